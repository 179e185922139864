"""Drafting with a smaller model: it runs k times, one token each, and the target checks all k at once.

The draft model keeps its own paged KV cache (its own tensors, its own layer count and head shapes) but
uses the **same block tables** as the target: block b holds the target's KV in the target's tensors and
the draft's KV in the draft's tensors. One block manager therefore serves both, and preemption, swapping
and freeing need no second set of books. The scheduler gives each request k "lookahead" slots beyond its
scheduled tokens so the draft can write the KV of its own guesses (vLLM: ``num_lookahead_tokens``).

Each proposal is one catch-up pass over the request's tokens that the draft has not seen yet (the whole
prompt the first time; afterwards the target's own token, and the last draft when every draft was accepted),
which also guesses d_0, then k - 1 single-token passes for d_1 .. d_{k-1}. All requests go through each pass
together, as one batch. The drafts it fed itself (d_0 .. d_{k-2}) left their KV in its cache: those the target
accepted are the request's tokens at those positions, so the next catch-up starts after them (a token that
differs, and everything after it, is fed again). That keeps each pass one or two rows: with the four rows of a
full catch-up, a pass cost about twice a one-row pass (the int8 loops).

The *self-draft* is the target's own first N layers with its final norm and LM head (the idea of
LayerSkip / "draft & verify" self-speculation): no second checkpoint, same vocabulary by construction.
The *int8 self-draft* (method ``int8_self_draft``) is the whole target with its matrices in int8
(kernels/int8.py): a quarter of the bytes to read per token, so a draft step costs about half a target step on
a CPU, and it nearly always agrees with the target (rounding moves the logits a little): what a separate
smaller model offers, without one. Having the target's shapes, it **shares the target's KV cache**: the context
it attends to is the target's own (exact) keys and values, so it never catches up on a prompt, and each pass
is one row. Its guesses' KV goes where the next verification writes the target's over it (every position it
writes is one the target has not computed yet: the last token and the guesses after it), so the target never
reads a value of the draft's.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..config import ConfigError
from ..model import CompactLlama
from ..kernels import Backend
from ..request import Request
from ..runner.model_runner import ModelRunner
from ..sampling import Sampler, probabilities
from ..scheduler import ScheduledChunk
from .config import INT8_SELF_DRAFT, SELF_DRAFT, SpeculativeConfig
from .proposer import Draft

logger = logging.getLogger("minipaged.spec_decode")


class DraftModelProposer:
    def __init__(self, model: CompactLlama, num_blocks: int, block_size: int, backend: Backend,
                 block_table_of: Callable[[str], list[int]], sampler: Sampler,
                 shared_kv_cache: Optional[torch.Tensor] = None) -> None:
        self.model = model
        backend = backend.for_shapes(model.shapes())
        model.store_weights_for(backend)
        # the target's own cache (the int8 self-draft: same layers and heads), or one of its own
        self.shares_kv = shared_kv_cache is not None
        self.kv_cache = shared_kv_cache if self.shares_kv else model.allocate_kv_cache(num_blocks, block_size,
                                                                                       backend=backend)
        self.runner = ModelRunner(model, self.kv_cache, block_size, backend)
        self.block_table_of = block_table_of
        self.sampler = sampler                 # the requests' own generators: a seed drives drafts too
        self.num_computed: dict[str, int] = {}   # tokens of each request whose KV is in the draft's cache
        self.fed: dict[str, list[int]] = {}      # the guesses fed after them (their KV is in the cache too)
        # the last proposal's passes, (requests, seconds) each, but a catch-up of more than two rows a request
        # (a prompt): what the automatic k knows a drafting pass to cost
        self.pass_seconds: list[tuple[int, float]] = []

    def forget(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)
        self.fed.pop(request_id, None)

    def _seen(self, req: Request) -> int:
        """How many of the request's tokens have their KV in the draft's cache: those it caught up on, then its
        own fed guesses as far as they are the request's tokens (always leaving the last token to feed). In the
        target's cache: every token the target computed, all but the last."""
        if self.shares_kv:
            return req.num_computed_tokens
        start = self.num_computed.get(req.request_id, 0)
        tokens, fed = req.all_token_ids, self.fed.pop(req.request_id, [])
        for guess in fed:
            if start >= req.num_tokens - 1 or tokens[start] != guess:
                break
            start += 1
        return start

    def propose(self, requests: Sequence[Request], max_drafts: dict[str, int]) -> dict[str, Draft]:
        active = [r for r in requests if max_drafts[r.request_id] > 0]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in active}
        chunks = []
        for req in active:                     # pass 0: catch up, and guess d_0
            start = self._seen(req)
            chunks.append(self._chunk(req, start, req.num_tokens - start, ()))
            self.num_computed[req.request_id] = req.num_tokens
        self.pass_seconds = []
        for j in range(max(max_drafts[r.request_id] for r in active) if active else 0):
            begin, typical = time.perf_counter(), all(c.num_new_tokens <= 2 for c in chunks)
            self._guess(chunks, tokens, probs)
            if typical:
                self.pass_seconds.append((len(chunks), time.perf_counter() - begin))
            # pass j + 1: feed d_j at its position, guess d_{j+1}
            chunks = [self._chunk(r, r.num_tokens + j, 1, (tokens[r.request_id][-1],))
                      for r in active if max_drafts[r.request_id] > j + 1]
        for req in active if not self.shares_kv else ():   # d_0 .. d_{k-2} were fed: their KV is in the cache
            self.fed[req.request_id] = tokens[req.request_id][:max_drafts[req.request_id] - 1]
        return {rid: Draft(ids, torch.stack(probs[rid]) if probs[rid] else None) for rid, ids in tokens.items()}

    def _chunk(self, req: Request, start: int, num_new: int, guesses: tuple[int, ...]) -> ScheduledChunk:
        return ScheduledChunk(req, start, num_new, tuple(self.block_table_of(req.request_id)), samples=True,
                              spec_token_ids=guesses)

    def _guess(self, chunks: list[ScheduledChunk], tokens: dict[str, list[int]],
               probs: dict[str, list[torch.Tensor]]) -> None:
        """One batched draft forward; each request's next guess (argmax, or a sample from q that is kept)."""
        model_input = self.runner.prepare(chunks, with_prompt_rows=False)
        logits = self.runner.execute(model_input)
        for row, req in enumerate(model_input.sampled_requests):
            rid = req.request_id
            if req.params.greedy:
                tokens[rid].append(int(logits[row].argmax()))
                continue
            q = probabilities(logits[row], req.params)
            tokens[rid].append(int(torch.multinomial(q, 1, generator=self.sampler.generator_for(req))))
            probs[rid].append(q)


def self_draft(target: CompactLlama, num_layers: int) -> CompactLlama:
    """The target's first ``num_layers`` layers, sharing its weights (nothing is copied)."""
    import copy
    if not 1 <= num_layers <= target.num_layers:
        raise ValueError(f"a self-draft takes 1 to {target.num_layers} of the target's layers, got {num_layers}.")
    draft = copy.copy(target)
    draft.layers = target.layers[:num_layers]
    draft.num_layers = num_layers
    draft._cos = draft._sin = None            # its own RoPE table cache
    return draft


def int8_self_draft(target: CompactLlama) -> CompactLlama:
    """The target with every layer matrix and the LM head quantized to int8 (per-row scales), sharing its
    embedding and norms. The target keeps its fp32 weights: it still decides every token."""
    import copy
    import dataclasses

    from ..kernels.int8 import quantize_int8
    from ..model.weights import MATRICES
    if target.quantization is not None:
        raise ConfigError(f"the target is already {target.quantization}: its int8 self-draft would be itself. Use "
                          f"an fp32 target (leave quantization off) with method '{INT8_SELF_DRAFT}'.")
    draft = copy.copy(target)
    draft.layers = [dataclasses.replace(w, **{name: quantize_int8(getattr(w, name)) for name in MATRICES})
                    for w in target.layers]
    draft.lm_head = quantize_int8(target.lm_head)
    draft._hf_model = None                    # transformers' module belongs to the target
    draft._cos = draft._sin = None            # its own RoPE table cache
    draft.quantization = "int8"
    return draft


def load_draft_model(config: SpeculativeConfig, target: CompactLlama, target_tokenizer: Any, dtype: Any,
                     device: str, progress: Optional[Callable[[str], None]] = None) -> CompactLlama:
    """The draft model: the target's own first layers, or another checkpoint with the same vocabulary
    (checked from its config and tokenizer, before its weights load)."""
    if config.method == INT8_SELF_DRAFT:
        return int8_self_draft(target)
    if config.model == SELF_DRAFT:
        layers = target.num_layers if config.num_draft_layers is None else config.num_draft_layers
        if layers > target.num_layers:
            raise ConfigError(f"num_draft_layers={layers}, but the target has {target.num_layers} layers; use 1 to "
                              f"{target.num_layers - 1} (or leave it out: all layers, a draft that is always right "
                              "and never faster, for watching the mechanics).")
        if layers == target.num_layers:
            logger.warning("The self-draft uses all %d layers: every guess will be accepted, but drafting costs as "
                           "much as the target. Give num_draft_layers < %d for a draft that can pay off.",
                           layers, layers)
        return self_draft(target, layers)
    from transformers import AutoConfig, AutoTokenizer

    from ..model import load_model
    from ..model.loader import resolve_model_path
    path, _ = resolve_model_path(config.model, progress)
    problem = check_same_vocabulary(target_tokenizer, AutoTokenizer.from_pretrained(path), target.embed.shape[0],
                                    AutoConfig.from_pretrained(path).vocab_size, config.model)
    if problem is not None:
        raise ConfigError(problem)
    loaded = load_model(config.model, dtype=dtype, device=device, progress=progress)
    return CompactLlama(loaded.hf_model)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab_rows: int, draft_vocab_rows: int,
                          draft_name: str) -> Optional[str]:
    """Why the draft cannot propose tokens for the target, or None if it can."""
    if target_vocab_rows != draft_vocab_rows:
        return (f"the draft model {draft_name!r} has a vocabulary of {draft_vocab_rows} tokens and the target "
                f"{target_vocab_rows}: a draft must share the target's tokenizer (use a smaller model of the same "
                "family, or the self-draft: model 'self' with num_draft_layers).")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        return (f"the draft model {draft_name!r} has as many tokens as the target but a different tokenizer: its "
                "token ids mean other text. Use a draft of the same family, or the self-draft (model 'self').")
    return None
