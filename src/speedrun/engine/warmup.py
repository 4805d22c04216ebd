"""The warm-up: everything a run does once or once per shape, done before the clock starts
on random data, so that compilation, cuDNN autotuning, lazy kernel loading and first-call
allocations never land in a timed run.

It covers the whitening fit (fp64 covariance and eigendecomposition on the device), the
batched augmentations, progressive resizing, the run's own training step (``session.step``,
the same object and compiled program the run calls: forward, loss, mixing, distillation,
backward over micro-batches, loss scaling, the optimizer and the weight averaging) at
every image size the run uses, and evaluation at every batch size the test set is cut
into, plain and with the recipe's test-time augmentation (the least-confident subsets
included), and plain at those of the validation split train.stop_at_target holds out. The model's weights and statistics are put back afterwards.
"""
from __future__ import annotations

import time

import torch

from ..data.augment.batch import BatchAugment, reflect_pad
from ..data.pipeline.resident import resize
from ..data.pipeline.shard import Shard
from .build import snapshot
from .evaluate import evaluate
from .sizes import resized_in_step


def train_calls(runtime) -> int:
    """Training steps per image size: with CUDA graphs three (they record on the second or
    third call); otherwise two, a plain step and one that averages the weights, which is
    every path a run's step takes."""
    return 3 if runtime.cuda_graphs else 2


def eval_batch_sizes(n_test: int, batch: int, shard: Shard = Shard()) -> list[int]:
    """The batch sizes this rank evaluates when a test set of ``n_test`` is cut into batches of
    ``batch`` (evaluating them also runs the subsets that partial TTA re-evaluates)."""
    return sorted({shard.eval_size(min(batch, n_test)), shard.eval_size(n_test % batch)} - {0})


def eval_pad(n_sets: list[int], batch: int, shard: Shard = Shard()) -> int:
    """The one batch size a compiled run evaluates at (:func:`.evaluate.evaluate`'s ``pad_to``):
    this rank's share of a full batch, or of the largest evaluated set where that is smaller
    (``n_sets``: the test set's images, and the held-out split's where there is one)."""
    return shard.eval_size(min(batch, max(n_sets)))


def warm_up(session) -> float:
    """Run the warm-up for ``session``; returns its seconds (the run's ``compile_seconds``)."""
    rt, r, src, model = session.runtime, session.recipe, session.source, session.model
    t0 = time.perf_counter()
    saved = snapshot(model)
    c, full, classes = src.in_channels, src.image_size[0], src.num_classes
    gen = torch.Generator(device=rt.device)
    gen.manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=rt.device)

    whiten = getattr(model, "whiten", None)
    if whiten is not None:
        whiten.fit(randn(min(256, r.model.whiten.samples), c, full, full))

    batch = session.local_batch                         # this rank's share of each step
    stats = torch.full((c,), 128.0, device=rt.device), torch.full((c,), 64.0, device=rt.device)
    stored = getattr(src, "stored_size", src.image_size)
    augment = BatchAugment(r.augment, batch, src.image_size, gen, rt.device, *stats,
                           resized_crop=not src.crops_in_workers, input_size=stored)
    draws = augment.draw(0)
    step = session.step
    step.idle()                                         # LR 0: kernels run, weights stay
    model.train()
    in_step, calls = resized_in_step(r), train_calls(rt)
    for size in session.image_sides:
        # crops are cut from the stored images; a step that resizes itself gets full-size batches
        side = stored[0] if augment.resized_crop or in_step else size
        x = augment(reflect_pad(randn(batch, c, side, side).to(rt.dtype), augment.translate),
                    torch.arange(batch, device=rt.device), draws, size if augment.resized_crop else None)
        if x.shape[-1] != size and not in_step:
            x = resize(x, size)
        x = x.contiguous(memory_format=rt.memory_format)
        y = torch.randint(0, classes, (batch,), generator=gen, device=rt.device)
        for i in range(calls):
            # the last call is a step that averages (eager decides every-N on the host)
            step.rewind(step.averaging_due_after if i == calls - 1 else 0)
            rt.mark_step()
            step(x, y, size if in_step else None)
        step.rewind()

    n_test = len(src.test_y)
    if session.eval_pad:                                # compiled: every evaluation batch padded to one size
        tested = held = [session.eval_pad]
    else:
        tested = eval_batch_sizes(n_test, r.eval.batch_size, session.shard)
        # train.stop_at_target's validation split: evaluated plain, at the batch sizes it is cut into
        held = eval_batch_sizes(session.holdout_images, r.eval.batch_size, session.shard) if session.holdout_images else []
    for n in sorted({*tested, *held}):
        x = randn(n, c, *src.eval_size).to(rt.dtype).contiguous(memory_format=rt.memory_format)
        y = torch.randint(0, classes, (n,), generator=gen, device=rt.device)
        for _ in range(2 if rt.cuda_graphs else 1):       # (CUDA graphs record on the second call)
            evaluate(session.forward, [(x, y)], "none", rt, chunk=session.eval_chunk)
            if n in tested:
                evaluate(session.forward, [(x, y)], r.eval.tta, rt, r.eval.tta_fraction, chunk=session.eval_chunk)
    rt.synchronize()
    model.load_state_dict(saved)
    model.train()
    step.reset(0)                                       # the schedule back, the state zero
    return time.perf_counter() - t0
