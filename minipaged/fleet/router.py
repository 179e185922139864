"""sglang-router in front of the replicas, as a process of its own.

Its Python entry point holds the GIL while it runs, so it is never imported into the fleet command: it runs
as ``python -m sglang_router.launch_router``. Its Prometheus port binds every interface unless told, so the
fleet binds it to 127.0.0.1. It is ready once its ``/workers`` list shows every replica healthy (it finds the
served model's name through the replicas' ``/model_info``).
"""
from __future__ import annotations

import importlib.util
import sys
import time

from minipaged.bench.servers import free_port

from .processes import Child, ChildProcesses

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
INSTALL_HINT = "pip install 'minipaged[fleet]' (or: pip install sglang-router)"


class RouterMissing(RuntimeError):
    """sglang-router is not installed here."""


def check_installed() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterMissing(f"minipaged fleet needs sglang-router, which is not installed: {INSTALL_HINT}.")


def router_command(host: str, port: int, worker_urls: list[str], policy: str) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--log-level", "warn"]


def start_router(children: ChildProcesses, host: str, port: int, worker_urls: list[str], policy: str,
                 timeout_s: float = 60.0) -> Child:
    """Start the router; returns once it lists every worker as healthy (RuntimeError with its log if not)."""
    import httpx

    child = children.start("router", router_command(host, port, worker_urls, policy))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if child.proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {child.proc.returncode} (log {child.log_path}):\n"
                               f"{child.log_tail()}")
        try:
            workers = httpx.get(url + "/workers", timeout=2.0).json().get("workers", [])
            if len([w for w in workers if w.get("is_healthy")]) >= len(worker_urls):
                return child
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sglang-router did not list {len(worker_urls)} healthy workers within {timeout_s:g} s "
                               f"(log {child.log_path}):\n{child.log_tail()}")
        time.sleep(0.2)
