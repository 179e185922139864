"""The design card's `minipaged watch --model tinyllama` on a CPU laptop, fp32 against --quantization int8: start-up
time, memory and one request's decode tokens/s on a TinyLlama-1.1B-shaped checkpoint with random weights
(saved locally once: the real one cannot be downloaded here; speed and memory depend on the shapes, not on the
values). Each precision runs in its own process, so each peak memory is its own. Writes
bench/out/quantization_tinyllama.json (docs/quantization.md shows it).

    python bench/quantization_tinyllama.py [--folder DIR] [--decode-tokens 16] [--threads 1]
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minipaged.bench.report import save
from minipaged.bench.report import markdown_table as table
from minipaged.model.testing import TINYLLAMA_SHAPE


def build_checkpoint(folder: Path) -> Path:
    """A TinyLlama-shaped LlamaForCausalLM with random weights and a byte tokenizer, saved once (fp32)."""
    from minipaged.model.testing import build_tinyllama_shaped
    return build_tinyllama_shaped(folder)


def measure_one(folder: str, quantization: str, tokens: int, threads: int) -> dict:
    """In this process: start the engine, decode one request alone; report time, memory, speed."""
    from minipaged import Engine, SamplingParams
    from minipaged.memory import resident_mib, return_freed_memory_to_the_os
    start = time.perf_counter()
    engine = Engine(folder, num_threads=threads, kv_cache_memory=0.25, max_model_len=512,
                    quantization=None if quantization == "fp32" else quantization)
    startup_s = time.perf_counter() - start
    events = []
    engine.subscribe(events.append)
    engine.generate([list(range(3, 35))], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                    use_tqdm=False)
    decodes = [e for e in events if e.scheduled and all(s.kind == "decode" for s in e.scheduled)]
    gc.collect()
    return_freed_memory_to_the_os()
    return {"startup_s": startup_s, "weights_mib": engine.model.weight_bytes() / 2**20,
            "resident_after_start_mib": resident_mib(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "decode_tok_s": len(decodes) / sum(e.duration_s for e in decodes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "minipaged-tinyllama-shaped"))
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", choices=("fp32", "int8"), help=argparse.SUPPRESS)   # the child process's job
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.folder, args.one, args.decode_tokens, args.threads)))
        return
    import torch
    torch.set_num_threads(args.threads)          # the recorded machine line names the children's thread count
    folder = build_checkpoint(Path(args.folder))
    results = {}
    for precision in ("fp32", "int8"):
        done = subprocess.run([sys.executable, __file__, "--folder", str(folder), "--one", precision,
                               "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        results[precision] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [[name, r["startup_s"], r["weights_mib"], r["resident_after_start_mib"], r["peak_rss_mib"], r["decode_tok_s"]]
            for name, r in results.items()]
    save("quantization_tinyllama", {"args": {k: v for k, v in vars(args).items() if k != "one"},
                                    "shape": TINYLLAMA_SHAPE, "results": results},
         table(["precision", "start-up (s)", "weights (MiB)", "resident after start-up and decoding (MiB)",
                "peak memory (MiB)", "decode tok/s"], rows))


if __name__ == "__main__":
    main()
