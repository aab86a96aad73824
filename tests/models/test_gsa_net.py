"""GSA-Net: parameter counts of the paper's architectures, invariance, config entry points."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
from symattn_cli.data.base import DataSpec
from symattn_cli.errors import ConfigError
from symattn_cli.models import gsa_net
from symattn_cli.models.gsa_net import GSANet
from symattn_cli.models.instantiate import model_config
from symattn_cli.verify.gsa import layer_equivariance, randomize_encodings
from tests.helpers import build_on, threads

ROTMNIST = DataSpec(task="classify", num_classes=10, in_channels=1, image_size=28, arch="rotmnist")
REFERENCE_PARAMS = {
    "z2": 44_368, "r4": 44_428, "r8": 44_508, "r12": 44_588, "r16": 44_668,
    "z2m": 44_388, "r4m": 44_508,
}  # fmt: skip


def build(options, spec):
    return build_on(gsa_net.build, options, spec)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("group,expected", REFERENCE_PARAMS.items())
def test_rotmnist_parameter_counts(group, expected):
    assert abs(n_params(build({"group": group}, ROTMNIST)) - expected) <= 0.02 * expected


def test_cifar_and_pcam_architectures_follow_the_data():
    cifar = DataSpec(task="classify", num_classes=10, in_channels=3, image_size=32, arch="cifar10")
    pcam = DataSpec(task="classify", num_classes=2, in_channels=3, image_size=96, arch="pcam")
    assert abs(n_params(build({"group": "z2"}, cifar)) - 3.00e6) <= 0.02 * 3.00e6
    assert abs(n_params(build({"group": "z2"}, pcam)) - 207e3) <= 0.02 * 207e3
    forced = build({"group": "z2", "arch": "rotmnist"}, cifar)
    assert n_params(forced) < 50_000
    with pytest.raises(ValueError, match="arch"):
        build({"group": "z2", "arch": "imagenet"}, cifar)


@pytest.mark.parametrize("size", [6, 7])
@pytest.mark.parametrize("group", ["z4", "r8", "z4m", "mirror"])
def test_network_logits_are_invariant(group, size):
    records = layer_equivariance(group, "network", image_size=size)
    assert max(r["max_rel"] for r in records) <= 1e-10


def test_mirror_net_is_invariant_to_left_right_not_up_down_flips():
    """z2m_sa (the CIFAR-10 preset's model) at its 28x28 rotMNIST size, float64: flipping the
    image left-right (x -> -x, as augmentation does) leaves the logits unchanged; flipping it
    upside down is not a symmetry of the net (negative control)."""
    torch.manual_seed(0)
    model = randomize_encodings(symattn_cli.create_model("z2m_sa")).double().eval()
    x = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        reference = model(x)

        def change(moved):
            return ((model(moved) - reference).abs().max() / reference.abs().max()).item()

        assert change(x.flip(-1)) <= 1e-10
        assert change(x.flip(-2)) > 1e-4


def _z4m_logit_error(arch: str, size: int, **options) -> float:
    """Largest relative change of the logits over every element of z4m, float64, with the
    architecture of ``arch`` at a small width (the maps' sizes are the preset's)."""
    spec = DataSpec(task="classify", num_classes=2, in_channels=3, image_size=size, arch=arch)
    torch.manual_seed(0)
    model = build({"group": "z4m", "channels": 6, "heads": 2, **options}, spec)
    model = randomize_encodings(model).double().eval()
    g = model.group
    x = torch.rand(1, 3, size, size, dtype=torch.float64)
    with torch.no_grad():
        reference = model(x)
        return max(
            ((model(g.act_on_image(e, x)) - reference).abs().max() / reference.abs().max()).item()
            for e in g.elements
        )


@pytest.mark.parametrize("arch,size", [("cifar10", 32), ("pcam", 96)])
def test_cifar_and_pcam_architectures_are_invariant(arch, size):
    """Every pooled map of these presets is even, so pooling commutes with the group."""
    assert _z4m_logit_error(arch, size) <= 1e-10


def test_reference_pcam_crops_break_invariance():
    """Negative control: with the reference's PCam crops [0, 2, 1, 1] the maps are
    96-48-48-24-20-18-9-7-3, and pooling 7x7 to 3x3 drops a row and a column."""
    assert _z4m_logit_error("pcam", 96, crops=[0, 2, 1, 1]) > 1e-6


@pytest.mark.parametrize("group", ["z4", "r8m"])
def test_block_is_equivariant(group):
    records = layer_equivariance(group, "block", image_size=7)
    assert max(r["max_rel"] for r in records) <= 1e-10


@pytest.mark.parametrize("group", ["z4", "z4m"])
def test_batch_norm_network_is_invariant_in_training_and_evaluation(group):
    """norm="batch": each channel's statistics pool over (B, N, H, W), whole orbits."""
    torch.manual_seed(0)
    g = symattn_cli.get_group(group)
    model = GSANet(
        group=g, in_channels=1, num_classes=3, channels=6, heads=2, block_sizes=[1, 1],
        expansion=[1, 2], crops=[1, 0], patch_size=3, attention_dropout=0.0, value_dropout=0.0,
        norm="batch",
    ).double()  # fmt: skip
    assert any(isinstance(m, torch.nn.BatchNorm3d) for m in model.modules())
    x = torch.rand(4, 1, 10, 10, dtype=torch.float64)
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            reference = model(x)
            for e in range(g.order):
                turned = model(g.act_on_image(e, x))
                assert (turned - reference).abs().max() <= 1e-10 * reference.abs().max()
    with pytest.raises(ValueError, match="norm"):
        GSANet(group=g, in_channels=1, num_classes=3, norm="instance")


def test_map_sizes_follow_the_crops_and_pools():
    """The r8_sa net on 28x28 digits: 28 after lifting, 24 after the first crop of 2, 12 after
    pooling, then 8, 6, 4 (the sizes the layers of the static GPU report run at)."""
    model = symattn_cli.create_model("r8_sa")
    assert model.map_sizes(28) == [28, 24, 24, 12, 8, 6, 4]
    assert symattn_cli.create_model("gsa_mini").map_sizes(28) == [14, 12, 6, 6, 6]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"crops": [5, 5, 5]},
            r"crops \[5, 5, 5\]: crop 5 of attention layer 2 leaves nothing "
            r"of its 2x2 map \(28x28 images\); lower that crop",
        ),
        ({"crops": [1, -1, 0]}, r"crops \[1, -1, 0\]: a crop is the pixels cut .* >= 0"),
        ({"input_pool": 0}, r"input_pool=0 must be at least 1"),
        ({"input_pool": 8}, r"the 1x1 map before a 2x2 pooling after attention layer 1"),
    ],
)
def test_crops_and_pools_that_leave_no_map_are_refused_when_built(options, message):
    """At build time, with the data's image size: not as a shape error in the first step."""
    spec = DataSpec(task="classify", num_classes=10, in_channels=1, image_size=28,
                    arch="rotmnist")  # fmt: skip
    config = model_config("gsa_mini", **options)
    with pytest.raises(ValueError, match=message):
        build(config, spec)


def test_global_attention_from_config():
    """``model.patch_size=global`` makes every layer global; 0 keeps the preset's."""
    model = symattn_cli.create_model("r4_sa", patch_size="global")
    layers = [m for m in model.modules() if hasattr(m, "patch_size")]
    assert len(layers) == 6 and all(m.patch_size is None for m in layers)
    assert symattn_cli.create_model("r4_sa", patch_size=0).lifting.patch_size == 5


@pytest.mark.parametrize("value", [None, -1, "glob"])
def test_other_patch_sizes_name_the_value_and_the_spelling(value):
    with pytest.raises(ConfigError, match=rf"model.patch_size: {value!r} .* or global for global"):
        symattn_cli.create_model("r4_sa", patch_size=value)


def test_create_model_and_presets():
    model = symattn_cli.create_model("r8_sa")
    assert model.group is symattn_cli.get_group("r8")
    assert abs(n_params(model) - 44_508) <= 0.02 * 44_508
    assert symattn_cli.create_model("z4_sa").group == symattn_cli.get_group("r4")
    mini = symattn_cli.create_model("gsa_mini").eval()
    with torch.no_grad():
        assert mini(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_default_preset_is_exactly_rotation_invariant_on_digits():
    """gsa_mini, the default model (R4, batch norm), in float64 on 28 x 28 inputs, on two
    threads as in training: every quarter turn leaves the logits unchanged, in training and
    evaluation."""
    torch.manual_seed(0)
    model = symattn_cli.create_model("gsa_mini").double()
    assert n_params(model) == 21_618 and model.group == symattn_cli.get_group("r4")
    x = torch.rand(3, 1, 28, 28, dtype=torch.float64)
    for training in (True, False):
        model.train(training)
        with torch.no_grad(), threads(2):
            reference = model(x)
            for e in range(model.group.order):
                turned = model(model.group.act_on_image(e, x))
                assert (turned - reference).abs().max() <= 1e-10 * reference.abs().max()


def test_full_rotmnist_model_runs_on_28x28():
    model = build({"group": "r4"}, ROTMNIST).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, 28, 28)).shape == (1, 10)


SHIPPED_GSA_NETS = [
    "z2m_sa", "r4_sa", "r8_sa", "r12_sa", "r16_sa", "r4m_sa", "r8m_sa",
    "gsa_mini", "z2m_mini", "r4m_mini", "r8_mini", "r8m_mini",
]  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED_GSA_NETS)
def test_every_group_layer_of_a_shipped_net_sees_its_group_axis(name):
    """Non-degeneracy of the shipped defaults: moving any group layer's input along its group
    axis alone (one generator-like element: the first after the identity) changes the logits
    by at least 1e-6 relative (float64); the nets' exact invariance is checked above."""
    from symattn_cli.models.instantiate import create_model
    from symattn_cli.nn.gsa import GroupSelfAttention
    from symattn_cli.verify.gsa import model_axis_response

    model = create_model(name, attention_dropout=0.0, value_dropout=0.0)
    model = randomize_encodings(model).double().eval()
    x = torch.randn(1, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    records = model_axis_response(model, x, elements=[1])
    group_layers = [
        m for m in model.modules() if isinstance(m, GroupSelfAttention) and not m.lifting
    ]
    assert len(records) == len(group_layers) > 0
    for r in records:
        assert r["expected"] == "responds", (name, r["layer"], r["index"], r["query_form"])
        assert r["max_rel"] >= 1e-6, (name, r["layer"], r["max_rel"])


def test_a_net_stored_before_the_group_index_option_keeps_its_index():
    """Run files from before ``group_index`` existed were built with ``relative``: their
    stored config must rebuild that net, not today's default."""
    from omegaconf import OmegaConf

    from symattn_cli.models.instantiate import upgrade_stored

    def upgraded(model):
        config = OmegaConf.create({"model": model, "data": {"name": "rotmnist_mini"}})
        return OmegaConf.to_container(upgrade_stored(config).model)

    assert upgraded({"family": "gsa"})["group_index"] == "relative"
    assert upgraded({"family": "gsa", "group_index": "pair"})["group_index"] == "pair"
    assert "group_index" not in upgraded({"family": "cnn"})
    assert upgraded({"family": "gsa"})["_target_"] == "symattn_cli.models.gsa_net.build"
