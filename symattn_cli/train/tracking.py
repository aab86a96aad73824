"""Weights & Biases streaming: one run per job, offline unless told otherwise.

``mode`` is passed to ``wandb.init`` explicitly, so a stray ``WANDB_MODE`` in the environment
does not override the config; ``disabled`` never imports wandb's network code paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from symattn_cli.errors import ConfigError, UserError

MODES = ("online", "offline", "disabled")


class Tracker:
    """A thin handle on one wandb run (or nothing, when disabled)."""

    def __init__(self, run: Any) -> None:
        self._run = run

    @property
    def run_id(self) -> str | None:
        return None if self._run is None else self._run.id

    @property
    def directory(self) -> str | None:
        return None if self._run is None else self._run.dir

    def log(self, values: Mapping[str, float], *, step: int) -> None:
        if self._run is not None:
            self._run.log(dict(values), step=step)

    def log_table(self, name: str, rows: list[Mapping[str, Any]]) -> None:
        """Log ``rows`` (dicts; the union of their keys are the columns) as a ``wandb.Table``."""
        if self._run is None or not rows:
            return
        import wandb

        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[row.get(column) for column in columns] for row in rows]
        self._run.log({name: wandb.Table(columns=columns, data=data)})

    def log_image(self, name: str, path: str | Path) -> None:
        """Attach an image file (a plot) to the run."""
        if self._run is not None:
            import wandb

            self._run.log({name: wandb.Image(str(path))})

    def summary(self, values: Mapping[str, float]) -> None:
        if self._run is not None:
            for key, value in values.items():
                self._run.summary[key] = value

    def finish(self, exit_code: int = 0) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None


def start_tracker(
    *,
    mode: str,
    project: str,
    run_dir: Path,
    config: Mapping[str, Any],
    name: str | None = None,
    entity: str | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    wandb_dir: str | None = None,
    run_id: str | None = None,
    job_type: str | None = None,
) -> Tracker:
    """Start (or resume, with ``run_id``) a wandb run writing under ``run_dir``."""
    if mode not in MODES:
        raise ConfigError(f"logger.mode={mode!r} is unknown; use one of {MODES}")
    if mode == "disabled":
        return Tracker(None)
    import wandb

    directory = Path(wandb_dir) if wandb_dir else Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(
            mode=mode,
            project=project,
            entity=entity,
            group=group,
            tags=list(tags or []),
            name=name,
            dir=str(directory),
            config=dict(config),
            id=run_id,
            job_type=job_type,
            resume="allow" if run_id else None,
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
    except wandb.errors.Error as err:  # no login, no network, a project it may not write to
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"logger.mode={mode}: W&B could not start the run ({first}); log in with `wandb "
            "login` (or set WANDB_API_KEY), or run with logger.mode=offline (`wandb sync` "
            "uploads it later) or logger.mode=disabled"
        ) from None
    return Tracker(run)
