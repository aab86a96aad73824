"""Config nodes -> a dataset and a model, by Hydra's ``_target_``: one path for the shipped
models and datasets and for a user's.

A data node ``{_target_: D, **options}`` is built as ``D(**options)``; the result is a
:class:`~symattn_cli.data.base.DataBundle` (the shipped datasets) or any object with ``train``,
``val`` and ``test`` splits (torch ``Dataset`` s yielding ``(x, y)``), optionally with
``extra_tests`` (name -> split), ``collate`` and the data's facts as attributes. The facts a
model is sized by (:data:`DATA_FACTS`) come from the built object, else from the data node,
and are written into the data node (:func:`fill_data_facts`) before the model node
``{_target_: M, **options}`` is resolved: model options read them by interpolation
(``num_classes: ${data.num_classes}``), and the model is built as ``M(**options)``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from symattn_cli.configs.targets import (
    TARGET,
    TargetError,
    instantiate,
    keyword_arguments,
    locate,
)
from symattn_cli.data.base import DataBundle, DataSpec
from symattn_cli.errors import ConfigError

# The data's facts, by task: data config key -> DataSpec field.
DATA_FACTS = {
    "classify": {"task": "task", "num_classes": "num_classes", "in_channels": "in_channels",
                 "image_size": "image_size"},
    "tokens": {"task": "task", "num_classes": "num_classes", "vocab_size": "vocab_size",
               "seq_len": "max_len", "pad_index": "pad_index", "tokens": "tokens",
               "answer_order": "answer_order", "causal_answer": "causal_answer"},
}  # fmt: skip
ALL_FACTS = {key: field for facts in DATA_FACTS.values() for key, field in facts.items()}
SPLITS = ("train", "val", "test")

# The shipped model builders by their short names (the ``family:`` of run files written
# before configs named their _target_; the benchmark's labels).
FAMILIES = {
    "cnn": "symattn_cli.models.cnn.build",
    "gcnn": "symattn_cli.models.gcnn.build",
    "gsa": "symattn_cli.models.gsa_net.build",
    "ka": "symattn_cli.models.knowledge.build",
}
LEGACY_DATA = {
    "image": "symattn_cli.data.images.dataset",
    "sequence": "symattn_cli.data.sequences.dataset",
}


def build_data(node: Any) -> DataBundle:
    """The dataset of a data node (resolved or not), as a :class:`DataBundle`."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    plain = dict(plain)
    target = plain.get(TARGET)
    if target is None:
        raise TargetError(
            "the data config has no _target_; add _target_: <package.module.Class> naming the "
            "dataset class (or function) that gives train, val and test splits"
        )
    takes = _parameters(locate(target, "data"))
    passed = {k: v for k, v in plain.items() if k not in ALL_FACTS or takes is None or k in takes}
    built = instantiate(passed, "data")
    if isinstance(built, DataBundle):
        return built
    return _bundle(built, plain, target)


def _parameters(built: Any) -> set[str] | None:
    """The keyword names ``built`` takes; None when it takes any (``**kwargs``) or has no
    signature."""
    try:
        parameters = inspect.signature(built).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def _bundle(built: Any, node: Mapping[str, Any], target: str) -> DataBundle:
    """A user's dataset object -> :class:`DataBundle`, its facts from its attributes or the
    data node."""
    missing = [split for split in SPLITS if getattr(built, split, None) is None]
    if missing:
        raise TargetError(
            f"data._target_={target} built a {type(built).__name__} without the split "
            f"{missing[0]!r}; a dataset gives train, val and test (torch Datasets of (x, y)) "
            "as attributes"
        )

    def fact(key: str, default: Any = None) -> Any:
        value = getattr(built, key, None)
        return node.get(key, default) if value is None else value

    task = fact("task", "classify")
    if task not in DATA_FACTS:
        raise TargetError(
            f"data.task={task!r} ({target}); choose classify (one label per input) or tokens "
            "(one label per position)"
        )
    values = {field: fact(key) for key, field in DATA_FACTS[task].items() if key != "task"}
    if task == "tokens" and values.get("vocab_size") and not values.get("num_classes"):
        values["num_classes"] = values["vocab_size"]
    if not isinstance(values.get("num_classes"), int) or values["num_classes"] < 1:
        key = "num_classes" if task == "classify" else "vocab_size"
        raise TargetError(
            f"data.{key}: {target} states no {key}; give it as an attribute of the dataset "
            f"or as {key}: <count> in the data config"
        )
    values = {k: v for k, v in values.items() if v is not None}
    if "tokens" in values:
        values["tokens"] = tuple(values["tokens"])
    spec = DataSpec(task=task, arch=str(fact("arch", "") or ""), **values)
    collate = getattr(built, "collate", None)
    if collate is None and task == "tokens":
        from symattn_cli.data.sequences import PadCollate

        collate = PadCollate(spec.pad_index)
    extra = dict(getattr(built, "extra_tests", None) or {})
    return DataBundle(train=built.train, val=built.val, test=built.test, spec=spec,
                      collate=collate, extra_tests=extra)  # fmt: skip


def fill_data_facts(data_node: Any, spec: DataSpec) -> None:
    """Write the built data's facts into its config node where it left them empty (None or
    absent); a stated value the data contradicts is a :class:`ConfigError`."""
    from omegaconf import OmegaConf, open_dict

    with open_dict(data_node):
        for key, field in DATA_FACTS.get(spec.task, {}).items():
            value = getattr(spec, field)
            value = list(value) if isinstance(value, tuple) else value
            stated = OmegaConf.select(data_node, key, default=None)
            stated = OmegaConf.to_container(stated) if OmegaConf.is_config(stated) else stated
            if stated is None:
                data_node[key] = value
            elif stated != value:
                raise ConfigError(
                    f"data.{key}={stated!r}, but the dataset gives {value!r}; remove data.{key} "
                    "from the config (it is filled in from the data) or correct it"
                )


def build_model(node: Any) -> Any:
    """The model of a model node whose data facts are filled in, as a ``torch.nn.Module``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError
    from torch import nn

    if OmegaConf.is_config(node):
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except InterpolationResolutionError as err:
            raise ConfigError(_interpolation_message(err)) from None
    target = node.get(TARGET) if isinstance(node, Mapping) else None
    model = instantiate(node, "model")
    if not isinstance(model, nn.Module):
        raise TargetError(
            f"model._target_={target} built a {type(model).__name__}, not a torch.nn.Module; "
            "name a module class, or a function that returns one"
        )
    return model


def _interpolation_message(err: Exception) -> str:
    key = getattr(err, "full_key", "") or "model"
    first = str(err).splitlines()[0]
    return (
        f"{key}: {first}; the data config gives no such value: choose a dataset that states it "
        f"(the data's facts are listed in docs/api.md), or set {key}=<value>"
    )


def build(cfg: Any) -> tuple[DataBundle, Any]:
    """``(data, model)`` of a composed config with ``model`` and ``data`` nodes; the data's
    facts are written into ``cfg.data`` first."""
    data = build_data(cfg.data)
    fill_data_facts(cfg.data, data.spec)
    return data, build_model(cfg.model)


def upgrade_stored(config: Any) -> Any:
    """A run file's config (an OmegaConf node with ``model`` and ``data``) as today's configs
    build it: a model stored with ``family:`` gets that family's ``_target_`` and reads the
    data's facts where it stored 0 (= from the data); a data node without ``_target_`` gets its
    kind's; a GSA-Net stored without ``group_index`` was built with ``relative``, the only
    index there was then; a data root stored as the run's ``data_root`` follows that option."""
    from omegaconf import OmegaConf, open_dict

    model, data = config.get("model"), config.get("data")
    with open_dict(config):
        if OmegaConf.is_config(model) and TARGET not in model and "family" in model:
            model = OmegaConf.to_container(model)
            family = model.pop("family")
            if family in FAMILIES:
                model[TARGET] = FAMILIES[family]
                reads = {"in_channels": "${data.in_channels}",
                         "num_classes": "${data.num_classes}",
                         "vocab_size": "${data.vocab_size}",
                         "max_len": "${data.seq_len}"}  # fmt: skip
                for key, interpolation in reads.items():
                    if model.get(key) == 0:
                        model[key] = interpolation
                if family in ("cnn", "gcnn", "gsa"):
                    model["image_size"] = "${oc.select:data.image_size,0}"
                if family == "gsa":
                    model.setdefault("group_index", "relative")
                    if model.get("arch", "auto") == "auto":
                        model["arch"] = "${oc.select:data.arch,auto}"
                if family == "ka":
                    model.update(pad_index="${data.pad_index}", tokens="${data.tokens}",
                                 answer_order="${data.answer_order}",
                                 causal_answer="${data.causal_answer}")  # fmt: skip
            config.model = model
        if OmegaConf.is_config(data) and TARGET not in data and "name" in data:
            from symattn_cli.data.images import IMAGE_DATASETS

            kind = data.get("kind") or ("image" if data.name in IMAGE_DATASETS else "sequence")
            data[TARGET] = LEGACY_DATA[kind]
            if kind == "image":
                data["root"] = "${data_root}"
        elif OmegaConf.is_config(data) and data.get("root") == config.get("data_root", None):
            data["root"] = "${data_root}"
    return config


# -- composing shipped configs from Python --------------------------------------------------

NATURAL_DATA = ("rotmnist_mini", "arithmetic")  # the default data of either trainer


def compose(
    model: str, data: str | None = None, *, search_path: list[str] = (), **overrides: Any
) -> Any:
    """The ``train`` config of ``model=<model>`` with ``overrides`` merged into its model node,
    on ``data`` (default: the first of :data:`NATURAL_DATA` whose facts the model reads), with
    the data's facts filled in."""
    from hydra.errors import MissingConfigException
    from omegaconf import OmegaConf

    from symattn_cli.configs.compose import compose_train

    errors = []
    for name in [data] if data else NATURAL_DATA:
        try:
            cfg = compose_train([f"model={model}", f"data={name}"], search_path)
        except MissingConfigException as err:
            group = "model" if f"'model/{model}'" in str(err) else "data"
            chosen = model if group == "model" else name
            options = ", ".join(err.options or []) if getattr(err, "options", None) else ""
            raise ConfigError(f"unknown {group} {chosen!r}; choose one of: {options}") from None
        if overrides:
            cfg.model = OmegaConf.merge(cfg.model, overrides)
        if any(cfg.data.get(key, 0) is None for key in ALL_FACTS):
            fill_data_facts(cfg.data, _facts(OmegaConf.to_yaml(cfg.data, resolve=True)))
        try:
            OmegaConf.to_container(cfg.model, resolve=True)
        except Exception as err:  # noqa: BLE001 - the model reads facts this data lacks
            errors.append(err)
            continue
        return cfg
    raise ConfigError(_interpolation_message(errors[-1]))


@functools.lru_cache(maxsize=8)
def _facts(data_yaml: str) -> DataSpec:
    """The facts of a data config (as YAML), by building it once."""
    from omegaconf import OmegaConf

    return build_data(OmegaConf.create(data_yaml)).spec


def family_of(target: str) -> str:
    """The short name of a shipped model builder (``gsa``), else ``custom``."""
    return {built: family for family, built in FAMILIES.items()}.get(target, "custom")


def model_config(name: str, data: str | None = None, **options: Any) -> dict[str, Any]:
    """The resolved model node of ``model=<name>`` (see :func:`compose`: ``options`` are its
    overrides and ``search_path``), ``_target_`` included."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(name, data, **options).model, resolve=True)


def create_model(name: str, data: str | None = None, **overrides: Any) -> Any:
    """``symattn_cli.create_model``: the model of ``model=<name>``, sized by ``data``."""
    return build_model(compose(name, data, **overrides).model)


def model_arguments(node: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a resolved model node passes to its target."""
    return keyword_arguments(node)
