"""The public layers: build an equivariant net from these (docs/api.md).

Letters: B batch, C channels, N = |H| group elements, H/W height/width (images ``(B, C, H, W)``,
group features ``(B, C, N, H, W)``); n tokens, d embedding (sequences ``(B, n, d)``).

Groups: :class:`Group` and :func:`get_group` (``"z4"``, ``"r8"``, ``"z4m"``...), acting on
images by ``(L_g f)(x) = f(u^-1 (x - t))`` and on group features by
``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)``.

Group self-attention (GSA-Nets): :class:`LiftingSelfAttention` ``(B, C, H, W) ->
(B, C', N, H, W)``, then :class:`GroupSelfAttention` ``(B, C, N, H, W) -> (B, C', N, H, W)``,
each ``layer(L_g f) = L_g layer(f)``; :class:`GroupPool` pools the group axis (and space):
``(B, C, N, H, W) -> (B, C, H, W)`` or ``(B, C)``, invariant to the group axis.

Knowledge attention (Ma & Ying): :class:`KnowledgeAttention` ``(B, n, d) -> (B, n, d)`` with
its coefficients (:class:`Coefficients` of a :class:`QuadraticScore` and a
:class:`SoftmaxNormalizer`), stacked as :class:`KnowledgeBlock` with :class:`PositionwiseMLP`
and :class:`ScalarRMSNorm`; :func:`rotate_embedding` moves a module's knowledge by an
orthogonal Q, ``rotate_embedding(f, Q)(x Qᵀ) = f(x) Qᵀ``.
"""

from symattn_cli.groups import Group, get_group
from symattn_cli.nn.gsa.layer import GroupSelfAttention, LiftingSelfAttention
from symattn_cli.nn.knowledge import (
    Coefficients,
    KnowledgeAttention,
    KnowledgeBlock,
    PositionwiseMLP,
    QuadraticScore,
    ScalarRMSNorm,
    SoftmaxNormalizer,
    rotate_embedding,
)
from symattn_cli.nn.pooling import GroupPool

__all__ = [
    "Coefficients",
    "Group",
    "GroupPool",
    "GroupSelfAttention",
    "KnowledgeAttention",
    "KnowledgeBlock",
    "LiftingSelfAttention",
    "PositionwiseMLP",
    "QuadraticScore",
    "ScalarRMSNorm",
    "SoftmaxNormalizer",
    "get_group",
    "rotate_embedding",
]
