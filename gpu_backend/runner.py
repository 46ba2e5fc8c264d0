"""Run simcluster programs unchanged on torch.distributed: gloo on CPU, NCCL when CUDA is present.

The program's yields are interpreted with torch.distributed calls. Kernels are simcluster's own
(`ctx.ops` in exact or fast mode), so exact mode stays bit-exact; values cross the process
boundary as tensors: float arrays as themselves, exact partials as their int64 limbs (integer sums
are associative in gloo and NCCL alike, and the limbs are re-normalised after the collective).

Each mesh group becomes one torch process group, created for every axis combination in a fixed
order at start-up (torch requires every process to create every group in the same order).
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simcluster.model.memory import MemoryLedger
from simcluster.numerics import limbs as _limbs
from simcluster.numerics.limbs import BF16
from simcluster.numerics.ops import make_ops
from simcluster.numerics.tensor import MetaTensor, Partial, ReduceOp, zeros_of
from simcluster.program.comm import Comm, CommKind, CommOp, ProgramError, Work
from simcluster.program.context import COMPUTE, Context, Program
from simcluster.program.mesh import DeviceMesh

_REDUCE = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


def pick_backend(requested: str = "auto") -> tuple[str, torch.device]:
    """('nccl', cuda) when CUDA is available, else ('gloo', cpu); or what was asked for."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {requested!r} is not valid; valid: auto, gloo, nccl")
    if requested == "nccl" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False")
        return "nccl", torch.device("cuda", dist.get_rank() % torch.cuda.device_count()
                                    if dist.is_initialized() else 0)
    return "gloo", torch.device("cpu")


class _Streams:
    """Stream bookkeeping is a timing concept; on real hardware NCCL orders its own streams."""

    def __init__(self) -> None:
        self.current = COMPUTE
        self.label: tuple[str | None, str | None] = (None, None)

    def wait_stream(self, name: str) -> None:
        pass


class TorchBackend:
    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device) -> None:
        self.mesh = mesh
        self.rank = rank
        self.device = device
        self.groups: dict[tuple[str, tuple[int, ...]], Any] = {}
        for g in mesh.all_groups():  # the same order on every process
            self.groups[(g.name, g.ranks)] = dist.new_group(list(g.ranks)) if g.size < mesh.world_size else None

    # -- values <-> tensors --------------------------------------------------------------------
    def to_torch(self, x: Any) -> torch.Tensor:
        if isinstance(x, MetaTensor):
            raise ProgramError("meta tensors carry no data and cannot run on torch.distributed; use exact or fast mode")
        # A copy: collectives work in place, and the program still owns its array.
        data = np.array(x.limbs if isinstance(x, Partial) else x, copy=True, order="C")
        if data.dtype == BF16:  # torch cannot take ml_dtypes arrays: move the bits
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).to(self.device)
        return torch.from_numpy(data).to(self.device)

    @staticmethod
    def from_torch(t: torch.Tensor, like: Any) -> Any:
        t = t.detach().cpu()
        arr = t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
        if isinstance(like, Partial) or (isinstance(like, tuple) and like[0]):
            dtype = like.dtype if isinstance(like, Partial) else like[1]
            return Partial(_limbs.normalize(np.ascontiguousarray(arr, dtype=np.int64)), dtype)
        return np.ascontiguousarray(arr)

    def _group(self, op: CommOp) -> Any:
        return self.groups[(op.group.name, op.group.ranks)]

    # -- issuing -------------------------------------------------------------------------------
    def issue(self, op: CommOp, sync: bool) -> Work:
        work = Work(op, sync)
        handle, finish = self._start(op)
        work.backend = (handle, finish)
        return work

    def _start(self, op: CommOp) -> tuple[Any, Callable[[], Any]]:
        k = op.kind
        if k is CommKind.SEND:
            return dist.isend(self.to_torch(op.tensor), dst=op.peer, tag=op.tag), lambda: None
        if k is CommKind.RECV:
            buf = self.to_torch(zeros_of(op.spec))
            return dist.irecv(buf, src=op.peer, tag=op.tag), lambda: self.from_torch(buf, op.spec)
        g, n = self._group(op), op.group.size
        if k is CommKind.BARRIER:
            return dist.barrier(group=g, async_op=True), lambda: None
        x = op.tensor
        t = self.to_torch(x)
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
            h = dist.reduce_scatter_tensor(out, src, op=_REDUCE[op.op], group=g, async_op=True)
            return h, lambda: self.from_torch(torch.movedim(out, 0, dim), x)
        if k is CommKind.ALL_GATHER:
            dim = op.dim % ndim
            flat = torch.empty(n * t.numel(), dtype=t.dtype, device=self.device)
            h = dist.all_gather_into_tensor(flat, t.contiguous().view(-1), group=g, async_op=True)
            out = flat.view((n,) + tuple(t.shape))
            return h, lambda: self.from_torch(torch.cat(list(out), dim=dim), x)
        if k is CommKind.ALL_TO_ALL:
            split, cat = op.split_dim % ndim, op.concat_dim % ndim
            src = torch.stack(list(torch.chunk(t, n, dim=split))).contiguous()  # (n, ...) chunk j for rank j
            out = torch.empty_like(src)
            h = dist.all_to_all_single(out, src, group=g, async_op=True)
            return h, lambda: self.from_torch(torch.cat(list(out), dim=cat), x)
        raise AssertionError(k)

    @staticmethod
    def wait(work: Work) -> Any:
        work.waited = True
        if not work.done:
            handle, finish = work.backend
            handle.wait()
            work.value, work.done = finish(), True
        return work.value


def run_rank(program: Program, args: Sequence[Any], mesh: DeviceMesh, *, mode: str = "exact",
             device: torch.device | None = None) -> Any:
    """Run `program(ctx, *args)` as this process's rank (the process group must be initialised)."""
    rank = dist.get_rank()
    if dist.get_world_size() != mesh.world_size:
        raise ValueError(f"{dist.get_world_size()} processes for a mesh of {mesh.world_size} ranks")
    backend = TorchBackend(mesh, rank, device or torch.device("cpu"))
    comm = Comm(backend.issue, rank, mesh.world_size)
    ctx = Context(rank=rank, mesh=mesh.view(rank), ops=make_ops(mode), comm=comm, streams=_Streams(),
                  memory=MemoryLedger())
    gen = program(ctx, *args)
    if not hasattr(gen, "send"):
        return gen
    value: Any = None
    while True:
        try:
            y = gen.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(y, Work):
            value = TorchBackend.wait(y)
        elif isinstance(y, (list, tuple)) and y and all(isinstance(w, Work) for w in y):
            value = [TorchBackend.wait(w) for w in y]
        else:
            raise ProgramError(f"rank {rank} yielded {type(y).__name__}; a program yields ctx.comm works")


def _worker(rank: int, world: int, port: int, backend: str, program: Program, args: Sequence[Any],
            mesh: DeviceMesh, mode: str, results: Any) -> None:
    kind = backend if backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if kind == "nccl" else torch.device("cpu")
    if kind == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(kind, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = run_rank(program, args, mesh, mode=mode, device=device)
        results.put((rank, "ok", out))
    except BaseException as exc:  # report to the parent instead of hanging it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(program: Program, *args: Any, mesh: DeviceMesh, mode: str = "exact", backend: str = "auto",
          timeout_s: float = 300.0) -> list[Any]:
    """Run `program` on `mesh.world_size` spawned processes; return each rank's result, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(mesh.world_size, _free_port(), backend, program, args, mesh, mode, results),
                               nprocs=mesh.world_size, join=False, start_method="spawn")
    out: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(mesh.world_size):
        rank, status, value = results.get()
        if status == "ok":
            out[rank] = value
        else:
            errors.append(f"rank {rank}: {value}")
            break
    if errors:
        for p in procs.processes:
            p.terminate()
        raise RuntimeError("torch.distributed run failed: " + "; ".join(errors))
    procs.join(timeout_s)
    return [out[r] for r in range(mesh.world_size)]
