"""The GSA options' choices and defaults, declared once.

The typed configs (:mod:`symattn_cli.configs.gsa`), the layer
(:class:`symattn_cli.nn.gsa.GroupSelfAttention`), the attention core's dispatcher, the model
builder (:mod:`symattn_cli.models.gsa_net`) and the benchmark (:mod:`symattn_cli.bench`) read
them from here. A leaf module without torch, so that configs and the benchmark's case lists
import it cheaply; docs/gsa-nets.md explains the group indices.
"""

from __future__ import annotations

# query_form: sum (GSA-Nets Eq. 15-16: a query per group element g, summed over g) | single
# (only g = v: N times cheaper, same law). Lifting layers always use sum.
QUERY_FORMS = ("sum", "single")
DEFAULT_QUERY_FORM = "sum"

# group_index, the group term's index idx(v, g, m): pair (v^-1 g, g^-1 m; N^2 rows) and gevit
# (v^-1 g m^-1 g; N rows) are exact and see the group axis; relative (g^-1 m) is exact but
# blind to the group axis in the sum form; shifted (v g^-1 m, the reference implementation's)
# is not equivariant: a negative control. The default: exact, sees the axis, N rows (chosen by
# measurement, docs/results.md).
GROUP_INDEX = ("pair", "gevit", "relative", "shifted")
DEFAULT_GROUP_INDEX = "gevit"

# The attention core's backends: auto (per call: the C++ kernel on CPU; on CUDA the tiled
# Triton kernel for group layers, the one-query-a-program one for lifting layers; else torch),
# cpp (fused CPU kernel), triton (GPU, one query a program), triton_tiles (GPU, a tile of
# queries a program), torch (plain PyTorch, any device).
BACKENDS = ("auto", "cpp", "triton", "triton_tiles", "torch")
# attention_backend of a layer, a net or a benchmark case: a core backend, or dense, the
# reference algorithm with its full (V, G, J, M) logits per query (inspection, benchmarks).
ATTENTION_BACKENDS = (*BACKENDS, "dense")
DEFAULT_ATTENTION_BACKEND = "auto"

# position: relative (rho_xy, an MLP on continuous offsets) | none (no spatial encoding)
POSITION_KINDS = ("relative", "none")
DEFAULT_POSITION = "relative"

# norm of GSA-Net blocks: layer (the reference's GroupNorm(1, C) per sample) | batch
# (BatchNorm3d); both pool over whole orbits, so both commute with the group action.
NORMS = ("layer", "batch")
DEFAULT_NORM = "layer"

# patch_size as configs and the command line write it: an odd side P (P x P local attention)
# or this word (every pixel attends to every pixel; the layer's patch_size=None).
GLOBAL = "global"
