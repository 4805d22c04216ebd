"""Parameter groups and the optimizer (SGD, LARS, LAMB or AdamW), with hyperparameters whose
meaning does not change with the batch size or the momentum.

- ``optim.lr`` is the step size for a batch of ``optim.ref_batch`` examples, scaled to the
  actual batch by ``optim.lr_scaling``: ``scale`` = batch_size / ref_batch (linear, Goyal et al.
  2017), its square root (sqrt), or 1 (none). For SGD and LARS it is momentum-normalised: the
  per-step LR is ``lr * (1 - momentum) * scale`` (with momentum m the long-run step is lr/(1-m)
  times the per-step rate). For LAMB and AdamW, whose Adam moments are averages, it is
  ``lr * scale``: Adam's own per-step LR at batch ref_batch.
- ``optim.weight_decay`` for SGD is decoupled from the LR (Loshchilov & Hutter, 2019): the
  fraction of each weight removed per ref_batch examples at the schedule's peak, in the same
  momentum-normalised units and scaled like the LR. Changing ``lr`` or a group's LR multiplier
  leaves it unchanged; it follows the LR schedule's shape.
- For LARS and LAMB, ``optim.weight_decay`` is the published formula's coefficient (see
  ``layerwise.py``): the decay applied per step is proportional to the LR and the trust ratio.
  Only "weight" tensors are trust-scaled unless ``optim.adapt_bias_norm``.
- For AdamW it is torch.optim.AdamW's coefficient (``adam.py``): each step removes
  ``lr_t * weight_decay`` of each weight, ``lr_t`` the group's per-step LR then (schedule, batch
  scale and the group's multipliers included), as timm and torch do.
- ``optim.layer_decay`` and ``finetune.lr_first`` give each block of the network (:func:`block_of`)
  its own LR multiplier, geometric in the block's distance from the classifier.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..models import PatchWhitening, classifier_layers
from ..models.timm_models import timm_blocks
from ..recipe import FinetuneConfig, OptimConfig
from .adam import AdamW
from .base import SGD, Optimizer
from .layerwise import LAMB, LARS
from .orthogonal import OptimizerList, OrthogonalFilters


def classify(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by role: weight, bias, norm_weight, norm_bias, whiten_bias."""
    groups: dict[str, list[nn.Parameter]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            # (the whitening bias is always in: an eager step turns its requires_grad off while
            # it is frozen, and a step built then must still train it in the next run)
            if not p.requires_grad and not isinstance(module, PatchWhitening):
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                kind = "norm_weight" if name == "weight" else "norm_bias"
            elif isinstance(module, PatchWhitening):
                kind = "whiten_bias"
            else:
                kind = "weight" if p.ndim > 1 else "bias"
            groups.setdefault(kind, []).append(p)
    return groups


def blocks(model: nn.Module) -> dict[int, int]:
    """speedrun's structural rule for :func:`block_of`: each parameter's block, by ``id``: 0, 1,
    ... from the input to the classifier (a top-level layer, or one block of a stage: a
    ``Sequential`` is opened where it holds blocks of layers rather than single layers)."""
    def opens(m: nn.Module) -> bool:
        return isinstance(m, nn.Sequential) and any(len(list(c.children())) for c in m.children())

    found: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if opens(child):
                visit(child)
                continue
            params = [p for p in child.parameters() if id(p) not in found]
            if params:
                index = len(set(found.values()))
                found.update((id(p), index) for p in params)
    visit(model)
    rest = [p for p in model.parameters(recurse=False)]
    if rest:
        found.update((id(p), len(set(found.values()))) for p in rest)
    return found


def block_of(model: nn.Module) -> dict[int, int]:
    """The block of each of ``model``'s parameters, by ``id``: the one place that decides
    which parameters share a per-block learning rate (``optim.layer_decay``,
    ``finetune.lr_first``).

    Contract (what every source of blocks below must give): every parameter of
    ``model.parameters()`` gets an int; the values run from 0 (the block nearest the input: a
    stem, a whitening layer) to ``depth``, each value in between used by at least one
    parameter, in the order the data flows through them; the classifier's parameters make up
    block ``depth``, the last, alone (its LR multiplier is 1). A block is the unit a layer-wise
    decay treats as one "layer" (timm's layer groups): a stem, a residual block, a
    conv-BN-activation layer of the speed net, a final norm, the classifier. Callers take the
    result as it is: ``depth`` is its largest value.

    Where the blocks come from, in order:

    1. the model's own ``speedrun_blocks()`` method, for a network of yours: it returns the
       blocks from the input to the classifier, each an ``nn.Module`` (its parameters) or an
       iterable of parameters; each parameter must be in exactly one of them;
    2. a timm network's own blocks, from its ``group_matcher()`` as timm's layer decay reads it;
    3. speedrun's structural rule (:func:`blocks`), for speedrun's models and any module
       whose children are defined in data-flow order with the classifier last."""
    own = getattr(model, "speedrun_blocks", None)
    if callable(own):
        return _declared_blocks(model, own())
    timm = timm_blocks(model)
    if timm is not None:
        return timm
    return blocks(model)


def _declared_blocks(model: nn.Module, declared) -> dict[int, int]:
    """:func:`block_of` from a model's own list of blocks, checked against its contract."""
    found: dict[int, int] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for index, block in enumerate(declared):
        params = list(block.parameters()) if isinstance(block, nn.Module) else list(block)
        if not params:
            raise ValueError(f"{type(model).__name__}.speedrun_blocks(): block {index} has no parameters")
        for p in params:
            if id(p) not in names:
                raise ValueError(f"{type(model).__name__}.speedrun_blocks(): block {index} holds a tensor that is "
                                 "not one of the model's parameters")
            if id(p) in found:
                raise ValueError(f"{type(model).__name__}.speedrun_blocks(): {names[id(p)]} is in blocks "
                                 f"{found[id(p)]} and {index}; each parameter belongs to one block")
            found[id(p)] = index
    missing = [n for i, n in names.items() if i not in found]
    if missing:
        raise ValueError(f"{type(model).__name__}.speedrun_blocks(): {', '.join(missing[:5])} "
                         f"{'is' if len(missing) == 1 else 'are'} in no block; every parameter belongs to one")
    return found


def head_of(model: nn.Module) -> set[int]:
    """The classifier's parameters (by ``id``): those of the model's last linear layer (a timm
    network's ``get_classifier``)."""
    return {id(p) for m in classifier_layers(model) for p in m.parameters()}


def layer_decay_mult(layer_decay: float, block: int, depth: int) -> float:
    """``optim.layer_decay``'s LR multiplier of a parameter in ``block`` of ``depth`` (the
    classifier's block): ``layer_decay ** (depth - block)``, 1 for the classifier."""
    return layer_decay ** (depth - block)


def lr_first_mult(lr_first: float, block: int, depth: int) -> float:
    """``finetune.lr_first``'s LR multiplier: ``lr_first`` at block 0, geometric up to 1 at ``depth``."""
    return lr_first ** ((depth - block) / depth) if depth else 1.0


def block_split(model: nn.Module, roles: dict[str, list[nn.Parameter]], cfg: OptimConfig,
                ft: FinetuneConfig | None, stand_ins: dict[int, torch.Tensor] | None = None
                ) -> list[tuple[str, list, float, bool]]:
    """``roles`` as the optimizer's groups: (role, parameters, LR multiplier of their block,
    held during fine-tuning's head epochs). Where the LR depends on the block
    (``optim.layer_decay`` < 1, or fine-tuning's ``finetune.lr_first``), each role is cut by
    :func:`block_of` and the multipliers of both apply (a recipe sets at most one of them);
    otherwise one group per role at 1. The classifier is never held, the batch norms not with
    ``finetune.train_norm``."""
    tuned = ft is not None and ft.active
    if not tuned and cfg.layer_decay == 1:
        return [(kind, params, 1.0, False) for kind, params in roles.items()]
    block, head = block_of(model), head_of(model)
    depth = max(block.values(), default=0)
    back = {id(v): k for k, v in (stand_ins or {}).items()}        # a stand-in's parameter
    out = []
    for kind, params in roles.items():
        by_block: dict[int, list] = {}
        for p in params:
            by_block.setdefault(block[back.get(id(p), id(p))], []).append(p)
        for b, ps in sorted(by_block.items()):
            mult = layer_decay_mult(cfg.layer_decay, b, depth)
            if tuned:
                mult *= lr_first_mult(ft.lr_first, b, depth)
            is_head = all(back.get(id(p), id(p)) in head for p in ps)
            held = tuned and ft.head_epochs > 0 and not is_head and not (ft.train_norm and kind.startswith("norm_"))
            out.append((kind, ps, mult, held))
    return out


def filter_split(model: nn.Module, filters: list, cfg: OptimConfig,
                 stand_ins: dict[int, torch.Tensor] | None = None) -> list[tuple[list, float]]:
    """The orthogonally updated filters as groups: (filters, LR multiplier). ``optim.layer_decay``
    applies to them as to every parameter (one group per block); fine-tuning's ``lr_first`` does
    not (one group at 1, as the filters' update has its own scale)."""
    if cfg.layer_decay == 1:
        return [(filters, 1.0)]
    block = block_of(model)
    depth = max(block.values(), default=0)
    back = {id(v): k for k, v in (stand_ins or {}).items()}
    by_block: dict[int, list] = {}
    for p in filters:
        by_block.setdefault(block[back.get(id(p), id(p))], []).append(p)
    return [(ps, layer_decay_mult(cfg.layer_decay, b, depth)) for b, ps in sorted(by_block.items())]


def step_lr(cfg: OptimConfig, batch_size: int) -> float:
    """The per-step LR at schedule multiplier 1, before a group's LR multiplier."""
    ratio = batch_size / cfg.ref_batch
    scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[cfg.lr_scaling]
    momentum_norm = 1.0 if cfg.name in ("lamb", "adamw") else 1 - cfg.momentum
    return cfg.lr * momentum_norm * scale


def build_optimizer(model: nn.Module, cfg: OptimConfig, batch_size: int,
                    ns_dtype: torch.dtype | None = None,
                    stand_ins: dict[int, torch.Tensor] | None = None,
                    finetune: FinetuneConfig | None = None) -> Optimizer | OptimizerList:
    """SGD, LARS, LAMB or AdamW (by ``cfg.name``) with one group per parameter role (and per
    block, where the LR depends on the block: :func:`block_split`).

    Each group carries ``name`` (its role), ``base_lr`` (its LR at schedule multiplier 1),
    ``lr_mult`` (its role's and block's multipliers) and ``held``. For SGD the decoupled decay is
    expressed through torch's coupled ``weight_decay`` as ``decay / (lr * lr_mult)``, so that
    lr_t * weight_decay = multiplier_t * decay * (1 - momentum) * scale; LARS, LAMB and AdamW
    groups take the decay as it is (LARS and LAMB also ``adapt``)."""
    lr = step_lr(cfg, batch_size)
    mults = {"norm_bias": cfg.norm_bias_lr_mult, "whiten_bias": cfg.whiten_bias_lr_mult}
    groups = []
    roles = classify(model)
    if stand_ins:               # the tensors updated in the parameters' place (fp32 master weights), by id
        roles = {kind: [stand_ins.get(id(p), p) for p in params] for kind, params in roles.items()}
    filters = None
    if cfg.filters == "orthogonal":
        filters = [p for p in roles.get("weight", []) if p.ndim == 4]
        roles["weight"] = [p for p in roles.get("weight", []) if p.ndim != 4]
        if not roles["weight"]:
            del roles["weight"]
    tuned = finetune is not None and finetune.active
    for kind, params, block_mult, held in block_split(model, roles, cfg, finetune, stand_ins):
        lr_mult = mults.get(kind, 1.0) * block_mult
        one_d = kind != "weight"
        decay = 0.0 if (cfg.no_decay_bias_norm and one_d) else cfg.weight_decay
        group = dict(params=params, name=kind, lr=lr * lr_mult, base_lr=lr * lr_mult, lr_mult=lr_mult, held=held)
        if cfg.name == "sgd":
            group["weight_decay"] = decay / (cfg.lr * lr_mult) if lr_mult > 0 else 0.0
        elif cfg.name == "adamw":
            group["weight_decay"] = decay
        else:
            group.update(weight_decay=decay, adapt=not one_d or cfg.adapt_bias_norm)
        groups.append(group)
    if cfg.name == "lars":
        main = LARS(groups, lr, momentum=cfg.momentum, nesterov=cfg.nesterov, trust_coefficient=cfg.trust_coefficient)
    elif cfg.name == "lamb":
        main = LAMB(groups, lr, betas=cfg.betas, eps=cfg.eps)
    elif cfg.name == "adamw":
        main = AdamW(groups, lr, betas=cfg.betas, eps=cfg.eps)
    else:
        main = SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    if filters is None:
        return main
    # decoupled decay in optim.weight_decay's units: lr_t * weight_decay = multiplier_t * decay per step,
    # whatever the group's layer-decay multiplier. It has its own field: resetting the norms every step
    # (the records' choice) undoes any decay.
    decay_per_step = cfg.filter_weight_decay * lr / cfg.lr
    held = tuned and finetune.head_epochs > 0
    filter_groups = [dict(params=ps, name="filters", lr=cfg.filter_lr * mult, base_lr=cfg.filter_lr * mult,
                          lr_mult=mult, held=held, weight_decay=decay_per_step / (cfg.filter_lr * mult))
                     for ps, mult in filter_split(model, filters, cfg, stand_ins)]
    ortho = OrthogonalFilters(filter_groups, cfg.filter_lr, momentum=cfg.filter_momentum, nesterov=cfg.nesterov,
                              ns_steps=cfg.ns_steps, norm_every=cfg.filter_norm_every, ns_dtype=ns_dtype)
    return OptimizerList(main, ortho)
