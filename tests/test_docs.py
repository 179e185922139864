"""The README is a short guide, its links and the docs' links lead somewhere, and docs/performance.md's
figures all come from the benchmarks' JSON.

Nothing is measured or imported heavily here: these tests take well under a second.
"""
from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path

import pytest

from minipaged.bench.docs import (BENCH_OUT, PEER_TEMPLATE, PERFORMANCE_DOC, PERFORMANCE_TEMPLATE, bench_results,
                                  load_values, performance_values, render, rendered_performance_doc)
from minipaged.placeholders import PLACEHOLDER, hand_written_numbers

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def without_code(text: str) -> str:
    """The text without fenced code, inline code and HTML comments (links there are not links)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        base, n = slug(heading), 0
        while (candidate := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(candidate)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):                       # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_the_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    text = README.read_text(encoding="utf-8")
    assert "make watch" in text and "make test" in text           # the two set-up commands
    assert re.search(r"!\[[^\]]*\]\([^)]+\.png\)", text)          # a picture
    for guide in ("architecture", "performance", "serving", "workshop", "parallel"):
        assert f"(docs/{guide}.md)" in text, f"README does not link docs/{guide}.md"


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A `code` heading, with: punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-with-punctuation) [ok](#here) [web](https://example.org/x)\n"
                    "## Here\n[gone](missing.md) [bad](other.md#nowhere) `[in code](nope.md)`\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nowhere (no heading with that anchor)"]


# --------------------------------------------------------------------------- docs/performance.md's figures

def test_performance_md_is_its_template_filled_from_the_json():
    assert PERFORMANCE_DOC.read_text(encoding="utf-8") == rendered_performance_doc(bench_results(), load_values()), (
        "docs/performance.md is not docs/performance.md.in filled from bench/out/*.json: run "
        "python bench/render_docs.py (after editing the template or running a benchmark)")


# Numbers that may stand in a template without being measured: an HTTP status code, names (SmolLM2, fp32,
# p99), and the verification step's size in a formula.
ALLOWED = [r"HTTP \d{3}", r"SmolLM2", r"\bfp32\b", r"\bp\d\d\b", r"\bk \+ 1\b"]


@pytest.mark.parametrize("template", [PERFORMANCE_TEMPLATE, PEER_TEMPLATE], ids=lambda t: t.name)
def test_no_figure_in_the_templates_is_typed_by_hand(template):
    leftovers = hand_written_numbers(template.read_text(encoding="utf-8"), ALLOWED)
    assert not leftovers, (f"{template.name} states numbers that no JSON holds; make each a placeholder "
                           f"({{{{name.key:spec}}}}) or drop it: {leftovers}")


def test_the_digit_check_sees_a_typed_number():
    assert hand_written_numbers("ratio **2.56x** here\n`--budget 256` {{a.b:.2f}} [x](f1.md)\n") == [
        "ratio **2.56x** here"]


def test_every_benchmark_result_appears_in_performance_md():
    template = PERFORMANCE_TEMPLATE.read_text(encoding="utf-8")
    used = {key.split(".")[0] for key in (m.group(1) for m in PLACEHOLDER.finditer(template))}
    used |= {key.split(".")[1] for key in (m.group(1) for m in PLACEHOLDER.finditer(template))
             if key.startswith("tables.")}
    missing = [path.stem for path in sorted(BENCH_OUT.glob("*.json")) if path.stem not in used]
    assert not missing, f"bench/out/{missing}.json is not shown in docs/performance.md.in"


NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def figures(page: str) -> list[str]:
    """The numbers a reader sees in the rendered page (outside code, comments and link targets), up to the
    peer section (which comes from docs/tuning.json; test_tuning_doc.py checks it)."""
    text = re.sub(r"```.*?```", "", page, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return NUMBER.findall(text[:text.find("## Peer comparison")])


def numbers_written_in(node) -> set[str]:
    """The numbers inside the JSON's strings and keys ("tp=2 pp=1", a batch size, the machine, the date)."""
    if isinstance(node, dict):
        return set().union(*(set(NUMBER.findall(str(k))) | numbers_written_in(v) for k, v in node.items()))
    if isinstance(node, list):
        return set().union(*(numbers_written_in(v) for v in node))
    return set(NUMBER.findall(node)) if isinstance(node, str) else set()


def nudged(node, factors=None):
    """Every measured number changed a little, each by its own factor so that ratios of two values move too
    (bools, strings and keys kept)."""
    factors = itertools.count(11) if factors is None else factors
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return node
    if isinstance(node, int):
        return round(node * (1.05 + next(factors) * 37 % 89 / 100)) + 1
    if isinstance(node, float):       # away from zero, both ways (+0.01 could bring a negative value back)
        return node * (1.05 + next(factors) * 37 % 89 / 100) + (0.01 if node >= 0 else -0.01)
    if isinstance(node, dict):
        return {k: nudged(v, factors) for k, v in node.items()}
    return [nudged(v, factors) for v in node]


def test_every_figure_in_the_rendered_page_moves_with_the_json():
    """Nudge every measured value and render again: each figure must change with it. What may stay put: the
    numbers the JSON writes in its strings and keys, the chunked-prefill budgets and long-prefill thresholds
    (rows are found by them),
    and the engine's defaults. A number the template or the renderer typed itself would stay put and fail."""
    results, values = bench_results(), load_values()
    moved = nudged(copy.deepcopy(results))
    factors = itertools.count(500)
    moved["chunked_prefill"]["results"] = [{**nudged(x, factors), "budget": x["budget"]}
                                           for x in results["chunked_prefill"]["results"]]
    moved["long_prefill"]["results"] = [{**nudged(x, factors),
                                         "long_prefill_token_threshold": x["long_prefill_token_threshold"]}
                                        for x in results["long_prefill"]["results"]]
    before = figures(rendered_performance_doc(results, values))
    after = figures(rendered_performance_doc(moved, values))
    assert len(before) == len(after) and len(before) > 100
    fixed = numbers_written_in(results) | {str(x["budget"]) for x in results["chunked_prefill"]["results"]}
    fixed |= {str(x["long_prefill_token_threshold"]) for x in results["long_prefill"]["results"]}
    fixed |= {str(v) for v in performance_values(results, values)["config"].values()}
    unmoved = sorted({a for a, b in zip(before, after) if a == b and a not in fixed})
    assert not unmoved, f"numbers in docs/performance.md that do not come from the JSON: {unmoved}"


def test_a_missing_value_is_refused_with_the_fix():
    with pytest.raises(KeyError, match="throughput.nope"):
        render("{{throughput.nope:.1f}}", {"throughput": {"seconds": 1.0}})
    assert json.loads((BENCH_OUT / "throughput.json").read_text())["minipaged"]["seconds"] > 0


def test_make_says_what_it_installs_before_each_install():
    """A first `make` runs for minutes: every pip step is announced (what, and roughly how big), not silent."""
    import subprocess
    steps = subprocess.run(["make", "-n", "-B", "/nonexistent-venv/.gpu-extra", "VENV=/nonexistent-venv"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    installs = [i for i, line in enumerate(steps) if "pip install" in line]
    assert len(installs) >= 3
    for before, i in zip([-1, *installs], installs):
        assert any(line.startswith('echo "make: ') for line in steps[before + 1:i]), f"nothing said before {steps[i]}"
    assert "several minutes" in " ".join(steps)
