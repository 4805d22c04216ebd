"""Terminal output: a progress bar while training and a short table at the end."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

def make_console(stderr: bool = False) -> Console:
    """A rich console; when output goes to a file or pipe, wide enough that tables do not wrap."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)


console = make_console(stderr=True)


class TrainingProgress:
    """Implements the loop's progress protocol with a rich progress bar (to stderr)."""

    def __init__(self, title: str):
        self.title = title
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        self.task = None

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def start(self, total_steps: int, epochs: int) -> None:
        self.epochs = epochs
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(f"{self.title} epoch 1/{epochs}", total=total_steps, info="")

    def step(self) -> None:
        self.bar.advance(self.task)

    def epoch(self, rec) -> None:
        test = f" test {rec.test_acc:.4f}" if rec.test_acc is not None else ""
        nxt = min(rec.epoch + 1, self.epochs)
        self.bar.update(self.task, description=f"{self.title} epoch {nxt}/{self.epochs}",
                        info=f"loss {rec.train_loss:.3f} train {rec.train_acc:.4f}{test}")


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in rows:
        table.add_row(k, v)
    make_console().print(table)
