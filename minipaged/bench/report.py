"""What every bench shares on the way out: a progress bar, the JSON result, a table, and the picture.

Both homes of benchmarks use it: the ``minipaged bench`` commands (``write_json``) and the scripts in the
repository's ``bench/`` folder, which write the docs' figures to ``bench/out/NAME.json`` (``save``).

matplotlib is imported only when a picture is asked for (it is in the ``test`` extra, not a core
dependency), and its absence is reported before the benchmark runs, not after.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .requests import BenchError

err = Console(stderr=True)
# Where the repository's benchmark scripts (bench/*.py, run from a checkout) write the docs' figures.
BENCH_OUT = Path(__file__).resolve().parents[2] / "bench" / "out"


PLAIN_EVERY_S = 10.0       # without a terminal: one progress line this often (a log shows the run is alive)


class LiveProgress:
    """Requests done and output tokens per second so far, on standard error, while a bench runs: a rich bar
    on a terminal; otherwise (a log, CI, a pipe) a plain line every ``PLAIN_EVERY_S`` seconds and one at the
    end, so a run of minutes is never silent. Call it as ``advance(requests, tokens)``."""

    def __init__(self, description: str, total: int, progress: Optional[Progress] = None) -> None:
        self.description, self.total, self.progress = description, total, progress
        self.task = progress.add_task(description, total=total, rate="") if progress is not None else None
        self.requests = self.tokens = 0
        self.start = self.last_line = time.perf_counter()

    def __call__(self, requests: int = 0, tokens: int = 0) -> None:
        self.requests += requests
        self.tokens += tokens
        now = time.perf_counter()
        if self.progress is not None:
            self.progress.update(self.task, advance=requests, rate=f"{self.rate(now):.1f} tok/s")
        elif now - self.last_line >= PLAIN_EVERY_S:
            self.print_line(now)

    def rate(self, now: float) -> float:
        return self.tokens / max(now - self.start, 1e-9)

    def print_line(self, now: float, so_far: str = "so far") -> None:
        self.last_line = now
        print(f"{self.description}: {self.requests}/{self.total} requests, {self.tokens} output tokens, "
              f"{self.rate(now):.1f} tok/s {so_far} ({now - self.start:.0f} s)", file=sys.stderr, flush=True)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[LiveProgress]:
    """Live progress of ``total`` requests on standard error (see ``LiveProgress``); yields ``advance``."""
    if not err.is_terminal:
        live = LiveProgress(description, total)
        yield live
        live.print_line(time.perf_counter(), so_far="in all")
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err, transient=True) as progress:
        yield LiveProgress(description, total, progress)


def cpu_model_and_vectors() -> tuple[str, str]:
    """The processor's model name and its widest x86 vector extension (AVX-512, AVX2 or neither), from Linux's
    /proc/cpuinfo: compiled kernels tuned on one can lose on the other, so every measurement names it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    vectors = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return model, vectors if flags else "vector extensions unknown"


def machine() -> dict[str, Any]:
    import torch
    cpu, vectors = cpu_model_and_vectors()
    return {"machine": platform.machine(), "cpu": cpu, "vectors": vectors, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def machine_line() -> str:
    """The machine in one line, as the benchmark records and the docs print it."""
    m = machine()
    return (f"{m['machine']} {m['cpu']} ({m['vectors']}), {m['cpu_count']} cores, torch {m['torch']}, "
            f"{m['torch_threads']} threads, " + (m["gpu"] or "no GPU"))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], number: str = ".3g") -> str:
    """A markdown table; floats formatted with ``number`` (a format spec), everything else as ``str``."""
    def cell(v: Any) -> str:
        return format(v, number) if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (nan for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def save(name: str, record: dict[str, Any], markdown: str, out: Path = BENCH_OUT) -> None:
    """A benchmark script's result: ``out/NAME.json`` (what the docs render their figures from, with the machine
    and the time) and ``out/NAME.md`` (its table, for a quick look); the table is printed too."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_line(), "when": time.strftime("%Y-%m-%d %H:%M"), **record}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    (out / f"{name}.md").write_text(markdown + "\n")
    print(markdown)
    print(f"\n(saved {out / name}.json and .md; python bench/render_docs.py puts the figures in the docs)")


def write_json(path: Optional[str], record: dict[str, Any]) -> None:
    if path:
        record = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": machine(), **record}
        Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        err.print(f"[dim]wrote {path}[/]")


def check_plot_possible(path: Optional[str]) -> None:
    """Fail before the benchmark runs if the picture cannot be drawn."""
    if not path:
        return
    from minipaged.plot import PlotError, check_png_path, import_matplotlib
    try:
        check_png_path(path)
        import_matplotlib()
    except PlotError as e:
        raise BenchError(f"--plot: {e}") from None


def new_figure(num_axes: int, title: str) -> tuple[Any, Any]:
    from minipaged.plot import import_matplotlib
    import_matplotlib()
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, num_axes, figsize=(5 * num_axes, 4), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def save_figure(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    err.print(f"[dim]wrote {path}[/]")
