"""Benchmark presets (lists of cases), the reference figures, and growth-exponent fits.

A preset is a small factory: it returns the cases to measure and its default settings
(repeats, warm-up, threads, isolation). Axes the user sets (``groups``, ``batch_sizes`` ...)
then filter or replace the preset's values in :func:`select_cases`.

Columns describing a case (one row per case): ``label``, ``kind`` (layer | model | authors:
the authors' GSA-Net), ``name`` (layer kind gsa | conv | gconv, or model name: for the
authors' net, the model of ours it stands beside), ``family`` (gsa | conv | gconv | cnn | gcnn),
``group``, ``group_order`` N, ``form`` (lifting | sum | single | group | -), ``patch_size``
P (attention neighbourhood or kernel side; :data:`GLOBAL_P` = 0 for global attention, as the
column is numeric), ``image_size``, ``batch``,
``channels``, ``heads``, ``attention_backend`` (the one asked for; a measured row holds the one
that ran: cpp | triton | triton_tiles | torch | dense, empty without attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from symattn_cli.bench.measure import Case
from symattn_cli.errors import ConfigError
from symattn_cli.groups import group_option
from symattn_cli.options import BACKENDS, DEFAULT_ATTENTION_BACKEND, GLOBAL, QUERY_FORMS

# The GSA-Net issue's figures for the reference implementation: rotMNIST model (5x5, 20
# channels, 9 heads), fp32, forward + backward, 2-core CPU. group -> (seconds, GB peak RSS).
# The fallback: the authors' net measured in the same run (``reference_code``) is preferred,
# as seconds on one host move between days.
REFERENCE_BATCH = 2
REFERENCE = {"z2": (0.4, 0.16), "z4": (3.4, 0.84), "r8": (14.0, 4.31)}
AUTHORS_REPO = "https://github.com/dwromero/g_selfatt"
TARGET_RATIO = 10.0  # ours must be at least this many times cheaper in time and memory

ROTMNIST_SIDES = (24, 12, 8, 6)  # map sides the rotMNIST GSA-Net's attention layers see
GLOBAL_P = 0  # the ``patch_size`` column of a global-attention row (cases: patch_size=None)


def shown(column: str, value: Any) -> Any:
    """A column's value as printed: ``global`` for the patch size of global attention."""
    return GLOBAL if column == "patch_size" and value == GLOBAL_P else value


@dataclass
class Preset:
    name: str
    doc: str
    cases: Callable[[], list[Case]]
    repeats: int = 5
    warmup: int = 2
    threads: int = 0  # 0 = PyTorch's default
    fresh_process: bool = True
    modes: tuple[str, ...] = ("train", "forward")
    extra: dict[str, Any] = field(default_factory=dict)


def gsa_layer(group: str, form: str, patch: int | None = 5, side: int = 12, batch: int = 2) -> Case:
    """A 20-channel, 9-head GSA layer (the rotMNIST width); ``form`` lifting | sum | single;
    ``patch`` None: global attention."""
    lifting = form == "lifting"
    return Case(kind="layer", name="gsa", group=group, lifting=lifting,
                query_form="sum" if lifting else form, patch_size=patch, image_size=side,
                batch=batch)  # fmt: skip


def gsa_model(group: str, batch: int = REFERENCE_BATCH, form: str = "sum", patch: int = 5) -> Case:
    """The rotMNIST GSA-Net (``<group>_sa``) on 28x28 digits."""
    return Case(kind="model", name=f"{group}_sa", group=group, query_form=form,
                patch_size=patch, image_size=28, batch=batch)  # fmt: skip


def model(name: str, batch: int = REFERENCE_BATCH, **overrides: Any) -> Case:
    """Model ``name`` as its config has it, with ``overrides``."""
    return Case(kind="model", name=name, image_size=28, batch=batch, overrides=overrides,
                configured=True)  # fmt: skip


MATCHED_BATCH = 16  # the default trainer's batch


def matched_cases() -> list[Case]:
    """The matched set's training step (forward, backward, Adam): the baselines at 28x28, the
    R4 and R8 GSA-Nets as shipped (input pooled to 14x14) and at 28x28 (input_pool=1)."""
    cases = [model("gcnn_mini", MATCHED_BATCH), model("cnn_mini", MATCHED_BATCH)]
    for name in ("r4_mini", "r8_mini"):
        cases += [
            model(name, MATCHED_BATCH, input_pool=2),
            model(name, MATCHED_BATCH, input_pool=1),
        ]
    return cases


def overview_cases() -> list[Case]:
    """What a newcomer asks first: the default model's training step, one GSA layer per form
    at the size of its first map (14x14, P=3, batch 16), and the R4 net at full resolution
    beside the P4CNN."""
    layers = [replace(gsa_layer("r4", form, patch=3, side=14, batch=MATCHED_BATCH),
                      channels=16, heads=4) for form in ("lifting", "sum", "single")]  # fmt: skip
    return [model("gsa_mini", MATCHED_BATCH), *layers, model("gcnn_mini", MATCHED_BATCH),
            model("r4_mini", MATCHED_BATCH, input_pool=1)]  # fmt: skip


def reference_cases() -> list[Case]:
    return [gsa_model(g) for g in ("z2", "r4", "r8")]


def quick_cases() -> list[Case]:
    return [
        gsa_layer("z2", "sum", patch=3, side=6, batch=1),
        gsa_layer("r4", "sum", patch=3, side=6, batch=1),
        gsa_layer("r4", "single", patch=3, side=6, batch=1),
        gsa_layer("r4", "sum", patch=5, side=6, batch=1),
        gsa_layer("r4", "sum", patch=3, side=8, batch=1),
        gsa_layer("r4", "lifting", patch=3, side=6, batch=1),
        gsa_layer("r4", "sum", patch=None, side=4, batch=1),
        replace(
            gsa_layer("r4", "sum", patch=3, side=6, batch=1),
            attention_backend="dense",
            group_index="relative",
        ),
        replace(gsa_layer("r4", "sum", patch=3, side=6, batch=1), group_index="relative"),
        Case(kind="layer", name="conv", patch_size=3, image_size=6, batch=1),
        Case(kind="layer", name="gconv", group="r4", patch_size=3, image_size=6, batch=1),
        model("cnn", batch=1, channels=[4, 8]),
    ]


def index_cases() -> list[Case]:
    """The group term's index: sum-form layers with each exact index (not ``shifted``, the
    negative control) and the single form, per group, at the rotMNIST width on a 12x12 map
    (the ratios over ``relative`` come with them)."""
    cases = []
    for group in ("r4", "r8", "r8m"):
        for index in ("relative", "gevit", "pair"):
            cases.append(replace(gsa_layer(group, "sum"), group_index=index))
        cases.append(gsa_layer(group, "single"))
    return cases


def default_cases() -> list[Case]:
    cases = []
    for group in ("z2", "r4", "r8", "r12", "r16"):  # time and memory vs group order
        forms = ("lifting", "sum") if group == "z2" else ("lifting", "sum", "single")
        cases += [gsa_layer(group, form) for form in forms]
    for patch in (3, 7, 9, None):  # vs neighbourhood (None = global, on the 12x12 map)
        cases += [gsa_layer("r8", form, patch=patch) for form in QUERY_FORMS]
    for side in (6, 8, 24):  # vs image side (the rotMNIST net's maps: 24, 12, 8, 6)
        cases += [gsa_layer("r8", form, side=side) for form in QUERY_FORMS]
    cases += [gsa_layer("r8", "sum", batch=b) for b in (1, 8)]  # vs batch
    for group in ("r4", "r8"):  # the reference's algorithm (full N^3 P^2 logits), same sizes
        naive = replace(gsa_layer(group, "sum"), attention_backend="dense", group_index="relative")
        cases.append(naive)
    for group in ("r4", "r8", "r8m"):  # the group term's index: its cost per form
        for index in ("pair", "gevit", "relative"):
            cases.append(replace(gsa_layer(group, "sum"), group_index=index))
    for k in (3, 5):  # the convolutions a GSA layer replaces
        cases.append(Case(kind="layer", name="conv", patch_size=k, image_size=12))
        cases.append(Case(kind="layer", name="gconv", group="r4", patch_size=k, image_size=12))
    cases.append(Case(kind="layer", name="gconv", group="r4", lifting=True, patch_size=3,
                      image_size=12))  # fmt: skip
    cases += [gsa_model(g) for g in ("z2", "r4", "r8")]  # whole networks, batch 2
    cases += [gsa_model("r8", form="single"), gsa_model("z2", batch=8)]
    cases += [model("cnn"), model("gcnn")]
    # the default run's net (R4, 3x3, batch 16): its training step is what a first run waits for
    cases.append(replace(model("gsa_mini", batch=16), group="r4", patch_size=3))
    return list({case.key(): case for case in cases}.values())  # each case once


def global_cases() -> list[Case]:
    """Global r8 layers on a whole 28x28 digit, batch 1: every pixel attends to every pixel."""
    return [
        gsa_layer("r8", form, patch=None, side=28, batch=1) for form in ("lifting", "sum", "single")
    ]


GPU_BATCHES = (8, 32, 128)  # the paper's rotMNIST batch (8), and larger ones a GPU fills


def gpu_cases() -> list[Case]:
    """Train-step throughput and memory of the rotMNIST r8 net (both group-layer forms) on a
    GPU, beside the z2 net and the plain CNN at the same batches."""
    cases = []
    for batch in GPU_BATCHES:
        cases += [gsa_model("r8", batch=batch), gsa_model("r8", batch=batch, form="single")]
        cases += [gsa_model("z2", batch=batch), model("cnn", batch=batch)]
    return cases


def gpu_static_cases() -> list[Case]:
    """The rotMNIST r8 net at the paper's batch: both forms, and the sum form with a group
    index that sees v (the kernel's v-dependent group term)."""
    r8 = gsa_model("r8", batch=8)
    return [r8, gsa_model("r8", batch=8, form="single"), replace(r8, group_index="pair")]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("reference", "GSA-Net issue figures: z2/r4/r8 rotMNIST nets, batch 2, vs the "
               "reference implementation", reference_cases, repeats=3, warmup=1, threads=2,
               modes=("train",)),
        Preset("global", "global r8 layers (lifting, sum, single) on 28x28 maps, batch 1",
               global_cases, repeats=2, warmup=1),
        Preset("default", "a minute: the default model's training step, a lifting and both "
               "group-layer forms at its first map, r4_mini at 28x28 over gcnn_mini",
               overview_cases, repeats=3, warmup=1, fresh_process=False, modes=("step",)),
        Preset("sweep", "layers per group, P in {3,5,7,9,global}, both group-layer forms, "
               "image and batch sizes, conv / group conv / z2 SA baselines, whole networks",
               default_cases, repeats=3, warmup=1),
        Preset("index", "sum-form r4/r8/r8m layers with each exact group index (relative, "
               "gevit, pair; not shifted) and the single form, side by side", index_cases,
               repeats=5, warmup=2),
        Preset("gpu", "rotMNIST r8 net (both forms), z2 net and CNN at batches 8, 32, 128: "
               "train-step throughput and memory, for device=cuda", gpu_cases, repeats=10,
               warmup=3),
        Preset("gpu-static", "the Triton kernels compiled for a GPU (arch=90) at the r8 net's "
               "sizes, batch 8: registers, occupancy, instructions, bounds; no GPU needed",
               gpu_static_cases, repeats=1, warmup=0),
        Preset("matched", "the matched set's training step (forward, backward, Adam) at batch "
               "16 on one thread: cnn_mini and gcnn_mini at 28x28, r4_mini and r8_mini at 14x14 "
               "(as shipped) and 28x28 (input_pool=1), each over gcnn_mini, with its parts",
               matched_cases, repeats=5, warmup=2, threads=1, modes=("step",)),
        Preset("quick", "seconds: tiny layers and a tiny CNN (tests)", quick_cases,
               repeats=3, warmup=1, threads=1, fresh_process=False),
    )
}  # fmt: skip


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"preset={name!r} is unknown; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


# ---------------------------------------------------------------- case resolution


def resolve(case: Case) -> tuple[Case, dict[str, Any]]:
    """The case with its model options made explicit, and the columns that describe it."""
    from symattn_cli.groups import get_group

    label = case.label
    if case.kind == "authors":  # their rotMNIST GSA-Net: 20 channels, 9 heads
        info = dict(family="gsa", form=case.form, patch_size=case.patch_size, channels=20,
                    heads=9)  # fmt: skip
    elif case.kind == "model":
        from symattn_cli.configs.compose import user_search_path
        from symattn_cli.models.instantiate import family_of, model_config

        search_path = user_search_path()
        try:
            config = model_config(case.name, search_path=search_path, **case.overrides)
        except Exception as err:  # unknown model name or a bad override
            raise ConfigError(f"model {case.name!r}: {err}".splitlines()[0]) from None
        family = family_of(config["_target_"])
        overrides = dict(case.overrides)
        if family == "gsa" and case.configured:
            if case.attention_backend != DEFAULT_ATTENTION_BACKEND:
                overrides.update(attention_backend=case.attention_backend)
            group, form, patch = config["group"], config["query_form"], config["patch_size"]
            patch = None if patch == GLOBAL else patch
            channels, heads = config["channels"] or 20, config["heads"] or 9
        elif family == "gsa":
            option = GLOBAL if case.patch_size is None else case.patch_size
            overrides.update(group=case.group, query_form=case.query_form, patch_size=option,
                             group_index=case.group_index)  # fmt: skip
            if case.attention_backend != DEFAULT_ATTENTION_BACKEND:
                overrides.update(attention_backend=case.attention_backend)
            group, form, patch = case.group, case.query_form, case.patch_size
            channels, heads = config["channels"] or 20, config["heads"] or 9
        elif family in ("cnn", "gcnn"):
            group, form, patch = config.get("group", "z2"), "-", config.get("kernel_size", 0)
            channels, heads = max(config.get("channels") or [0]), 0
        else:  # a user's model: what its config says, where it says it
            group = config.get("group") if isinstance(config.get("group"), str) else "z2"
            form, patch, heads = "-", 0, config.get("heads", 0)
            width = config.get("channels", 0)
            channels = max(width) if isinstance(width, list) and width else width or 0
            family = config["_target_"]
        case = replace(case, group=group, overrides=overrides, search_path=search_path)
        info = dict(family=family, form=form, patch_size=patch, channels=channels, heads=heads)
    else:
        heads = case.heads if case.name == "gsa" else 0
        info = dict(family=case.name, form=case.form, patch_size=case.patch_size,
                    channels=case.channels, heads=heads)  # fmt: skip
    if info["patch_size"] is None:
        info["patch_size"] = GLOBAL_P
    group = get_group(group_option(case.group))
    info = dict(label=label, kind=case.kind, name=case.name, group=group.name,
                group_order=group.order, image_size=case.image_size, batch=case.batch,
                attention_backend=case.attention_backend if case.attends else "",
                group_index=case.group_index if case.attends else "",
                **info)  # fmt: skip
    return case, info


def check_names(models: Sequence[str] = (), layers: Sequence[str] = ()) -> None:
    """Unknown model or layer names are config errors that list the valid ones."""
    from symattn_cli.bench.measure import LAYERS

    bad_layers = [name for name in layers if name not in LAYERS]
    if bad_layers:
        raise ConfigError(f"layers={list(layers)}: {bad_layers} unknown; use any of {LAYERS}")
    for name in models:  # a shipped config or one on the command line's --config-dir
        from symattn_cli.models.instantiate import compose

        try:
            compose(name)
        except ConfigError as err:
            raise ConfigError(f"models={list(models)}: {err}") from None


def select_cases(
    cases: Iterable[Case],
    *,
    groups: Sequence[str] = (),
    models: Sequence[str] = (),
    layers: Sequence[str] = (),
    batch_sizes: Sequence[int] = (),
    image_sizes: Sequence[int] = (),
    patch_sizes: Sequence[int | str] = (),
    attention_backends: Sequence[str] = (),
) -> list[Case]:
    """Filter by ``groups``/``models``/``layers``; set every case's batch, image and patch
    sizes (a side P, or ``global``), and every attention case's backend, to each value given
    (a product); drop duplicates, keep the order."""
    from symattn_cli.models.gsa_net import patch_size_option

    check_names(models, layers)
    bad = [name for name in attention_backends if name not in BACKENDS]
    if bad:
        raise ConfigError(
            f"attention_backends={list(attention_backends)}: {bad} unknown; use any of "
            f"{list(BACKENDS)}"
        )
    for option, values in (("batch_sizes", batch_sizes), ("image_sizes", image_sizes)):
        small = [x for x in values if int(x) < 1]
        if small:
            raise ConfigError(f"{option}={list(values)}: {small} below 1; give sizes of at least 1")
    patches = [patch_size_option(p, "patch_sizes") for p in patch_sizes]
    wanted_groups = {group_option(g) for g in groups}
    cases = list(cases)
    batch = next((c.batch for c in cases if c.kind == "model"), 2)
    present = {c.name for c in cases if c.kind == "model"}
    cases += [
        Case(kind="model", name=name, image_size=28, batch=batch, configured=True)
        for name in models
        if name not in present
    ]  # named, not in the preset: as is
    out: list[Case] = []
    for case in cases:
        if wanted_groups and group_option(case.group) not in wanted_groups:
            continue
        if case.kind == "model" and models and case.name not in models:
            continue
        if case.kind == "layer" and layers and case.name not in layers:
            continue
        if (case.kind == "model" and layers and not models) or (
            case.kind == "layer" and models and not layers
        ):
            continue
        variants = [case]
        for attr, values in (("batch", [int(x) for x in batch_sizes]),
                             ("image_size", [int(x) for x in image_sizes]),
                             ("patch_size", patches)):  # fmt: skip
            if values:
                variants = [replace(v, **{attr: x}) for v in variants for x in values]
        if attention_backends and case.attends:
            variants = [replace(v, attention_backend=b)
                        for v in variants for b in attention_backends]  # fmt: skip
        out += variants
    unique = {c.key(): c for c in reversed(out)}
    keys = list(dict.fromkeys(c.key() for c in out))
    return [unique[k] for k in keys]


def step_ratios(rows: Sequence[dict[str, Any]], baseline: str) -> dict[str, float]:
    """Each case's training step over ``baseline``'s (the row of that model as configured):
    ``<label>_step_ratio``."""
    base = next((r for r in rows if r.get("name") == baseline and r.get("status") == "ok"
                 and "step_time_s" in r and "=" not in r["label"]), None)  # fmt: skip
    if base is None:
        return {}
    return {f"{r['label']}_step_ratio": r["step_time_s"] / base["step_time_s"]
            for r in rows if r.get("status") == "ok" and "step_time_s" in r}  # fmt: skip


def naive_comparison(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Time and memory of the reference's algorithm (``sum-naive`` layers) over ours (``sum``)
    at the same sizes, measured in the same run: ``<group>_naive_{time,mem}_ratio``."""
    return _ratios(rows, lambda r: r["form"] == "sum-naive", "naive",
                   ("form", "attention_backend"))  # fmt: skip


def index_comparison(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Time and memory of a sum-form layer with a v-dependent exact group index (``pair``,
    ``gevit``; not ``shifted``) over the same layer with ``relative``, measured in the same run:
    ``<group>_<index>_{train,forward}_{time,mem}_ratio``."""
    return _ratios(rows, lambda r: r["form"] == "sum" and r.get("group_index") in ("pair", "gevit"),
                   None, ("group_index",))  # fmt: skip


def _ratios(rows, pick, name: str | None, free: tuple[str, ...]) -> dict[str, float]:
    """Ratios of the rows ``pick`` selects over the ``sum``-form, ``relative``-index row that
    matches them in every series key but ``free`` (the attention backend: the one auto picks).
    Keys ``<group>_<name or the row's index>_<mode>_<time|mem>_ratio``."""
    keys = [k for k in SERIES_KEYS if k not in free]
    ours = {
        tuple(r.get(k) for k in keys): r
        for r in rows
        if r.get("status") == "ok" and r["form"] == "sum"
        and r.get("group_index") in (None, "relative")
        and r.get("attention_backend") != "dense"
    }  # fmt: skip
    out = {}
    for row in rows:
        match = ours.get(tuple(row.get(k) for k in keys))
        if row.get("status") != "ok" or not pick(row) or match is None:
            continue
        label = name or row["group_index"]
        for mode in ("train", "forward"):
            for quantity, column in (("time", f"{mode}_time_s"), ("mem", f"{mode}_mem_mb")):
                if column in row and column in match:
                    ratio = row[column] / max(match[column], 1e-12)
                    out[f"{row['group']}_{label}_{mode}_{quantity}_ratio"] = ratio
    return out


def compared(info: dict[str, Any]) -> bool:
    """Whether a case is one the reference is compared on: a rotMNIST GSA-Net (ours) at the
    issue's sizes (batch 2, 28x28, P=5, ``sum`` form)."""
    return (
        info["kind"] == "model"
        and info["family"] == "gsa"
        and info["batch"] == REFERENCE_BATCH
        and info["patch_size"] == 5
        and info["form"] == "sum"
        and info["image_size"] == 28
    )


def reference_comparison(
    info: dict[str, Any], row: dict[str, Any], measured: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ratios reference / ours (train mode) for a :func:`compared` case: over ``measured``,
    the row of the authors' net measured in the same run, where given (``ref_source``
    ``measured``), else over the issue's figures (``published``; z2, z4 and r8 only)."""
    if not compared(info) or "train_time_s" not in row:
        return {}
    if measured is not None:
        ref_time, ref_gb = measured["train_time_s"], measured["train_mem_mb"] / 1e3
        source = "measured"
    elif info["group"] in REFERENCE:
        (ref_time, ref_gb), source = REFERENCE[info["group"]], "published"
    else:
        return {}
    time_ratio = ref_time / row["train_time_s"]
    mem_ratio = ref_gb / max(row["train_mem_mb"] / 1e3, 1e-9)
    return {
        "ref_time_s": ref_time,
        "ref_mem_gb": ref_gb,
        "ref_source": source,
        "time_ratio": time_ratio,
        "mem_ratio": mem_ratio,
        "meets_target": float(time_ratio >= TARGET_RATIO and mem_ratio >= TARGET_RATIO),
    }


def check_reference_code(path: str) -> str:
    """The absolute path of ``path``, a checkout of the authors' code that can run here;
    :class:`ConfigError` naming the fix otherwise."""
    import importlib.util
    from pathlib import Path

    code = Path(path).expanduser().resolve()
    clone = f"clone it with `git clone {AUTHORS_REPO}` and give the clone's path"
    if not code.is_dir():
        raise ConfigError(f"reference_code={path!r}: no such folder; {clone}")
    if not ((code / "g_selfatt").is_dir() and (code / "models").is_dir()):
        raise ConfigError(
            f"reference_code={path!r} is not a checkout of the authors' code (no g_selfatt/ and "
            f"models/ folders); {clone}"
        )
    if importlib.util.find_spec("einops") is None:
        raise ConfigError(f"reference_code={path!r}: the authors' code needs einops: "
                          "pip install einops")  # fmt: skip
    return str(code)


def with_authors(
    resolved: Sequence[tuple[Case, dict[str, Any]]], code: str
) -> list[tuple[Case, dict[str, Any]]]:
    """``resolved`` (cases and their columns) with the authors' net, from their checkout
    ``code``, right after the first :func:`compared` net of each group: measured next to
    ours, under the same load."""
    out, groups = [], set()
    for case, info in resolved:
        out.append((case, info))
        if compared(info) and info["group"] not in groups:
            groups.add(info["group"])
            authors = Case(kind="authors", name=case.name, group=case.group,
                           patch_size=case.patch_size, image_size=case.image_size,
                           batch=case.batch, overrides={"code": code})  # fmt: skip
            out.append(resolve(authors))
    if not groups:
        raise ConfigError(
            "reference_code is set, but no case is a rotMNIST GSA-Net at batch 2, 28x28, P=5, "
            "sum form to compare with the authors' one; use preset=reference"
        )
    return out


# ---------------------------------------------------------------- growth exponents

# axis -> the column that varies; series hold every other describing column fixed.
AXES = {"N": "group_order", "P": "patch_size", "side": "image_size", "batch": "batch"}
SERIES_KEYS = ("kind", "family", "form", "group_order", "patch_size", "image_size", "batch",
               "channels", "heads", "attention_backend", "group_index")  # fmt: skip


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of ``log y = log a + k log x``: returns ``(k, a, r2)``."""
    import numpy as np

    x = np.log(np.asarray(xs, dtype=float))
    y = np.log(np.asarray(ys, dtype=float))
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a power-law fit needs at least two distinct x values")
    k, log_a = np.polyfit(x, y, 1)
    residual = y - (k * x + log_a)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual**2).sum() / total if total > 0 else 1.0
    return float(k), float(math.exp(log_a)), float(r2)


def growth_exponents(
    rows: Sequence[dict[str, Any]],
    quantities: Sequence[str] = ("train_time_s", "forward_time_s", "train_mem_mb"),
    *,
    min_points: int = 2,
) -> list[dict[str, Any]]:
    """Fit ``quantity ~ x^k`` along each axis of :data:`AXES`, per series of rows (layers or
    models) that differ only in that axis (global attention is left out of the P fits)."""
    fits = []
    for axis, column in AXES.items():
        keys = [k for k in SERIES_KEYS if k != column]
        series: dict[tuple, list[dict[str, Any]]] = {}
        for row in rows:
            if row.get("status") != "ok":
                continue
            if axis == "P" and row["patch_size"] == GLOBAL_P:
                continue
            series.setdefault(tuple(row.get(k) for k in keys), []).append(row)
        for members in series.values():
            xs_all = sorted({m[column] for m in members})
            if len(xs_all) < min_points:
                continue
            first = members[0]
            name = f"{first['kind']} {first['family']} {first['form']}"
            if first.get("group_index") and first["form"] == "sum":
                name += f" {first['group_index']}"
            fixed = ", ".join(f"{k}={shown(k, first[k])}" for k in ("group_order", "patch_size",
                              "image_size", "batch") if k != column)  # fmt: skip
            for quantity in quantities:
                points = [(m[column], m.get(quantity)) for m in members]
                points = [(x, y) for x, y in points if y is not None and y > 0 and x > 0]
                if len({x for x, _ in points}) < min_points:
                    continue
                k, a, r2 = fit_power_law(*zip(*points, strict=True))
                fits.append(
                    dict(quantity=quantity, axis=axis, series=name, fixed=fixed,
                         points=len(points), x_min=min(x for x, _ in points),
                         x_max=max(x for x, _ in points), exponent=k, prefactor=a, r2=r2)
                )  # fmt: skip
    return fits
