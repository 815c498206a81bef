"""The analytic start: a gradient method's last layer from a closed-form head, then its rounds.

With `init_from.method` set, a gradient method (FedAvg, FedProx, FedAvgM, SCAFFOLD, OS-FED) first
fits its model's last linear layer in closed form on the activations that layer reads,
h = body(x; w₀) (the features themselves for `architecture: linear`, the hidden ReLU layer of an
`mlp`, the flattened map of a `cnn`), under the same engine and protocol, and then trains as it
would from there ("AFL+FT", "Fed3R+FT", "FedNCM+FT"). The start's rounds come first and count as
rounds, bytes included:

Start round 0. Every client with data uploads the sums of its activations: per class
    A_c = Σ_{y=c} h and N_c (C × d_h and C numbers), and for AFL, Fed3R and LDA B = Σ hhᵀ
    (d_h(d_h+1)/2 packed); with a temperature grid, the same sums of its hold-out rows beside them
    (`client_holdout`: a seeded share per class, drawn by the client alone). They are sums, so the
    head depends on the pooled rows only. The server solves with the method's own code on them:

        AFL, Fed3R   ridge on [h, 1]: W = (G + λI)⁻¹ H,  G = [[B, Σ_c A_c], [·, n]],  H = [Aᵀ; Nᵀ]
        FedNCM       w_c = μ_c / ‖μ_c‖, b = 0 (‖h‖ times FedNCM's cosine logits: the same argmax)
        LDA          W = Σ⁻¹μᵀ, b_c = −½ μ_cᵀW_c + log π_c (GH-OFL's, shrunk pooled covariance)

    once on all the rows (the head kept) and once on the rows outside the hold-outs (the
    candidate whose temperature is scored). AFL and Fed3R are one solve here; they differ in their
    defaults (AFL: λ = γ_out = 0, no bias; Fed3R: λ = 0.01 and a bias). The settings are the
    method's own (`init_from.settings`, e.g. `{gamma_out: 1.0, bias: true}`).
Start round 1 (a grid of more than one temperature). The server broadcasts the candidate; each
    client uploads, for every τ of the grid, Σ CE(softmax(z/τ), y) over its hold-out rows
    (z = hW + b) and their number; the server keeps the τ of the smallest pooled cross-entropy
    (ties: the smaller τ). The hold-out rows still train in the gradient rounds.

The last layer becomes W/τ, b/τ: the analytic head as a softmax classifier with a calibrated
temperature (its argmax unchanged). The method's own round r is then the fit's round S + r (S the
start rounds) with round r's cohort, minibatch seeds and learning rate: the gradient phase draws
what a run without the start draws. With `local.lr = 0` the model stays the analytic head / τ
(tested). `fixed_head` keeps the last layer as the start set it while local SGD trains the layers
below it (Fed3R+FT's finding: a fixed classifier steadies training across clients); a model with
nothing below its head (`linear`) has nothing left to train and is refused.

A class no client holds gets weight 0 and bias `ABSENT_LOGIT`, a finite stand-in for the
analytic heads' −∞ (softmax gives it 0 and every gradient stays finite).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.linalg import class_sums, counts_of, statistics_dtype
from workbench.methods.base import GRAM, SUMMED, SYMMETRIC, Cohort, Problem, Uploads
from workbench.methods.ridge_selection import client_holdout

if TYPE_CHECKING:
    from workbench.methods.afl import AFL
    from workbench.methods.fedncm import FedNCM
    from workbench.methods.ghofl import GHOFL

StartMethod = Literal["none", "AFL", "Fed3R", "FedNCM", "LDA"]
ABSENT_LOGIT = -1e4
#: τ candidates: powers of 2 from 1/256 (a ridge head's logits lie in about [0, 1]) to 16 (LDA's
#: are log-densities)
DEFAULT_TEMPERATURES = tuple(2.0 ** k for k in range(-8, 5))
SUMS = ("class_sums", "class_counts", "second_moment")
#: what the start rounds upload, beside the method's own uploads
START_UPLOADS = {**{f"start_{name}": SUMMED for name in SUMS[:2]}, "start_second_moment": GRAM,
                 **{f"start_holdout_{name}": SUMMED for name in SUMS[:2]}, "start_holdout_second_moment": SYMMETRIC,
                 "start_holdout_loss": SUMMED, "start_holdout_rows": SUMMED}


@dataclass(frozen=True)
class AnalyticStart:
    """Where a gradient method's last layer starts (`init_from`; see the module docstring).

    method: `none` (the seeded w₀), `AFL`, `Fed3R`, `FedNCM` or `LDA` (GH-OFL's head).
    settings: the analytic method's own settings (AFL: gamma_out, bias; Fed3R: ridge, bias;
        FedNCM: temperature; LDA: shrinkage; dtype for each).
    temperatures: the τ grid scored on the clients' hold-outs (one value: that τ, no extra round).
    holdout_fraction: each client's share of rows per class held out to score τ.
    fixed_head: the last layer stays as the start set it; local SGD trains the layers below it.
    """

    method: StartMethod = "none"
    settings: dict[str, Any] = field(default_factory=dict)
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    holdout_fraction: float = 0.1
    fixed_head: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(sorted(float(t) for t in self.temperatures)))
        if self.method not in ("none", "AFL", "Fed3R", "FedNCM", "LDA"):
            raise ValueError(f"unknown init_from.method {self.method!r}; choose none, AFL, Fed3R, FedNCM or LDA")
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise ValueError(f"init_from.temperatures must be a non-empty list of values > 0, got "
                             f"{list(self.temperatures)}")
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"init_from.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.enabled:
            self.build_head_method()  # the settings are checked now, not at round 0

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def calibrates(self) -> bool:
        """Whether τ is chosen on the hold-outs (one more round)."""
        return self.enabled and len(self.temperatures) > 1

    @property
    def rounds(self) -> int:
        """S: the start's rounds before the method's own."""
        return int(self.enabled) + int(self.calibrates)

    @property
    def needs_second_moment(self) -> bool:
        return self.method != "FedNCM"

    @property
    def stat_dtype(self) -> torch.dtype:
        """The dtype of the statistics and the solve: the analytic method's `dtype` setting (each
        defaults to float64)."""
        return statistics_dtype(self.settings.get("dtype", "float64"))

    def build_head_method(self) -> AFL | FedNCM | GHOFL:
        """The analytic method whose server solve gives the head, built from `settings`."""
        from workbench.methods.afl import AFL
        from workbench.methods.fed3r import Fed3R
        from workbench.methods.fedncm import FedNCM
        from workbench.methods.ghofl import GHOFL

        settings = dict(self.settings)
        methods: dict[str, type[AFL] | type[FedNCM]] = {"AFL": AFL, "Fed3R": Fed3R, "FedNCM": FedNCM}
        try:
            if self.method == "LDA":
                head_method: AFL | FedNCM | GHOFL = GHOFL(heads=("lda",), primary_head="lda", **settings)
            else:
                head_method = methods[self.method](**settings)
        except TypeError as error:
            raise ValueError(f"init_from.settings {settings} are not {self.method}'s settings: {error}") from None
        if getattr(head_method, "gamma_grid", [])[1:]:
            raise ValueError("init_from.settings.gamma_grid is not supported: give one gamma_out (the start "
                             "chooses its temperature on the hold-outs)")
        if getattr(head_method, "random_features", 0) or getattr(head_method, "sketch_dim", None):
            raise ValueError(f"init_from {self.method} with random features or a sketch is not a linear head of "
                             "the activations: drop random_features / sketch_dim from init_from.settings")
        return head_method

    # ---- the clients -----------------------------------------------------------------------------
    def client_update(self, round_index: int, net: nn.Module, broadcast: Mapping[str, Tensor], cohort: Cohort,
                      num_classes: int, seed: int) -> Uploads:
        """Start round `round_index` of the cohort, on the activations h of `net` (at w₀)."""
        if round_index == 0:
            return self.client_statistics(activations(net, cohort.features, cohort.batch_size), cohort,
                                          num_classes, seed)
        held = self.holdout(cohort, seed)  # round 1 reads only the hold-out rows
        return self.client_scores(activations(net, cohort.features[held], cohort.batch_size), cohort.labels[held],
                                  broadcast)

    def client_statistics(self, activations: Tensor, cohort: Cohort, num_classes: int, seed: int) -> Uploads:
        """Start round 0: the sums of the cohort's activations h (n, d_h), and of its hold-out rows."""
        h = activations.to(self.stat_dtype)
        uploads = self._sums(h, cohort.labels, num_classes, cohort.batch_size, "start_")
        if self.calibrates:
            held = self.holdout(cohort, seed)
            uploads |= self._sums(h[held], cohort.labels[held], num_classes, cohort.batch_size, "start_holdout_")
        return uploads

    def _sums(self, h: Tensor, labels: Tensor, num_classes: int, batch_size: int, prefix: str) -> Uploads:
        sums = {f"{prefix}class_sums": h.new_zeros(num_classes, h.shape[1]),
                f"{prefix}class_counts": counts_of(labels, num_classes)}
        if self.needs_second_moment:
            sums[f"{prefix}second_moment"] = h.new_zeros(h.shape[1], h.shape[1])
        for start in range(0, len(labels), batch_size):
            rows = h[start:start + batch_size]
            sums[f"{prefix}class_sums"] += class_sums(rows, labels[start:start + batch_size], num_classes).T
            if self.needs_second_moment:
                sums[f"{prefix}second_moment"] += rows.T @ rows
        return sums

    def client_scores(self, held_activations: Tensor, labels: Tensor, broadcast: Mapping[str, Tensor]) -> Uploads:
        """Start round 1: Σ CE(z/τ) over the hold-out rows (their h and labels) for every τ (Γ,),
        and their number."""
        weight, bias = broadcast["start_weight"], broadcast["start_bias"]
        logits = held_activations.to(weight) @ weight + bias
        losses = torch.stack([F.cross_entropy(logits / t, labels, reduction="sum") for t in self.temperatures])
        rows = torch.tensor(float(len(labels)), dtype=weight.dtype)
        return {"start_holdout_loss": losses, "start_holdout_rows": rows}

    def holdout(self, cohort: Cohort, seed: int) -> Tensor:
        return client_holdout(cohort.labels, cohort.client_ids, cohort.clients, self.holdout_fraction, seed)

    # ---- the server ------------------------------------------------------------------------------
    def solve(self, uploads: Uploads, num_classes: int, num_clients: int,
              kept: bool = False) -> tuple[Tensor, Tensor]:
        """The head from the pooled sums of all the rows, or (`kept`) of the rows outside the
        hold-outs (all − hold-out: sums): W (d_h, C), b (C,)."""
        sums = {name: uploads[f"start_{name}"] - uploads[f"start_holdout_{name}"] if kept else uploads[f"start_{name}"]
                for name in SUMS if f"start_{name}" in uploads}
        return self._head(sums, num_classes, num_clients)

    def _head(self, sums: dict[str, Tensor], num_classes: int, num_clients: int) -> tuple[Tensor, Tensor]:
        from workbench.methods.afl import AFL
        from workbench.methods.fedncm import FedNCM

        method = self.build_head_method()
        dim = sums["class_sums"].shape[1]
        method.setup(Problem((dim,), num_classes, num_clients))
        a, counts = sums["class_sums"].to(method.stat_dtype), sums["class_counts"].to(torch.long)
        if isinstance(method, AFL):  # AFL, Fed3R
            n = counts.to(a)
            gram, cross = sums["second_moment"].to(a), a.T
            if method.bias:  # the design [h, 1]
                total = a.sum(0, keepdim=True)
                gram = torch.cat([torch.cat([gram, total.T], 1), torch.cat([total, n.sum().view(1, 1)], 1)], 0)
                cross = torch.cat([cross, n[None]], 0)
            method.pooled_gram, method.pooled_cross = gram, cross
            weight = method.solve()
            bias = weight[dim] if method.bias else weight.new_zeros(num_classes)
            weight = weight[:dim]
        elif isinstance(method, FedNCM):
            method.server_update({"class_sums": a, "class_counts": counts}, num_clients)
            weight, bias = method.temperature * method.prototypes.T, a.new_zeros(num_classes)
        else:  # LDA
            method.server_update({"class_sums": a, "class_counts": counts,
                                  "second_moment": sums["second_moment"].to(a)}, num_clients)
            weight, bias = method.lda_weight, method.lda_bias
        absent = counts == 0
        weight = weight.masked_fill(absent[None], 0.0)
        return weight, bias.masked_fill(absent, ABSENT_LOGIT)

    def choose_temperature(self, uploads: Uploads) -> tuple[float, dict[str, float]]:
        """τ of the smallest pooled hold-out cross-entropy (ties: the smaller τ), and the metrics."""
        rows = float(uploads["start_holdout_rows"])
        if rows < 1:
            raise ValueError("no client holds a hold-out row to choose the start's temperature: give one "
                             "init_from.temperatures value, or a larger init_from.holdout_fraction")
        losses = (uploads["start_holdout_loss"] / rows).tolist()
        best = min(range(len(losses)), key=lambda i: (losses[i], i))
        chosen = self.temperatures[best]
        return chosen, {"start/temperature": chosen, "start/holdout_loss": losses[best],
                        "start/holdout_loss_at_1": _loss_at(self.temperatures, losses, 1.0)}


NO_START = AnalyticStart()  # the default: w₀ from the seed (a module-level default, since `settings` is a dict)


def _loss_at(grid: Sequence[float], losses: Sequence[float], value: float) -> float:
    """The loss at τ = value if the grid holds it, else NaN."""
    return next((loss for t, loss in zip(grid, losses, strict=True) if math.isclose(t, value)), float("nan"))


def body(net: nn.Module) -> nn.Sequential:
    """The layers below the last (Linear) one: h = body(x)."""
    layers = list(net.children())
    if not isinstance(net, nn.Sequential) or not isinstance(layers[-1], nn.Linear):
        raise ValueError(f"the analytic start needs a model ending in a linear layer, got {type(net).__name__}")
    return nn.Sequential(*layers[:-1])


def head_names(net: nn.Module) -> tuple[str, ...]:
    """The parameter names of the last layer (`fixed_head` keeps them)."""
    last = str(len(list(net.children())) - 1)
    return tuple(name for name, _ in net.named_parameters() if name.split(".")[0] == last)


@torch.no_grad()
def activations(net: nn.Module, features: Tensor, batch_size: int) -> Tensor:
    """h = body(x) at the model's current weights, in chunks: (n, *input_shape) -> (n, d_h)."""
    lower = body(net)
    dtype = next(net.parameters()).dtype
    parts = [lower(features[start:start + batch_size].to(dtype)) for start in range(0, len(features), batch_size)]
    return torch.cat(parts) if parts else lower(features[:0].to(dtype))


@torch.no_grad()
def load_head(net: nn.Module, weight: Tensor, bias: Tensor, temperature: float) -> None:
    """The last layer ← W/τ, b/τ: (d_h, C), (C,)."""
    last = list(net.children())[-1]
    assert isinstance(last, nn.Linear)  # as `body` checked
    last.weight.copy_((weight / temperature).T.to(last.weight))
    last.bias.copy_((bias / temperature).to(last.bias))
