"""GSA-Net: lifting self-attention, attention blocks, pooling, invariant logits (GSA-Nets Fig. F.1).

Letters: B batch, C channels, N = |H|, H/W height/width, K classes. Features between layers
are ``(B, C, N, H, W)``; every layer is equivariant, ``layer(L_g f) = L_g layer(f)`` with
``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)``, and the logits are invariant: spatial mean, then
max over the group axis. Maps are kept even-sized (symmetric crops, 2x2 pooling of even maps)
so that quarter turns of the input permute pixels exactly all the way down.

Architectures (channels, blocks, crops...) are presets in :data:`ARCHITECTURES`, chosen by the
data (``DataSpec.arch``) or forced with the model option ``arch``; any preset value can be
overridden by a model option.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from symattn_cli.errors import ConfigError
from symattn_cli.groups import Group, get_group
from symattn_cli.nn.gsa import GroupSelfAttention
from symattn_cli.nn.pointwise import Pointwise3d
from symattn_cli.nn.pooling import GroupPool
from symattn_cli.nn.positional import Swish
from symattn_cli.options import (
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GROUP_INDEX,
    DEFAULT_NORM,
    DEFAULT_QUERY_FORM,
    GLOBAL,
    NORMS,
)

# Paper / reference architectures (GSA-Nets App. F); the crops of "pcam" differ from the
# reference ([0, 2, 1, 1]) so that every pooled map is even: 96-48-48-24-20-20-10-8-4.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "rotmnist": dict(
        channels=20, block_sizes=[2, 3], expansion=[1, 1], crops=[2, 0, 2, 1, 1], heads=9,
        patch_size=5, pool_after_last_block=False, norm_between_layers=False,
        input_dropout=0.0, pool_dropout=0.0,
    ),
    "cifar10": dict(
        channels=96, block_sizes=[2, 2, 2], expansion=[1, 2, 1], crops=[0, 0, 0, 0, 0, 0],
        heads=9, patch_size=5, pool_after_last_block=False, norm_between_layers=True,
        input_dropout=0.2, pool_dropout=0.3,
    ),
    "pcam": dict(
        channels=12, block_sizes=[0, 1, 2, 1], expansion=[1, 2, 2, 2], crops=[0, 2, 0, 1],
        heads=9, patch_size=5, pool_after_last_block=True, norm_between_layers=True,
        input_dropout=0.0, pool_dropout=0.0,
    ),
}  # fmt: skip


def layer_norm(channels: int) -> nn.Module:
    """The reference's "LayerNorm": GroupNorm(1, C) over (C, N, H, W) of each sample.

    Statistics over the whole orbit, so it commutes with every L_g.
    """
    return nn.GroupNorm(1, channels)


def make_norm(kind: str, channels: int) -> nn.Module:
    """``"layer"``: :func:`layer_norm` (the reference's); ``"batch"``: BatchNorm3d, statistics
    of each channel over (B, N, H, W). Both pool over whole orbits (every group element and
    pixel), so both commute with every L_g, in training and in evaluation mode."""
    if kind == "layer":
        return layer_norm(channels)
    if kind == "batch":
        return nn.BatchNorm3d(channels)
    raise ValueError(f"norm={kind!r}; choose one of {NORMS}")


def crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """Remove ``size`` pixels from every border (symmetric, so rotations still act)."""
    return x if size == 0 else x[..., size:-size, size:-size]


class GSABlock(nn.Module):
    """``a = drop(act(norm(SA(act(norm(x)))))); out = crop(a) + crop(shortcut(x));
    out = out + norm(conv(act(norm(conv(out)))))`` (the reference transformer block).

    Equivariant: every piece commutes with L_g (the norm pools over whole orbits, see
    :func:`make_norm`; the crop is symmetric). The crop is applied inside the attention, so
    the norm after it sees the cropped map (the reference normalises before cropping).
    """

    def __init__(
        self,
        *,
        attention: GroupSelfAttention,
        in_channels: int,
        out_channels: int,
        crop_size: int = 0,
        value_dropout: float = 0.0,
        norm: str = DEFAULT_NORM,
    ) -> None:
        super().__init__()
        hidden = max(out_channels // 2, 1)
        self.pre = nn.Sequential(make_norm(norm, in_channels), Swish())
        self.attention = attention
        self.post = nn.Sequential(make_norm(norm, out_channels), Swish(), nn.Dropout(value_dropout))
        self.shortcut = (
            Pointwise3d(in_channels, out_channels) if in_channels != out_channels else None
        )
        self.mlp = nn.Sequential(
            Pointwise3d(out_channels, hidden),
            make_norm(norm, hidden),
            Swish(),
            Pointwise3d(hidden, out_channels),
            make_norm(norm, out_channels),
        )
        self.crop_size = crop_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, N, H, W)
        # The attention computes only the pixels that survive the crop (no wasted queries).
        a = self.post(self.attention(self.pre(x), crop=self.crop_size))  # (B, C', N, H-2c, W-2c)
        skip = x if self.shortcut is None else self.shortcut(x)
        out = a + crop(skip, self.crop_size)  # (B, C', N, H-2c, W-2c)
        return out + self.mlp(out)


class GSANet(nn.Module):
    """Group self-attention network with G-invariant logits ``(B, K)``."""

    def __init__(
        self,
        *,
        group: Group,
        in_channels: int,
        num_classes: int,
        channels: int = 20,
        block_sizes: Sequence[int] = (2, 3),
        expansion: Sequence[int] = (1, 1),
        crops: Sequence[int] = (2, 0, 2, 1, 1),
        heads: int = 9,
        patch_size: int | None = 5,
        query_form: str = DEFAULT_QUERY_FORM,
        attention_dropout: float = 0.1,
        value_dropout: float = 0.1,
        input_dropout: float = 0.0,
        pool_dropout: float = 0.0,
        norm_between_layers: bool = False,
        pool_after_last_block: bool = False,
        input_pool: int = 1,
        checkpointing: bool = True,
        chunk_elements: int = 0,
        attention_backend: str = DEFAULT_ATTENTION_BACKEND,
        group_index: str = DEFAULT_GROUP_INDEX,
        init_gain: float = 2**0.5,
        norm: str = DEFAULT_NORM,
    ) -> None:
        super().__init__()
        if len(expansion) != len(block_sizes):
            raise ValueError(
                f"expansion {list(expansion)} needs one entry per block {list(block_sizes)}"
            )
        if len(crops) != sum(block_sizes):
            raise ValueError(
                f"crops {list(crops)} needs one entry per attention layer ({sum(block_sizes)})"
            )
        if any(c < 0 for c in crops):
            raise ValueError(
                f"crops {list(crops)}: a crop is the pixels cut from each border, >= 0"
            )
        if input_pool < 1:
            raise ValueError(f"input_pool={input_pool} must be at least 1 (1: no pooling)")
        self.group = group

        def attention(c_in: int, c_out: int, lifting: bool) -> GroupSelfAttention:
            return GroupSelfAttention(
                group=group, in_channels=c_in, out_channels=c_out, heads=heads,
                head_dim=max(c_out // 2, 1), patch_size=patch_size, lifting=lifting,
                query_form=query_form, attention_dropout=attention_dropout,
                checkpointing=checkpointing, chunk_elements=chunk_elements,
                attention_backend=attention_backend,
                group_index=group_index,
            )  # fmt: skip

        self.input_pool = nn.AvgPool2d(input_pool) if input_pool > 1 else nn.Identity()
        self.input_dropout = nn.Dropout(input_dropout)
        self.lifting = attention(in_channels, channels, lifting=True)
        self.lifting_norm = nn.Sequential(make_norm(norm, channels), Swish())
        layers: list[nn.Module] = []
        width, layer_index = channels, 0
        for block, (size, factor) in enumerate(zip(block_sizes, expansion, strict=True)):
            out = width * factor
            for _ in range(size):
                layers.append(
                    GSABlock(
                        attention=attention(width, out, lifting=False),
                        in_channels=width,
                        out_channels=out,
                        crop_size=crops[layer_index],
                        value_dropout=value_dropout,
                        norm=norm,
                    )
                )
                if norm_between_layers:
                    layers += [make_norm(norm, out), Swish()]
                width, layer_index = out, layer_index + 1
            width = out
            if block < len(block_sizes) - 1 or pool_after_last_block:
                layers.append(nn.MaxPool3d(kernel_size=(1, 2, 2)))
                if pool_dropout > 0:
                    layers.append(nn.Dropout(pool_dropout))
        self.blocks = nn.Sequential(*layers)
        self.head = Pointwise3d(width, num_classes)
        self.pool = GroupPool(reduction="max", spatial="mean")  # (B, K, N, H', W') -> (B, K)
        self._init_weights(init_gain)

    def _init_weights(self, gain: float) -> None:
        """Normal 1x1-map weights with std ``gain / sqrt(fan_in)`` and zero biases (the
        reference's "whitening" initialisation): larger q, k than PyTorch's default, so the
        attention is not uniform at the start of training."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Conv3d)):
                fan_in = module.weight[0].numel()
                nn.init.normal_(module.weight, 0.0, gain / fan_in**0.5)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def map_sizes(self, image_size: int) -> list[int]:
        """The side of the feature map after the input pooling and after each attention layer
        and pooling of the blocks, for square images of ``image_size`` pixels; a ValueError
        naming the crop where one leaves no pixel."""
        pool = self.input_pool.kernel_size if isinstance(self.input_pool, nn.AvgPool2d) else 1
        side = image_size // pool
        sizes = [side]
        layer = 0
        for module in self.blocks:
            if isinstance(module, GSABlock):
                if 2 * module.crop_size >= side:
                    crops = [b.crop_size for b in self.blocks if isinstance(b, GSABlock)]
                    raise ValueError(
                        f"crops {crops}: crop {module.crop_size} of attention layer "
                        f"{layer + 1} leaves nothing of its {side}x{side} map ({image_size}x"
                        f"{image_size} images); lower that crop or model.input_pool"
                    )
                side -= 2 * module.crop_size
                layer += 1
            elif isinstance(module, nn.MaxPool3d):
                if side < 2:
                    raise ValueError(
                        f"the {side}x{side} map before a 2x2 pooling after attention layer "
                        f"{layer} is too small ({image_size}x{image_size} images); lower the "
                        "crops or model.input_pool"
                    )
                side //= 2
            else:
                continue
            sizes.append(side)
        return sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_dropout(self.input_pool(x))  # (B, C_in, H, W)
        h = self.lifting_norm(self.lifting(x))  # (B, C, N, H, W)
        h = self.head(self.blocks(h))  # (B, K, N, H', W')
        return self.pool(h)  # (B, K): invariant logits


def resolve_arch(options: dict[str, Any]) -> str:
    arch = options.get("arch") or "auto"
    if arch == "auto":
        arch = "rotmnist"
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"arch={arch!r} has no GSA-Net preset; choose auto or one of {sorted(ARCHITECTURES)}"
        )
    return arch


_EMPTY = (None, 0, [], ())
_PRESET_KEYS = tuple(k for k in ARCHITECTURES["rotmnist"] if k != "patch_size")


def patch_size_option(value: Any, option: str, also: str = "") -> int | None:
    """A patch size as users write it -> the layer's ``patch_size``: a side P (P x P local
    attention) stays P, ``global`` (every pixel attends to every pixel) becomes ``None``."""
    if value == GLOBAL:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(
        f"{option}: {value!r} is not a patch size; write an odd side P (3, 5, ...) for P x P "
        f"local attention or {GLOBAL} for global attention{also}"
    )


def build(*, in_channels: int, num_classes: int, image_size: int = 0, **options: Any) -> GSANet:
    """``_target_`` of the GSA-Net configs: model options -> :class:`GSANet` keyword arguments.

    Architecture values come from the preset of ``arch`` (the configs pass the data's; auto:
    rotmnist), and a model option replaces a preset value unless it is empty (0, null or []);
    ``patch_size`` is an odd side P, ``global``, or 0 for the preset's
    (:func:`patch_size_option`). ``image_size`` > 0 checks that the crops leave a map.
    The options are the fields of :class:`symattn_cli.configs.gsa.GSANetConfig`.
    """
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: GSA-Nets have no option {unknown[0]!r}")
    arch = resolve_arch(options)
    kwargs = dict(ARCHITECTURES[arch])
    for key in _PRESET_KEYS:
        value = options.get(key)
        if value not in _EMPTY or (isinstance(value, bool) and key in options):
            kwargs[key] = value
    patch = options.get("patch_size", 0)
    if patch != 0 or isinstance(patch, bool):  # 0: the preset's
        kwargs["patch_size"] = patch_size_option(
            patch, "model.patch_size", also=", or 0 for the preset's"
        )
    net = GSANet(
        group=get_group(options.get("group", "z2")),
        in_channels=in_channels,
        num_classes=num_classes,
        query_form=options.get("query_form", DEFAULT_QUERY_FORM),
        attention_dropout=options.get("attention_dropout", 0.1),
        value_dropout=options.get("value_dropout", 0.1),
        input_pool=options.get("input_pool", 1),
        checkpointing=options.get("checkpointing", True),
        chunk_elements=options.get("chunk_elements", 0),
        attention_backend=options.get("attention_backend", DEFAULT_ATTENTION_BACKEND),
        group_index=options.get("group_index", DEFAULT_GROUP_INDEX),
        norm=options.get("norm", DEFAULT_NORM),
        **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()},
    )
    if image_size > 0:
        net.map_sizes(image_size)
    return net


_OPTION_KEYS = ("group", "arch", "query_form", "group_index", "channels", "heads", "block_sizes",
                "expansion", "crops", "patch_size", "attention_dropout", "value_dropout",
                "input_dropout", "pool_dropout", "input_pool", "norm", "checkpointing",
                "chunk_elements", "attention_backend")  # fmt: skip
