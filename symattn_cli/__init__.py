"""symattn: an experiment runner for symmetry-aware attention.

The package is layered one way (docs/architecture.md): ``groups`` (pure maths) and ``data``
-> ``nn`` (layers) -> ``train`` -> ``configs`` -> ``models`` -> ``verify`` / ``bench`` /
``report`` -> ``commands`` -> ``cli``. Importing the package imports nothing heavy; torch is
loaded by the functions below when they are first called.
"""

from __future__ import annotations

from typing import Any

from symattn_cli.version import __version__

__all__ = ["__version__", "create_model", "get_group", "list_models"]


def create_model(name: str, data: str | None = None, **overrides: Any):
    """Build the model that ``symattn train model=<name> data=<data>`` trains, as a
    ``torch.nn.Module``.

    ``overrides`` replace keys of the model config (``create_model("r8_sa", heads=3)``); the
    data's facts (input channels, classes, vocabulary) come from ``data`` (default:
    ``rotmnist_mini`` for image models, ``arithmetic`` for sequence models) and can be
    overridden the same way (``num_classes=2``).
    """
    from symattn_cli.models.instantiate import create_model as _create_model

    return _create_model(name, data, **overrides)


def list_models() -> list[str]:
    """Names accepted by :func:`create_model` and by ``symattn train model=<name>``."""
    from symattn_cli.configs.paths import list_group_options

    return list_group_options("model")


def get_group(name: str):
    """The group object for a name such as ``"r8"``, ``"z4m"`` or an alias (``"r4"``)."""
    from symattn_cli.groups import get_group as _get_group

    return _get_group(name)
