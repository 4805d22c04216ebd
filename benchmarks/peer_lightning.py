"""The Lightning peer of ``peers.py``: cifar10-94 as a ``lightning.LightningModule`` trained
by ``lightning.Trainer`` with the settings Lightning documents for raw speed on a CPU:
``precision="bf16-mixed"`` where the CPU computes bf16 natively (else ``"32-true"``),
``barebones=True`` (no logger, checkpointing, progress bar, model summary or sanity
validation), the model in channels_last, batches built whole from tensors in memory and
handed over as a plain iterable (no DataLoader workers), ``max_steps`` for fractional epochs.

The algorithm is ``peer_algorithm``'s, the same code the plain loop runs: the optimizer and
its per-step schedule from ``configure_optimizers``, the lookahead averaging after each
optimizer step (``on_train_batch_end``), the monitoring evaluation of the averaged weights
after each epoch but the last (``on_train_epoch_end``, its time kept out of the training
clock as speedrun keeps it), and the final TTA accuracy from ``Trainer.test``.

Imported only where Lightning is wanted, so the plain peer's process never loads it.
"""
from __future__ import annotations

from contextlib import nullcontext

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from peer_algorithm import Algorithm, Clock, evaluate, make_lookahead, make_optimizer, tta_logits


def lightning_precision(precision: str) -> str:
    """Lightning's name for a precision of the peers ("bf16" or "fp32")."""
    return {"bf16": "bf16-mixed", "fp32": "32-true"}[precision]


class Cifar10Peer(L.LightningModule):
    """``model`` trained with ``algo``. ``clock`` (optional) gets a mark at the end of each
    epoch; ``monitor_batches()`` (optional) gives the test batches for the per-epoch
    monitoring accuracy, collected in :attr:`monitor_acc`."""

    def __init__(self, model: nn.Module, algo: Algorithm, clock: Clock | None = None, monitor_batches=None):
        super().__init__()
        self.model, self.algo, self.clock, self.monitor_batches = model, algo, clock, monitor_batches
        self.lookahead = None
        self.steps_done = 0
        self.monitor_acc: list[float] = []
        self.correct = torch.zeros(2, dtype=torch.int64)
        self.seen = 0

    # -- training ----------------------------------------------------------------------------
    def configure_optimizers(self):
        opt, schedule = make_optimizer(self.model, self.algo)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        # the average starts from the weights as training starts (whitening already fitted)
        self.lookahead = make_lookahead(self.model, self.algo)
        self.steps_done = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.algo.label_smoothing)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps_done += 1
        if self.lookahead is not None:
            self.lookahead.update(self.steps_done)

    def on_train_epoch_end(self) -> None:
        if self.clock is not None:
            self.clock.mark_epoch()
        if self.monitor_batches is None or not self.algo.monitors_after(self.current_epoch):
            return
        averaged = self.lookahead.applied() if self.lookahead is not None else nullcontext()
        with self.clock.pause() if self.clock is not None else nullcontext(), averaged:
            _, acc = evaluate(self.model, self.monitor_batches(), "none",
                              self.trainer.precision_plugin.forward_context)
        self.monitor_acc.append(acc)

    def on_train_end(self) -> None:
        if self.lookahead is not None:
            self.lookahead.finalize()

    # -- the final evaluation (Trainer.test) -------------------------------------------------
    def on_test_epoch_start(self) -> None:
        self.correct.zero_()
        self.seen = 0

    def test_step(self, batch, batch_idx) -> None:
        x, y = batch
        total, plain = tta_logits(self.model, x, self.algo.tta)
        self.correct += torch.stack([(total.argmax(1) == y).sum(), (plain.argmax(1) == y).sum()])
        self.seen += len(y)


def make_trainer(algo: Algorithm, precision: str) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, precision=lightning_precision(precision), barebones=True,
                     max_epochs=algo.epochs, max_steps=algo.total_steps, inference_mode=True)


def train_lightning(model: nn.Module, algo: Algorithm, batches, precision: str, clock: Clock | None = None,
                    monitor_batches=None, trainer: L.Trainer | None = None) -> tuple[L.Trainer, Cifar10Peer]:
    """Train ``model`` (whitening already fitted) on ``batches`` (an iterable, one pass per
    epoch) for ``algo.total_steps`` steps; the averaged weights end up in ``model``.
    ``trainer``: one from :func:`make_trainer` (the benchmark makes it before its clock, as
    speedrun builds its session before its clock), else made here."""
    trainer = trainer or make_trainer(algo, precision)
    module = Cifar10Peer(model, algo, clock, monitor_batches)
    trainer.fit(module, train_dataloaders=batches)
    return trainer, module


def final_accuracy(trainer: L.Trainer, module: Cifar10Peer, batches) -> tuple[float, float]:
    """(accuracy with the recipe's TTA, without) from ``Trainer.test``."""
    trainer.test(module, dataloaders=batches, verbose=False)
    c_tta, c_plain = module.correct.tolist()
    return c_tta / module.seen, c_plain / module.seen
