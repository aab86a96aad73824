"""Every model makes its tensors on its input's device, so it runs where it is put (a GPU).

No GPU is needed to check it: with the default device set to ``meta``, a tensor made without
naming a device lands there, and the first operation that mixes it with the model's CPU
tensors fails (or, for an index, reads nothing: hence the comparison of values). The attention
core takes its plain PyTorch backend, the one a GPU without a kernel takes.
"""

from __future__ import annotations

import pytest
import torch

import symattn_cli
import symattn_cli.nn.gsa.core as core
from symattn_cli.models.instantiate import compose
from symattn_cli.nn.gsa import AUTO_CHUNK
from tests.helpers import values_and_gradients

NARROW_GSA = {"channels": 8, "heads": 2}  # the paper's layout at a test-sized width


def _model_and_input(name: str):
    cfg = compose(name)
    family = cfg.model._target_.split(".")[-2]  # the builder's module: cnn, gcnn, gsa_net, ...
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if family == "knowledge":
        model = symattn_cli.create_model(name)
        tokens = torch.randint(1, cfg.data.vocab_size, (2, 7), generator=gen)
        return model, tokens
    options = {}
    if family == "gsa_net":  # chunks as large as a GPU takes them (the chunk size is automatic)
        options = {"chunk_elements": AUTO_CHUNK["cuda"]}
        if name != "gsa_mini":
            options |= NARROW_GSA
    model = symattn_cli.create_model(name, **options)
    return model, torch.randn(1, 1, 28, 28, generator=gen)


# The paper-sized GSA-Nets take seconds to a minute and a half each on the torch backend; the
# quick loop checks their layers in the mini nets and in r4_sa and mirror_sa.
PAPER_SIZED = {"r4m_sa", "r8_sa", "r8m_sa", "r12_sa", "r16_sa", "z2_sa", "z2m_sa", "z4_sa"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in PAPER_SIZED else name
                                  for name in symattn_cli.list_models()])  # fmt: skip
def test_forward_and_backward_make_no_tensor_off_the_input_device(name, monkeypatch):
    monkeypatch.setattr(
        core, "backend_for", lambda device, dtype=None, backend="auto", grouped=True: "torch"
    )
    model, x = _model_and_input(name)
    for module in model.modules():  # dropout on, where the model has it
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.2
    model.train()
    reference = values_and_gradients(model, x)
    with torch.device("meta"):
        placed = values_and_gradients(model, x)
    assert len(placed) == len(reference) > 1
    for a, b in zip(placed, reference, strict=True):
        assert a.device == b.device and torch.equal(a, b)
