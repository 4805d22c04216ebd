"""Parameter groups and the optimizer (SGD, LARS or LAMB), with hyperparameters whose
meaning does not change with the batch size or the momentum.

- ``optim.lr`` is the step size for a batch of ``optim.ref_batch`` examples, scaled to the
  actual batch by ``optim.lr_scaling``: ``scale`` = batch_size / ref_batch (linear, Goyal et al.
  2017), its square root (sqrt), or 1 (none). For SGD and LARS it is momentum-normalised: the
  per-step LR is ``lr * (1 - momentum) * scale`` (with momentum m the long-run step is lr/(1-m)
  times the per-step rate). For LAMB, whose Adam moments are averages, it is ``lr * scale``.
- ``optim.weight_decay`` for SGD is decoupled from the LR (Loshchilov & Hutter, 2019): the
  fraction of each weight removed per ref_batch examples at the schedule's peak, in the same
  momentum-normalised units and scaled like the LR. Changing ``lr`` or a group's LR multiplier
  leaves it unchanged; it follows the LR schedule's shape.
- For LARS and LAMB, ``optim.weight_decay`` is the published formula's coefficient (see
  ``layerwise.py``): the decay applied per step is proportional to the LR and the trust ratio.
  Only "weight" tensors are trust-scaled unless ``optim.adapt_bias_norm``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..models import PatchWhitening, classifier_layers
from ..models.timm_models import timm_blocks
from ..recipe import FinetuneConfig, OptimConfig
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
    """Each trainable parameter's block, by ``id``: 0, 1, ... from the input to the classifier
    (a top-level layer, or one block of a stage: a ``Sequential`` is opened where it holds
    blocks of layers rather than single layers; a timm network's blocks are timm's own, from its
    ``group_matcher``). Discriminative learning rates scale by it."""
    own = timm_blocks(model)
    if own is not None:
        return own

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


def head_of(model: nn.Module) -> set[int]:
    """The classifier's parameters (by ``id``): those of the model's last linear layer (a timm
    network's ``get_classifier``)."""
    return {id(p) for m in classifier_layers(model) for p in m.parameters()}


def finetune_split(model: nn.Module, roles: dict[str, list[nn.Parameter]], ft: FinetuneConfig,
                   stand_ins: dict[int, torch.Tensor] | None = None) -> list[tuple[str, list, float, bool]]:
    """``roles`` cut for fine-tuning: (role, parameters, LR multiplier of their block, held
    during the head epochs) per role and block. The multiplier grows geometrically from
    ``finetune.lr_first`` at the first block to 1 at the classifier; the classifier is never
    held, the batch norms not with ``finetune.train_norm``."""
    block, head = blocks(model), head_of(model)
    last = max(block.values(), default=0)
    back = {id(v): k for k, v in (stand_ins or {}).items()}        # a stand-in's parameter
    out = []
    for kind, params in roles.items():
        by_block: dict[int, list] = {}
        for p in params:
            by_block.setdefault(block.get(back.get(id(p), id(p)), last), []).append(p)
        for b, ps in sorted(by_block.items()):
            is_head = all(back.get(id(p), id(p)) in head for p in ps)
            mult = ft.lr_first ** ((last - b) / last) if last else 1.0
            held = ft.head_epochs > 0 and not is_head and not (ft.train_norm and kind.startswith("norm_"))
            out.append((kind, ps, mult, held))
    return out


def step_lr(cfg: OptimConfig, batch_size: int) -> float:
    """The per-step LR at schedule multiplier 1, before a group's LR multiplier."""
    ratio = batch_size / cfg.ref_batch
    scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[cfg.lr_scaling]
    momentum_norm = 1.0 if cfg.name == "lamb" else 1 - cfg.momentum
    return cfg.lr * momentum_norm * scale


def build_optimizer(model: nn.Module, cfg: OptimConfig, batch_size: int,
                    ns_dtype: torch.dtype | None = None,
                    stand_ins: dict[int, torch.Tensor] | None = None,
                    finetune: FinetuneConfig | None = None) -> Optimizer | OptimizerList:
    """SGD, LARS or LAMB (by ``cfg.name``) with one group per parameter role.

    Each group carries ``name`` (its role), ``base_lr`` (its LR at schedule multiplier 1) and
    ``lr_mult``. For SGD the decoupled decay is expressed through torch's coupled
    ``weight_decay`` as ``decay / (lr * lr_mult)``, so that lr_t * weight_decay = multiplier_t *
    decay * (1 - momentum) * scale; LARS and LAMB groups take the decay as it is, plus ``adapt``."""
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
    cut = finetune_split(model, roles, finetune, stand_ins) if tuned else \
        [(kind, params, 1.0, False) for kind, params in roles.items()]
    for kind, params, block_mult, held in cut:
        lr_mult = mults.get(kind, 1.0) * block_mult
        one_d = kind != "weight"
        decay = 0.0 if (cfg.no_decay_bias_norm and one_d) else cfg.weight_decay
        group = dict(params=params, name=kind, lr=lr * lr_mult, base_lr=lr * lr_mult, lr_mult=lr_mult, held=held)
        if cfg.name == "sgd":
            group["weight_decay"] = decay / (cfg.lr * lr_mult) if lr_mult > 0 else 0.0
        else:
            group.update(weight_decay=decay, adapt=not one_d or cfg.adapt_bias_norm)
        groups.append(group)
    if cfg.name == "lars":
        main = LARS(groups, lr, momentum=cfg.momentum, nesterov=cfg.nesterov, trust_coefficient=cfg.trust_coefficient)
    elif cfg.name == "lamb":
        main = LAMB(groups, lr, betas=cfg.betas, eps=cfg.eps)
    else:
        main = SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    if filters is None:
        return main
    # decoupled decay in optim.weight_decay's units: lr_t * weight_decay = multiplier_t * decay per step.
    # It has its own field: resetting the norms every step (the records' choice) undoes any decay.
    decay_per_step = cfg.filter_weight_decay * lr / cfg.lr
    ortho = OrthogonalFilters([dict(params=filters, name="filters", lr=cfg.filter_lr, base_lr=cfg.filter_lr,
                                    lr_mult=1.0, held=tuned and finetune.head_epochs > 0)], cfg.filter_lr, momentum=cfg.filter_momentum,
                              nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, norm_every=cfg.filter_norm_every,
                              weight_decay=decay_per_step / cfg.filter_lr, ns_dtype=ns_dtype)
    return OptimizerList(main, ortho)
