"""calibrate's step profile: every kernel of a training step timed as the program calls it.

A calibration that times each kernel alone, or a mix of them, misses what a kernel costs where a step
runs it: a GELU backward of five temporaries, a norm's reductions, the fused attention through autograd
(0.3 to 16 GB/s on one CPU core against a mix's 4, measured). So `step_rates` runs a real training
step of a small GPT and of a small Llama on the torch kernel set, on the calibrated ranks, with
`TimedKernels` around it, and gives each kernel name the rate it reached: the bytes the cost model
charges it over its time, less a launch each. The emulator then times a kernel of that name at it
(topology/profile.py `kernels`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from gpu_backend.backend import measured
from simcluster.config.scenario import load
from simcluster.numerics.ops import EINSUM_PARTIAL, GEMM_PARTIAL
from simcluster.run.job import job_of
from simcluster.topology import profile as _profile


# Kernels a step profile leaves to the figures measured for them apart: GEMMs (timed by shape, from the grid).
# The kernels over weight-sized tensors are measured here at the step's sizes and apart at larger ones (their
# rates change past the caches: `kernel_rates`); a run's call is charged at the rate between the sizes nearest
# its own.
APART = frozenset({"matmul", "einsum", GEMM_PARTIAL, EINSUM_PARTIAL})


class TimedKernels:
    """Times a kernel set's every call from the program (the outermost call only: a kernel's own calls to
    others are part of it) and puts the time on the kernels the call recorded, in proportion to the
    bytes it charged each; `fused` regions are calls too (the kernel they record is theirs). On a CPU a
    kernel runs as it is called, so a call's wall time is the kernel's, its Python included.
    `wrap(ops)` returns the kernel set timed (measured's `kernels=`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.nbytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0
        self.charged = self.uncharged = 0.0  # seconds of the calls that recorded kernels, and of the others

    def wrap(self, ops: Any) -> Any:
        for name in dir(type(ops)):
            attr = getattr(type(ops), name, None)
            if name.startswith("_") or not callable(attr) or isinstance(attr, (type, property)) or name == "kernel":
                continue
            setattr(ops, name, self._region(ops, getattr(ops, name)) if name == "fused" else self._call(ops, getattr(ops, name)))
        return ops

    def _call(self, ops: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._timing(ops, fn.__name__):
                return fn(*args, **kwargs)
        return call

    def _region(self, ops: Any, fused: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def region(*args: Any, **kwargs: Any) -> Iterator[None]:  # a fused kernel: the enclosed ops are its
            with self._timing(ops, "fused"), fused(*args, **kwargs):
                yield
        return region

    @contextlib.contextmanager
    def _timing(self, ops: Any, call: str) -> Iterator[None]:
        if self.depth:
            yield
            return
        self.depth += 1
        recorded: list[tuple[str, float]] = []
        record = ops._record
        ops._record = lambda name, work, nbytes: (recorded.append((name, nbytes)), record(name, work, nbytes))
        t0 = time.perf_counter()
        try:
            yield
        finally:
            ops._record = record
            self.depth -= 1
            self._charge(recorded, time.perf_counter() - t0, call)

    def _charge(self, recorded: list[tuple[str, float]], seconds: float, call: str) -> None:
        """A call's time on its kernels; one that records none (the cost model charges it nothing) on
        `<call>`, for a reader to see (prediction_breakdown.py)."""
        if recorded:
            self.charged += seconds
        else:
            self.uncharged += seconds
        recorded = recorded or [(f"<{call}>", 0.0)]
        total = sum(b for _, b in recorded)
        for name, nbytes in recorded:
            share = nbytes / total if total > 0 else 1 / len(recorded)
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds * share
            self.nbytes[name] = self.nbytes.get(name, 0.0) + nbytes
            self.calls[name] = self.calls.get(name, 0) + 1


# The widths a step profile is measured at: head dimensions 32 and 128 (8 heads), a kernel's calls some 16x
# apart in bytes. One width (512) left the fused attention 2.1x slower than charged at head dimension 32
# and 0.6x at 128 (prediction_breakdown.py, 2026-11-27): a kernel's rate grows with its size, and a kernel
# measured at two sizes is charged at the rate interpolated for its own (profile.kernel_rate).
WIDTHS = (256, 1024)


def step_sets(arch: str, dtype: str, ranks: int, hidden: int = 512) -> list[str]:
    """The step a profile is measured on: a small model of `arch` (one block of `hidden` with 8 heads, 256
    tokens a rank) in data parallelism over the calibrated ranks, fast mode, two steps."""
    sets = [f"model.hidden={hidden}", "model.layers=1", "model.heads=8", f"model.ffn_hidden={4 * hidden}", "model.seq=256",
            "model.vocab=2048", f"model.global_batch={ranks}", f"model.dtype={dtype}", "model.tied_head=false",
            "run.numerics=fast", f"parallel.dp={ranks}", f"cluster.gpus_per_node={ranks}", "run.verify=false",
            "run.steps=2"]
    return sets + (["model.arch=llama", "model.kv_heads=4"] if arch == "llama" else [])


def timed_steps(device: torch.device, dtype: str, ranks: int, hidden: int = 512) -> TimedKernels:
    """(In each rank's process.) The calls of a `dtype` training step of a GPT and of a Llama (`step_sets`),
    timed and summed, each kernel's bytes as the emulator charges them in a run of that dtype."""
    timed = TimedKernels()
    for arch in ("gpt", "llama"):
        job = job_of(load(None, step_sets(arch, dtype, ranks, hidden)), fold=False)
        measured(job.program, job.args, job.mesh, mode="fast", device=device, kernels=timed.wrap, cost_dtype=dtype)
    return timed


REPEATS = 5  # step profiles a calibration takes; each kernel's rate is the median of its rates in them


def step_rates(device: torch.device, overhead_s: float, dtypes: Sequence[str], ranks: int,
               repeats: int = REPEATS, widths: Sequence[int] = WIDTHS) -> tuple[list[Any], dict[str, float]]:
    """(In each rank's process.) The rate of every kernel a training step calls, timed as the program calls
    it (`TimedKernels`) in a real step of a GPT and of a Llama (`step_sets`) of each of `widths`: the bytes
    the cost model charges each over its time less a launch each, by kernel name, run dtype and the bytes
    a call (its mean over the step); the median over `repeats` profiles (one profile's rates moved 0.25x to
    6x between two calibrations a minute apart on this shared machine: a call preempted once is a kernel's
    time several times over), the widths taken in turn in each. GEMMs are left to the grid's figures
    (`APART`). Beside them, by run dtype, the time of the calls that record no kernel (views, a gradient's
    rounding into its 16-bit buffer, the optimizer's zeroed state: the kernel set's own work, which the
    cost model does not charge) over the time of those that do: the median of the profiles'."""
    out, shares = [], {}
    for dtype in dtypes:
        rates: dict[tuple[str, int], list[float]] = {}
        sizes: dict[tuple[str, int], float] = {}
        host: list[float] = []
        for _ in range(repeats):
            for width in widths:
                timed = timed_steps(device, dtype, ranks, width)
                host.append(timed.uncharged / timed.charged if timed.charged > 0 else 0.0)
                for name in sorted(timed.seconds):
                    t, nbytes, calls = timed.seconds[name], timed.nbytes[name], timed.calls[name]
                    if name in APART or nbytes <= 0:
                        continue
                    rates.setdefault((name, width), []).append(nbytes / max(t - calls * overhead_s, t / 2) / 1e9)
                    sizes[name, width] = nbytes / calls
        out += [_profile.Kernel(name, dtype, statistics.median(rates[name, w]), sizes[name, w])
                for name, w in sorted(rates)]
        shares[dtype] = statistics.median(host) if host else 0.0
    return out, shares


__all__ = ["APART", "WIDTHS", "TimedKernels", "step_rates", "step_sets", "timed_steps"]
