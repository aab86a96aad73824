"""Compose configs from Python with the same search path and schemas as the CLI."""

from __future__ import annotations

from symattn_cli.configs.paths import list_group_options


def compose_group(group: str, name: str):
    """The composed config node of ``<group>=<name>`` (e.g. ``model=r8_sa``).

    Unknown names raise ``ValueError`` listing the valid ones.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from symattn_cli.configs import register_configs

    options = list_group_options(group)
    if name not in options:
        raise ValueError(f"unknown {group} {name!r}; choose one of: {', '.join(options)}")
    register_configs()
    overrides = [f"{group}={name}"]
    if GlobalHydra.instance().is_initialized():  # inside a running Hydra app
        return compose(config_name="train", overrides=overrides)[group]
    with initialize_config_module(config_module="symattn_cli.conf", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)[group]


def compose_train(overrides: list[str], search_path: list[str] = ()):
    """The ``train`` config composed with ``overrides``: in a running Hydra app with its search
    path (a user's ``--config-dir`` included), else from the shipped configs and the config
    folders of ``search_path`` (``file://<dir>``, as :func:`user_search_path` gives them)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from symattn_cli.configs import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="train", overrides=overrides)
    if search_path:
        overrides = [*overrides, f"hydra.searchpath=[{','.join(search_path)}]"]
    with initialize_config_module(config_module="symattn_cli.conf", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def user_search_path() -> list[str]:
    """The config folders a running Hydra app reads besides the shipped ones (``--config-dir``,
    ``hydra.searchpath``), as ``file://<dir>``; empty outside an app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    sources = HydraConfig.get().runtime.config_sources
    return [f"{s.schema}://{s.path}" for s in sources if s.schema == "file"]
