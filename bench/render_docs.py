"""Render docs/tuning.md and docs/performance.md from their templates and the benchmarks' JSON, and
docs/architecture.md's reading order from the source (minipaged/bench/anatomy.py).

    python bench/render_docs.py

Every benchmark script writes its result to bench/out/NAME.json (``bench/tuning.py``: docs/tuning.json, and it
renders the docs itself); run this after a benchmark or after editing a template (docs/*.md.in).
The machinery is ``minipaged.bench.docs``.
"""
from __future__ import annotations

import argparse

from minipaged.bench.anatomy import ROOT, with_reading_order
from minipaged.bench.docs import write_all

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    write_all()
    architecture = ROOT / "docs" / "architecture.md"
    architecture.write_text(with_reading_order(architecture.read_text(encoding="utf-8")), encoding="utf-8")
