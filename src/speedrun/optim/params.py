"""Parameter groups and the SGD optimizer, with hyperparameters whose meaning does not
change with the batch size or the momentum.

- ``optim.lr`` is the momentum-normalised step size for a batch of ``optim.ref_batch``
  examples: the per-step learning rate applied to the mean-loss gradient is
  ``lr * (1 - momentum) * batch_size / ref_batch`` (the linear scaling rule, Goyal et al.
  2017; with momentum m the long-run step is lr/(1-m) times the per-step rate).
- ``optim.weight_decay`` is decoupled from the LR (Loshchilov & Hutter, 2019): the fraction
  of each weight removed per ref_batch examples at the schedule's peak, in the same
  momentum-normalised units. Changing ``lr`` or a group's LR multiplier leaves it unchanged;
  it follows the LR schedule's shape.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..models import BatchNorm, PatchWhitening
from ..recipe import OptimConfig


def classify(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by role: weight, bias, norm_weight, norm_bias, whiten_bias."""
    groups: dict[str, list[nn.Parameter]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                kind = "norm_weight" if name == "weight" else "norm_bias"
            elif isinstance(module, PatchWhitening):
                kind = "whiten_bias"
            else:
                kind = "weight" if p.ndim > 1 else "bias"
            groups.setdefault(kind, []).append(p)
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, batch_size: int) -> torch.optim.SGD:
    """torch SGD with one group per parameter role.

    Each group carries ``base_lr`` (its LR at schedule multiplier 1) and ``lr_mult``; the
    decoupled decay is expressed through torch's coupled ``weight_decay`` as
    ``decay / (lr * lr_mult)``, so that lr_t * weight_decay = multiplier_t * decay."""
    step_lr = cfg.lr * (1 - cfg.momentum) * batch_size / cfg.ref_batch
    mults = {"norm_bias": cfg.norm_bias_lr_mult, "whiten_bias": cfg.whiten_bias_lr_mult}
    groups = []
    for kind, params in classify(model).items():
        lr_mult = mults.get(kind, 1.0)
        one_d = kind != "weight"
        decay = 0.0 if (cfg.no_decay_bias_norm and one_d) else cfg.weight_decay
        wd = decay / (cfg.lr * lr_mult) if lr_mult > 0 else 0.0
        groups.append(dict(params=params, name=kind, lr=step_lr * lr_mult, base_lr=step_lr * lr_mult,
                           lr_mult=lr_mult, weight_decay=wd))
    return torch.optim.SGD(groups, lr=step_lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)


def set_step_hyperparams(opt: torch.optim.Optimizer, lr_mult: float, momentum: float | None = None,
                         frozen: frozenset[str] = frozenset()) -> None:
    """Apply the schedule's multiplier (and momentum) for this step; groups named in
    ``frozen`` get LR 0 (e.g. the whitening bias after its training epochs)."""
    for g in opt.param_groups:
        g["lr"] = 0.0 if g["name"] in frozen else g["base_lr"] * lr_mult
        if momentum is not None:
            g["momentum"] = momentum
