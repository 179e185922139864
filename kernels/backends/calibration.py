"""Which compiled CPU ops are faster than torch on this machine: measured once, cached.

The C kernels were tuned on an AVX-512 CPU; on another CPU (AVX2 only, say) torch may be faster at some of
them, for instance at few-row matmuls with the weights stored [in, out]. So the cpu backend races each op it
offers against torch on the model's own shapes, the first time a model starts on a machine, and uses the
compiled op only where it won. The race is short (a handful of interleaved repetitions, the median kept;
well under 3 s for SmolLM2), and its verdict (a ``CpuChoice``) is cached in minipaged's cache folder
(``$MINIPAGED_CACHE`` or the user cache dir) under a key made of the CPU, the compiled library's build
(sources, compiler, flags), torch's version, the thread count and the shapes: a change of any of them measures
again. Whether a decode step of a few rows runs as one compiled call (cpu_decode_layers.c) is not read off the
per-op verdicts: it is raced as a whole step both ways (step_race.py), since a near-tie on one small op (SiLU,
0.127 against 0.137 ms, measured on a busy machine) said nothing about the step, yet used to turn the loop off.
A race whose repeats disagree (the machine was busy: NOISE_SPREAD) is run again, up to NOISE_RETRIES times; a
calibration still noisy after that is used for this run but not cached, so that a quiet start measures again.
The engine option ``cpu_ops="compiled"`` (or ``"torch"``; ``--cpu-ops`` on the command line) skips the race
and takes every op from one side; the test suite makes ``compiled`` its default (``DEFAULT_CPU_OPS``, set by
tests/conftest.py), so that every compiled op is exercised whatever the machine.

The weights are read from a buffer larger than the processor's caches, window after window, as a decode step
reads 30 layers' weights from memory: timing one small matrix over and over would measure it in cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .base import ModelShapes

COMPILED, TORCH, IN_OUT = "compiled", "torch", "torch [in, out]"
FIXED_POINT = "compiled, fixed point"        # int8_one_row: the int8 loop over activations in fixed point
LAYER_OPS = ("add_rms_norm", "rope_and_write_kv", "silu_and_mul")
CALIBRATION_VERSION = 5       # 2: batch_linear; 3: int8_batch_linear; 4: int8_one_row; 5: decode_step, noise
FEW_ROWS, MANY_ROWS = (1, 4), 32           # token rows a decode step of one or a few requests has; a batch
STREAM_BYTES = 64 * 2**20                   # more than a last-level cache: weights come from memory
REPEATS = 5
RACE_BUDGET_S = 0.5                         # per op: see race()
LARGE_BATCH_SLACK = 1.1                     # a layout may cost many-row steps at most this much more
# A race is noisy when, for some option, (second slowest - fastest repeat) / median exceeds this: a quiet machine's
# repeats of a milliseconds-long sample agree within a few percent; a busy one's differ by 2x or more.
NOISE_SPREAD = 0.5
NOISE_RETRIES = 2                           # a noisy race runs again at most this many times
MIN_SAMPLES_FOR_SPREAD = 3                  # fewer repeats (a race cut short by its budget) say nothing of noise

MEASURE = "measure"
# What cpu_ops=None means (minipaged.config.CpuOps): measure. The test suite's conftest sets COMPILED instead.
DEFAULT_CPU_OPS = MEASURE

# (op, option, run) -> seconds that one call of ``run`` took. The real one is a wall clock; tests pass a fake.
Timer = Callable[[str, str, Callable[[], Any]], float]


@dataclass(frozen=True)
class CpuChoice:
    """Which side runs each op: COMPILED or TORCH (few_row_linear may also be IN_OUT: torch, weights [in, out];
    int8_one_row is FIXED_POINT or COMPILED, two compiled loops: the activations in fixed point, or widening)."""

    decode_attention: str = COMPILED
    few_row_linear: str = COMPILED
    batch_linear: str = COMPILED
    int8_batch_linear: str = COMPILED       # --quantization int8, 8+ rows: the tiled int8 multiply or widening
    int8_one_row: str = FIXED_POINT         # --quantization int8, 1-3 rows: which of the two one-row loops
    lm_head: str = COMPILED
    add_rms_norm: str = COMPILED
    rope_and_write_kv: str = COMPILED
    silu_and_mul: str = COMPILED
    argmax: str = COMPILED
    decode_step: str = COMPILED             # decode steps of 1-7 rows: the compiled layer loop, or op by op

    def describe(self) -> str:
        names = {"decode_attention": "decode attention", "few_row_linear": "1-7 row matmuls",
                 "batch_linear": "matmuls of 8+ rows", "int8_batch_linear": "8+ row int8 matmuls",
                 "lm_head": "LM head",
                 "add_rms_norm": "norms", "rope_and_write_kv": "RoPE + K/V write", "silu_and_mul": "SiLU",
                 "argmax": "argmax"}
        # (int8_one_row picks between two compiled loops: the backend's int8 clause names the one it runs)
        # (nor decode_step: the backend's own clause says whether the layer loop runs as one call)
        fields = [f.name for f in dataclasses.fields(self) if f.name not in ("int8_one_row", "decode_step")]
        compiled = [names[name] for name in fields if getattr(self, name) == COMPILED]
        torch_side = [names[name] + (" (weights stored [in, out])" if getattr(self, name) == IN_OUT else "")
                      for name in fields if getattr(self, name) != COMPILED]
        return (f"compiled C kernels for {', '.join(compiled) or 'nothing'}"
                + (f"; torch for {', '.join(torch_side)}" if torch_side else ""))


# Every op torch's, except the choice between two compiled loops that torch has no counterpart for.
ALL_TORCH = CpuChoice(**{f.name: TORCH for f in dataclasses.fields(CpuChoice) if f.name != "int8_one_row"})


def wall_clock(op: str, option: str, run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def race(op: str, options: dict[str, Callable[[], Any]], timer: Timer, repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds of each option (``race_samples``' medians)."""
    return {name: statistics.median(times) for name, times in race_samples(op, options, timer, repeats).items()}


def race_samples(op: str, options: dict[str, Callable[[], Any]], timer: Timer,
                 repeats: int = REPEATS) -> dict[str, list[float]]:
    """Seconds of each repeat of each option, the options interleaved (a machine's slow moments hit them all);
    kept apart so that ``SteadyRaces`` can tell whether the repeats agree. A race that has taken RACE_BUDGET_S
    stops after the round it is in: on a crowded machine an op can take 100 times its usual time (measured:
    OpenMP threads waiting for a busy core), and start-up must not wait for it."""
    start = time.perf_counter()
    for run in options.values():
        run()                                   # warm: first-call costs are not the op's
    samples: dict[str, list[float]] = {name: [] for name in options}
    for _ in range(repeats):
        for name, run in options.items():
            samples[name].append(timer(op, name, run))
        if time.perf_counter() - start > RACE_BUDGET_S:
            break
    return samples


def spread(samples: list[float]) -> float:
    """How far one option's repeats disagree: (second slowest - fastest) / median, so that one hiccup (a timer
    interrupt in a sample of microseconds) is forgiven and a busy machine's many are not; 0 for too few repeats."""
    if len(samples) < MIN_SAMPLES_FOR_SPREAD:
        return 0.0
    ordered = sorted(samples)
    return (ordered[-2] - ordered[0]) / max(statistics.median(ordered), 1e-12)


class SteadyRaces:
    """Runs races again while their repeats disagree (the machine is busy), and notes the ones that never
    settled: a calibration with any such race is used but not cached (``calibrated_choice``)."""

    def __init__(self, timer: Timer, retries: int = NOISE_RETRIES) -> None:
        self.timer, self.retries = timer, retries
        self.noisy: dict[str, float] = {}           # op -> the spread of its last try, for those that stayed noisy
        self.retried = 0                            # races run again, in all

    def race(self, op: str, options: dict[str, Callable[[], Any]]) -> dict[str, float]:
        for attempt in range(self.retries + 1):
            samples = race_samples(op, options, self.timer)
            worst = max(spread(times) for times in samples.values())
            if worst <= NOISE_SPREAD:
                self.noisy.pop(op, None)
                break
            self.noisy[op] = worst
            if attempt < self.retries:
                self.retried += 1
        return {name: statistics.median(times) for name, times in samples.items()}


def fastest(times: dict[str, float]) -> str:
    return min(times, key=times.__getitem__)


class _Windows:
    """Matrices of one shape cut one after another from a big buffer: each call reads the next (cold) one."""

    def __init__(self, buffer: torch.Tensor, out_features: int, in_features: int) -> None:
        self.n, self.shape = out_features * in_features, (out_features, in_features)
        self.count, self.buffer, self.next = max(1, buffer.numel() // self.n), buffer, 0

    def take(self, in_out: bool = False) -> torch.Tensor:
        start = (self.next % self.count) * self.n
        self.next += 1
        flat = self.buffer[start:start + self.n]
        return flat.view(self.shape[1], self.shape[0]).t() if in_out else flat.view(self.shape)


class _Layers:
    """The layers' matrices end to end, layer after layer, as the engine places its weights (``store_weights_for``),
    cut from a big buffer and walked in that order, wrapping around: ``take`` gives the next matrix. Where a loop
    asks for its weights ahead of use, what lies after a matrix (the next one, or anything) changes its speed."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, int]]) -> None:
        self.buffer, self.shapes, self.next, self.offset = buffer, shapes, 0, 0

    def take(self) -> torch.Tensor:
        rows, cols = self.shapes[self.next % len(self.shapes)]
        if self.offset + rows * cols > self.buffer.numel():
            self.offset = 0
        matrix = self.buffer[self.offset:self.offset + rows * cols].view(rows, cols)
        self.offset += rows * cols
        self.next += 1
        return matrix


def on_huge_pages(buffer: torch.Tensor) -> torch.Tensor:
    """The race's weights in the memory the engine keeps its own in (``Backend.weight_placer``: on Linux, huge
    pages). It matters to the verdict: the int8 one-row loops ask for their weights 4 KB ahead, which on 4 KB pages
    runs into a page not yet in the TLB at every step. Measured on the CI machine, one token row over SmolLM2-shaped
    int8 layers (64 MB), fixed point and widening: 2.67 and 2.57 ms on 4 KB pages, 2.26 and 2.30 ms on huge pages."""
    from ..huge_pages import copies_on_huge_pages
    return copies_on_huge_pages([buffer])[0]


def calibrate(shapes: ModelShapes, head_dim: int, timer: Timer = wall_clock,
              races: Optional[SteadyRaces] = None) -> tuple[CpuChoice, dict[str, Any]]:
    """Race every compiled op against torch on ``shapes``; the verdict and the medians (ms). ``races`` (by default
    a fresh ``SteadyRaces`` over ``timer``) runs each race, and afterwards says which stayed noisy. The verdict's
    ``decode_step`` is the old rule (every op the C loop replays won); ``calibrated_choice`` races the step."""
    races = races or SteadyRaces(timer)
    from ..cpu_argmax import CpuArgmax
    from ..cpu_layer_ops import cpu_layer_ops
    from ..cpu_linear import compiled_linear
    from ..cpu_paged_attention import paged_decode_attention_cpu
    from ..reference import paged_attention_torch, plan_torch_attention
    from ..torch_ops import TORCH_LAYER_OPS, vocab_sliced_linear

    matvec, compiled_ops = compiled_linear(head_dim), cpu_layer_ops(head_dim)
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = shapes.hidden_size, shapes.vocab_size
    buffer = on_huge_pages(torch.randn(max(STREAM_BYTES // 4, vocab * hidden), generator=gen))
    windows = [_Windows(buffer, *shape) for shape in shapes.matrices().values()]
    few = {(rows, width): torch.randn(rows, width, generator=gen)
           for rows in (*FEW_ROWS, MANY_ROWS) for width in {w.shape[1] for w in windows}}

    # Each sample reads as many layers' weights as STREAM_BYTES holds: long enough (milliseconds) that a busy
    # machine's hiccups do not decide the race, as a decode step reads them.
    layers_per_sample = max(1, STREAM_BYTES // (4 * sum(w.n for w in windows)))

    def layer_matmuls(rows_set: tuple[int, ...], how: str) -> Callable[[], None]:
        def run() -> None:
            for rows, _layer in itertools.product(rows_set, range(layers_per_sample)):
                for w in windows:
                    x = few[rows, w.shape[1]]
                    if how == COMPILED:
                        matvec(x, w.take())
                    else:
                        F.linear(x, w.take(in_out=how == IN_OUT))
        return run

    verdict: dict[str, str] = {}
    times: dict[str, dict[str, float]] = {}
    times["few_row_linear"] = races.race("few_row_linear",
                                         {o: layer_matmuls(FEW_ROWS, o) for o in (COMPILED, TORCH, IN_OUT)})
    times["many_row_linear"] = races.race("many_row_linear",
                                          {o: layer_matmuls((MANY_ROWS,), o) for o in (COMPILED, TORCH, IN_OUT)})
    many = times["many_row_linear"]
    verdict["batch_linear"] = COMPILED if many[COMPILED] < min(many[TORCH], many[IN_OUT]) else TORCH
    candidates = dict(times["few_row_linear"])
    if many[IN_OUT] > LARGE_BATCH_SLACK * many[TORCH] or verdict["batch_linear"] == COMPILED:
        # Faster for a few rows, but slower for a batch (or it would keep a batch from the tiled multiply, which
        # reads the weights [out, in]): not worth it.
        candidates.pop(IN_OUT)
    verdict["few_row_linear"] = fastest(candidates)

    # Int8 weights (--quantization int8) for 8+ rows: the tiled int8 multiply against the weights widened to
    # fp32 a slice at a time for torch's matmul. The values do not matter to the time: random bytes, scale 1.
    from ..int8 import Int8Linear, Int8Weight, int8_linear_torch
    int8_buffer = on_huge_pages(torch.randint(-127, 128, (max(STREAM_BYTES, vocab * hidden),), dtype=torch.int8,
                                              generator=gen))
    int8_windows = [_Windows(int8_buffer, *shape) for shape in shapes.matrices().values()]
    int8_scales = {w.shape[0]: torch.ones(w.shape[0]) for w in int8_windows}
    int8_layers_per_sample = max(1, STREAM_BYTES // sum(w.n for w in int8_windows))
    tiled_int8 = Int8Linear(F.linear, head_dim, compiled=True, tiled_many_rows=True)

    def int8_matmuls(how: str) -> Callable[[], None]:
        def run() -> None:
            for _layer in range(int8_layers_per_sample):
                for w in int8_windows:
                    weight = Int8Weight(w.take(), int8_scales[w.shape[0]])
                    x = few[MANY_ROWS, w.shape[1]]
                    tiled_int8(x, weight) if how == COMPILED else int8_linear_torch(x, weight)
        return run
    times["int8_batch_linear"] = races.race("int8_batch_linear", {o: int8_matmuls(o) for o in (COMPILED, TORCH)})
    verdict["int8_batch_linear"] = fastest(times["int8_batch_linear"])

    # Int8 weights for one request's decode (1-3 rows): the two one-row loops, each reading a decode step's
    # matrices cold, in the engine's order: as many layers as the buffer holds, then the LM head (a fifth of
    # SmolLM2's int8 bytes; leaving it out made the race a tie that the engine's steps were not).
    one_row_loops = {FIXED_POINT: Int8Linear(F.linear, head_dim, compiled=True, fixed_point=True),
                     COMPILED: Int8Linear(F.linear, head_dim, compiled=True, fixed_point=False)}
    step_shapes = [w.shape for w in int8_windows] * int8_layers_per_sample + [(vocab, hidden)]
    layers, int8_scales[vocab] = _Layers(int8_buffer, step_shapes), torch.ones(vocab)

    def int8_one_row(how: str) -> Callable[[], None]:
        def run() -> None:
            for _matrix in step_shapes:
                w = layers.take()
                x = few[MANY_ROWS, w.shape[1]][:1]                  # one token row
                one_row_loops[how](x, Int8Weight(w, int8_scales[w.shape[0]]))
        return run
    times["int8_one_row"] = races.race("int8_one_row", {o: int8_one_row(o) for o in (FIXED_POINT, COMPILED)})
    verdict["int8_one_row"] = fastest(times["int8_one_row"])

    head = _Windows(buffer, vocab, hidden)
    xs = [torch.randn(rows, hidden, generator=gen) for rows in FEW_ROWS]
    times["lm_head"] = races.race("lm_head", {
        COMPILED: lambda: [matvec(x, head.take()) for x in xs],
        TORCH: lambda: [vocab_sliced_linear(x, head.take()) for x in xs]})

    rows16 = 16
    residual, delta = torch.randn(rows16, hidden, generator=gen), torch.randn(rows16, hidden, generator=gen) * 1e-3
    norm_weight = torch.ones(hidden)
    qkv_width = shapes.matrices()["qkv"][0]
    qkv = torch.randn(rows16, qkv_width, generator=gen)
    angles = torch.rand(rows16, head_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    caches = torch.zeros(2, 64, 16, shapes.num_kv_heads, head_dim)
    slots = torch.arange(rows16, dtype=torch.int64)
    gate_up = torch.randn(rows16, 2 * shapes.intermediate_size, generator=gen)

    def layer_op(name: str, ops: Any) -> Callable[[], None]:
        def run() -> None:
            for rows in (1, rows16):
                for _ in range(10):             # microseconds each: time several
                    if name == "add_rms_norm":
                        ops.add_rms_norm(residual[:rows], delta[:rows], norm_weight, 1e-5)
                    elif name == "rope_and_write_kv":
                        ops.rope_and_write_kv(qkv[:rows], cos[:rows], sin[:rows], caches[0], caches[1], slots[:rows],
                                              shapes.num_heads, shapes.num_kv_heads)
                    else:
                        ops.silu_and_mul(gate_up[:rows])
        return run

    for name in LAYER_OPS:
        times[name] = races.race(name, {COMPILED: layer_op(name, compiled_ops),
                                        TORCH: layer_op(name, TORCH_LAYER_OPS)})

    logits = torch.randn(rows16, vocab, generator=gen)
    compiled_argmax = CpuArgmax(head_dim)
    times["argmax"] = races.race("argmax", {COMPILED: lambda: compiled_argmax(logits),
                                            TORCH: lambda: logits.argmax(dim=-1)})

    num_reqs, context, block_size = 8, 200, 16
    blocks_each = -(-context // block_size)
    k_cache = torch.randn(num_reqs * blocks_each, block_size, shapes.num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_reqs * blocks_each, generator=gen).view(num_reqs, blocks_each).to(torch.int32)
    q = torch.randn(num_reqs, shapes.num_heads, head_dim, generator=gen)
    seq_lens, starts = [context] * num_reqs, list(range(num_reqs + 1))
    seq_t, starts_t = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
    plan = plan_torch_attention(tables, block_size, seq_lens, starts)

    def attend(decode: Any) -> Callable[[], None]:
        return lambda: paged_attention_torch(q, k_cache, v_cache, tables, seq_t, starts_t, head_dim ** -0.5,
                                             plan=plan, decode_attention=decode)
    times["decode_attention"] = races.race("decode_attention", {COMPILED: attend(paged_decode_attention_cpu),
                                                                TORCH: attend(None)})
    for name in ("lm_head", *LAYER_OPS, "argmax", "decode_attention"):
        verdict[name] = fastest(times[name])
    replayed = ("decode_attention", *LAYER_OPS)
    verdict["decode_step"] = COMPILED if all(verdict[name] == COMPILED for name in replayed) else TORCH
    return CpuChoice(**verdict), in_ms(times)


def in_ms(times: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {op: {o: round(t * 1e3, 4) for o, t in by_option.items()} for op, by_option in times.items()}


def calibration_key(shapes: ModelShapes, head_dim: int) -> str:
    from ..build import library_identity
    text = json.dumps([CALIBRATION_VERSION, library_identity(), dataclasses.asdict(shapes), head_dim,
                       torch.get_num_threads()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_folder() -> Path:
    from minipaged.cache import cache_root
    return cache_root() / "calibration"


# (choice, races) -> the step race's verdict (COMPILED: the layer loop as one call; TORCH: op by op) and its
# medians (ms), or None where the loop cannot run with this choice. step_race.race_decode_step is the real one.
StepRace = Callable[[CpuChoice, SteadyRaces], Optional[tuple[str, dict[str, dict[str, float]]]]]


def measure(shapes: ModelShapes, head_dim: int, timer: Timer,
            step_race: Optional[StepRace] = None) -> tuple[CpuChoice, dict[str, Any], SteadyRaces]:
    """``calibrate``, then (given ``step_race``) the whole decode step raced both ways, which decides
    ``decode_step`` in place of the per-op rule (kept only where the step cannot be raced: fp32 weights stored
    [in, out], which the loop does not read, leave it to int8 weights); the races, to ask which stayed noisy."""
    races = SteadyRaces(timer)
    choice, medians_ms = calibrate(shapes, head_dim, timer, races)
    raced = step_race(choice, races) if step_race is not None else None
    if raced is not None:
        choice = dataclasses.replace(choice, decode_step=raced[0])
        medians_ms.update(raced[1])
    return choice, medians_ms, races


def calibrated_choice(shapes: ModelShapes, head_dim: int, timer: Optional[Timer] = None,
                      cpu_ops: Optional[str] = None, step_race: Optional[StepRace] = None,
                      remeasure: bool = False, record: Optional[dict[str, Any]] = None) -> tuple[CpuChoice, str]:
    """The verdict for these shapes on this machine (cached, else measured now with ``timer``, by default the
    wall clock) and where it came from; ``cpu_ops`` (the engine option, None: ``DEFAULT_CPU_OPS``) may take
    every op from one side instead, without measuring. ``step_race`` decides the compiled layer loop by timing
    the whole decode step (``measure``); ``remeasure`` ignores a cached verdict and overwrites it
    (``minipaged bench calibrate``, which also passes ``record``: filled with what was measured, cached or not).
    A measurement whose races stayed noisy is used but not cached."""
    forced = DEFAULT_CPU_OPS if cpu_ops is None else cpu_ops
    if forced == COMPILED:
        return CpuChoice(), "every op compiled: cpu_ops='compiled'"
    if forced == TORCH:
        return ALL_TORCH, "every op torch's: cpu_ops='torch'"
    if forced != MEASURE:
        raise ValueError(f"cpu_ops must be 'measure', 'compiled' or 'torch', got {forced!r}")
    path = cache_path(shapes, head_dim)
    if not remeasure and (cached := read_cached(path)) is not None:
        return CpuChoice(**cached["choice"]), f"measured on this machine earlier: {path}"
    start = time.perf_counter()
    # (the module's wall_clock looked up now, not bound at definition: tests replace it)
    choice, medians_ms, races = measure(shapes, head_dim, timer or wall_clock, step_race)
    seconds = time.perf_counter() - start
    measured = {"choice": dataclasses.asdict(choice), "median_ms": medians_ms, "seconds": round(seconds, 2),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "shapes": dataclasses.asdict(shapes),
                "retried": races.retried}
    if record is not None:
        record.update(measured, noisy=dict(races.noisy))
    if races.noisy:
        worst = ", ".join(f"{op} {spread:.0%}" for op, spread in sorted(races.noisy.items()))
        return choice, (f"measured now in {seconds:.1f} s, not cached: the machine was busy (repeats disagreed "
                        f"after {races.retried} retries: {worst}); the next start measures again")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(measured, indent=1))
        os.replace(tmp, path)
    except OSError:
        return choice, f"measured now in {seconds:.1f} s (not cached: {path.parent} is not writable)"
    return choice, f"measured now in {seconds:.1f} s, cached in {path}"


def cache_path(shapes: ModelShapes, head_dim: int) -> Path:
    return cache_folder() / f"{calibration_key(shapes, head_dim)}.json"


def read_cached(path: Path) -> Optional[dict[str, Any]]:
    """The cached record (its ``choice`` a valid CpuChoice), or None: not measured yet, or unreadable."""
    try:
        record = json.loads(path.read_text())
        CpuChoice(**record["choice"])
        return record
    except (OSError, ValueError, TypeError, KeyError):
        return None
