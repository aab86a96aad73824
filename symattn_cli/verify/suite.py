"""The ``verify-equivariance`` payload: every check of every family, as :class:`Check` rows.

Families:
  ``gsa``        GSA-Net layers (lifting, group layer in both query forms, block, whole model)
                 for every group element, translations on the interior, off-grid rotations
                 (approximate) and the exact point-set view; the reference's group indexing as
                 a negative control.
  ``attention``  GSA-Nets Props. 4.1-4.3 for plain global self-attention.
  ``knowledge``  Ma & Ying: orthogonal equivariance with knowledge for every g form, the
                 permutation laws in both conventions, the attention identities; coupled and
                 abacus positions (one pass and causal answers) with their non-degeneracy
                 and causality checks; negative controls (embedding rotated alone,
                 position encoding added, position indices moved).
"""

from __future__ import annotations

from collections.abc import Sequence

from symattn_cli.errors import ConfigError
from symattn_cli.verify.records import Check

FAMILIES = ("gsa", "attention", "knowledge")
# User-facing layer names -> the kinds of symattn_cli.verify.gsa.
LAYERS = {
    "lifting": ("lifting",),
    "group": ("group_sum", "group_single"),
    "group_sum": ("group_sum",),
    "group_single": ("group_single",),
    "block": ("block",),
    "model": ("network",),
}
EXPECT = {
    "exact": "exact",
    "approximate": "approximate",
    "fail": "violation",
    "responds": "responds",
    "blind": "blind",
}
LAYER_NAMES = {
    "network": "model",
    "group_sum": "group (Eq. 16, sum",
    "group_single": "group (single query",
    "group_shifted": "group (sum, reference index)",
}


def _gsa_row(record: dict, dtype: str, family: str = "gsa") -> Check:
    kind = LAYER_NAMES.get(record["kind"], record["kind"])
    if record["kind"] in ("group_sum", "group_single"):
        kind += f", {record['index']})"
    if record["expected"] in ("responds", "blind"):
        if record["kind"] == "network":
            kind += f" · {record['layer']} ({record['query_form']}, {record['index']})"
        kind += " · group axis alone"
    if record.get("points"):
        kind += " · point set"
    elif record["expected"] == "approximate":
        kind += " · off-grid"
    elif str(record["element"]).startswith("shift"):
        kind += " · translation"
    size = record.get("image_size")
    return Check(
        family=family,
        symmetry=record["group"],
        layer=kind,
        element=str(record["element"]),
        abs_err=record["max_abs"],
        rel_err=record["max_rel"],
        expect=EXPECT[record["expected"]],
        dtype=dtype,
        note=f"{size}×{size}" if size else "",
    )


def gsa_checks(
    groups: Sequence[str], layers: Sequence[str], *, dtype: str, seed: int, offgrid: bool
) -> list[Check]:
    from symattn_cli.verify import gsa

    kinds: list[str] = []
    for name in layers:
        if name not in LAYERS:
            raise ConfigError(f"layers: {name!r} is unknown; choose from {sorted(LAYERS)}")
        kinds += [k for k in LAYERS[name] if k not in kinds]
    records = gsa.run_all(groups, kinds, dtype=dtype, seed=seed, offgrid=offgrid)
    records = [r for r in records if r["kind"] != "self_attention"]
    if "group_sum" in kinds:  # the authors' (m - g + v) group index must visibly fail
        for name in groups:
            if gsa.get_group(name).order > 2:
                shifted = gsa.layer_equivariance(name, "group_shifted", dtype=dtype, seed=seed)
                records += shifted[1:]  # the identity (first) holds trivially
    return [_gsa_row(r, dtype) for r in records]


def attention_checks(*, dtype: str, seed: int) -> list[Check]:
    from symattn_cli.verify import gsa

    rows = []
    for record in gsa.self_attention_facts(seed=seed):
        fact = str(record["element"]).replace("_", " ")
        record = dict(record, group="S_n / R²", kind=f"self-attention: {fact}", element="")
        rows.append(_gsa_row(record, "float64", family="attention"))
    return rows


def knowledge_checks(*, dtype: str, seed: int) -> list[Check]:
    import torch

    from symattn_cli.models.knowledge import FORMS, build_model
    from symattn_cli.verify import knowledge as kv

    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
    tokens = torch.randint(1, 15, (3, 7), generator=torch.Generator().manual_seed(seed))
    rows: list[Check] = []

    def model(form: str, position: str):
        torch.manual_seed(seed)
        return build_model(
            vocab_size=15, pad_index=0, max_len=12, form=form, position=position,
            d_model=8, heads=2, layers=2, knowledge=6, mlp_hidden=16,
        ).to(torch_dtype)  # fmt: skip

    def add(symmetry, layer, element, error, expect, note=""):
        rows.append(Check("knowledge", symmetry, layer, element, error, error, expect, dtype,
                          note=note))  # fmt: skip

    for form in sorted(FORMS):
        errors = kv.model_orthogonal_errors(model(form, "footnote"), tokens, seed=seed)
        add("O(d)", f"ka_{form} model", "(E,Z,W,P)→(QE,QZ,QWQᵀ,QP), 4 Haar Q",
            errors["with_knowledge"], "exact", "logits invariant")  # fmt: skip
        add("O(d)", f"ka_{form} model", "E→QE alone", errors["embedding_only"], "violation")
    for form in ("softmax", "general", "perm"):
        for convention, element in (("columns", "X→XP"), ("rows", "X→PX")):
            plain = kv.model_permutation_error(model(form, "none"), tokens,
                                               convention=convention, seed=seed)  # fmt: skip
            add("permutation", f"ka_{form} model, no position", element, plain, "exact")
            encoded = kv.model_permutation_error(model(form, "footnote"), tokens,
                                                 convention=convention, seed=seed)  # fmt: skip
            add("permutation", f"ka_{form} model + position", element, encoded, "violation")
    rows += indexed_position_checks(dtype=dtype, seed=seed)
    add("identity", "multi-head attention", "Z=[W_Qᵀ,W_Kᵀ], A=[[0,I],[0,0]]",
        kv.attention_identity_error(seed=seed), "exact", "vs torch MultiheadAttention")  # fmt: skip
    remark = kv.remark41_errors(seed=seed)
    add("identity", "Prop. 4.1 ρ/ψ", "Remark 4.1 corrected", remark["corrected"], "exact")
    add("identity", "Prop. 4.1 layer", "ρ/ψ layer = softmax", remark["layer"], "exact")
    add("identity", "Prop. 4.1 ρ/ψ", "Remark 4.1 as printed", remark["as_printed"], "violation",
        "misses the self term of the denominator")  # fmt: skip
    add("O(d)", "fixed one-hot embedding", "swap e₊, e₋ (Sec. 3.2)",
        kv.fixed_embedding_violation(), "violation", "share of '2 + 1' targets broken")  # fmt: skip
    return rows


def indexed_position_checks(*, dtype: str, seed: int) -> list[Check]:
    """Coupled and abacus positions on addition, one pass and causal answers: O(d)
    invariance with knowledge, its negative control, non-degeneracy (positions moved) and,
    for causal answers, that no logit reads a later answer token."""
    import torch

    from symattn_cli.models.knowledge import build as build_ka
    from symattn_cli.verify import knowledge as kv

    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
    rows: list[Check] = []

    def add(symmetry, layer, element, error, expect, note=""):
        rows.append(Check("knowledge", symmetry, layer, element, error, error, expect, dtype,
                          note=note))  # fmt: skip

    def on_data(options, spec):  # the model config's target with the data's facts
        return build_ka(vocab_size=spec.vocab_size or spec.num_classes, max_len=spec.max_len,
                        pad_index=spec.pad_index, tokens=spec.tokens,
                        answer_order=spec.answer_order, causal_answer=spec.causal_answer,
                        **options)  # fmt: skip

    for position in ("coupled", "abacus"):
        for causal in (False, True):
            example, spec = kv.addition_example(causal=causal)
            torch.manual_seed(seed)
            options = {"form": "softmax", "position": position, "d_model": 8, "heads": 2,
                       "layers": 2, "knowledge": 6, "mlp_hidden": 16}  # fmt: skip
            indexed = on_data(options, spec).to(torch_dtype).eval()
            layer = f"ka_softmax + {position}" + (", causal" if causal else "") + " (addition)"
            errors = kv.model_orthogonal_errors(indexed, example, seed=seed)
            add("O(d)", layer, "(E,Z,W,F)→(QE,QZ,QWQᵀ,QF), 4 Haar Q",
                errors["with_knowledge"], "exact", "logits invariant")  # fmt: skip
            add("O(d)", layer, "E→QE alone", errors["embedding_only"], "violation")
            add("positions", layer, "c→c+1 (non-degeneracy)",
                kv.position_shift_change(indexed, example), "violation",
                "the logits see the positions")  # fmt: skip
            if causal:
                leak = kv.causal_leak(indexed, example)
                add("causality", layer, "later answer tokens replaced", leak, "exact",
                    "earlier logits unchanged")  # fmt: skip
    example, spec = kv.addition_example(causal=True)
    torch.manual_seed(seed)
    options = {"form": "softmax", "position": "abacus", "relative_span": 2,
               "relative_window": True, "d_model": 8, "heads": 2, "layers": 2, "knowledge": 6,
               "mlp_hidden": 16}  # fmt: skip
    relative = on_data(options, spec).to(torch_dtype).eval()
    for block in relative.blocks:
        torch.nn.init.normal_(block.attention.relative_bias)
    layer = "ka_softmax + abacus + relative span 2, window, causal (addition)"
    errors = kv.model_orthogonal_errors(relative, example, seed=seed)
    add("O(d)", layer, "(E,Z,W,F)→(QE,QZ,QWQᵀ,QF), 4 Haar Q", errors["with_knowledge"],
        "exact", "logits invariant")  # fmt: skip
    add("O(d)", layer, "E→QE alone", errors["embedding_only"], "violation")
    changes = kv.relative_index_changes(relative, example)
    add("positions", layer, "c→c+1, position vectors removed", changes["shift"], "exact",
        "the relative term reads index differences only")  # fmt: skip
    add("positions", layer, "relative term removed (non-degeneracy)", changes["removed"],
        "violation", "the logits see index differences")  # fmt: skip
    # the ka_addition model's layout (coupled, window of 3), evaluated over listed window
    # pairs at 40 digits (the law holds at any length; long greedy decodings cost minutes);
    # the dense masks are compared on the short example
    torch.manual_seed(seed)
    options = {"form": "softmax", "position": "coupled", "position_offset": 64,
               "relative_span": 3, "relative_window": True, "d_model": 8, "heads": 2,
               "layers": 2, "knowledge": 6, "mlp_hidden": 16}  # fmt: skip
    windowed = on_data(options, spec).to(torch_dtype).eval()
    for block in windowed.blocks:
        torch.nn.init.normal_(block.attention.relative_bias)
    layer = "ka_softmax + coupled + relative span 3, window, causal (addition)"
    add("window", layer, "listed window pairs vs dense masks",
        kv.windowed_dense_error(windowed, example), "exact", "same logits")  # fmt: skip
    long = kv.long_addition_example(40, count=1, seed=seed)
    layer = layer.replace("(addition)", "(40 digits, windowed)")
    errors = kv.model_orthogonal_errors(windowed, long, samples=2, seed=seed)
    add("O(d)", layer, "(E,Z,W,F)→(QE,QZ,QWQᵀ,QF), 2 Haar Q", errors["with_knowledge"],
        "exact", "logits invariant")  # fmt: skip
    add("O(d)", layer, "E→QE alone", errors["embedding_only"], "violation")
    add("positions", layer, "c→c+1 (non-degeneracy)", kv.position_shift_change(windowed, long),
        "violation", "the logits see the positions")  # fmt: skip
    return rows


def run_suite(
    *,
    families: Sequence[str] = FAMILIES,
    groups: Sequence[str] = (),
    layers: Sequence[str] = (),
    dtype: str = "float64",
    seed: int = 0,
    offgrid: bool = True,
) -> list[Check]:
    """All checks selected; an empty ``groups`` / ``layers`` means all of them."""
    from symattn_cli.groups import GROUP_NAMES, group_option

    if dtype not in ("float64", "float32"):
        raise ConfigError(f"dtype={dtype!r} is unknown; use float64 or float32")
    for family in families:
        if family not in FAMILIES:
            raise ConfigError(f"families: {family!r} is unknown; choose from {FAMILIES}")
    names = [group_option(g) for g in groups] if groups else list(GROUP_NAMES)
    rows: list[Check] = []
    if "gsa" in families:
        rows += gsa_checks(names, list(layers) or list(LAYERS)[:2] + ["block", "model"],
                           dtype=dtype, seed=seed, offgrid=offgrid)  # fmt: skip
    if "attention" in families:
        rows += attention_checks(dtype=dtype, seed=seed)
    if "knowledge" in families:
        rows += knowledge_checks(dtype=dtype, seed=seed)
    return rows
