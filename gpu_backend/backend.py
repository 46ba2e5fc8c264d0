"""Run simcluster programs unchanged on torch.distributed: gloo on CPU, NCCL when CUDA is present.

The program's yields are interpreted with torch.distributed calls. Every kernel runs from the torch
kernel set on the rank's device (torch_ops.py): weights, activations, optimizer state and the
collectives' buffers all live there, and nothing goes through the host. Fast mode is the device's
own arithmetic; exact mode keeps its int64 limbs and sliced float64 GEMMs there too, and its partial
sums travel as limbs (integer sums are associative in gloo and NCCL alike; the limbs are carried again
after the collective), so a real run is the emulator's, byte for byte. A collective over a group of
one rank is the identity, as NCCL makes it, and touches no data.

Each mesh group becomes one torch process group, created for every axis combination in a fixed
order at start-up (torch requires every process to create every group in the same order).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from simcluster.engine import simulate
from simcluster.engine.errors import SimulationError
from simcluster.model.memory import MemoryLedger
from simcluster.numerics import limbs as _limbs
from simcluster.numerics.tensor import MetaTensor, Partial, ReduceOp, zeros_of
from simcluster.program.comm import Comm, CommKind, CommOp, ProgramError, Work
from simcluster.program.context import COMPUTE, Context, Program
from simcluster.program.mesh import DeviceMesh

from gpu_backend.digests import summarize, walk
from gpu_backend.processes import GRACE_S, LaunchError, check_backend, in_processes
from gpu_backend.torch_arrays import no_host_reads
from gpu_backend.torch_ops import TorchExactOps, TorchFastOps, deterministic_math, host_to_torch, torch_to_host
from gpu_backend.watchdog import FlightRecorder

_REDUCE = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


KERNEL_SETS = {"exact": TorchExactOps, "fast": TorchFastOps}


class _Streams:
    """Stream bookkeeping is a timing concept; on real hardware NCCL orders its own streams."""

    def __init__(self) -> None:
        self.current = COMPUTE
        self.label: tuple[str | None, str | None] = (None, None)

    def wait_stream(self, name: str) -> None:
        pass


class _Done:
    """The handle of what finished as it was issued (a copy between memory tiers)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def _default_store() -> Any:
    """The process group's key-value store (for the flight recorder), or None where torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


class TorchBackend:
    """`watchdog_s`: how long a collective may take before the watchdog reports it (watchdog.py)."""

    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device, watchdog_s: float = 300.0) -> None:
        self.mesh = mesh
        self.rank = rank
        self.device = device
        self.watchdog_s = watchdog_s
        self.exact = True  # the form of a partial a receive expects (set from the ops' mode)
        self.arrays: Any = None  # the torch kernel set's namespace: values stay tensors on the device
        self.p2p_sequence: dict[tuple[int, int], int] = {}  # (src, dst): messages issued so far
        self.recorder = FlightRecorder(rank, _default_store())
        self.groups: dict[tuple[str, tuple[int, ...]], Any] = {}
        timeout = timedelta(seconds=watchdog_s)
        for g in mesh.all_groups():  # the same order on every process
            self.groups[(g.name, g.ranks)] = (dist.new_group(list(g.ranks), timeout=timeout)
                                              if g.size < mesh.world_size else None)

    # -- values <-> tensors --------------------------------------------------------------------
    def to_torch(self, x: Any, copy: bool = False) -> torch.Tensor:
        """x as a contiguous tensor on this rank's device; `copy`: one the program does not hold (for a
        collective that writes into its input: all_reduce, broadcast, reduce, and reduce_scatter, which
        gloo may use as scratch)."""
        if isinstance(x, MetaTensor):
            raise ProgramError("meta tensors carry no data and cannot run on torch.distributed; use exact or fast mode")
        data = x.limbs if isinstance(x, Partial) else x
        if isinstance(data, torch.Tensor):
            return data.clone(memory_format=torch.contiguous_format) if copy else data.contiguous()
        return host_to_torch(np.array(data, copy=True, order="C"), self.device)

    def from_torch(self, t: torch.Tensor, like: Any) -> Any:
        partial = isinstance(like, Partial) or (isinstance(like, tuple) and like[0])
        if self.arrays is not None:  # stays on the device
            if not partial:
                return t
            dtype = like.dtype if isinstance(like, Partial) else like[1]
            exact = t.dtype == torch.int64  # limbs, summed digit by digit: carried again
            return Partial(_limbs.normalize(t, self.arrays) if exact else t, dtype, self.arrays)
        arr = torch_to_host(t)
        if partial:
            dtype = like.dtype if isinstance(like, Partial) else like[1]
            if arr.dtype != np.int64:  # fast mode's float accumulator
                return Partial(np.ascontiguousarray(arr), dtype)
            return Partial(_limbs.normalize(np.ascontiguousarray(arr, dtype=np.int64)), dtype)
        return np.ascontiguousarray(arr)

    def _receive_buffer(self, spec: tuple[bool, str, tuple[int, ...]]) -> torch.Tensor:
        partial, dtype, shape = spec
        if self.arrays is None:
            return self.to_torch(zeros_of(spec, exact=self.exact))
        if partial and self.exact:
            return self.arrays.zeros(tuple(shape) + (_limbs.LIMBS,), "int64")
        if partial:  # fast mode's accumulator
            return self.arrays.zeros(tuple(shape) + (1,), "fp64" if dtype == "fp64" else "fp32")
        return self.arrays.zeros(shape, dtype)

    def _in_order(self, src: int, dst: int) -> int:
        """The tag of the next message from src to dst: its place in their sequence. NCCL ignores tags and
        matches a pair's sends and receives in the order each rank issues them; so does gloo with these
        tags, so a program that leans on its own tags to reorder messages fails here as it would on GPUs."""
        seq = self.p2p_sequence.get((src, dst), 0)
        self.p2p_sequence[(src, dst)] = seq + 1
        return seq

    def _group(self, op: CommOp) -> Any:
        return self.groups[(op.group.name, op.group.ranks)]

    # -- issuing -------------------------------------------------------------------------------
    def issue(self, op: CommOp, sync: bool) -> Work:
        work = Work(op, sync)
        seq = self.recorder.issued(op)
        handle, finish = self._start(op)
        work.backend = (handle, finish, seq, time.monotonic())
        return work

    def _start(self, op: CommOp) -> tuple[Any, Callable[[], Any]]:
        k = op.kind
        if k is CommKind.SEND:
            return dist.isend(self.to_torch(op.tensor), dst=op.peer, tag=self._in_order(self.rank, op.peer)), lambda: None
        if k is CommKind.RECV:
            buf = self._receive_buffer(op.spec)
            return (dist.irecv(buf, src=op.peer, tag=self._in_order(op.peer, self.rank)),
                    lambda: self.from_torch(buf, op.spec))
        if k is CommKind.COPY:  # to the host's memory (NVMe: the host's too, here), or back to the device
            moved = self.to_torch(op.tensor).to(self.device if op.tiers[1] == "gpu" else "cpu", copy=True)  # (a copy)
            return _Done(), lambda: self.from_torch(moved.to(self.device), op.tensor)
        g, n = self._group(op), op.group.size
        if k is CommKind.BARRIER:
            return (_Done(), lambda: None) if n == 1 else (dist.barrier(group=g, async_op=True), lambda: None)
        x = op.tensor
        if n == 1:  # the identity: what the rank gave (values are never changed in place)
            return _Done(), lambda: x if self.arrays is not None else self.from_torch(self.to_torch(x), x)
        t = self.to_torch(x, copy=k in (CommKind.ALL_REDUCE, CommKind.BROADCAST, CommKind.REDUCE, CommKind.REDUCE_SCATTER)
                          and not op.donate)
        if isinstance(x, Partial) and k in (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER, CommKind.REDUCE) \
                and op.op is not ReduceOp.SUM:
            raise ProgramError(f"a Partial can only be reduced with SUM, not {op.op.name}")
        if k is CommKind.ALL_REDUCE:
            return dist.all_reduce(t, op=_REDUCE[op.op], group=g, async_op=True), lambda: self.from_torch(t, x)
        if k is CommKind.REDUCE:
            h = dist.reduce(t, dst=op.peer, op=_REDUCE[op.op], group=g, async_op=True)
            return h, lambda: self.from_torch(t, x) if self.rank == op.peer else None
        if k is CommKind.BROADCAST:
            return dist.broadcast(t, src=op.peer, group=g, async_op=True), lambda: self.from_torch(t, x)
        ndim = len(x.shape)
        if k is CommKind.REDUCE_SCATTER:
            dim = op.dim % ndim
            src = torch.movedim(t, dim, 0).contiguous()
            out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=src.dtype, device=self.device)
            h = dist.reduce_scatter_single(out, src, op=_REDUCE[op.op], group=g, async_op=True)
            return h, lambda: self.from_torch(torch.movedim(out, 0, dim), x)
        if k is CommKind.ALL_GATHER:
            dim = op.dim % ndim
            flat = torch.empty(n * t.numel(), dtype=t.dtype, device=self.device)
            h = dist.all_gather_single(flat, t.contiguous().view(-1), group=g, async_op=True)
            out = flat.view((n,) + tuple(t.shape))
            return h, lambda: self.from_torch(_joined(out, dim), x)
        if k is CommKind.ALL_TO_ALL and op.splits is not None:  # uneven, along dim 0
            src = t.contiguous()
            out = torch.empty((sum(op.gets),) + tuple(src.shape[1:]), dtype=src.dtype, device=self.device)
            h = dist.all_to_all_single(out, src, output_split_sizes=list(op.gets), input_split_sizes=list(op.splits),
                                       group=g, async_op=True)
            return h, lambda: self.from_torch(out, x)
        if k is CommKind.ALL_TO_ALL:
            split, cat = op.split_dim % ndim, op.concat_dim % ndim
            src = torch.stack(list(torch.chunk(t, n, dim=split))).contiguous()  # (n, ...) chunk j for rank j
            out = torch.empty_like(src)
            h = dist.all_to_all_single(out, src, group=g, async_op=True)
            return h, lambda: self.from_torch(_joined(out, cat), x)
        raise AssertionError(k)

    def wait(self, work: Work) -> Any:
        """The op's value once it has finished; the watchdog's report (CollectiveTimeout) if it does not."""
        work.waited = True
        if not work.done:
            handle, finish, seq, issued = work.backend
            try:
                handle.wait(timedelta(seconds=self.watchdog_s))
            except RuntimeError as exc:  # gloo's timeout, or a peer that went away
                raise self.recorder.report(work.op, seq, time.monotonic() - issued, exc) from None
            self.recorder.completed(work.op, seq)
            work.value, work.done = finish(), True
        return work.value


def _joined(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The n received parts (stacked on a new first axis) joined along `dim`: along the first, the buffer
    they arrived in, as it is (no copy: FSDP's gathered weights were copied after every all-gather, 45 ms
    a call at h 2048, measured); along another, one copy."""
    if dim == 0:
        return parts.view((parts.shape[0] * parts.shape[1],) + tuple(parts.shape[2:]))
    return torch.cat(list(parts), dim=dim)


@dataclass
class RankRun:
    """One rank's run: what its program returned, how long it took (wall clock on CPU, CUDA events on a
    GPU) and its peak memory (`memory_source` says which measure)."""

    result: Any
    seconds: float
    peak_bytes: int
    memory_source: str
    outputs: int = 0  # with digests (digests.summarize): the tensors in the result, and those sent whole
    sent: int = 0


def run_rank(program: Program, args: Sequence[Any], mesh: DeviceMesh, *, mode: str = "exact",
             device: torch.device | None = None, watchdog_s: float = 300.0) -> Any:
    """Run `program(ctx, *args)` as this process's rank (the process group must be initialised)."""
    return measured(program, args, mesh, mode=mode, device=device, watchdog_s=watchdog_s).result


def measured(program: Program, args: Sequence[Any], mesh: DeviceMesh, *, mode: str = "exact",
             device: torch.device | None = None, watchdog_s: float = 300.0, digests: bool = False, expected: Any = None,
             kernels: Callable[[Any], Any] | None = None, cost_dtype: str = "fp32") -> RankRun:
    """run_rank, timed from a barrier to the program's end, with the peak memory. The kernels are the torch
    kernel set's on `device` (in fast mode a `meta` device runs the step with no numbers at all); `kernels`,
    if given, is handed that kernel set and returns the one the program uses (calibrate's timed wrapper),
    which sees each kernel's cost as the emulator charges it in a run of `cost_dtype` (the model's dtype).
    The result's tensors come back to the host: whole, or with `digests` as digests.summarize makes them
    against `expected` (the digests of the emulator's outputs of this rank; None: none sent back)."""
    rank = dist.get_rank()
    if dist.get_world_size() != mesh.world_size:
        raise LaunchError(f"{dist.get_world_size()} processes for a mesh of {mesh.world_size} ranks")
    device = device or torch.device("cpu")
    backend = TorchBackend(mesh, rank, device, watchdog_s)
    backend.exact = mode == "exact"
    if mode not in KERNEL_SETS:
        raise ProgramError(f"mode {mode!r} cannot run on torch.distributed (it computes numbers): use "
                           f"{' or '.join(KERNEL_SETS)}")
    deterministic_math()
    ops = KERNEL_SETS[mode](device, cost_dtype=cost_dtype)
    if kernels is not None:
        ops = kernels(ops)
    backend.arrays = ops.xp
    comm = Comm(backend.issue, rank, mesh.world_size)
    ctx = Context(rank=rank, mesh=mesh.view(rank), ops=ops, comm=comm, streams=_Streams(), memory=MemoryLedger())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    try:
        with no_host_reads():
            result = _drive(program(ctx, *args), backend)
    except BaseException:
        backend.recorder.publish("failed")
        raise
    backend.recorder.publish("finished")
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
        peak, source = int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    else:
        seconds = time.perf_counter() - t0
        peak, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, \
            "the process's peak resident set (host memory)"
    if device.type == "meta":
        return RankRun(result, seconds, peak, source)
    if not digests:
        return RankRun(on_host(result), seconds, peak, source)
    sent, outputs, whole = summarize(result, expected, _to_host)
    return RankRun(sent, seconds, peak, source, outputs, whole)


def on_host(value: Any) -> Any:
    """A program's result with every tensor (and fast partial) as numpy on the host."""
    return walk(value, _to_host)


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch_to_host(value)
    if isinstance(value, Partial) and isinstance(value.limbs, torch.Tensor):
        return Partial(torch_to_host(value.limbs), value.dtype)
    return value


def _drive(gen: Any, backend: TorchBackend) -> Any:
    if not hasattr(gen, "send"):
        return gen
    value: Any = None
    while True:
        try:
            y = gen.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(y, Work):
            value = backend.wait(y)
        elif isinstance(y, (list, tuple)) and y and all(isinstance(w, Work) for w in y):
            value = [backend.wait(w) for w in y]
        else:
            raise ProgramError(f"rank {backend.rank} yielded {type(y).__name__}; a program yields ctx.comm works")


def _measured_on(device: torch.device, program: Program, args: Sequence[Any], mesh: DeviceMesh, mode: str,
                 watchdog_s: float, digests: bool, expected: Sequence[Any] | None) -> RankRun:
    return measured(program, args, mesh, mode=mode, device=device, watchdog_s=watchdog_s, digests=digests,
                    expected=None if expected is None else expected[dist.get_rank()])


def preflight(program: Program, args: Sequence[Any], mesh: DeviceMesh, cluster: Any = None,
              cost_dtype: str = "fp32") -> None:
    """The program on the emulator in meta mode (shapes only): a mismatched collective or a deadlock
    raises the emulator's error (CollectiveMismatchError, DeadlockError) before any process starts."""
    try:
        simulate(program, *args, mesh=mesh, cluster=cluster, mode="meta", cost_dtype=cost_dtype)
    except SimulationError as exc:
        raise type(exc)(f"preflight (the program on the emulator, meta mode) refused to start the ranks: {exc}") \
            from None


def launch(program: Program, *args: Any, mesh: DeviceMesh, mode: str = "exact", backend: str = "auto",
           timeout_s: float = 600.0, watchdog_s: float = 300.0, check: bool = True, digests: bool = False,
           expected: Sequence[Any] | None = None) -> list[RankRun]:
    """Run `program` on `mesh.world_size` spawned processes; each rank's run, by rank. `check`: first the
    preflight (which a caller that has run it already, or a test of the watchdog, turns off). `digests`,
    `expected` (by rank): see measured. Never waits without a limit: a rank that fails, dies before
    reporting, or is still running after `timeout_s` ends the launch with a LaunchError naming it (and
    what the watchdogs of its peers saw)."""
    world = mesh.world_size
    kind = check_backend(backend, world)
    if check:
        preflight(program, args, mesh)
    return in_processes(_measured_on, (program, args, mesh, mode, watchdog_s, digests, expected), world, kind,
                        timeout_s=timeout_s, grace_s=min(GRACE_S, watchdog_s) + FlightRecorder.grace_s,  # a watchdog fires, asks around
                        group_timeout_s=watchdog_s)


def spawn(program: Program, *args: Any, mesh: DeviceMesh, mode: str = "exact", backend: str = "auto",
          timeout_s: float = 600.0, watchdog_s: float = 300.0, check: bool = True) -> list[Any]:
    """Run `program` on `mesh.world_size` spawned processes; return each rank's result, by rank."""
    return [run.result for run in launch(program, *args, mesh=mesh, mode=mode, backend=backend,
                                         timeout_s=timeout_s, watchdog_s=watchdog_s, check=check)]
