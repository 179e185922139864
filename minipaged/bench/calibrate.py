"""``minipaged bench calibrate``: measure the cpu backend's choices again, here and now, and cache them.

The cpu backend measures which compiled ops beat torch (and whether a decode step runs as one compiled call)
once per machine and model shape, and caches the verdict (kernels/backends/calibration.py). A verdict taken
while the machine was busy may be wrong and would be kept; this command measures again on a quiet machine,
overwrites the cached verdict (unless its races disagreed between repeats: then it says so and caches nothing),
and prints the verdicts with the medians they came from.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..options import MODEL_HELP
from .requests import BenchError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help=MODEL_HELP)
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="torch's CPU threads, as the engine's --num-threads (a verdict is kept per thread count)")


def model_shapes(model: str) -> Any:
    """The shapes the engine would calibrate for (``CompactLlama.shapes``), from the model's config alone."""
    from transformers import AutoConfig

    from ..kernels import ModelShapes
    from ..model.loader import resolve_model_path
    path, _converted = resolve_model_path(model)
    cfg = AutoConfig.from_pretrained(path)
    heads = cfg.num_attention_heads
    return ModelShapes(hidden_size=cfg.hidden_size, num_heads=heads,
                       num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                       head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                       intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)


def run(args: argparse.Namespace) -> int:
    from ..config import EngineConfig
    from ..kernels.backends import cpu_backend_for
    from ..kernels.backends.calibration import MEASURE
    from ..kernels.build import cpu_kernel_problem
    from ..memory import apply_num_threads
    try:
        shapes = model_shapes(args.model)
    except Exception as exc:           # (a missing model, a config that is not a Llama's)
        raise BenchError(f"cannot read {args.model}'s shapes: {exc}") from None
    if problem := cpu_kernel_problem(shapes.head_dim):
        raise BenchError(f"the compiled CPU kernels are unavailable here: {problem}")
    threads = apply_num_threads(EngineConfig(model=args.model, num_threads=args.num_threads))
    measured: dict[str, Any] = {}
    backend = cpu_backend_for(shapes, cpu_ops=MEASURE, remeasure=True, record=measured)
    print(f"{args.model}, {threads} thread(s): {backend.describe()}")
    for op, verdict in vars(backend.choice).items():
        print(f"  {op:20} {verdict}")
    print("medians:")
    for op, medians in measured.get("median_ms", {}).items():
        print(f"  {op:20} " + ", ".join(f"{option} {ms:.3f} ms" for option, ms in medians.items()))
    return 0
