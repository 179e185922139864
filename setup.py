"""Why a setup.py next to pyproject.toml: the package list is found here, from the source tree.

pyproject.toml maps four top-level folders into one namespace (``[tool.setuptools.package-dir]``:
``kernels/`` is installed as ``minipaged.kernels``, ``tui/`` as ``minipaged.tui``, ``lessons/`` as
``minipaged.lessons``), and setuptools' own ``packages.find`` cannot give the folders it finds those names.
A hand-kept list in pyproject.toml once missed ``kernels/backends/`` and ``tui/widgets/``: the wheel built,
and failed at import. So every folder under the four is a package here, data folders (``web/static/``)
included, whose files the package data in pyproject.toml then ships. ``tests/test_wheel.py`` builds and
installs the wheel to keep this true.
"""
from setuptools import find_namespace_packages, setup
from setuptools.config.pyprojecttoml import read_configuration

FOLDERS = read_configuration("pyproject.toml", expand=False)["tool"]["setuptools"]["package-dir"]


def packages() -> list[str]:
    """Each mapped package and every folder below it, by its installed name (``__pycache__`` is no package)."""
    found = []
    for name, folder in FOLDERS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"]))]
    return found


setup(packages=packages())
