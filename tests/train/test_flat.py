"""Flat parameters: the same updates as the separate parameters, the optimiser's state saved
in their layout, and a clear error where a gradient stops being a view."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from symattn_cli.train.flat import FlatParameters
from symattn_cli.train.trainer import eager

OPTIMISERS = {  # torch's loop implementations: the same arithmetic on any split of the tensors
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 3))  # fmt: skip


def _steps(model: nn.Module, optimiser, zero, count: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randn(5, 2, 6, 6, generator=gen)
        zero()
        model(x).square().mean().backward()
        optimiser.step()


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_flat_parameters_take_the_updates_of_the_separate_ones(name):
    """Five steps of each optimiser over the flat tensor leave every parameter and every
    state tensor bit-identical to the same optimiser over the separate parameters (the
    update is element by element), and the state saved per parameter is the separate
    optimiser's."""
    separate, flat_model = _model(), _model()
    reference = OPTIMISERS[name](list(separate.parameters()))
    flat = FlatParameters(flat_model.parameters())
    optimiser = OPTIMISERS[name](flat.tensors)
    _steps(separate, reference, lambda: reference.zero_grad(set_to_none=True), 5)
    _steps(flat_model, optimiser, flat.zero_grad, 5)
    for a, b in zip(separate.parameters(), flat_model.parameters(), strict=True):
        assert torch.equal(a, b)
    ours, theirs = flat.per_parameter(optimiser.state_dict()), reference.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ours["state"][index][key]))


def test_the_fused_step_on_the_flat_tensor_rounds_like_the_separate_ones():
    """torch's fused Adam (the trainer's) on the flat tensor against the same on the separate
    parameters: one step from the same gradients differs at most by a rounding in a few
    elements (its vector loop and its scalar tail, which a small tensor takes, round
    differently), so a run's trajectory is not bit-identical to the per-parameter one."""
    separate, flat_model = _model(), _model()
    reference = torch.optim.Adam(list(separate.parameters()), lr=1e-2, fused=True)
    flat = FlatParameters(flat_model.parameters())
    optimiser = torch.optim.Adam(flat.tensors, lr=1e-2, fused=True)
    _steps(separate, reference, lambda: reference.zero_grad(set_to_none=True), 1)
    _steps(flat_model, optimiser, flat.zero_grad, 1)
    for a, b in zip(separate.parameters(), flat_model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=2e-7, atol=0)


def test_a_state_saved_per_parameter_resumes_the_same_run():
    """Three steps, the state saved per parameter (as run files keep it) and read into a new
    flat optimiser on a copy of the model: two more steps match five uninterrupted ones."""
    whole_model, model = _model(), _model()
    whole = FlatParameters(whole_model.parameters())
    whole_opt = OPTIMISERS["adam"](whole.tensors)
    _steps(whole_model, whole_opt, whole.zero_grad, 5)

    flat = FlatParameters(model.parameters())
    optimiser = OPTIMISERS["adam"](flat.tensors)
    gen_steps = 3
    _steps(model, optimiser, flat.zero_grad, gen_steps)
    saved = copy.deepcopy(flat.per_parameter(optimiser.state_dict()))
    weights = copy.deepcopy(model.state_dict())

    resumed_model = _model()
    resumed_model.load_state_dict(weights)
    resumed = FlatParameters(resumed_model.parameters())
    resumed_opt = OPTIMISERS["adam"](resumed.tensors)
    resumed_opt.load_state_dict(resumed.flat_state(saved))
    # the same two batches the uninterrupted run drew after its third
    gen = torch.Generator().manual_seed(1)
    for _ in range(gen_steps):
        torch.randn(5, 2, 6, 6, generator=gen)
    for _ in range(2):
        resumed.zero_grad()
        resumed_model(torch.randn(5, 2, 6, 6, generator=gen)).square().mean().backward()
        resumed_opt.step()
    for a, b in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_each_dtype_gets_its_own_flat_tensor():
    """Parameters of two dtypes: two flat tensors, each parameter a view of its own dtype's."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2).double())
    flat = FlatParameters(model.parameters())
    assert [t.dtype for t in flat.tensors] == [torch.float32, torch.float64]
    assert [t.numel() for t in flat.tensors] == [8, 6]
    for p in model.parameters():
        owner = flat.tensors[0 if p.dtype == torch.float32 else 1]
        assert p.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == owner.grad.untyped_storage().data_ptr()


def test_a_replaced_gradient_is_refused_with_the_fix():
    """zero_grad(set_to_none=True) on the model drops the views: the next backward's
    gradients would never reach the optimiser, so check() says so."""
    model = _model()
    flat = FlatParameters(model.parameters())
    model(torch.randn(5, 2, 6, 6)).sum().backward()
    flat.check()  # still the views
    model.zero_grad(set_to_none=True)
    model(torch.randn(5, 2, 6, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="FlatParameters.zero_grad"):
        flat.check()


def test_a_state_saved_for_another_model_is_refused():
    """An optimiser state listing another number of parameters names both counts."""
    small, large = _model(), nn.Sequential(_model(), nn.Linear(3, 3))
    flat_small = FlatParameters(small.parameters())
    optimiser = OPTIMISERS["adam"](flat_small.tensors)
    _steps(small, optimiser, flat_small.zero_grad, 1)
    saved = flat_small.per_parameter(optimiser.state_dict())
    with pytest.raises(ValueError, match="holds 6 parameters, this model 8"):
        FlatParameters(large.parameters()).flat_state(saved)


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
@pytest.mark.parametrize("fused", [False, True])
def test_the_trainers_unwrapped_optimiser_is_torchs(name, fused):
    """The trainer's optimiser classes (torch's, their methods without the wrappers that keep
    torch.compile out) give bit-identical parameters and state dicts to torch's own, fused
    or not, and take each other's saved state. (A step that recorded gradients would fail:
    it updates leaves that require them in place.)"""
    kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    options = {"lr": 1e-2, "fused": fused, **({"momentum": 0.9} if name == "sgd" else {})}
    models = _model(), _model()
    optimisers = [
        k(list(m.parameters()), **options) for k, m in zip((kind, eager(kind)), models, strict=True)
    ]
    assert type(optimisers[1]).__name__ == kind.__name__ and isinstance(optimisers[1], kind)
    for model, optimiser in zip(models, optimisers, strict=True):
        _steps(model, optimiser, optimiser.zero_grad, 3)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b)
    theirs, ours = (o.state_dict() for o in optimisers)
    assert ours["param_groups"] == theirs["param_groups"]
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ours["state"][index][key]))
    resumed = eager(kind)(list(models[1].parameters()), **options)
    resumed.load_state_dict(copy.deepcopy(theirs))
    _steps(models[0], optimisers[0], optimisers[0].zero_grad, 1, seed=2)
    _steps(models[1], resumed, resumed.zero_grad, 1, seed=2)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b)
