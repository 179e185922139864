"""What docs/architecture.md's rules of the house claim, checked on the code, so that the page stays true.

* Device specifics live in kernels/: no module of ``minipaged/`` (but ``parallel/``, which picks NCCL or gloo,
  and ``bench/``, which names the machine it measured) tests a device's type or asks torch.cuda, and kernels/ imports nothing of the engine but its options' names
  and its cache folder.
* One spelling for each list of names: the backends' (``config.AttentionBackend``) and the server's defaults
  (``serve.limits.ServerSettings``).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

ROOT = Path(__file__).resolve().parent.parent
# minipaged/parallel/ starts processes and process groups: NCCL on CUDA, gloo elsewhere; minipaged/bench/ names the
# machine and card a result was measured on (architecture.md says so).
DEVICE_NAMING_ALLOWED = {"parallel", "bench"}
DEVICE_TYPES = {"cpu", "cuda", "mps", "xpu", "hip"}


def device_tests(path: Path) -> list[str]:
    """Where a file asks what a device is: ``x.type`` compared with a device's name, ``x.is_cuda``,
    ``torch.cuda...``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
        if any(isinstance(side, ast.Attribute) and side.attr == "type" for side in sides) and \
                any(isinstance(side, ast.Constant) and side.value in DEVICE_TYPES for side in sides):
            found.append(f"{path.name}:{node.lineno} compares a .type")
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            found.append(f"{path.name}:{node.lineno} asks .is_cuda")
        elif isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            found.append(f"{path.name}:{node.lineno} asks torch.cuda")
    return found


def test_no_engine_module_tests_a_device():
    package = ROOT / "minipaged"
    offenders = [where for path in sorted(package.rglob("*.py"))
                 if path.relative_to(package).parts[0] not in DEVICE_NAMING_ALLOWED for where in device_tests(path)]
    assert not offenders, f"device specifics outside kernels/ (move them to kernels/devices.py): {offenders}"


def test_the_device_check_sees_each_way_of_asking(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nif d.type == 'cuda': pass\nx = t.is_cuda\ntorch.cuda.is_available()\n")
    assert len(device_tests(probe)) == 3
    probe.write_text("import torch\nx = torch.zeros(1)\nif kind == 'cuda': pass\nif part.type != 'text': pass\n")
    assert device_tests(probe) == []


def test_kernels_import_nothing_of_the_engine_but_its_option_names_and_cache_folder():
    allowed = {"minipaged.config", "minipaged.cache"}
    taken = set()
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("minipaged."):
                if not node.module.startswith("minipaged.kernels"):
                    taken.add(node.module)
            elif isinstance(node, ast.Import):
                taken |= {a.name for a in node.names
                          if a.name.startswith("minipaged.") and not a.name.startswith("minipaged.kernels")}
    assert taken <= allowed, f"kernels/ imports {sorted(taken - allowed)} of the engine"


def test_backend_names_are_one_list():
    """The option's type, the flag's choices and the backends' own names are the same names."""
    from minipaged.cli import make_parser
    from minipaged.config import AttentionBackend
    from minipaged.kernels import Backend
    from minipaged.kernels.backends import BACKEND_NAMES

    def subclasses(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct, *subclasses(direct)}}
    assert BACKEND_NAMES == get_args(AttentionBackend)
    assert {cls.name for cls in subclasses(Backend)} == set(BACKEND_NAMES)
    flag = next(a for a in make_parser()._subparsers._group_actions[0].choices["generate"]._actions
                if "--attention-backend" in a.option_strings)
    assert tuple(flag.choices) == BACKEND_NAMES
    import minipaged.kernels as kernels
    assert not hasattr(kernels, "BACKENDS") and not hasattr(kernels, "choose_backend")   # tests/kernel_dispatch.py


def test_serve_flags_left_alone_give_the_servers_own_defaults():
    from minipaged.cli import make_parser
    from minipaged.serve import server_settings
    from minipaged.serve.limits import ServerSettings

    args = make_parser().parse_args(["serve", "--model", "m"])
    # Two follow from other flags by design: the Host check knows the address it listens on (an app built
    # in-process checks none), and a client's share of samples is half the queue, at least one request's n.
    derived = {"host": args.host, "max_client_samples": max(args.max_n, args.max_waiting_requests // 2)}
    assert server_settings(args) == ServerSettings(served_model_name="m", **derived)
