"""Evaluation with test-time augmentation (TTA): the logits of several views of each test
image, averaged with fixed weights. 'flip' averages the image and its mirror (Page, 2018);
'flip_translate' adds both of those shifted one pixel up-left and down-right (airbench)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def _shift(dy: int, dx: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Translate by (dy, dx) pixels, filling the border by reflection."""
    def view(x):
        h, w = x.shape[2:]
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        return padded[:, :, 1 - dy:1 - dy + h, 1 - dx:1 - dx + w]
    return view


_identity = lambda x: x
_mirror = lambda x: x.flip(3)
_compose = lambda f, g: (lambda x: g(f(x)))

# (weight, view) pairs; the first view is always the plain image
TTA_VIEWS: dict[str, list[tuple[float, Callable]]] = {
    "none": [(1.0, _identity)],
    "flip": [(0.5, _identity), (0.5, _mirror)],
    "flip_translate": [(0.25, _identity), (0.25, _mirror),
                       (0.125, _shift(1, 1)), (0.125, _compose(_shift(1, 1), _mirror)),
                       (0.125, _shift(-1, -1)), (0.125, _compose(_shift(-1, -1), _mirror))],
}


EVAL_CHUNK_FLOPS = 1e10
"""On a CPU, the most forward-pass FLOPs of one model call in an evaluation (``eval.chunk =
"auto"``): a batch is cut into calls of that many images, and a stop signal is checked between
them. A whole batch of 500 Tiny-ImageNet images at 64 px on a ResNet-18 is about 30 times this and
took over a minute on one thread of a 2-core AMD EPYC Zen 1; a call of this size takes a few
seconds there."""


def chunk_images(forward_flops: float) -> int:
    """Images per model call of an evaluation on a CPU, for a model of ``forward_flops`` per
    image (:data:`EVAL_CHUNK_FLOPS`)."""
    return max(1, int(EVAL_CHUNK_FLOPS // max(forward_flops, 1.0)))


def _calls(model: nn.Module, x: torch.Tensor, chunk: int | None, between: Callable[[], None] | None) -> torch.Tensor:
    """``model(x)`` as fp32 logits, in calls of at most ``chunk`` images where the batch has more,
    with ``between()`` before each call after the first. The calls are of one size (the batch cut
    into equal parts, the last filled with zero images whose outputs are dropped), so that a
    compiled model sees one shape per batch size; in evaluation mode each image's logits do not
    depend on the others in its call."""
    n = len(x)
    if chunk is None or n <= chunk:
        # a copy: under CUDA graphs the next view's replay of the same graph overwrites the output
        return model(x).to(torch.float32, copy=True)
    calls = math.ceil(n / chunk)
    size = math.ceil(n / calls)
    if calls * size > n:
        x = torch.cat([x, x.new_zeros((calls * size - n, *x.shape[1:]))])
    out = []
    for i in range(calls):
        if i and between is not None:
            between()
        out.append(model(x[i * size:(i + 1) * size]).float())
    return torch.cat(out)[:n]


def tta_logits(model: nn.Module, x: torch.Tensor, tta: str, memory_format=torch.contiguous_format,
               fraction: float = 1.0, valid: int | None = None, chunk: int | None = None,
               between: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean of the views' logits, logits of the plain view) for one batch.

    With ``fraction`` < 1 only that share of the batch, the images whose plain prediction has
    the smallest margin between its two top logits, gets the other views (the 2025 CIFAR-10
    record's cheaper TTA); the rest keep their plain logits. The share is a fixed count per
    batch size, so nothing is read back from the device. ``valid``: the rows that are images
    where the rest pad the batch (:func:`evaluate`'s ``pad_to``): padding rows are chosen last.
    ``chunk``, ``between``: each view is computed in calls of at most that many images, with
    ``between()`` (the stop check) before each call but the batch's first."""
    views = TTA_VIEWS[tta]
    plain = _calls(model, x.contiguous(memory_format=memory_format), chunk, between)
    if len(views) == 1:
        return plain, plain
    idx = None
    if fraction < 1:
        k = max(1, math.ceil(fraction * len(x)))
        top2 = plain.topk(2, dim=1).values
        margin = top2[:, 0] - top2[:, 1]
        if valid is not None and valid < len(x):
            margin[valid:] = float("inf")
        idx = margin.topk(k, largest=False).indices
        x = x[idx]
    total = views[0][0] * (plain if idx is None else plain[idx])
    for weight, view in views[1:]:
        if between is not None and chunk is not None:
            between()
        total = total + weight * _calls(model, view(x).contiguous(memory_format=memory_format), chunk, between)
    if idx is None:
        return total, plain
    return plain.index_copy(0, idx, total), plain


class EvaluationStopped(Exception):
    """A stop signal ended an evaluation between two of its batches or model calls (``signum``: the
    signal)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.what: str | None = None           # which evaluation (set by the training loop)
        self.weights: dict | None = None       # the evaluated weights, where the loop keeps them
        super().__init__(f"evaluation stopped by signal {signum}")


@torch.no_grad()
def evaluate(model: nn.Module, batches, tta: str, runtime=None, fraction: float = 1.0,
             on_batch: Callable | None = None, pad_to: int | None = None,
             stop: Callable[[bool], int | None] | None = None,
             chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Correct-prediction counts (with TTA, plain view) as device tensors, and the number of
    images, over an iterable of (x, y) device batches: no host sync. ``on_batch(total, plain,
    y)``, where given, sees each batch's logits (``speedrun evaluate`` keeps them).

    ``stop``: asked on the host before each batch (``stop(True)``) and once after the last
    (``stop(False)``) whether a stop signal ends the evaluation; a signal number raises
    :class:`EvaluationStopped`. It reads a flag (one process) or agrees with the other ranks
    (see :meth:`~speedrun.engine.distributed.StopAgreement.in_evaluation`); nothing waits for
    the device. ``chunk``: each batch's views are computed in model calls of at most this many
    images, and ``stop`` is asked between them too (on a CPU, where one batch can take minutes).

    ``pad_to``: a batch with fewer images (the last one of a set, a smaller set) is filled to
    this many with zero images whose outputs are dropped, so that a compiled model sees one
    batch shape in evaluation. With partial TTA its re-evaluated share is then the full batch's
    count, the padding rows chosen last: a short last batch has at least as many of its images
    re-evaluated as it would unpadded."""
    memory_format = runtime.memory_format if runtime else torch.contiguous_format
    was_training = model.training
    model.eval()
    correct, n = None, 0
    try:
        with runtime.autocast() if runtime else contextlib.nullcontext():
            for xb, yb in batches:
                _check(stop, True)
                if not len(xb):                     # a rank's share of a small last batch can be empty
                    continue
                valid = len(xb)
                if pad_to is not None and valid < pad_to:
                    xb = torch.cat([xb, xb.new_zeros((pad_to - valid, *xb.shape[1:]))])
                total, plain = tta_logits(model, xb, tta, memory_format, fraction, valid, chunk,
                                          None if stop is None else (lambda: _check(stop, True)))
                total, plain = total[:valid], plain[:valid]
                if on_batch is not None:
                    on_batch(total, plain, yb)
                c = torch.stack([(total.argmax(1) == yb).sum(), (plain.argmax(1) == yb).sum()])
                correct = c if correct is None else correct + c
                n += len(yb)
            _check(stop, False)
    finally:
        model.train(was_training)
    if correct is None:
        device = next(model.parameters()).device
        correct = torch.zeros(2, dtype=torch.int64, device=device)
    return correct[0], correct[1], n


def _check(stop: Callable[[bool], int | None] | None, running: bool) -> None:
    signum = stop(running) if stop is not None else None
    if signum:
        raise EvaluationStopped(signum)
