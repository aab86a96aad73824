"""``symattn verify-equivariance``: measure, for every group element, how equivariant it is.

With no arguments: every group and GSA layer kind, plain self-attention (GSA-Nets Props.
4.1-4.3) and knowledge attention (orthogonal and permutation laws), float64, with negative
controls shown as expected failures. ``checkpoint=<run dir or run.h5>`` checks a trained model.
Writes a rich table, ``verify.h5`` (table ``checks``), a W&B run and ``errors.png`` (with a
checkpoint of a GSA-Net also ``attention.png``, its lifting layer's attention maps over the
group); exits 1 when an exact check fails or a negative control does not.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symattn_cli.commands.common import (
    environment,
    hydra_entry,
    resolve_path,
    run_dir,
    start_run_tracker,
    to_yaml,
)
from symattn_cli.errors import ConfigError
from symattn_cli.verify.records import Check

RESULTS_FILE = "verify.h5"


@dataclasses.dataclass
class Trained:
    """The model of ``checkpoint=``, read once: its run file, data and the test images the
    image checks and the attention maps use (None for a token model)."""

    path: Path | None  # None: model=<name> at its initial weights
    model: Any
    data: Any
    images: Any


def command_line_targets(cfg: Any) -> set[str]:
    """The ``_target_`` s of the model and data configs this command line names."""
    from symattn_cli.configs.targets import targets_in

    return targets_in(cfg.model or {}) | targets_in(cfg.data or {})


def load_model(cfg: Any) -> Trained:
    """The model of ``model=<name>`` at its initial weights with the encodings of its attention
    layers drawn at random (:func:`~symattn_cli.verify.gsa.randomize_encodings`: at their
    initial values near zero a layer's group term would hardly show), on ``data=`` (default
    ``rotmnist_mini``), with a few of its test images. The data's facts are written into
    ``cfg.data``."""
    from omegaconf import open_dict

    from symattn_cli.configs.compose import compose_train
    from symattn_cli.models.instantiate import build
    from symattn_cli.verify.gsa import randomize_encodings
    from symattn_cli.verify.model import sample_inputs

    if cfg.data is None:
        with open_dict(cfg):
            cfg.data = compose_train(["data=rotmnist_mini"]).data
    torch_seed(cfg.seed)
    built, model = build(cfg)
    if built.spec.task != "classify":
        raise ConfigError(
            f"model=: verify-equivariance measures models of images under turns and flips; "
            f"this data's task is {built.spec.task!r} (the knowledge-attention laws are "
            "checked by the suite: families=[knowledge])"
        )
    return Trained(None, randomize_encodings(model, seed=cfg.seed), built,
                   sample_inputs(built, seed=cfg.seed))  # fmt: skip


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def load_checkpoint(cfg: Any) -> Trained:
    from symattn_cli.commands.train import locate_run_file
    from symattn_cli.verify.checkpoint import checkpoint_images, load_trained

    if cfg.checkpoint_images < 1:
        raise ConfigError(
            f"checkpoint_images={cfg.checkpoint_images} must be at least 1 (the test images the "
            "checkpoint checks rotate)"
        )
    path = locate_run_file(cfg.checkpoint, option="checkpoint")
    root = resolve_path(cfg.data_root)
    model, data, stored = load_trained(path, root, command_line_targets(cfg))
    if cfg.model is not None or cfg.data is not None:  # named for trust: record the run's own
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.model, cfg.data = stored["model"], stored["data"]
    images = None
    if data.spec.task != "tokens":
        images = checkpoint_images(data, root, cfg.checkpoint_images)
    return Trained(path, model, data, images)


def collect(cfg: Any, trained: Trained | None = None) -> list[Check]:
    from symattn_cli.verify.suite import run_suite

    if trained is not None and trained.path is None:  # model=<name>
        from symattn_cli.groups import get_group, group_option
        from symattn_cli.verify.model import model_checks

        claims = [get_group(group_option(g)).name for g in cfg.claims]
        names = [get_group(group_option(g)).name for g in cfg.groups] or all_groups()
        groups = [get_group(n) for n in dict.fromkeys([*names, *claims])]
        return model_checks(trained.model, trained.images, groups, claims, dtype=cfg.dtype,
                            seed=cfg.seed)  # fmt: skip
    if trained is not None:
        from symattn_cli.verify.checkpoint import checkpoint_checks

        return checkpoint_checks(
            trained.model, trained.data, trained.images, dtype=cfg.dtype, seed=cfg.seed,
            announce=lambda text: print(text, flush=True),
        )  # fmt: skip
    return run_suite(
        families=list(cfg.families),
        groups=list(cfg.groups),
        layers=list(cfg.layers),
        dtype=cfg.dtype,
        seed=cfg.seed,
        offgrid=cfg.offgrid,
    )


def all_groups() -> list[str]:
    from symattn_cli.groups import GROUP_NAMES

    return list(GROUP_NAMES)


def render(rows: Sequence[Check], *, full: bool = False) -> None:
    """A rich table: one line per (family, symmetry, layer, expectation) with its worst element,
    or one line per element with ``full``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="equivariance error, and the change a move of the group axis alone must cause "
        "(max over the batch; rel = max|err| / max|out|)"
    )
    for column in ("group", "layer", "element", "abs", "rel", "tolerance", "verdict"):
        table.add_column(
            column, justify="right" if column in ("abs", "rel", "tolerance") else "left"
        )
    styles = {
        "pass": "green",
        "fails as expected": "cyan",
        "responds": "green",
        "blind as expected": "cyan",
        "measured": "yellow",
        "FAIL": "bold red",
    }
    for row in rows if full else worst_per_layer(rows):
        tolerance = "—" if row.tolerance != row.tolerance else f"{row.tolerance:.0e}"
        element = row.element + (f" ({row.note})" if row.note else "")
        table.add_row(row.symmetry, row.layer, element, f"{row.abs_err:.2e}",
                      f"{row.rel_err:.2e}", tolerance,
                      f"[{styles.get(row.verdict, '')}]{row.verdict}")  # fmt: skip
    Console(width=160).print(table)


def worst_per_layer(rows: Sequence[Check]) -> list[Check]:
    """For each (family, symmetry, layer, expectation): the row with the largest error
    (the smallest for negative controls), annotated with how many elements it covers."""
    groups: dict[tuple, list[Check]] = {}
    for row in rows:
        groups.setdefault((row.family, row.symmetry, row.layer, row.expect), []).append(row)
    out = []
    for members in groups.values():
        if any(m.failed for m in members):
            pick = next(m for m in members if m.failed)
        elif members[0].expect in ("violation", "responds"):  # must be large: the least
            pick = min(members, key=lambda m: m.rel_err)
        else:
            pick = max(members, key=lambda m: m.rel_err)
        if len(members) > 1:
            label = "least" if members[0].expect in ("violation", "responds") else "worst"
            pick = dataclasses.replace(pick, element=f"{label} of {len(members)}: {pick.element}")
        out.append(pick)
    return out


def plot(rows: Sequence[Check], path: Path) -> Path:
    """Relative error per group element, one panel per layer kind of the GSA family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, dict[str, list[Check]]] = {}
    for row in rows:
        if row.family in ("gsa", "checkpoint") and "·" not in row.layer:
            panels.setdefault(row.layer, {}).setdefault(row.symmetry, []).append(row)
    if not panels:
        panels = {"all checks": {"": list(rows)}}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.6 * len(panels)), squeeze=False)
    for ax, (layer, by_group) in zip(axes[:, 0], panels.items(), strict=True):
        labels, values, colours = [], [], []
        for group, members in by_group.items():
            for m in members:
                labels.append(f"{group} {m.element}".strip())
                values.append(max(m.rel_err, 1e-18))
                colours.append("tab:red" if m.failed else
                               "tab:cyan" if m.expect == "violation" else "tab:green")  # fmt: skip
        ax.bar(range(len(values)), values, color=colours)
        ax.set_yscale("log")
        ax.axhline(1e-10, color="grey", lw=0.8, ls="--")
        ax.set_title(layer, fontsize=9)
        ax.set_ylabel("rel. error")
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def verify(cfg: Any) -> list[Check]:
    from symattn_cli.train.runfile import write_results_file

    start = time.perf_counter()
    if cfg.claims and cfg.model is None:
        raise ConfigError(
            f"claims={list(cfg.claims)} judges a whole model; name it with model=<name> "
            "(and --config-dir <dir> for a model config of your own)"
        )
    if cfg.checkpoint:
        trained = load_checkpoint(cfg)
    else:
        trained = load_model(cfg) if cfg.model is not None else None
    rows = collect(cfg, trained)
    elapsed = time.perf_counter() - start
    directory = run_dir()
    render(rows, full=cfg.full_table)
    failures = [r for r in rows if r.failed]
    summary = {
        "checks": len(rows),
        "failures": len(failures),
        "expected_failures": sum(r.verdict == "fails as expected" for r in rows),
        "responds": sum(r.verdict == "responds" for r in rows),
        "blind_controls": sum(r.verdict == "blind as expected" for r in rows),
        "measured_only": sum(r.verdict == "measured" for r in rows),
        "seconds": elapsed,
    }
    path = write_results_file(
        directory / RESULTS_FILE,
        command="verify-equivariance",
        config_yaml=to_yaml(cfg),
        env=environment("cpu"),
        tables={"checks": [r.row() for r in rows]},
        summary=summary,
    )
    figure = plot(rows, directory / "errors.png") if cfg.plot else None
    attention = None
    if cfg.plot and trained is not None and trained.path is not None and trained.images is not None:
        from symattn_cli.verify.attention_maps import ATTENTION_FILE, draw_attention

        title = f"{trained.path.parent.name}: first test image"
        attention = draw_attention(trained.model, trained.images[:1], directory / ATTENTION_FILE,
                                   title=title)  # fmt: skip
    tracker = start_run_tracker(
        cfg, directory, name=f"verify-{directory.name}", job_type="verify-equivariance"
    )
    try:
        tracker.log_table("checks", [r.row() for r in rows])
        if figure is not None:
            tracker.log_image("errors", figure)
        if attention is not None:
            tracker.log_image("attention", attention)
        tracker.summary(summary)
    finally:
        tracker.finish()
    print(
        f"{summary['checks']} checks, {summary['failures']} failed, "
        f"{summary['expected_failures']} negative controls failed as expected, "
        f"{summary['responds']} non-degeneracy checks responded, "
        f"{summary['blind_controls']} blind layers detected as blind, "
        f"{summary['measured_only']} approximate (measured) in {elapsed:.1f} s\n"
        f"results: {path}" + (f"\nattention maps: {attention}" if attention else ""),
        flush=True,
    )
    if failures:
        for row in failures[:20]:
            print(f"FAIL {row.family} {row.symmetry} {row.layer} {row.element}: "
                  f"rel {row.rel_err:.2e} (tolerance {row.tolerance:.0e}, expect {row.expect})",
                  file=sys.stderr)  # fmt: skip
        raise SystemExit(1)
    return rows


main = hydra_entry("verify", verify)
