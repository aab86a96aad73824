"""The ``torch`` backend of the attention core: the factorised algorithm
(:mod:`symattn_cli.nn.gsa.core`) in plain PyTorch over chunks of queries, each recomputed in
the backward (activation checkpointing), on any device."""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from symattn_cli.nn.gsa.common import DROP_STEPS, keep_mask, spatial_table


def _chunk(q, k, v, gl, rho, offsets, neighbour, valid, keep, rows, single, n):
    """The factorised algorithm for queries ``rows``, in plain PyTorch: ``(Z, Lc, V, d)``."""
    z, lc, g, d = q.shape
    j = neighbour.shape[1]
    nb = neighbour[rows]  # (Lc, J)
    k_nb, v_nb = k[:, nb], v[:, nb]  # (Z, Lc, J, M, d)
    c = torch.einsum("zlgc,zljmc->zljmg", q, k_nb)[:, :, None]  # (Z, Lc, 1, J, M, G)
    if gl is not None:  # (Z, Lc, M, G), or (Z, Lc, V, M, G) when it depends on v
        c = c + (gl[:, :, None, None] if gl.dim() == 4 else gl[:, :, :, None])
    lse = torch.logsumexp(c, dim=4)  # (Z, Lc, K', J, G), K' = V when gl depends on v, else 1
    pi = torch.exp(c - lse[..., None, :])  # (Z, Lc, K', J, M, G)
    if keep is not None:
        pi = pi * keep[:, :, None]
    t = lse  # (Z, Lc, K', J, G)
    if rho is not None:
        e = rho.shape[-1]
        table = spatial_table(rho, offsets, rows, j).expand(-1, lc, -1, -1)  # (V, Lc, J, e)
        if not single:
            t = t + torch.einsum("zlgc,vljc->zlvjg", q[..., :e], table)  # (Z, Lc, V, J, G)
        else:  # v = g
            t = t + torch.einsum("zlgc,gljc->zljg", q[..., :e], table)[:, :, None]
    if valid is not None:
        t = t.masked_fill(~valid[rows][None, :, None, :, None], -math.inf)
    beta = torch.softmax(t, dim=3)  # (Z, Lc, K, J, G): over neighbours
    if single:
        w = torch.einsum("zljmg,zljmc->zljgc", pi[:, :, 0], v_nb)  # (Z, Lc, J, G, d)
        return torch.einsum("zljg,zljgc->zlgc", beta[:, :, 0], w)  # (Z, Lc, G = V, d)
    if pi.shape[2] > 1:  # v-dependent pi: mix the probabilities over g, then one value sum
        mixed = torch.einsum("zlvjmg,zlvjg->zlvjm", pi, beta)  # (Z, Lc, V, J, M)
        return torch.einsum("zlvjm,zljmc->zlvc", mixed, v_nb)  # (Z, Lc, V, d)
    w = torch.einsum("zljmg,zljmc->zljgc", pi[:, :, 0], v_nb)  # (Z, Lc, J, G, d)
    out = torch.einsum("zlkjg,zljgc->zlkc", beta, w)  # (Z, Lc, K, d)
    return out.expand(z, lc, n, d)  # K = 1: the same for every v


def torch_attention(
    q, k, v, gl, rho, offsets, neighbour, valid, single, n, threshold, seed, chunk, recompute
):
    """The factorised attention by plain PyTorch, without the 1 / (1 - drop) rescaling:
    ``(Z, L, V, d)``. Chunks of ``chunk`` queries, with ``recompute`` each recomputed in the
    backward (so peak memory is one chunk's tensors); dropout keeps an entry whose 15-bit hash
    is at least ``threshold`` (:func:`~symattn_cli.nn.gsa.common.keep_mask`)."""
    z, n_q, g, _ = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    k, v = k.contiguous(), v.contiguous()  # rows gathered per neighbour, gradients scattered
    drop = threshold / DROP_STEPS
    recompute = (
        recompute
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (q, k, v, gl, rho))
    )
    outs = []
    for lo in range(0, n_q, chunk):
        rows = slice(lo, min(lo + chunk, n_q))

        def run(q_rows, k, v, gl_rows, rho, rows=rows):
            keep = None
            if drop > 0:
                keep = keep_mask(seed, (z, n_q, j, m, g), rows, drop, q.device).to(q.dtype)
            return _chunk(
                q_rows, k, v, gl_rows, rho, offsets, neighbour, valid, keep, rows, single, n
            )

        args = (q[:, rows], k, v, None if gl is None else gl[:, rows], rho)
        outs.append(checkpoint(run, *args, use_reentrant=False) if recompute else run(*args))
    return torch.cat(outs, dim=1)  # (Z, L, V, d)
