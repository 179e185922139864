"""The engine: requests in, tokens out, one ``step()`` at a time.

Follow a request from top to bottom:
  1. ``add_request`` validates it, tokenises the prompt and puts it in the scheduler's waiting queue.
  2. ``step`` asks the ``Scheduler`` which requests run and how many tokens each computes (it allocates
     their KV blocks, using prefix-cache hits, preempting if memory runs out).
  3. Swapped blocks are copied between the GPU and CPU pools.
  4. The ``ModelRunner`` lays all scheduled tokens end to end and runs ``CompactLlama`` once; attention
     reads and writes the paged cache through block tables.
  5. The ``Sampler`` picks a token for each request that reached the end of its known tokens.
  6. Requests advance ``num_computed_tokens``, append their token, check stop conditions; finished ones free
     their blocks at once (continuous batching: the next step can admit someone else).
  7. A ``StepEvent`` records all of it for the TUI, traces and metrics.
"""
from __future__ import annotations

import itertools
import logging
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from .block_manager import CpuBlockPool, KVCacheManager
from .config import ConfigError, EngineConfig
from .events import (PREVIEW_GAP, EngineInfo, KVChanges, Preemption, RequestArrival, RequestFinish, ScheduledRequest,
                     StepEvent)
from .model import CompactLlama, load_model
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import InvalidRequestError, Request, RequestStatus, SamplingParams
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler

logger = logging.getLogger("minipaged")

Prompt = Union[str, Sequence[int]]
DEFAULT_CPU_KV_GIB = 1.0
PREVIEW_CHARS = 150          # a prompt preview keeps its first third and its last two thirds of this
PREVIEW_TOKENS = 24          # token-id prompts: decode this many tokens from each end for the preview
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    """A paged-KV, continuously batched inference engine for Llama-architecture models."""

    def __init__(self, model: str = "smollm2", *, load_progress: Optional[Callable[[str], None]] = None,
                 **options: Any) -> None:
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {sorted(unknown)}; valid options: "
                              f"{sorted(f for f in EngineConfig.__dataclass_fields__ if f != 'model')}")
        self.config = config = EngineConfig(model=model, **options)
        config.validate()
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for, but torch sees no CUDA device here (a CPU build of "
                              "torch, or no GPU); leave device unset to use the CPU.")
        if self.device.type == "mps" and not torch.backends.mps.is_available():
            raise ConfigError("device='mps' was asked for, but Apple's MPS is not available here; leave device "
                              "unset to use the CPU.")
        dtype_name = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.loaded = load_model(model, dtype=DTYPES[dtype_name], device=str(self.device), progress=load_progress)
        self.tokenizer = self.loaded.tokenizer
        self.model = CompactLlama(self.loaded.hf_model)
        config.finalize(self.loaded.config.max_position_embeddings)
        self.backend = config.attention_backend or ("triton" if self.device.type == "cuda" else "torch")

        bytes_per_block = self.model.kv_bytes_per_token() * config.block_size
        num_blocks = config.num_blocks or self._blocks_from_memory(bytes_per_block)
        num_cpu_blocks = config.num_cpu_blocks or max(1, int(config.swap_space * 2**30 // bytes_per_block))
        self.kv_cache = self.model.allocate_kv_cache(num_blocks, config.block_size)
        self.cpu_kv_cache = self.model.allocate_kv_cache(num_cpu_blocks, config.block_size, device="cpu") \
            if config.preemption_mode == "swap" else self.model.allocate_kv_cache(1, config.block_size, "cpu")
        if config.preemption_mode != "swap":
            num_cpu_blocks = 0
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.scheduler = Scheduler(config, self.kv, self.cpu_pool)
        self.runner = ModelRunner(self.model, self.kv, self.kv_cache, self.backend)
        self.sampler = Sampler(config.seed)

        self.info = EngineInfo(
            model=model, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching, policy=config.policy,
            preemption_mode=config.preemption_mode, kv_bytes_per_token=self.model.kv_bytes_per_token(),
            device=str(self.device), dtype=dtype_name, attention_backend=self.backend)
        capacity = (f"KV cache: {num_blocks} blocks x {config.block_size} tokens = {num_blocks * config.block_size} "
                    f"tokens ({num_blocks * bytes_per_block / 2**20:.1f} MiB, "
                    f"{self.model.kv_bytes_per_token() / 1024:.1f} KiB per token)")
        logger.info(capacity)
        if load_progress is not None:
            load_progress(capacity)

        self._requests: dict[str, Request] = {}
        self._children: dict[str, list[str]] = {}        # user-visible id -> sub-request ids (n > 1)
        self._finished: dict[str, RequestOutput] = {}
        self._arrival_counter = itertools.count()
        self._id_counter = itertools.count()
        self._pending_arrivals: list[RequestArrival] = []
        self._pending_finishes: list[RequestFinish] = []
        self._pending_text: dict[str, str] = {}        # text an aborted request still owed its stream
        self._subscribers: list[Callable[[StepEvent], None]] = []
        self._step_index = 0
        self._start_time = time.perf_counter()
        self.counters: dict[str, float] = {
            "steps": 0, "prompt_tokens_computed": 0, "generation_tokens": 0, "preemptions_recompute": 0,
            "preemptions_swap": 0, "blocks_swapped_out": 0, "blocks_swapped_in": 0, "requests_finished": 0,
            "forward_seconds": 0.0, "step_seconds": 0.0}

    # ------------------------------------------------------------------ set-up helpers
    def _blocks_from_memory(self, bytes_per_block: int) -> int:
        cfg = self.config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = total * cfg.gpu_memory_utilization - used_by_others - 1.0 * 2**30   # activations headroom
            if budget <= bytes_per_block:
                raise ConfigError("no GPU memory left for the KV cache; raise gpu_memory_utilization or set "
                                  "num_blocks.")
        else:
            budget = (cfg.kv_cache_memory or DEFAULT_CPU_KV_GIB) * 2**30
        blocks = int(budget // bytes_per_block)
        # never more than every sequence at full length could use
        max_useful = cfg.max_num_seqs * self.kv.blocks_needed(cfg.max_model_len) if hasattr(self, "kv") else \
            cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        return max(1, min(blocks, max_useful))

    # ------------------------------------------------------------------ requests in
    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Validate and queue one prompt; returns its request id. Raises InvalidRequestError on bad input."""
        token_ids, text, params = self._validate(prompt, params)
        return self._queue(token_ids, text, params, request_id)

    def validate_request(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> None:
        """Raise InvalidRequestError if ``add_request`` would refuse this request; nothing is queued."""
        self._validate(prompt, params)

    def _validate(self, prompt: Prompt, params: Optional[SamplingParams]) -> tuple[list[int], Optional[str],
                                                                                  SamplingParams]:
        """Everything that can be wrong with a request, checked before anything is queued."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a minipaged.SamplingParams.")
        token_ids, text = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return token_ids, text, params

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._children or request_id in self._finished

    def _queue(self, token_ids: list[int], text: Optional[str], params: SamplingParams,
               request_id: Optional[str]) -> str:
        def sample_ids(rid: str) -> list[str]:     # the n parallel samples run as rid.0, rid.1, ...
            return [rid] if params.n == 1 else [f"{rid}.{i}" for i in range(params.n)]

        def taken(rid: str) -> bool:
            return any(self._id_in_use(r) for r in {rid, *sample_ids(rid)})

        if request_id is None:                    # the next number that nobody has taken by hand
            request_id = next(rid for rid in map(str, self._id_counter) if not taken(rid))
        request_id = str(request_id)
        if taken(request_id):
            raise InvalidRequestError(f"request id {request_id!r} (or one of its samples' ids) is already in use; "
                                      f"pass a new one or None.")
        now = time.perf_counter()
        ids = sample_ids(request_id)
        self._children[request_id] = ids
        for i, rid in enumerate(ids):
            req = Request(rid, list(token_ids), params, next(self._arrival_counter), now, prompt=text,
                          sample_index=i, parent_id=request_id)
            self._requests[rid] = req
            self.scheduler.add(req)
            self._pending_arrivals.append(
                RequestArrival(rid, len(token_ids), params.max_tokens, self._prompt_preview(token_ids, text),
                               now - self._start_time))
        return request_id

    def _prompt_preview(self, token_ids: list[int], text: Optional[str]) -> str:
        """The prompt's start and end for the queue panel: prompts that share a long system prompt differ
        only at the end. Token-id prompts are decoded (only their two ends), so every view shows text."""
        n = PREVIEW_TOKENS
        if text is None and len(token_ids) <= 2 * n:
            text = self.tokenizer.decode(token_ids)
        elif text is None:
            text = self.tokenizer.decode(token_ids[:n]) + PREVIEW_GAP + self.tokenizer.decode(token_ids[-n:])
        if len(text) <= PREVIEW_CHARS:
            return text
        return text[:PREVIEW_CHARS // 3] + PREVIEW_GAP + text[-(PREVIEW_CHARS - PREVIEW_CHARS // 3):]

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], Optional[str]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one character or token id.")
            return list(self.tokenizer(prompt).input_ids), prompt
        try:
            token_ids = [int(t) for t in prompt]
            if any(t != p for t, p in zip(token_ids, prompt)):
                raise TypeError
        except (TypeError, ValueError):
            raise InvalidRequestError("a prompt must be a string or a list of integer token ids.") from None
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one character or token id.")
        vocab = self.model.embed.shape[0]
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id(s) {bad[:5]} are outside the vocabulary (0..{vocab - 1}).")
        return token_ids, None

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        cfg = self.config
        if len(token_ids) >= cfg.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {cfg.max_model_len} (room is needed "
                f"for at least one generated token); shorten the prompt or raise max_model_len.")
        longest = min(len(token_ids) + params.max_tokens, cfg.max_model_len)
        need = self.kv.blocks_needed(longest)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"this request can grow to {longest} tokens = {need} KV blocks, but the whole pool has "
                f"{self.kv.num_blocks} blocks, so it could never finish; lower max_tokens or the prompt length, "
                f"or raise num_blocks / kv_cache_memory.")

    def abort(self, request_id: str) -> bool:
        """Stop a request (or all n samples of it) now and free its blocks. False if it is not running."""
        ids = self._children.get(request_id, [request_id])
        found = False
        for rid in ids:
            req = self._requests.get(rid)
            if req is None or req.is_finished:
                continue
            found = True
            self._finish(req, RequestStatus.FINISHED_ABORTED, time.perf_counter())
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def subscribe(self, callback: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after every step; returns a function that unsubscribes it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:                # calling it twice is harmless
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    # ------------------------------------------------------------------ one step
    def step(self) -> StepEvent:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        changes = self.kv.drain_changes()        # before the forward pass; finishes below are logged apart
        t1 = time.perf_counter()
        if sched.swap_out:
            self.runner.copy_blocks(self.kv_cache, self.cpu_kv_cache, sched.swap_out)
        if sched.swap_in:
            self.runner.copy_blocks(self.cpu_kv_cache, self.kv_cache, sched.swap_in)
        sampled_tokens: list[Optional[int]] = []
        sampled_requests: list[Request] = []
        forward_start = forward_end = time.perf_counter()
        if sched.chunks:
            model_input = self.runner.prepare(sched.chunks)
            forward_start = time.perf_counter()
            logits = self.runner.execute(model_input)
            sampled_requests = model_input.sampled_requests
            sampled_tokens = self.sampler.sample(logits, sampled_requests)
            forward_end = time.perf_counter()
        t2 = time.perf_counter()

        scheduled: list[ScheduledRequest] = []
        new_token_ids: dict[str, list[int]] = {}
        new_text: dict[str, str] = {}
        tokens_by_request = dict(zip((r.request_id for r in sampled_requests), sampled_tokens))
        for chunk in sched.chunks:
            req = chunk.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = t1
            kind = chunk.kind
            if kind == "prefill":
                self.counters["prompt_tokens_computed"] += chunk.num_new_tokens
            req.num_computed_tokens = chunk.end
            token = tokens_by_request.get(req.request_id)
            if token is None and req.request_id in tokens_by_request:
                self._finish(req, RequestStatus.FINISHED_ABORTED, t2)       # its sampling failed
            elif token is not None:
                delta = self._append_token(req, token, t2)
                new_token_ids[req.request_id] = [token]
                if delta:
                    new_text[req.request_id] = delta
            scheduled.append(ScheduledRequest(req.request_id, kind, chunk.start, chunk.end, req.num_prompt_tokens,
                                              chunk.num_cached_tokens, len(req.output_token_ids)))
        self.counters["generation_tokens"] += len(new_token_ids)
        for p in sched.preempted:
            self.counters[f"preemptions_{p.mode}"] += 1
        self.counters["blocks_swapped_out"] += len(sched.swap_out)
        self.counters["blocks_swapped_in"] += len(sched.swap_in)
        t3 = time.perf_counter()
        self.counters["steps"] += 1
        model_s = forward_end - forward_start          # the forward pass and sampling; the rest is bookkeeping
        self.counters["forward_seconds"] += model_s
        self.counters["step_seconds"] += t3 - t0
        self._step_index += 1
        event = self._make_event(sched, changes, scheduled, new_token_ids, new_text, t0, model_s, t3)
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:                         # an observer must never take the engine down
                logger.exception("a StepEvent subscriber raised; it stays subscribed")
        return event

    def _append_token(self, req: Request, token: int, now: float) -> str:
        """Add a generated token, update the text, and finish the request if a stop condition holds."""
        req.output_token_ids.append(token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        p = req.params
        old_len = len(req.output_text)
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):               # wait for the rest of a multi-byte character
            req.output_text = text
        status: Optional[RequestStatus] = None
        if not p.ignore_eos and token in self.loaded.eos_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif p.stop:
            search_from = max(0, old_len - max(len(s) for s in p.stop) + 1)
            hits = [(req.output_text.find(s, search_from), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                req.output_text = req.output_text[:index]
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and (len(req.output_token_ids) >= p.max_tokens
                               or req.num_tokens >= self.config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status, now)
        return self._stream_delta(req, finished=status is not None)

    @staticmethod
    def _stream_delta(req: Request, finished: bool) -> str:
        """The text to stream now. Until the request finishes, its last ``len(longest stop string) - 1``
        characters are held back: they may be the start of a stop string, which the final text leaves out."""
        hold = 0 if finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        end = max(req.num_streamed_chars, len(req.output_text) - hold)
        delta = req.output_text[req.num_streamed_chars:end]
        req.num_streamed_chars = end
        return delta

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if status is RequestStatus.FINISHED_ABORTED:      # no stop string will come: send what was held back
            rest = self._stream_delta(req, finished=True)
            if rest:
                self._pending_text[req.request_id] = rest
        self.scheduler.remove(req)
        req.status = status
        req.finished_time = now
        self.sampler.forget(req.request_id)
        self.counters["requests_finished"] += 1
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        itls = [b - a for a, b in zip(req.token_times, req.token_times[1:])]
        self._pending_finishes.append(RequestFinish(
            req.request_id, status.value, req.num_prompt_tokens, len(req.output_token_ids),
            max(req.num_cached_tokens, 0), ttft, now - req.arrival_time,
            sum(itls) / len(itls) if itls else None))
        parent = req.parent_id or req.request_id
        siblings = [self._requests[rid] for rid in self._children.get(parent, [req.request_id])]
        if all(s.is_finished for s in siblings):
            self._finished[parent] = self._build_output(parent, siblings)
            for s in siblings:
                del self._requests[s.request_id]
            del self._children[parent]

    def _build_output(self, parent: str, samples: list[Request]) -> RequestOutput:
        first = samples[0]
        return RequestOutput(
            request_id=parent, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=[CompletionOutput(s.sample_index, s.output_text, list(s.output_token_ids), s.status.value,
                                      s.stop_reason, list(s.token_times)) for s in samples],
            num_cached_tokens=max(max(s.num_cached_tokens for s in samples), 0),   # samples after the first hit
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                   max(s.finished_time or 0.0 for s in samples),
                                   sum(s.num_preemptions for s in samples)))

    def _make_event(self, sched, changes, scheduled, new_token_ids, new_text, t0, model_s, t3) -> StepEvent:
        finished_changes = self.kv.drain_changes()
        arrivals, self._pending_arrivals = self._pending_arrivals, []
        finishes, self._pending_finishes = self._pending_finishes, []
        for rid, rest in self._pending_text.items():
            new_text[rid] = new_text.get(rid, "") + rest
        self._pending_text = {}
        s = self.scheduler
        return StepEvent(
            step=self._step_index, time_s=t3 - self._start_time, duration_s=t3 - t0, schedule_s=(t3 - t0) - model_s,
            model_s=model_s, budget_limit=self.config.max_num_batched_tokens, budget_used=sched.num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, scheduled=tuple(scheduled), arrivals=tuple(arrivals),
            preempted=tuple(Preemption(p.request.request_id, p.mode, p.num_blocks,
                                       "not enough free KV blocks for a running request") for p in sched.preempted),
            swapped_in=tuple(r.request_id for r in sched.swapped_in), finished=tuple(finishes),
            new_token_ids=new_token_ids, new_text=new_text,
            kv=KVChanges(changes.allocated, changes.cache_hits, changes.freed, changes.cached, changes.evicted,
                         changes.uncached, changes.swapped_out, changes.swapped_in,
                         freed_on_finish=finished_changes.freed),
            num_free_blocks=self.kv.num_free_blocks, num_cached_free_blocks=self.kv.num_cached_free_blocks,
            num_total_blocks=self.kv.num_blocks, num_free_cpu_blocks=self.cpu_pool.num_free_blocks,
            num_total_cpu_blocks=self.cpu_pool.num_blocks,
            waiting=tuple(r.request_id for r in s.waiting), running=tuple(r.request_id for r in s.running),
            swapped=tuple(r.request_id for r in s.swapped), counters=self.stats())

    # ------------------------------------------------------------------ results out
    def pop_finished(self) -> list[RequestOutput]:
        """Outputs of the requests finished since the last call (for callers driving ``step`` themselves)."""
        done, self._finished = list(self._finished.values()), {}
        return done

    def generate(self, prompts: Union[Prompt, Iterable[Prompt]], params: Union[SamplingParams,
                 Sequence[SamplingParams], None] = None, *, use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Run prompts to completion, batched continuously; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts.")
        checked = [self._validate(p, sp) for p, sp in zip(prompts, param_list)]   # all or none are queued
        ids = [self._queue(token_ids, text, sp, None) for token_ids, text, sp in checked]
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() and len(prompts) >= 4 if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="Generating", unit="req")
        try:
            while wanted - results.keys():
                self.step()
                for rid in list(self._finished):
                    if rid in wanted:
                        results[rid] = self._finished.pop(rid)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in wanted - results.keys():   # leave the engine clean for the next caller
                self.abort(rid)
                self._finished.pop(rid, None)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def chat(self, messages: Union[list[dict], list[list[dict]]], params: Optional[SamplingParams] = None,
             **kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"{self.config.model} has no chat template; use generate() with plain text.")
        prompts = [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]) for c in conversations]
        return self.generate(prompts, params, **kwargs)

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; returns how many blocks lost their hash."""
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        kv, s = self.kv, self.stats_prefix()
        return {
            "blocks_total": kv.num_blocks, "blocks_free": kv.num_free_blocks,
            "blocks_cached_free": kv.num_cached_free_blocks, "blocks_used": kv.num_blocks - kv.num_free_blocks,
            "cpu_blocks_total": self.cpu_pool.num_blocks, "cpu_blocks_free": self.cpu_pool.num_free_blocks,
            "requests_waiting": len(self.scheduler.waiting), "requests_running": len(self.scheduler.running),
            "requests_swapped": len(self.scheduler.swapped), **s, **self.counters}

    def stats_prefix(self) -> dict[str, float]:
        st = self.kv.stats
        return {"prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
                "prefix_cache_hit_rate": st.hits / st.queries if st.queries else 0.0,
                "blocks_evicted": st.evictions}
