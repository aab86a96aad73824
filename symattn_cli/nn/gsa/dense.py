"""The reference algorithm of the attention core, the test oracle: the full ``(V, G, J, M)``
logits of every query (GSA-Nets Eq. 16, :mod:`symattn_cli.nn.gsa.core`), one softmax over
``(J, M)`` each, plain autograd. Slow and obviously correct."""

from __future__ import annotations

import math

import torch

from symattn_cli.nn.gsa.common import DROP_STEPS, keep_mask, spatial_table


def dense_weights(q, k, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
                  rows: slice) -> torch.Tensor:  # fmt: skip
    """The reference algorithm's attention probabilities ``(P, V, G, J, M)`` (P = Z * Lc; G = 1
    in the single form, where g = v) for the queries q ``(Z, Lc, G, d)`` (scaled) at ``rows``
    of the layer's L: keys k ``(Z, Lkv, M, d)``, the layer's ``neighbour`` indices and
    ``valid`` ``(L, J)`` (or None); ``group_rho`` ``(G, M, E)`` or, v-dependent,
    ``(V, G, M, E)`` on q's last E channels; ``rho`` ``(V, D, e)`` on the first e, at
    ``offsets`` ``(L, J)`` (None: local). Full logits, plain autograd."""
    z, lc, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    p = z * lc
    k_nb = k[:, neighbour[rows]].view(p, j, m, d)  # (P, J, M, d)
    q2 = q.reshape(p, g, d)  # (P, G, d)
    full = torch.einsum("pgc,pjmc->pgjm", q2, k_nb)[:, None]  # (P, 1, G, J, M)
    if group_rho is not None:
        table = group_rho if group_rho.dim() == 4 else group_rho[None]  # (V or 1, G, M, E)
        gt = torch.einsum("pgc,vgmc->pvgm", q2[..., d - table.shape[-1] :], table)
        full = full + gt[:, :, :, None, :]  # (P, V or 1, G, J, M)
    if rho is not None:
        e = rho.shape[-1]
        table = spatial_table(rho, offsets, rows, j).expand(-1, lc, -1, -1)  # (V, Lc, J, e)
        s = torch.einsum("zlgc,vljc->zlvgj", q[..., :e], table).reshape(p, -1, g, j)
        full = full + s[..., None]  # (P, V, G, J, M)
    full = full.expand(p, n, g, j, m)
    if form == "single":  # g = v only
        full = torch.diagonal(full, dim1=1, dim2=2).permute(0, 3, 1, 2)[:, :, None]
    if valid is not None:
        mask = valid[rows].repeat(z, 1)[:, None, None, :, None]  # (P, 1, 1, J, 1)
        full = full.masked_fill(~mask, -math.inf)
    return torch.softmax(full.flatten(3), dim=-1).view_as(full)  # (P, V, G, J, M)


def dense_attention(q, k, v, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
                    drop: float = 0.0, seed: int = 0, chunk: int = 64) -> torch.Tensor:  # fmt: skip
    """The reference algorithm: full ``(P, V, G, J, M)`` logits (:func:`dense_weights`), plain
    autograd, over chunks of ``chunk`` queries; ``(Z, L, V, d)``.

    Same arguments as :func:`factorised_attention` except ``group_rho`` may be
    ``(V, G, M, E)``, a group encoding that depends on v (the reference's (m - g + v) index).
    Attention dropout multiplies the weights by :func:`keep_mask` of ``seed`` (the kernels'
    mask) and by 1 / (1 - drop). Memory grows as N^3 P^2 per query, as in the reference.
    """
    z, n_q, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    drop = round(drop * DROP_STEPS) / DROP_STEPS
    outs = []
    for lo in range(0, n_q, chunk):
        rows = slice(lo, min(lo + chunk, n_q))
        lc = rows.stop - rows.start
        attn = dense_weights(
            q[:, rows], k, group_rho, rho, offsets, neighbour, valid, form=form, n=n, rows=rows
        )  # (P, V, G, J, M)
        if drop > 0:
            keep = keep_mask(seed, (z, n_q, j, m, g), rows, drop, q.device)  # (Z, Lc, J, M, G)
            keep = keep.permute(0, 1, 4, 2, 3)  # (Z, Lc, G, J, M)
            # as attn: (P, 1, G, J, M), or (P, V = G, 1, J, M) in the single form
            keep = keep.reshape(z * lc, *((g, 1) if form == "single" else (1, g)), j, m)
            attn = attn * keep.to(attn.dtype) / (1.0 - drop)
        v_nb = v[:, neighbour[rows]].view(z * lc, j, m, d)  # (P, J, M, d)
        outs.append(torch.einsum("pvgjm,pjmc->pvc", attn, v_nb).view(z, lc, n, d))
    return torch.cat(outs, dim=1)  # (Z, L, V, d)
