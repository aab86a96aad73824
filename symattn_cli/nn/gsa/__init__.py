"""Lifting and group self-attention (GSA-Nets): the layer (:mod:`.layer`), the attention core's
dispatcher (:mod:`.core`), one file per backend (:mod:`.cpp`, :mod:`.triton`,
:mod:`.triton_tiles`, :mod:`.torch`) and the dense oracle (:mod:`.dense`); the options'
choices and defaults are in :mod:`symattn_cli.options`."""

from symattn_cli.nn.gsa.layer import (
    AUTO_CHUNK,
    DEFAULT_GROUP_INDEX,
    GROUP_INDEX,
    QUERY_FORMS,
    GroupSelfAttention,
    LiftingSelfAttention,
    group_self_attention,
    lifting_self_attention,
    neighbourhoods,
)

__all__ = [
    "AUTO_CHUNK",
    "DEFAULT_GROUP_INDEX",
    "GROUP_INDEX",
    "QUERY_FORMS",
    "GroupSelfAttention",
    "LiftingSelfAttention",
    "group_self_attention",
    "lifting_self_attention",
    "neighbourhoods",
]
