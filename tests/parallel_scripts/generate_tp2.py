"""Run under torchrun (or as a plain script) by tests/test_parallel.py: greedy tokens for fixed prompts, as JSON.

Every rank runs this same file, as on two machines: rank 0's Engine is the engine, and on every other rank
constructing the Engine turns the process into a worker that serves rank 0 until it closes.
"""
import json
import sys

from minipaged import Engine, SamplingParams

if __name__ == "__main__":
    model, tp, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    with Engine(model, block_size=4, num_blocks=64, num_threads=1, tensor_parallel_size=tp,
                distributed_timeout=60) as engine:
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        print("RESULT " + json.dumps({"tokens": [o.token_ids for o in outs], "parallel": engine.info.parallel}))
