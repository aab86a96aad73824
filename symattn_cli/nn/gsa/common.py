"""Pieces every backend of the attention core shares: the attention-dropout keep mask, the
spatial table lookup (:mod:`symattn_cli.nn.gsa.core` states the algorithm and the letters),
and the Triton backwards' copies of drho and their alert under torch's deterministic mode."""

from __future__ import annotations

import warnings

import torch

DROP_STEPS = 1 << 15  # dropout rates are multiples of 2^-15

_MASK32 = 0xFFFFFFFF


def gradient_copies(q: torch.Tensor, rho: torch.Tensor | None, sms: int | None = None) -> int:
    """Copies of the spatial table's gradient drho ``(V, D, e)`` that a Triton backward adds
    into (program p into copy p mod copies), summed after the launch. Every program adds to
    most of a local table's few entries, so on a GPU of ``sms`` multiprocessors (default: q's
    GPU) one copy per SM keeps concurrent programs' atomic adds apart, as many as fit in the
    memory of dq; one on the CPU (the interpreter runs programs one by one)."""
    if rho is None:
        return 1
    if sms is None:
        if q.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(sms, q.numel() // max(rho.numel(), 1)))


def deterministic_mode() -> str:
    """torch's deterministic mode: ``"off"``, ``"warn"`` (``warn_only=True``: an operation
    without a deterministic implementation warns) or ``"strict"`` (it raises)."""
    if not torch.are_deterministic_algorithms_enabled():
        return "off"
    return "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "strict"


def alert_not_deterministic(what: str, device: torch.device) -> None:
    """Under ``torch.use_deterministic_algorithms(True)``, what torch does for its own
    operations without a deterministic implementation: raise, or warn with ``warn_only=True``.
    ``what`` is a Triton backward, whose atomic adds on a GPU sum in an order, and so to last
    bits, that vary from run to run; on the CPU (the interpreter) it runs programs in order."""
    mode = deterministic_mode()
    if device.type != "cuda" or mode == "off":
        return
    message = (
        f"{what} sums gradients by atomic adds on the GPU, so their last bits vary from run to "
        "run under torch's deterministic mode; for reproducible gradients use "
        "model.attention_backend=torch (slower)"
    )
    if mode == "warn":
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        raise RuntimeError(
            f"{message}, or accept them with torch.use_deterministic_algorithms(True, "
            "warn_only=True)"
        )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (the "lowbias32" constants) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(seed: int, shape: tuple[int, ...], rows: slice, drop: float, device) -> torch.Tensor:
    """The keep mask ``(Z, Lc, J, M, G)`` (bool) of queries ``rows`` of a call whose mask has
    ``shape`` = (Z, L, J, M, G): entry x at flat index n of the full mask is kept iff
    ``hash32(hash32(n mod 2^32 xor s0) xor s1 xor (n >> 32)) mod 2^15 >= drop * 2^15``, with
    (s0, s1) the low and high 32 bits of ``seed``. The kernels compute the same function."""
    z, n_q, j, m, g = shape
    per_query = j * m * g
    local = torch.arange(per_query, device=device)  # (JMG,)
    zi = torch.arange(z, device=device)[:, None] * n_q
    qi = torch.arange(rows.start, rows.stop, device=device)[None, :]
    flat = ((zi + qi) * per_query)[..., None] + local  # (Z, Lc, JMG)
    s0, s1 = seed & _MASK32, (seed >> 32) & _MASK32
    x = _hash32((flat & _MASK32) ^ s0)
    x = _hash32(x ^ s1 ^ (flat >> 32))
    keep = (x & (DROP_STEPS - 1)) >= round(drop * DROP_STEPS)
    return keep.view(z, rows.stop - rows.start, j, m, g)


def spatial_table(rho: torch.Tensor, offsets: torch.Tensor | None, rows: slice, j: int):
    """rho_xy at each (query, neighbour) of ``rows``: ``(V, Lc, J, e)``, or ``(V, 1, J, e)``
    when local (the same for every query)."""
    if offsets is None:
        return rho[:, None, :j]  # (V, 1, J, e)
    return rho[:, offsets[rows]]  # (V, Lc, J, e)
