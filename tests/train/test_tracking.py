"""The W&B handle: a run W&B refuses to start is one clear error, not wandb's traceback."""

from __future__ import annotations

import pytest

from symattn_cli.errors import UserError
from symattn_cli.train.tracking import start_tracker


def test_a_run_wandb_cannot_start_names_the_mode_and_the_ways_on(tmp_path, monkeypatch):
    import wandb

    def refuse(**_):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(UserError) as caught:
        start_tracker(mode="online", project="p", run_dir=tmp_path, config={})
    message = str(caught.value)
    assert message.startswith("logger.mode=online: W&B could not start the run (No API key")
    assert "`wandb login`" in message and "logger.mode=offline" in message
    assert "logger.mode=disabled" in message and "\n" not in message
    assert start_tracker(mode="disabled", project="p", run_dir=tmp_path, config={})._run is None
