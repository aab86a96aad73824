"""The GSA options (symattn_cli.options): declared once, read by the configs, the layer, the
dispatcher, the model builder and the benchmark, and named in full wherever a text lists them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import subprocess
import sys
import tokenize

import pytest
import torch

from symattn_cli import options
from tests.helpers import REPO

PACKAGE = REPO / "symattn_cli"
CHOICES = {
    "QUERY_FORMS": options.QUERY_FORMS,
    "GROUP_INDEX": options.GROUP_INDEX,
    "BACKENDS": options.BACKENDS,
    "ATTENTION_BACKENDS": options.ATTENTION_BACKENDS,
    "POSITION_KINDS": options.POSITION_KINDS,
    "NORMS": options.NORMS,
}
# option -> its default, as the configs, layers, nets and benchmark cases name the option
DEFAULTS = {
    "query_form": options.DEFAULT_QUERY_FORM,
    "group_index": options.DEFAULT_GROUP_INDEX,
    "attention_backend": options.DEFAULT_ATTENTION_BACKEND,
    "position": options.DEFAULT_POSITION,
    "norm": options.DEFAULT_NORM,
}


def test_the_module_imports_without_torch():
    code = "import sys, symattn_cli.options; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_each_default_is_one_of_its_choices():
    assert options.DEFAULT_QUERY_FORM in options.QUERY_FORMS
    assert options.DEFAULT_GROUP_INDEX in options.GROUP_INDEX
    assert options.DEFAULT_ATTENTION_BACKEND in options.BACKENDS
    assert set(options.BACKENDS) < set(options.ATTENTION_BACKENDS)
    assert options.DEFAULT_POSITION in options.POSITION_KINDS
    assert options.DEFAULT_NORM in options.NORMS


def _defaults(cls_or_function) -> dict:
    """The defaults of the options in ``DEFAULTS`` that a dataclass or signature declares."""
    if dataclasses.is_dataclass(cls_or_function):
        fields = {f.name: f.default for f in dataclasses.fields(cls_or_function)}
    else:
        params = inspect.signature(cls_or_function).parameters.values()
        fields = {p.name: p.default for p in params}
    return {name: value for name, value in fields.items() if name in DEFAULTS}


def _declarers():
    from symattn_cli.bench.measure import Case
    from symattn_cli.configs.gsa import GSANetConfig
    from symattn_cli.models.gsa_net import GSABlock, GSANet
    from symattn_cli.nn.gsa import GroupSelfAttention, LiftingSelfAttention

    return {
        "GSANetConfig": (GSANetConfig, {"query_form", "group_index", "attention_backend", "norm"}),
        "GroupSelfAttention": (
            GroupSelfAttention,
            {"query_form", "group_index", "attention_backend", "position"},
        ),
        "LiftingSelfAttention": (LiftingSelfAttention, {"attention_backend", "position"}),
        "GSANet": (GSANet, {"query_form", "group_index", "attention_backend", "norm"}),
        "GSABlock": (GSABlock, {"norm"}),
        "Case": (Case, {"query_form", "group_index", "attention_backend"}),
    }


@pytest.mark.parametrize("name", list(_declarers()))
def test_schemas_layers_nets_and_cases_default_to_the_modules_defaults(name):
    declarer, expected = _declarers()[name]
    found = _defaults(declarer)
    assert set(found) == expected, name
    assert found == {option: DEFAULTS[option] for option in expected}, name


def test_the_builder_defaults_an_option_left_out_to_the_modules_default():
    from symattn_cli.models.gsa_net import build

    net = build(in_channels=1, num_classes=2, group="r4", channels=6, heads=1, block_sizes=[1],
                expansion=[1], crops=[0])  # fmt: skip
    layer = net.blocks[0].attention
    assert (layer.query_form, layer.group_index, layer.attention_backend) == (
        options.DEFAULT_QUERY_FORM, options.DEFAULT_GROUP_INDEX, options.DEFAULT_ATTENTION_BACKEND
    )  # fmt: skip
    assert isinstance(net.lifting_norm[0], torch.nn.GroupNorm)  # norm's default: layer


def test_the_layer_the_dispatcher_and_the_benchmark_check_against_the_modules_choices():
    from symattn_cli.bench.suite import select_cases
    from symattn_cli.errors import ConfigError
    from symattn_cli.nn.gsa import core, layer

    assert core.BACKENDS is options.BACKENDS and core.FORMS is options.QUERY_FORMS
    assert layer.ATTENTION_BACKENDS is options.ATTENTION_BACKENDS
    assert layer.GROUP_INDEX is options.GROUP_INDEX and layer.QUERY_FORMS is options.QUERY_FORMS
    assert select_cases([], attention_backends=list(options.BACKENDS)) == []
    with pytest.raises(ConfigError) as err:
        select_cases([], attention_backends=["dense"])  # the sweep runs the core's backends
    assert all(repr(name) in str(err.value) for name in options.BACKENDS)


def test_no_other_module_declares_an_options_choices():
    """A tuple of strings equal (as a set) to one of the module's choices, outside it, is a
    second declaration."""
    wanted = {frozenset(choices): name for name, choices in CHOICES.items()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "options.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Tuple)
                and node.elts
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
            ):
                values = frozenset(e.value for e in node.elts)
                if values in wanted:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {wanted[values]}")
    assert not found, found


def _texts(path):
    """(line, text) of each docstring or other string, and each run of comment lines."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
    lines, start, last = [], 0, -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        if token.start[0] != last + 1 and lines:
            yield start, " ".join(lines)
            lines = []
        if not lines:
            start = token.start[0]
        lines.append(token.string)
        last = token.start[0]
    if lines:
        yield start, " ".join(lines)


def test_every_text_that_lists_backends_or_indices_names_them_all():
    """A docstring, string or comment that names ``cpp``, ``triton`` and ``torch`` lists
    the core's backends and must name ``triton_tiles`` too; one that names three group indices
    must name the fourth (saying why it is left out, where it is)."""
    backends = set(options.BACKENDS) - {"auto"}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _texts(path):
            words = set(re.findall(r"[A-Za-z_]+", text))
            where = f"{path.relative_to(REPO)}:{line}"
            if {"cpp", "triton", "torch"} <= words and not backends <= words:
                wrong.append(f"{where} lacks {sorted(backends - words)}")
            named = words & set(options.GROUP_INDEX)
            if len(named) >= 3 and named != set(options.GROUP_INDEX):
                wrong.append(f"{where} lacks {sorted(set(options.GROUP_INDEX) - named)}")
    assert not wrong, wrong
