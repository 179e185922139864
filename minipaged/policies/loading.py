"""From an option's value to a policy class: a name from ``REGISTRY``, or ``path/to/file.py:ClassName``.

A user's class need not subclass the interface; it must have the interface's methods, taking the same
arguments. It is checked when the engine starts (a wrong signature, a constructor or a first call that
raises), so a misfit fails with one sentence that names the file, the class and the fix, before any
request runs.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from ..config import ConfigError
from ..request import Request, SamplingParams
from .eviction import FreeBlockQueue, LRUFreeBlockQueue, MRUFreeBlockQueue
from .order import FCFS, PriorityOrder, RequestOrder, ShortestPromptFirst
from .victim import LowestPriority, MostBlocks, Newest, VictimPolicy


class PolicyError(ConfigError):
    """A policy option names nothing usable; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class PolicyKind:
    option: str                                   # the EngineConfig field: scheduling_policy ...
    interface: type
    by_name: dict[str, type]
    methods: tuple[str, ...]                      # what the engine calls: a user's class must have them all
    trial: Callable[[type], Any]                  # build one and call it once: raises if it does not fit

    @property
    def flag(self) -> str:
        return "--" + self.option.replace("_", "-")


def _trial_request(index: int) -> Request:
    return Request(f"trial-{index}", [1, 2, 3 + index], SamplingParams(), index, 0.0)


def _trial_order(cls: type) -> Any:
    order, waiting = cls(), [_trial_request(0), _trial_request(1)]
    assert order.first(waiting) in waiting, "first(waiting) must return one of the waiting requests"
    return order


def _trial_victim(cls: type) -> Any:
    victim, running = cls(), [_trial_request(0), _trial_request(1)]
    assert victim.choose(running, lambda r: 1) in running, "choose(candidates, num_blocks) must return a candidate"
    return victim


def _trial_queue(cls: type) -> Any:
    """A queue of three blocks must give each back once, take frees at both ends and let one be removed."""
    queue = cls(range(3))
    assert len(queue) == 3 and 0 in queue, "a new queue of blocks 0, 1, 2 must hold all three"
    taken = sorted(queue.pop_front() for _ in range(3))
    assert taken == [0, 1, 2], f"pop_front gave {taken}, not each of the blocks 0, 1, 2 once"
    queue.push_back(1)
    queue.push_front(2)
    queue.remove(1)
    assert len(queue) == 1 and list(queue) == [2], "after push_back(1), push_front(2), remove(1) only 2 is left"
    return queue


REGISTRY: dict[str, PolicyKind] = {kind.option: kind for kind in (
    PolicyKind("scheduling_policy", RequestOrder,
               {c.name: c for c in (FCFS, PriorityOrder, ShortestPromptFirst)}, ("key", "first"), _trial_order),
    PolicyKind("preemption_victim", VictimPolicy,
               {c.name: c for c in (Newest, LowestPriority, MostBlocks)}, ("choose",), _trial_victim),
    PolicyKind("eviction_policy", FreeBlockQueue,
               {c.name: c for c in (LRUFreeBlockQueue, MRUFreeBlockQueue)},
               ("__len__", "__contains__", "__iter__", "pop_front", "push_back", "push_front", "remove"), _trial_queue),
)}


def policy_names(option: str) -> tuple[str, ...]:
    return tuple(REGISTRY[option].by_name)


def load_policy(option: str, value: str) -> type:
    """The class an option names (checked to fit its interface); raises PolicyError with the fix."""
    kind = REGISTRY[option]
    names = ", ".join(kind.by_name)
    if not isinstance(value, str):
        raise PolicyError(f"{option} must be a name ({names}) or 'path/to/file.py:ClassName', got {value!r}.")
    if value in kind.by_name:
        return kind.by_name[value]
    path, sep, class_name = value.rpartition(":")
    if not sep or not path.endswith(".py") or not class_name.isidentifier():
        raise PolicyError(f"{kind.flag} {value!r} is neither a policy ({names}) nor 'path/to/file.py:ClassName'.")
    cls = _class_from_file(kind, Path(path), class_name)
    _check_fits(kind, cls, value)
    return cls


def import_file(path: Path, prefix: str) -> ModuleType:
    """Import a user's .py file by its path as a module of its own (whatever its code raises propagates).

    It is registered in ``sys.modules`` under a name made from ``prefix`` and the file's path, because
    dataclasses and pickling look a class's module up by name."""
    module_name = f"{prefix}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _class_from_file(kind: PolicyKind, path: Path, class_name: str) -> type:
    if not path.is_file():
        raise PolicyError(f"{kind.flag}: no file {str(path)!r}; give the path of your .py file, then ':ClassName'.")
    try:
        module = import_file(path, f"minipaged_user_policy_{kind.option}")
    except Exception as e:
        raise PolicyError(f"{kind.flag}: importing {str(path)!r} raised {type(e).__name__}: {e}") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise PolicyError(f"{kind.flag}: {str(path)!r} has no class {class_name!r} (classes in it: "
                          f"{', '.join(found) or 'none'}).")
    return cls


def _check_fits(kind: PolicyKind, cls: type, value: str) -> None:
    """Every method of the interface present, taking the interface's arguments, and a trial run that works."""
    interface = kind.interface
    required = kind.methods
    for method in required:
        wanted = inspect.signature(getattr(interface, method))
        got = getattr(cls, method, None)
        if got is None or not callable(got):
            raise PolicyError(f"{kind.flag} {value}: the class has no method {method}{wanted}; a "
                              f"{interface.__name__} needs {', '.join(required)} (see minipaged.policies).")
        try:
            inspect.signature(got).bind(*wanted.parameters)
        except TypeError:
            raise PolicyError(f"{kind.flag} {value}: {cls.__name__}.{method}{inspect.signature(got)} does not take "
                              f"the arguments of {interface.__name__}.{method}{wanted}.") from None
        except ValueError:                          # a builtin without a signature: let the trial decide
            pass
    try:
        kind.trial(cls)
    except Exception as e:
        raise PolicyError(f"{kind.flag} {value}: a trial run of {cls.__name__} failed ({type(e).__name__}: {e}); "
                          f"it must behave like a {interface.__name__} (see minipaged.policies).") from e
