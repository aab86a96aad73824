"""The dispatcher's hooks for measuring code: :func:`~symattn_cli.nn.gsa.core.recording` hands
over each call of the attention core (its backend, its arguments), and
:func:`~symattn_cli.nn.gsa.core.overriding` makes the calls of a block run another backend."""

from __future__ import annotations

import threading

import pytest
import torch

from symattn_cli.groups import get_group
from symattn_cli.nn.gsa import GroupSelfAttention, core


def _layer(*, lifting=False, **kwargs) -> GroupSelfAttention:
    """A small r4 layer: 2 heads of 6 channels, P = 3."""
    torch.manual_seed(0)
    return GroupSelfAttention(group=get_group("r4"), in_channels=3, out_channels=4, heads=2,
                              head_dim=6, patch_size=3, lifting=lifting, **kwargs)  # fmt: skip


def _features(batch=2, side=5) -> torch.Tensor:
    return torch.randn(batch, 3, 4, side, side, generator=torch.Generator().manual_seed(1))


def _net() -> torch.nn.Sequential:
    """A lifting layer (3 -> 3 channels), then a global group layer in the single form."""
    torch.manual_seed(0)
    r4 = get_group("r4")
    return torch.nn.Sequential(
        GroupSelfAttention(group=r4, in_channels=3, out_channels=3, heads=1, head_dim=4,
                           patch_size=3, lifting=True),
        GroupSelfAttention(group=r4, in_channels=3, out_channels=2, heads=2, head_dim=6,
                           patch_size=None, query_form="single", attention_backend="torch"),
    )  # fmt: skip


def test_a_layers_forward_is_recorded_with_its_backend_and_shapes():
    layer, x = _layer(), _features()
    expected = layer(x)
    with core.recording() as calls:
        out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the core ran as without it
    (call,) = calls
    assert call.backend == core.backend_for("cpu", torch.float32)  # auto's choice here
    z, points, n, j = 2 * 2, 5 * 5, 4, 3 * 3  # batch x heads, pixels, |r4|, P x P
    assert call.q.shape == (z, points, n, 6) and call.k.shape == call.v.shape == (z, points, n, 6)
    assert call.neighbour.shape == call.valid.shape == (points, j) and call.offsets is None
    assert call.rho.shape[:2] == (n, j) and call.encoding.shape[:3] == (n, n, n)  # (V, G, M, c)
    assert call.group_index.shape == (n, n, n) and call.group_rho.dim() == 2  # table (R, c)
    assert (call.form, call.n, call.recompute) == ("sum", n, True)


def test_calls_are_recorded_in_the_order_the_forward_makes_them():
    net, x = _net(), torch.randn(1, 3, 4, 4)
    seen = []
    with core.recording(seen.append) as calls:
        net(x)
    assert seen == calls and len(calls) == 2
    lifting, group = calls
    assert lifting.backend == core.backend_for("cpu", torch.float32, grouped=False)
    assert lifting.q.shape == (1, 16, 1, 4) and lifting.encoding is None
    assert group.backend == "torch" and group.form == "single"
    assert group.q.shape == (2, 16, 4, 6) and group.neighbour.shape == (16, 16)
    assert group.offsets.shape == (16, 16) and group.valid is None


def test_nothing_is_recorded_outside_the_block():
    layer, x = _layer(), _features()
    with core.recording() as calls:
        pass
    layer(x)
    assert calls == [] and core._HOOKS.get() is None


def test_without_running_zeros_stand_in_and_no_seed_is_drawn():
    layer, x = _layer(attention_dropout=0.25).train(), _features()
    torch.manual_seed(3)
    with core.recording(run=False) as calls:
        out = layer._attend(*_core_inputs(layer, x))
    state = torch.get_rng_state()
    assert out.shape == (4, 25, 4, 6) and not out.any() and calls[0].drop == 0.25
    torch.manual_seed(3)
    assert torch.equal(state, torch.get_rng_state())  # the dropout seed was not drawn
    with core.recording() as calls:
        layer._attend(*_core_inputs(layer, x))
    assert not torch.equal(state, torch.get_rng_state())  # as it is when the core runs


def _core_inputs(layer: GroupSelfAttention, x: torch.Tensor):
    """The core's arguments of ``layer``'s forward on ``x``, recorded without running it."""
    with core.recording(run=False) as calls:
        layer(x)
    (call,) = calls
    return call.q, call.k, call.v, call.rho, call.offsets, call.neighbour, call.valid


def test_recordings_nest_and_a_failing_block_restores_the_outer_one():
    layer, x = _layer(), _features()
    with core.recording() as outer:
        layer(x)
        with core.recording(run=False) as inner:
            assert _only_bias(layer, layer(x))  # the inner block did not run the core
        with pytest.raises(RuntimeError, match="inside"):
            with core.recording() as failed:
                layer(x)
                raise RuntimeError("inside")
        assert not _only_bias(layer, layer(x))  # the outer block runs the core again
    assert len(inner) == len(failed) == 1 and len(outer) == 4
    assert inner[0] is outer[1] and failed[0] is outer[2]
    assert core._HOOKS.get() is None


def _only_bias(layer: GroupSelfAttention, out: torch.Tensor) -> bool:
    """Whether ``out`` is the output map's bias alone: the core's output was zeros."""
    return bool((out == layer.w_out.bias[:, None, None, None]).all())


def test_calls_of_other_threads_are_not_recorded():
    layer, x = _layer(), _features()
    with core.recording() as calls:
        worker = threading.Thread(target=layer, args=(x,))
        worker.start()
        worker.join()
        assert calls == []
        layer(x)
    assert len(calls) == 1


def test_a_call_under_autocast_is_recorded_once_in_float32():
    layer, x = _layer(), _features()
    with torch.autocast("cpu", dtype=torch.bfloat16), core.recording() as calls:
        layer(x)
    (call,) = calls
    assert call.q.dtype == call.k.dtype == torch.float32


def test_an_override_switches_the_backend_and_recomputation_of_its_block():
    layer, x = _layer(), _features()
    with core.recording() as calls:
        with core.overriding("torch", recompute=False):
            out = layer(x)
            with core.overriding(recompute=True):  # None keeps the enclosing backend
                layer(x)
        layer(x)
    assert [(c.backend, c.recompute) for c in calls] == [
        ("torch", False), ("torch", True), (core.backend_for("cpu", torch.float32), True)
    ]  # fmt: skip
    assert layer.attention_backend == "auto" and layer.checkpointing
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)  # the same algorithm
    with pytest.raises(ValueError, match="attention backend 'dense'"):
        with core.overriding("dense"):
            pass


def test_an_override_leaves_the_reference_algorithm_alone():
    layer, x = _layer(attention_backend="dense"), _features()
    with core.recording() as calls, core.overriding("torch"):
        layer(x)
    assert calls == []  # the dense layer does not call the core
