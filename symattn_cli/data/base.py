"""What every dataset hands the trainer: three splits and a :class:`DataSpec`.

Image datasets yield ``(x, y)`` with ``x`` float32 ``(C, H, W)`` and ``y`` an int class.
Sequence tasks yield ``(tokens, targets)``, both int64 ``(n,)``; ``targets`` holds
:data:`IGNORE_INDEX` where no answer is read, and :func:`pad_collate` pads a batch to its
longest sequence with ``spec.pad_index``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from symattn_cli.errors import UserError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DataSpec:
    """Sizes a model needs from its data; builders take these as keyword arguments."""

    task: str  # "classify" (one label per input) | "tokens" (one label per position)
    num_classes: int  # classes, or output vocabulary for token tasks
    in_channels: int = 0
    image_size: int = 0
    vocab_size: int = 0
    max_len: int = 0  # longest sequence in any split (position encodings must cover it)
    pad_index: int = 0
    arch: str = ""  # architecture preset the data suggests: rotmnist | cifar10 | pcam | sequence
    tokens: tuple[str, ...] = ()  # token strings, index = id (sequence tasks)
    # order of the answer digits at the slots: lsd (least significant first, also sort and
    # reverse) | msd; coupled positions index answer digits by it
    answer_order: str = "lsd"
    # answer positions after the first hold the previous answer token (teacher forcing): a
    # model must read them causally and decode greedily when evaluating
    causal_answer: bool = False


class DataError(UserError):
    """A dataset cannot be provided (files missing offline, bad file, bad option).

    The message is meant for people: it names the files expected, where to put them and the
    fix. The CLI prints it on one line and exits non-zero, without a traceback.
    """


@dataclass
class DataBundle:
    train: Any
    val: Any
    test: Any
    spec: DataSpec
    collate: Callable | None = None
    # Extra evaluation splits, e.g. {"test_long": ...} for length generalisation.
    extra_tests: dict[str, Any] = field(default_factory=dict)
