"""An analytic cost model of data-parallel training: step time, throughput and scaling
efficiency on 1 to thousands of GPUs, from one GPU's step time, the gradient size and the
network.

A step on ``p`` GPUs is the compute of one GPU on its share of the batch, plus whatever part of
the gradient all-reduce the backward pass does not hide, plus an optional fixed overhead. The
all-reduce follows the usual latency-bandwidth (alpha-beta) costs of the ring, tree and
hierarchical (2D-torus) algorithms, with links of two speeds: inside a node (NVLink) and
between nodes (the network). Everything here is a pure function of its arguments; the command
(``command.py``) reads options and prints, the calibration (``calibration.py``)
compares with published runs. ``docs/scaling.md`` states what the model leaves out.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import UsageError

ALGORITHMS = ("ring", "tree", "hierarchical")
COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
BACKWARD_FRACTION = 2 / 3
"""Share of a training step's compute in the backward pass (about twice the forward's FLOPs)."""

KNOWN_PARAMS = {
    # Parameter counts of the torchvision ImageNet (1000-class) models.
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}


def gbps_to_bytes_per_second(gbps: float) -> float:
    """Gigabits per second (the unit of link datasheets) to bytes per second."""
    return gbps * 1e9 / 8


# ------------------------------------------------------------------------------------------
# Networks
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Network:
    """The links an all-reduce runs over. Bandwidths are one direction, in Gb/s: ``intra_gbps``
    per GPU inside a node (what nccl-tests calls bus bandwidth), ``inter_gbps`` per node to the
    network (all its adapters together). Latencies are per message step of an algorithm."""
    name: str
    description: str
    gpus_per_node: int
    intra_gbps: float
    inter_gbps: float
    latency_us: float
    intra_latency_us: float = 1.0

    def validate(self) -> "Network":
        for option, value in (("--gpus-per-node", self.gpus_per_node), ("--bandwidth-gbps", self.inter_gbps),
                              ("--intra-bandwidth-gbps", self.intra_gbps)):
            if not value > 0:
                raise UsageError(f"{option} {value:g}: must be above 0")
        if not self.latency_us >= 0:
            raise UsageError(f"--latency-us {self.latency_us:g}: must be 0 or more")
        return self


# Link rates are datasheet peaks (NVLink: links x 25 GB/s, or 20 GB/s for NVLink 1, per
# direction); an achieved all-reduce reaches less, which --bandwidth-gbps can say. Network
# latencies are what a collective library sees per step, software included, not the wire's.
NETWORKS: dict[str, Network] = {n.name: n for n in (
    Network("abci", "ABCI (AIST): 4 V100 SXM2 per node on NVLink 2 (6 links), 2x InfiniBand EDR "
            "(2 x 100 Gb/s) per node; the cluster of the 2,048-GPU and Sony 2D-torus runs",
            gpus_per_node=4, intra_gbps=1200, inter_gbps=200, latency_us=5),
    Network("big-basin", "Facebook Big Basin: 8 P100 SXM2 per server on NVLink 1 (4 links), "
            "50 Gb/s Ethernet per server; the cluster of Goyal et al.'s 256-GPU run",
            gpus_per_node=8, intra_gbps=640, inter_gbps=50, latency_us=20),
    Network("dgx-a100", "NVIDIA DGX A100: 8 A100 SXM4 on NVLink 3 / NVSwitch (12 links), "
            "8x InfiniBand HDR (8 x 200 Gb/s) per node",
            gpus_per_node=8, intra_gbps=2400, inter_gbps=1600, latency_us=5),
    Network("dgx-h100", "NVIDIA DGX H100: 8 H100 SXM5 on NVLink 4 / NVSwitch (18 links), "
            "8x InfiniBand NDR (8 x 400 Gb/s) per node",
            gpus_per_node=8, intra_gbps=3600, inter_gbps=3200, latency_us=5),
    Network("ethernet-25g", "cloud servers of 8 GPUs on PCIe 4.0 x16 (about 25 GB/s), one 25 Gb/s "
            "Ethernet adapter per server, TCP",
            gpus_per_node=8, intra_gbps=200, inter_gbps=25, latency_us=30),
)}


def network_preset(name: str) -> Network:
    if name not in NETWORKS:
        raise UsageError(f"--network {name!r}: unknown preset; choose one of {', '.join(NETWORKS)} "
                         "(--bandwidth-gbps, --latency-us and --gpus-per-node change its links)")
    return NETWORKS[name]


# ------------------------------------------------------------------------------------------
# All-reduce costs (seconds), alpha-beta model
# ------------------------------------------------------------------------------------------

def ring_allreduce_seconds(nbytes: float, ranks: int, bytes_per_second: float, latency_s: float) -> float:
    """Reduce-scatter then all-gather around a ring: 2(p-1) steps, each moving nbytes/p."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bytes_per_second + 2 * (ranks - 1) * latency_s


def tree_allreduce_seconds(nbytes: float, ranks: int, bytes_per_second: float, latency_s: float) -> float:
    """Reduce up and broadcast down a pipelined (double) binary tree: the bandwidth term of a
    ring (each rank sends and receives about 2 x nbytes) with a latency of log2(p) levels."""
    if ranks <= 1:
        return 0.0
    return 2 * nbytes / bytes_per_second + 2 * math.ceil(math.log2(ranks)) * latency_s


def nodes_for(gpus: int, net: Network) -> int:
    return math.ceil(gpus / net.gpus_per_node)


def allreduce_seconds(nbytes: float, gpus: int, net: Network, algorithm: str) -> float:
    """Time to all-reduce ``nbytes`` of gradients over ``gpus`` GPUs.

    Within one node every algorithm runs on NVLink. Across nodes, ``ring`` and ``tree`` span
    all GPUs with the node's network adapters as the narrow link (one ring or tree per
    adapter, each carrying its share), and ``hierarchical`` reduce-scatters inside each node,
    all-reduces each GPU's shard across nodes in a ring (the GPUs of a node share its
    adapters), and all-gathers inside the node: the 2D-torus scheme."""
    if algorithm not in ALGORITHMS:
        raise UsageError(f"--algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    intra_bw, inter_bw = gbps_to_bytes_per_second(net.intra_gbps), gbps_to_bytes_per_second(net.inter_gbps)
    intra_lat, inter_lat = net.intra_latency_us * 1e-6, net.latency_us * 1e-6
    nodes = nodes_for(gpus, net)
    if nodes == 1:
        flat = tree_allreduce_seconds if algorithm == "tree" else ring_allreduce_seconds
        return flat(nbytes, gpus, intra_bw, intra_lat)
    if algorithm == "ring":
        return ring_allreduce_seconds(nbytes, gpus, inter_bw, inter_lat)
    if algorithm == "tree":
        return tree_allreduce_seconds(nbytes, gpus, inter_bw, inter_lat)
    local = net.gpus_per_node
    # reduce-scatter and all-gather inside the node: each is half of a ring all-reduce
    inside = ring_allreduce_seconds(nbytes, local, intra_bw, intra_lat)
    across = ring_allreduce_seconds(nbytes, nodes, inter_bw, inter_lat)
    return inside + across


# ------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What one GPU does per step and what it must share.

    ``images_per_second``: one GPU's training rate at ``batch_per_gpu`` (taken to hold at
    every per-GPU batch). ``global_batch``: set for strong scaling (the batch is split over
    the GPUs), None for weak scaling (each GPU keeps ``batch_per_gpu``). ``overlap``: the
    fraction of the backward pass during which the all-reduce can run hidden (0: it starts
    after backward; 1: it may run during all of it)."""
    gradient_bytes: float
    images_per_second: float
    batch_per_gpu: float
    global_batch: int | None = None
    overlap: float = 0.0
    overhead_s: float = 0.0

    def validate(self) -> "Workload":
        if not self.gradient_bytes > 0:
            raise UsageError(f"gradient size {self.gradient_bytes:g} bytes: give a model with parameters")
        if not self.images_per_second > 0:
            raise UsageError(f"one GPU's speed is {self.images_per_second:g} images/s (--images-per-second or "
                             "--step-time): it must be above 0")
        if not self.batch_per_gpu > 0:
            raise UsageError(f"--batch-per-gpu {self.batch_per_gpu:g}: must be above 0")
        if self.global_batch is not None and self.global_batch < 1:
            raise UsageError(f"--global-batch {self.global_batch}: must be above 0")
        if not 0 <= self.overlap <= 1:
            raise UsageError(f"--overlap {self.overlap:g}: must be between 0 and 1")
        if not self.overhead_s >= 0:
            raise UsageError(f"--overhead-ms {self.overhead_s * 1e3:g}: must be 0 or more")
        return self

    def batch_on(self, gpus: int) -> float:
        return self.batch_per_gpu if self.global_batch is None else self.global_batch / gpus


@dataclass(frozen=True)
class StepPrediction:
    gpus: int
    nodes: int
    batch_per_gpu: float
    compute_s: float
    allreduce_s: float
    exposed_s: float
    step_s: float
    images_per_s: float
    efficiency: float

    def as_dict(self) -> dict:
        return asdict(self)


def exposed_seconds(allreduce_s: float, compute_s: float, overlap: float) -> float:
    """The part of the all-reduce left after hiding what it can behind the backward pass."""
    return max(0.0, allreduce_s - overlap * BACKWARD_FRACTION * compute_s)


def _step(gpus: int, work: Workload, net: Network, algorithm: str) -> tuple[float, float, float, float]:
    batch = work.batch_on(gpus)
    compute = batch / work.images_per_second
    allreduce = allreduce_seconds(work.gradient_bytes, gpus, net, algorithm)
    exposed = exposed_seconds(allreduce, compute, work.overlap)
    return batch, compute, allreduce, exposed


def predict(gpu_counts: list[int], work: Workload, net: Network, algorithm: str) -> list[StepPrediction]:
    """One prediction per GPU count. Efficiency is throughput(p) / (p x throughput(1)), one
    GPU running the same per-GPU batch (weak scaling) or the whole batch (strong scaling)."""
    work, net = work.validate(), net.validate()
    b1, c1, _, _ = _step(1, work, net, algorithm)
    one_gpu_rate = b1 / (c1 + work.overhead_s)
    rows = []
    for gpus in gpu_counts:
        if gpus < 1:
            raise UsageError(f"--gpus {gpus}: a GPU count must be above 0")
        batch, compute, allreduce, exposed = _step(gpus, work, net, algorithm)
        step = compute + exposed + work.overhead_s
        rate = gpus * batch / step
        rows.append(StepPrediction(gpus, nodes_for(gpus, net), batch, compute, allreduce, exposed, step, rate,
                                   rate / (gpus * one_gpu_rate)))
    return rows


def default_gpu_counts(limit: int = 4096) -> list[int]:
    """1, 2, 4, ... up to ``limit``."""
    return [2 ** k for k in range(int(math.log2(limit)) + 1)]
