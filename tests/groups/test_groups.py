"""Group axioms, homomorphism of the actions, and grid action == coordinate action."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
from symattn_cli.groups import GROUP_NAMES, GridActionError, get_group, grid_coordinates


@pytest.fixture(params=GROUP_NAMES)
def group(request):
    return get_group(request.param)


def test_axioms(group):
    n = group.order
    table = group.cayley
    assert table.shape == (n, n)
    for a in group.elements:  # each row and column is a permutation (Latin square)
        assert sorted(table[a].tolist()) == list(range(n))
        assert sorted(table[:, a].tolist()) == list(range(n))
        assert group.multiply(group.identity, a) == a == group.multiply(a, group.identity)
        assert group.multiply(a, int(group.inverse[a])) == group.identity
    for a in group.elements:
        for b in group.elements:
            for c in group.elements:
                assert table[table[a, b], c] == table[a, table[b, c]]


def test_matrices_are_a_homomorphism(group):
    mats = group.matrices()
    for a in group.elements:
        assert torch.allclose(mats[a] @ mats[a].T, torch.eye(2, dtype=torch.float64))
        for b in group.elements:
            assert torch.allclose(mats[a] @ mats[b], mats[group.multiply(a, b)], atol=1e-12)


def test_regular_representation_is_a_homomorphism(group):
    f = torch.randn(group.order)
    for a in group.elements:
        for b in group.elements:
            two_steps = f[group.regular_permutation(b)][group.regular_permutation(a)]
            one_step = f[group.regular_permutation(group.multiply(a, b))]
            assert torch.equal(two_steps, one_step)


def test_matrices_in_other_dtypes_are_the_float64_ones_rounded_once(group):
    exact = group.matrices(torch.float64)
    assert torch.equal(group.matrices(torch.float32), exact.float())
    for e in group.elements:
        assert torch.equal(group.matrix(e), exact[e])
        if group.is_grid_exact(e):  # quarter turns and reflections: entries are 0 and +-1
            assert set(exact[e].flatten().tolist()) <= {0.0, 1.0, -1.0}


def test_tables_follow_the_device_asked_for_and_are_fresh_copies(group):
    """``device=None`` means torch's default device, as for torch's constructors (a layer
    that forgets to pass its input's device fails off the CPU, and a test can see it); the
    caller may write into what it gets without touching the group's cache."""
    assert group.matrices().device.type == "cpu"
    assert group.matrices(device="meta").device.type == "meta"
    assert grid_coordinates(3, 4, device="meta").device.type == "meta"
    with torch.device("meta"):
        assert group.matrices().device.type == "meta"
        assert group.regular_permutation(0).device.type == "meta"
        assert grid_coordinates(3, 4).device.type == "meta"
        assert group.cayley.device.type == "cpu"  # index tables stay on the host
    before = group.matrices().clone()
    group.matrices().zero_()
    group.regular_permutation(group.order - 1).zero_()
    assert torch.equal(group.matrices(), before)
    assert group.regular_permutation(group.order - 1).tolist() == group.relative[-1].tolist()


def test_relative_index_is_invariant(group):
    rel = group.relative
    for u in group.elements:
        for g in group.elements:
            for m in group.elements:
                assert rel[group.multiply(u, g), group.multiply(u, m)] == rel[g, m]


@pytest.mark.parametrize("size", [5, 6])
def test_grid_action_equals_coordinate_action(group, size):
    coords = grid_coordinates(size, size)  # (H, W, 2)
    for e in group.grid_exact_elements():
        f = torch.arange(size * size, dtype=torch.float64).reshape(size, size)
        moved = group.act_on_grid(e, f)
        image = group.act_on_coordinates(e, coords)  # where each pixel centre goes
        for r in range(size):
            for c in range(size):
                x, y = image[r, c].tolist()
                r2 = round((size - 1) / 2 - y)
                c2 = round(x + (size - 1) / 2)
                assert moved[r2, c2] == f[r, c]


def test_grid_and_group_function_actions_are_homomorphisms(group):
    f = torch.randn(2, 3, group.order, 6, 6, dtype=torch.float64)
    exact = group.grid_exact_elements()
    for a in exact:
        for b in exact:
            ab = group.multiply(a, b)
            lhs = group.act_on_group_function(a, group.act_on_group_function(b, f))
            assert torch.equal(lhs, group.act_on_group_function(ab, f))


@pytest.mark.parametrize("name", ["mirror", "z4m", "r8m"])
def test_the_mirror_is_the_left_right_flip(name):
    """M = R^0 M^1 (index n) maps (x, y) to (-x, y): on a grid it reverses the columns, the
    horizontal flip of data augmentation, not the rows (which would turn images upside down)."""
    group = get_group(name)
    m = group.rotations  # index of R^0 M
    assert group.is_reflection(m) and group.describe(m) == "rot0*mirror"
    assert torch.equal(group.matrix(m), torch.tensor([[-1.0, 0.0], [0.0, 1.0]]).double())
    point = torch.tensor([[2.0, 3.0]], dtype=torch.float64)
    assert group.act_on_coordinates(m, point).tolist() == [[-2.0, 3.0]]
    f = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    assert torch.equal(group.act_on_grid(m, f), f.flip(-1))
    assert torch.equal(group.act_on_image(m, f), f.flip(-1))
    if group.rotations % 4 == 0:  # the up-down flip is M turned by 180 degrees: R^(n/2) M
        updown = group.compose_index(group.rotations // 2, 1)
        assert torch.equal(group.act_on_grid(updown, f), f.flip(-2))


def test_off_grid_action_is_a_clear_error():
    r8 = get_group("r8")
    with pytest.raises(GridActionError, match="45"):
        r8.act_on_grid(1, torch.zeros(4, 4))


def test_translation_convention():
    z2 = get_group("z2")
    f = torch.zeros(1, 1, 1, 5, 5)
    f[..., 2, 2] = 1
    moved = z2.act_on_group_function(0, f, shift=(1, 1))  # right and up
    assert moved[0, 0, 0, 1, 3] == 1


def test_registry_names_and_aliases():
    assert get_group("r4") is get_group("z4")
    assert get_group("R4M") == get_group("z4m")
    assert symattn_cli.get_group("z2m") is get_group("mirror")
    with pytest.raises(ValueError, match="choose one of"):
        get_group("r5")
