"""Figures for reports, drawn with matplotlib (Agg) and returned as PNG bytes."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def training_curves(histories: list[list[dict]]) -> bytes:
    """Train loss, train accuracy and (monitoring) test accuracy per epoch, one line per run."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, h in enumerate(histories):
        ep = [r["epoch"] for r in h]
        alpha = 1.0 if len(histories) == 1 else 0.35
        ax1.plot(ep, [r["train_loss"] for r in h], color="C0", alpha=alpha, marker="o", ms=3)
        ax2.plot(ep, [r["train_acc"] for r in h], color="C1", alpha=alpha, marker="o", ms=3,
                 label="train (augmented)" if i == 0 else None)
        test = [(r["epoch"], r["test_acc"]) for r in h if r.get("test_acc") is not None]
        if test:
            ax2.plot(*zip(*test), color="C2", alpha=alpha, marker="s", ms=3, label="test (no TTA)" if i == 0 else None)
    ax1.set(xlabel="epoch", ylabel="train loss", title="loss")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    ax2.legend()
    return _png(fig)


def schedule(lrs: list[float], momenta: list[float] | None, steps_per_epoch: int) -> bytes:
    fig, ax = plt.subplots(figsize=(10, 3.2))
    epochs = [i / steps_per_epoch for i in range(len(lrs))]
    ax.plot(epochs, lrs, color="C0", label="LR (per-step, weights)")
    ax.set(xlabel="epoch", ylabel="learning rate", title="schedule")
    if momenta:
        ax2 = ax.twinx()
        ax2.plot(epochs, momenta, color="C3", label="momentum")
        ax2.set_ylabel("momentum")
        ax2.legend(loc="lower right")
    ax.legend(loc="upper right")
    return _png(fig)


def accuracy_histogram(accs: list[float], target: float) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.hist([a * 100 for a in accs], bins=min(30, max(5, len(accs) // 2)), color="C0", edgecolor="white")
    ax.axvline(target * 100, color="C3", linestyle="--", label=f"target {target:.2%}")
    mean = sum(accs) / len(accs)
    ax.axvline(mean * 100, color="k", label=f"mean {mean:.2%}")
    ax.set(xlabel="test accuracy (%)", ylabel="runs", title=f"accuracy over {len(accs)} runs")
    ax.legend()
    return _png(fig)


def time_per_run(times: dict[str, list[float]]) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (region, values) in enumerate(times.items()):
        ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, color=f"C{i}", label=region)
    ax.set(xlabel="run", ylabel="seconds", title="time per run")
    ax.set_ylim(bottom=0)
    ax.legend()
    return _png(fig)


def ablation_chart(rows: list[dict], target: float) -> bytes:
    """Change in accuracy and time per variant against its reference."""
    rows = [r for r in rows if r.get("delta_acc") is not None]
    labels = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.6), sharey=True)
    ys = range(len(rows))
    dacc = [r["delta_acc"] * 100 for r in rows]
    ax1.barh(ys, dacc, color=["C3" if d < 0 else "C2" for d in dacc])
    ax1.axvline(0, color="k", lw=0.8)
    ax1.set(yticks=list(ys), yticklabels=labels, xlabel="change in mean accuracy (points)")
    ax2.barh(ys, [r["delta_time"] for r in rows], color="C0")
    ax2.axvline(0, color="k", lw=0.8)
    ax2.set(xlabel="change in train+eval time (s)")
    ax1.invert_yaxis()
    fig.suptitle(f"ablation (target {target:.2%})")
    return _png(fig)


def scaling_curves(rows: list[dict], title: str) -> bytes:
    """Predicted throughput (against perfect scaling) and scaling efficiency per GPU count."""
    gpus = [r["gpus"] for r in rows]
    rate = [r["images_per_s"] for r in rows]
    one_gpu = rows[0]["images_per_s"] / (rows[0]["gpus"] * rows[0]["efficiency"])
    ideal = [one_gpu * g for g in gpus]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.loglog(gpus, ideal, color="0.6", ls="--", label="perfect scaling")
    ax1.loglog(gpus, rate, color="C0", marker="o", ms=3, label="predicted")
    ax1.set(xlabel="GPUs", ylabel="images/s", title="throughput")
    ax1.legend()
    ax2.semilogx(gpus, [100 * r["efficiency"] for r in rows], color="C1", marker="o", ms=3)
    ax2.set(xlabel="GPUs", ylabel="efficiency (%)", title="scaling efficiency", ylim=(0, 105))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return _png(fig)
