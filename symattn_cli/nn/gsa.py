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
    content  q_ig . k_jm                   (i, g, j, m)
    spatial  q_ig . rho_xy(v^-1 (x_j - x_i)) (i, v, g, j)       GSA-Nets Eq. 14 / 16
    group    q_ig . rho_H(g^-1 m)           (i, g, m)
The group term's argument g^-1 m is invariant under (v, g, m) -> (u v, u g, u m), which is what
makes the layer exactly equivariant, dihedral groups included (the reference indexes it by
m - g + v, which is not; ``group_index="shifted"`` reproduces that as a negative control).

Two query forms:
  ``"sum"`` (GSA-Nets Eq. 15-16): out(i, v) = sum_g softmax_{(j, m)}(...) val_jm, one softmax
      per (v, g). Since the spatial term does not depend on m and the others not on v, the
      softmax of the sum is a normalised product exp(content + group) * exp(spatial): the
      N^3 P^2 logit tensor of the reference is never formed, only N^2 P^2 ones.
  ``"single"``: one query per output element, g = v: N times cheaper, same law.
Lifting is the ``"sum"`` form with one query and one key element per point.

Memory: the core runs over chunks of Z and, when training, recomputes each chunk in the
backward pass (activation checkpointing), so only the small q, k, v survive the forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from symattn_cli.groups import Group, grid_coordinates
from symattn_cli.nn.positional import RelativePositionEncoding

QUERY_FORMS = ("sum", "single")
GROUP_INDEX = ("relative", "shifted")
POSITION_KINDS = ("relative", "none")


class GroupSelfAttention(nn.Module):
    """Multi-head local (P x P) or global lifting / group self-attention on ``G = R^2 x| H``.

    ``lifting=True``: ``(B, C_in, H, W) -> (B, C_out, N, H, W)`` (GSA-Nets Eq. 13-14).
    ``lifting=False``: ``(B, C_in, N, H, W) -> (B, C_out, N, H, W)`` (Eq. 15-16, or the
    single-query form). ``patch_size=None`` attends globally.
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
        query_form: str = "sum",
        attention_dropout: float = 0.0,
        position: str = "relative",
        position_hidden: int = 16,
        max_offset: float | None = None,
        group_index: str = "relative",
        checkpointing: bool = True,
        chunk_elements: int = 1 << 22,
    ) -> None:
        super().__init__()
        if not isinstance(group, Group):
            raise TypeError(f"group must be a Group object (use get_group(name)), got {group!r}")
        if patch_size is not None and (patch_size < 1 or patch_size % 2 == 0):
            raise ValueError(f"patch_size={patch_size} must be odd (or None for global)")
        if query_form not in QUERY_FORMS:
            raise ValueError(f"query_form={query_form!r}; choose one of {QUERY_FORMS}")
        if group_index not in GROUP_INDEX:
            raise ValueError(f"group_index={group_index!r}; choose one of {GROUP_INDEX}")
        if position not in POSITION_KINDS:
            raise ValueError(f"position={position!r}; choose one of {POSITION_KINDS}")
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
        d, inner = self.head_dim, heads * self.head_dim

        # 1x1 maps on (B, C, M, I), applied as Conv2d over the (M, I) axes.
        self.query = nn.Conv2d(in_channels, inner, 1)
        self.key = nn.Conv2d(in_channels, inner, 1)
        self.value = nn.Conv2d(in_channels, inner, 1)
        self.w_out = nn.Conv2d(inner, out_channels, 1)

        # rho = [rho_xy (2 * d//3 or 2 * d//2 channels), rho_H (the rest)], shared by heads.
        per_axis = d // 2 if lifting else d // 3
        self.position = (
            RelativePositionEncoding(dim_per_axis=per_axis, hidden=position_hidden)
            if position == "relative"
            else None
        )
        self.pos_dim = 2 * per_axis if self.position is not None else 0
        group_dim = 0 if lifting else d - 2 * per_axis
        self.group_embedding = (
            nn.Parameter(torch.randn(group.order, group_dim)) if group_dim > 0 else None
        )
        self.attention_dropout = nn.Dropout(attention_dropout)

    # ------------------------------------------------------------------ public
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` (lifting) or group features ``(B, C, N, H, W)``."""
        x = self._as_group_features(x)  # (B, C, M, H, W)
        b, _, m, height, width = x.shape
        coords = grid_coordinates(height, width, dtype=x.dtype).to(x.device).reshape(-1, 2)
        out = self._attend(x.reshape(b, -1, m, height * width), coords, (height, width))
        return out.reshape(b, -1, self.group.order, height, width)  # (B, C_out, N, H, W)

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
        return self._attend(x, coords.to(x.dtype), None)

    # ------------------------------------------------------------------ core
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

    def _attend(self, x: torch.Tensor, coords: torch.Tensor, grid) -> torch.Tensor:
        """``x`` ``(B, C, M, I)`` -> ``(B, C_out, N, I)``; ``grid`` is (H, W) when local."""
        b, _, m, n_points = x.shape
        h, d, n = self.heads, self.head_dim, self.group.order
        q = self.query(x).reshape(b * h, d, m, n_points)  # (Z, d, G, I)
        k = self.key(x).reshape(b * h, d, m, n_points)  # (Z, d, M, I)
        v = self.value(x).reshape(b * h, d, m, n_points)  # (Z, d, M, I)

        inv_mats = self.group.matrices(x.dtype).to(x.device)[self.group.inverse]  # (V, 2, 2)
        valid = None
        if self.patch_size is not None:
            if grid is None:
                raise ValueError("local attention needs a grid")
            p = self.patch_size
            offsets = grid_coordinates(p, p, dtype=x.dtype).to(x.device).reshape(-1, 2)  # (J, 2)
            scale = self.max_offset or max(p // 2, 1)
            ones = torch.ones(1, 1, *grid, dtype=x.dtype, device=x.device)
            valid = F.unfold(ones, p, padding=p // 2)[0] > 0.5  # (J, I)
        else:
            offsets = coords[None, :, :] - coords[:, None, :]  # (I, J, 2): x_j - x_i
            scale = self.max_offset or float(offsets.norm(dim=-1).amax().clamp_min(1.0))
        rho_xy = None
        if self.position is not None:
            rho_xy = self.position(offsets, inv_mats, scale)  # (V, J, E) or (V, I, J, E)
        rho_h = None
        if self.group_embedding is not None:
            if self.group_index == "relative":
                rho_h = self.group_embedding[self.group.relative]  # (G, M, E): rho_H(g^-1 m)
            else:  # negative control: the reference's (m - g + v) index, v-dependent
                idx = self.group.cayley[:, self.group.relative]  # (V, G, M): v g^-1 m
                rho_h = self.group_embedding[idx]  # (V, G, M, E)

        z = q.shape[0]
        n_keys = valid.shape[0] if valid is not None else n_points
        per_z = n_points * n_keys * (m * m + n * m + 2 * d * m)
        step = max(1, self.chunk_elements // max(per_z, 1))
        use_ckpt = self.checkpointing and torch.is_grad_enabled() and self.training
        outs = []
        for start in range(0, z, step):
            sl = slice(start, start + step)
            args = (q[sl], k[sl], v[sl], rho_xy, rho_h, valid, grid)
            if use_ckpt:
                outs.append(checkpoint(self._chunk, *args, use_reentrant=False))
            else:
                outs.append(self._chunk(*args))
        out = torch.cat(outs, dim=0)  # (Z, I, V, d)
        out = out.reshape(b, h, n_points, n, d).permute(0, 1, 4, 3, 2)  # (B, h, d, V, I)
        return self.w_out(out.reshape(b, h * d, n, n_points))  # (B, C_out, N, I)

    def _chunk(self, q, k, v, rho_xy, rho_h, valid, grid) -> torch.Tensor:
        """One chunk of Z: q ``(z, d, G, I)``, k, v ``(z, d, M, I)`` -> ``(z, I, V, d)``.

        Keys are laid out ``(J, M)`` and logits ``(z, I, J, M, G)`` so that every contraction
        is a batched matrix product over contiguous memory.
        """
        zc, d, m, n_points = k.shape
        g_size, n = q.shape[2], self.group.order
        scale = 1.0 / math.sqrt(d)
        e_xy = self.pos_dim
        q_t = q.permute(0, 3, 2, 1)  # (z, I, G, d)
        if valid is not None:  # local: gather the P x P neighbourhood of every query
            p = self.patch_size
            j = p * p
            k = F.unfold(k.reshape(zc, d * m, *grid), p, padding=p // 2)  # (z, d*M*J, I)
            v = F.unfold(v.reshape(zc, d * m, *grid), p, padding=p // 2)  # (z, d*M*J, I)
            k = k.reshape(zc, d, m, j, n_points).permute(0, 4, 3, 2, 1)  # (z, I, J, M, d)
            v = v.reshape(zc, d, m, j, n_points).permute(0, 4, 3, 2, 1)  # (z, I, J, M, d)
        else:  # global: every point is a neighbour of every query
            j = n_points
            k = k.permute(0, 3, 2, 1)[:, None].expand(zc, n_points, j, m, d)  # (z, I, J, M, d)
            v = v.permute(0, 3, 2, 1)[:, None].expand(zc, n_points, j, m, d)  # (z, I, J, M, d)
        k = k.reshape(zc * n_points, j * m, d)  # (zI, JM, d)
        v = v.reshape(zc * n_points, j, m, d)  # (zI, J, M, d)
        logits = torch.matmul(k, q_t.reshape(zc * n_points, g_size, d).transpose(1, 2))
        logits = logits.view(zc, n_points, j, m, g_size)  # (z, I, J, M, G)
        shifted = rho_h is not None and rho_h.dim() == 4
        if rho_h is not None and not shifted:
            group_term = torch.einsum("zige,gme->zimg", q_t[..., e_xy:], rho_h)  # (z, I, M, G)
            logits = logits + group_term[:, :, None]  # (z, I, J, M, G)
        logits = logits * scale
        if valid is not None:
            outside = ~valid.T[None, :, :, None, None]  # (1, I, J, 1, 1)
            logits = logits.masked_fill(outside, float("-inf"))

        spatial = None
        if rho_xy is not None:  # q_ig . rho_xy(v^-1 (x_j - x_i))
            q_xy = q_t[..., :e_xy]  # (z, I, G, e)
            if rho_xy.dim() == 3:  # local: (V, J, e), one dense product
                spatial = q_xy.reshape(-1, e_xy) @ rho_xy.reshape(-1, e_xy).T  # (zIG, VJ)
                spatial = spatial.view(zc, n_points, g_size, n, j)  # (z, I, G, V, J)
            else:  # global: (V, I, J, e)
                spatial = torch.einsum("zige,vije->zigvj", q_xy, rho_xy)  # (z, I, G, V, J)
            spatial = spatial * scale

        if self.query_form == "single":  # g = v: one softmax over (j, m) per output element
            if spatial is not None:
                diag = torch.diagonal(spatial, dim1=2, dim2=3)  # (z, I, J, G)
                logits = logits + diag[:, :, :, None, :]  # (z, I, J, M, G)
            a = torch.exp(logits - logits.amax(dim=(2, 3), keepdim=True).detach())
            attn = a / a.sum(dim=(2, 3), keepdim=True)  # (z, I, J, M, G)
            attn = self.attention_dropout(attn).reshape(zc * n_points, j * m, g_size)
            out = attn.transpose(1, 2) @ v.reshape(zc * n_points, j * m, d)  # (zI, G, d)
            return out.view(zc, n_points, g_size, d)  # (z, I, V, d)

        if spatial is None:
            spatial = logits.new_zeros(zc, n_points, g_size, n, j)
        if shifted:  # negative control: v-dependent group term, full N^3 logits
            group_term = torch.einsum("zige,vgme->zimgv", q_t[..., e_xy:], rho_h) * scale
            full = logits[..., None] + group_term[:, :, None]  # (z, I, J, M, G, V)
            full = full + spatial.permute(0, 1, 4, 2, 3)[:, :, :, None]  # (z, I, J, M, G, V)
            full = full - full.amax(dim=(2, 3), keepdim=True).detach()
            attn = torch.exp(full) / torch.exp(full).sum(dim=(2, 3), keepdim=True)
            attn = self.attention_dropout(attn)
            v = v.reshape(zc, n_points, j, m, d)  # (z, I, J, M, d)
            return torch.einsum("zijmgv,zijmc->zivc", attn, v)  # (z, I, V, d)

        # softmax_{(j,m)}(a_jmg + s_gvj) = exp(a_jmg) exp(s_gvj) / sum_{j,m}(same)
        a = torch.exp(logits - logits.amax(dim=(2, 3), keepdim=True).detach())  # (z,I,J,M,G)
        s = torch.exp(spatial - spatial.amax(dim=-1, keepdim=True).detach())  # (z,I,G,V,J)
        a_sum = a.sum(dim=3).permute(0, 1, 3, 2).unsqueeze(-1)  # (z, I, G, J, 1)
        norm = torch.matmul(s, a_sum)  # (z, I, G, V, 1)
        # Dropout on exp(content + group) drops attention weights with a mask shared over v.
        a = self.attention_dropout(a).view(zc * n_points * j, m, g_size)  # (zIJ, M, G)
        weighted = torch.matmul(a.transpose(1, 2), v.reshape(-1, m, d))  # (zIJ, G, d)
        weighted = weighted.view(zc, n_points, j, g_size, d).transpose(2, 3)  # (z, I, G, J, d)
        num = torch.matmul(s, weighted)  # (z, I, G, V, d)
        return (num / norm).sum(dim=2)  # (z, I, V, d)


def lifting_self_attention(**kwargs) -> GroupSelfAttention:
    """Lifting layer ``(B, C, H, W) -> (B, C', N, H, W)`` (GSA-Nets Eq. 14)."""
    return GroupSelfAttention(lifting=True, **kwargs)


def group_self_attention(**kwargs) -> GroupSelfAttention:
    """Group layer ``(B, C, N, H, W) -> (B, C', N, H, W)`` (GSA-Nets Eq. 16)."""
    return GroupSelfAttention(lifting=False, **kwargs)
