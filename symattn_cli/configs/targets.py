"""Hydra's ``_target_`` convention: a config node names the callable that builds it.

A node ``{_target_: pkg.module.Name, a: 1, b: 2}`` is built as ``pkg.module.Name(a=1, b=2)``,
as :func:`hydra.utils.instantiate` does (nested nodes with their own ``_target_`` are built
first). This module adds what a runner needs around it:

- one-line errors (:class:`TargetError`, exit status 2) for a target that cannot be imported,
  is not callable, or is called with an unknown or missing keyword argument, each naming the
  target, the key and the fix;
- the rule that a file does not choose code (:func:`check_trusted`): a ``_target_`` read
  from a run file is imported only if the shipped configs or the current command line name
  the same target.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from symattn_cli.errors import ConfigError, UserError

TARGET = "_target_"
# Hydra's own instantiate keys: options of the call, never keyword arguments of the target.
HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_", "_args_"})


class TargetError(ConfigError):
    """A ``_target_`` that cannot be built as configured, or that a file may not choose."""


def targets_in(node: Any) -> set[str]:
    """Every ``_target_`` string in a (plain or OmegaConf) config tree; nothing is resolved."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=False)
    found: set[str] = set()
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == TARGET and isinstance(value, str):
                found.add(value)
            else:
                found |= targets_in(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            found |= targets_in(value)
    return found


@functools.cache
def shipped_targets() -> frozenset[str]:
    """The targets the shipped ``model`` and ``data`` configs build: the project's own code."""
    import yaml

    from symattn_cli.configs import SCHEMA_MODULES
    from symattn_cli.configs.paths import conf_dir

    found: set[str] = set()
    for group in ("model", "data"):
        for path in sorted((conf_dir() / group).glob("*.yaml")):
            found |= targets_in(yaml.safe_load(path.read_text()) or {})
    for module_name in SCHEMA_MODULES:
        module = importlib.import_module(f"symattn_cli.configs.{module_name}")
        for _, _, node in module.SCHEMAS:
            default = getattr(node, TARGET, None)
            if isinstance(default, str):
                found.add(default)
    return frozenset(found)


def check_trusted(stored: Any, given: Iterable[str], source: Path | str, option: str) -> None:
    """Refuse a config read from ``source`` (a run file) whose ``_target_`` neither the shipped
    configs nor the current command line (``given``: the targets of its composed config)
    name: a file must not choose which code runs."""
    trusted = shipped_targets() | set(given)
    foreign = sorted(targets_in(stored) - trusted)
    if foreign:
        raise TargetError(
            f"{option}={source}: its config builds {', '.join(foreign)}, which neither the "
            "shipped configs nor this command line name, and a run file may not choose the "
            "code that runs; give the same model and data configs again on the command line "
            "(e.g. --config-dir <your conf> model=<name> data=<name>) if you trust that code"
        )


def locate(target: Any, where: str) -> Any:
    """The callable named by ``target`` (``pkg.module.Name``, also ``pkg.module.Class.method``),
    imported; ``where`` names the config node in errors (``model``)."""
    if not isinstance(target, str) or not target.strip() or target.startswith("."):
        raise TargetError(
            f"{where}._target_={target!r} is not a dotted path; write the importable name of "
            "a class or function, e.g. _target_: mypkg.models.TinyNet"
        )
    if os.getcwd() not in sys.path:  # a user's package in the launch directory
        sys.path.append(os.getcwd())
    parts = target.split(".")
    module, attribute = None, len(parts)
    for attribute in range(len(parts), 0, -1):
        name = ".".join(parts[:attribute])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                raise _import_error(target, where, err) from None
        except Exception as err:  # noqa: BLE001 - a user's module failing as it is imported
            raise _import_error(target, where, err) from None
    if module is None:
        raise TargetError(
            f"{where}._target_={target}: no module {parts[0]!r} can be imported; install "
            "the package that holds it (pip install -e <its folder>), or run symattn from the "
            "folder that contains it (the working directory is on the import path)"
        )
    found: Any = module
    for index in range(attribute, len(parts)):
        if not hasattr(found, parts[index]):
            held = ".".join(parts[:index])
            raise TargetError(
                f"{where}._target_={target}: {held} has no attribute {parts[index]!r}; check "
                f"the spelling against what {held} defines"
            )
        found = getattr(found, parts[index])
    if not callable(found):
        raise TargetError(
            f"{where}._target_={target} is a {type(found).__name__}, not a class or function; "
            "name the class or function that builds the object"
        )
    return found


def _import_error(target: str, where: str, err: BaseException) -> TargetError:
    return TargetError(
        f"{where}._target_={target}: importing it raised {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}; fix the module, or name another target"
    )


def check_arguments(built: Any, arguments: Mapping[str, Any], target: str, where: str) -> None:
    """Raise :class:`TargetError` naming the key when ``built`` cannot take ``arguments``."""
    try:
        signature = inspect.signature(built)
    except (TypeError, ValueError):  # some builtins have none: let the call decide
        return
    parameters = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        known = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(arguments) - known)
        if unknown:
            raise TargetError(
                f"{where}.{unknown[0]}: {target} takes no argument {unknown[0]!r}; remove it "
                f"from the {where} config, or use one of: {', '.join(sorted(known)) or 'none'}"
            )
    missing = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in arguments
    ]
    if missing:
        raise TargetError(
            f"{where}.{missing[0]}: {target} needs the argument {missing[0]!r}; add "
            f"{missing[0]}: <value> to the {where} config (or {where}.{missing[0]}=<value> on "
            "the command line)"
        )


def keyword_arguments(node: Any) -> dict[str, Any]:
    """A target node's keyword arguments: its keys but Hydra's own (``_target_``, ...)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return {k: v for k, v in dict(plain).items() if k not in HYDRA_KEYS}


def instantiate(node: Any, where: str, **extra: Any) -> Any:
    """Build ``node`` by its ``_target_`` (Hydra's instantiate, nested targets included), with
    ``extra`` keyword arguments added; every target is imported and checked first, so a wrong
    one is a :class:`TargetError` naming it."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate
    from omegaconf import OmegaConf

    target = node.get(TARGET) if hasattr(node, "get") else None
    if target is None:
        raise TargetError(
            f"the {where} config has no _target_; add _target_: <package.module.Class> "
            "naming the class or function that builds it"
        )
    for nested in sorted(targets_in(node)):
        locate(nested, where)
    built = locate(target, where)
    arguments = {**keyword_arguments(node), **extra}
    check_arguments(built, arguments, target, where)
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    try:
        return hydra_instantiate(OmegaConf.create(dict(plain)), _convert_="all", **extra)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, (ValueError, TypeError, RuntimeError)):
            raise TargetError(f"{where}: {target}: {cause}") from None
        raise
