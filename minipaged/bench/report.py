"""What every bench shares on the way out: a progress bar, the JSON result, and the picture.

matplotlib is imported only when a picture is asked for (it is in the ``test`` extra, not a core
dependency), and its absence is reported before the benchmark runs, not after.
"""
from __future__ import annotations

import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .requests import BenchError

err = Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on standard error; yields ``advance(n)``. Hidden when stderr is not a terminal."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def machine() -> dict[str, Any]:
    import torch
    return {"machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


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
