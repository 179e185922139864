"""Where minipaged keeps what it makes once per machine: converted models, compiled kernels, measured verdicts.

A module of its own, importing nothing of the project, because both the model loader and kernels/ need it and
neither may import the other for it (kernels/build.py once reached it through ``minipaged.model``, whose
``__init__`` imports the model, which imports kernels/: a loop).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$MINIPAGED_CACHE``, else the user's cache folder (``~/.cache/minipaged`` on Linux)."""
    env = os.environ.get("MINIPAGED_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("minipaged"))
