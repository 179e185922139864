"""The light install: Triton is the ``[gpu]`` extra, and everything a CPU laptop runs works without it."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter where ``import triton`` fails, as on a machine that never installed it.
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None            # a None entry makes every import of triton raise ImportError
from minipaged import Engine, SamplingParams
from minipaged.kernels import triton_available
assert not triton_available()
engine = Engine(sys.argv[1], block_size=4, num_blocks=64, num_threads=1)
assert engine.backend.name in ("cpu", "torch")  # the compiled CPU kernel where a C compiler builds it
out = engine.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
assert len(out[0].token_ids) == 5
try:
    Engine(sys.argv[1], block_size=4, num_blocks=64, num_threads=1, attention_backend="triton")
except ValueError as exc:
    assert "pip install 'minipaged[gpu]'" in str(exc), exc
else:
    raise AssertionError("asking for triton without it did not say how to get it")
print("ok without triton")
"""


def test_triton_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert any(dep.startswith("triton") for dep in project["optional-dependencies"]["gpu"])


def test_the_engine_runs_without_triton(tiny_model):
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, tiny_model], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok without triton" in done.stdout


# Thin clients (``watch --attach``, ``export-html``, a trace read in a notebook) take the event schema, the trace
# reader and writer and the fold of events into a view, and nothing that computes: each of these modules must
# import in an interpreter where torch and transformers cannot be imported at all.
THIN_MODULES = ("minipaged.events", "minipaged.trace", "minipaged.event_view", "minipaged.notebook.feed",
                "minipaged.notebook.widget")
WITHOUT_TORCH = """
import importlib, sys
for heavy in ("torch", "transformers", "triton"):
    sys.modules[heavy] = None           # every import of them raises ImportError
importlib.import_module(sys.argv[1])
print("ok without torch")
"""


@pytest.mark.parametrize("module", THIN_MODULES)
def test_the_event_modules_import_without_torch_or_transformers(module):
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, module], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok without torch" in done.stdout
