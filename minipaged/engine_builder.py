"""Assembling an engine: everything ``Engine.__init__`` needs, built in the order the parts depend on each
other (config -> device -> model -> backend -> KV pools -> scheduler, runner, sampler, speculator -> the
engine core -> the front end's processors -> the observers' recorder -> info).

Kept out of engine.py so that the engine reads as what it does per request and per step; this is the one
place to look for how the parts are chosen and wired together: the core and the front end import none of the
parts they are given (policies, backends, the speculator, the recorder).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .config import ConfigError, EngineConfig
from .engine_core import EngineCore
from .events import EngineInfo
from .input_processor import InputProcessor
from .kv_cache_manager import KVCacheManager
from .logits.stage import LogitsStage
from .kernels import Backend, select_backend
from .kernels.backends.cuda_graphs import default_capture_sizes
from .kernels.devices import use_in_this_thread
from .kernels.int8 import quantization_problem
from .memory import (DTYPES, apply_num_threads, choose_device, choose_dtype, num_cpu_blocks, num_kv_blocks,
                     return_freed_memory_to_the_os)
from .model import CompactLlama, load_model
from .model.families import sliding_window_problem
from .output_processor import OutputProcessor
from .parallel import ParallelLayout, rank0_shard
from .parallel.distributed_runner import DistributedRunner
from .parallel.launch import serve_torchrun_worker, started_by_torchrun
from .parallel.worker import WorkerSpec
from .policies import load_policy
from .policies.client_share import ClientShare, attention_context_per_token
from .runner.executor import ModelExecutor
from .runner.model_runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler
from .spec_decode.config import INT8_SELF_DRAFT
from .spec_decode.draft_model import load_draft_model
from .spec_decode.speculator import Speculator, build_speculator
from .step_recorder import StepRecorder
from .swap import CpuBlockPool

logger = logging.getLogger("minipaged")


@dataclass
class EngineParts:
    """The engine's parts; ``Engine`` keeps each as an attribute of the same name."""

    config: EngineConfig
    info: EngineInfo                      # what does not change during a run (every event's header)
    inputs: InputProcessor                # the front end: requests in (validate, tokenise, fit checks)
    core: EngineCore                      # scheduler, KV cache, executor: one EngineCoreOutputs a step
    outputs: OutputProcessor              # the front end: tokens out (text, stop strings, deltas, outputs)
    recorder: StepRecorder                # the observers' window: one StepEvent a step
    # The core's parts, for those who study or test them (the engine itself talks to the core):
    device: torch.device
    layout: ParallelLayout
    model: CompactLlama
    loaded: Any                           # LoadedModel: transformers' model, tokenizer, config, EOS ids
    tokenizer: Any
    backend: Backend
    draft_model: Optional[CompactLlama]
    kv_cache: torch.Tensor
    cpu_kv_cache: Optional[torch.Tensor]
    kv: KVCacheManager
    cpu_pool: CpuBlockPool
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    logits: LogitsStage
    speculator: Optional[Speculator]


def build_engine_parts(model_name: str, options: dict[str, Any],
                       load_progress: Optional[Callable[[str], None]] = None) -> EngineParts:
    """Check the options, load the model, choose the backend, size and allocate the KV pools, and build the
    scheduler, runner, sampler, output processor and speculator. Raises ConfigError on a bad option."""
    unknown = set(options) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {sorted(unknown)}; valid options: "
                          f"{sorted(f for f in EngineConfig.__dataclass_fields__ if f != 'model')}")
    config = EngineConfig(model=model_name, **options)
    config.validate()
    if started_by_torchrun() and int(os.environ["RANK"]) > 0:
        serve_torchrun_worker()            # a worker rank under torchrun: serve rank 0 until it closes
        raise SystemExit(0)
    device = choose_device(config)
    num_threads = apply_num_threads(config)
    dtype_name = choose_dtype(config, device)
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    if layout.world_size == 1:
        loaded = load_model(model_name, dtype=DTYPES[dtype_name], device=str(device), progress=load_progress)
        model = CompactLlama(loaded.hf_model)
    else:                                  # rank 0's shard only: the whole model never stays in memory
        model, loaded = rank0_shard(model_name, layout, DTYPES[dtype_name], device, load_progress)
    tokenizer = loaded.tokenizer
    config.finalize(loaded.config.max_position_embeddings, device.type)
    if problem := sliding_window_problem(loaded.config, config.max_model_len, model_name):
        raise ConfigError(problem)          # before any worker starts or any KV memory is taken
    try:
        backend = select_backend(device, DTYPES[dtype_name], model.shapes(), config.attention_backend,
                                 cpu_ops=config.cpu_ops, compiled_decode=config.compiled_decode,
                                 triton_fused_ops=config.triton_fused_ops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if graphs_wanted(config) and (problem := backend.cuda_graphs_problem(device)):
        raise ConfigError(problem + ".")    # before any KV memory is taken
    if config.quantization:        # once the backend is known (it may refuse), before a self-draft shares the layers
        quantize(model, backend, config.quantization, DTYPES[dtype_name], layout)
        loaded = dataclasses.replace(loaded, hf_model=None)     # transformers' module held the fp32 weights:
        gc.collect()                                            # dropped, so that only int8 stays
        return_freed_memory_to_the_os()
    model.store_weights_for(backend)                    # (int8 matrices stay as they are: [out, in])
    spec = config.speculative
    if spec and spec.method == INT8_SELF_DRAFT and (
            problem := quantization_problem("int8", backend, DTYPES[dtype_name], layout.world_size)):
        raise ConfigError(f"the int8 self-draft cannot run here: {problem}.")
    draft_model = load_draft_model(spec, model, tokenizer, DTYPES[dtype_name], str(device),
                                   load_progress) if spec and spec.uses_draft_model else None

    # The paged KV cache: one pool of blocks on the device, and a host pool for swapped-out requests.
    # A draft model keeps its own KV in the same blocks, so a block costs both models' bytes.
    own_draft_kv = draft_model is not None and spec.method != INT8_SELF_DRAFT   # (the int8 one shares the target's)
    kv_bytes_per_token = model.kv_bytes_per_token() + (draft_model.kv_bytes_per_token() if own_draft_kv else 0)
    bytes_per_block = kv_bytes_per_token * config.block_size
    num_blocks = num_kv_blocks(config, device, bytes_per_block)
    cpu_blocks = num_cpu_blocks(config, bytes_per_block)
    kv_cache = model.allocate_kv_cache(num_blocks, config.block_size, backend=backend)
    cpu_kv_cache = model.allocate_kv_cache(cpu_blocks, config.block_size, "cpu") if cpu_blocks else None
    kv = KVCacheManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                        free_queue=load_policy("eviction_policy", config.eviction_policy))
    cpu_pool = CpuBlockPool(cpu_blocks)

    inputs = InputProcessor(model_name, tokenizer, model.embed.shape[0], config.max_model_len, kv.blocks_needed,
                            num_blocks)
    lookahead = spec.num_speculative_tokens if draft_model is not None else 0
    scheduler = Scheduler(config, kv, cpu_pool, loaded.eos_token_ids, lookahead,
                          order=load_policy("scheduling_policy", config.scheduling_policy)(),
                          victim_policy=load_policy("preemption_victim", config.preemption_victim)(),
                          client_share=ClientShare(attention_context_per_token(loaded.config))
                          if config.fair_share else None)
    if layout.world_size == 1:
        runner = ModelRunner(model, kv_cache, config.block_size, backend)
        if graphs_wanted(config):
            capture_decode_graphs(runner, config, load_progress)
    else:          # starts the workers; each builds its own shard and caches from the spec
        runner = DistributedRunner(model, kv_cache, cpu_kv_cache, WorkerSpec(
            model_name, options, layout, num_blocks, cpu_blocks, config.block_size, backend,
            config.distributed_timeout))
    sampler = Sampler(config.seed, backend.argmax)
    outputs = OutputProcessor(tokenizer)
    logits = LogitsStage(tokenizer, model.embed.shape[0], loaded.eos_token_ids, config.grammar_timeout)
    speculator: Optional[Speculator] = None if spec is None else build_speculator(
        spec, draft_model, num_blocks=num_blocks, block_size=config.block_size, backend=backend,
        block_table_of=kv.blocks_of, max_model_len=config.max_model_len, sampler=sampler,
        target_kv_cache=kv_cache)
    core = EngineCore(config, scheduler, kv, cpu_pool, ModelExecutor(runner, logits, sampler, speculator), logits,
                      speculator, cpu_kv_cache, lambda: use_in_this_thread(device))
    recorder = StepRecorder(core, config, model.embed.shape[0], tokenizer.decode)

    info = EngineInfo(
        model=model_name, num_blocks=num_blocks, num_cpu_blocks=cpu_blocks, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
        enable_prefix_caching=config.enable_prefix_caching, policy=config.policy,
        scheduling_policy=config.scheduling_policy, preemption_victim=config.preemption_victim,
        eviction_policy=config.eviction_policy, quantization=config.quantization,
        weight_bytes=model.weight_bytes(), async_output_processing=config.async_output_processing,
        fair_share=bool(config.fair_share),
        preemption_mode=config.preemption_mode, kv_bytes_per_token=kv_bytes_per_token,
        device=str(device), dtype=dtype_name, attention_backend=backend.name, num_threads=num_threads,
        speculative=spec.describe() if spec else None,
        speculative_config=spec.as_dict() if spec else None,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        parallel=None if layout.world_size == 1 else layout.describe(
            model.config.num_attention_heads, model.config.num_key_value_heads,
            model.config.num_hidden_layers))
    per_rank, layout_text = (" per rank", f"; {info.parallel}") if info.parallel else ("", "")
    capacity = (f"KV cache{per_rank}: {num_blocks} blocks x {config.block_size} tokens = "
                f"{num_blocks * config.block_size} tokens ({num_blocks * bytes_per_block / 2**20:.1f} MiB, "
                f"{kv_bytes_per_token / 1024:.1f} KiB per token"
                f"{', draft model included' if own_draft_kv else ''}){layout_text}")
    logger.info(capacity)
    if load_progress is not None:
        load_progress(capacity)
        load_progress(weights_line(model, layout))
        load_progress("Attention: " + backend.describe())
        load_progress(async_output_processing_line(config.async_output_processing))
    return EngineParts(config, info, inputs, core, outputs, recorder, device, layout, model, loaded, tokenizer,
                       backend, draft_model, kv_cache, cpu_kv_cache, kv, cpu_pool, scheduler, runner, sampler, logits,
                       speculator)


def graphs_wanted(config: EngineConfig) -> bool:
    """--cuda-graphs, unless --enforce-eager says no (vLLM's flag wins)."""
    return config.cuda_graphs and not config.enforce_eager


def capture_decode_graphs(runner: ModelRunner, config: EngineConfig,
                          progress: Optional[Callable[[str], None]]) -> None:
    """Have the runner capture the decode steps' CUDA graphs (kernels/backends/cuda_graphs.py) of the sizes the
    options ask for; the time and memory it took go to the start-up messages."""
    sizes = config.capture_sizes() or default_capture_sizes(config.max_num_seqs)
    spec = config.speculative              # verifications get their own graphs, k + 1 rows a request
    line = runner.capture_decode_graphs(sizes, config.max_model_len,
                                        verify_rows=spec.num_speculative_tokens + 1 if spec is not None else 1)
    logger.info(line)
    if progress is not None:
        progress(line)


def quantize(model: CompactLlama, backend: Backend, quantization: str, dtype: torch.dtype,
             layout: ParallelLayout) -> None:
    """Weight-only int8 (kernels/int8.py) multiplied by ``backend``, or a ConfigError saying why this engine
    cannot."""
    if problem := quantization_problem(quantization, backend, dtype, layout.world_size):
        raise ConfigError(problem + ".")
    model.quantize_int8()
    backend.use_quantization(quantization)


def async_output_processing_line(on: bool) -> str:
    """The start-up line that says whether a step's outputs are processed while the next forward pass runs."""
    if on:
        return ("Async output processing: on (a step's outputs are processed while the next step's forward pass "
                "runs; --no-async-output-processing to turn it off)")
    return ("Async output processing: off (--async-output-processing to overlap output processing with the forward "
            "pass)")


def weights_line(model: CompactLlama, layout: ParallelLayout) -> str:
    """The start-up line on the weights' memory, beside the KV cache's."""
    kind = ("int8 matrices with fp32 scales, fp32 embedding and norms (not exact: docs/quantization.md)"
            if model.quantization else str(model.dtype).removeprefix("torch."))
    where = " on rank 0" if layout.world_size > 1 else ""
    return f"Weights{where}: {model.weight_bytes() / 2**20:.1f} MiB ({kind})"
