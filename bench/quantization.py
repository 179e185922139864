"""Weight-only int8 against fp32 on the embedded SmolLM2, in one run: weights MiB, greedy-token agreement over
held-out chat prompts, the perplexity of a fixed text, and decode tokens/s of one request alone (the two
engines timed in alternation, so a busy machine slows both alike). Writes bench/out/quantization.json, which
docs/quantization.md is rendered from.

    python bench/quantization.py [--model smollm2] [--prompts 8] [--max-tokens 48] [--decode-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from minipaged import Engine, SamplingParams
from minipaged.bench.quality import greedy_agreement, perplexity
from minipaged.bench.report import save
from minipaged.bench.report import markdown_table as table
from minipaged.model import load_model
from minipaged.model.int8_reference import dequantized_hf_model
from minipaged.workloads import OPEN_ENDED, PASSAGES


def decode_tokens_per_s(engine: Engine, prompt: list[int], tokens: int) -> float:
    """One request alone: tokens per second of its decode steps (the engine's own step durations)."""
    events = []
    unsubscribe = engine.subscribe(events.append)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    unsubscribe()
    decodes = [e for e in events if e.scheduled and all(s.kind == "decode" for s in e.scheduled)]
    return len(decodes) / sum(e.duration_s for e in decodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=8, help="held-out chat prompts for greedy agreement")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt compared")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per timing run")
    parser.add_argument("--rounds", type=int, default=3, help="timing runs of each engine, alternated")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    options = dict(num_threads=args.threads, kv_cache_memory=0.25, max_model_len=1024)
    fp32 = Engine(args.model, **options)
    int8 = Engine(args.model, quantization="int8", **options)
    hf = fp32.loaded.hf_model
    reference_int8 = dequantized_hf_model(hf, int8.model)

    chat = fp32.inputs.chat_prompt
    prompts = [chat([{"role": "user", "content": p}]) for p in OPEN_ENDED[-args.prompts:]]
    agreement = greedy_agreement(fp32, int8, reference_int8, prompts, args.max_tokens)

    text = fp32.tokenizer(" ".join(PASSAGES))["input_ids"]
    ppl_fp32, ppl_int8 = perplexity(hf, text), perplexity(reference_int8, text)

    timing_prompt = prompts[0]
    speeds: dict[str, list[float]] = {"fp32": [], "int8": []}
    for engine in (fp32, int8):                             # warm-up: kernels built, caches touched
        decode_tokens_per_s(engine, timing_prompt, 4)
    for _ in range(args.rounds):
        for name, engine in (("fp32", fp32), ("int8", int8)):
            speeds[name].append(decode_tokens_per_s(engine, timing_prompt, args.decode_tokens))
    median = {name: statistics.median(values) for name, values in speeds.items()}

    record = {
        "args": vars(args),
        "backend": fp32.info.attention_backend,
        "weights_mib": {"fp32": fp32.model.weight_bytes() / 2**20, "int8": int8.model.weight_bytes() / 2**20},
        "agreement": agreement.as_dict(),
        "perplexity": {"text_tokens": len(text), "fp32": ppl_fp32, "int8": ppl_int8,
                       "relative_change": ppl_int8 / ppl_fp32 - 1},
        "decode_tok_s_batch1": {"fp32": median["fp32"], "int8": median["int8"], "runs": speeds,
                                "speedup": median["int8"] / median["fp32"]},
    }
    rows = [["weights (MiB)", record["weights_mib"]["fp32"], record["weights_mib"]["int8"]],
            ["decode tok/s, one request", median["fp32"], median["int8"]],
            [f"perplexity ({len(text)} tokens)", ppl_fp32, ppl_int8]]
    markdown = (table(["", "fp32", "int8"], rows)
                + f"\n\nGreedy agreement over {agreement.prompts} chat prompts x {args.max_tokens} tokens: "
                  f"{agreement.identical_outputs} identical outputs, prefix {agreement.prefix_agreement:.3f}, "
                  f"teacher-forced {agreement.teacher_forced:.3f}\n")
    save("quantization", record, markdown)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
