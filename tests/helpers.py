"""Helpers shared by the tests: run the real ``symattn`` command in a scratch directory, and
take a module's values and gradients."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A tiny but real training job: 200 rotated digits, a two-stage CNN, W&B off.
TINY_TRAIN = [
    "data.num_train=160",
    "data.num_val=64",
    "data.num_test=64",
    "model=cnn",
    "model.channels=[4,8]",
    "trainer.batch_size=16",
    "trainer.eval_batch_size=64",
    "trainer.progress=plain",
    "logger.mode=disabled",
]


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, restored after (also on
    failure)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def values_and_gradients(module, x, seed: int = 1, **kwargs) -> list:
    """``[output, *gradients]`` of a random weighted sum of ``module(x)``: the input's gradient
    (when ``x`` is floating point), then the parameters' that are not None. ``seed`` fixes the
    dropout masks, so that two calls compare the same computation. The weights are drawn on
    the host (their generator's device) and moved to the output's: the call may run under
    another default device. ``kwargs`` go to the module's call."""
    import torch

    torch.manual_seed(seed)
    inputs = x.clone().requires_grad_() if x.is_floating_point() else x
    out = module(inputs, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(out.shape, generator=gen, dtype=out.dtype, device="cpu").to(out.device)
    leaves = ([inputs] if inputs.requires_grad else []) + list(module.parameters())
    grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
    return [out.detach(), *(g for g in grads if g is not None)]


class CodePayload:
    """What a crafted pickle holds: unpickling it runs code, here writing ``marker``. A test
    that feeds one to symattn checks that ``marker`` never appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the payload ran')",)


def symattn_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("WANDB_") or k == "HYDRA_FULL_ERROR"]:
        env.pop(key)
    env["WANDB_SILENT"] = "true"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_symattn(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m symattn_cli <args>`` in ``cwd``; returns the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "symattn_cli", *args],
        cwd=cwd,
        env=symattn_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def call_symattn(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``symattn <args>`` run by the dispatcher's :func:`~symattn_cli.cli.main` in this process,
    in ``cwd`` and the environment :func:`symattn_env` gives the program: its exit status and
    what it wrote to ``sys.stdout`` and ``sys.stderr``, as :func:`run_symattn` returns them,
    without the seconds a new interpreter takes to import torch. Python's warnings print to
    its stderr as in a fresh process. What a command sets for its process (the working
    directory, the environment, ``sys.argv``, logging, warning filters, signal handlers,
    torch's threads, deterministic mode and random generators) is put back after it."""
    import io
    import logging
    import random
    import signal
    import warnings

    import numpy as np
    import torch

    from symattn_cli.cli import main

    def print_warning(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    known = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(v for v in known if isinstance(v, logging.Logger))]
    kept = {id(lg): (lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers}
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    here, environ, argv = Path.cwd(), dict(os.environ), sys.argv[:]
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    generators = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    out, err, env = io.StringIO(), io.StringIO(), symattn_env()
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):  # fmt: skip
            warnings.resetwarnings()  # a fresh interpreter's filters and printer
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                             ResourceWarning):  # fmt: skip
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = print_warning
            code = main(list(args))
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = argv
        for lg in loggers:  # Hydra configures logging for each job
            handlers, level, propagate, disabled = kept[id(lg)]
            for handler in lg.handlers:
                if handler not in handlers:
                    handler.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        for number, handler in signals.items():
            signal.signal(number, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_rng_state(generators[0])
        np.random.set_state(generators[1])
        random.setstate(generators[2])
    return subprocess.CompletedProcess(["symattn", *args], code, out.getvalue(), err.getvalue())


def read_wandb_file(path: Path) -> dict[str, list[dict[str, str]]]:
    """Decode an offline ``run-*.wandb`` file into its history rows and summary updates.

    The file is a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB blocks, records split into
    full/first/middle/last chunks) of ``wandb.proto`` ``Record`` messages.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, position, pending, payloads = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # block trailer padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        position += 7
        chunk = data[position : position + length]
        position += length
        if kind == 0:
            break
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    out: dict[str, list[dict[str, str]]] = {"history": [], "summary": []}
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
        elif kind == "summary":
            items = record.summary.update
        else:
            continue
        out[kind].append({i.key or "/".join(i.nested_key): i.value_json for i in items})
    return out


def build_on(builder, options: dict, spec) -> object:
    """``builder`` (a model config's ``_target_``) called with ``options`` and the facts of
    ``spec`` (a DataSpec) as the configs pass them; a GSA-Net's ``arch`` defaults to the
    data's, as ``${oc.select:data.arch,auto}`` does."""
    if spec.task == "tokens":
        facts = dict(
            vocab_size=spec.vocab_size or spec.num_classes,
            max_len=spec.max_len,
            pad_index=spec.pad_index,
            tokens=spec.tokens,
            answer_order=spec.answer_order,
            causal_answer=spec.causal_answer,
        )
    else:
        facts = dict(
            in_channels=spec.in_channels, num_classes=spec.num_classes, image_size=spec.image_size
        )
        if builder.__module__.endswith("gsa_net"):
            facts["arch"] = spec.arch or "auto"
    options = {k: v for k, v in options.items() if k not in ("_target_", "family")}
    return builder(**{**facts, **options})


def arithmetic_spec():
    """The facts of ``data=arithmetic`` (two-digit operands): 15 tokens, longest 10."""
    from symattn_cli.data.base import DataSpec

    tokens = ("<pad>", "_", "=", "+", "-", *"0123456789")
    return DataSpec(
        task="tokens",
        num_classes=len(tokens),
        vocab_size=len(tokens),
        max_len=10,
        pad_index=0,
        arch="sequence",
        tokens=tokens,
    )
