"""bench/gpu_step.py, the unattended GPU measurement behind `make gpu-check`, kept from rotting on a machine without
a GPU: its plan (--dry-run), its refusals, and its stages' wiring on the tiny model on the CPU (times mean nothing
there; what is checked is that each stage runs and records what it should)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_step.py"


def gpu_step(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_plans_every_stage_under_the_budget(tmp_path):
    done = gpu_step("--dry-run", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "gpu_step-dry_run.json").read_text())
    names = [s["name"] for s in plan["stages"]]
    assert names[:2] == ["checkpoint", "engine"] and {"step_profile", "alone", "throughput", "hf_generate",
                                                      "hf_generate_batch", "serve", "async"} <= set(names)
    assert plan["budget_s"] <= 300 and plan["engine_options"]["cuda_graphs"] is True
    assert plan["engine_options"]["dtype"] == "bfloat16" and plan["engine_options"]["max_num_seqs"] >= 256


def test_bad_arguments_and_a_missing_gpu_are_said_plainly(tmp_path):
    bad = gpu_step("--input-len", "512-128", "--dry-run")
    assert bad.returncode == 2 and "--input-len must be LO-HI tokens" in bad.stderr
    cpu = gpu_step("--device", "cpu")
    assert cpu.returncode == 2 and "give --smoke-model" in cpu.stderr
    if not torch.cuda.is_available():
        none = gpu_step("--out-dir", str(tmp_path))
        assert none.returncode == 1 and "no CUDA device here" in none.stderr
        assert not list(tmp_path.iterdir())                 # nothing half-written


def test_stages_run_and_record_on_the_tiny_model_on_a_cpu(tiny_model, tmp_path):
    done = gpu_step("--smoke-model", tiny_model, "--device", "cpu", "--batches", "1", "3", "--profile-steps", "2",
                    "--num-requests", "5", "--input-len", "6-12", "--output-len", "4", "--alone-tokens", "4",
                    "--hf-batch-size", "2", "--out-dir", str(tmp_path),
                    "--stages", "engine", "graphs_exact", "step_profile", "alone", "throughput", "hf_generate")
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "gpu_step-cpu_smoke.json").read_text())
    stages = record["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {name: "ok" for name in (
        "engine", "graphs_exact", "step_profile", "alone", "throughput", "hf_generate")}
    assert set(stages["step_profile"]["graphs_off"]) == {"1", "3"}
    assert stages["step_profile"]["graphs_off"]["3"]["wall_ms"] > 0
    # the steps' own events: host and forward times everywhere, the device's only where there is one (CUDA)
    profile = stages["step_profile"]["graphs_off"]["3"]
    assert profile["event_host_ms"] > 0 and profile["event_forward_ms"] > 0
    assert profile["event_device_ms"] is None and profile["event_device_busy"] is None
    assert stages["throughput"]["graphs_off"]["output_tokens"] == 5 * 4
    assert stages["hf_generate"]["output_tokens"] == 5 * 4 and stages["hf_generate"]["minipaged_x"] > 0
    assert stages["alone"]["graphs_off"]["ms_per_token"] > 0
    assert "| step_profile | ok |" in (tmp_path / "gpu_step-cpu_smoke.md").read_text()
