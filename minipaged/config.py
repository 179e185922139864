"""Engine options, validated in one place so that a bad value fails at start-up with a clear message.

Names follow vLLM's spelling (``block_size``, ``max_num_seqs`` ...) so that what you learn here carries over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional, Union, get_args

from .validation import ConfigError, is_int, is_number

if TYPE_CHECKING:
    from .spec_decode.config import SpeculativeConfig

PreemptionMode = Literal["recompute", "swap"]
# long_prefill_token_threshold's default on a CPU, where a step's time grows with its tokens: measured in
# bench/long_prefill.py (docs/performance.md). On an accelerator (CUDA) a 2,048-token step takes milliseconds:
# 0 (no cap), vLLM's.
LONG_PREFILL_CPU = 128
Policy = Literal["continuous", "static"]
Dtype = Literal["float32", "bfloat16", "float16"]
# The backends' names, the one list of them (kernels/backends/ reads it; each name is a Backend's ``name``).
AttentionBackend = Literal["triton", "cpu", "torch"]
Quantization = Literal["int8"]
# How the cpu backend picks each compiled op (kernels/backends/calibration.py): race it against torch here
# (cached), or take every op from one side without measuring.
CpuOps = Literal["measure", "compiled", "torch"]
GRAMMAR_TIMEOUT_S = 30.0        # a grammar still compiling (in the background) after this long fails its request


# Options that size the same thing another way: num_blocks wins over a memory budget, num_cpu_blocks over
# swap_space. A user who types the budget means it, so a workload's or lesson's count must give way.
SET_ANOTHER_WAY = {"num_blocks": ("kv_cache_memory", "gpu_memory_utilization"), "num_cpu_blocks": ("swap_space",)}


def suggestions_left(suggested: dict, typed: dict) -> dict:
    """The suggested options that none of the user's typed options sets, directly or another way."""
    return {name: value for name, value in suggested.items()
            if name not in typed and not any(other in typed for other in SET_ANOTHER_WAY.get(name, ()))}


@dataclass
class EngineConfig:
    """Every knob of the engine. ``None`` means "derive it from the model or the memory budget".

    Each field's metadata also makes it a command-line flag on every command (``minipaged.options`` reads
    it): ``help`` is the flag's help text, ``shown_default`` what the help says the default is when the
    field's own default (often ``None``) would not tell a reader; a ``Literal`` type (``Policy`` ...) gives
    the flag its choices. A field that is not a flag says so with ``"flag": False``, so adding a field means
    deciding, in this one place, whether users can set it.
    """

    # Not an engine flag: every command adds its own --model, with its own default.
    model: str = field(default="smollm2", metadata={"flag": False})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    # None: sized from kv_cache_memory (CPU) or gpu_memory_utilization (CUDA).
    num_blocks: Optional[int] = field(default=None, metadata={
        "help": "KV blocks in the pool", "shown_default": "from the memory budget"})
    # None: 1 GiB, capped by what max_model_len needs.
    kv_cache_memory: Optional[float] = field(default=None, metadata={
        "help": "GiB for the KV pool on CPU", "shown_default": "1"})
    # On CUDA, the share covers the weights and the KV pool.
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory the engine may use"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests in one step"})
    max_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": "token budget per step", "shown_default": "2048; max_model_len without chunked prefill"})
    max_model_len: Optional[int] = field(default=None, metadata={      # prompt + output
        "help": "longest sequence", "shown_default": "the model's context"})
    # A bool that defaults to True is switched off by its --no-... flag: --no-chunked-prefill.
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "prefill-first scheduling with whole prompts (vLLM's old default)", "shown_default": "chunked"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "turn automatic prefix caching off", "shown_default": "caching on"})
    # A long prompt shares the step with everyone else (vLLM's names; the scheduler's docstring tells how).
    # None: derived from the device in finalize (LONG_PREFILL_CPU on a CPU, 0 on an accelerator; performance.md).
    long_prefill_token_threshold: Optional[int] = field(default=None, metadata={
        "help": "with chunked prefill, a prompt with more than this many tokens left to compute is long: it "
                "gets at most this many per step, so other requests keep decoding while it prefills (0: no cap)",
        "shown_default": f"{LONG_PREFILL_CPU} on CPU, 0 on CUDA"})
    max_num_partial_prefills: Optional[int] = field(default=None, metadata={
        "help": "most prompts mid-prefill at once: a new prompt that cannot finish its prefill in this step "
                "waits while this many are mid-prefill", "shown_default": "no limit"})
    max_long_partial_prefills: int = field(default=1, metadata={
        "help": "most long prompts (see --long-prefill-token-threshold) prefilling at once; shorter prompts "
                "behind them are admitted first"})
    # Fair share by client (minipaged/policies/client_share.py; not in vLLM). None: off in the library, on under
    # ``minipaged serve`` (whose requests carry their client in SamplingParams.client).
    fair_share: Optional[bool] = field(default=None, metadata={
        "help": "share the engine between clients (SamplingParams.client) before requests: admission takes turns "
                "between clients, a preemption takes from the client holding the most KV blocks, a newcomer under its "
                "share takes blocks back from the client most over its share, and while two "
                "or more clients have requests one step does at most --long-prefill-token-threshold tokens of work "
                "(cached context counted): every client's first decode, other decodes in turns between clients up "
                "to half of it, prefills in the rest",
        "shown_default": "on under serve, off in the library"})
    policy: Policy = field(default="continuous", metadata={"help": "static batching is a teaching baseline"})
    preemption_mode: PreemptionMode = field(default="recompute", metadata={"help": "what a preempted request loses"})
    # Policies (minipaged.policies): a name, or a user's class as path/to/file.py:ClassName. vLLM's are the defaults.
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "order of admission: fcfs, priority (lower SamplingParams.priority first), shortest-prompt-first, "
                "or path/to/file.py:ClassName"})
    preemption_victim: str = field(default="newest", metadata={
        "help": "who is preempted when blocks run out: newest, lowest-priority, most-blocks, or "
                "path/to/file.py:ClassName"})
    eviction_policy: str = field(default="lru", metadata={
        "help": "which free cached block is evicted first: lru, mru, or path/to/file.py:ClassName"})
    swap_space: float = field(default=0.5, metadata={"help": "GiB of CPU memory for swapped blocks"})
    num_cpu_blocks: Optional[int] = field(default=None, metadata={
        "help": "CPU swap blocks (overrides --swap-space)", "shown_default": "from --swap-space"})
    seed: int = field(default=0, metadata={
        "help": "engine seed for requests without their own (watch: also picks the workload's prompts)"})
    device: Optional[str] = field(default=None, metadata={            # "cuda[:N]", "cpu" or "mps"
        "help": "cuda, cpu or mps", "shown_default": "cuda when present"})
    dtype: Optional[Dtype] = field(default=None, metadata={
        "help": "weights and KV cache", "shown_default": "float32 on CPU, bfloat16 on CUDA"})
    num_threads: Optional[int] = field(default=None, metadata={
        "help": "CPU threads for torch's matmuls (0: leave torch's own setting); more threads than free cores "
                "makes every step wait for the slowest", "aliases": ("--threads",),
        "shown_default": "$OMP_NUM_THREADS if set, else all cores but one"})
    # A dict (from Python) or JSON (from the command line) in vLLM's spelling; ``speculative`` parses it.
    # The seed guide's flags (--speculative-method, --num-speculative-tokens, --speculative-model) fill it too.
    speculative_config: Optional[dict] = field(default=None, metadata={
        "help": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
        "cli_type": str, "shown_default": "off"})
    # None: the engine picks the attention code from the device (triton on CUDA; on a CPU in float32 the
    # compiled kernel when a C compiler builds it, torch otherwise); naming one forces it, e.g. to compare.
    attention_backend: Optional[AttentionBackend] = field(default=None, metadata={
        "help": "attention code: triton (CUDA), cpu (compiled C kernels: decode attention, and matmuls for steps of "
                "1-7 tokens), torch (plain torch ops)",
        "shown_default": "triton on CUDA, cpu where it builds, else torch"})
    # Switches of the backends' own code paths (kernels/backends/). None: the backend's default, which the test
    # suite's conftest sets otherwise so that CI exercises every compiled and fused op whatever the machine.
    cpu_ops: Optional[CpuOps] = field(default=None, metadata={
        "help": "cpu backend: measure each compiled op against torch's on this machine the first time (cached) "
                "and take the faster, or take every op compiled, or every op torch's (no measuring)",
        "shown_default": "measure"})
    compiled_decode: bool = field(default=True, metadata={
        "help": "cpu backend: run decode steps of 1-7 rows through Python's layer loop instead of one compiled "
                "call of the whole loop (kernels/cpu_decode_layers.c; to compare the two: bench/decode_floor.py)",
        "shown_default": "one compiled call"})
    triton_fused_ops: Optional[bool] = field(default=None, metadata={
        "help": "triton backend: the fused layer ops (kernels/triton_layer_ops.py: norm with residual add, RoPE "
                "with the K/V write, SiLU-and-mul, argmax) instead of torch's; not yet checked on a GPU",
        "shown_default": "off"})
    # CUDA graphs for decode steps (kernels/backends/cuda_graphs.py). vLLM captures them by default and has
    # --enforce-eager to turn them off; here they stay opt-in until a GPU run has shown them exact (issue 37).
    cuda_graphs: bool = field(default=False, metadata={
        "help": "capture decode steps as CUDA graphs at start-up, one per batch size, replayed for decode-only "
                "steps (triton backend on CUDA; off until a GPU run shows them exact)", "shown_default": "off"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "never capture CUDA graphs: every step runs eagerly (vLLM's flag; wins over --cuda-graphs)"})
    cudagraph_capture_sizes: Optional[Union[str, list[int]]] = field(default=None, metadata={
        "help": "decode batch sizes to capture, e.g. 1,2,4,8 (a list from Python)", "cli_type": str,
        "shown_default": "1, 2, 4, then every 8 up to max_num_seqs"})
    # Weight-only int8 (kernels/int8.py, docs/quantization.md): opt-in, not exact; vLLM's flag name.
    quantization: Optional[Quantization] = field(default=None, metadata={
        "help": "int8: weights as int8 with per-row scales, computed at load (a quarter of fp32's bytes; not "
                "exact, see docs/quantization.md); activations and KV stay float32", "shown_default": "off"})
    # Parallelism (minipaged.parallel): world size = tp x pp processes, rank 0 being the engine's own.
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes that each hold a slice of every layer (heads, MLP columns, KV heads)",
        "aliases": ("-tp",)})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "processes that each hold consecutive layers", "aliases": ("-pp",)})
    # vLLM v0's async output processing (minipaged/engine_core.py): step N's outputs are processed while
    # step N+1's forward pass runs. Not vLLM v1's --async-scheduling, which also schedules step N+1 before step
    # N's tokens are known (lesson 10). Off until a measurement shows it faster here; the start-up line says which.
    async_output_processing: bool = field(default=False, metadata={
        "help": "process a step's outputs (text, stop strings, events) while the next step's forward pass runs "
                "in a thread; outputs come one step later (vLLM v0's async output processing; not vLLM v1's "
                "--async-scheduling, which schedules the next step before this one's tokens are known)",
        "negatable": True, "shown_default": "off"})
    # Structured outputs compile in the background (minipaged/logits/structured.py); a request waits meanwhile.
    grammar_timeout: float = field(default=GRAMMAR_TIMEOUT_S, metadata={
        "help": "a request whose structured-outputs grammar is still compiling (in the background) after this "
                "many seconds fails with a message that says so"})
    distributed_timeout: float = field(default=120.0, metadata={
        "help": "seconds a step may wait for another rank before the engine stops with an error"})

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")

        def one_of(name: str, choices: object, optional: bool = False) -> None:
            """A Literal field's value among the Literal's own values (the type is the one list of them)."""
            allowed = get_args(choices)
            value = getattr(self, name)
            if not (value in allowed or (optional and value is None)):
                raise ConfigError(f"{name} must be {' or '.join(repr(a) for a in allowed)}"
                                  f"{' (or None)' if optional else ''}, got {value!r}.")

        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_cpu_blocks", "max_num_partial_prefills", "max_long_partial_prefills"):
            positive(name)
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not is_int(threshold) or threshold < 0):
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), got {threshold!r}.")
        if self.max_num_partial_prefills is not None and \
                self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must not exceed "
                              f"max_num_partial_prefills ({self.max_num_partial_prefills}): long prompts are "
                              f"among the partial prefills. Lower the first or raise the second.")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks == 0:
            raise ConfigError("num_cpu_blocks must be positive.")
        if self.num_threads is not None and (not is_int(self.num_threads) or self.num_threads < 0):
            raise ConfigError(f"num_threads must be an integer >= 0 (0: leave torch's setting), got {self.num_threads!r}.")
        if not is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}.")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two from 1 to 128, got {self.block_size}.")
        if not is_number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        if self.kv_cache_memory is not None and (not is_number(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ConfigError(f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory!r}.")
        if not is_number(self.swap_space) or self.swap_space < 0:
            raise ConfigError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}.")
        if self.preemption_mode == "swap" and self.num_cpu_blocks is None and self.swap_space == 0:
            raise ConfigError("preemption_mode='swap' needs CPU blocks to swap into, but swap_space is 0; give "
                              "swap_space > 0 (GiB) or num_cpu_blocks, or use preemption_mode='recompute'.")
        one_of("policy", Policy)
        one_of("preemption_mode", PreemptionMode)
        one_of("attention_backend", AttentionBackend, optional=True)
        one_of("cpu_ops", CpuOps, optional=True)
        for name in ("scheduling_policy", "preemption_victim", "eviction_policy"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be a policy name or 'path/to/file.py:ClassName', got "
                                  f"{getattr(self, name)!r}.")
        one_of("quantization", Quantization, optional=True)
        if self.quantization and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("quantization='int8' does not combine with tensor or pipeline parallelism yet (the "
                              "shards are cut from fp32 weights); use tensor_parallel_size=1 and "
                              "pipeline_parallel_size=1, or leave quantization out.")
        if self.device is not None and str(self.device).split(":")[0] not in ("cpu", "cuda", "mps"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'mps', got {self.device!r}.")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
        for name in ("distributed_timeout", "grammar_timeout"):
            if not is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}.")
        one_of("dtype", Dtype, optional=True)
        for name in ("cuda_graphs", "enforce_eager", "compiled_decode", "triton_fused_ops"):
            if not isinstance(getattr(self, name), bool) and not (name == "triton_fused_ops" and
                                                                   self.triton_fused_ops is None):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.cuda_graphs and not self.enforce_eager and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("cuda_graphs does not combine with tensor or pipeline parallelism yet (each rank would "
                              "need its own graphs); turn cuda_graphs off, or use one process.")
        self.capture_sizes()
        if self.speculative is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            # The draft model and the rejection sampler run on rank 0 only; a self-draft would need the
            # sharded target's first layers on every rank. Not built yet.
            raise ConfigError("speculative decoding does not combine with tensor or pipeline parallelism yet; "
                              "use tensor_parallel_size=1 and pipeline_parallel_size=1, or turn speculation off.")

        if self.async_output_processing and self.speculative is not None:
            # The proposer guesses from the tokens of the step just verified: with async output processing the
            # engine thread has them a step late.
            raise ConfigError("async_output_processing (--async-output-processing) does not combine with "
                              "speculative decoding: the proposer needs the tokens of the step just verified, "
                              "which async output processing knows a step later. Use "
                              "--no-async-output-processing, or turn speculation off.")
        if self.async_output_processing and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("async_output_processing (--async-output-processing) does not combine with tensor or "
                              "pipeline parallelism yet; use --no-async-output-processing, or tensor_parallel_size=1 "
                              "and pipeline_parallel_size=1.")

    def capture_sizes(self) -> Optional[list[int]]:
        """``cudagraph_capture_sizes`` as sorted batch sizes (given as a list, or "1,2,4,8" on the command line);
        None: the default list (kernels/backends/cuda_graphs.py). Raises ConfigError."""
        value = self.cudagraph_capture_sizes
        if value is None:
            return None
        items = value.split(",") if isinstance(value, str) else value
        try:
            sizes = sorted({int(str(item).strip()) for item in items})
        except (TypeError, ValueError):
            sizes = []
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"cudagraph_capture_sizes must be positive batch sizes like '1,2,4,8' (or a list of "
                              f"ints), got {value!r}.")
        return sizes

    @property
    def speculative(self) -> "Optional[SpeculativeConfig]":
        """``speculative_config`` checked and with vLLM's defaults filled in (None: no speculation)."""
        from .spec_decode.config import SpeculativeConfig
        return SpeculativeConfig.parse(self.speculative_config)

    def finalize(self, model_max_len: int, device_type: str = "cpu") -> None:
        """Fill in the derived values once the model's context length (and the device: ``cuda``, ``cpu`` ...) is
        known."""
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = LONG_PREFILL_CPU if device_type == "cpu" else 0
        if self.fair_share is None:
            self.fair_share = False
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len={self.max_model_len} is longer than the model's context ({model_max_len}); "
                f"use max_model_len <= {model_max_len}.")
        if self.max_num_batched_tokens is None:
            # Without chunking a whole prompt must fit one step (vLLM's rule), so the budget grows to max_model_len.
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill disabled every prompt must fit one step, but max_num_batched_tokens="
                f"{self.max_num_batched_tokens} < max_model_len={self.max_model_len}. Enable chunked prefill, "
                f"raise max_num_batched_tokens, or lower max_model_len.")
