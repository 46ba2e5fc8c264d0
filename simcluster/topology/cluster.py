"""A cluster built from a spec: which node holds a rank, which links a transfer crosses, kernel cost.

Links are numbered `rank * 4 + port`, one per direction: a transfer inside a node leaves through the
sender's NVLink port and enters the receiver's (the NVSwitch itself does not block); a transfer
between nodes leaves through the sender's NIC and enters the receiver's (a non-blocking fabric).
On a torus (`cluster.torus`) the ports go unused: chip r's link along dimension d, direction + or -,
is `world * 4 + r * 2D + 2d (+1 for -)`, and a transfer crosses the links of its dimension-order
route (x first, then y, then z; the shorter way round where the torus wraps, + on a tie).
After those, every GPU's PCIe link to its host, each way (GPU to host, host to GPU), then every
node's NVMe drives, each way (writes, reads): a copy between memory tiers (ZeRO-Offload/Infinity)
crosses them, and the GPUs of a node share their NVMe drives. Kernels on a rank's "cpu" stream run
on its host's cores (`host_kernel_ns`).
"""

from __future__ import annotations

import math

from simcluster.numerics.ops import EINSUM_PARTIAL, GEMM_PARTIAL
from simcluster.topology.presets import ClusterSpec
from simcluster.topology.profile import kernel_rate

NVLINK_OUT, NVLINK_IN, NIC_OUT, NIC_IN = range(4)
PORT_NAMES = ("nvlink-out", "nvlink-in", "nic-out", "nic-in")
HOST = "cpu"  # the stream whose kernels run on the host's cores (CPU Adam)
# FLOPs ops.adam counts a parameter: the host's rate is set so that an Adam step runs at the preset's
# CPU Adam throughput, and the host's other kernels (casts, unscaling) at that FLOP rate
ADAM_FLOPS = 12
# A GEMM's output tile per SM: 128 x 128, the middle of cuBLAS's tensor-core tiles on Ampere and
# Hopper (64 x 64 to 256 x 128); one size for every GEMM is the model's simplification.
TILE = 128
# FlashAttention's kernels (model/flash.py), which run at the preset's attention_efficiency
ATTENTION_KERNELS = ("flash_attention", "flash_attention_backward")
# and the backward at this share of the forward's rate: on an H100, head dim 128, 4k tokens, cuDNN's fused
# attention runs its backward at 499 TFLOP/s against 609 forward (FlashAttention-2: 310 against 368, 0.84;
# FlashAttention-3: 542 against 638, 0.85), Shah et al. 2024, "FlashAttention-3", the H100 SXM5 figures
ATTENTION_BACKWARD = 499 / 609


class Cluster:
    def __init__(self, spec: ClusterSpec, tp: int = 1) -> None:
        self.spec = spec
        self.tp = tp  # the mesh's tp degree: how a ring orders a node's ranks (ring_order)
        self.world_size = spec.world_size
        self.gpus_per_node = spec.gpus_per_node
        nvlink, nic = spec.nvlink_bytes_per_ns, spec.nic_bytes_per_ns
        # capacity in bytes per ns, by link id; with an oversubscribed spine, each rail's uplink and
        # downlink after the ports (link world * 4 + 2 rail, + 1)
        self.capacity: list[float] = [nvlink, nvlink, nic, nic] * self.world_size
        self.spine = spec.spine
        if self.spine:
            self.capacity += [spec.nodes * nic / spec.oversubscription] * (2 * self.gpus_per_node)
        self.torus = spec.torus_dims  # () without a torus
        if self.torus:
            self.wrap = spec.torus_wraps
            self.capacity += [spec.ici_gbyte_per_s] * (2 * len(self.torus) * self.world_size)
        self.host_base = len(self.capacity)  # PCIe: rank r's links host_base + 2r (to the host), + 1 (back)
        self.capacity += [spec.pcie_gbyte_per_s * spec.pcie_efficiency] * (2 * self.world_size)
        self.nvme_base = len(self.capacity)  # NVMe: node n's nvme_base + 2n (writes), + 1 (reads)
        self.capacity += [spec.nvme_gbyte_per_s] * (2 * spec.nodes)
        # each rank's share of its host's cores, in FLOPs per ns
        self._host_flops_per_ns = ADAM_FLOPS * spec.cpu_adam_gparam_per_s / self.gpus_per_node
        peak = {"bf16": spec.peak_tflops * 1e3, "fp16": spec.peak_tflops * 1e3,  # FLOPs per ns
                "fp32": spec.peak_tflops_fp32 * 1e3, "fp64": spec.peak_tflops_fp32 * 1e3 / 2}
        # compute-bound rates, at the clock a power limit leaves (presets.POWER_CLOCK_EXPONENT) and what a run sustains
        scale = spec.compute_scale
        self._flops_per_ns = {d: r * spec.compute_efficiency * scale for d, r in peak.items()}
        self._gemm_flops_per_ns = {d: r * spec.matmul_efficiency * scale for d, r in peak.items()}
        self._attention_flops_per_ns = {d: r * spec.attention_efficiency * scale for d, r in peak.items()}
        self._attention_backward_flops_per_ns = {d: r * ATTENTION_BACKWARD for d, r in self._attention_flops_per_ns.items()}
        self._bytes_per_ns = spec.hbm_gbyte_per_s * spec.memory_efficiency
        self.profile = spec.profile
        # a profile's GEMM rates: TFLOP/s to FLOPs a ns, at the share a run keeps (1 unless a scenario sets one)
        self._profile_gemm_scale = 1e3 * spec.sustained_compute
        sixteen = self.profile and self.profile.memory_gbyte_per_s_16bit  # (measured: efficiency 1)
        self._bytes_per_ns_by_dtype = {"bf16": sixteen, "fp16": sixteen} if sixteen else {}
        # a profile's kernels measured one by one: (name, dtype) -> bytes per ns
        self._named = self.profile.kernel_rates() if self.profile else {}
        # (a CPU profile's: the kernel set's uncharged calls, a share of every kernel's time in a run of a dtype)
        self._host_share = {d: 1.0 + v for d, v in self.profile.host_share} if self.profile else {}
        # (by name too where the profile times a GEMM writing partial sums apart: GEMM_PARTIAL)
        self.named_rates = bool(self.profile) and (bool(self._named) or any(g.partial for g in self.profile.gemm))
        self.collective_rates = dict(self.profile.collective_rates) if self.profile else {}

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node

    def coords(self, rank: int) -> tuple[int, ...]:
        """A chip's place on the torus, x first."""
        out = []
        for n in self.torus:
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(out)

    def rank_at(self, coords: tuple[int, ...] | list[int]) -> int:
        rank = 0
        for n, c in zip(reversed(self.torus), reversed(coords)):
            rank = rank * n + c
        return rank

    def route(self, src: int, dst: int) -> tuple[tuple[int, ...], int]:
        """(link ids, per-step latency in ns) of a transfer from src to dst."""
        if self.torus:
            return self._torus_route(src, dst)
        if self.same_node(src, dst):
            return (src * 4 + NVLINK_OUT, dst * 4 + NVLINK_IN), self.spec.nvlink_latency_ns
        a, b = src % self.gpus_per_node, dst % self.gpus_per_node
        if self.spine and a != b:  # across rails: up from rail a's leaf, down to rail b's
            spine = self.world_size * 4
            return (src * 4 + NIC_OUT, spine + 2 * a, spine + 2 * b + 1, dst * 4 + NIC_IN), self.spec.nic_latency_ns
        return (src * 4 + NIC_OUT, dst * 4 + NIC_IN), self.spec.nic_latency_ns

    def copy_route(self, rank: int, src: str, dst: str) -> tuple[int, ...]:
        """The links a copy between rank's memory tiers crosses: PCIe between GPU and host, the node's
        NVMe drives between host and NVMe (GPU to NVMe: both, through a host buffer)."""
        down, up = self.host_base + 2 * rank, self.host_base + 2 * rank + 1
        write, read = self.nvme_base + 2 * self.node_of(rank), self.nvme_base + 2 * self.node_of(rank) + 1
        return {("gpu", "cpu"): (down,), ("cpu", "gpu"): (up,), ("cpu", "nvme"): (write,), ("nvme", "cpu"): (read,),
                ("gpu", "nvme"): (down, write), ("nvme", "gpu"): (read, up)}[(src, dst)]

    def _torus_route(self, src: int, dst: int) -> tuple[tuple[int, ...], int]:
        here, there = list(self.coords(src)), self.coords(dst)
        per_rank, base = 2 * len(self.torus), self.world_size * 4
        links = []
        for d, n in enumerate(self.torus):
            ahead = (there[d] - here[d]) % n
            if self.wrap:
                step, hops = (1, ahead) if ahead <= n - ahead else (-1, n - ahead)
            else:
                step, hops = (1, ahead) if there[d] >= here[d] else (-1, here[d] - there[d])
            for _ in range(hops):
                links.append(base + self.rank_at(here) * per_rank + 2 * d + (step < 0))
                here[d] = (here[d] + step) % n
        return tuple(links), len(links) * self.spec.ici_latency_ns

    def ring_order(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The order a ring visits `ranks` in: by node, inside a node by tp index, then by rank.

        Through an NVSwitch every order costs the same; this one is mapped onto itself when the tp
        index is rotated inside each tp group (a ring through tp ranks 0,0,..,1,1,..: the rotation
        shifts it along itself), so a group across tp groups (the clipping norm's world all-reduce)
        moves the same flows on every tp rank, which lets a simulation fold tp peers (engine/fold.py).
        With tp = 1, or a group inside one tp group, it is rank order; on a torus too (phases.py then
        rings along each dimension where it can)."""
        if self.torus:
            return tuple(sorted(ranks))
        t = self.tp
        return tuple(sorted(ranks, key=lambda r: (r // self.gpus_per_node, r % t, r)))

    def link_name(self, link: int) -> str:
        if link >= self.nvme_base:
            node, read = divmod(link - self.nvme_base, 2)
            return f"node{node}:nvme-{'read' if read else 'write'}"
        if link >= self.host_base:
            rank, up = divmod(link - self.host_base, 2)
            return f"rank{rank}:pcie-{'h2d' if up else 'd2h'}"
        if self.torus and link >= self.world_size * 4:
            rank, rest = divmod(link - self.world_size * 4, 2 * len(self.torus))
            return f"rank{rank}:ici-{'xyz'[rest // 2]}{'+-'[rest % 2]}"
        if link >= self.world_size * 4:
            rail, down = divmod(link - self.world_size * 4, 2)
            return f"spine:rail{rail}-{'down' if down else 'up'}"
        return f"rank{link // 4}:{PORT_NAMES[link % 4]}"

    def host_kernel_ns(self, work: float | tuple[int, int, int, int], nbytes: float, dtype: str,
                       name: str = "") -> int:
        """A kernel on the host's cores (the "cpu" stream): its FLOPs at the rank's share of the host's
        rate (ADAM_FLOPS x the CPU Adam throughput / GPUs a node), plus the launch gap."""
        flops = 2.0 * math.prod(work) if work.__class__ is tuple else work
        return int(math.ceil(flops / self._host_flops_per_ns)) + self.spec.kernel_overhead_ns

    def kernel_ns(self, work: float | tuple[int, int, int, int], nbytes: float, dtype: str, name: str = "") -> int:
        """max(compute-bound, memory-bound) time plus the per-kernel overhead, in whole ns.

        `work` is a kernel's FLOPs, or a GEMM's shape (batch, m, n, k). A GEMM runs as output tiles,
        one per SM at a time, so it takes as many waves as its tiles fill and every wave costs a whole
        wave's FLOPs (tile and wave quantisation; NVIDIA's "Matrix Multiplication Background" guide):
        the (m, n) = (2048, 2304) products of a 2,304-wide model take 288 tiles of 128 x 128, three
        waves of 108 on an A100, 89 % of them doing work. A side shorter than the tile gets a tile
        of its own size (to a multiple of 16, the tensor cores' step), and a GEMM with fewer tiles
        than SMs splits its k among them (split-K), as cuBLAS does for narrow products. With a measured
        profile, a GEMM runs at the rate measured for the shape nearest it instead, and a kernel the profile
        measured by name (`name`, past its label; in a run of `dtype`) at the bandwidth measured for it at its
        size (`profile.kernel_rate`); and where the profile measured a CPU kernel set's uncharged calls
        (`host_share`), every kernel takes that share longer."""
        if work.__class__ is tuple and self.profile is not None:  # at the rate measured nearest its shape
            batch, m, n, k = work
            partial = name.rpartition("/")[2] in (GEMM_PARTIAL, EINSUM_PARTIAL)
            rate = self.profile.gemm_rate(batch, m, n, k, dtype, partial) * self._profile_gemm_scale
            flops = 2.0 * batch * m * n * k
        elif work.__class__ is tuple and 0 in work:  # an empty product (an expert no token chose): its launch
            flops, rate = 0.0, 1.0
        elif work.__class__ is tuple:
            batch, m, n, k = work
            tm, tn = min(TILE, -(-m // 16) * 16), min(TILE, -(-n // 16) * 16)
            tiles = batch * -(-m // tm) * -(-n // tn)
            sms = self.spec.sms
            split = max(1, min(sms // max(tiles, 1), -(-k // TILE)))
            flops = 2.0 * -(-k // split) * tm * tn * sms * -(-tiles * split // sms)
            rate = self._gemm_flops_per_ns.get(dtype, self._gemm_flops_per_ns["fp32"])
        else:
            rates = self._flops_per_ns
            if name.endswith(ATTENTION_KERNELS):
                rates = self._attention_backward_flops_per_ns if name.endswith(ATTENTION_KERNELS[1]) else \
                    self._attention_flops_per_ns
            flops, rate = work, rates.get(dtype, rates["fp32"])
        sizes = self._named.get((name.rpartition("/")[2], dtype)) if self._named else None
        if sizes is not None:
            bandwidth = kernel_rate(sizes, nbytes)
        else:
            bandwidth = self._bytes_per_ns_by_dtype.get(dtype, self._bytes_per_ns)
        t = max(flops / rate, nbytes / bandwidth)
        if self._host_share:
            return int(math.ceil((t + self.spec.kernel_overhead_ns) * self._host_share.get(dtype, 1.0)))
        return int(math.ceil(t)) + self.spec.kernel_overhead_ns
