"""Hardware profiles: what `simcluster calibrate` measured on a machine, in place of a preset's constants.

A profile is a TOML file (written by gpu_backend/calibrate.py, read here without torch):

    device = "..."                 what was measured
    peak_tflops = 2.1              16-bit GEMM peak: the datasheet's on a GPU a preset names, else the best
    peak_tflops_fp32 = 1.4         measured GEMM rate (so MFU is against what this machine achieves)
    memory_gbyte_per_s = 9.5       the bandwidth the elementwise kernels reach (the bytes the cost model
                                   charges them over their time)
    memory_gbyte_per_s_16bit = 4.1 the same in a 16-bit run (optional; a CPU widens 16-bit data to compute,
                                   so it moves half the bytes in no less time)
    kernel_overhead_ns = 4000      the time of the smallest kernel
    link_gbyte_per_s = 1.2         fitted from all-reduce times over the measured ranks (absent with one
    link_latency_ns = 30000        rank): bus bandwidth, and latency per ring step
    gemm = [{dtype = "bf16", batch = 1, m = 256, n = 256, k = 256, tflops = 0.8}, ...]
                                   (`partial = true`: a GEMM writing fp32 partial sums, measured apart
                                   where the device runs it as another kernel: a CPU's)
    kernels = [{name = "adam", dtype = "bf16", gbyte_per_s = 11.0, bytes = 4e6}, ...]   (optional) kernels
                                   measured one by one: the bytes the cost model charges each in a run of
                                   that dtype over its time (the others at the figures above); `bytes`,
                                   what it was charged a call where measured: a kernel measured at several
                                   sizes runs at the rate interpolated for its own (`kernel_rate`)
    collectives_share_cores = true (optional) a CPU's: collectives run on the cores that compute, so a
                                   run's communication overlaps nothing (on the stream that issues it)
    host_share = {bf16 = 0.06, fp32 = 0.05}   (optional; a CPU's) the time a step's calls that record no
                                   kernel take (the kernel set's views, roundings and zeroed buffers: work of
                                   its own that the cost model does not charge), as a share of the kernels'
                                   time in a run of that dtype: every kernel takes that much longer
    collective_rates = {all_gather = 0.54, reduce_scatter = 0.40}   (optional) the share of the link's
                                   fitted rate these reach (a backend's algorithms for them may be slower)
    allreduce = [{bytes = 1024, seconds = 2e-05, busbw_gbyte_per_s = 0.05}, ...]   (shown, not used)

`apply(spec, profile)` turns a preset's spec into the profiled one: the measured figures replace the
preset's (with efficiency 1: they are achieved rates), links inside a node are the measured links
(the NIC, between nodes, stays the preset's: a calibration on one host sees no NIC), and every GEMM
is then timed at the rate measured for the nearest measured shape (`gemm_rate`). What the profile
does not measure (non-GEMM compute-bound kernels: compute_efficiency of the peak, FlashAttention's
attention_efficiency) stays as it was; a power limit is refused with a profile (it ran under its own),
and a preset's sustained_compute is not applied (the measurements are taken as they are; a scenario may set one).
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

DTYPES = ("bf16", "fp16", "fp32", "fp64")
SAME_RATE = {"fp16": "bf16", "bf16": "fp16"}  # tensor cores run both at one rate: either stands for the other


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, not TOML, a figure missing or out of range)."""


@dataclass(frozen=True)
class Gemm:
    dtype: str
    batch: int
    m: int
    n: int
    k: int
    tflops: float
    partial: bool = False  # writing fp32 partial sums of `dtype` inputs (ops.py GEMM_PARTIAL)

    @property
    def where(self) -> tuple[float, float, float]:
        """Its place in shape space: log2 of (batch * m, n, k)."""
        return math.log2(self.batch * self.m), math.log2(self.n), math.log2(self.k)


@dataclass(frozen=True)
class Kernel:
    name: str  # as ops.py records it ("adam", "uniform", ...)
    dtype: str  # the run's cost dtype it was charged in
    gbyte_per_s: float
    nbytes: float = 0.0  # what it was charged a call where measured (0: not said; its rate at every size)


@dataclass(frozen=True)
class Profile:
    source: str
    device: str
    peak_tflops: float
    peak_tflops_fp32: float
    memory_gbyte_per_s: float
    kernel_overhead_ns: int
    gemm: tuple[Gemm, ...]
    link_gbyte_per_s: float | None = None
    link_latency_ns: int | None = None
    memory_gbyte: float | None = None
    memory_gbyte_per_s_16bit: float | None = None
    kernels: tuple[Kernel, ...] = ()
    shares_cores: bool = False  # collectives run on the cores that compute (a CPU's): nothing overlaps
    # the share of the fitted link's rate other collectives reach, by kind ("all_gather": 0.4): a
    # backend's own algorithms for them may be slower than its all-reduce's (gloo's on a CPU are)
    collective_rates: tuple[tuple[str, float], ...] = ()
    host_share: tuple[tuple[str, float], ...] = ()  # by run dtype: the uncharged calls' time over the kernels'

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes whose GEMMs were measured (their partial-sum GEMMs alone do not make one)."""
        return tuple(sorted({g.dtype for g in self.gemm if not g.partial}))

    def gemm_rate(self, batch: int, m: int, n: int, k: int, dtype: str, partial: bool = False) -> float:
        """TFLOP/s of the measured GEMM of this dtype nearest to (batch, m, n, k) in log2 of (batch * m,
        n, k); ties go to the earlier entry. A dtype not measured: fp16 and bf16 stand for each other,
        otherwise a ProfileError. `partial`: one writing fp32 partial sums, at the rate measured for those
        where the profile has them (a CPU's), else as any other."""
        tables = _by_dtype(self)
        table = partial and (tables.get((dtype, True)) or tables.get((SAME_RATE.get(dtype, ""), True)))
        table = table or tables.get((dtype, False)) or tables.get((SAME_RATE.get(dtype, ""), False))
        if not table:
            raise ProfileError(f"profile {self.source}: no {dtype} GEMMs measured (it has "
                               f"{', '.join(self.dtypes)}); run `simcluster calibrate --dtypes {dtype}`")
        x = (math.log2(max(batch * m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1)))
        best = min(table, key=lambda g: sum((a - b) ** 2 for a, b in zip(g.where, x)))
        return best.tflops

    def kernel_rates(self) -> dict[tuple[str, str], tuple[tuple[float, float], ...]]:
        """The kernels measured by name: (name, dtype) -> (log2 of the bytes a call, GB/s) by size."""
        return _by_name(self)


def kernel_rate(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """GB/s for a call of `nbytes` of a kernel measured at `points` (`Profile.kernel_rates`): a kernel's rate
    grows with its size (its launch and Python spread over more bytes, until the caches overflow), so
    between two measured sizes it is interpolated in log2 of the bytes, in log of the rate; outside them it
    is the nearest one's."""
    x = math.log2(max(nbytes, 1.0))
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, r0), (x1, r1) in zip(points, points[1:]):
        if x <= x1:
            return r0 * (r1 / r0) ** ((x - x0) / (x1 - x0))
    return points[-1][1]


@functools.lru_cache(maxsize=None)
def _by_name(profile: Profile) -> dict[tuple[str, str], tuple[tuple[float, float], ...]]:
    out: dict[tuple[str, str], dict[float, float]] = {}
    for k in profile.kernels:  # (one size given twice: the later entry)
        out.setdefault((k.name, k.dtype), {})[math.log2(max(k.nbytes, 1.0))] = k.gbyte_per_s
    return {key: tuple(sorted(sizes.items())) for key, sizes in out.items()}


@functools.lru_cache(maxsize=None)
def _by_dtype(profile: Profile) -> dict[tuple[str, bool], tuple[Gemm, ...]]:
    return {(g.dtype, g.partial): tuple(h for h in profile.gemm if (h.dtype, h.partial) == (g.dtype, g.partial))
            for g in profile.gemm}


def _number(doc: dict[str, Any], key: str, where: str, *, integer: bool = False, optional: bool = False) -> Any:
    if key not in doc:
        if optional:
            return None
        raise ProfileError(f"{where}: missing {key!r}")
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ProfileError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v):
        raise ProfileError(f"{where}: {key} must be a finite number, got {v!r}")
    if not v > 0 and not (integer and v == 0):
        raise ProfileError(f"{where}: {key} must be positive, got {v!r}")
    return v


def _flag(doc: dict[str, Any], key: str, where: str) -> bool:
    v = doc.get(key, False)
    if not isinstance(v, bool):
        raise ProfileError(f"{where}: {key} must be true or false, got {v!r}")
    return v


RATED = ("all_gather", "reduce_scatter")  # the collectives whose rates calibrate measures apart


def _rates(doc: dict[str, Any], source: str) -> tuple[tuple[str, float], ...]:
    table = doc.get("collective_rates", {})
    if not isinstance(table, dict) or any(k not in RATED for k in table):
        raise ProfileError(f"{source}: collective_rates must be a table of {', '.join(RATED)}")
    return tuple((k, float(_number(table, k, f"{source}: collective_rates"))) for k in sorted(table))


def _shares(doc: dict[str, Any], source: str) -> tuple[tuple[str, float], ...]:
    table = doc.get("host_share", {})
    if not isinstance(table, dict) or any(k not in DTYPES for k in table):
        raise ProfileError(f"{source}: host_share must be a table of dtypes ({', '.join(DTYPES)})")
    out = []
    for k in sorted(table):
        v = table[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 10:
            raise ProfileError(f"{source}: host_share.{k} must be a number from 0 to 10, got {v!r}")
        out.append((k, float(v)))
    return tuple(out)


def parse(text: str, source: str) -> Profile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source}: not valid TOML: {exc}") from None
    rows = doc.get("gemm")
    if not isinstance(rows, list) or not rows:
        raise ProfileError(f"{source}: no gemm table (a profile lists the GEMMs it measured)")
    gemm = []
    for i, row in enumerate(rows):
        where = f"{source}: gemm[{i}]"
        if not isinstance(row, dict) or row.get("dtype") not in DTYPES:
            raise ProfileError(f"{where}: needs dtype, one of {', '.join(DTYPES)}")
        gemm.append(Gemm(row["dtype"], *(_number(row, k, where, integer=True) for k in ("batch", "m", "n", "k")),
                         float(_number(row, "tflops", where)), _flag(row, "partial", where)))
    if not any(not g.partial for g in gemm):
        raise ProfileError(f"{source}: the gemm table has only partial GEMMs (a profile measures the others first)")
    kernels = []
    table = doc.get("kernels", [])
    if not isinstance(table, list):
        raise ProfileError(f"{source}: kernels must be a list of {{name, dtype, gbyte_per_s}}")
    for i, row in enumerate(table):
        where = f"{source}: kernels[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) or row.get("dtype") not in DTYPES:
            raise ProfileError(f"{where}: needs a name and a dtype, one of {', '.join(DTYPES)}")
        size = _number(row, "bytes", where, optional=True)
        kernels.append(Kernel(row["name"], row["dtype"], float(_number(row, "gbyte_per_s", where)),
                              0.0 if size is None else float(size)))
    link = _number(doc, "link_gbyte_per_s", source, optional=True)
    latency = _number(doc, "link_latency_ns", source, integer=True, optional=True)
    if (link is None) != (latency is None):
        raise ProfileError(f"{source}: link_gbyte_per_s and link_latency_ns go together")
    memory = _number(doc, "memory_gbyte", source, optional=True)
    sixteen = _number(doc, "memory_gbyte_per_s_16bit", source, optional=True)
    return Profile(source=source, device=str(doc.get("device", "profiled")),
                   peak_tflops=float(_number(doc, "peak_tflops", source)),
                   peak_tflops_fp32=float(_number(doc, "peak_tflops_fp32", source)),
                   memory_gbyte_per_s=float(_number(doc, "memory_gbyte_per_s", source)),
                   kernel_overhead_ns=_number(doc, "kernel_overhead_ns", source, integer=True), gemm=tuple(gemm),
                   link_gbyte_per_s=None if link is None else float(link), link_latency_ns=latency,
                   memory_gbyte=None if memory is None else float(memory),
                   memory_gbyte_per_s_16bit=None if sixteen is None else float(sixteen), kernels=tuple(kernels),
                   shares_cores=_flag(doc, "collectives_share_cores", source), collective_rates=_rates(doc, source),
                   host_share=_shares(doc, source))


def load(path: str | Path) -> Profile:
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read the hardware profile {str(path)!r}: {exc.strerror or exc}") from None
    return parse(text, str(path))


def apply(spec: Any, profile: Profile) -> Any:
    """The ClusterSpec `spec` with the profile's measured figures in place of the preset's."""
    best16 = max((g.tflops for g in profile.gemm if g.dtype in ("bf16", "fp16") and not g.partial),
                 default=profile.peak_tflops)
    figures: dict[str, Any] = dict(
        device=profile.device, peak_tflops=profile.peak_tflops, peak_tflops_fp32=profile.peak_tflops_fp32,
        matmul_efficiency=min(1.0, best16 / profile.peak_tflops),  # for the planner's one-rate estimate
        hbm_gbyte_per_s=profile.memory_gbyte_per_s, memory_efficiency=1.0,
        kernel_overhead_ns=profile.kernel_overhead_ns, sustained_compute=1.0, profile=profile)
    if profile.link_gbyte_per_s is not None:
        figures.update(nvlink_gbyte_per_s=profile.link_gbyte_per_s, nvlink_efficiency=1.0,
                       nvlink_latency_ns=profile.link_latency_ns, collectives="alpha-beta")
    if profile.memory_gbyte is not None:
        figures["memory_gbyte"] = profile.memory_gbyte
    return replace(spec, **figures)


def write(path: str | Path, *, device: str, peak_tflops: float, peak_tflops_fp32: float, memory_gbyte_per_s: float,
          kernel_overhead_ns: int, gemm: list[Gemm], link: tuple[float, int] | None,
          allreduce: list[tuple[int, float]], ranks: int, backend: str, memory_gbyte: float | None,
          notes: list[str], memory_gbyte_per_s_16bit: float | None = None, kernels: Sequence[Kernel] = (),
          shares_cores: bool = False, collective_rates: Sequence[tuple[str, float]] = (),
          host_share: Sequence[tuple[str, float]] = ()) -> None:
    """Write a profile file (readable by `load`), with comments saying what each figure is."""
    def g(x: float) -> str:
        return repr(float(f"{x:.4g}"))

    lines = ["# simcluster hardware profile, written by `simcluster calibrate`.",
             "# Use it in a scenario with cluster.profile = \"<this file>\" (or --set cluster.profile=<this file>).",
             *(f"# {n}" for n in notes),
             f"device = {_quote(device)}",
             f"backend = {_quote(backend)}",
             f"ranks = {ranks}",
             f"peak_tflops = {g(peak_tflops)}",
             f"peak_tflops_fp32 = {g(peak_tflops_fp32)}",
             f"memory_gbyte_per_s = {g(memory_gbyte_per_s)}  # reached by the elementwise kernels, as charged",
             f"kernel_overhead_ns = {int(kernel_overhead_ns)}  # the smallest kernel's time"]
    if collective_rates:
        lines.append("collective_rates = { " + ", ".join(f"{k} = {g(v)}" for k, v in collective_rates)
                     + " }  # the share of the link's rate each reaches (measured apart)")
    if shares_cores:
        lines.append("collectives_share_cores = true  # a CPU's: communication and compute take turns")
    if host_share:
        lines.append("host_share = { " + ", ".join(f"{k} = {g(v)}" for k, v in host_share)
                     + " }  # the calls that record no kernel: their time over the kernels'")
    if memory_gbyte_per_s_16bit is not None:
        lines.append(f"memory_gbyte_per_s_16bit = {g(memory_gbyte_per_s_16bit)}  # the same in a 16-bit run")
    if memory_gbyte is not None:
        lines.append(f"memory_gbyte = {g(memory_gbyte)}")
    if link is not None:
        lines += [f"link_gbyte_per_s = {g(link[0])}  # all-reduce bus bandwidth, fitted over the sizes below",
                  f"link_latency_ns = {int(link[1])}  # per ring step, fitted"]
    lines.append("gemm = [  # achieved TFLOP/s by shape; a GEMM is timed at its nearest measured shape")
    lines += [f"  {{dtype = {_quote(r.dtype)}, batch = {r.batch}, m = {r.m}, n = {r.n}, k = {r.k}, "
              f"tflops = {g(r.tflops)}{', partial = true' if r.partial else ''}}}," for r in gemm]
    lines.append("]")
    if kernels:
        lines.append("kernels = [  # kernels measured one by one: the bytes charged over the time")
        lines += [f"  {{name = {_quote(k.name)}, dtype = {_quote(k.dtype)}, gbyte_per_s = {g(k.gbyte_per_s)}"
                  + (f", bytes = {g(k.nbytes)}" if k.nbytes else "") + "}," for k in kernels]
        lines.append("]")
    if allreduce:
        factor = 2 * (ranks - 1) / ranks
        lines.append(f"allreduce = [  # measured over {ranks} ranks (busbw = 2(p-1)/p * bytes / seconds); not read")
        lines += [f"  {{bytes = {b}, seconds = {g(t)}, busbw_gbyte_per_s = {g(factor * b / t / 1e9)}}},"
                  for b, t in allreduce]
        lines.append("]")
    Path(path).write_text("\n".join(lines) + "\n")


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
