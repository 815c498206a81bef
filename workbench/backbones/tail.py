"""A trainable tail: the backbone's last stage(s) trained on their cached inputs.

With `data.trainable_tail: k` the feature cache holds, instead of the pooled vector, the
activation map at the INPUT of the backbone's last k stages (unpooled, (C, H, W) per image), and
the gradient methods train those stages and a linear head on it (`architecture: tail`). The
backbone's forward up to there runs once, at extraction; the tail runs in every local step.

    EfficientNet (timm `EfficientNet`: efficientnet_lite0, tf_efficientnet_*, ...):
        input of blocks[-k]; tail = blocks[-k:], conv_head, bn2 (+ its act), global average pool
    ResNet (timm `ResNet`: resnet18, resnet50, ...):
        input of layer(5-k); tail = layer(5-k) .. layer4, global average pool

`tail(cached map)` equals the backbone's pooled features (float tolerance): the tail is the
backbone's own modules, copied with their pretrained weights. Every BatchNorm is folded into a
per-channel affine with its statistics frozen as at extraction, y = x·s + t, s = γ/√(σ² + ε) and
t = β − μ·s, both trainable: the tail has no batch statistics, so it is a pure function of
(parameters, input), as `torch.func.vmap` (local SGD of many clients at once) and the double
backprop of OS-FED's snapshot fit need, and Lightning's `train()` cannot change it. Activations
are made out-of-place (in-place ReLU6 on a vmapped tensor is not safe to differentiate twice).
Every convolution is computed as matrix products (`MatmulConv2d`, the same parameters): under
vmap a convolution becomes a grouped one with a group per client, whose backward is slow on a
CPU, while a product stays a batched matmul (benchmarks/tail_step.py: 1.8–2.7× a step). The two
agree to 1e-15 in float64. In float32 either form's gradients are within 5e-7 of float64's,
except for a client with a ReLU6 input within rounding of a kink (0 or 6): its mask can flip and
move that client's gradient by up to 2e-2 (7 of 100 clients in that benchmark, 4 in the
convolutions' form, 4 in the products', one in both).

The `synthetic` dataset has a tail of its own (`synthetic_tail`): the blobs as (dim, 1, 1) maps
and k seeded pointwise stages (1×1 convolution, per-channel affine, ReLU), then the pool; for the
conformance tests and smoke runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.backbones.base import Backbone, seeded

FAMILIES = ("timm EfficientNet (efficientnet_lite0, tf_efficientnet_*, efficientnet_*) and ResNet (resnet18, "
            "resnet50, ...)")


class ChannelAffine(nn.Module):
    """y = act(x · scale + shift), per channel of (..., C, H, W): a BatchNorm folded at frozen statistics."""

    def __init__(self, scale: Tensor, shift: Tensor, act: nn.Module | None = None) -> None:
        super().__init__()
        self.scale, self.shift = nn.Parameter(scale.clone()), nn.Parameter(shift.clone())
        self.act = act if act is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x * self.scale[:, None, None] + self.shift[:, None, None])


@functools.cache
def tap_selection(size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
                  padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """S (taps, output positions, input positions), S[t, p, q] = 1 where tap t of output p reads
    input q (0 where it reads the zero padding): a convolution is Σ_t W_t · (x S_tᵀ)."""
    positions = size[0] * size[1]
    one_hots = torch.eye(positions).view(positions, 1, *size)
    return F.unfold(one_hots, kernel, dilation, padding, stride).permute(1, 2, 0).contiguous()


class MatmulConv2d(nn.Module):
    """A Conv2d (its `weight` and `bias`; zero padding, or timm's TF "same" padding) computed by
    matrix products: 1×1 at stride 1 as W x; otherwise through `tap_selection` — a dense
    convolution as W times the taps' columns, a depthwise one as each channel's (output × input
    positions) matrix Σ_t w_{c,t} S_t. Meant for the small maps of a tail (S is (k², HW_out, HW_in))."""

    def __init__(self, conv: nn.Conv2d) -> None:
        from timm.layers import Conv2dSame

        super().__init__()
        self.depthwise = conv.groups > 1 and conv.groups == conv.in_channels == conv.out_channels
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str) or not (conv.groups == 1 or self.depthwise):
            raise ValueError(f"MatmulConv2d takes dense or depthwise convolutions with numeric zero padding, "
                             f"not {conv}")
        self.weight, self.bias = conv.weight, conv.bias
        self.geometry = (tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation))
        self.same = isinstance(conv, Conv2dSame)  # padded as the input's size needs, at every call

    def forward(self, x: Tensor) -> Tensor:
        kernel, stride, padding, dilation = self.geometry
        if self.same:
            from timm.layers import pad_same

            x = pad_same(x, list(kernel), list(stride), list(dilation))
        n, _, h, w = x.shape
        out_h = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
        out_w = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
        flat = x.flatten(2)  # (n, c, HW)
        if self.geometry == ((1, 1), (1, 1), (0, 0), (1, 1)) and not self.depthwise:
            y = torch.matmul(self.weight.flatten(1), flat)
        else:
            taps = tap_selection((h, w), *self.geometry).to(x)
            if self.depthwise:
                per_channel = torch.einsum("ct,tpq->cpq", self.weight.flatten(1), taps)
                y = torch.einsum("ncq,cpq->ncp", flat, per_channel)
            else:
                columns = torch.einsum("ncq,tpq->nctp", flat, taps).flatten(1, 2)  # unfold's order
                y = torch.matmul(self.weight.flatten(1), columns)
        y = y.reshape(n, self.weight.shape[0], out_h, out_w)  # (n may be 0: a process with no rows)
        return y if self.bias is None else y + self.bias[:, None, None]


@torch.no_grad()
def fold_batchnorm(bn: nn.BatchNorm2d) -> ChannelAffine:
    """The BatchNorm at its running statistics as a trainable per-channel affine (timm's
    BatchNormAct2d keeps its dropout and activation after the affine)."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("a BatchNorm without running statistics cannot be folded into a fixed affine")
    var, mean = bn.running_var.double(), bn.running_mean.double()
    gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(var)
    scale = gamma / torch.sqrt(var + bn.eps)
    shift = beta - mean * scale
    extra = [getattr(bn, name) for name in ("drop", "act") if isinstance(getattr(bn, name, None), nn.Module)]
    act = nn.Sequential(*extra) if extra else None
    dtype = bn.running_var.dtype
    return ChannelAffine(scale.to(dtype), shift.to(dtype), act)


def make_pure(module: nn.Module) -> nn.Module:
    """In place: every BatchNorm2d folded (`fold_batchnorm`), every Conv2d a `MatmulConv2d`, every
    activation out-of-place, all parameters trainable; ValueError if something with train-mode
    behaviour is left."""
    from timm.layers import Conv2dSame

    for name, child in list(module.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, fold_batchnorm(child))
        elif isinstance(child, nn.Conv2d) and type(child) in (nn.Conv2d, Conv2dSame):  # other kinds stay as they are
            setattr(module, name, MatmulConv2d(child))
        else:
            make_pure(child)
    for sub in module.modules():
        if getattr(sub, "inplace", False) is True:
            sub.inplace = False  # type: ignore[assignment]
    for sub in module.modules():
        random = isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0
        random |= float(getattr(sub, "drop_prob", 0.0) or 0.0) > 0  # timm DropPath / DropBlock
        if random or isinstance(sub, nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"the tail keeps a {type(sub).__name__}, which trains differently than it "
                             "evaluates: not a pure function of (parameters, input)")
    module.requires_grad_(True)
    return module


def tail_split(net: nn.Module, stages: int) -> tuple[str, list[nn.Module]]:
    """Where the tail of the last `stages` stages starts (the module whose input is cached) and
    its modules, as they are in `net` (not copied); ValueError for another family or too many stages."""
    from timm.models.efficientnet import EfficientNet
    from timm.models.resnet import ResNet

    if isinstance(net, EfficientNet):
        count, first = len(net.blocks), len(net.blocks) - stages
        if 1 <= stages <= count:
            return f"blocks.{first}", [*net.blocks[first:], net.conv_head, net.bn2, net.global_pool]
    elif isinstance(net, ResNet):
        layers = [net.layer1, net.layer2, net.layer3, net.layer4]
        count, first = len(layers), len(layers) - stages
        if 1 <= stages <= count:
            return f"layer{first + 1}", [*layers[first:], net.global_pool]
    else:
        raise ValueError(f"data.trainable_tail: no tail builder for {type(net).__name__}; it is known for {FAMILIES}")
    raise ValueError(f"data.trainable_tail must be in [1, {count}] for {type(net).__name__} ({count} stages), "
                     f"got {stages}")


def _net(backbone: Backbone) -> nn.Module:
    if hasattr(backbone, "tokenize"):
        raise ValueError("data.trainable_tail needs an image backbone; text backbones have no trainable tail")
    if getattr(backbone, "feature_layers", ()) or getattr(backbone, "tail_input", ""):
        raise ValueError("data.trainable_tail needs the backbone's own pooled features: drop data.feature_layers")
    return backbone.model.get_submodule("net")


def build_tail(backbone: Backbone, stages: int) -> nn.Sequential:
    """The backbone's last `stages` stages and its pool, copied with their weights, BatchNorms
    folded: (n, C, H, W) tail input maps -> (n, feature_dim) pooled features, trainable."""
    _, modules = tail_split(_net(backbone), stages)
    tail = nn.Sequential(*copy.deepcopy(modules))
    make_pure(tail).float().train()  # pure: the mode changes nothing (Lightning expects train mode)
    return tail


class _Stop(Exception):
    """Raised by the hook once the tail's input is taken: the tail itself need not run."""


class TailInputExtractor(nn.Module):
    """A frozen image network -> the flattened activation map at the input of module `entry`
    (B, C·H·W); the network stops there (the tail is not computed)."""

    def __init__(self, frozen: nn.Module, entry: str) -> None:
        super().__init__()
        self.frozen, self.entry = frozen, entry
        self._taken: Tensor | None = None
        self._armed = False
        self.map_shape: tuple[int, ...] = ()  # (C, H, W) of the last forward's map
        frozen.get_submodule(f"net.{entry}").register_forward_pre_hook(self._take)
        self.requires_grad_(False)
        self.eval()

    def _take(self, module: nn.Module, inputs) -> None:
        if self._armed:  # only in this extractor's forward: the backbone's own forward runs on
            self._taken = inputs[0]
            raise _Stop

    def train(self, mode: bool = True) -> TailInputExtractor:
        return super().train(False)

    def forward(self, images: Tensor) -> Tensor:
        self._taken, self._armed = None, True
        try:
            self.frozen(images)
        except _Stop:
            pass
        finally:
            self._armed = False
        taken, self._taken = self._taken, None
        if taken is None:
            raise RuntimeError(f"the forward never reached {self.entry}")
        self.map_shape = tuple(int(s) for s in taken.shape[1:])
        return taken.float().flatten(1)  # (C, H, W) order, whatever the memory format


@torch.inference_mode()
def with_tail_input(backbone: Backbone, stages: int) -> Backbone:
    """`backbone` whose features are the flattened input maps of its last `stages` stages
    (`feature_shape` (C, H, W), `feature_dim` C·H·W); `tail_input` (the entry module) enters the
    feature cache's key."""
    entry, _ = tail_split(_net(backbone), stages)
    model = TailInputExtractor(backbone.model, entry)
    size = backbone.input_size
    model(torch.zeros(1, 3, size, size))
    shape = model.map_shape
    return dataclasses.replace(backbone, model=model, feature_dim=int(torch.Size(shape).numel()),
                               tail_input=entry, feature_shape=shape)


def synthetic_tail(dim: int, stages: int, seed: int) -> nn.Sequential:
    """The synthetic dataset's tail: `stages` × (1×1 convolution d→d, per-channel affine, ReLU),
    then the global average pool: (n, d, 1, 1) -> (n, d); seeded, trainable, pure."""
    if stages < 1:
        raise ValueError(f"data.trainable_tail must be ≥ 1, got {stages}")
    with seeded(seed):
        layers: list[nn.Module] = []
        for _ in range(stages):
            conv = MatmulConv2d(nn.Conv2d(dim, dim, 1, bias=False))
            scale, shift = 1 + 0.1 * torch.randn(dim), 0.1 * torch.randn(dim)
            layers += [conv, ChannelAffine(scale, shift, nn.ReLU())]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
