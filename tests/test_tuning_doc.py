"""docs/tuning.md and docs/performance.md's peer section are their templates filled from docs/tuning.json, exactly.

Editing a template without re-rendering, or the JSON without the text, fails here; so does a placeholder the
measuring script (bench/tuning.py) does not produce. Nothing is measured: these tests take milliseconds.
"""
from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest

from minipaged.bench.docs import (DOCS, PEER_TEMPLATE, PERFORMANCE_DOC, ROOT, TUNING_DOC, TUNING_TEMPLATE,
                                  load_values, peer_section, render, rendered_tuning_doc, with_peer_section)
from minipaged.placeholders import placeholders

TEMPLATES = (TUNING_TEMPLATE, PEER_TEMPLATE)


@pytest.fixture(scope="module")
def values() -> dict:
    return load_values()


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_every_placeholder_has_a_measured_value(template, values):
    keys = placeholders(template.read_text(encoding="utf-8"))
    assert len(keys) > 10                                   # the text's numbers are placeholders, not typed in
    missing = [key for key in keys if key not in values]
    assert not missing, f"{template.name} uses {missing}, which docs/tuning.json lacks: run python bench/tuning.py"


def test_docs_tuning_md_is_its_template_filled_with_the_json(values):
    assert TUNING_DOC.read_text(encoding="utf-8") == rendered_tuning_doc(values), (
        "docs/tuning.md is not docs/tuning.md.in filled from docs/tuning.json: run python bench/render_docs.py "
        "(after editing the template) or python bench/tuning.py (to measure again)")


def test_the_performance_docs_peer_section_is_its_template_filled_with_the_json(values):
    performance = PERFORMANCE_DOC.read_text(encoding="utf-8")
    assert peer_section(values) in performance, ("docs/performance.md's peer section is not docs/peer.md.in "
                                                 "filled from docs/tuning.json: run python bench/render_docs.py")
    assert with_peer_section(performance, values) == performance


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_every_picture_the_docs_show_exists():
    names = {name for template in TEMPLATES
             for name in re.findall(r"!\[[^]]*\]\((?:docs/)?([\w.-]+\.png)\)", template.read_text(encoding="utf-8"))}
    assert {"tuning-baseline.png", "tuning-concurrency.png", "tuning-budget.png", "tuning-prefix.png",
            "tuning-spec.png", "peer.png"} <= names
    for name in names:
        width, height = png_size(DOCS / name)
        assert (width, height) in ((1000, 400), (1500, 400)), f"{name} is {width}x{height}"


def test_render_fills_with_a_format_and_names_a_missing_key():
    assert render("a {{x:.1f}} b {{ y }} c {{x:.0%}}", {"x": 0.345, "y": "z"}) == "a 0.3 b z c 34%"
    with pytest.raises(KeyError, match="nope"):
        render("text {{nope}}", {"x": 1})


def test_a_doc_without_the_markers_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="markers"):
        with_peer_section("# a doc\n", {})


def test_change_puts_a_ratio_in_words_so_the_text_follows_the_numbers():
    from minipaged.bench.walkthrough import change
    assert change(2.0, 1.0) == "2.00x higher"
    assert change(1.0, 4.0) == "4.00x lower"
    assert change(1.02, 1.0) == "about the same"
    assert change(0.0, 1.0) == "not comparable (a zero)"


def test_one_step_runs_end_to_end_on_a_tiny_model_and_leaves_the_docs_alone(tiny_model, tmp_path):
    """bench/tuning.py --only prefix: two real servers, the JSON and the picture; outside docs/ it renders nothing."""
    import json
    import os
    import subprocess
    script = ROOT / "bench" / "tuning.py"
    before = TUNING_DOC.read_bytes() if TUNING_DOC.exists() else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), "--model", tiny_model, "--quick", "--threads", "1",
                           "--out", str(tmp_path), "--only", "prefix", "--conditions", "a test"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "tuning.json").read_text())
    off, on = result["runs"]["prefix"]["prefix caching off"], result["runs"]["prefix"]["prefix caching on"]
    assert off["prefix_hits"] == 0 and on["prefix_hits"] > 0          # the server's own counters, read around the run
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert off["input_tokens"] == on["input_tokens"] and off["output_tokens"] == on["output_tokens"]
    assert result["values"]["conditions"] == "a test" and 0 < result["values"]["prefix_hit_rate"] < 1
    assert png_size(tmp_path / "tuning-prefix.png") == (1500, 400)
    assert (TUNING_DOC.read_bytes() if TUNING_DOC.exists() else None) == before
