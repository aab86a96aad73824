"""Lifting / group self-attention: exact equivariance (float64), forms, controls, errors."""

from __future__ import annotations

import math

import pytest
import torch

import symattn_cli.nn.gsa.core as core
from symattn_cli.groups import GROUP_NAMES, get_group, grid_coordinates
from symattn_cli.nn.gsa import GROUP_INDEX, GroupSelfAttention
from symattn_cli.nn.gsa.layer import offset_table
from symattn_cli.verify.gsa import build_probe, layer_equivariance, randomize_encodings
from tests.helpers import values_and_gradients

KINDS = ["lifting", "group_sum", "group_single"]


@pytest.mark.parametrize("size", [5, 6])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", GROUP_NAMES)
def test_exact_equivariance_float64(group, kind, size):
    records = layer_equivariance(group, kind, image_size=size)
    assert len(records) == len(get_group(group).grid_exact_elements())
    worst = max(r["max_rel"] for r in records)
    assert worst <= 1e-10, records


@pytest.mark.parametrize("group", ["z4m", "r8"])
@pytest.mark.parametrize("kind", [*KINDS, "network"])
def test_torch_backend_agrees_and_is_exactly_equivariant(group, kind, monkeypatch, kernel):
    """The plain PyTorch backend (the path of devices without a kernel) gives the fused CPU
    kernel's values and gradients in float64, with attention dropout on (the same masks), and
    is exactly equivariant for every grid-exact element."""
    module, x = build_probe(get_group(group), kind, image_size=6, dtype=torch.float64)
    for layer in module.modules():
        if isinstance(layer, GroupSelfAttention):
            layer.attention_dropout.p = 0.2
    module.train()
    assert core.backend_for(x.device, x.dtype) == "cpp"
    cpu_out, *cpu_grads = values_and_gradients(module, x)
    asked = []
    monkeypatch.setattr(
        core,
        "backend_for",
        lambda device, dtype=None, backend="auto", grouped=True: asked.append(1) or "torch",
    )
    torch_out, *torch_grads = values_and_gradients(module, x)
    assert asked  # the core did take the other backend
    assert torch.allclose(torch_out, cpu_out, rtol=0, atol=1e-12 * cpu_out.abs().max())
    # One scale for every gradient: some are zero up to round-off (the key bias adds the same
    # logit to every key of a softmax).
    scale = max(g.abs().max() for g in cpu_grads)
    for a, b in zip(torch_grads, cpu_grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12 * scale)
    records = layer_equivariance(group, kind, image_size=6)
    assert len(records) == len(get_group(group).grid_exact_elements())
    assert max(r["max_rel"] for r in records) <= 1e-10, records


@pytest.mark.parametrize("group", ["z4", "r8", "z4m"])
def test_reference_indexing_is_not_equivariant(group):
    """Negative control: the reference's (m - g + v) group index breaks equivariance."""
    records = layer_equivariance(group, "group_shifted", image_size=5)
    assert max(r["max_rel"] for r in records) > 1e-6


def _brute_force_sum_form(layer: GroupSelfAttention, x: torch.Tensor, coords: torch.Tensor):
    """GSA-Nets Eq. 16 written out with the full (V, G, J, M) logit tensor."""
    g = layer.group
    b, _, n, n_pts = x.shape
    h, d = layer.heads, layer.head_dim
    q = layer.query(x).reshape(b, h, d, n, n_pts)
    k = layer.key(x).reshape(b, h, d, n, n_pts)
    v = layer.value(x).reshape(b, h, d, n, n_pts)
    offsets = coords[None] - coords[:, None]  # (I, J, 2)
    scale = layer.max_offset
    inv = g.matrices(x.dtype)[g.inverse]
    rho_xy = layer.position(offsets, inv, scale)  # (V, I, J, e)
    rho_h = layer.group_embedding[layer.group_index_table]  # (G, M, c) or (V, G, M, c)
    rho_h = rho_h.expand(n, n, n, rho_h.shape[-1])  # (V, G, M, c)
    e = layer.pos_dim
    rho = torch.cat(
        [
            rho_xy[:, :, :, None, None, :].expand(n, n_pts, n_pts, n, n, e),
            rho_h[:, None, None].expand(n, n_pts, n_pts, n, n, rho_h.shape[-1]),
        ],
        dim=-1,
    )  # (V, I, J, G, M, d)
    logits = torch.einsum("bhcgi,bhcmj->bhigjm", q, k)[:, :, None]  # (B, h, 1, I, G, J, M)
    logits = logits + torch.einsum("bhcgi,vijgmc->bhvigjm", q, rho)
    logits = logits / math.sqrt(d)
    attn = torch.softmax(logits.flatten(-2), -1).view_as(logits)
    out = torch.einsum("bhvigjm,bhcmj->bhcvi", attn, v).reshape(b, h * d, n, n_pts)
    return layer.w_out(out)


@pytest.mark.parametrize("index", GROUP_INDEX)
def test_factorised_softmax_matches_eq16(index):
    """Every group index, through the layer and its backend, against Eq. 16 written out."""
    g = get_group("z4m")
    layer = GroupSelfAttention(
        group=g, in_channels=4, out_channels=6, heads=2, patch_size=None, max_offset=4.0,
        group_index=index,
    )  # fmt: skip
    layer = randomize_encodings(layer).double().eval()
    x = torch.randn(2, 4, g.order, 7, dtype=torch.float64)
    coords = torch.randn(7, 2, dtype=torch.float64) * 2
    with torch.no_grad():
        fast = layer.forward_points(x, coords)
        slow = _brute_force_sum_form(layer, x, coords)
    assert torch.allclose(fast, slow, atol=1e-12)


@pytest.mark.parametrize("patch, crop", [(3, 1), (3, 2), (5, 1), (5, 3)])
def test_a_cropped_layer_is_the_full_layer_cropped(patch, crop):
    """The cropped layer's queries are the kept pixels only: values and gradients are the
    full layer's there, whether or not the neighbourhoods reach outside the map."""
    layer = GroupSelfAttention(group=get_group("r4"), in_channels=3, out_channels=6, heads=2,
                               head_dim=6, patch_size=patch, checkpointing=False)  # fmt: skip
    layer = randomize_encodings(layer).double()
    x = torch.randn(2, 3, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    full = layer(x)[..., crop:-crop, crop:-crop]
    cropped = layer(x, crop=crop)
    assert cropped.shape == full.shape
    assert torch.allclose(cropped, full, rtol=0, atol=1e-13 * float(full.detach().abs().max()))
    weights = torch.randn_like(full)
    (a,) = torch.autograd.grad((full * weights).sum(), x)
    (b,) = torch.autograd.grad((cropped * weights).sum(), x)
    assert torch.allclose(a, b, rtol=0, atol=1e-12 * float(a.abs().max()))


@pytest.mark.parametrize("patch", [3, None])
def test_kept_geometry_gives_a_fresh_layers_values_at_every_size(patch):
    """The neighbourhoods, offsets and spatial-encoding inputs a layer keeps per size, dtype
    and crop give the values and gradients of a layer that has never run, whatever ran
    before: other sizes, a crop, float32, and a first call under ``torch.inference_mode``
    (whose tensors training could not use)."""
    kw = dict(group=get_group("r4"), in_channels=3, out_channels=4, heads=2, head_dim=6,
              patch_size=patch)  # fmt: skip
    layer = randomize_encodings(GroupSelfAttention(**kw)).double()
    with torch.inference_mode():
        layer(torch.randn(1, 3, 4, 6, 5, dtype=torch.float64))
    calls = [(6, 5, 0, torch.float64), (7, 7, 0, torch.float64), (6, 5, 1, torch.float64),
             (6, 5, 0, torch.float32), (7, 7, 0, torch.float64)]  # fmt: skip
    for height, width, crop, dtype in calls:
        layer = layer.to(dtype)
        fresh = GroupSelfAttention(**kw).to(dtype)
        fresh.load_state_dict(layer.state_dict())
        x = torch.randn(2, 3, 4, height, width, dtype=dtype)
        kept, new = (values_and_gradients(m, x, crop=crop) for m in (layer, fresh))
        assert kept[0].shape == (2, 4, 4, height - 2 * crop, width - 2 * crop)
        assert all(torch.equal(a, b) for a, b in zip(kept, new, strict=True))
    assert len(layer._constants) == (3 if patch is None else 4)  # per size, dtype (local: crop)


@pytest.mark.parametrize("form", ["sum", "single"])
def test_local_with_large_patch_equals_global(form):
    g = get_group("r8")
    kw = dict(group=g, in_channels=3, out_channels=6, heads=2, query_form=form, max_offset=3.0)
    local = GroupSelfAttention(patch_size=9, chunk_elements=4000, **kw).double()
    glob = GroupSelfAttention(patch_size=None, **kw).double()
    glob.load_state_dict(local.state_dict())
    x = torch.randn(2, 3, 8, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(local(x), glob(x), atol=1e-12)
        # crop computes only the inner pixels: the same values up to round-off (fewer
        # queries make products of other shapes, which BLAS may round differently)
        full = local(x)
        assert torch.allclose(local(x, crop=1), full[..., 1:-1, 1:-1], rtol=0,
                              atol=1e-13 * full.abs().max())  # fmt: skip
    # Most of a 9 x 9 neighbourhood lies outside a 5 x 5 image; those neighbours are clamped
    # to pixels inside and must take no gradient either.
    weights = torch.randn(2, 6, 8, 5, 5, dtype=torch.float64)
    (a,) = torch.autograd.grad((local(x.requires_grad_()) * weights).sum(), x)
    (b,) = torch.autograd.grad((glob(x) * weights).sum(), x)
    assert torch.allclose(a, b, atol=1e-12)


def test_group_encoding_spans_every_channel_without_positional_encoding():
    """``position="none"``: rho_H is dotted with all d channels of q, and the layer stays
    exactly equivariant (float64) for every element of the group."""
    g = get_group("z4m")
    layer = GroupSelfAttention(
        group=g, in_channels=3, out_channels=6, heads=2, patch_size=3, position="none",
        group_index="relative",
    ).double()  # fmt: skip
    assert layer.group_embedding.shape == (g.order, layer.head_dim)
    torch.nn.init.normal_(layer.group_embedding)
    x = torch.randn(2, 3, g.order, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for e in g.grid_exact_elements():
            moved = layer(g.act_on_group_function(e, x, (0, 0)))
            err = (moved - g.act_on_group_function(e, y, (0, 0))).abs().max()
            assert err <= 1e-10 * y.abs().max(), (e, err)


def test_checkpointed_gradients_match():
    torch.manual_seed(0)
    g = get_group("z4")
    kw = dict(group=g, in_channels=4, out_channels=6, heads=2, patch_size=3)
    a = GroupSelfAttention(checkpointing=True, chunk_elements=2000, **kw).double().train()
    b = GroupSelfAttention(checkpointing=False, **kw).double().train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 4, 4, 6, 6, dtype=torch.float64)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-10)


def test_errors_for_people():
    g = get_group("z4")
    with pytest.raises(ValueError, match="odd"):
        GroupSelfAttention(group=g, in_channels=2, out_channels=6, heads=1, patch_size=4)
    with pytest.raises(TypeError, match="get_group"):
        GroupSelfAttention(group="z4", in_channels=2, out_channels=6, heads=1)
    with pytest.raises(ValueError, match="query_form"):
        GroupSelfAttention(group=g, in_channels=2, out_channels=6, heads=1, query_form="x")
    with pytest.raises(ValueError, match="chunk_elements=-1"):
        GroupSelfAttention(group=g, in_channels=2, out_channels=6, heads=1, chunk_elements=-1)
    layer = GroupSelfAttention(group=g, in_channels=2, out_channels=6, heads=1)
    with pytest.raises(ValueError, match="N=4"):
        layer(torch.randn(1, 2, 3, 5, 5))


def test_swish_is_x_times_sigmoid_in_value_and_gradient():
    """``Swish`` (computed by ``F.silu``) equals x * sigmoid(x) in value and gradient."""
    from symattn_cli.nn.positional import Swish

    x = torch.linspace(-30, 30, 1001, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    torch.testing.assert_close(Swish()(x), y * torch.sigmoid(y), rtol=1e-15, atol=1e-15)
    Swish()(x).sum().backward()
    (y * torch.sigmoid(y)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-13, atol=1e-15)


def _output_from_weights(layer: GroupSelfAttention, x: torch.Tensor, pixel, weights):
    """The layer's output at ``pixel`` rebuilt from explicit attention weights and values."""
    x = x if x.dim() == 5 else x.unsqueeze(2)  # (1, C, M, H, W)
    h, d = layer.heads, layer.head_dim
    val = layer.value(x.flatten(3)).reshape(h, d, x.shape[2], *x.shape[-2:])  # (h, d, M, H, W)
    if layer.patch_size is not None:  # the P x P neighbourhood, zeros outside the image
        p, r = layer.patch_size, layer.patch_size // 2
        val = torch.nn.functional.pad(val, (r, r, r, r))[..., pixel[0] : pixel[0] + p,
                                                          pixel[1] : pixel[1] + p]  # fmt: skip
    out = torch.einsum("hvgabm,hdmab->hdv", weights, val)  # (h, d, V)
    return layer.w_out(out.reshape(1, h * d, -1, 1))[0, :, :, 0]  # (C_out, V)


@pytest.mark.parametrize(
    "group,kind,form,patch",
    [("r8", "lifting", "sum", 5), ("z4m", "group", "sum", 5), ("r4", "group", "single", 5),
     ("mirror", "group", "sum", 5), ("r8", "lifting", "sum", None), ("z4m", "group", "sum", None),
     ("r4", "group", "single", None)],
)  # fmt: skip
@pytest.mark.parametrize("pixel", [(0, 0), (3, 2)])
def test_attention_weights_are_the_ones_the_layer_uses(group, kind, form, patch, pixel):
    """Weights and values rebuild the layer's output at the pixel, local and global (a corner
    included, where most of a local neighbourhood lies outside the image and gets no weight)."""
    torch.manual_seed(1)
    g = get_group(group)
    lifting = kind == "lifting"
    layer = GroupSelfAttention(group=g, in_channels=3, out_channels=6, heads=2, patch_size=patch,
                               lifting=lifting, query_form=form)  # fmt: skip
    layer = randomize_encodings(layer).double().eval()
    shape = (1, 3, 6, 5) if lifting else (1, 3, g.order, 6, 5)
    x = torch.randn(shape, dtype=torch.float64)
    weights = layer.attention_weights(x, pixel)
    queries = 1 if lifting or form == "single" else g.order
    side = (5, 5) if patch else (6, 5)
    assert weights.shape == (2, g.order, queries, *side, 1 if lifting else g.order)
    ones = torch.ones(2, g.order, queries, dtype=torch.float64)
    torch.testing.assert_close(weights.sum((-3, -2, -1)), ones)
    if pixel == (0, 0) and patch:  # offsets above or left of the image
        assert weights[..., :2, :, :].abs().max() == 0 and weights[..., :2, :].abs().max() == 0
    with torch.no_grad():
        expected = layer(x)[0, :, :, pixel[0], pixel[1]]
    torch.testing.assert_close(_output_from_weights(layer, x, pixel, weights), expected,
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_attention_weights_turn_with_the_input():
    """Lifting, z4: the query at u.pixel of the turned image weighs its neighbourhood, for
    output element u v, as the original query does for v, turned by u (float64 exact)."""
    torch.manual_seed(2)
    g = get_group("z4")
    layer = GroupSelfAttention(group=g, in_channels=2, out_channels=4, heads=2, patch_size=3,
                               lifting=True)  # fmt: skip
    layer = randomize_encodings(layer).double().eval()
    x = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    pixel = (1, 4)
    base = layer.attention_weights(x, pixel)[:, :, 0, :, :, 0]  # (h, V, P, P)
    for u in g.elements:
        spot = torch.zeros(7, 7)
        spot[pixel] = 1
        moved_pixel = divmod(int(g.act_on_grid(u, spot).argmax()), 7)
        moved = layer.attention_weights(g.act_on_grid(u, x), moved_pixel)[:, :, 0, :, :, 0]
        for v in g.elements:
            torch.testing.assert_close(moved[:, g.multiply(u, v)], g.act_on_grid(u, base[:, v]),
                                       rtol=0, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("group", ["r4", "r8"])
def test_mixed_precision_forward_and_backward(group):
    """``trainer.amp``: under autocast the attention core runs in float32 and its backward
    sees one dtype. CPU bfloat16 autocast stands in for CUDA float16 (the same code path);
    r8's products are unpacked, r4's packed. Gradients follow the float32 ones."""
    import symattn_cli

    torch.manual_seed(0)
    model = symattn_cli.create_model("gsa_mini", group=group, channels=8, heads=2)
    x = torch.randn(4, 1, 28, 28)
    target = torch.randint(0, 10, (4,))

    def gradients(amp: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        assert logits.dtype == (torch.bfloat16 if amp else torch.float32)
        loss = torch.nn.functional.cross_entropy(logits.float(), target)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss32, grad32 = gradients(False)
    loss16, grad16 = gradients(True)
    assert torch.isfinite(grad16).all()
    assert abs(loss16 - loss32) <= 0.05 * loss32
    # bfloat16 keeps 8 bits: the cosine measured 0.978-0.999 over r4 / r8 and every group
    # index at this seed
    cosine = torch.nn.functional.cosine_similarity(grad16.float(), grad32, dim=0)
    assert cosine > 0.97, cosine


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offset_table_sorts_the_distinct_offsets_by_y_then_x_from_the_right(dtype):
    """A global layer's table of distinct offsets and each pair's index equal those of one
    sort of (y, -x) rows, on a grid and on random points. On a grid, consecutive queries of
    an image row read entries that rise by one, and a tile of them across the end of a row
    reads the next row's entries above the first row's (two runs a kernel reads as loads)."""
    grid = grid_coordinates(5, 7, dtype=dtype).reshape(-1, 2)
    points = torch.randn(40, 2, generator=torch.Generator().manual_seed(0)).to(dtype)
    for coords in (grid, points, points.round()):  # rounded: repeated offsets off a grid
        offsets = coords[None] - coords[:, None]
        distinct, index = offset_table(offsets)
        rows = torch.stack([offsets[..., 1], -offsets[..., 0]], dim=-1).reshape(-1, 2)
        yx, expected = torch.unique(rows, dim=0, return_inverse=True)
        assert torch.equal(distinct, torch.stack([-yx[:, 1], yx[:, 0]], dim=-1))
        assert torch.equal(index, expected.view(index.shape))
        assert torch.equal(distinct[index], offsets)
    distinct, index = offset_table(grid[None] - grid[:, None])
    assert distinct.shape == (9 * 13, 2)
    rows = index.view(5, 7, -1)  # (query row, query column, J)
    assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.full_like(rows[:, 1:], 1))
    # run 1 (the next row from its first column) starts above where run 0 would continue
    assert (rows[1:, 0] >= rows[:-1, 0] + 7).all()
