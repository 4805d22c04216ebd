"""Published large-scale ResNet-50 runs, as data, and the cost model's predictions for them.

Each run says which of its numbers the source publishes and which are derived here or
assumed, so that ``speedrun scale --calibration`` (and the table in ``docs/scaling.md``)
can show predicted against published honestly. Efficiency is throughput per GPU at ``gpus``
over throughput per GPU at ``base_gpus``, as each source defines its baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import COMM_BYTES, KNOWN_PARAMS, NETWORKS, Workload, predict

IMAGENET_TRAIN_IMAGES = 1_281_167


@dataclass(frozen=True)
class PublishedRun:
    key: str
    source: str                   # paper title, or MLPerf round, submitter and result ids
    network: str                  # a preset of model.NETWORKS
    algorithm: str
    comm_dtype: str
    gpus: int
    base_gpus: int                # the efficiency's baseline, as the source states it
    batch_per_gpu: float
    base_batch_per_gpu: float
    images_per_second: float      # one GPU's training rate at base_batch_per_gpu
    efficiency: float             # published, or derived from published times (see ``measure``)
    measure: str                  # what ``efficiency`` is and how it was obtained
    inputs: str                   # which inputs are published, derived or assumed
    overlap_in_run: str           # whether the run overlapped all-reduce with backward, if known


def _rate(epochs: float, minutes: float, gpus: int) -> float:
    return epochs * IMAGENET_TRAIN_IMAGES / (minutes * 60) / gpus


# MLPerf Training v3.0, closed division, ResNet-50 v1.5 (MXNet), time to train in minutes.
# The 8-GPU result targets epoch 35 at 400 images per GPU (its config in the submission); the
# NVIDIA multi-node configs of the next round (v3.1) target epoch 35 at 50 per GPU on 64 GPUs
# and epoch 77 at 16 per GPU on 3,584 GPUs, assumed here to be those of the v3.0 runs.
_H100_RATE = _rate(35, 13.466, 8)

PUBLISHED_RUNS: list[PublishedRun] = [
    PublishedRun(
        "yamazaki-2019-abci-2048",
        "Yamazaki et al. 2019, 'Yet Another Accelerated SGD: ResNet-50 Training on ImageNet in "
        "74.7 seconds' (Fujitsu, ABCI, 2,048 V100, batch 81,920, 75.08%)",
        "abci", "hierarchical", "fp16", gpus=2048, base_gpus=1, batch_per_gpu=40, base_batch_per_gpu=40,
        images_per_second=1.73e6 / 2048 / 0.77, efficiency=0.77,
        measure="throughput efficiency, published (about 77%)",
        inputs="published: 2,048 GPUs, batch 81,920 (40 per GPU), over 1.73 M images/s; derived: one GPU's "
               "rate 1,097 images/s = 1.73 M / 2,048 / 0.77; assumed: fp16 gradients, hierarchical all-reduce",
        overlap_in_run="not known"),
    PublishedRun(
        "goyal-2017-big-basin-256",
        "Goyal et al. 2017, 'Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour' "
        "(Facebook, 256 P100 in 32 Big Basin servers, batch 8,192)",
        "big-basin", "hierarchical", "fp32", gpus=256, base_gpus=8, batch_per_gpu=32, base_batch_per_gpu=32,
        images_per_second=_rate(90, 65, 256) / 0.90, efficiency=0.90,
        measure="throughput efficiency from 8 to 256 GPUs, published (about 90%)",
        inputs="published: 32 images per GPU, 90 epochs, about 90% from 8 to 256 GPUs; derived: one GPU's rate "
               "128 images/s from 90 epochs in 65 min at 90%; assumed: 50 Gb/s per server (as we recall the "
               "paper), fp32 gradients",
        overlap_in_run="yes (gradients reduced during backprop)"),
    PublishedRun(
        "mikami-2018-abci-1088",
        "Mikami et al. 2018, 'ImageNet/ResNet-50 Training in 224 Seconds' (Sony, ABCI, 2D-torus "
        "all-reduce; 90% scaling efficiency on 1,088 V100 as reported)",
        "abci", "hierarchical", "fp16", gpus=1088, base_gpus=1, batch_per_gpu=32, base_batch_per_gpu=32,
        images_per_second=1.73e6 / 2048 / 0.77, efficiency=0.90,
        measure="GPU scaling efficiency as reported in press coverage (90%; one report says 91.62%)",
        inputs="published: 1,088 GPUs, 2D-torus, mixed precision; assumed: 32 images per GPU (34K batch), "
               "the V100 rate of the Fujitsu row, fp16 gradients",
        overlap_in_run="not known"),
    PublishedRun(
        "mlperf-3.0-h100-64",
        "MLPerf Training v3.0 ResNet-50: NVIDIA DGX H100 x 8 nodes (3.0-2071) 2.664 min, against "
        "Dell XE9680 8x H100 (3.0-2053) 13.466 min",
        "dgx-h100", "hierarchical", "fp16", gpus=64, base_gpus=8, batch_per_gpu=50, base_batch_per_gpu=400,
        images_per_second=_H100_RATE, efficiency=(35 / 2.664 / 64) / (35 / 13.466 / 8),
        measure="derived: images/s per GPU from time to train and epochs, against the 8-GPU result",
        inputs="published: times to train, 400 per GPU and epoch 35 on 8 GPUs; assumed from the v3.1 config: "
               "50 per GPU and epoch 35 on 64; fp16 gradients. Times include evaluation, so rates are low bounds",
        overlap_in_run="no (the config says all-reduce does not overlap backward)"),
    PublishedRun(
        "mlperf-3.0-h100-3584",
        "MLPerf Training v3.0 ResNet-50: CoreWeave HGX H100, 448 nodes x 8 (3.0-2002) 0.183 min, against "
        "Dell XE9680 8x H100 (3.0-2053) 13.466 min",
        "dgx-h100", "tree", "fp16", gpus=3584, base_gpus=8, batch_per_gpu=16, base_batch_per_gpu=400,
        images_per_second=_H100_RATE, efficiency=(77 / 0.183 / 3584) / (35 / 13.466 / 8),
        measure="derived: images/s per GPU from time to train and epochs, against the 8-GPU result",
        inputs="published: times to train, 400 per GPU and epoch 35 on 8 GPUs; assumed from the v3.1 config: "
               "16 per GPU, epoch 77, in-network (SHARP) reduction modelled as a tree; fp16 gradients",
        overlap_in_run="no (the config says all-reduce does not overlap backward)"),
]


def predicted_efficiency(run: PublishedRun, overlap: float = 0.0) -> dict:
    """The model's throughput per GPU at ``run.gpus`` over that at ``run.base_gpus``."""
    net = NETWORKS[run.network]
    grad = KNOWN_PARAMS["resnet50"] * COMM_BYTES[run.comm_dtype]

    def per_gpu_rate(gpus: int, batch: float) -> tuple[float, float]:
        work = Workload(grad, run.images_per_second, batch, overlap=overlap)
        row = predict([gpus], work, net, run.algorithm)[0]
        return row.images_per_s / gpus, row.step_s

    scaled, step = per_gpu_rate(run.gpus, run.batch_per_gpu)
    base, _ = per_gpu_rate(run.base_gpus, run.base_batch_per_gpu)
    return {"efficiency": scaled / base, "images_per_s": scaled * run.gpus, "step_s": step}


def calibration_table() -> list[dict]:
    """Published against predicted (no overlap, the default; and full overlap), one row a run."""
    rows = []
    for run in PUBLISHED_RUNS:
        none, full = predicted_efficiency(run, 0.0), predicted_efficiency(run, 1.0)
        rows.append({"key": run.key, "source": run.source, "gpus": run.gpus, "base_gpus": run.base_gpus,
                     "network": run.network, "algorithm": run.algorithm, "comm_dtype": run.comm_dtype,
                     "published_efficiency": run.efficiency, "measure": run.measure, "inputs": run.inputs,
                     "overlap_in_run": run.overlap_in_run,
                     "predicted_efficiency": none["efficiency"], "predicted_images_per_s": none["images_per_s"],
                     "predicted_step_s": none["step_s"],
                     "predicted_efficiency_full_overlap": full["efficiency"],
                     "difference_points": 100 * (none["efficiency"] - run.efficiency)})
    return rows
