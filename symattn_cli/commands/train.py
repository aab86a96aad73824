"""``symattn train``: compose model, data, trainer and logger into one run.

Writes ``<run dir>/run.h5`` (see :mod:`symattn_cli.train.runfile`) and streams metrics to
Weights & Biases. ``resume=<run dir or run.h5>`` continues a killed run from its last finished
epoch, with the config stored in the run file (:func:`resumed_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

from symattn_cli.commands.common import (
    environment,
    fail,
    hydra_entry,
    resolve_path,
    run_dir,
    start_run_tracker,
    to_yaml,
)
from symattn_cli.errors import ConfigError, UserError

RUN_FILE = "run.h5"


def locate_run_file(target: str, *, option: str = "resume", note: bool = True) -> Path:
    """The run file behind ``resume=`` (or ``option=``): a run directory or the ``run.h5``
    itself, checked whole (:func:`symattn_cli.train.runfile.check_run_file`: a damaged file
    raises). With ``note``, a file without checksums is named on stderr."""
    from symattn_cli.train.runfile import RunFileError, check_run_file

    path = resolve_path(target)
    if path.is_dir():
        path = path / RUN_FILE
    if not path.exists():
        raise RunFileError(
            f"{option}={target!r}: no run file at {path}; pass a run directory made by "
            "`symattn train` (it holds run.h5) or the run.h5 itself"
        )
    unchecked = check_run_file(path)
    if unchecked and note:
        print(f"symattn: note: {unchecked}", file=sys.stderr, flush=True)
    return path


def stored_config(path: Path):
    """The resolved config a run was started with, re-validated against the schema."""
    from omegaconf import OmegaConf

    from symattn_cli.configs.base import TrainConfig
    from symattn_cli.models.instantiate import upgrade_stored
    from symattn_cli.train.runfile import read_config_yaml

    stored = upgrade_stored(OmegaConf.create(read_config_yaml(path)))
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), stored)


def check_stored_targets(stored: Any, given: Any, path: Path, option: str) -> None:
    """Refuse a run file whose model or data ``_target_`` the command line (``given``) does
    not name (:func:`symattn_cli.configs.targets.check_trusted`): nothing is imported."""
    from symattn_cli.configs.targets import check_trusted, targets_in

    named = set()
    for key in ("model", "data"):
        if key in given:
            named |= targets_in(given[key])
    check_trusted({k: stored[k] for k in ("model", "data") if k in stored}, named, path, option)


# What a resumed run takes from the command line: how it reports and where it runs, not what
# it computes (the rest comes from its run file).
RESUME_FREE = ("logger", "trainer.progress", "trainer.profile", "trainer.threads",
               "trainer.device", "trainer.num_workers", "data_root")  # fmt: skip


def resumed_config(stored: Any, given: Any, overrides: list[str]) -> Any:
    """The config a resumed run continues with: ``stored`` (the run file's) with the command
    line's (``given``, composed from ``overrides``) values of :data:`RESUME_FREE`. An override
    of anything else that differs from the stored value is a :class:`ConfigError` naming it:
    the run's state belongs to its own config."""
    from omegaconf import OmegaConf, open_dict

    from symattn_cli.models.instantiate import ALL_FACTS

    given = copy.deepcopy(given)
    if "data" in given and "data" in stored:  # the data's facts as the run's data gave them
        with open_dict(given):
            for fact in ALL_FACTS:
                if given.data.get(fact) is None and fact in stored.data:
                    given.data[fact] = stored.data[fact]

    def plain(config: Any, key: str) -> Any:
        """The value at ``key``, without the keys of :data:`RESUME_FREE` below it."""
        value = OmegaConf.select(config, key)
        if not OmegaConf.is_config(value):
            return value
        value = OmegaConf.to_container(value, resolve=True)
        for free in RESUME_FREE:
            if free.startswith(key + "."):
                value.pop(free[len(key) + 1 :], None)
        return value

    differ = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "resume" or key.startswith("hydra.") or "=" not in override:
            continue
        if any(key == free or key.startswith(free + ".") for free in RESUME_FREE):
            OmegaConf.update(stored, key, plain(given, key), merge=True)
            continue
        # a preset that sets other keys (experiment=...) is compared by what it computes
        keys = [key] if key in given or "." in key else ["model", "data", "trainer", "seed"]
        if any(plain(given, k) != plain(stored, k) for k in keys):
            differ.append(override)
    if differ:
        raise ConfigError(
            f"resume= continues a run with the config in its run file; {', '.join(differ)} "
            "would change it. Drop those overrides, or start a new run with them (more epochs "
            "are a new run: trainer.epochs shapes the learning-rate schedule)"
        )
    return stored


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def train(cfg: Any) -> dict[str, float]:
    """Run one training job described by ``cfg``; return the final summary."""
    import torch
    from omegaconf import OmegaConf

    from symattn_cli.models.instantiate import build
    from symattn_cli.train.curves import CURVES_FILE, epoch_plotter
    from symattn_cli.train.distributed import barrier, device_for, init_world, shutdown
    from symattn_cli.train.profile import profiled
    from symattn_cli.train.progress import Progress
    from symattn_cli.train.runfile import NullRunFile, RunFile, read_state
    from symattn_cli.train.settings import TrainSettings
    from symattn_cli.train.trainer import (
        DivergedError,
        Trainer,
        metric_names,
        resolve_device,
        seed_everything,
    )

    resume_path = locate_run_file(cfg.resume) if cfg.resume else None
    state = None
    if resume_path is not None:
        stored = stored_config(resume_path)
        check_stored_targets(stored, cfg, resume_path, "resume")
        cfg = resumed_config(stored, cfg, _task_overrides())
        state = read_state(resume_path)  # first: a state that cannot be read fails at once
        directory = resume_path.parent
    else:
        directory = run_dir()
    settings = TrainSettings(**OmegaConf.to_container(cfg.trainer, resolve=True))
    settings.check()
    world = init_world(settings.device)
    settings = dataclasses.replace(settings, device=device_for(world, settings.device))
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    seed_everything(cfg.seed, deterministic=settings.deterministic)

    data, model = build(cfg)
    device = resolve_device(settings.device)
    names = metric_names(data.spec.task, data.extra_tests)

    if resume_path is not None:
        barrier(world)  # every process has its state before rank 0 reopens the file
    if not world.is_main:
        run_file = NullRunFile()
    elif resume_path is not None:
        run_file = RunFile.reopen(resume_path, safe_epoch=int(state["epoch"]) if state else 0)
    else:
        run_file = RunFile.create(
            directory / RUN_FILE,
            command="train",
            config_yaml=to_yaml(cfg),
            env=environment(str(device)),
            epoch_metrics=names["epoch"],
            step_metrics=names["step"],
            summary_metrics=names["summary"],
            weights={k: v.detach().cpu().numpy() for k, v in model.state_dict().items()},
            choices=_choices(),
        )
    tracker = start_run_tracker(
        cfg,
        directory,
        name=directory.name,
        job_type="train",
        mode=cfg.logger.mode if world.is_main else "disabled",
        run_id=state.get("tracker_id") if state else None,
    )
    profiling = settings.profile and world.is_main
    with profiled(directory, enabled=profiling):  # trainer.profile=true: profile.md
        exit_code, draw, curves, attention = 1, False, None, None
        title = f"{type(model).__name__} on {_data_name(cfg)}: {directory.name}"
        redraw = epoch_plotter(run_file, directory / CURVES_FILE, title) if world.is_main else None
        try:
            with Progress(settings.progress if world.is_main else "none") as progress:
                trainer = Trainer(
                    model,
                    data,
                    settings,
                    run_file=run_file,
                    tracker=tracker,
                    seed=cfg.seed,
                    progress=progress,
                    world=world,
                    on_epoch=redraw,
                )
                if state is not None:
                    trainer.load_state(state)
                    progress.message(f"resuming {resume_path} after epoch {trainer.epoch}")
                summary = trainer.fit()
            run_file.set_summary(summary)
            run_file.set_status("finished")
            tracker.summary(summary)
            exit_code, draw = 0, True
        except DivergedError:
            run_file.set_status("diverged")
            draw = True  # worth a look: where the loss went
            raise
        except BaseException:
            run_file.set_status("failed")
            raise
        finally:
            run_file.close()
            if world.is_main and draw:
                curves = _draw_curves(run_file.path, tracker, title)
                if exit_code == 0:
                    attention = _draw_attention(model, data, run_file.path.parent, tracker, title)
            tracker.finish(exit_code=exit_code)
            shutdown(world)
    if world.is_main:
        _report(summary, run_file.path, [("curves", curves), ("attention maps", attention)])
    return summary


def _choices() -> str:
    """The option picked in each config group (``model: r4_mini``), as YAML, for reports."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    choices = HydraConfig.get().runtime.choices
    return OmegaConf.to_yaml({k: v for k, v in choices.items() if not k.startswith("hydra/")})


def _draw_curves(path: Path, tracker, title: str) -> Path | None:
    """``curves.png`` next to the run file, also sent to W&B. A plotting failure only warns:
    the run and its file are complete without it."""
    from symattn_cli.train.curves import plot_run

    try:
        image = plot_run(path, title=title)
    except Exception as err:  # noqa: BLE001 - matplotlib/font problems must not fail a run
        print(f"symattn: learning curves not drawn ({err}); run file: {path}", file=sys.stderr)
        return None
    if image is not None:
        tracker.log_image("curves", image)
    return image


def _data_name(cfg: Any) -> str:
    name = cfg.data.get("name") or str(cfg.data.get("_target_", "data")).rsplit(".", 1)[-1]
    variant = cfg.data.get("variant")
    return f"{name} ({variant})" if variant else name


def _draw_attention(model, data, directory: Path, tracker, title: str) -> Path | None:
    """``attention.png``: a GSA-Net's attention over the group for its first test image, at the
    weights the run tested (:func:`symattn_cli.verify.attention_maps.draw_attention`); ``None``
    for other models. A failure only warns, as for the curves."""
    from symattn_cli.verify.attention_maps import ATTENTION_FILE, draw_attention

    if data.spec.task != "classify" or len(data.test) == 0:
        return None
    try:
        path = draw_attention(model, data.test[0][0][None], directory / ATTENTION_FILE,
                              title=f"{title}, test image 0")  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a plot must not fail a finished run
        print(f"symattn: attention maps not drawn ({err})", file=sys.stderr)
        return None
    if path is not None:
        tracker.log_image("attention", path)
    return path


def _report(summary: dict[str, float], path: Path, figures: list[tuple[str, Path | None]]) -> None:
    scores = ", ".join(
        f"{key} {value:.4f}"
        for key, value in summary.items()
        if key.startswith("test") and key.endswith(("acc", "exact"))
    )
    lines = [scores, f"run file: {path}"]
    lines += [f"{name}: {figure}" for name, figure in figures if figure is not None]
    print("\n".join(lines), flush=True)


def _task(cfg: Any) -> None:
    train(cfg)


def main() -> None:
    _prepare_resume_argv()
    hydra_entry("train", _task)()


def _prepare_resume_argv() -> None:
    """With ``resume=``, write Hydra's own files nowhere new: the run keeps its directory."""
    args = sys.argv[1:]
    targets = [a.split("=", 1)[1] for a in args if a.startswith("resume=")]
    if not targets or any(a in ("-m", "--multirun") for a in args):
        return
    try:
        path = locate_run_file(targets[-1], note=False)  # the run itself gives the note
    except UserError as err:  # one line, before Hydra starts
        fail(str(err))
    sys.argv += [f"hydra.run.dir={path.parent}", "hydra.output_subdir=null"]
