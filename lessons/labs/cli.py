"""``minipaged lab list | start N | check N [FILE]``: the labs from the command line."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import all_labs, check_file, find_lab


def add_lab_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", required=True)
    sub.add_parser("list", help="the labs")
    start = sub.add_parser("start", help="write lab N's stub and guide into a folder")
    start.add_argument("number", type=int)
    start.add_argument("--dir", default=".", help="where to write them")
    start.add_argument("--force", action="store_true", help="overwrite files already there")
    check = sub.add_parser("check", help="run lab N's checks on your file")
    check.add_argument("number", type=int)
    check.add_argument("file", nargs="?", help="your file (default: the stub's name in the working folder)")


def cmd_lab(args: argparse.Namespace) -> int:
    try:
        if args.lab_command == "list":
            for lab in all_labs():
                print(f"{lab.number}  {lab.title:<48} you write {lab.target} in {lab.file_name}")
            return 0
        lab = find_lab(args.number)
    except ValueError as e:
        print(f"minipaged lab: {e}")
        return 2
    if args.lab_command == "start":
        folder = Path(args.dir)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in ((lab.file_name, lab.stub), (lab.guide_name, lab.guide())):
            path = folder / name
            if path.exists() and not args.force:
                print(f"{path} is there already (your work?); keeping it. --force overwrites it.")
                continue
            path.write_text(text)
            written.append(str(path))
        if written:
            print(f"Lab {lab.number}: {lab.title}. Wrote {' and '.join(written)}.\n"
                  f"Read the guide, fill in the TODOs, then: minipaged lab check {lab.number}")
        return 0
    path = Path(args.file) if args.file else Path(lab.file_name)
    results = check_file(lab, path)
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.title}")
        if not result.passed:
            print("      " + result.message.replace("\n", "\n      "))
    passed = sum(r.passed for r in results)
    print(f"\n{passed} of {len(results)} checks pass."
          + (f" Now watch it run: minipaged watch --lab {lab.number}" if passed == len(results) else ""))
    return 0 if passed == len(results) else 1
