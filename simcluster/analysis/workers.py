"""Where `plan`'s and `sweep`'s simulations run: here, one after another; in local worker processes
(`jobs`); or as tasks on a Ray cluster (`ray`: "local" starts one on this machine, as `ray.init()` does;
an address joins a running one, e.g. "ray://head:10001" or "auto"). Whichever, `in_order` returns the
results in the items' order and announces each item as it is waited for, so the table and the progress
lines are the same everywhere. Ray is imported only when asked for (`pip install 'simcluster[ray]'`).
"""

from __future__ import annotations

import multiprocessing
import socket
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from simcluster.config.scenario import ScenarioError


def in_order(fn: Callable[..., Any], items: Sequence[Any], *args: Any, jobs: int = 1, ray: str | None = None,
             announce: Callable[[int], None] | None = None) -> list[Any]:
    """[fn(item, *args) for item in items], computed as the module docstring says; `fn` module-level (it
    is pickled), its results too."""
    if ray is not None:
        return _on_ray(fn, items, args, ray, announce)
    if jobs <= 1 or len(items) <= 1:
        return _waited(list(items), lambda item: fn(item, *args), announce)
    # (the platform's own start method: fork on Linux; spawn on macOS, where forking is unsafe)
    with ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=multiprocessing.get_context()) as pool:
        return _waited([pool.submit(fn, item, *args) for item in items], lambda f: f.result(), announce)


def _waited(handles: list[Any], result: Callable[[Any], Any], announce: Callable[[int], None] | None) -> list[Any]:
    """result(handle) for each, in order, announce(i) before the i-th is waited for."""
    out = []
    for i, handle in enumerate(handles):
        if announce is not None:
            announce(i)
        out.append(result(handle))
    return out


def _on_ray(fn: Callable[..., Any], items: Sequence[Any], args: tuple, address: str,
            announce: Callable[[int], None] | None) -> list[Any]:
    """Each item a Ray task. A cluster this call started is shut down after; one it joined is left running.
    Joining a remote cluster ships this simcluster to its workers (Ray's runtime_env py_modules); they need
    its dependencies (numpy, simpy, rich, ml_dtypes, shtab) installed."""
    try:
        import ray
    except ImportError:
        raise ScenarioError("--ray needs Ray, which is not installed here: pip install 'simcluster[ray]' "
                            "(or without --ray, the simulations run in local processes)") from None
    started = not ray.is_initialized()
    if started:
        _reachable(address)
        try:
            if address == "local":
                ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            else:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR",
                         runtime_env={"py_modules": [str(Path(__file__).resolve().parents[1])]})  # (simcluster/)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ScenarioError(f"--ray {address}: could not start or join a Ray cluster: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    try:
        task = ray.remote(fn)
        return _waited([task.remote(item, *args) for item in items], ray.get, announce)
    finally:
        if started:
            ray.shutdown()


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address (or ray://HOST:PORT) that takes no connection is one line now, not Ray's minutes
    of retries; "local" and "auto" are Ray's to resolve."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address in ("local", "auto") or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ScenarioError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
                            f"with `ray start --head`, or give --ray alone for a local one") from None
