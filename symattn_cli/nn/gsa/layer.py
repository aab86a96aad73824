"""Lifting and group self-attention (GSA-Nets, Romero & Cordonnier 2021), one shared core.

Letters: B batch, C channels, h heads, d channels per head, Z = B*h, N = |H|, V output group
elements (= N), G query group elements, M key group elements (lifting: G = M = 1), I query
points (H*W on a grid), J neighbours of a query (P*P offsets when local, all I points when
global), E positional-encoding channels. Group features are ``(B, C, N, H, W)``.

Transformation law (GSA-Nets Props. 5.1 and 5.2), for g = (t, u) in R^2 x| H:
    layer(L_g f) = L_g layer(f),   (L_g f)(x, h) = f(u^-1 (x - t), u^-1 h),
exactly for every u that maps the pixel grid onto itself, and for every u in H when the
layer is global and the points' coordinates (not pixels) are rotated.

Attention logits for output (i, v), query element g and key (j, m) are ``<q_ig, k_jm +
rho(v, g, j, m)>`` / sqrt(d), split into three terms that live on different index sets:
    content  q_ig . k_jm                     (i, g, j, m)
    spatial  q_ig . rho_xy(v^-1 (x_j - x_i)) (i, v, g, j)       GSA-Nets Eq. 14 / 16
    group    q_ig . rho_H[idx(v, g, m)]      (i, v, g, m)       ``group_index``
Two laws for the group index (docs/gsa-nets.md):
  equivariance     idx(u v, u g, u m) = idx(v, g, m) for every u in H;
  non-degeneracy   the output changes when only the input's group axis is moved,
                   f(x, m) -> f(x, u^-1 m): the layer sees how that axis lines up with space.
``group_index``:
  ``"pair"``     (v^-1 g, g^-1 m), N^2 rows: the general exact index; both laws.
  ``"gevit"``    v^-1 g m^-1 g, N rows: (2g - m - v) mod N on rotations (GE-ViT, Xu et al.
                 2023); its dihedral form is the same word in the group; both laws.
  ``"relative"`` g^-1 m, N rows: exact but blind in the sum form (every term is unchanged by
                 (g, m) -> (u g, u m), and the sum runs over all g).
  ``"shifted"``  v g^-1 m, (m - g + v) mod N: the reference implementation's index, not
                 equivariant; a negative control.
In the single form (g = v) every exact index reduces to a function of v^-1 m, which sees the
group axis.

Two query forms:
  ``"sum"`` (GSA-Nets Eq. 15-16): out(i, v) = sum_g softmax_{(j, m)}(...) val_jm, one softmax
      per (v, g). The spatial term does not depend on m and the others not on v, so each
      softmax is an inner softmax over m times an outer softmax over j
      (:mod:`symattn_cli.nn.gsa.core`): the N^3 P^2 logit tensor of the reference is never
      formed, only N^2 P^2 ones, a chunk of queries at a time.
  ``"single"``: one query per output element, g = v: N times cheaper, same law.
Lifting is the ``"sum"`` form with one query and one key element per point.

Memory and speed: the core (:mod:`symattn_cli.nn.gsa.core`) keeps only q, k, v and the
encodings for the backward pass and recomputes the rest there. On CPU it runs a fused C++
kernel over torch's intra-op threads, on CUDA a fused Triton kernel; elsewhere (or with
``attention_backend="torch"``) a plain PyTorch version over chunks of queries
(``chunk_elements`` numbers in the largest chunk tensor; 0 = :data:`AUTO_CHUNK` for the
device). Global layers evaluate the spatial encoding once per distinct offset, not per
(query, key) pair. A layer computes its geometry (neighbourhoods, masks, offsets, the spatial
encoding's inputs) once per input size, dtype and device, and keeps it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from symattn_cli.groups import Group, grid_coordinates
from symattn_cli.nn.gsa.core import factorised_attention
from symattn_cli.nn.gsa.dense import dense_attention, dense_weights
from symattn_cli.nn.pointwise import Pointwise2d, pointwise
from symattn_cli.nn.positional import RelativePositionEncoding

# the options' choices and defaults (re-exported here for the layer's users)
from symattn_cli.options import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GROUP_INDEX,
    DEFAULT_POSITION,
    DEFAULT_QUERY_FORM,
    GROUP_INDEX,
    POSITION_KINDS,
    QUERY_FORMS,
)

# Numbers in the largest chunk tensor of the torch backend: cache-sized on CPU, large on GPUs
# where every operation is a kernel launch.
AUTO_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 26}


class GroupSelfAttention(nn.Module):
    """Multi-head group self-attention on ``G = R^2 x| H``, local (P x P) or global (GSA-Nets
    Eq. 15-16).

    For output pixel x_i and group element v, with per-head 1x1 maps q, k, val of the input f
    and j over the P x P neighbourhood of x_i (every pixel when global):
        out(x_i, v) = W_out sum_g sum_(j, m) softmax_(j, m)(q(x_i, g) . (k(x_j, m)
                      + rho(v, g, j, m)) / sqrt(d)) val(x_j, m),
        rho = [rho_xy(v^-1 (x_j - x_i)), rho_H[idx(v, g, m)]]
    (heads concatenated before W_out; ``query_form="single"`` keeps only the term g = v).

    Shapes (B batch, C channels, N = |H|, H/W height/width, I points):
        ``forward(x, crop=0)``: ``(B, C_in, N, H, W) -> (B, C_out, N, H - 2 crop, W - 2 crop)``;
        with ``lifting=True`` (see :class:`LiftingSelfAttention`): ``(B, C_in, H, W) ->
        (B, C_out, N, H, W)``.
        ``forward_points(x, coords)`` (global layers): ``(B, C_in, N, I)`` with ``coords``
        ``(I, 2)`` -> ``(B, C_out, N, I)``.

    Group action: ``layer(L_g f) = L_g layer(f)`` with ``(L_g f)(x, h) = f(u^-1 (x - t),
    u^-1 h)`` for g = (t, u) on input and output. Exact up to rounding for every u that maps
    the pixel grid onto itself (quarter turns and the flip: ``group.grid_exact_elements()``;
    quarter turns need square maps), and for translations when no neighbourhood crosses the
    border. Every u in H (45 degrees for r8) is exact in ``forward_points``, where the points'
    coordinates are rotated instead of the pixels.

    Options (keyword-only):
        ``group``: a :class:`~symattn_cli.groups.Group` (``get_group(name)``).
        ``in_channels``, ``out_channels``, ``heads``: positive integers.
        ``head_dim``: channels per head; None (default) is ``max(out_channels // 2, 1)``.
        ``patch_size``: an odd side P for P x P local attention (default 5); None: global.
        ``query_form``: ``"sum"`` (default, Eq. 16) or ``"single"`` (g = v only, N times
        cheaper, same law).
        ``group_index``: ``"gevit"`` (default) or ``"pair"``: exact and not blind to the
        group axis; ``"relative"``: exact but blind in the sum form; ``"shifted"``: not
        equivariant, a negative control.
        ``position``: ``"relative"`` (default: rho_xy, an MLP on continuous offsets) or
        ``"none"``; ``position_hidden``: that MLP's width (default 16); ``max_offset``: the
        scale of its offsets, None (default) for the patch radius, or the longest offset
        when global.
        ``attention_dropout``: a probability (default 0.0).
        ``attention_backend``: ``"auto"`` (default), ``"cpp"``, ``"triton"``,
        ``"triton_tiles"``, ``"torch"`` or ``"dense"`` (the reference): one function,
        different kernels.
        ``checkpointing``: recompute the attention in the backward (default True);
        ``chunk_elements``: numbers per chunk of the torch backend, 0 (default) automatic.
        ``lifting``: False (default); True makes the lifting layer.
    """

    def __init__(
        self,
        *,
        group: Group,
        in_channels: int,
        out_channels: int,
        heads: int,
        head_dim: int | None = None,
        patch_size: int | None = 5,
        lifting: bool = False,
        query_form: str = DEFAULT_QUERY_FORM,
        attention_dropout: float = 0.0,
        position: str = DEFAULT_POSITION,
        position_hidden: int = 16,
        max_offset: float | None = None,
        group_index: str = DEFAULT_GROUP_INDEX,
        checkpointing: bool = True,
        chunk_elements: int = 0,
        attention_backend: str = DEFAULT_ATTENTION_BACKEND,
    ) -> None:
        super().__init__()
        if not isinstance(group, Group):
            raise TypeError(f"group must be a Group object (use get_group(name)), got {group!r}")
        if patch_size is not None and (patch_size < 1 or patch_size % 2 == 0):
            raise ValueError(
                f"patch_size={patch_size} must be odd, or None for global attention "
                "(model.patch_size=global in a config)"
            )
        if query_form not in QUERY_FORMS:
            raise ValueError(f"query_form={query_form!r}; choose one of {QUERY_FORMS}")
        if group_index not in GROUP_INDEX:
            raise ValueError(f"group_index={group_index!r}; choose one of {GROUP_INDEX}")
        if position not in POSITION_KINDS:
            raise ValueError(f"position={position!r}; choose one of {POSITION_KINDS}")
        if chunk_elements < 0:
            raise ValueError(f"chunk_elements={chunk_elements} must be >= 0 (0 = automatic)")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={attention_backend!r}; choose one of {ATTENTION_BACKENDS}"
            )
        self.group = group
        self.heads = heads
        self.head_dim = head_dim or max(out_channels // 2, 1)
        self.patch_size = patch_size
        self.lifting = lifting
        self.query_form = "sum" if lifting else query_form
        self.group_index = group_index
        self.max_offset = max_offset
        self.checkpointing = checkpointing
        self.chunk_elements = chunk_elements
        self.attention_backend = attention_backend
        d, inner = self.head_dim, heads * self.head_dim

        # 1x1 maps over the channels of (B, C, M, ...), as matrix products (Conv2d parameters)
        self.query = Pointwise2d(in_channels, inner)
        self.key = Pointwise2d(in_channels, inner)
        self.value = Pointwise2d(in_channels, inner)
        self.w_out = Pointwise2d(inner, out_channels)

        # rho = [rho_xy (2 * d//3 or 2 * d//2 channels), rho_H (the rest)], shared by heads.
        per_axis = d // 2 if lifting else d // 3
        self.position = (
            RelativePositionEncoding(dim_per_axis=per_axis, hidden=position_hidden)
            if position == "relative"
            else None
        )
        self.pos_dim = 2 * per_axis if self.position is not None else 0
        group_dim = 0 if lifting else d - self.pos_dim  # rho_H: q's channels after rho_xy
        rows, index = group_index_table(group, group_index)
        self.register_buffer("group_index_table", index, persistent=False)  # (V, G, M) or (G, M)
        self.group_embedding = nn.Parameter(torch.randn(rows, group_dim)) if group_dim > 0 else None
        self.attention_dropout = nn.Dropout(attention_dropout)
        # neighbourhoods, offsets and the spatial MLPs' inputs per (sizes, dtype, device):
        # they depend on no parameter (:meth:`_constant`)
        self._constants: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ public
    def forward(self, x: torch.Tensor, crop: int = 0) -> torch.Tensor:
        """Images ``(B, C, H, W)`` (lifting) or group features ``(B, C, N, H, W)``.

        ``crop`` > 0 returns only the output pixels ``crop`` away from every border (the
        local path then computes no queries for the others).
        """
        x = self._as_group_features(x)  # (B, C, M, H, W)
        b, _, m, height, width = x.shape
        if 2 * crop >= min(height, width):
            raise ValueError(f"crop={crop} leaves nothing of a {height}x{width} map")
        if self.patch_size is not None:
            return self._attend_local(x, crop)
        geometry = self._constant(
            ("grid", height, width, x.dtype, x.device),
            lambda: self._point_geometry(
                grid_coordinates(height, width, dtype=x.dtype, device=x.device).reshape(-1, 2)
            ),
        )
        out = self._attend_points(x.reshape(b, -1, m, height * width), geometry)
        out = out.reshape(b, -1, self.group.order, height, width)  # (B, C_out, N, H, W)
        return out[..., crop : height - crop, crop : width - crop]

    def forward_points(self, x: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """Global attention on a point set: ``x`` ``(B, C, I)`` (lifting) or ``(B, C, N, I)``,
        ``coords`` ``(I, 2)`` in (x, y) order; returns ``(B, C_out, N, I)``.

        Rotating ``coords`` by any u in H (45 degrees for r8, say) permutes the output's
        group axis exactly: no pixels, no interpolation.
        """
        if self.patch_size is not None:
            raise ValueError("forward_points needs a global layer (patch_size=None)")
        if self.lifting:
            x = x.unsqueeze(2)  # (B, C, 1, I)
        return self._attend_points(x, self._point_geometry(coords.to(x.dtype)))

    @torch.no_grad()
    def attention_weights(self, x: torch.Tensor, pixel: tuple[int, int]) -> torch.Tensor:
        """The attention probabilities of the query at ``pixel`` = (row, column), computed
        explicitly by the reference algorithm (:func:`dense_weights`; no chunks, no dropout) for
        inspection and plots.

        ``x``: one image ``(1, C, H, W)`` (lifting) or group feature map ``(1, C, N, H, W)``.
        Returns ``(heads, V, G, P, P, M)`` for a local layer, ``(heads, V, G, H, W, M)`` for a
        global one: for output element v and query element g (G = 1 when lifting, and in the
        single form, where g = v), the weight of the key at neighbourhood offset (row, column),
        or at that pixel, and group element m. Each (head, v, g) sums to 1; neighbours outside
        the image get 0. With the layer's value and output maps these weights give the
        layer's output at ``pixel``.
        """
        x = self._as_group_features(x)  # (1, C, M, H, W)
        if x.shape[0] != 1:
            raise ValueError(f"attention_weights takes one input, got a batch of {x.shape[0]}")
        height, width = x.shape[-2:]
        row, col = pixel
        if not (0 <= row < height and 0 <= col < width):
            raise ValueError(f"pixel {pixel} is outside the {height}x{width} map")
        q, k, _ = self._qkv(x)  # (h, d, M, H, W), q scaled by 1/sqrt(d)
        h, d, m = q.shape[:3]
        q = q[..., row, col].transpose(1, 2)[:, None]  # (h, 1, G, d): the one query
        k = k.permute(0, 3, 4, 2, 1).reshape(h, height * width, m, d)  # (h, HW, M, d)
        if self.patch_size is None:  # every pixel, as _attend_points
            side = (height, width)
            coords = grid_coordinates(height, width, dtype=x.dtype, device=x.device)  # (H, W, 2)
            offsets = (coords - coords[row, col]).reshape(-1, 2)  # (J, 2): x_j - x_i
            longest = (coords[0, 0] - coords[-1, -1]).norm().clamp_min(1.0)  # corner to corner
            scale = self.max_offset or float(longest)
            rho_xy = self._spatial(self._arguments(offsets, scale))  # (V, J, E)
            neighbour, valid = torch.arange(height * width, device=x.device)[None], None
        else:  # the P x P neighbourhood, as _attend_local
            p, r = self.patch_size, self.patch_size // 2
            side = (p, p)
            top, left = (torch.tensor([i - r], device=x.device) for i in pixel)
            neighbour, valid = neighbourhoods(top, left, p, height, width)  # (1, J) each
            offsets = grid_coordinates(p, p, dtype=x.dtype, device=x.device)  # (P, P, 2)
            offsets = offsets.reshape(-1, 2)  # (J, 2)
            rho_xy = self._spatial(self._arguments(offsets, self.max_offset or max(r, 1)))
        weights = dense_weights(
            q, k, self._group_encoding(), rho_xy, None, neighbour, valid, form=self.query_form,
            n=self.group.order, rows=slice(0, 1),
        )  # fmt: skip
        return weights.reshape(*weights.shape[:3], *side, m)  # (h, V, G, P, P, M)

    # ------------------------------------------------------------------ encodings
    def _as_group_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.lifting:
            if x.dim() != 4:
                raise ValueError(f"lifting expects images (B, C, H, W), got {tuple(x.shape)}")
            return x.unsqueeze(2)  # (B, C, 1, H, W)
        if x.dim() != 5 or x.shape[2] != self.group.order:
            raise ValueError(
                f"group self-attention expects (B, C, N={self.group.order}, H, W), "
                f"got {tuple(x.shape)}"
            )
        return x

    def _constant(self, key: tuple, build):
        """``build()``, computed once per ``key`` (sizes, dtype, device) and kept: the layer's
        geometry, which depends on no parameter. Built outside inference mode, so that a
        first call under ``torch.inference_mode`` leaves tensors that training can use."""
        if key not in self._constants:
            with torch.inference_mode(False), torch.no_grad():
                self._constants[key] = build()
        return self._constants[key]

    def _arguments(self, offsets: torch.Tensor, scale: float):
        """The spatial encoding's inputs at v^-1 offsets / scale for every v
        (:meth:`RelativePositionEncoding.arguments`), or None without a spatial encoding."""
        if self.position is None:
            return None
        inv = self.group.matrices(offsets.dtype, offsets.device)[self.group.inverse]  # (V, 2, 2)
        return self.position.arguments(offsets, inv, scale)

    def _spatial(self, arguments):
        """rho_xy(v^-1 offsets) ``(V, ..., E)`` from :meth:`_arguments`, or None."""
        return None if arguments is None else self.position.encode(*arguments)

    def _group_encoding(self):
        """rho_H at the group index, ``(G, M, E)``, or ``(V, G, M, E)`` for an index that
        depends on v; None without a group term. The core's kernels read the table and the
        index instead (:func:`factorised_attention`)."""
        if self.group_embedding is None:
            return None
        return self.group_embedding[self.group_index_table]

    def _qkv(self, x: torch.Tensor, crop: int = 0):
        """``x`` ``(B, C, M, ...)`` -> q (scaled by 1/sqrt(d)), k, v each ``(Z, d, M, ...)``,
        contiguous (the layout of the fused CPU kernel: no copy in between); q only at the
        pixels ``crop`` away from every border (the queries of a cropped layer)."""
        b, _, m = x.shape[:3]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b * self.heads, self.head_dim, m, *t.shape[3:])

        inner = x[..., crop : x.shape[-2] - crop, crop : x.shape[-1] - crop] if crop else x
        scale = 1.0 / math.sqrt(self.head_dim)  # in the map's weights: no scaled copy of q
        q = pointwise(inner, self.query.weight * scale, self.query.bias * scale)
        return heads(q), heads(self.key(x)), heads(self.value(x))

    def _output(self, out: torch.Tensor, b: int, spatial: tuple[int, ...]) -> torch.Tensor:
        """``(Z, L, V, d)`` -> W_out -> ``(B, C_out, N, *spatial)``."""
        n_points = math.prod(spatial)
        out = out.reshape(b, self.heads, n_points, self.group.order, self.head_dim)
        out = out.permute(0, 1, 4, 3, 2).reshape(b, -1, self.group.order, n_points)  # (B,hd,V,L)
        return self.w_out(out).reshape(b, -1, self.group.order, *spatial)

    def _attend(self, q, k, v, rho_xy, offsets, neighbour, valid) -> torch.Tensor:
        """q ``(Z, L, G, d)`` (scaled), k, v ``(Z, Lkv, M, d)``, neighbours ``(L, J)``, spatial
        encoding ``rho_xy`` ``(V, D, E)`` at ``offsets`` ``(L, J)`` (None: local) -> ``(Z, L,
        V, d)``.

        The shared core of every layer kind: :func:`factorised_attention`, or with
        ``attention_backend="dense"`` the reference algorithm.
        """
        z, _, g, d = q.shape
        m, j, n = k.shape[2], neighbour.shape[1], self.group.order
        per_query = z * j * max(g * m, g * n, g * d, m * d)
        table, index = self.group_embedding, self.group_index_table
        if table is not None and index.dim() == 3 and self.query_form == "sum":
            per_query *= n  # the group term, and with it pi, depends on v
        budget = self.chunk_elements or AUTO_CHUNK.get(q.device.type, AUTO_CHUNK["cuda"])
        drop = self.attention_dropout.p if self.training else 0.0
        if self.attention_backend == "dense":
            seed = int(torch.randint(1 << 62, (), device="cpu")) if drop > 0 else 0
            return dense_attention(
                q, k, v, self._group_encoding(), rho_xy, offsets, neighbour, valid,
                form=self.query_form, n=n, drop=drop, seed=seed,
                chunk=max(1, budget // (per_query * n * g)),
            )  # fmt: skip
        # the table and its index: the fused CPU kernel gathers the logits per query
        return factorised_attention(
            q, k, v, table, rho_xy, offsets, neighbour, valid, form=self.query_form, n=n,
            drop=drop, chunk=max(1, budget // per_query), recompute=self.checkpointing,
            backend=self.attention_backend, group_index=None if table is None else index,
        )  # fmt: skip

    # ------------------------------------------------------------------ local (P x P)
    def _attend_local(self, x: torch.Tensor, crop: int) -> torch.Tensor:
        """Local attention: each output pixel attends to its P x P neighbourhood.

        Keys and values are flattened to ``(Z, H*W, M, d)``; the neighbour at offset (dy, dx)
        of output pixel (y, x) is pixel (y + dy, x + dx). Neighbours outside the image are
        masked out (their flat index is clamped into the map, whose key then takes no weight
        and gets no gradient). The queries are the output pixels, from (crop, crop) to
        (H-1-crop, W-1-crop), in flat order: along a row their neighbours at one offset are
        consecutive pixels (a kernel reads a tile's keys as runs).
        """
        b, _, m, height, width = x.shape
        p, r = self.patch_size, self.patch_size // 2
        q, k, v = self._qkv(x, crop)  # q (Z, d, G, H', W'), k, v (Z, d, M, H, W)
        z, d = q.shape[:2]
        # views in the core's (Z, points, M, d) order: each backend copies into its own layout
        k = k.reshape(z, d, m, height * width).permute(0, 3, 2, 1)  # (Z, Lkv, M, d)
        v = v.reshape(z, d, m, height * width).permute(0, 3, 2, 1)  # (Z, Lkv, M, d)
        out_h, out_w = height - 2 * crop, width - 2 * crop
        q = q.reshape(z, d, m, out_h * out_w).permute(0, 3, 2, 1)  # (Z, L, G, d)

        def geometry():
            dev = x.device
            tops = torch.arange(out_h, device=dev).repeat_interleave(out_w) + (crop - r)  # (L,)
            lefts = torch.arange(out_w, device=dev).repeat(out_h) + (crop - r)  # (L,)
            neighbour, inside = neighbourhoods(tops, lefts, p, height, width)  # (L, J) each
            valid = inside if crop < r else None  # some neighbourhood reaches outside the map
            offsets = grid_coordinates(p, p, dtype=x.dtype, device=dev).reshape(-1, 2)  # (J, 2)
            return neighbour, valid, self._arguments(offsets, self.max_offset or max(r, 1))

        key = ("local", height, width, crop, x.dtype, x.device)
        neighbour, valid, arguments = self._constant(key, geometry)
        rho_xy = self._spatial(arguments)  # (V, J, E)
        out = self._attend(q, k, v, rho_xy, None, neighbour, valid)  # (Z, L, V, d)
        return self._output(out, b, (out_h, out_w))

    # ------------------------------------------------------------------ global
    def _point_geometry(self, coords: torch.Tensor):
        """For points ``coords`` ``(I, 2)``: the spatial encoding's inputs at the distinct
        offsets x_j - x_i (:func:`offset_table`), each pair's index into them ``(I, J)``, and
        every point as every query's neighbour ``(I, J)``."""
        n_points = coords.shape[0]
        offsets = coords[None, :, :] - coords[:, None, :]  # (I, J, 2): x_j - x_i
        scale = self.max_offset or float(offsets.norm(dim=-1).amax().clamp_min(1.0))
        distinct, index = offset_table(offsets)  # (D, 2), (I, J) into D
        everyone = torch.arange(n_points, device=coords.device).expand(n_points, n_points)
        return self._arguments(distinct, scale), index, everyone

    def _attend_points(self, x: torch.Tensor, geometry) -> torch.Tensor:
        """Global attention, ``x`` ``(B, C, M, I)`` -> ``(B, C_out, N, I)``, on the points of
        ``geometry`` (:meth:`_point_geometry`)."""
        b, _, m, n_points = x.shape
        arguments, index, everyone = geometry
        q, k, v = (t.permute(0, 3, 2, 1) for t in self._qkv(x))  # (Z, I, M, d), views
        rho_xy = self._spatial(arguments)  # (V, D, E): once per distinct offset
        out = self._attend(q, k, v, rho_xy, index, everyone, None)  # (Z, I, V, d)
        return self._output(out, b, (n_points,))


def offset_table(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct offsets of ``offsets`` ``(I, J, 2)`` in (x, y) order, ``(D, 2)``
    ((2H-1)(2W-1) on a grid), and the index of each pair's offset ``(I, J)``. Sorted by y,
    then by x from right to left: as a query moves right along an image row, its offsets
    x_j - x_i fall, so consecutive queries read consecutive entries, rising by one; on the
    next image row down, y_i is lower and the offsets' y higher, so its entries lie above.
    Three sorts of numbers (x, y, then the pairs' (y, -x) ranks as one integer), not a sort
    of (I J, 2) rows."""
    ux, ix = torch.unique(offsets[..., 0], return_inverse=True)
    uy, iy = torch.unique(offsets[..., 1], return_inverse=True)
    left = len(ux) - 1 - ix  # x's rank from the right
    keys, index = torch.unique(iy * len(ux) + left, return_inverse=True)
    return torch.stack([ux.flip(0)[keys % len(ux)], uy[keys // len(ux)]], dim=-1), index


def group_index_table(group: Group, kind: str) -> tuple[int, torch.Tensor]:
    """The rows of the group embedding and the index of the row each (v, g, m) reads:
    ``(V, G, M)`` for ``pair``, ``gevit`` and ``shifted``, ``(G, M)`` for ``relative`` (see
    the module docstring for the laws each satisfies)."""
    n, table, inv, rel = group.order, group.cayley, group.inverse, group.relative
    if kind == "relative":
        return n, rel.clone()  # (G, M): g^-1 m
    if kind == "pair":
        return n * n, rel[:, :, None] * n + rel[None, :, :]  # (V, G, M): (v^-1 g, g^-1 m)
    if kind == "gevit":
        g = torch.arange(n)[:, None]
        gmg = table[table[g, inv[None, :]], g]  # (G, M): g m^-1 g
        return n, table[inv[:, None, None], gmg[None]]  # (V, G, M): v^-1 g m^-1 g
    if kind == "shifted":
        return n, table[:, rel]  # (V, G, M): v g^-1 m
    raise ValueError(f"group_index={kind!r}; choose one of {GROUP_INDEX}")


def neighbourhoods(tops: torch.Tensor, lefts: torch.Tensor, p: int, height: int, width: int):
    """The P x P neighbourhoods whose top-left pixels are (tops[a], lefts[a]) on a height x
    width map: flat pixel indices ``(A, P P)``, and which neighbours lie inside ``(A, P P)``.
    A neighbour outside (masked out) keeps its flat index row * width +
    column, clamped into [0, height * width): left and right of the image that is a pixel of
    the row above or below, so that consecutive queries keep consecutive neighbours."""
    offsets = torch.arange(p, device=tops.device)
    rows = tops[:, None, None] + offsets[None, :, None]  # (A, P, 1)
    cols = lefts[:, None, None] + offsets[None, None, :]  # (A, 1, P)
    index = (rows * width + cols).clamp(0, height * width - 1)  # (A, P, P)
    inside = (rows >= 0) & (rows < height) & (cols >= 0) & (cols < width)  # (A, P, P)
    return index.reshape(-1, p * p), inside.reshape(-1, p * p)


class LiftingSelfAttention(GroupSelfAttention):
    """Multi-head lifting self-attention: images to group features (GSA-Nets Eq. 13-14).

    For output pixel x_i and group element v, with per-head 1x1 maps q, k, val of the image f
    and j over the P x P neighbourhood of x_i (every pixel when global):
        out(x_i, v) = W_out sum_j softmax_j(q(x_i) . (k(x_j) + rho_xy(v^-1 (x_j - x_i)))
                      / sqrt(d)) val(x_j)
    (heads concatenated before W_out): one attention per group element v, which sees the
    neighbourhood through the spatial encoding turned by v^-1.

    Shapes (B batch, C channels, N = |H|, H/W height/width, I points):
        ``forward(x, crop=0)``: ``(B, C_in, H, W) -> (B, C_out, N, H - 2 crop, W - 2 crop)``.
        ``forward_points(x, coords)`` (global layers): ``(B, C_in, I)`` with ``coords``
        ``(I, 2)`` -> ``(B, C_out, N, I)``.

    Group action: the input is an image, ``(L_g f)(x) = f(u^-1 (x - t))``, the output group
    features, ``(L_g o)(x, h) = o(u^-1 (x - t), u^-1 h)``: ``layer(L_g f) = L_g layer(f)``.
    Exact up to rounding for every u that maps the pixel grid onto itself (quarter turns and
    the flip, on square maps for quarter turns), and for translations when no neighbourhood
    crosses the border; every u in H in ``forward_points``.

    Options (keyword-only), as :class:`GroupSelfAttention`: ``group``, ``in_channels``,
    ``out_channels``, ``heads``; ``head_dim`` (None: ``max(out_channels // 2, 1)``),
    ``patch_size`` (odd P, default 5; None: global), ``attention_dropout`` (0.0),
    ``position`` (``"relative"`` or ``"none"``), ``position_hidden`` (16), ``max_offset``
    (None), ``attention_backend`` (``"auto"``), ``checkpointing`` (True), ``chunk_elements``
    (0). There is no group axis in the input, so no ``query_form`` or ``group_index``.
    """

    def __init__(
        self,
        *,
        group: Group,
        in_channels: int,
        out_channels: int,
        heads: int,
        head_dim: int | None = None,
        patch_size: int | None = 5,
        attention_dropout: float = 0.0,
        position: str = DEFAULT_POSITION,
        position_hidden: int = 16,
        max_offset: float | None = None,
        checkpointing: bool = True,
        chunk_elements: int = 0,
        attention_backend: str = DEFAULT_ATTENTION_BACKEND,
    ) -> None:
        super().__init__(
            group=group, in_channels=in_channels, out_channels=out_channels, heads=heads,
            head_dim=head_dim, patch_size=patch_size, lifting=True,
            attention_dropout=attention_dropout, position=position,
            position_hidden=position_hidden, max_offset=max_offset, checkpointing=checkpointing,
            chunk_elements=chunk_elements, attention_backend=attention_backend,
        )  # fmt: skip


def lifting_self_attention(**kwargs) -> LiftingSelfAttention:
    """:class:`LiftingSelfAttention`: ``(B, C, H, W) -> (B, C', N, H, W)`` (GSA-Nets Eq. 14)."""
    return LiftingSelfAttention(**kwargs)


def group_self_attention(**kwargs) -> GroupSelfAttention:
    """Group layer ``(B, C, N, H, W) -> (B, C', N, H, W)`` (GSA-Nets Eq. 16)."""
    return GroupSelfAttention(lifting=False, **kwargs)
