"""Lab 5: paged attention in plain torch, the engine's heart.

The student writes ``paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)``, with
the signature and meaning of ``minipaged.kernels.reference.paged_attention_reference`` (the specification every
backend's kernel is checked against). The checks compare it with the reference on cases that each isolate one
classic mistake (the causal mask of a chunk that starts mid-prompt, the last partial block, the GQA head
mapping), then at random mixed shapes, then run it as the torch backend's attention inside the engine on a tiny
model, whose greedy tokens must be transformers' own.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from minipaged.kernels.backends.torch_backend import TorchBackend
from minipaged.kernels.reference import paged_attention_reference

from .core import Lab, LabFailure, expect
from .harness import greedy_run, require

STUB = '''"""Lab 5: paged attention. Fill in the TODOs, then run `minipaged lab check 5`.

One call attends every request of a step: decodes (one query each) and prefill chunks (many) side by side.
    q            [num_tokens, num_heads, head_dim]   the step's queries, request after request
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same): the paged KV pool
    block_tables [num_reqs, max_blocks]  block ids of each request, in order (past its last block: padding)
    seq_lens     [num_reqs]  tokens of context of each request, its queries included
    query_start_loc [num_reqs + 1]  request i owns q rows query_start_loc[i] : query_start_loc[i + 1]
Request i's q_len queries are the *last* q_len of its seq_len tokens: query j sits at position
seq_len - q_len + j and may see keys 0 .. that position. Token t is in block block_tables[i, t // block_size],
at offset t % block_size. Returns [num_tokens, num_heads, head_dim], each row softmax(q k^T * scale) v.
"""
import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(len(seq_lens)):
        seq_len = int(seq_lens[i])
        qs, qe = int(query_start_loc[i]), int(query_start_loc[i + 1])
        q_len = qe - qs
        if q_len == 0:
            continue
        # TODO: this request's keys and values, [seq_len, num_kv_heads, head_dim] each, gathered from its blocks
        #       (its last block may be partly filled: what lies past seq_len is not its own).
        raise NotImplementedError("paged_attention: gather the keys and values")
        # TODO: grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
        #       Make keys and values [seq_len, num_heads, head_dim].
        raise NotImplementedError("paged_attention: map query heads to KV heads")
        # TODO: scores [num_heads, q_len, seq_len] (in float32), the causal mask, softmax over the keys, the
        #       weighted sum of the values; write the result into out[qs:qe] (in q's dtype).
        raise NotImplementedError("paged_attention: scores, mask, softmax")
    return out
'''


class Case:
    """One call's inputs: requests given as (seq_len, q_len), K/V of every slot random, the rest derived."""

    def __init__(self, requests: Sequence[tuple[int, int]], *, num_heads: int = 2, num_kv_heads: int = 2,
                 head_dim: int = 8, block_size: int = 4, seed: int = 0, poison_padding: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        blocks_each = [(seq_len + block_size - 1) // block_size for seq_len, _ in requests]
        num_blocks = sum(blocks_each) + 2
        ids = list(range(num_blocks))
        rng.shuffle(ids)                                   # a request's blocks are anywhere in the pool
        self.k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        self.v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        width = max(blocks_each)
        tables, taken = [], 0
        for n in blocks_each:
            table = ids[taken:taken + n]
            taken += n
            tables.append(table + [ids[-1]] * (width - n))      # padding: a block nobody owns
        if poison_padding:
            # Slots past each request's seq_len hold someone else's (or nobody's) K/V: make them loud, so that
            # reading them changes the answer a lot.
            for (seq_len, _), table in zip(requests, tables):
                last, used = table[(seq_len - 1) // block_size], (seq_len - 1) % block_size + 1
                self.k_cache[last, used:] = 30.0
                self.v_cache[last, used:] = 30.0
            self.k_cache[ids[-1]] = 30.0
            self.v_cache[ids[-1]] = 30.0
        self.block_tables = torch.tensor(tables, dtype=torch.int32)
        self.seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
        starts = [0]
        for _, q_len in requests:
            starts.append(starts[-1] + q_len)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
        self.scale = head_dim ** -0.5

    def args(self) -> tuple:
        return (self.q.clone(), self.k_cache.clone(), self.v_cache.clone(), self.block_tables.clone(),
                self.seq_lens.clone(), self.query_start_loc.clone(), self.scale)

    def run(self, fn: Any) -> torch.Tensor:
        got = fn(*self.args())
        expect(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(self.q.shape),
               f"paged_attention returned {type(got).__name__} of shape "
               f"{tuple(got.shape) if isinstance(got, torch.Tensor) else '?'}; it must return one row per query, "
               f"the shape of q: {tuple(self.q.shape)}.")
        return got.float()

    def reference(self) -> torch.Tensor:
        return paged_attention_reference(*self.args()).float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def one_decode(fn: Any) -> None:
    """one decode over full blocks (no GQA, no partial block, no chunk) equals the reference"""
    case = Case([(8, 1)])
    got = case.run(fn)
    expect(close(got, case.reference()),
           "one query over 8 keys in two full blocks already differs from the reference: check the gather "
           "(token t is in block block_tables[i, t // block_size] at offset t % block_size), the scale (scores "
           "times `scale`) and that softmax runs over the keys (the last dimension of [heads, q_len, seq_len]).")


def chunk_that_starts_mid_prompt(fn: Any) -> None:
    """a prefill chunk that starts mid-prompt: the query at position p sees keys 0..p"""
    case = Case([(12, 4)])                 # positions 8..11 are new, 0..7 are cached context
    got, want = case.run(fn), case.reference()
    if close(got, want):
        return
    expect(False, "a chunk of 4 queries at positions 8..11 of a 12-token prompt differs from the reference: the "
                  "causal mask of a chunk that starts mid-prompt is wrong. Query j of the chunk sits at position "
                  "seq_len - q_len + j, so the query at position p may see keys 0..p: the whole cached context "
                  "before the chunk, and the chunk up to itself. A mask built as if the chunk started at 0 "
                  "(query j sees keys 0..j) hides the context; no mask at all shows each query its future.")


def last_partial_block(fn: Any) -> None:
    """the last block, partly filled: no slot past seq_len is read"""
    case = Case([(6, 1), (9, 1)])          # 6 = 4 + 2 and 9 = 4 + 4 + 1: both end inside a block
    got, want = case.run(fn), case.reference()
    expect(close(got, want),
           "decodes over 6 and 9 tokens (their last block partly filled) differ from the reference: you read "
           "slots past seq_len. A request's last block holds only seq_len % block_size of its tokens; the rest "
           "of the block is empty or stale (here set to 30.0, loud on purpose). Gather whole blocks, then keep "
           "only the first seq_len tokens.")


def gqa_head_mapping(fn: Any) -> None:
    """grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads)"""
    case = Case([(8, 1), (4, 1)], num_heads=4, num_kv_heads=2)
    got, want = case.run(fn), case.reference()
    expect(close(got, want),
           "with 4 query heads over 2 KV heads, decodes over full blocks differ from the reference: the GQA head "
           "mapping is wrong. Query head h uses KV head h // (num_heads // num_kv_heads): heads 0 and 1 share KV "
           "head 0, heads 2 and 3 share KV head 1 (repeat_interleave on the head dimension, not repeat, which "
           "gives h % num_kv_heads).")


def random_mixed_steps(fn: Any) -> None:
    """random mixed steps (decodes, whole prompts, chunks mid-prompt, GQA, partial blocks) equal the reference"""
    rng = random.Random(5)
    for trial in range(20):
        heads_kv = rng.choice([(2, 2), (4, 2), (4, 1), (6, 2)])
        block_size = rng.choice([1, 2, 4, 16])
        requests = []
        for _ in range(rng.randint(1, 5)):
            seq_len = rng.randint(1, 40)
            q_len = rng.choice([1, seq_len, rng.randint(1, seq_len)])    # decode, whole prompt, any chunk
            requests.append((seq_len, q_len))
        case = Case(requests, num_heads=heads_kv[0], num_kv_heads=heads_kv[1], head_dim=rng.choice([4, 8, 16]),
                    block_size=block_size, seed=trial)
        got, want = case.run(fn), case.reference()
        if not close(got, want):
            worst = int((got - want).abs().amax(dim=(1, 2)).argmax())
            raise LabFailure(f"trial {trial}: requests (seq_len, q_len) {requests}, {heads_kv[0]} query heads over "
                             f"{heads_kv[1]} KV heads, blocks of {block_size}: query row {worst} differs from the "
                             f"reference by {float((got - want).abs().max()):.3g}. The three checks above isolate "
                             f"the usual causes; if they pass, look at how rows are matched with requests "
                             f"(query_start_loc) and blocks of size 1.")


class LabAttentionBackend(TorchBackend):
    """The torch backend with the student's attention in place of ``paged_attention_torch``: the seam every
    attention kernel of the engine plugs into (``Backend.attention``, called by each layer)."""

    def __init__(self, fn: Any) -> None:
        super().__init__(note="lab 5: your paged_attention")
        self.fn = fn

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, plan: Any) -> torch.Tensor:
        return self.fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def install(engine: Any, fn: Any) -> None:
    """Every layer's attention, from now on, is the student's (the engine runs on the torch backend)."""
    backend = LabAttentionBackend(fn)
    engine.backend = backend
    engine.runner.backend = backend


def greedy_like_transformers(fn: Any) -> None:
    """inside the engine (torch backend, chunked prompts mixed with decodes): greedy tokens equal transformers'"""
    require(fn, random_mixed_steps)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 23, 11, 30)]
    # a budget of 16 tokens: the longer prompts are chunked, and their chunks share steps with the others' decodes
    engine, tokens, _ = greedy_run(lambda e: install(e, fn), prompts, 8, attention_backend="torch", num_blocks=64,
                                   max_num_batched_tokens=16, long_prefill_token_threshold=0)
    hf = engine.loaded.hf_model
    for prompt, got in zip(prompts, tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(got)])).logits[0]
        want = logits[len(prompt) - 1:len(prompt) - 1 + len(got)].argmax(-1).tolist()
        expect(list(got) == want,
               f"inside the engine, a {len(prompt)}-token prompt generated {list(got)}, transformers says {want} on "
               f"the same weights. The checks alone passed, so look at what only the engine gives you: a q, "
               f"k_cache and v_cache in the model's dtype, block tables padded with block 0, and steps where one "
               f"request's chunk and others' decodes share the call.")


def reference() -> Any:
    return paged_attention_reference


LAB = Lab(5, "lab5_paged_attention", "Paged attention over block tables", "paged_attention", STUB, reference,
          (one_decode, chunk_that_starts_mid_prompt, last_partial_block, gqa_head_mapping, random_mixed_steps,
           greedy_like_transformers),
          reference_options={"attention_backend": "torch"},
          install=install)
