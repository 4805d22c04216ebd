"""The recipe matrix: which recipe trains on which data, in which precision, eager or compiled,
with which overrides (small widths, few steps). Used by tests/test_recipe_matrix.py on the
CPU (and on a GPU by the earlier gpu_smoke.py, which docs/results.md says how to get back);
plain Python, no test framework."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

# Each entry trains long enough on its small slice to beat chance by three standard errors of
# its test accuracy (test_recipe_matrix.py checks): a few epochs of a narrow net, and a warm-up
# scaled to the short run where a recipe's warm-up is counted in epochs (ImageNet's five would
# otherwise fill the whole run), a shorter average where one would outlast the run. Photos
# train at 32 px (the 224 px files through the streamed pipeline's decode, random-resized crop
# and resize; the Tiny-ImageNet folder prepared at 32 px for the resident one): a bf16 step on
# a CPU without native bf16 is emulated at a few GFLOP/s.
# The fp32 speed-net entries run 24 steps of 256 of the 1,024 images: with 12, cifar10-94 passed
# under seed 0 on a 2-core Zen 3 but fell 2-7 of the 256 test images under the bar with seeds 2-5;
# with 24 it beats it by 5-15 images under seeds 0-5.
SPEEDNET = ["model.widths=[16,32,32]", "data.batch_size=256", "eval.batch_size=256", "train.epochs=6"]
RESNET_CIFAR = ["model.width=8", "data.batch_size=64", "eval.batch_size=256", "train.epochs=2"]
# The folder entries train 8 epochs of their 512 images (64 steps of 64). On a 2-core Zen 3, 4
# epochs had left the fp32 runs 3-4 of the 512 test images above the bar under seed 0, and under
# it with seed 3 (the npz entry with seeds 1-3 too); 8 epochs put them 3.6-6.3 points above it
# under seeds 0-3 (the progressive entry: 2.4-7.1).
FOLDER = ["model.widths=[16,32,32]", "data.batch_size=64", "eval.batch_size=256", "train.epochs=8",
          "data.workers=1"]
PHOTO = ["model.width=16", "eval.batch_size=128", "data.workers=1", "data.image_size=32", "eval.every=0"]
IMAGENET = PHOTO + ["data.batch_size=32", "train.epochs=4", "schedule.warmup_epochs=0.5", "optim.lr=3.0"]
LARS = PHOTO + ["data.per_device_batch=32", "train.epochs=4", "schedule.warmup_epochs=0.5"]
RESNET18_FAST = PHOTO + ["data.batch_size=32", "train.epochs=4", "optim.lr=4.0", "model.antialias=stem"]
TINY = ["model.width=8", "data.batch_size=32", "eval.batch_size=128", "train.epochs=6", "data.workers=1",
        "schedule.warmup_epochs=0.3", "data.image_size=32", "optim.lr=4.0"]
# The fp32 entries of LARS and resnet18-fast on the 256 images at 32 px (tiny_npz32) train 8
# epochs, and Tiny-ImageNet's (there and in its folder, which holds the same images) 6: on a
# 2-core Zen 3 their 3 or 4 epochs had fallen under the bar with one of seeds 1-3; with these they
# beat it by 7-24 of the 256 test images under seeds 0-3 (resnet50's 4 epochs: by 11-29).
LONGER = ["train.epochs=8"]
NPZ = ["data.dataset=npz"]
# The bf16 entries: bf16 is computed natively on some of the CPUs the suite runs on (AVX512-BF16,
# AMX) and emulated on others (a Zen 3), and the two round differently, so each entry's margin is
# measured both ways over seeds 0-7 by benchmarks/margins.py (records: benchmarks/results/
# margins-bf16-*.json; on a 2-core AMD EPYC Zen 4, cpu family 25 model 17, with
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 for the emulated way). The lowest margins, in
# test images (native / emulated): cifar10-94 inductor 43/42 and eager 43/42, cifar10-94-cpu
# 22/17, cifar10-94-gpu 7/7, page-resnet9 18/21, dawnbench-resnet18 7/23, folder 57/57,
# imagenet-resnet50 30/24, imagenet-resnet50-lars 14/24, imagenet-resnet18-fast 14/11, imagenette
# 22/34, tiny-imagenet 9/7, fashion-mnist (gemm) 26/28.
# The SGD recipes (cifar10-94, page-resnet9, dawnbench-resnet18, folder) learn CIFAR-10 too slowly
# in a few dozen steps of a narrow net to clear the bar under every seed (on 1,024 CIFAR images,
# 2 epochs of cifar10-94 at batch 64 fell 16 images under it with seed 7, and 4 epochs still only
# cleared it by 2; the folder entry fell 15 under it at 4 epochs): their compiled bf16 entries,
# which need only show that the compiled bf16 step runs and learns (the graphs do not depend on
# the images' values, and the fp32 entries train them on CIFAR-10), learn on Fashion-MNIST (the
# arrays, or the same as a JPEG folder), where the same steps clear it by far.
# The bf16 speed-net entries run 32 steps of 64 images, a third of the images of SPEEDNET's 24
# steps of 256, and warm-up steps a quarter the size
SPEEDNET_SHORTER = ["data.batch_size=64", "train.epochs=2"]
# ... and where that beats the bar by far, at half the widths (a quarter of the convolutions' work;
# the graphs do not depend on the widths)
SPEEDNET_NARROWER = SPEEDNET_SHORTER + ["model.widths=[8,16,16]"]
# imagenette: the 224 px files decoded once (at 40 px here) into a cache, random-resized crops of
# 32 px cut from it on the device, evaluated at 40 px
# finetune: the speed net of the teacher run (cifar10-94 on CIFAR-10's first 1,024 images) fine-tuned
# on the CIFAR-10 JPEG folder, with a target it cannot reach checked every other epoch on a fifth
# of the training images held out (so it trains the whole run), the batch norms held in the head
# epoch
FINETUNE = ["data.workers=1", "eval.batch_size=256", "train.epochs=3", "train.stop_at_target=true", "target=0.99",
            "data.holdout=0.2", "train.stop_check_every=2", "finetune.train_norm=false"]
# AdamW (its LR Adam's per step at ref_batch, its decay torch's coefficient) with layer decay over the
# speed net's 8 blocks, the SGD recipe's 64-fold LR for BN biases back to 1: 0.08 per 1,024 images,
# square-root scaled, is 0.02 a step at batch 64, a short run's LR (fp32, 32 steps of 64 of a
# [16, 32, 32] net, seeds 0-3, on a 2-core Zen 3: 35-52% at 0.01, 52-67% at 0.08, 58-75% at 0.16)
ADAMW = ["optim.name=adamw", "optim.lr=0.08", "optim.lr_scaling=sqrt", "optim.weight_decay=0.05",
         "optim.norm_bias_lr_mult=1.0", "optim.layer_decay=0.8"]
IMAGENETTE = ["model.width=16", "eval.batch_size=128", "data.workers=1", "data.image_size=32", "data.eval_size=40",
              "data.batch_size=32", "train.epochs=4", "optim.lr=4.0", "data.cache_dir={tmp}/cache"]


@dataclass(frozen=True)
class Entry:
    """One run: a recipe on a data set, in a precision, eager or compiled with a backend."""
    recipe: str
    data: str                              # a fixture name
    sets: tuple[str, ...]
    precision: str = "fp32"
    backend: str | None = None             # None: eager
    subprocess: bool = False               # through a real `speedrun` process
    # two real processes with speedrun's own compile folder (no $TORCHINDUCTOR_CACHE_DIR), the
    # second identical to the first, which must find every compiled graph there
    cache_reuse: bool = False
    expect_files: tuple[str, ...] = ()
    args: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        mode = "eager" if self.backend is None else f"compiled-{self.backend}"
        return f"{self.recipe}-{self.data}-{self.precision}-{mode}"


def bar(classes: int, images: int) -> float:
    """What an entry's test accuracy must reach: chance plus three standard errors of an accuracy
    on ``images`` test images."""
    chance = 1 / classes
    return chance + 3 * math.sqrt(chance * (1 - chance) / images)


def command(entry: Entry, data: Path, out: Path, seed: int | None = None,
            teacher: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The `speedrun` arguments that train ``entry`` on ``data`` into ``out`` (``seed``: in place
    of the recipe's; ``teacher``: the model distilled from, or started from, for entries that
    take one), and the
    environment its compile backend needs."""
    sets = [s.replace("{tmp}", str(out.parent)) for s in entry.sets] + [f"runtime.precision={entry.precision}",
                               f"runtime.compile={'off' if entry.backend is None else 'on'}"]
    if "teacher" in entry.args:
        sets.append(f"distill.teacher={teacher}")
    if "init" in entry.args:                   # (the same run's weights to start from)
        sets.append(f"model.init={teacher}")
    if entry.data == "jpeg32_train":
        sets.append(f"data.path={data}")
        location = []
    else:
        location = ["--data-dir", str(data)]
    argv = ["train", entry.recipe, *location, "--out", str(out), "--device", "cpu",
            *sum((["--set", s] for s in sets), []), *(["--seed", str(seed)] if seed is not None else [])]
    return argv, ({"SPEEDRUN_COMPILE_BACKEND": entry.backend} if entry.backend else {})


def _both(recipe: str, data: str, sets: list[str], compiled_backend: str = "aot_eager", shorter: list[str] = (),
          bf16_data: str | None = None, **kw) -> list[Entry]:
    """The CPU default on CPUs without native bf16 (fp32, eager) and the CUDA default (bf16,
    compiled); ``shorter``: overrides of the compiled bf16 entry alone (a shorter run), whose
    emulated bf16 steps are the slow part of the matrix and which need only show that the
    compiled bf16 step runs and learns; ``bf16_data``: the data it learns that on, where not
    ``data`` (a set of the same kind: arrays or a folder)."""
    return [Entry(recipe, data, tuple(sets), **kw),
            Entry(recipe, bf16_data or data, tuple(sets) + tuple(shorter), "bf16", compiled_backend,
                  **{k: v for k, v in kw.items() if k != "subprocess"})]


def _shared(recipe: str, data: str, sets: list[str], compiled_by: str, **kw) -> list[Entry]:
    """fp32, eager only: a recipe whose compiled bf16 step is ``compiled_by``'s, whose entry on
    the same pipeline compiles every part of this recipe's step (the same model, optimizer,
    weight average and loss, and more: test_recipe_matrix.py checks it with
    :func:`step_features`); what differs (the data set, its classes, the schedule's values)
    changes no graph, so a second compile in emulated bf16 would check nothing new."""
    COMPILED_BY[recipe] = compiled_by
    return [Entry(recipe, data, tuple(sets), **kw)]


COMPILED_BY: dict[str, str] = {}
"""Recipe -> the recipe whose compiled bf16 matrix entry covers its step (see _shared)."""


def step_features(recipe) -> set[str]:
    """The parts of a loaded recipe's training step that decide its compiled graphs: the
    model's kind and structure, the optimizer and its filter updates, the weight average, the
    loss's terms, and how batches reach the step (streamed or resident, cached, resized)."""
    m, a, d = recipe.model, recipe.augment, recipe.data
    if m.name == "resnet":
        parts = [f"resnet{m.depth}", f"stem={m.stem}", f"variant={m.variant}", f"antialias={m.antialias}",
                 "preact" * m.preact, "zero_gamma" * m.zero_gamma]
    else:
        parts = ["speednet", f"activation={m.activation}", "residual" * bool(m.residual and any(m.residual)),
                 "whiten" * (m.whiten.kernel > 0), "stem" * (m.stem_width > 0), f"pool={m.global_pool_grad}"]
    parts += [f"optim={recipe.optim.name}", f"filters={recipe.optim.filters}", f"average={recipe.averaging.kind}",
              "smoothing" * (recipe.train.label_smoothing > 0), "mixing" * bool(a.mixup or a.cutmix),
              "prune" * (d.prune > 0), "distill" * (recipe.distill.teacher is not None),
              "streamed" if d.dataset in ("folder", "imagenette") else "resident", f"cache={d.cache}",
              f"low_res={a.low_res}" * (d.progressive is not None), "whole_epoch" * a.whole_epoch,
              f"cast={recipe.runtime.cast}", "finetune" * recipe.finetune.active]
    return {p for p in parts if p and not p.endswith("=none")}


def _fp32(recipe: str, data: str, sets: list[str], **kw) -> list[Entry]:
    """fp32, eager only: for a recipe's second pipeline, whose bf16 compiled run would repeat
    the first's model and step (what differs, the batches' source, does not depend on the
    precision) at the cost of emulated bf16 on CPUs without it."""
    return [Entry(recipe, data, tuple(sets), **kw)]


MATRIX: list[Entry] = [
    Entry("cifar10-94", "cifar_small", tuple(NPZ + SPEEDNET)),
    # the CUDA default of the main recipe: compiled by inductor, in a real process whose compiled
    # code a second process reuses (32 steps of 64, on Fashion-MNIST: see the bf16 margins above)
    Entry("cifar10-94", "fashion_small", tuple(NPZ + SPEEDNET + SPEEDNET_SHORTER), "bf16", "inductor",
          cache_reuse=True),
    *_shared("cifar10-94-fast", "cifar_small", NPZ + SPEEDNET, compiled_by="cifar10-94-cpu"),
    *_both("cifar10-94-cpu", "cifar_small", NPZ + SPEEDNET, shorter=SPEEDNET_SHORTER),   # cifar10-94-fast at 24, 28, 32 px
    # the GPU record candidate (the model stored in bf16 with batch norm in fp32, the global
    # max-pool's select backward, each epoch augmented whole), with fp32 master weights, SiLU and 24 then 32 px steps
    # shrunk inside the compiled step
    *_both("cifar10-94-gpu", "cifar_small", NPZ + SPEEDNET + [
        "model.activation=silu", "data.progressive=[[0.0, 0.75], [0.5, 1.0]]", "augment.low_res=bilinear_in_step",
        "runtime.master_weights=fp32"], shorter=SPEEDNET_NARROWER),
    *_both("page-resnet9", "cifar_small", NPZ + SPEEDNET + ["model.stem_width=16", "train.epochs=4",
                                                            "averaging.every=1", "averaging.decay=0.6"],
           shorter=SPEEDNET_NARROWER, bf16_data="fashion_small"),
    # (bf16: the fp32 entry's 2 epochs; 1 epoch on Fashion-MNIST fell 2 images under the bar with seed 7)
    *_both("dawnbench-resnet18", "cifar_small", NPZ + RESNET_CIFAR, bf16_data="fashion_small"),
    *_shared("fashion-mnist", "fashion_small", NPZ + SPEEDNET, compiled_by="cifar10-94"),
    *_both("folder", "jpeg32", FOLDER, shorter=["train.epochs=2"], bf16_data="fashion_jpeg"),
    *_fp32("folder", "npz32", NPZ + FOLDER),
    *_both("finetune", "jpeg32", FINETUNE, shorter=["train.epochs=2"], args=("init",)),
    *_both("imagenet-resnet50", "imagenet224", IMAGENET + ["checkpoint.every_steps=2"], subprocess=True,
           expect_files=("checkpoint.pt",)),
    *_fp32("imagenet-resnet50", "tiny_npz32", NPZ + IMAGENET),
    *_both("imagenet-resnet50-lars", "imagenet224", LARS),
    *_fp32("imagenet-resnet50-lars", "tiny_npz32", NPZ + LARS + LONGER),
    *_both("imagenet-resnet18-fast", "imagenet224", RESNET18_FAST),
    *_fp32("imagenet-resnet18-fast", "tiny_npz32", NPZ + RESNET18_FAST + LONGER),
    *_both("imagenette", "imagenet224", IMAGENETTE),
    *_fp32("imagenette", "imagenet224", IMAGENETTE + ["data.cache=off"]),      # streamed, evaluated at 40 px
    *_shared("imagenette-20", "imagenet224", IMAGENETTE, compiled_by="imagenette"),
    # (bf16: 4 epochs; with 3 it fell 1 image under the bar with seeds 2 and 6, both ways)
    *_both("tiny-imagenet", "tiny64", TINY, subprocess=True, shorter=["train.epochs=4"]),
    *_fp32("tiny-imagenet", "tiny_npz32", NPZ + TINY),
    # the two remaining corners of fp32/bf16 x eager/compiled
    Entry("cifar10-94", "fashion_small", tuple(NPZ + SPEEDNET + ["runtime.conv_weight_grad=auto"] + SPEEDNET_SHORTER),
          "bf16"),
    # 3x3 weight gradients always as matrix products (auto measures them in the entry above)
    Entry("fashion-mnist", "fashion_small", tuple(NPZ + SPEEDNET + SPEEDNET_NARROWER + ["runtime.conv_weight_grad=gemm"]),
          "bf16"),
    # (no entry for runtime.compile_mode or runtime.cuda_graphs: a CPU refuses max-autotune and
    # replays no CUDA graphs; the inductor options each pair gives are tested in
    # test_cuda_decisions.py; the lending's record recipe, cifar10-94-gpu, runs with them on a GPU)
    Entry("cifar10-94", "cifar_small", tuple(NPZ + SPEEDNET), "fp32", "aot_eager"),
]

# Runs that set the fields no shipped recipe sets away from their defaults.
FIELDS: list[Entry] = [
    # a single folder split by a seeded fraction, decoded by Pillow, unreadable files skipped; its
    # 102 test images set the bar at 18.9%, so it trains 12 epochs (on a 2-core Zen 3, seeds 0-3:
    # 22.5-28.4%, where 8 epochs reached 19.6-20.6%)
    Entry("folder", "jpeg32_train", tuple(FOLDER + ["train.epochs=12", "data.val_fraction=0.2", "data.split_seed=3",
                                                    "data.decoder=pillow", "data.skip_corrupt=true"])),
    # the built-in imagenette dataset found in place (a small copy in its layout), the 320 px archive
    # named; the folder recipe's photo choices with the user's model kept
    Entry("imagenette", "imagenette_tiny", tuple(IMAGENETTE + ["data.dataset=imagenette", "data.imagenette_size=320",
                                                               "data.cache=on"])),
    Entry("folder", "imagenet224", ("model={name='resnet', depth=18, stem='imagenet', variant='d', width=16, "
                                    "zero_gamma=true, antialias='all'}", "data.image_size=32", "data.eval_size=40", "train.epochs=4",
                                    "data.workers=1", "eval.batch_size=128", "data.batch_size=32", "optim.lr=4.0",
                                    "data.cache_dir={tmp}/cache", "data.cache_size=64",
                                    "augment.rrc_antialias=true")),
    # streamed translation with progressive resizing (16 px, then 32 px crops of the 32 px images),
    # cutout and the brightness shift and contrast scale
    Entry("folder", "jpeg32", tuple(FOLDER + ["data.progressive=[[0.0, 0.5], [0.5, 1.0]]", "augment.cutout=8",
                                              "augment.brightness=0.1", "augment.contrast=0.1"])),
    # speed-net and optimizer knobs, one-cycle with cycled momentum, accumulation, checkpoints,
    # low-resolution steps as windows of the translated images; each evaluation batch in calls of 64
    Entry("cifar10-94", "cifar_small", tuple(NPZ + SPEEDNET + [
        "model.activation=celu", "model.celu_alpha=0.5", "model.norm.fp32=false", "optim.whiten_bias_lr_mult=2.0",
        "optim.filters=orthogonal", "optim.filter_momentum=0.5", "optim.ns_steps=4", "optim.filter_norm_every=2",
        "optim.ns_precision=bf16",
        "optim.filter_weight_decay=0.01", "schedule={kind='onecycle', peak_at=0.4, start=0.1, end=0.01, "
        "momentum_low=0.8}", "train.accumulate=2", "train.seed=7", "eval.every=0", "eval.chunk=64", "runtime.channels_last=false",
        "checkpoint.every_steps=2", "model.whiten.padding=true", "model.whiten.negate=false",
        "averaging.every=3", "averaging.power=2.0", "data.progressive=[[0.0, 0.75], [0.5, 1.0]]",
        "augment.low_res=crop"]),
        expect_files=("checkpoint.pt",)),
    # ResNet with Xavier init, LAMB, a step schedule; CutMix with a mixing probability; ReLU speed net
    Entry("dawnbench-resnet18", "cifar_small", tuple(NPZ + RESNET_CIFAR + [
        "model.init=xavier", "optim.name=lamb", "optim.lr=0.02", "optim.betas=[0.8, 0.99]", "optim.eps=1e-7",
        "optim.adapt_bias_norm=true", "schedule={kind='step', warmup_epochs=0.1, warmup_start=0.2, "
        "milestones=[0.2], gamma=0.5}", "augment.cutmix=1.0", "augment.mix_prob=0.5", "augment.crop=random_resized",
        "augment.rrc_ratio=[0.5, 2.0]", "augment.flip=none"])),
    # LARS knobs and a cosine schedule with a warm-up start and floor; relu; the batch finder (at
    # LR 20, on a 2-core Zen 3, it stayed near chance under 3 of seeds 0-3 in 3 epochs, and under
    # seed 0 in 6; at LR 10 and 6 epochs, 34-46%)
    Entry("fashion-mnist", "fashion_small", tuple(NPZ + SPEEDNET + [
        "optim.name=lars", "optim.lr=10.0", "optim.trust_coefficient=0.002", "optim.lr_scaling=none",
        "schedule={kind='cosine', warmup_epochs=0.25, warmup_start=0.1, end=0.05}", "model.activation=relu",
        "runtime.find_batch=true", "runtime.hold_memory=off", "runtime.threads=1"])),
    # a polynomial schedule with a floor
    Entry("imagenet-resnet50-lars", "tiny_npz32", tuple(NPZ + LARS + LONGER + [
        "schedule={kind='poly', warmup_epochs=0.2, power=1.5, end=0.01}"])),
    # distillation from the cifar10-94 run above (the teacher fixture), with loss-based pruning of easy
    # images (the weighted cross entropy beside the distillation term)
    Entry("cifar10-94", "cifar_small", tuple(NPZ + SPEEDNET + ["distill.alpha=0.3", "distill.temperature=2.0",
                                                               "data.prune=0.5", "data.prune_full=0.25"]),
          args=("teacher",)),
    # AdamW with layer-wise LR decay (its bias corrections counted on the device), compiled in bf16;
    # seeds 0-7 on a 2-core AMD EPYC Zen 3 (25/1, bf16 emulated: it has no native bf16), 52-67%,
    # at least 94 test images above the bar (margins-bf16-adamw-entry-amd-epyc-25-1-442a61a.json;
    # natively computed bf16 not measured)
    Entry("fashion-mnist", "fashion_small", tuple(NPZ + SPEEDNET + SPEEDNET_SHORTER + ADAMW), "bf16", "aot_eager"),
]

# The runs whose compiled steps are counted (tests/test_step_structure.py, on the CPU): narrow
# nets; every optimizer kind, averaging kind and precision. Each row is (recipe, precision,
# overrides, as_on_cuda): as_on_cuda rows are built as on CUDA with CUDA graphs on (the GPU
# record recipe's way: speedrun.profiling.step_structure.as_on_cuda), where the graphs' inputs
# are also checked for what CUDA graph trees would be given (the records of the earlier
# cuda_graph_inputs.py); the others as a CPU runs them. Where a step is both counted and
# checked, one compile does both.
_NARROW = ["model.widths=[16,32,32]"]
# fp16 and bf16, emulated on CPUs without them (fp16 by a slow reference convolution everywhere), at
# half those widths: the graphs, their parameters and inputs do not depend on the widths
_NARROWER = ["model.widths=[8,16,16]"]
# They run on batches of 64 and 64 test images: the counts depend on neither (a half-precision
# convolution on a CPU without native bf16 and fp16 runs a slow reference kernel; small batches
# keep it short there).
STRUCTURE_BATCHES = ["data.batch_size=64", "eval.batch_size=64"]
_FP16 = [*_NARROWER, "data.batch_size=32"]      # (fp16, slow everywhere: batches of 32)
STEP_ROWS: list[tuple[str, str, list[str], bool]] = [
    ("cifar10-94", "fp32", _NARROW, False),
    ("cifar10-94", "fp16", _FP16, True),                         # loss scaling, skip on the device
    ("cifar10-94-fast", "bf16", _NARROWER, True),                # orthogonal filter updates
    ("dawnbench-resnet18", "bf16", ["model.width=8", "augment.cutmix=1.0",    # mixing, LAMB, one-cycle momentum
                                    "optim.name=lamb", "optim.lr=0.02"], True),
    ("fashion-mnist", "bf16", [*_NARROWER, "optim.name=lars", "schedule={kind='onecycle', peak_at=0.3, start=0.1, "
                               "end=0.01, momentum_low=0.8}", "averaging.kind=ema", "averaging.decay=0.9"], False),
]
# ... and the rows only checked for their graphs' inputs (warmed up as on CUDA, not counted). The
# update's inputs do not depend on the autocast precision (the bf16 and fp16 rows above check
# those graphs), so these run in fp32, whose warm-up steps are not emulated on CPUs without bf16.
CUDA_GRAPH_ROWS: list[tuple[str, str, list[str]]] = [
    ("cifar10-94", "fp32", _NARROW),
    ("cifar10-94-cpu", "fp32", _NARROW),                 # three sizes, pruning weights
    ("cifar10-94", "fp32", [*_NARROW, "optim.name=lars", "averaging.kind=ema", "averaging.decay=0.9"]),
]


def structure_slice(ds):
    """An array data set's first 1,024 training and 64 test images: what the structure checks
    of STEP_ROWS and CUDA_GRAPH_ROWS in tests/test_step_structure.py run on."""
    return replace(ds, train_x=ds.train_x[:1024], train_y=ds.train_y[:1024], test_x=ds.test_x[:64],
                   test_y=ds.test_y[:64])
