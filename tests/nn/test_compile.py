"""torch.compile traces every shipped model in one graph (the attention kernels are registered
ops with shape functions and a registered backward), and the compiled model computes what
the eager one does: values and gradients in float64, exactness and non-degeneracy."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
from symattn_cli.models.instantiate import compose
from tests.helpers import run_symattn

NARROW = {"channels": 8, "heads": 2}  # the paper's nets at a test-sized width


def _model_and_input(name: str, **options):
    family = compose(name).model._target_.split(".")[-2]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if family == "knowledge":
        return symattn_cli.create_model(name, **options), torch.randint(
            1, 15, (2, 7), generator=gen
        )
    if family == "gsa_net" and "mini" not in name:
        options = {**NARROW, **options}
    return symattn_cli.create_model(name, **options), torch.randn(2, 1, 28, 28, generator=gen)


QUICK = {"gsa_mini"}  # the rest in the full suite
VARIANTS = [
    pytest.param(name, options, marks=() if name in QUICK and not options else pytest.mark.slow)
    for name, options in [(name, {}) for name in symattn_cli.list_models()]
    + [
        ("r8_sa", {"query_form": "single"}),
        ("r4_mini", {"group_index": "pair"}),
        ("r4_mini", {"group_index": "relative"}),
    ]
]


@pytest.mark.parametrize(("name", "options"), VARIANTS)
def test_every_shipped_model_traces_in_one_graph(name, options):
    """Training mode (dropout on): one graph, no break, as torch.compile(fullgraph=True)
    needs."""
    import torch._dynamo as dynamo

    model, x = _model_and_input(name, **options)
    dynamo.reset()
    explained = dynamo.explain(model.train())(x)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


def _assert_same_gradients(grads, eager_grads) -> None:
    """Every gradient equal to 1e-12 of the largest gradient entry (some parameters' are
    zero up to rounding, e.g. a bias before a batch norm)."""
    scale = max(float(g.abs().max()) for g in eager_grads)
    for mine, theirs in zip(grads, eager_grads, strict=True):
        assert (mine - theirs).abs().max() <= 1e-12 * scale


def _values_and_gradients(model, x):
    out = model(x)
    loss = out.square().mean() if out.is_floating_point() else out.float().mean()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return out.detach(), grads


@pytest.mark.parametrize(
    "name", ["gsa_mini", *(pytest.param(n, marks=pytest.mark.slow)
                           for n in ("ka_perm", "r8m_mini", "ka_softmax"))]
)  # fmt: skip
def test_traced_graph_gives_the_eager_values_and_gradients(name):
    """Through AOT autograd (the registered ops' shape functions and backward), float64,
    no attention dropout: the same logits and parameter gradients to 1e-12."""
    model, x = _model_and_input(
        name, **({} if name.startswith("ka") else {"attention_dropout": 0.0, "value_dropout": 0.0})
    )
    model = model.double().train()
    if x.is_floating_point():
        x = x.double()
    eager_out, eager_grads = _values_and_gradients(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out, grads = _values_and_gradients(compiled, x)
    assert (out - eager_out).abs().max() <= 1e-12 * eager_out.abs().max()
    _assert_same_gradients(grads, eager_grads)


def test_the_pair_pooled_sum_written_whole_is_the_sliced_one():
    """The perm form's hidden sum over k: the compiled path (one tensor) against the eager
    path (one query at a time, its own backward), float64."""
    from symattn_cli.nn.knowledge import PairPooledActivation

    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))  # fmt: skip
    r = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    act = torch.nn.functional.gelu
    sliced = PairPooledActivation.apply(a, b, c, r, act)
    whole = torch.einsum("bk,bhkijw->bhijw", r.double(),
                         act(a[:, :, :, None, None] + (b[:, :, None, :, None]
                                                       + c[:, :, None, None, :])))  # fmt: skip
    assert (sliced - whole).abs().max() <= 1e-13
    weight = torch.randn(sliced.shape, dtype=torch.float64, generator=gen)
    g1 = torch.autograd.grad((sliced * weight).sum(), (a, b, c))
    g2 = torch.autograd.grad((whole * weight).sum(), (a, b, c))
    for x, y in zip(g1, g2, strict=True):
        assert (x - y).abs().max() <= 1e-12


@pytest.mark.slow
def test_inductor_compiled_net_is_exact_responds_and_has_eager_gradients():
    """The default model compiled by inductor (the C++ backend), float64: gradients equal the
    eager ones to 1e-12; invariant under the four quarter turns to 1e-10; and its logits move
    with an input change the group does not fix."""
    model, x = _model_and_input("gsa_mini")
    model = model.double().train()
    x = x.double()
    eager_out, eager_grads = _values_and_gradients(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out, grads = _values_and_gradients(compiled, x)
    assert (out - eager_out).abs().max() <= 1e-12 * eager_out.abs().max()
    _assert_same_gradients(grads, eager_grads)
    compiled.eval()
    group = model.group
    with torch.no_grad():
        reference = compiled(x)
        for e in group.grid_exact_elements():
            moved = compiled(group.act_on_image(e, x))
            assert (moved - reference).abs().max() <= 1e-10 * reference.abs().max()
        changed = compiled(x + 0.5 * torch.randn_like(x))
        assert (changed - reference).abs().max() >= 1e-6 * reference.abs().max()


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
def test_trainer_compile_trains_and_keeps_plain_weight_names(tmp_path):
    from symattn_cli.train.runfile import read_weights

    result = run_symattn("train", "trainer.compile=true", "trainer.epochs=1",
                         "trainer.max_steps_per_epoch=3", "data.num_train=48", "data.num_val=16",
                         "data.num_test=16", "trainer.progress=plain", "logger.mode=disabled",
                         cwd=tmp_path, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = next((tmp_path / "outputs/train").glob("*/*/run.h5"))
    names = list(read_weights(run))
    assert names and not any(n.startswith("_orig_mod") for n in names)
