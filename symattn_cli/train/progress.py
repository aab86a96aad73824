"""Progress display: rich bars on a terminal, one plain line per epoch otherwise."""

from __future__ import annotations

import sys
from collections.abc import Mapping


def format_metrics(values: Mapping[str, float]) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


class Progress:
    """Epoch/step progress. ``mode``: auto (rich on a TTY), rich, plain or none."""

    def __init__(self, mode: str = "auto", *, stream=None) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "rich" if self.stream.isatty() else "plain"
        self.mode = mode
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
                console=Console(file=self.stream),
            )
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        if self._bar is not None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(f"epoch {epoch}/{epochs}", total=steps, info="")

    def step(self, info: str = "") -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, info=info)

    def message(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def end_epoch(self, epoch: int, epochs: int, values: Mapping[str, float]) -> None:
        self.message(f"epoch {epoch}/{epochs} {format_metrics(values)}")
