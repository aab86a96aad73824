"""The tiled Triton kernel (``attention_backend=triton_tiles``) against the dense oracle:
values and gradients of every case, dropout masks included, with many tiles and halo blocks,
repeated and invalid neighbours; its tile maps; float32 (products at float32 accuracy). Compiled
on a GPU, or in Triton's interpreter on CPU tensors (``tests/conftest.py``). The layers'
equivariance on it and its compilation for a GPU are in ``test_gsa_triton.py``."""

from __future__ import annotations

import pytest
import torch

import symattn_cli.nn.gsa.core as core
from symattn_cli.nn.gsa import triton as gsa_triton
from symattn_cli.nn.gsa import triton_tiles
from symattn_cli.nn.gsa.core import factorised_attention

from .test_gsa_core import CASES, _dense, _inputs, _run, check_opposed

pytest.importorskip("triton", reason="Triton ships with PyTorch's CUDA wheels only")


@pytest.fixture(scope="module")
def device(triton_device) -> str:
    return triton_device


def _on(device: str, inputs: tuple) -> tuple:
    return tuple(t.to(device) if torch.is_tensor(t) else t for t in inputs)


def _kernel_only(monkeypatch) -> list:
    """Makes the other backends unreachable from the dispatcher; records each launch's tile
    and halo sizes."""

    def fallback(*args, **kwargs):
        raise AssertionError("the dispatcher fell back to another backend")

    monkeypatch.setattr(core, "torch_attention", fallback)
    monkeypatch.setattr(gsa_triton, "triton_attention", fallback)
    launch, seen = triton_tiles._launch, []

    def recorded(*args):
        maps, sizes, blocks = launch(*args)
        seen.append((maps[0].shape, blocks["BQ"], blocks["BH"], blocks["CHUNKS"]))
        return maps, sizes, blocks

    monkeypatch.setattr(triton_tiles, "_launch", recorded)
    return seen


@pytest.mark.parametrize(("form", "shape"), CASES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_matches_the_dense_oracle(form, shape, drop, device, monkeypatch):
    """Values and gradients (q, k, v, the group encoding, rho) to float64 round-off, with the
    same dropout masks: one tile of three queries and one halo block."""
    seen = _kernel_only(monkeypatch)
    inputs = _on(device, _inputs(**{**shape, "z": 1, "n_q": 3}))
    ours = _run(factorised_attention, inputs, form, drop=drop, backend="triton_tiles")
    oracle = _run(_dense(drop), inputs, form)
    assert len(ours) == len(oracle)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    assert len(seen) == 1  # the tile maps, built once for the forward and the backward


@pytest.mark.parametrize(("form", "shape"), [CASES[i] for i in (0, 3, 4, 13)])
def test_many_tiles_and_halo_blocks(form, shape, device, monkeypatch):
    """Nine queries, 9 neighbours each out of 30 keys (repeats likely), blocks and programs as
    small as the products allow, dropout on: the statistics carried from block to block, dk,
    dv, drho added from many programs, d grho summed over programs, each backward program
    taking several tiles, an R8 query's rows r split over programs (dq added by each)."""
    monkeypatch.setattr(triton_tiles, "COLUMNS", 1)
    monkeypatch.setattr(triton_tiles, "MAX_ROWS", 16)
    seen = _kernel_only(monkeypatch)
    inputs = _on(device, _inputs(**{**shape, "z": 2, "n_q": 9, "n_kv": 30, "j": 9}))
    ours = _run(factorised_attention, inputs, form, drop=0.3, backend="triton_tiles")
    oracle = _run(_dense(0.3), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    (tiles, halo), bq, bh, chunks = seen[0]
    assert halo > bh  # more than one block a tile
    assert tiles == -(-9 // bq)
    assert (chunks > 1) == (shape.get("g") == 8)  # 64 rows a query, in chunks of 16


@pytest.mark.parametrize(
    ("form", "shape"),
    [
        ("sum", dict(d=8, e=5)),  # group layer, e > M: its spatial term through products
        ("single", dict(d=8, e=5)),
        # and its rows r in chunks (each alone in the quick loop: the cases above and
        # test_many_tiles_and_halo_blocks)
        pytest.param("sum", dict(g=8, m=2, d=6, e=3, by_v=True), marks=pytest.mark.slow),
    ],
)
def test_a_spatial_term_with_more_products_than_logits(form, shape, device, monkeypatch):
    """A local spatial term with more channels than key elements (e > M) goes through the
    tile's logits by neighbour and each block's one-hot map, in group layers too: values and
    gradients against the dense oracle, with dropout, many tiles, blocks and chunks of rows."""
    monkeypatch.setattr(triton_tiles, "COLUMNS", 1)
    monkeypatch.setattr(triton_tiles, "MAX_ROWS", 16)
    chosen = []
    plan = triton_tiles.plan

    def recorded(*args):
        launch = plan(*args)
        chosen.append(launch[3])
        return launch

    monkeypatch.setattr(triton_tiles, "plan", recorded)
    _kernel_only(monkeypatch)
    inputs = _on(device, _inputs(**{**shape, "z": 2, "n_q": 9, "n_kv": 30, "j": 9}))
    ours = _run(factorised_attention, inputs, form, drop=0.3, backend="triton_tiles")
    oracle = _run(_dense(0.3), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    assert chosen[0]["SP_DOT"] and chosen[0]["BG"] > 1
    assert (chosen[0]["CHUNKS"] > 1) == (shape.get("g") == 8)


@pytest.mark.parametrize(("form", "shape"), [CASES[i] for i in (0, 2, 4, 13)])
def test_float32_matches_the_float64_oracle(form, shape, device):
    inputs = _on(device, _inputs(**{**shape, "z": 1, "n_q": 3}))
    ours = _run(factorised_attention, inputs, form, torch.float32, drop=0.2,
                backend="triton_tiles")  # fmt: skip
    oracle = _run(_dense(0.2), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 2e-5 * b.abs().max()


def test_tile_maps_list_each_neighbour_once():
    """Every valid neighbour (i, j) is the halo entry whose slot for i is j, a point listed
    twice by one query twice; invalid neighbours and padding get no slot; rows of rho follow
    the offsets."""
    neighbour = torch.tensor([[0, 2, 2, 5], [1, 2, 3, 0], [5, 5, 5, 4]])
    valid = torch.tensor([[True, True, True, True], [True, False, True, True],
                          [True, True, False, True]])  # fmt: skip
    offsets = torch.arange(12).view(3, 4) + 100
    halo, slot, row = triton_tiles.tile_maps(neighbour, valid, offsets, bq=2, bh=4)
    assert halo.shape[0] == 2 and halo.shape[1] % 4 == 0
    found = {}
    for t in range(halo.shape[0]):
        for iq in range(2):
            for h in range(halo.shape[1]):
                j = int(slot[t, iq, h])
                if j < 0:
                    continue
                i = 2 * t + iq
                assert i < 3 and valid[i, j]
                assert int(halo[t, h]) == int(neighbour[i, j])
                assert int(row[t, iq, h]) == int(offsets[i, j])
                assert (i, j) not in found
                found[i, j] = h
    assert set(found) == {(i, j) for i in range(3) for j in range(4) if valid[i, j]}
    # the tile of queries 0-1 lists point 2 twice (query 0 lists it twice), the others once
    assert sorted(int(p) for p in halo[0] if p >= 0) == [0, 1, 2, 2, 3, 5]


def test_v_dependent_encoding_needs_v_rows(device):
    q, k, v, g_rho, rho, offsets, nb, valid, n = _on(device, _inputs(z=1, n_q=3, by_v=True))
    with pytest.raises(ValueError, match="V = 4 rows"):
        triton_tiles.tiled_attention(q, k, v, g_rho, rho, offsets, nb, valid, False, 4, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_term_that_sees_v_against_key_logits_far_the_other_way(dtype, device, monkeypatch):
    """Key logits and a v-dependent group term favouring different key elements by more than
    exp's range (``test_gsa_core.opposed_inputs``): each row's inner softmax subtracts the
    maximum of their sum, and values and gradients match the float64 oracle, with dropout."""
    _kernel_only(monkeypatch)
    check_opposed(dtype, "triton_tiles", device)
