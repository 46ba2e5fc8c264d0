"""Hardware presets. Datasheet figures are marked as such; the rest are modelling assumptions.

Units are in the field names. Bandwidths are per direction per GPU (NVLink: through the NVSwitch;
NIC: one InfiniBand port per GPU, rail-optimised, through a non-blocking fabric).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simcluster.topology.profile import Profile


COLLECTIVES = ("nccl", "alpha-beta")
# The SM clock under a power limit (`power_limit_w`, what `nvidia-smi -pl` sets): the firmware lowers the
# clock until the board's draw fits. NVIDIA sells one die at two limits: GH100 with 132 SMs as the H100 SXM5
# (up to 700 W: 989 TFLOP/s dense bf16) and as the H100 NVL (350-400 W: 835 TFLOP/s) (NVIDIA H100 datasheet,
# nvidia.com/en-us/data-center/h100; the figures torchtitan's get_peak_flops uses). Between them the
# tensor-core rate, so the clock, goes as power^0.3025 = ln(989 / 835) / ln(700 / 400): the textbook DVFS
# law (dynamic power ~ f V^2 with V ~ f, so f ~ P^(1/3)) within 10 %. Checked on a third board: the H100
# PCIe's 114 SMs at 350 W (3.07 W an SM, as 132 SMs at 405 W) come out at 724 TFLOP/s by this law, the
# datasheet's 756 (-4 %). HBM keeps its one clock (these boards list a single supported memory clock), so
# memory-bound kernels and the links keep their rates. The A100 datasheet rates its 300 W PCIe board at the
# 400 W SXM4's 312 TFLOP/s (both at the boost clock, whatever the power), so it says nothing either way: on
# other GPUs than Hopper the law is an assumption.
POWER_CLOCK_EXPONENT = math.log(989 / 835) / math.log(700 / 400)


@dataclass(frozen=True)
class ClusterSpec:
    preset: str
    device: str
    nodes: int = 1
    gpus_per_node: int = 8
    peak_tflops: float = 312.0  # dense 16-bit tensor-core peak (bf16/fp16)
    peak_tflops_fp32: float = 19.5  # plain fp32 (no tensor cores)
    hbm_gbyte_per_s: float = 2039.0
    memory_gbyte: float = 80.0  # device memory in GiB (the datasheet's "80GB"); a peak above it is out of memory
    nvlink_gbyte_per_s: float = 300.0  # each way
    nic_gbit_per_s: float = 200.0  # each way
    # what NCCL gets of a link's line rate: ~80 % of NVLink (its protocol's overhead, ~20 %: S. Jeaugey,
    # NVIDIA, nccl-tests issue #212), 96 % of an HDR InfiniBand port (all_reduce_perf peak busbw 96 of
    # 100 GB/s over four HDR NICs, nccl-tests issue #119)
    nvlink_efficiency: float = 0.8
    nic_efficiency: float = 0.96
    # Between nodes, rail-optimised: NIC i of every node hangs off rail (leaf) switch i, so a transfer
    # between GPUs of the same local index stays on its rail; one between different indices crosses
    # the spine, whose uplinks carry nodes x NIC bandwidth / oversubscription per rail (1: non-blocking,
    # what a single leaf tier gives). NCCL's PXN, which would hop over NVLink to the right rail first,
    # is not modelled.
    oversubscription: float = 1.0
    # A TPU-style torus in place of NVSwitch nodes and a switched fabric: "XxYxZ" (or "XxY"), the chips
    # along each dimension; rank r sits at x = r % X, y = r // X % Y, z = r // (X Y). Each chip has one
    # link each way to its neighbour along every dimension (six on a 3D torus), wrapped around at the
    # ends where every dimension is at least 4 (Google Cloud TPU v5p docs: "All 4x4x4 and larger slices
    # have full 3D torus"); a smaller slice is an open mesh. "": no torus. Nodes are then hosts (4 chips
    # on TPU v5p), which route nothing.
    torus: str = ""
    ici_gbyte_per_s: float = 100.0  # one inter-chip link, each way (TPU v5p: 1,200 GB/s bidirectional per chip over 6 links)
    ici_latency_ns: int = 1000  # per hop; assumption
    # How a collective's latency and rate are modelled (topology/nccl.py): "nccl", NCCL's protocols (LL,
    # LL128, Simple) chosen by message size with its tuning constants; "alpha-beta", the textbook form
    # with the two latencies below a ring step at the link's full rate (what a measured profile fits)
    collectives: str = "nccl"
    nvlink_latency_ns: int = 1000  # per ring step, "alpha-beta" only; assumption
    nic_latency_ns: int = 3000  # per ring step, "alpha-beta" only; assumption
    kernel_overhead_ns: int = 1000  # gap between back-to-back kernels; assumption
    compute_efficiency: float = 0.7  # achievable fraction of peak FLOP/s for kernels other than GEMMs; assumption
    # FlashAttention's fused kernels (model/flash.py): the share of the peak the forward reaches (the backward
    # runs at 0.82 of it: cluster.ATTENTION_BACKWARD, from FlashAttention-3's H100 figures).
    # A100: FlashAttention-2 reaches 50-73 % of it (Dao 2023, abstract; 73 % its forward, the backward less);
    # 0.7 is within that, an assumption (the A100 tables run attention unfused, as Megatron-LM did then).
    attention_efficiency: float = 0.7
    # GEMMs (matmul, einsum, attention's batched products): the maximum achievable matmul FLOP/s of
    # the best-shaped bf16 GEMM over the datasheet peak, measured: A100 SXM 267.9 of 312 TFLOP/s
    # (S. Bekman, "Machine Learning Engineering", MAMF table, CUDA 12.1); a GEMM's own shape then
    # costs it tile and wave quantisation over `sms` streaming multiprocessors (cluster.py).
    matmul_efficiency: float = 0.859
    sms: int = 108  # streaming multiprocessors; datasheet (A100: 108)
    memory_efficiency: float = 0.8  # achievable fraction of HBM bandwidth; assumption
    # The host (ZeRO-Offload/Infinity keep optimizer state, and parameters, in its memory or on its NVMe).
    # PCIe between a GPU and its host, each way: A100 SXM4 Gen4 x16, 32 GB/s (datasheet "PCIe Gen4:
    # 64 GB/s", both ways together); what a pinned-memory copy gets of it, and a copy's set-up: assumptions.
    pcie_gbyte_per_s: float = 32.0
    pcie_efficiency: float = 0.8
    pcie_latency_ns: int = 5000
    # A node's NVMe drives together, each way. Assumption: DGX A100's eight 3.84 TB U.2 drives (datasheet:
    # 30 TB) at ~3 GB/s sustained each.
    nvme_gbyte_per_s: float = 24.0
    nvme_tbyte: float = 30.0
    host_memory_gbyte: float = 2048.0  # DGX A100 640GB: 2 TB system memory (datasheet)
    # CPU Adam (DeepSpeed's vectorised AdamW), a node's cores together, in billions of parameters a second.
    # Assumption: memory-bound at half the host's DRAM bandwidth (two AMD EPYC 7742, 8 channels of
    # DDR4-3200 each: 409.6 GB/s), moving 28 bytes a parameter (fp32 master, m and v read and written,
    # the fp32 gradient read): 204.8 / 28 = 7.3.
    cpu_adam_gparam_per_s: float = 7.3
    # The board's rated power: A100 SXM4 400 W (datasheet "Max TDP Power"); 0 where none is published. A
    # `power_limit_w` under it (0: none, the GPU at its TDP) slows every compute-bound kernel as the clock
    # falls, POWER_CLOCK_EXPONENT above; the datasheet peak (MFU's denominator) stays.
    tdp_w: float = 400.0
    power_limit_w: float = 0.0
    # The share of the compute-bound rates above (GEMMs, attention, other compute-bound kernels) that a GPU
    # keeps through a training run. Those rates come from short benchmarks on one GPU (MAMF: the fastest of
    # 100 timed runs after 50 warm-ups); a run holds eight GPUs at full load for hours. 1: none lost, an
    # assumption where no run says otherwise (the A100 tables are met without it: benchmarks/fidelity.py).
    # A measured profile's rates are taken as they are (profile.apply sets 1); HBM and the links keep theirs.
    sustained_compute: float = 1.0
    # a measured hardware profile (topology/profile.py, from `simcluster calibrate`): with one, the
    # figures above are its measurements, and each GEMM is timed by the shape measured nearest to it
    profile: "Profile | None" = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "profile":
                continue
            if f.name == "torus":
                self.torus_dims  # (raises on a bad shape or a chip count other than the world's)
                continue
            if f.name == "collectives":
                if v not in COLLECTIVES:
                    raise ValueError(f"cluster.collectives must be one of {', '.join(map(repr, COLLECTIVES))}, "
                                     f"got {v!r}")
                continue
            if f.name in ("preset", "device"):
                if not isinstance(v, str) or not v:
                    raise ValueError(f"cluster.{f.name} must be a non-empty string, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"cluster.{f.name} must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"cluster.{f.name} must be a finite number, got {v!r}")
            if f.name in ("nodes", "gpus_per_node", "sms") and (not isinstance(v, int) or v < 1):
                raise ValueError(f"cluster.{f.name} must be a positive integer, got {v!r}")
            if f.name in ("tdp_w", "power_limit_w") and v >= 0:
                continue
            if f.name.endswith("_ns") and (not isinstance(v, int) or v < 0):
                raise ValueError(f"cluster.{f.name} must be a non-negative integer (ns), got {v!r}")
            if f.name.endswith(("efficiency", "sustained_compute")) and not 0 < v <= 1:
                raise ValueError(f"cluster.{f.name} must be in (0, 1], got {v!r}")
            if f.name == "oversubscription" and v < 1:
                raise ValueError(f"cluster.oversubscription must be at least 1 (1: a non-blocking fabric), got {v!r}")
            if not f.name.endswith("_ns") and v <= 0:
                raise ValueError(f"cluster.{f.name} must be positive, got {v!r}")
        self._check_power_limit()

    def _check_power_limit(self) -> None:
        limit, tdp = self.power_limit_w, self.tdp_w
        if not limit:
            return
        if not tdp:
            raise ValueError(f"cluster.power_limit_w = {limit:g} needs the board's rated power, and {self.device} has "
                             f"none published: set cluster.tdp_w too")
        if limit > tdp:
            raise ValueError(f"cluster.power_limit_w = {limit:g} W is above the {self.device}'s rated power "
                             f"(cluster.tdp_w = {tdp:g} W), the most it may be set to")
        if limit < tdp / 2:
            raise ValueError(f"cluster.power_limit_w = {limit:g} W is under half the {self.device}'s rated power "
                             f"({tdp:g} W): the clock-under-power law is sourced from 350 to 700 W on a 700 W "
                             f"H100 (topology/presets.py), and below that leakage and the clock's floor dominate")
        if self.profile is not None:
            raise ValueError("cluster.power_limit_w scales the preset's datasheet rates; a measured profile ran at "
                             "its GPU's own power limit: measure it under the limit (nvidia-smi -pl) and drop "
                             "cluster.power_limit_w")

    @property
    def clock_scale(self) -> float:
        """The share of its TDP clock the GPU keeps under `power_limit_w`: every compute-bound rate's factor."""
        if not self.power_limit_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** POWER_CLOCK_EXPONENT

    @property
    def compute_scale(self) -> float:
        """Every compute-bound rate's factor: the clock a power limit leaves, times what a run sustains."""
        return self.clock_scale * self.sustained_compute

    @property
    def gemm_tflops(self) -> float:
        """What the best-shaped 16-bit GEMM runs at: the datasheet peak x matmul_efficiency x compute_scale."""
        return self.peak_tflops * self.matmul_efficiency * self.compute_scale

    @property
    def nvlink_bytes_per_ns(self) -> float:
        """What NCCL gets of an NVLink port, each way (GB/s == bytes/ns)."""
        return self.nvlink_gbyte_per_s * self.nvlink_efficiency

    @property
    def nic_bytes_per_ns(self) -> float:
        """What NCCL gets of a NIC, each way."""
        return self.nic_gbit_per_s / 8.0 * self.nic_efficiency

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def torus_dims(self) -> tuple[int, ...]:
        """The torus's chips along each dimension; () without a torus."""
        if not isinstance(self.torus, str):
            raise TypeError(f"cluster.torus must be a string like '4x4x4', got {type(self.torus).__name__}")
        if not self.torus:
            return ()
        parts = self.torus.lower().split("x")
        if not 2 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"cluster.torus = {self.torus!r} is not a torus shape: two or three positive whole "
                             f"numbers joined by x, like '4x4x4' or '16x16'")
        dims = tuple(int(p) for p in parts)
        if math.prod(dims) != self.world_size:
            raise ValueError(f"cluster.torus = {self.torus!r} has {math.prod(dims)} chips but cluster.nodes x "
                             f"cluster.gpus_per_node = {self.nodes} x {self.gpus_per_node} = {self.world_size}; they "
                             f"must be equal")
        return dims

    @property
    def torus_wraps(self) -> bool:
        """Whether the torus has wrap-around links (every dimension at least 4; the field's comment)."""
        return bool(self.torus) and min(self.torus_dims) >= 4

    @property
    def unfoldable(self) -> str:
        """Why this cluster's ranks cannot stand for each other (engine/fold.py), or "" if they can."""
        if self.torus:
            return "on a torus, transfers share the links of their routes between chips"
        if self.spine:
            return "an oversubscribed spine is shared by every rank's transfers across rails"
        return ""

    @property
    def spine(self) -> bool:
        """Whether transfers across rails share an oversubscribed spine (cluster.py routes them)."""
        return self.oversubscription > 1 and self.nodes > 1 and not self.torus

    def with_overrides(self, **kw: Any) -> "ClusterSpec":
        valid = {f.name for f in fields(self)} - {"preset"}
        for k in kw:
            if k not in valid:
                raise ValueError(f"unknown cluster field {k!r}; valid: {', '.join(sorted(valid))}")
        return replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, profile=None))
        if self.torus:
            out["torus_wraps"] = self.torus_wraps
        if self.power_limit_w:
            out["clock_scale"] = round(self.clock_scale, 4)
        if self.profile is None:
            del out["profile"]
        else:
            out["profile"] = self.profile.source
        return out


PRESETS: dict[str, ClusterSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 400 W, 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, 2,039 GB/s HBM2e,
    # NVLink 3 600 GB/s total (300 each way); DGX A100: 8 GPUs, one 200 Gb/s HDR InfiniBand NIC each.
    "dgx-a100": ClusterSpec(preset="dgx-a100", device="A100-SXM4-80GB"),
    # NVIDIA H100 SXM5 datasheet: up to 700 W, 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 3.35 TB/s HBM3,
    # NVLink 4 900 GB/s total (450 each way); DGX H100: 8 GPUs, one 400 Gb/s NDR NIC each.
    "dgx-h100": ClusterSpec(preset="dgx-h100", device="H100-SXM5-80GB", peak_tflops=989.0, peak_tflops_fp32=67.0,
                            hbm_gbyte_per_s=3350.0, memory_gbyte=80.0, nvlink_gbyte_per_s=450.0, nic_gbit_per_s=400.0,
                            tdp_w=700.0,
                            # 132 SMs (datasheet); MAMF 792.1 of 989 TFLOP/s (Bekman, as above)
                            sms=132, matmul_efficiency=0.801,
                            # Fitted: the one published H100 bf16 run whose step is compute nearly alone, Megatron-Core
                            # r0.8's 177B GPT on 96 GPUs (the layout of its weak-scaling 177B row, TP 8 x PP 6, so DP 2:
                            # 576 micro-batches a step, a bubble under 1 %), 47 % MFU (the Megatron-LM README of
                            # 2024-07-15, f2e5db402c: "a reduction in MFU from 47% to 42%" from 96 to 4,608 GPUs), which
                            # 1.0 predicts at 59.9 % and 0.76 at 47.0 (benchmarks/megatron_core_2024_strong.toml). No
                            # other row was fitted. (0.82 until each kernel moved its tensors' own bytes and Megatron's
                            # gradient accumulation fusion was modelled: both took time off that run's step.) With it,
                            # torchtitan's two tables come within -5 to +4 %, where they were 14 to 25 % fast, Llama 3's
                            # rows within -8 to -3 % (its attention FlashAttention-2's), Megatron-Core's pipelined
                            # rows within -1 to +6 %, and one stack's speedup from A100s to H100s on the same
                            # configurations (LLM Foundry's 2023 MPT table) within -7 to +8 %
                            # (benchmarks/fidelity.py). The likely cause, not measured here: the clock under a long
                            # load. bf16 GEMMs on random data draw the most power and throttle at the board's limit (H.
                            # He, "Strangely, Matrix Multiplications on GPUs Run Faster When Given 'Predictable' Data",
                            # 2024); an H100 DGX timed an 8,192 x 2,048 x 2,048 bf16 GEMM at 687 TFLOP/s on average
                            # (NVIDIA/TransformerEngine#2053, torch's Linear: 100.06 us), where the rates above give
                            # 768. benchmarks/sustained_gemm.py measures it on a GPU.
                            sustained_compute=0.76,
                            # attention: cuDNN's fused kernel, which Transformer Engine (Megatron-Core) prefers
                            # on Hopper (NVIDIA NeMo docs, PR #9188), 631.3 TFLOP/s (FlashAttention-3: 631.8)
                            # on batch 1, 24 heads, 4,608 tokens, head dim 128 (tritonbench, forward, in
                            # pytorch/pytorch#142132, 2024-12); the backward at 0.82 of it (cluster.ATTENTION_BACKWARD)
                            attention_efficiency=631.3 / 989,
                            # PCIe Gen5 x16: 128 GB/s both ways (datasheet); DGX H100: 2 TB, 8 x 3.84 TB
                            # NVMe (datasheet); two Xeon 8480C, 8 channels of DDR5-4800 each: 614.4 GB/s, so
                            # CPU Adam at 307.2 / 28 = 11.0 G parameters/s (the A100 preset's assumption)
                            pcie_gbyte_per_s=64.0, cpu_adam_gparam_per_s=11.0),
    # Google Cloud TPU v5p (docs.cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 per chip, 95 GiB HBM
    # (of 96) at 2,765 GB/s, 1,200 GB/s bidirectional ICI per chip over the six links of a 3D torus,
    # 4 chips a host, slices from 2x2x1 to 16x16x24. Two TensorCores of four 128 x 128 MXUs each: eight
    # units working on one output tile each, as `sms` (the tile/wave model of cluster.py). Assumptions:
    # fp32 matmuls as six bf16 passes (XLA's highest precision); the share of the MXUs' peak that a
    # best-shaped matmul reaches (no measured figure found), attention's the A100's (none found either);
    # no rated power published (tdp_w 0: a power limit is refused); the host's figures are the DGX A100's
    # (none found for a v5p host); the NVLink/NIC figures are unused.
    "tpu-v5p": ClusterSpec(preset="tpu-v5p", device="TPU-v5p", gpus_per_node=4, torus="2x2x1", peak_tflops=459.0,
                           peak_tflops_fp32=459.0 / 6, hbm_gbyte_per_s=2765.0, memory_gbyte=95.0,
                           ici_gbyte_per_s=100.0, sms=8, matmul_efficiency=0.8, tdp_w=0.0),
}


def preset(name: str, **overrides: Any) -> ClusterSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].with_overrides(**overrides) if overrides else PRESETS[name]
