"""Ranks as processes: the launcher under `launch`, `spawn` and `simcluster calibrate`.

`in_processes` starts `world` spawned processes, each a rank of one torch.distributed process group
(gloo or NCCL), runs a function in each with its device, and gathers what each returned; it never
waits without a limit (a rank that fails, dies or overruns is named, with what its peers saw).
Each process gets its share of the host's cores for its math libraries' threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_backend.watchdog import CollectiveTimeout


class LaunchError(RuntimeError):
    """The ranks could not be started, or did not all finish: the message says which and why."""


def check_backend(requested: str, world: int) -> str:
    """The backend a launch of `world` ranks will use ('gloo' or 'nccl'), or a LaunchError at once."""
    if requested not in ("auto", "gloo", "nccl"):
        raise LaunchError(f"backend {requested!r} is not valid; valid: auto, gloo, nccl")
    kind = requested if requested != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if kind == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("backend 'nccl' needs CUDA, and this machine has none (torch.cuda.is_available() is "
                              "False): use gloo, which runs on the CPU")
        if torch.cuda.device_count() < world:
            raise LaunchError(f"backend 'nccl' runs one rank per GPU: {world} ranks, {torch.cuda.device_count()} "
                              f"GPUs here (use torchrun over several nodes, or gloo)")
    return kind


# Ranks are forked from a server process that has imported torch and the backend once (spawn imports them
# anew in every rank: 1.7 s of CPU a rank here, measured); safe with CUDA, which the server never touches.
# Each rank still imports the launching script's main module, so an unguarded script is caught as before.
# The server also imports what torch imports lazily on a rank's first attention backward (autograd through
# scaled_dot_product_attention loads torch.fx's symbolic shapes, and sympy with them: 0.24 s, measured), which
# every rank would otherwise pay inside its first step.
START, PRELOAD = "forkserver", ["gpu_backend.backend", "torch.fx.experimental.symbolic_shapes"]


# glibc's malloc returns a block of 128 KiB or more to the OS when it is freed (mmap, or a trim of the heap's
# top), so the next tensor of that size is fresh pages that fault in on first touch: a step that all-gathers
# into new buffers pays it on every buffer. CUDA's caching allocator keeps freed blocks on a GPU, and PyTorch's
# tuning guide ("CPU specific optimizations: switch memory allocator", pytorch/tutorials #1512) has CPU runs
# keep them with jemalloc or TCMalloc for the same reason. Measured here (benchmarks/calibrated_prediction.py,
# 2 gloo ranks): GPT width 1024 fp32 under ZeRO-3 1.31-1.35 s a step with glibc's default, 1.06-1.07 s with
# freed memory kept. Constants from glibc's <malloc.h>; -1 disables trimming (mallopt(3)).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """(In a rank's process on the CPU.) Freed memory stays in the process for the next tensor, as CUDA's
    caching allocator keeps it on a GPU; False where the C library has no glibc `mallopt` (macOS, musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))


def _worker(rank: int, world: int, port: int, kind: str, timeout_s: float, threads: int | None,
            body: Callable[..., Any], body_args: Sequence[Any], results: Any) -> None:
    """One spawned rank: joins the process group, runs `body(device, *body_args)`, reports to the parent."""
    if threads:  # (the server's environment is its first launch's: the share is this launch's)
        torch.set_num_threads(threads)
    try:  # everything: a worker that fails before its program starts must say so, not hang its parent
        device = torch.device("cuda", rank % torch.cuda.device_count()) if kind == "nccl" else torch.device("cpu")
        if kind == "nccl":
            torch.cuda.set_device(device)
        else:
            keep_freed_memory()
        dist.init_process_group(kind, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ok", body(device, *body_args)))
    except CollectiveTimeout as exc:
        results.put((rank, "error", str(exc)))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which says it once)
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_share(world: int) -> int:
    """Threads for each of `world` ranks on this CPU: its cores shared out (at least one)."""
    return max(1, (os.cpu_count() or 1) // world)


@contextlib.contextmanager
def _threads_each(threads: int | None) -> Iterator[None]:
    """Spawned processes inherit this many math-library threads (unless the user has set a count):
    N ranks on one CPU, each with every core's worth of BLAS and OpenMP threads, run several times
    slower than with their share (measured: 940 against 189 ms a step, 2 ranks on 2 cores)."""
    if threads is None or any(v in os.environ for v in THREAD_VARIABLES):
        yield
        return
    for v in THREAD_VARIABLES:
        os.environ[v] = str(threads)
    try:
        yield
    finally:
        for v in THREAD_VARIABLES:
            del os.environ[v]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(code: int | None) -> str:
    """What a rank's process that exited before reporting died of: a signal, or an error of its own."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"its process was killed by {name} before it reported"
    return (f"its process exited (status {code}) before it reported: see its error above; a script that launches "
            f"ranks must guard its entry point with `if __name__ == \"__main__\":`")


_STATES = {"T": "stopped (SIGSTOP, or ^Z)", "t": "stopped by a debugger", "D": "in an uninterruptible wait (I/O)",
           "Z": "exited, not yet reaped"}


def _state(pid: int | None) -> str:
    """`; its process is stopped ...` where the OS says a process is in a state other than running or
    sleeping (Linux: /proc/PID/stat), else nothing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f"; its process is {_STATES[state]}" if state in _STATES else ""


GRACE_S = 8.0  # after a rank's error, at most how long its peers have to report theirs (their watchdogs' accounts)


def in_processes(body: Callable[..., Any], body_args: Sequence[Any], world: int, kind: str, *, timeout_s: float,
                 grace_s: float = GRACE_S, group_timeout_s: float = 300.0) -> list[Any]:
    """`body(device, *body_args)` in `world` spawned processes, each a rank of one process group of `kind`
    (module-level, so that it pickles); what each returned, by rank. Never waits without a limit: a rank
    that fails, dies before reporting, or is still running after `timeout_s` ends the run with a
    LaunchError naming it (after `grace_s` for its peers to report what they saw)."""
    ctx = mp.get_context(START)
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    threads = None if any(v in os.environ for v in THREAD_VARIABLES) else cpu_share(world)
    with _threads_each(threads):  # (under NCCL too: the host's threads are shared all the same)
        procs = mp.start_processes(_worker, args=(world, free_port(), kind, group_timeout_s, threads, body,
                                                  body_args, results), nprocs=world, join=False,
                                   start_method=START).processes
    runs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline, first_error = time.monotonic() + timeout_s, None
    try:
        while len(runs) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in runs and r not in errors]
                if gone:  # a report may still be in the pipe: read it before calling the rank dead
                    try:
                        rank, status, value = results.get(timeout=1.0)
                    except queue.Empty:
                        for r in gone:
                            errors[r] = _gone(procs[r].exitcode)
                        first_error = first_error or now
                        continue
                elif first_error is not None and now > first_error + grace_s:
                    break
                elif now > deadline:
                    for r in range(world):
                        if r not in runs:
                            errors.setdefault(r, f"still running after {timeout_s:g} s{_state(procs[r].pid)}")
                    break
                else:
                    continue
            if status == "ok":
                runs[rank] = value
            else:
                errors[rank] = value
                first_error = first_error or time.monotonic()
    finally:
        states = {r: _state(p.pid) for r, p in enumerate(procs) if p.is_alive()}
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2)
        for p in procs:  # stopped (SIGSTOP, a debugger) or deaf to SIGTERM: SIGKILL ends either
            if p.is_alive():
                p.kill()
                p.join(2)
    if errors:
        silent = [r for r in range(world) if r not in runs and r not in errors]
        lines = [f"rank {r}: {errors[r]}" for r in sorted(errors)]
        if silent:
            lines += [f"rank {r}: no report{states.get(r, '')}" for r in silent]
        raise LaunchError(f"torch.distributed run ({kind}, {world} processes) failed:\n" + "\n".join(lines))
    return [runs[r] for r in range(world)]


def power_limit_note(device: Any) -> str | None:
    """What `nvidia-smi` says of a CUDA device's power: the limit it enforces, its default and its maximum (W),
    for a profile's notes (a profile's rates are the clock that limit left: `cluster.power_limit_w` is
    refused beside one); None for another device, or where nvidia-smi is missing or says nothing usable."""
    import subprocess

    if getattr(device, "type", None) != "cuda":
        return None
    index = device.index or 0
    query = "power.limit,power.default_limit,power.max_limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)],
                             capture_output=True, text=True, timeout=30, check=False).stdout
        limit, default, most = (float(v) for v in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return f"measured under a {limit:g} W power limit (default {default:g} W, at most {most:g} W; nvidia-smi)"
