"""What every lab shares: load the student's file, run the lab's checks on what it defines, report.

A lab is a module with a ``LAB`` (a ``Lab``): the name the student's file must define, the stub text, the
engine's own implementation (the reference) and the checks. A check is a function that takes the student's
object and raises ``LabFailure`` with a message that explains the mistake, not only that there is one.
Checks run in order and each on its own, so one mistake does not hide the next.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from minipaged.policies.loading import import_file


class LabFailure(AssertionError):
    """A check found a mistake; the message teaches what is wrong and how to fix it."""


Check = Callable[[Any], None]


@dataclass(frozen=True)
class Lab:
    number: int
    slug: str                          # the file names: lab1_lru_queue.py and lab1_lru_queue.md
    title: str
    target: str                        # what the student's file defines: a class or function name
    stub: str                          # the file ``start`` writes, TODOs in it
    reference: Callable[[], Any]       # the engine's own implementation of ``target``
    checks: tuple[Check, ...]
    # watch --lab: engine options that run the student's code (a path gives the file), and options for both runs
    watch_options: Optional[Callable[[str], dict]] = None
    reference_options: dict = field(default_factory=dict)
    install: Optional[Callable[[Any, Any], None]] = None   # (engine, student's object): hook it into the engine
    adapt_workload: Optional[Callable[[Any], Any]] = None  # a Workload -> the one this lab shows best

    @property
    def file_name(self) -> str:
        return f"{self.slug}.py"

    @property
    def guide_name(self) -> str:
        return f"{self.slug}.md"

    def guide(self) -> str:
        return (Path(__file__).parent / self.guide_name).read_text()


@dataclass(frozen=True)
class CheckResult:
    title: str
    passed: bool
    message: str = ""


def check_title(check: Check) -> str:
    return (check.__doc__ or check.__name__).strip().splitlines()[0]


def load_target(path: Path, name: str) -> Any:
    """``name`` from the student's file; a missing file or name, or an import error, is a LabFailure."""
    if not path.is_file():
        raise LabFailure(f"no file {path}: run `minipaged lab start` for the stub, or give the path of your file.")
    try:
        module = import_file(path, f"minipaged_lab_{path.stem}")
    except Exception as e:
        raise LabFailure(f"importing {path} raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=-1)}") from e
    if not hasattr(module, name):
        raise LabFailure(f"{path} does not define {name}: keep the name the stub gave it.")
    return getattr(module, name)


def run_checks(lab: Lab, target: Any) -> list[CheckResult]:
    results = []
    for check in lab.checks:
        try:
            check(target)
        except LabFailure as e:
            results.append(CheckResult(check_title(check), False, str(e)))
        except NotImplementedError as e:
            results.append(CheckResult(check_title(check), False,
                                       f"not written yet (NotImplementedError{': ' + str(e) if str(e) else ''}): "
                                       f"fill in the TODOs of the stub."))
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            results.append(CheckResult(check_title(check), False,
                                       f"your code raised {type(e).__name__}: {e} (at {Path(where.filename).name} "
                                       f"line {where.lineno}: {where.line})"))
        else:
            results.append(CheckResult(check_title(check), True))
    return results


def check_file(lab: Lab, path: Path) -> list[CheckResult]:
    try:
        target = load_target(path, lab.target)
    except LabFailure as e:
        return [CheckResult(f"load {lab.target} from {path}", False, str(e))]
    return run_checks(lab, target)


def expect(condition: bool, message: str) -> None:
    """A check's assertion: raise LabFailure(message) unless ``condition``."""
    if not condition:
        raise LabFailure(message)
