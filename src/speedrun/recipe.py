"""Recipes: a TOML file of named, validated fields that fully describe one training run.

A recipe is loaded from a shipped name (``cifar10-94``) or a path, overridden with
``--set key=value`` (dotted keys, TOML values), and validated by pydantic so that a bad
value or an unknown field ends in one message naming the field. Code that changes a recipe
passes Python values (:meth:`Recipe.with_values`), never ``--set`` text, which is the user's.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import RecipeError

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def refuse_unused(self, switch: str, off: Any, fields: tuple[str, ...], where: str, turn_on: str) -> None:
        """Refuse the ``fields`` set away from their defaults while ``switch`` is at ``off``,
        its default, where they do nothing: one message naming them and the switch they need
        (``where`` is this section's dotted path). A switch the recipe turns off itself keeps
        its trick's settings quietly: that is how an ablation turns one trick off."""
        if getattr(self, switch) != off or switch in self.model_fields_set:
            return
        unused = [f for f in fields if f in self.model_fields_set and getattr(self, f) != type(self).model_fields[f].default]
        if unused:
            named = ", ".join(f"{where}.{f} = {getattr(self, f)!r}" for f in unused)
            raise ValueError(f"{named} does nothing with {where}.{switch} = {off!r}: {turn_on}, or leave "
                             f"{'it' if len(unused) == 1 else 'them'} at the default")


# ------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------

class DataConfig(Section):
    dataset: Literal["cifar10", "cifar100", "fashion-mnist", "folder", "npz", "imagenette"]
    batch_size: int = Field(0, ge=0, description="training examples per optimizer step (over all devices)")
    per_device_batch: int = Field(0, ge=0, description="instead of batch_size: this many per device, times "
                                  "the number of devices")
    path: str | None = Field(None, description="the image folder or .npz file (folder and npz datasets; "
                             "--data-dir gives it too)")
    imagenette_size: Literal[160, 320] = Field(
        160, description="imagenette: which official archive, imagenette2-160.tgz or imagenette2-320.tgz "
        "(shorter side of the images in pixels)")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="folder without val/: fraction held out")
    split_seed: int = Field(0, ge=0, description="seed of the train/val split of a single folder, and of the "
                            "data.holdout split")
    holdout: float = Field(0.1, gt=0, le=0.5, description="with train.stop_at_target: the fraction of the training "
                           "images held out (per class, seeded by data.split_seed) as the validation split the "
                           "target is checked on; they are never trained on")
    image_size: int = Field(0, ge=0, description="folder: training crop size in pixels (decoded folders: the "
                            "random-resized crops' size); 0 = from the data")
    eval_size: int = Field(0, ge=0, description="folder: evaluation size in pixels (decoded once: at least "
                           "data.image_size); 0 = data.image_size")
    auto_choices: bool = Field(False, description="folder: choose the model, sizes and batch from the data "
                               "(photos or small images), said at start; the fields you --set are kept")
    cache: Literal["auto", "on", "off"] = Field(
        "auto", description="folder: decode once to a memory-mapped uint8 cache at data.eval_size and train "
        "from memory (random-resized crops cut on the device; evaluation on whole centre squares); auto = on "
        "for random-resized-crop recipes with data.eval_crop = 1 when the cache fits in half the memory")
    cache_size: int = Field(0, ge=0, description="folder, decoded once: the side of the cached training images "
                            "(shorter side resized, centre square), at least the evaluation and training sizes; "
                            "larger keeps random-resized crops sharp (cut from more pixels) for more memory; the "
                            "evaluation images are resized to data.eval_size as the cache is opened; 0 = the "
                            "evaluation size")
    cache_dir: str | None = Field(None, description="folder of decoded caches; default $SPEEDRUN_CACHE, else "
                                  "~/.cache/speedrun")
    eval_crop: float = Field(0.0, ge=0, le=1, description="streamed eval: centre crop fraction; 0 = 0.875, "
                             "or 1 for images of 64 px or less")
    workers: int = Field(-1, ge=-1, description="DataLoader worker processes; -1 = one per CPU core, at most 8")
    decoder: Literal["auto", "pillow", "simplejpeg", "torchvision"] = Field(
        "auto", description="image decoder: auto (simplejpeg for JPEGs when installed, else Pillow), pillow, "
        "simplejpeg, or torchvision (data prepare: JPEGs decoded in batches on the device, nvjpeg on a GPU; "
        "streamed training reads it as pillow)")
    skip_corrupt: bool = Field(False, description="skip unreadable images (and report how many) instead of stopping")
    progressive: list[tuple[float, float]] | None = Field(
        None, description="progressive resizing: [[fraction of training, scale of image_size], ...]")
    prune: float = Field(0.0, ge=0, lt=1, description="after a first pass over every image, each pass leaves "
                         "out this fraction of the images whose last training loss is below the mean (drawn "
                         "afresh each pass); the easy images kept count 1/(1 - prune) in the loss, so the "
                         "expected gradient stays the same (device-resident data, one process); 0 = off")
    prune_full: float = Field(0.125, ge=0, le=1, description="with data.prune: passes that start in this last "
                              "fraction of the steps take every image again, with weight 1")

    @model_validator(mode="after")
    def _check(self):
        if bool(self.batch_size) == bool(self.per_device_batch):
            raise ValueError("give exactly one of data.batch_size and data.per_device_batch")
        if self.progressive is not None:
            fracs = [f for f, _ in self.progressive]
            if not fracs or fracs[0] != 0 or any(b <= a for a, b in zip(fracs, fracs[1:])) or fracs[-1] >= 1:
                raise ValueError("data.progressive fractions must start at 0 and increase below 1")
            if self.progressive[-1][1] != 1 or any(not 0 < sc <= 1 for _, sc in self.progressive):
                raise ValueError("data.progressive scales must be in (0, 1] and end at 1 (full size)")
        return self


class AugmentConfig(Section):
    flip: Literal["none", "random", "alternating"] = "random"
    crop: Literal["translate", "random_resized"] = "translate"
    translate: int = Field(0, ge=0, le=16, description="random-crop shift in pixels (reflect padding)")
    low_res: Literal["resize", "crop", "bilinear_in_step"] = Field(
        "resize", description="how data.progressive makes its smaller training batches: resize (the whole "
        "image, antialiased bilinear, by the data pipeline: objects smaller than at test time), crop (a random "
        "window of that size from the translated image: objects at the test-time scale, part of each image) or "
        "bilinear_in_step (the whole augmented image, plain bilinear, inside the compiled training step, as the "
        "2026 CIFAR-10 record does); crop and bilinear_in_step need augment.crop = translate, crop also "
        "device-resident data")
    whole_epoch: bool = Field(False, description="device-resident data: augment the whole training set at the "
                              "start of each epoch (normalise, pad, crop, flip, resize: the same per-image draws, "
                              "so the same batches to the bit) and cut each batch from it with one gather; a few "
                              "kernels an epoch instead of a few a step, for a copy of the set in the compute dtype")
    rrc_scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    rrc_ratio: tuple[float, float] = Field((0.75, 4 / 3), description="random-resized-crop aspect range")
    rrc_antialias: bool = Field(False, description="random-resized crops cut on the device from images stored "
                                "about 1.5 times or more their size are area-filtered (a supersampled grid), as "
                                "an antialiased resize would be; streamed crops always are")
    cutout: int = Field(0, ge=0, description="side of the square cut out of each image; 0 = off")
    color_jitter: float = Field(0.0, ge=0, lt=1, description="brightness, contrast, saturation factors in 1 +- this")
    brightness: float = Field(0.0, ge=0, le=2, description="normalised pixels shifted by a per-image amount "
                              "uniform in +- this (units of the channel std); 0 = off")
    contrast: float = Field(0.0, ge=0, lt=1, description="normalised pixels scaled by a per-image factor uniform "
                            "in 1 +- this, about the data set's mean colour; 0 = off")
    lighting: float = Field(0.0, ge=0, description="std of AlexNet-style PCA lighting noise; 0 = off")
    mixup: float = Field(0.0, ge=0, description="mixup Beta(alpha, alpha); 0 = off")
    cutmix: float = Field(0.0, ge=0, description="CutMix Beta(alpha, alpha); 0 = off")
    mix_prob: float = Field(1.0, ge=0, le=1, description="probability that a batch is mixed")

    @model_validator(mode="after")
    def _check(self):
        lo, hi = self.rrc_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError("augment.rrc_scale must be 0 < low <= high <= 1")
        if not 0 < self.rrc_ratio[0] <= self.rrc_ratio[1]:
            raise ValueError("augment.rrc_ratio must be 0 < low <= high")
        if self.low_res != "resize" and self.crop != "translate":
            raise ValueError(f"augment.low_res = {self.low_res} shrinks translated images: it needs "
                             "augment.crop = translate (random-resized crops are cut at the smaller size directly)")
        return self


class WhitenConfig(Section):
    kernel: int = Field(0, ge=0, le=7, description="patch size of the frozen whitening layer; 0 = none")
    eps: float = Field(5e-4, gt=0, description="added to eigenvalues before the inverse square root")
    samples: int = Field(5000, gt=0, description="training images used to estimate the patch covariance")
    negate: bool = Field(True, description="also emit each filter's negation (doubles the width)")
    activation: bool = Field(True, description="apply the activation right after whitening")
    padding: bool = Field(False, description="'same' padding (True) or valid convolution (False)")
    train_bias_epochs: float = Field(0.0, ge=0, description="epochs the whitening bias is trained for")

    @model_validator(mode="after")
    def _used(self):
        self.refuse_unused("kernel", 0, ("eps", "samples", "negate", "activation", "padding", "train_bias_epochs"),
                           "model.whiten", "set model.whiten.kernel (2 or 3) for a whitening layer")
        return self


class NormConfig(Section):
    ghost_batch: int = Field(0, ge=0, description="sub-batch size for ghost batch norm; 0 = whole batch")
    scale: Literal["learned", "frozen"] = "learned"
    momentum: float = Field(0.1, gt=0, le=1, description="weight of each new batch in running stats")
    eps: float = Field(1e-5, gt=0)
    fp32: bool | Literal["auto"] = Field(
        "auto", description="compute batch norm in fp32 under reduced precision: true, false, or auto (fp32 on "
        "CUDA; on a CPU batch norm reads the bf16 activations as they are, its statistics still summed in fp32)")
    sync_ranks: int = Field(1, ge=0, description="processes whose batches one batch norm spans: 1 = each its own, "
                            "0 = all, k = groups of k consecutive ranks")

    @model_validator(mode="after")
    def _ghost_or_sync(self):
        if self.ghost_batch and self.sync_ranks != 1:
            raise ValueError("model.norm.ghost_batch (smaller batches for batch norm) and model.norm.sync_ranks "
                             "(larger ones, across processes) exclude each other; set one of them")
        return self


INIT_DESCRIPTION = (
    "how the weights start: {schemes}, or weights to start from (fine-tuning): a speedrun run folder or its "
    "model.pt, a .pt/.pth/.safetensors file of ResNet weights in torchvision's or timm's layout, "
    "torchvision:NAME.WEIGHTS (e.g. torchvision:resnet50.IMAGENET1K_V2, fetched and checked against its published "
    "hash), or timm:NAME of any of timm's architectures (e.g. timm:convnext_atto.d2_in1k; needs speedrun[timm]; "
    "timm:NAME=FILE for a local copy). "
    "With weights, the network is the one they were trained as: this section's other fields are taken from them")

SCHEMES = ("default", "kaiming", "xavier")
"""``model.init`` values that name an initialisation scheme rather than weights to load."""


def init_is_weights(init: str) -> bool:
    """Whether ``model.init`` names weights to start from (not a scheme)."""
    return init not in SCHEMES


def _plain_init(init: str) -> str:
    if not init.strip():
        raise ValueError("model.init is empty: give an initialisation scheme or weights to start from")
    return init


class SpeedNetConfig(Section):
    name: Literal["speednet"] = "speednet"
    widths: list[Annotated[int, Field(gt=0)]] = Field(min_length=1)
    convs: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="convolutions per block before any residual branch (default 2 each)")
    residual: list[bool] | None = Field(None, description="add a two-conv residual branch per block")
    stem_width: int = Field(0, ge=0, description="width of a 1x1 conv after whitening; 0 = none")
    activation: Literal["relu", "celu", "gelu", "silu"] = "gelu"
    celu_alpha: float = Field(0.3, gt=0)
    out_scale: float = Field(1.0, gt=0, description="multiplier on the logits")
    identity_init: bool = Field(False, description="Dirac-initialise the first in-channels of each conv")
    init: str = Field("default", description=INIT_DESCRIPTION.format(schemes="default (the speed net's own)"))
    global_pool_grad: Literal["scatter", "select"] = Field(
        "scatter", description="the global max-pool's backward: scatter (torch's adaptive max-pool, atomic adds "
                               "on a GPU) or select (an element-wise select at the stored argmax, no atomics)")
    whiten: WhitenConfig = WhitenConfig()
    norm: NormConfig = NormConfig()

    @model_validator(mode="after")
    def _lengths(self):
        _plain_init(self.init)
        if self.init in ("kaiming", "xavier"):
            raise ValueError(f"model.init = {self.init} is a ResNet's scheme; the speed net starts from its own "
                             "(default) or from weights")
        n = len(self.widths)
        for field in ("convs", "residual"):
            value = getattr(self, field)
            if value is not None and len(value) != n:
                raise ValueError(f"{field} has {len(value)} entries but widths has {n}")
        return self


class ResNetConfig(Section):
    name: Literal["resnet"] = "resnet"
    depth: Literal[18, 34, 50, 101] = 50
    stem: Literal["cifar", "imagenet"] = Field(
        "imagenet", description="cifar: one 3x3 conv, no down-sampling; imagenet: 7x7/2 conv and max-pool")
    variant: Literal["a", "b", "c", "d"] = Field(
        "a", description="He et al. 2019 tweaks, cumulative: b strided 3x3, c deep stem, d avg-pool shortcut")
    preact: bool = Field(False, description="pre-activation blocks (BN-ReLU before each conv; depth 18/34)")
    width: int = Field(64, ge=8, description="channels of the first stage (doubled per stage, multiples of 8)")
    zero_gamma: bool = Field(False, description="zero-initialise the last BN scale of each residual block "
                             "(needs preact = false and a learned BN scale)")
    antialias: Literal["none", "stem", "all"] = Field(
        "none", description="low-pass (binomial 3x3) before down-sampling, after Zhang (2019): stem = the stem's "
        "max-pool becomes a stride-1 max-pool then a blur with stride 2 (MaxBlurPool); all = also a blur "
        "before each strided convolution of the blocks (needs stem = imagenet)")
    init: str = Field("kaiming", description=INIT_DESCRIPTION.format(
        schemes="kaiming (He-normal convolutions) or xavier (Xavier-uniform)"))
    norm: NormConfig = NormConfig()

    @model_validator(mode="after")
    def _check(self):
        _plain_init(self.init)
        if self.antialias != "none" and self.stem != "imagenet":
            raise ValueError(f"model.antialias={self.antialias!r} blurs the down-sampling of the imagenet stem and "
                             "the stages after it; with stem = 'cifar' use antialias = 'none'")
        if self.preact and self.depth > 34:
            raise ValueError("model.preact is for basic-block ResNets (depth 18 or 34)")
        if self.preact and self.variant != "a":
            raise ValueError("model.variant tweaks apply to post-activation ResNets (preact = false)")
        return self


SPEEDRUN_NET_FIELDS = {
    "whiten": "the speed net's patch-whitening layer", "norm": "the batch-norm options of speedrun's own networks "
    "(ghost batches, a frozen scale, fp32, statistics across processes)", "global_pool_grad": "the speed net's "
    "global max-pool backward", "widths": "the speed net's widths", "convs": "the speed net's layers per block",
    "residual": "the speed net's residual branches", "stem_width": "the speed net's 1x1 stem",
    "activation": "the speed net's activation", "celu_alpha": "the speed net's CELU", "out_scale": "the speed "
    "net's logit multiplier", "identity_init": "the speed net's Dirac initialisation", "depth": "speedrun's ResNet "
    "depth", "stem": "speedrun's ResNet stem", "variant": "speedrun's ResNet tweaks", "preact": "speedrun's "
    "pre-activation ResNet", "width": "speedrun's ResNet width", "zero_gamma": "speedrun's ResNet zero-gamma "
    "initialisation", "antialias": "speedrun's ResNet anti-aliasing"}
"""Fields of the speed net and speedrun's ResNet, which another network does not have (named
when they are set for one)."""


class OtherNetwork(Section):
    """A network speedrun does not build itself (timm's, or a user's): what the engine asks of it
    is what any torch module answers."""

    @model_validator(mode="before")
    @classmethod
    def _no_speedrun_fields(cls, raw):
        if isinstance(raw, dict):
            kind = raw.get("name")
            for key in raw:
                if key in SPEEDRUN_NET_FIELDS:
                    what = SPEEDRUN_NET_FIELDS[key]
                    own = "model.args" if kind == "timm" else "model.args (passed to your factory)"
                    raise ValueError(f"model.{key} is {what}; model.name = {kind!r} builds another network, which has "
                                     f"no such option: remove model.{key} (options of the network itself go in {own})")
        return raw

    @property
    def norm(self) -> NormConfig:
        """What the engine assumes of this network's batch norms: torch's own, each process
        normalising its own batch, in the compute dtype (none of speedrun's options)."""
        return NormConfig(fp32=False)


class TimmConfig(OtherNetwork):
    name: Literal["timm"] = "timm"
    arch: str = Field(description="any model timm.create_model knows (timm.list_models()), e.g. convnext_atto, "
                      "resnet18, mobilenetv3_small_050, vit_tiny_patch16_224")
    drop_path_rate: float = Field(0.0, ge=0, lt=1, description="stochastic depth: the rate at the last block "
                                  "(timm's drop_path_rate); 0 = off")
    drop_rate: float = Field(0.0, ge=0, lt=1, description="dropout before the classifier (timm's drop_rate); 0 = off")
    img_size: int = Field(0, ge=0, description="the input side of networks built for one size (ViTs: their "
                          "position embedding); 0 = timm's default for the architecture")
    args: dict[str, Any] = Field(default_factory=dict, description="more keyword arguments for timm.create_model "
                                 "(e.g. {patch_size = 4} or {dynamic_img_size = true})")
    init: str = Field("default", description=INIT_DESCRIPTION.format(schemes="default (timm's own initialisation)"))

    @model_validator(mode="after")
    def _check(self):
        _plain_init(self.init)
        if self.init in ("kaiming", "xavier"):
            raise ValueError(f"model.init = {self.init} is speedrun's ResNet's scheme; a timm network starts from "
                             "timm's own initialisation (default) or from weights")
        if not self.arch.strip():
            raise ValueError("model.arch is empty: name one of timm's models (timm.list_models())")
        taken = {"num_classes", "in_chans", "pretrained", "drop_path_rate", "drop_rate", "img_size"} & set(self.args)
        if taken:
            key = sorted(taken)[0]
            where = f"model.{key}" if key in ("drop_path_rate", "drop_rate", "img_size") else "the data (classes and channels) and model.init"
            raise ValueError(f"model.args.{key} is set by {where}: leave it out of model.args")
        return self


class CustomConfig(OtherNetwork):
    name: Literal["custom"] = "custom"
    factory: str = Field(description="your network: 'package.module:function' or 'path/to/file.py:function', "
                         "called as function(in_channels, num_classes, **model.args) and returning a torch.nn.Module")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the factory")
    factory_sha256: str = Field("", description="the SHA-256 of the factory's source file, filled in when a run "
                                "starts (its config.toml and checkpoint keep it): resuming, predicting, evaluating "
                                "and exporting refuse a run whose factory file has changed since; empty = not checked")
    init: str = Field("default", description="default (the factory's own initialisation), or a speedrun run "
                      "folder of the same factory to start from")

    @model_validator(mode="after")
    def _check(self):
        _plain_init(self.init)
        if self.init in ("kaiming", "xavier"):
            raise ValueError(f"model.init = {self.init} is speedrun's ResNet's scheme; your network starts from its "
                             "factory's own initialisation (default) or from a run's weights")
        if ":" not in self.factory.strip(":") or self.factory.rsplit(":", 1)[1].strip() == "":
            raise ValueError(f"model.factory = {self.factory!r} names no function: give 'package.module:function' "
                             "or 'path/to/file.py:function'")
        if self.factory_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.factory_sha256):
            raise ValueError("model.factory_sha256 is not a SHA-256 (64 hex digits); leave it empty, a run fills it in")
        return self


ModelConfig = Annotated[Union[SpeedNetConfig, ResNetConfig, TimmConfig, CustomConfig], Field(discriminator="name")]


ADAM_EPS = {"lamb": 1e-6, "adamw": 1e-8}
"""``optim.eps`` where the recipe leaves it out, by optimizer: 1e-6 for LAMB (as the common
LAMB implementations) and torch.optim.AdamW's 1e-8 (timm's too)."""

OPTIM_FIELDS_READ_BY = {"betas": ("lamb", "adamw"), "eps": ("lamb", "adamw"), "trust_coefficient": ("lars",),
                        "adapt_bias_norm": ("lars", "lamb")}
"""The optimizer-specific fields of [optim] and the optimizers (``optim.name``) that read them;
set away from its default for another optimizer, a field is refused (it would do nothing)."""


class OptimConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _defaults_by_optimizer(cls, raw):
        """The two fields whose default depends on ``optim.name``, filled in where the recipe
        leaves them out, so that the resolved recipe (config.toml) states them: AdamW excludes
        biases and norm parameters from decay by default (timm's and the AdamW fine-tuning
        recipes' practice), the others decay everything unless told; ``eps`` is each Adam
        optimizer's usual value (:data:`ADAM_EPS`)."""
        if isinstance(raw, dict):
            name = raw.get("name", "sgd")
            raw = dict(raw)
            if raw.get("no_decay_bias_norm") is None:
                raw["no_decay_bias_norm"] = name == "adamw"
            if raw.get("eps") is None:
                raw["eps"] = ADAM_EPS["adamw"] if name == "adamw" else ADAM_EPS["lamb"]
        return raw

    name: Literal["sgd", "lars", "lamb", "adamw"] = "sgd"
    lr: float = Field(gt=0, description="step size per ref_batch examples (momentum-normalised for sgd/lars; "
                      "lamb/adamw: the per-step LR at batch ref_batch)")
    ref_batch: int = Field(gt=0, description="batch size that lr and weight_decay are stated for")
    lr_scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear", description="how lr and weight_decay follow batch_size / ref_batch")
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(0.0, ge=0, description="sgd: decoupled decay per ref_batch examples at peak; "
                                "lars/lamb: the coefficient of their published update; adamw: torch.optim.AdamW's "
                                "coefficient (each step removes lr * weight_decay of each weight)")
    no_decay_bias_norm: bool = Field(False, description="exclude biases and norm parameters (every parameter but "
                                     "the multi-dimensional weights) from decay; default true for adamw, false "
                                     "for the others")
    norm_bias_lr_mult: float = Field(1.0, ge=0, description="LR multiplier for batch-norm biases")
    whiten_bias_lr_mult: float = Field(1.0, ge=0, description="LR multiplier for the whitening bias")
    layer_decay: float = Field(1.0, gt=0, le=1, description="layer-wise LR decay: each parameter's LR times "
                               "layer_decay ** (depth - block), its block counted from the input (0) to the "
                               "classifier (depth), as timm's --layer-decay; 1 = off")
    trust_coefficient: float = Field(0.001, gt=0, description="LARS: eta in the layer-wise trust ratio")
    betas: tuple[float, float] = Field((0.9, 0.999), description="LAMB/AdamW: Adam moment decays")
    eps: float = Field(1e-6, gt=0, description="LAMB/AdamW: added to the second-moment root; default 1e-6 for "
                       "lamb, 1e-8 for adamw")
    adapt_bias_norm: bool = Field(False, description="LARS/LAMB: also scale biases and norms by trust ratio")
    filters: Literal["same", "orthogonal"] = Field(
        "same", description="conv filters: the optimizer above, or orthogonalised momentum updates (Muon)")
    filter_lr: float = Field(0.2, gt=0, description="orthogonal filters: per-step LR at schedule multiplier 1")
    filter_momentum: float = Field(0.6, ge=0, lt=1, description="orthogonal filters: Nesterov momentum")
    ns_steps: int = Field(3, ge=1, le=10, description="orthogonal filters: Newton-Schulz iterations")
    ns_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="orthogonal filters: dtype of the Newton-Schulz products; auto = bf16 on CUDA and "
        "where the run computes in bf16, else fp32")
    filter_norm_every: int = Field(1, ge=0, description="orthogonal filters: reset filter norms every N steps; 0 = never")
    filter_weight_decay: float = Field(0.0, ge=0, description="orthogonal filters: decoupled decay per ref_batch "
                                       "examples at peak, as optim.weight_decay; needs filter_norm_every != 1")

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas):
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each of the two decays must be at least 0 and below 1 (e.g. [0.9, 0.999])")
        return betas

    @model_validator(mode="after")
    def _read_by_the_optimizer(self):
        for f, readers in OPTIM_FIELDS_READ_BY.items():
            value = getattr(self, f)
            if self.name not in readers and value != type(self).model_fields[f].default:
                shown = list(value) if isinstance(value, tuple) else value
                raise ValueError(f"optim.{f} = {shown!r} does nothing with optim.name = {self.name!r} (only "
                                 f"{' and '.join(readers)} read it): leave it at the default, or choose "
                                 f"{'that optimizer' if len(readers) == 1 else 'one of those optimizers'}")
        return self

    @model_validator(mode="after")
    def _filter_decay(self):
        self.refuse_unused("filters", "same", ("filter_lr", "filter_momentum", "ns_steps", "ns_precision",
                                               "filter_norm_every", "filter_weight_decay"),
                           "optim", "set optim.filters = orthogonal for orthogonalised filter updates")
        if self.filter_weight_decay and self.filters == "orthogonal" and self.filter_norm_every == 1:
            raise ValueError("optim.filter_weight_decay has no effect with optim.filter_norm_every = 1: the "
                             "filters' norms are reset every step, which undoes the decay; set it to 0, or "
                             "reset the norms less often")
        return self


class PiecewiseSchedule(Section):
    kind: Literal["piecewise"] = "piecewise"
    knots: list[float] = Field(min_length=2, description="fractions of training, 0 to 1, increasing")
    values: list[float] = Field(min_length=2, description="LR multiplier at each knot")

    @model_validator(mode="after")
    def _check(self):
        if len(self.knots) != len(self.values):
            raise ValueError(f"knots has {len(self.knots)} entries but values has {len(self.values)}")
        if self.knots[0] != 0 or self.knots[-1] != 1:
            raise ValueError("knots must start at 0 and end at 1")
        if any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError("knots must be strictly increasing")
        if any(v < 0 for v in self.values):
            raise ValueError("values must be >= 0")
        return self


class OneCycleSchedule(Section):
    kind: Literal["onecycle"] = "onecycle"
    peak_at: float = Field(0.3, gt=0, lt=1, description="fraction of training at which LR peaks")
    start: float = Field(0.04, ge=0, description="LR multiplier at the start")
    end: float = Field(0.0, ge=0, description="LR multiplier at the end")
    momentum_low: float | None = Field(
        None, ge=0, lt=1, description="momentum at the LR peak (cycled inversely to the LR); None = fixed")


class CosineSchedule(Section):
    kind: Literal["cosine"] = "cosine"
    warmup_epochs: float = Field(0.0, ge=0, description="linear warm-up from warmup_start to 1")
    warmup_start: float = Field(0.0, ge=0)
    end: float = Field(0.0, ge=0, description="LR multiplier at the end of the cosine")


class StepSchedule(Section):
    kind: Literal["step"] = "step"
    warmup_epochs: float = Field(0.0, ge=0)
    warmup_start: float = Field(0.0, ge=0)
    milestones: list[float] = Field(description="epochs at which the LR is multiplied by gamma")
    gamma: float = Field(0.1, gt=0)


class PolySchedule(Section):
    kind: Literal["poly"] = "poly"
    warmup_epochs: float = Field(0.0, ge=0)
    warmup_start: float = Field(0.0, ge=0)
    power: float = Field(2.0, gt=0, description="polynomial decay (1 - progress)**power after warm-up")
    end: float = Field(0.0, ge=0)


ScheduleConfig = Annotated[Union[PiecewiseSchedule, OneCycleSchedule, CosineSchedule, StepSchedule, PolySchedule],
                           Field(discriminator="kind")]


class AveragingConfig(Section):
    kind: Literal["none", "ema", "lookahead"] = "none"
    every: int = Field(5, ge=1, description="optimizer steps between updates")
    decay: float = Field(0.95, ge=0, lt=1, description="EMA decay per update, or lookahead's final decay")
    power: float = Field(3.0, ge=0, description="lookahead decay ramps as decay * (step/total)**power")

    @model_validator(mode="after")
    def _used(self):
        self.refuse_unused("kind", "none", ("every", "decay", "power"), "averaging",
                           "set averaging.kind (ema or lookahead)")
        if self.kind == "ema" and self.power != type(self).model_fields["power"].default:
            raise ValueError(f"averaging.power = {self.power} does nothing with averaging.kind = ema (it ramps "
                             "lookahead's decay; an EMA's is constant): set averaging.kind = lookahead, or leave "
                             "averaging.power at the default")
        return self


class TrainConfig(Section):
    epochs: float = Field(gt=0, le=10_000)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    seed: int = Field(0, ge=0)
    accumulate: int = Field(1, ge=1, description="split each batch into this many micro-batches")
    stop_at_target: bool = Field(False, description="stop once `target` is reached on a validation split held out "
                                 "of the training images (data.holdout; never the test set), checked after each "
                                 "train.stop_check_every epochs with the averaged weights and no TTA; the check's "
                                 "time counts in the run's; the final evaluation on the test set follows as usual")
    stop_check_every: int = Field(1, ge=1, description="with train.stop_at_target: epochs between checks")

    @model_validator(mode="after")
    def _used(self):
        self.refuse_unused("stop_at_target", False, ("stop_check_every",), "train",
                           "set train.stop_at_target = true to stop at the target")
        return self


class FinetuneConfig(Section):
    head_epochs: float = Field(0.0, ge=0, description="epochs at the start in which only the classifier (and, "
                               "with finetune.train_norm, the batch norms) trains, the rest of the network held at "
                               "LR 0 by a mask in the step (the same program on one process and under DDP); 0 = off")
    lr_first: float = Field(1.0, gt=0, le=1, description="discriminative learning rates: the LR multiplier of the "
                            "network's first block, growing geometrically block by block to 1 at the classifier "
                            "(0.01 spans fastai's slice(lr/100, lr); timm's layer decay d over n blocks is d**n); "
                            "1 = one LR for the whole network")
    train_norm: bool = Field(True, description="batch-norm scales and shifts of the held network train during "
                             "finetune.head_epochs (their running statistics always follow the new data)")

    @property
    def active(self) -> bool:
        return self.head_epochs > 0 or self.lr_first < 1


class DistillConfig(Section):
    teacher: str | None = Field(None, description="a teacher's model.pt (its run folder holds config.toml)")
    alpha: float = Field(0.5, ge=0, le=1, description="weight of the distillation term")
    temperature: float = Field(4.0, gt=0, description="softmax temperature of both teacher and student")


class CheckpointConfig(Section):
    every_steps: int = Field(0, ge=0, description="write a checkpoint every this many steps; 0 = off")
    every_epochs: float = Field(0.0, ge=0, description="write a checkpoint every this many epochs; 0 = off")


class EvalConfig(Section):
    tta: Literal["none", "flip", "flip_translate"] = "none"
    tta_fraction: float = Field(1.0, gt=0, le=1, description="apply TTA only to this fraction of each batch: "
                                "the images the plain view is least confident about")
    every: int = Field(1, ge=0, description="epochs between monitoring evaluations; 0 = final only")
    batch_size: int = Field(1000, gt=0)
    chunk: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description="images per model call within an evaluation batch; a stop signal (SIGTERM, Ctrl-C) "
        "is checked between calls: auto = on a CPU, as many as make 10 GFLOP of forward passes (a few seconds "
        "on one core of a slow CPU); on a GPU, the whole batch")

    @model_validator(mode="after")
    def _used(self):
        self.refuse_unused("tta", "none", ("tta_fraction",), "eval", "set eval.tta (flip or flip_translate)")
        return self


class DistributedConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend: auto = "
                                                     "nccl on CUDA, gloo on CPUs")
    bucket_mb: float = Field(25.0, gt=0, description="DistributedDataParallel gradient bucket (all-reduce message) "
                             "size in MiB")
    compression: Literal["none", "bf16", "fp16"] = Field(
        "none", description="all-reduce gradients in this precision (a DDP communication hook)")
    timeout_s: float = Field(600.0, gt=0, description="seconds a collective waits for the other processes before "
                             "the job stops with an error")


OLD_COMPILE_MODES = {"reduce-overhead": ("default", "on"), "max-autotune-no-cudagraphs": ("max-autotune", "off")}
"""torch.compile mode names that were values of ``runtime.compile_mode`` before CUDA graphs became a field
of their own -> (compile_mode, cuda_graphs)."""


class RuntimeConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _old_compile_modes(cls, raw):
        """The one-field spellings of earlier versions (``reduce-overhead``,
        ``max-autotune-no-cudagraphs``) read as the two fields they meant."""
        if isinstance(raw, dict) and raw.get("compile_mode") in OLD_COMPILE_MODES:
            old = raw["compile_mode"]
            mode, graphs = OLD_COMPILE_MODES[old]
            if raw.get("cuda_graphs", graphs) != graphs:
                raise ValueError(f"runtime.compile_mode={old!r} means runtime.compile_mode={mode!r} with "
                                 f"runtime.cuda_graphs={graphs!r}, not {raw['cuda_graphs']!r}: set the two fields")
            raw = {**raw, "compile_mode": mode, "cuda_graphs": graphs}
        return raw

    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    compile_mode: Literal["default", "max-autotune"] = Field(
        "default", description="torch.compile's kernel search: default (inductor's generated kernels) or "
        "max-autotune (Triton templates timed against cuDNN and cuBLAS for each convolution and matrix shape, with "
        "coordinate-descent tuning: minutes more compiling; CUDA only)")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="replay the compiled step and evaluation as CUDA graphs (one launch per graph instead of "
        "one per kernel: what a small net on a fast GPU needs); auto = on with max-autotune, as torch's own mode "
        "does, off with default; CUDA only")
    cast: Literal["autocast", "model"] = Field(
        "autocast", description="how bf16/fp16 is applied: autocast (fp32 weights, each op cast as it runs) or model "
        "(the weights, optimizer state and activations stored in the compute dtype end to end, batch norm and its "
        "statistics in fp32, no per-step casts; what the CIFAR-10 records do)")
    master_weights: Literal["none", "fp32"] = Field(
        "none", description="with runtime.cast = model: none (the optimizer updates the stored bf16/fp16 weights, "
        "where an update below half a bf16 step, 0.2% to 0.4% of the weight, is rounded away) or fp32 (the optimizer and the weight "
        "averaging update fp32 copies of the weights, with fp32 state, from the step's low-precision gradients, and "
        "the model gets the copies rounded after each step)")
    channels_last: bool = Field(True, description="NHWC memory layout for images and conv weights")
    find_batch: bool = Field(False, description="halve data.batch_size on out-of-memory until it fits")
    threads: Literal["auto"] | Annotated[int, Field(ge=1, le=1024)] = Field(
        "auto", description="CPU threads of torch's operators: auto = $OMP_NUM_THREADS where it is set, else one "
        "per usable core that other work leaves idle at the start of the run (a thread sharing its core with a "
        "busy process stalls every operator); N = exactly N")
    hold_memory: Literal["auto", "on", "off"] = Field(
        "auto", description="keep freed memory in the process (glibc: large blocks from the heap, no trimming) so "
        "that each step reuses its pages instead of faulting fresh ones in; auto = on for CPU devices under glibc")
    conv_weight_grad: Literal["auto", "torch", "gemm"] = Field(
        "torch", description="weight gradients of 3x3 convolutions in eager bf16 steps on a CPU: torch's kernel, nine "
        "matrix products (gemm), or auto = each shape timed both ways in its first step and the products kept "
        "where they are clearly faster (opt-in: a resumed or repeated run may time a shape differently); "
        "elsewhere always torch's")

    @model_validator(mode="after")
    def _used(self):
        if self.master_weights != "none" and self.cast != "model":
            raise ValueError(f"runtime.master_weights = {self.master_weights} does nothing with runtime.cast = "
                             f"{self.cast} (autocast keeps the weights in fp32 already): set runtime.cast = model, or "
                             "leave runtime.master_weights at the default")
        return self


class Recipe(Section):
    _overrides: list[str] = PrivateAttr(default_factory=list)   # the --set values it was loaded with
    name: str = Field(description="names the run folder (runs/NAME-TIME): letters, digits, '.', '_', '+', '-'")
    description: str = ""
    target: float = Field(0.9, gt=0, le=1, description="test accuracy the recipe aims for")
    data: DataConfig
    augment: AugmentConfig = AugmentConfig()
    model: ModelConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    averaging: AveragingConfig = AveragingConfig()
    train: TrainConfig
    finetune: FinetuneConfig = FinetuneConfig()
    distill: DistillConfig = DistillConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    distributed: DistributedConfig = DistributedConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError("a recipe name names its run folders, so it may hold only letters, digits, "
                             "'.', '_', '+' and '-' (no '/', no '..', at most 100 characters)")
        return name

    @model_validator(mode="after")
    def _cross_checks(self):
        a = self.augment
        streamed = self.data.dataset in ("folder", "imagenette")      # decoded in workers, not resident
        if self.data.prune and streamed:
            raise ValueError(f"data.prune={self.data.prune} keeps a loss per image of device-resident data "
                             "(cifar10, cifar100, fashion-mnist, npz); image folders are streamed: set data.prune=0")
        if a.whole_epoch and streamed:
            raise ValueError("augment.whole_epoch augments device-resident data (cifar10, cifar100, fashion-mnist, "
                             "npz) a whole epoch at a time; image folders are streamed: set augment.whole_epoch=false")
        if a.whole_epoch and self.data.prune:
            raise ValueError(f"augment.whole_epoch augments every image each epoch; data.prune={self.data.prune} "
                             "draws its batches from the images it keeps: set one of them off")
        if a.low_res != "resize" and self.data.progressive is None:
            raise ValueError(f"augment.low_res = {a.low_res} makes the smaller steps of data.progressive, which this "
                             "recipe has none of, so it does nothing: set data.progressive (e.g. [[0.0, 0.75], "
                             "[0.5, 1.0]]), or leave augment.low_res at the default")
        if a.low_res == "crop" and streamed:
            raise ValueError("augment.low_res = crop cuts windows from device-resident images (cifar10, "
                             "cifar100, fashion-mnist, npz); image folders are streamed: set augment.low_res = resize")
        if self.data.prune and (a.mixup or a.cutmix):
            raise ValueError(f"data.prune={self.data.prune} weighs each image's own loss, which mixed images "
                             "(augment.mixup, augment.cutmix) do not have: turn one of them off")
        o, ft = self.optim, self.finetune
        if self.model.name in ("timm", "custom") and o.whiten_bias_lr_mult != OptimConfig.model_fields[
                "whiten_bias_lr_mult"].default:
            raise ValueError(f"optim.whiten_bias_lr_mult = {o.whiten_bias_lr_mult!r} is the LR multiplier of the speed "
                             f"net's whitening bias; model.name = {self.model.name!r} has no whitening layer: leave it "
                             "at the default")
        if o.layer_decay < 1 and ft.lr_first < 1:
            raise ValueError(f"optim.layer_decay = {o.layer_decay} and finetune.lr_first = {ft.lr_first} set the same "
                             "thing, one LR per block growing geometrically to the classifier's (lr_first is "
                             "layer_decay ** blocks): set one of them and leave the other at 1")
        d, t = self.data, self.train
        if ("holdout" in d.model_fields_set and d.holdout != DataConfig.model_fields["holdout"].default
                and not t.stop_at_target and "stop_at_target" not in t.model_fields_set):
            raise ValueError(f"data.holdout = {d.holdout!r} does nothing with train.stop_at_target = False: set "
                             "train.stop_at_target = true to hold out a validation split, or leave data.holdout "
                             "at the default")
        if not self.data.batch_size:            # per_device_batch: checked once the device count is known
            return self
        gb = self.model.norm.ghost_batch
        micro = self.data.batch_size // self.train.accumulate
        if gb and (self.data.batch_size % self.train.accumulate or micro % gb):
            raise ValueError(f"model.norm.ghost_batch={gb} must divide the micro-batch "
                             f"(data.batch_size={self.data.batch_size} / train.accumulate={self.train.accumulate})")
        if self.train.accumulate > self.data.batch_size:
            raise ValueError("train.accumulate must not exceed data.batch_size")
        return self

    def __eq__(self, other) -> bool:
        """Recipes are equal when their fields are (not the --set values they were loaded with)."""
        return isinstance(other, Recipe) and self.model_dump() == other.model_dump()

    def with_values(self, values: Mapping[str, Any], source: str | None = None) -> Recipe:
        """A new recipe with the fields named by dotted keys set to these Python values
        (``{"data.batch_size": 512, "data.path": "/x"}``), validated as a loaded recipe is:
        a bad value or an unknown field ends in a RecipeError naming it (``source``, default
        the recipe's name, begins the message). This recipe is left as it is; the --set
        values it was loaded with go with the new one (the data applies them again over
        what it chooses)."""
        source = source or self.name
        changed = recipe_from_dict(set_values(self.to_dict(), values, source), source=source)
        changed._overrides = list(self._overrides)
        return changed

    # -- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def digest(self) -> str:
        """A short hash of the resolved recipe, to tell runs of different recipes apart."""
        return hashlib.sha256(self.to_toml().encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------
# Loading, overrides and error messages
# ------------------------------------------------------------------------------------------

def shipped_recipes() -> dict[str, Path]:
    """Name -> path of every recipe shipped in the package."""
    folder = resources.files("speedrun") / "recipes"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml")}


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=0.5' -> (['optim', 'lr'], 0.5). Values are TOML; bare words are strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set expects key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def set_value(raw: dict, key: str, value: Any, where: str) -> None:
    """Set the field of ``raw`` (a recipe as nested dicts) named by the dotted ``key``, making
    the sections on the way; ``where`` begins the message when a part of the key is a value."""
    *sections, field = key.split(".")
    node = raw
    for part in sections:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{where}: '{part}' is a value, not a section")
        node = child
    node[field] = value


def set_values(raw: dict, values: Mapping[str, Any], source: str = "recipe") -> dict:
    """``raw`` with each dotted key of ``values`` set to its Python value (unvalidated)."""
    for key, value in values.items():
        set_value(raw, key, value, f"{source}: {key}")
    return raw


def new_network(raw: dict, overrides: list[str]) -> str | None:
    """The ``model.name`` the ``--set`` texts give ``raw`` where it is another kind of network
    than the recipe's, else None."""
    names = [value for path, value in map(parse_override, overrides) if path == ["model", "name"]]
    model = raw.get("model")
    have = model.get("name") if isinstance(model, dict) else None
    return names[-1] if names and names[-1] != have else None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` with the user's ``--set key=value`` texts applied in order (unvalidated). A
    ``model.name`` of another kind of network starts the [model] section afresh: the recipe's
    fields of its own network do not carry over to the new one."""
    if new_network(raw, overrides) is not None:
        raw["model"] = {}
    for text in overrides:
        path, value = parse_override(text)
        set_value(raw, ".".join(path), value, f"--set {text}")
    return raw


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    shipped = shipped_recipes()
    path = Path(name_or_path)
    if name_or_path in shipped:
        path = shipped[name_or_path]
    elif path.is_dir():
        raise RecipeError(f"{path}: is a folder; give a recipe name or a .toml file "
                          "(to continue a run in a folder: speedrun train --resume FOLDER)")
    elif not path.is_file():
        hint = difflib.get_close_matches(name_or_path, shipped, n=1)
        raise RecipeError(
            f"no recipe named {name_or_path!r} and no such file"
            + (f"; did you mean {hint[0]!r}?" if hint else ".")
            + f" Shipped recipes: {', '.join(sorted(shipped))}.")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte {err.start}); a recipe is a TOML text file") from None
    except OSError as err:
        raise RecipeError(f"{path}: cannot read the recipe ({err.strerror})") from None
    overrides = list(overrides or [])
    held = held_for_data(raw, overrides)
    applied = [o for o in overrides if o not in held]
    recipe = recipe_from_dict(apply_overrides(raw, applied), source=str(path), overrides=applied)
    recipe._overrides = overrides
    return recipe


CHOSEN_BY_DATA = ("model", "schedule")
"""Sections whose kind a recipe with ``data.auto_choices`` leaves to the data (the folder
recipe: its speed net for small images, a ResNet for photos)."""


def held_for_data(raw: dict, overrides: list[str]) -> list[str]:
    """The --set values that ``raw`` (a recipe whose folder data chooses the model) can check
    only once the data has chosen: those under :data:`CHOSEN_BY_DATA`. The data layer applies
    them, once, to the model the run will use; every other value is checked at once."""
    data = apply_overrides(copy.deepcopy(raw), overrides).get("data")
    if not (isinstance(data, dict) and data.get("auto_choices") is True
            and data.get("dataset") in ("folder", "imagenette")):
        return []
    # (model.init is checked at once: weights to start from decide the model the data gets)
    return [o for o in overrides if parse_override(o)[0][0] in CHOSEN_BY_DATA and parse_override(o)[0] != ["model", "init"]]


def recipe_from_dict(raw: dict, source: str = "recipe", overrides: Sequence[str] = (),
                     over_source: bool = False) -> Recipe:
    """``raw`` validated as a recipe; a RecipeError naming each bad field otherwise. An error in a
    value one of ``overrides`` (the ``--set`` texts applied to ``raw``) gave is blamed on that
    ``--set``, any other on ``source`` (the recipe file, or what made ``raw``); with
    ``over_source`` the blamed ``--set`` is said to be applied over ``source``, where that tells
    more (what the data chose)."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise RecipeError(describe_errors(err, source, overrides, over_source)) from None


def _section_model(raw_loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at ``raw_loc`` (for 'did you mean' hints).

    ``raw_loc`` is pydantic's location, where a discriminated union adds its tag
    ('speednet', 'piecewise', ...) after the field name; the tag picks the member.
    """
    model: type[BaseModel] = Recipe
    parts = list(raw_loc[:-1])
    while parts:
        field = model.model_fields.get(parts.pop(0))
        if field is None:
            return None
        options = getattr(field.annotation, "__args__", (field.annotation,))
        nested = [o for o in options if isinstance(o, type) and issubclass(o, BaseModel)]
        if not nested:
            return None
        if len(nested) > 1 and parts and parts[0] in _TAGS:
            tag = parts.pop(0)
            nested = [o for o in nested if tag in (o.model_fields.get("name") or o.model_fields.get("kind")).annotation.__args__]
        model = nested[0]
    return model


def _given_by(loc: tuple, message: str, overrides: Sequence[str]) -> list[str]:
    """The ``--set`` texts that gave the value an error at ``loc`` is about: one that set the
    field itself or a section holding it, or, for a check over a section (or the whole recipe),
    one that set a field of it which the message names. A ``--set`` a later one replaced gave
    nothing."""
    at = tuple(str(p) for p in loc)
    given, later = [], []
    for text in reversed(overrides):
        key = tuple(text.partition("=")[0].strip().split("."))
        if any(key[:len(k)] == k for k in later):          # replaced by a later --set
            continue
        later.append(key)
        if at[:len(key)] == key or (key[:len(at)] == at and _names(message, key, len(at))):
            given.append(text)
    return given[::-1]


def _names(message: str, key: tuple, depth: int) -> bool:
    """Whether ``message`` names the field ``key``, in full or below the section ``key[:depth]``."""
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)
               for name in {".".join(key), ".".join(key[depth:])} if name)


def describe_errors(err: ValidationError, source: str, overrides: Sequence[str] = (),
                    over_source: bool = False) -> str:
    """One line for the errors of ``err``, each blamed on the ``--set`` that gave its value
    (see :func:`recipe_from_dict`) or on ``source``."""
    lines: dict[str, list[str]] = {}
    for e in err.errors():
        # discriminated unions insert the tag ('speednet', 'piecewise') into the location
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in _TAGS))
        field = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            owner = _section_model(tuple(e["loc"]))
            known = sorted(owner.model_fields) if owner else []
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = f"unknown recipe field '{field}'"
            msg += f"; did you mean '{'.'.join(map(str, loc[:-1] + (hint[0],)))}'?" if hint else ""
            if known:
                msg += f" (fields here: {', '.join(known)})"
        elif e["type"] == "missing":
            msg = f"recipe field '{field}' is required but missing"
        elif e["type"] == "value_error" and not loc:       # a check across sections names its fields itself
            msg = e["msg"].removeprefix("Value error, ")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = f"bad recipe value for '{field}'{shown}: {e['msg'].removeprefix('Value error, ')}"
        given = " ".join(f"--set {text}" for text in _given_by(loc, msg, overrides))
        where = (f"{given} over {source}" if over_source else given) if given else source
        lines.setdefault(where, []).append(msg)
    return "; ".join(f"{where}: " + "; ".join(msgs) for where, msgs in lines.items())


_TAGS = {"speednet", "resnet", "timm", "custom", "piecewise", "onecycle", "cosine", "step", "poly"}


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    """Training drops the last partial batch (batch-norm statistics need full batches)."""
    if n_train < batch_size:
        raise RecipeError(
            f"data.batch_size={batch_size} is larger than the training set ({n_train} images)")
    return n_train // batch_size


def total_steps(recipe: Recipe, n_train: int) -> int:
    return max(1, math.ceil(recipe.train.epochs * steps_per_epoch(n_train, recipe.data.batch_size)))
