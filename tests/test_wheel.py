"""The wheel works: built from the sources, installed without ``-e`` into a fresh virtual environment, run from
another folder.

Every doc installs with ``-e``, which reads the source tree itself, so a wheel that lacks a folder
(``kernels/backends/`` and ``tui/widgets/`` once) or a data file still passes every other test. Here the
wheel is built offline (``pip wheel --no-build-isolation``: the build tools are the test environment's own),
installed by pip into a venv of its own whose only other path is this environment's site-packages (for
torch and the rest; its ``.pth`` files, the editable install's among them, are not run from there), and
then: every module imports from the installed copy, ``minipaged --help`` answers, ``minipaged generate``
runs a tiny checkpoint, and ``minipaged watch --replay --no-tui`` and ``minipaged export-html`` of a recorded
trace give what the source tree gives.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "data" / "watch_trace.jsonl"
# What the wheel is built from: the four package folders pyproject.toml maps, and the files the build reads.
FOLDERS = {"minipaged": "minipaged", "kernels": "minipaged/kernels", "tui": "minipaged/tui",
           "lessons": "minipaged/lessons"}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")

# Run by the installed interpreter: every module of the package imports, and from the installed copy (walking the
# packages imports each of them first: a missing subpackage fails here).
IMPORT_EVERYTHING = """
import importlib, pathlib, pkgutil, sys
import minipaged
home = pathlib.Path(minipaged.__file__).resolve()
assert home.is_relative_to(pathlib.Path(sys.prefix).resolve()), f"minipaged came from {home}, not the venv"
names = [m.name for m in pkgutil.walk_packages(minipaged.__path__, "minipaged.")
         if not m.name.endswith(".__main__")]                  # those run a command
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as missing:       # Triton is the [gpu] extra: a machine without it skips its module
        if missing.name != "triton":
            raise
        continue
    assert pathlib.Path(module.__file__).resolve().is_relative_to(home.parent), (name, module.__file__)
print(len(names), "modules")
"""


def run(command: list, *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def site_packages_of(python: str, cwd: Path) -> list[str]:
    """The site-packages folders an interpreter imports from (a worktree's venv may chain to another's)."""
    done = run([python, "-c", "import sys; print('\\n'.join(sys.path))"], cwd=cwd)
    return [p for p in done.stdout.splitlines() if Path(p).name in ("site-packages", "dist-packages")]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a copy of the sources (no stale build/ folder of the checkout can slip in), and the
    build's log."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=SKIPPED)
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, source / name)
    done = run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-index", "--no-build-isolation",
                "--wheel-dir", work / "dist", source], cwd=work)
    wheels = list((work / "dist").glob("minipaged-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], done.stdout + done.stderr


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed by pip (not editable), reusing this environment's dependencies."""
    wheel, _ = built
    where = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", where / "env"], cwd=where)
    python = where / "env" / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=where)
    # After the install, so that pip saw an empty environment: the dependencies come from here, as paths only.
    own = site_packages_of(str(python), where)
    (Path(own[0]) / "outer_dependencies.pth").write_text("\n".join(site_packages_of(sys.executable, where)) + "\n")
    return where / "env"


def test_the_build_warns_of_nothing(built):
    """setuptools' warnings (``SetuptoolsDeprecationWarning: ...``, ``_Warning: Package ... is absent``) and
    distutils' (``warning: build_py: ...``); pip's own ``WARNING:`` lines are about the machine, not the project."""
    _, log = built
    warnings = [line for line in log.splitlines() if re.search(r"Warning\b|warning:", line)]
    assert not warnings, "the wheel's build warns:\n" + "\n".join(warnings)


def test_the_wheel_holds_every_file_of_the_package_folders(built):
    """Modules, the C kernels, the web page, the TUI's stylesheets, the lessons' texts and data: all of them."""
    wheel, _ = built
    inside = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
                for folder, installed in FOLDERS.items() for path in (ROOT / folder).rglob("*")
                if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}
    missing = sorted(expected - inside)
    assert not missing, f"the wheel lacks {len(missing)} files: {missing[:20]}"


def test_the_installed_wheel_imports_and_runs_from_another_folder(venv, tiny_model, tmp_path):
    python, minipaged = venv / "bin" / "python", venv / "bin" / "minipaged"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert "modules" in run([python, "-c", IMPORT_EVERYTHING], cwd=elsewhere).stdout
    assert "generate" in run([minipaged, "--help"], cwd=elsewhere).stdout
    generated = run([minipaged, "generate", "--model", tiny_model, "--max-tokens", "4", "--no-chat",
                     "--block-size", "4", "--num-blocks", "32", "--threads", "1", "hello"], cwd=elsewhere)
    assert generated.stdout.strip(), generated.stderr[-2000:]
    # The replay prints the same lines as the source tree's own command, and the one-file web view (the page's
    # static files inlined) is the same file.
    replay = ["watch", "--replay", TRACE, "--no-tui"]
    installed = run([minipaged, *replay], cwd=elsewhere).stdout
    from_source = run([sys.executable, "-m", "minipaged", *replay], cwd=ROOT).stdout
    assert "done:" in installed and installed == from_source
    run([minipaged, "export-html", TRACE, "-o", elsewhere / "installed.html"], cwd=elsewhere)
    run([sys.executable, "-m", "minipaged", "export-html", TRACE, "-o", elsewhere / "source.html"], cwd=ROOT)
    assert (elsewhere / "installed.html").read_bytes() == (elsewhere / "source.html").read_bytes()
