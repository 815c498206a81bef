"""One local SGD step of the trainable tail for K clients at once, its convolutions as matrix
products (`MatmulConv2d`, the product's) against the same tail with torch's nn.Conv2d.

The tail is EfficientNet-Lite0's last stage, conv_head and folded BatchNorms (`build_tail`, random
weights: the cost does not depend on them) and a linear head, on (192, 2, 2) input maps, as
`data.trainable_tail: 1` caches them at 64 px. The step is `vmap(grad(cross-entropy))` over the
clients, as `local_sgd` takes it, K clients × B rows each. Both variants run in this process,
alternating, medians of `--repeats`. Each client's float32 gradients, in either form, are
compared with float64's; beside the clients off by more than 1e-5 the report counts the ReLU6
inputs so close to a kink (0 or 6) that float32's rounding can flip their gradient.

    python benchmarks/tail_step.py                   # K = 100 and 10, B = 64
    python benchmarks/tail_step.py --clients 100 --repeats 3
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from benchmarks.common import load_average, machine_line, write_report
from workbench.backbones import build_backbone
from workbench.backbones.tail import MatmulConv2d, build_tail


def as_convolutions(module: nn.Module) -> nn.Module:
    """A copy of `module` whose MatmulConv2d are torch's nn.Conv2d again (the same parameters)."""
    module = copy.deepcopy(module)
    for parent in module.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, MatmulConv2d):
                (kernel, stride, padding, dilation), weight = child.geometry, child.weight
                conv = nn.Conv2d(weight.shape[1] * (weight.shape[0] if child.depthwise else 1), weight.shape[0],
                                 kernel, stride, padding, dilation, groups=weight.shape[0] if child.depthwise else 1,
                                 bias=child.bias is not None)
                conv.weight, conv.bias = child.weight, child.bias
                setattr(parent, name, conv)
    return module


def loss_of(model: nn.Module):
    def loss(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    return loss


def client_gaps(got: dict, exact: dict) -> list[float]:
    """Per client, the largest relative difference of a parameter's gradient from `exact`."""
    k = next(iter(exact.values())).shape[0]
    return [max(float((got[p][c].double() - exact[p][c]).norm() / exact[p][c].norm()) for p in exact)
            for c in range(k)]


def near_kinks(model: nn.Module, params: dict, x: Tensor, within: float = 1e-6) -> list[int]:
    """Per client, the ReLU6 inputs (exact, float64) closer to a kink (0 or 6) than `within` times
    their layer's root mean square: where float32's rounding can put them on the other side."""
    exact = copy.deepcopy(model).double()
    inputs: list[Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o: inputs.append(i[0].detach()))
             for m in exact.modules() if isinstance(m, nn.Hardtanh)]
    with torch.no_grad():
        for c in range(x.shape[0]):
            functional_call(exact, {p: v[c].double() for p, v in params.items()}, (x[c].double(),))
    for hook in hooks:
        hook.remove()
    per_layer = len(hooks)
    counts = []
    for c in range(x.shape[0]):
        layers = inputs[c * per_layer:(c + 1) * per_layer]
        counts.append(sum(int((torch.minimum(a.abs(), (a - 6).abs()) < within * a.square().mean().sqrt()).sum())
                          for a in layers))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 10])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/tail_step.md")
    args = parser.parse_args()
    load_start = load_average()
    backbone = build_backbone("efficientnet_lite0", pretrained=False, input_size=64)
    products = nn.Sequential(build_tail(backbone, 1), nn.Linear(backbone.feature_dim, 10))
    models = {"nn.Conv2d": as_convolutions(products), "MatmulConv2d": products}
    rows = []
    for k in args.clients:
        gen = torch.Generator().manual_seed(0)
        params = {name: p.detach() + 0.01 * torch.randn((k, *p.shape), generator=gen)
                  for name, p in products.named_parameters()}
        x = torch.randn(k, args.batch, 192, 2, 2, generator=gen)
        y = torch.randint(0, 10, (k, args.batch), generator=gen)
        steps = {name: vmap(grad(loss_of(model))) for name, model in models.items()}
        grads = {name: step(params, x, y) for name, step in steps.items()}  # warm-up, and compared
        exact = vmap(grad(loss_of(copy.deepcopy(products).double())))(
            {p: v.double() for p, v in params.items()}, x.double(), y)
        gaps = {name: client_gaps(g, exact) for name, g in grads.items()}
        off = sorted({c for name in gaps for c, gap in enumerate(gaps[name]) if gap > 1e-5})
        near = near_kinks(products, params, x)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step(params, x, y)
                times[name].append(time.perf_counter() - start)
        conv, matmul = (statistics.median(times[name]) for name in ("nn.Conv2d", "MatmulConv2d"))
        others = [gap for name in gaps for c, gap in enumerate(gaps[name]) if c not in off]
        outliers = "; ".join(f"client {c}: {gaps['nn.Conv2d'][c]:.1e} / {gaps['MatmulConv2d'][c]:.1e}, "
                             f"{near[c]} near a kink" for c in off) or "none"
        rows.append(f"| {k} | {args.batch} | {conv * 1e3:.0f} | {matmul * 1e3:.0f} | {conv / matmul:.2f}× | "
                    f"{max(others):.1e} | {outliers} | {sum(near)} in {sum(n > 0 for n in near)} clients |")
        print(rows[-1], flush=True)
    write_report(["# The trainable tail's local step: matrix products against nn.Conv2d", "",
                  "One `vmap(grad(cross-entropy))` step of EfficientNet-Lite0's last stage and a linear head for "
                  f"K clients × B rows of (192, 2, 2) maps; medians of {args.repeats}, the two alternating in one "
                  "process. Gradient gap: per client, the largest relative difference of a parameter's float32 "
                  "gradient from float64's, in either form; clients beyond 1e-5 are listed (nn.Conv2d / "
                  "products) with their ReLU6 inputs within 1e-6 of its layer's RMS of a kink (0 or 6, in "
                  "float64), where float32's rounding can flip the activation's gradient; the last column "
                  "counts those inputs over all clients.", "",
                  machine_line(load_at_start=load_start), "",
                  "| K | B | nn.Conv2d (ms) | MatmulConv2d (ms) | speed-up | gap, other clients "
                  "| clients beyond 1e-5 | inputs near a kink |",
                  "|---|---|---|---|---|---|---|---|", *rows], args.out)


if __name__ == "__main__":
    main()
