"""Client-side optimization of many clients at once, vectorized over clients.

A round of a gradient federated method trains every sampled client from the global model on
its own data. Instead of one optimizer (or one Lightning Trainer) per client, the m clients'
parameters are kept stacked along a leading client axis, `(m, *param.shape)`, and every
client's step is taken at once with `torch.func.vmap(torch.func.grad(loss))` over
`torch.func.functional_call(model, params, inputs)`. The model itself only supplies the
architecture (and its buffers); its parameters are never modified here.

`local_sgd` — local epochs of minibatch SGD (FedAvg, FedProx; Ditto's personal objective;
SCAFFOLD's corrected steps):

    w_k ← w_k − lr · ( ∇ [ mean_{i ∈ batch} CE(f(x_i; w_k), y_i) + μ/2 ‖w_k − c‖² ] + r_k )

with r_k a constant linear correction of the gradient (0 by default; SCAFFOLD's c − c_k).
Optionally with weight decay λ and heavy-ball momentum β, as `torch.optim.SGD` takes them
(dampening 0): d ← ∇(…) + r_k + λ w_k, b ← β b + d, w_k ← w_k − lr · b. The momentum buffer b
starts at 0 in every call, i.e. it is local to a round (as FedAvg implementations keep it: a
client's buffer is neither uploaded nor carried to its next round). Across rounds the step size
follows a schedule of the round index (`scheduled_lr`), known to every client.

In each epoch every client shuffles its own n_k samples and cuts them into ceil(n_k / B)
minibatches (the last one smaller), so client k takes exactly epochs · ceil(n_k / B) steps,
the steps it would take alone (`minibatch_schedule` is the draw; it does not depend on the
order or the set of other clients). Clients are processed by decreasing n_k, so at step j of
an epoch the clients that still have a batch form a prefix: vmap runs on that prefix (a view)
and clients whose epoch is done wait untouched. The compute is Σ_k n_k samples per epoch, not
m · max_k n_k. Any model whose forward is a pure function of (params, buffers, inputs) works:
linear and MLP heads, and BatchNorm-free CNNs (vmap turns the per-client convolutions into
grouped ones).

`lbfgs` — L-BFGS on m independent problems at once (OS-FED's per-client snapshot fits). Each
problem keeps its own curvature history, initial scaling and backtracking (Armijo) line
search; only the function evaluations are batched, and a backtrack evaluates only the problems
that have not yet accepted a step. This is exactly m independent L-BFGS runs
(tested), unlike one L-BFGS on the summed loss: the sum of separable losses has a
block-diagonal Hessian, but L-BFGS's history pairs and shared step length would couple the
problems.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from workbench.linalg import stream_generator


def client_generator(seed: int, client: int) -> torch.Generator:
    """The CPU generator of one client's stream under `seed`: the same wherever the client runs."""
    return stream_generator(seed, client)


def minibatch_schedule(
    client_ids: Tensor, clients: Tensor, *, epochs: int, batch_size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Each client's minibatches, step by step: yields `(index, mask)`, both (m, B').

    client_ids: (n,) int64 client of every sample; clients: (m,) the clients that train.
    Row r holds the sample indices (into the n samples) of client `clients[r]`'s batch at this
    step, `mask` marks the real entries (B' = min(B, max n_k)); a client with no batch left in
    the current epoch has an all-False row. Each client draws one uniform key per own sample and
    epoch from its own stream (`client_generator(seed, client)`) and takes its samples in key
    order: a client's batches do not depend on which other clients train, nor on where it runs
    (in one process with every other client, or alone on a Flower node).
    """
    for index, mask, _ in _schedule(client_ids, clients, epochs=epochs, batch_size=batch_size, seed=seed):
        yield index, mask


def _schedule(client_ids: Tensor, clients: Tensor, *, epochs: int, batch_size: int,
              seed: int) -> Iterator[tuple[Tensor, Tensor, int]]:
    """`minibatch_schedule`'s steps with the number of clients that have a batch at each, known on
    the host: the clients' sample counts are read once (the keys are drawn on the host anyway, by
    per-client generators), so the steps themselves never wait for the device."""
    device = client_ids.device
    num_ids = max(int(client_ids.max()), int(clients.max())) + 1
    slot = torch.full((num_ids,), -1, dtype=torch.long, device=device)
    slot[clients] = torch.arange(len(clients), device=device)
    sample_slot = slot[client_ids]  # row of each sample's client, -1 if it does not train
    mine = (sample_slot >= 0).nonzero().squeeze(1)
    mine = mine[torch.argsort(sample_slot[mine], stable=True)]  # by client, then by position
    counts = torch.bincount(sample_slot[mine], minlength=len(clients))
    first = torch.cumsum(counts, 0) - counts
    host_counts = counts.tolist()
    keys = torch.cat([torch.rand(epochs, count, generator=client_generator(seed, client), dtype=torch.float64)
                      for client, count in zip(clients.tolist(), host_counts, strict=True)], 1).to(device)
    steps = torch.tensor([-(-count // batch_size) for count in host_counts])  # ceil(n_k / B) per client
    steps_per_epoch = int(steps.max())  # the busiest client's
    active = (steps[None, :] > torch.arange(steps_per_epoch)[:, None]).sum(1).tolist()  # clients with a batch
    width = min(batch_size, max(host_counts))
    for epoch in range(epochs):
        order = mine[torch.argsort(sample_slot[mine] + keys[epoch])]  # by client, then key
        rank = torch.arange(len(order), device=device) - first[sample_slot[order]]
        table = torch.full(
            (len(clients), steps_per_epoch * batch_size), -1, dtype=torch.long, device=device
        )
        table[sample_slot[order], rank] = order
        for step in range(steps_per_epoch):
            index = table[:, step * batch_size : step * batch_size + width]
            yield index.clamp(min=0), index >= 0, active[step]


def local_steps(client_ids: Tensor, clients: Tensor, *, epochs: int, batch_size: int) -> Tensor:
    """The SGD steps each of `clients` (m,) takes in `local_sgd`: epochs · ceil(n_k / B), (m,)."""
    if len(clients) == 0:
        return torch.zeros(0, dtype=torch.long, device=clients.device)
    counts = torch.bincount(client_ids, minlength=int(clients.max()) + 1)[clients]
    return epochs * (-(-counts // batch_size))


LR_SCHEDULES = ("constant", "cosine", "step")


def scheduled_lr(lr: float, round_index: int, num_rounds: int, schedule: str = "constant", *,
                 final_fraction: float = 0.0, step_rounds: int = 1, gamma: float = 0.1) -> float:
    """The local step size of round t (0-based) of R rounds, a function of the round index only.

    constant: lr. cosine: lr · (f + (1 − f) · (1 + cos(π t / R)) / 2), from lr at t = 0 down
    towards f · lr (f = final_fraction). step: lr · γ^⌊t / step_rounds⌋.
    """
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * (final_fraction + (1 - final_fraction) * (1 + math.cos(math.pi * round_index / num_rounds)) / 2)
    if schedule == "step":
        return lr * gamma ** (round_index // step_rounds)
    raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


@dataclass(frozen=True)
class LocalTraining:
    """How every sampled client trains from the model it received: local minibatch SGD (the
    settings of the gradient methods' `local`, one source for FedAvg, FedProx, FedAvgM, Ditto,
    SCAFFOLD and OS-FED).

    epochs: passes over the client's data per round; lr: the step size at round 0 (0: no step, the
        model stays where it started, e.g. to check an analytic start); batch_size: B.
    lr_schedule: `constant`, `cosine` (lr → lr_final_fraction · lr over the fit's rounds) or
        `step` (× lr_gamma every lr_step_rounds rounds): a function of the round index only
        (`scheduled_lr`), so every client uses the same wherever it runs.
    momentum, weight_decay: as `torch.optim.SGD` takes them (the momentum buffer starts at 0 every
        round).
    """

    epochs: int = 1
    lr: float = 0.05
    batch_size: int = 64
    lr_schedule: Literal["constant", "cosine", "step"] = "constant"
    lr_final_fraction: float = 0.0
    lr_step_rounds: int = 1
    lr_gamma: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"local.epochs and local.batch_size must be ≥ 1, got {self.epochs} and {self.batch_size}")
        if not self.lr >= 0:
            raise ValueError(f"local.lr must be ≥ 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown local.lr_schedule {self.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
        if not 0 <= self.lr_final_fraction <= 1 or self.lr_step_rounds < 1 or not 0 < self.lr_gamma <= 1:
            raise ValueError(f"local.lr_final_fraction must be in [0, 1], local.lr_step_rounds ≥ 1 and local.lr_gamma "
                             f"in (0, 1], got {self.lr_final_fraction}, {self.lr_step_rounds} and {self.lr_gamma}")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"local.momentum must be in [0, 1) and local.weight_decay ≥ 0, got {self.momentum} and "
                             f"{self.weight_decay}")

    def round_lr(self, round_index: int, num_rounds: int, lr: float | None = None) -> float:
        """The step size at round t of `num_rounds` under the schedule, from `lr` (default `self.lr`)."""
        return scheduled_lr(self.lr if lr is None else lr, round_index, num_rounds, self.lr_schedule,
                            final_fraction=self.lr_final_fraction, step_rounds=self.lr_step_rounds,
                            gamma=self.lr_gamma)


def _per_client(value: Tensor | None, default: Tensor, m: int, name: str) -> tuple[Tensor, bool]:
    """A shared (param-shaped) or per-client ((m, *shape)) tensor -> (tensor, is_per_client)."""
    value = default if value is None else value
    if value.shape == default.shape:
        return value, False
    if value.shape == (m, *default.shape):
        return value, True
    raise ValueError(
        f"{name} must have the parameter's shape {tuple(default.shape)} or (m, *shape) "
        f"with m = {m} clients, got {tuple(value.shape)}"
    )


def local_sgd(
    model: nn.Module,
    features: Tensor,
    labels: Tensor,
    client_ids: Tensor,
    clients: Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    prox_mu: float = 0.0,
    prox_center: dict[str, Tensor] | None = None,
    init: dict[str, Tensor] | None = None,
    correction: dict[str, Tensor] | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    frozen: Collection[str] = (),
) -> dict[str, Tensor]:
    """Local SGD of m clients at once; returns each client's trained parameters.

    features: (n, *input_shape) inputs of all samples; labels: (n,) int64; client_ids: (n,);
    clients: (m,) distinct client ids to train. Cross-entropy on `model`'s logits.
    prox_mu, prox_center: adds μ/2 ‖w − c‖² (FedProx, Ditto); c defaults to the model's
        parameters; each entry may be shared (param shape) or per client ((m, *shape)).
    init: per-client (m, *shape) or shared starting points; default the model's parameters.
    correction: r, added to every step's gradient (the gradient of the linear term ⟨r, w⟩);
        per entry shared (param shape) or per client ((m, *shape)); missing entries are 0.
    seed: the round's minibatch seed; client k shuffles with `client_generator(seed, k)`.
    momentum: β of heavy-ball momentum (buffer from 0 at every call); weight_decay: λ, adds λ w.
    frozen: names of parameters that keep the model's value (no gradient is taken of them).
    Returns {name: (m, *param.shape)} in the order of `clients`, detached.
    """
    if epochs < 0 or batch_size < 1 or not lr >= 0 or prox_mu < 0 or not 0 <= momentum < 1 or weight_decay < 0:
        raise ValueError(
            f"local_sgd needs epochs ≥ 0, batch_size ≥ 1, lr ≥ 0, prox_mu ≥ 0, 0 ≤ momentum < 1 and "
            f"weight_decay ≥ 0; got epochs={epochs}, batch_size={batch_size}, lr={lr}, prox_mu={prox_mu}, "
            f"momentum={momentum}, weight_decay={weight_decay}"
        )
    m = len(clients)
    if unknown := sorted(set(frozen) - {name for name, _ in model.named_parameters()}):
        raise ValueError(f"frozen names {unknown}, which are not parameters of the model")
    # a frozen parameter goes in with the buffers: a constant of the loss, not differentiated
    global_params = {name: p.detach() for name, p in model.named_parameters() if name not in frozen}
    fixed = {name: p.detach() for name, p in model.named_parameters() if name in frozen}
    buffers = {name: b.detach() for name, b in model.named_buffers()} | fixed
    counts = torch.bincount(client_ids, minlength=int(clients.max()) + 1 if m else 1)[clients]
    by_size = torch.argsort(
        counts, descending=True, stable=True
    )  # busy clients first: a prefix works

    params, center, center_per_client, shift = {}, {}, {}, {}
    for name, value in global_params.items():
        start, per_client = _per_client(
            None if init is None else init.get(name), value, m, f"init[{name!r}]"
        )
        params[name] = (start[by_size] if per_client else start.expand(m, *value.shape)).clone()
        if prox_mu > 0:
            c, per_client = _per_client(
                None if prox_center is None else prox_center.get(name),
                value,
                m,
                f"prox_center[{name!r}]",
            )
            center[name], center_per_client[name] = (c[by_size] if per_client else c), per_client
        if correction is not None and name in correction:
            r, per_client = _per_client(correction[name], value, m, f"correction[{name!r}]")
            shift[name] = (r[by_size] if per_client else r.expand(m, *value.shape)).to(value)
    if correction is not None and (unknown := sorted(set(correction) - set(global_params) - set(fixed))):
        raise ValueError(f"correction names {unknown}, which are not parameters of the model")

    def loss(p: dict[str, Tensor], x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        logits = functional_call(model, (p, buffers), (x,))
        return (F.cross_entropy(logits, y, reduction="none") * weight).sum()

    # only the cross-entropy goes through autograd: the other terms' gradients are closed forms,
    # added to it in place (μ/2 ‖w − c‖² differentiated by autograd cost 2.6× a plain step)
    client_grad = vmap(grad(loss)) if m > 1 else _one_client(loss)
    velocity = {name: torch.zeros_like(value) for name, value in params.items()} if momentum > 0 else {}
    with torch.no_grad():
        for index, mask, active in _schedule(
            client_ids, clients[by_size], epochs=epochs, batch_size=batch_size, seed=seed
        ):
            index, mask = index[:active], mask[:active]  # the clients with a batch: a prefix
            weight = mask.to(features.dtype) / mask.sum(1, keepdim=True)
            prefix = {name: value[:active] for name, value in params.items()}
            with torch.enable_grad():
                step = client_grad(prefix, features[index], labels[index], weight)
            for name, value in prefix.items():
                direction = step[name]  # ∇ CE, a fresh tensor: the other terms add to it in place
                if name in shift:
                    direction.add_(shift[name][:active])  # r_k
                if prox_mu > 0:
                    c = center[name][:active] if center_per_client[name] else center[name]
                    direction.add_(value - c, alpha=prox_mu)  # ∇ μ/2 ‖w − c‖² = μ (w − c)
                if weight_decay > 0:
                    direction.add_(value, alpha=weight_decay)
                if momentum > 0:
                    buffer = velocity[name][:active]
                    buffer.mul_(momentum).add_(direction)  # clients without a batch keep theirs
                    direction = buffer
                value.sub_(direction, alpha=lr)  # in place on the prefix view
    unsort = torch.argsort(by_size)
    trained = {name: value[unsort] for name, value in params.items()}
    # every parameter, in the model's order: the frozen ones as they came in
    return {name: trained[name] if name in trained else p.detach().expand(m, *p.shape).clone()
            for name, p in model.named_parameters()}


def _one_client(loss: Callable[..., Tensor]) -> Callable[..., dict[str, Tensor]]:
    """`vmap(grad(loss))` for a batch of one client (a ClientApp's, or one masking alone under
    secure aggregation) by plain autograd: the same gradient at a torch.optim loop's speed
    (functorch's transforms cost 3.6× the step on an MLP head)."""

    def client_grad(params: dict[str, Tensor], x: Tensor, y: Tensor, weight: Tensor) -> dict[str, Tensor]:
        leaves = {name: value[0].detach().requires_grad_() for name, value in params.items()}
        gradients = torch.autograd.grad(loss(leaves, x[0], y[0], weight[0]), list(leaves.values()),
                                        allow_unused=True, materialize_grads=True)  # an unused one: 0, as grad gives
        return {name: gradient[None] for name, gradient in zip(leaves, gradients, strict=True)}

    return client_grad


def _rows(full: Tensor, rows: Tensor | None) -> Tensor:
    """The rows `rows` of `full` (None: all of it)."""
    return full if rows is None else full[rows]


def _put(full: Tensor, rows: Tensor | None, part: Tensor) -> Tensor:
    """`full` with its rows `rows` replaced by `part` (None: `part` is all of it); out of place."""
    return part if rows is None else full.index_copy(0, rows, part)


def lbfgs(
    objective: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]],
    start: Tensor,
    *,
    steps: int,
    history: int = 10,
    max_backtracks: int = 12,
    armijo: float = 1e-4,
    curvature_eps: float = 1e-10,
) -> tuple[Tensor, Tensor]:
    """Minimize m independent problems with L-BFGS, evaluations batched.

    objective: (x (r, n), rows) -> (values (r,), gradients (r, n)) of the problems `rows` (r,)
        (int64 indices among the m; None: all m in order, r = m), where row i of both depends only
        on row i of x (separable problems: the values of a row must not depend on which other
        rows are evaluated with it).
    start: (m, n). steps: L-BFGS iterations (each one line search); history: stored (s, y) pairs.
    Per problem: direction by the two-loop recursion with H₀ = (sᵀy / yᵀy) I from the newest pair;
    first step length min(1, 1/‖g‖₁) without history, else 1; halved until Armijo's condition
    f(x + t d) ≤ f(x) + armijo · t · gᵀd holds. A failed line search leaves the problem where it
    is and clears its history (the next iteration restarts from steepest descent). The first trial
    of a line search evaluates every problem; each backtrack after it only those that have not
    accepted a step (gathered, evaluated, scattered back).
    Returns (x (m, n), values (m,)); values never increase.
    """
    x = start.detach().clone()
    m, n = x.shape
    value, gradient = objective(x, None)
    s_hist = x.new_zeros(m, history, n)  # oldest ... newest along dim 1
    y_hist = x.new_zeros(m, history, n)
    rho = x.new_zeros(m, history)  # 1 / sᵀy, 0 for an empty slot
    tiny = torch.finfo(x.dtype).tiny
    for _ in range(steps):
        # Two-loop recursion, each row with its own pairs (empty slots have rho = 0: no effect).
        q = -gradient
        alphas = []
        for slot in reversed(range(history)):
            alpha = rho[:, slot] * (s_hist[:, slot] * q).sum(1)
            q = q - alpha[:, None] * y_hist[:, slot]
            alphas.append(alpha)
        newest_yy = (y_hist[:, -1] ** 2).sum(1)
        has_history = rho[:, -1] > 0
        scale = torch.where(
            has_history, 1 / (rho[:, -1] * newest_yy).clamp_min(tiny), torch.ones_like(newest_yy)
        )
        direction = q * scale[:, None]
        for slot, alpha in zip(range(history), reversed(alphas), strict=True):
            beta = rho[:, slot] * (y_hist[:, slot] * direction).sum(1)
            direction = direction + (alpha - beta)[:, None] * s_hist[:, slot]
        # A direction that does not descend (numerical trouble) restarts from steepest descent.
        restart = (gradient * direction).sum(1) >= 0
        direction = torch.where(restart[:, None], -gradient, direction)
        rho = rho.masked_fill(restart[:, None], 0)
        has_history = has_history & ~restart
        slope = (gradient * direction).sum(1)
        descent = slope < 0  # False only where the gradient is exactly zero
        step = torch.where(
            has_history,
            torch.ones_like(slope),
            (1 / gradient.abs().sum(1).clamp_min(tiny)).clamp(max=1),
        )

        # Backtracking, batched over the rows still searching: the first trial evaluates every
        # row (all search but one whose gradient is exactly zero, evaluated where it stands), each
        # later one gathers the rows that have not accepted a step and scatters their results back.
        accepted = ~descent
        new_x, new_value, new_gradient = x, value, gradient  # (replaced, never written in place)
        rows: Tensor | None = None  # the rows evaluated (None: all)
        for _ in range(max_backtracks):
            row_step, row_accepted = _rows(step, rows), _rows(accepted, rows)
            trial = _rows(x, rows) + row_step[:, None] * _rows(direction, rows)
            trial_value, trial_gradient = objective(trial, rows)
            ok = ~row_accepted & (trial_value <= _rows(value, rows) + armijo * row_step * _rows(slope, rows))
            new_x = _put(new_x, rows, torch.where(ok[:, None], trial, _rows(new_x, rows)))
            new_value = _put(new_value, rows, torch.where(ok, trial_value, _rows(new_value, rows)))
            new_gradient = _put(new_gradient, rows, torch.where(ok[:, None], trial_gradient, _rows(new_gradient, rows)))
            accepted = _put(accepted, rows, row_accepted | ok)
            step = torch.where(accepted, step, step / 2)
            # the rows still searching: the line search's one read of the device a backtrack
            rows = (~accepted).nonzero().squeeze(1)
            if len(rows) == 0:
                break
        failed = ~accepted
        # Curvature pair of the step taken; kept only when sᵀy > 0 (keeps H positive definite).
        s, y = new_x - x, new_gradient - gradient
        sy = (s * y).sum(1)
        keep = accepted & descent & (sy > curvature_eps)
        s_hist = torch.where(keep[:, None, None], torch.cat([s_hist[:, 1:], s[:, None]], 1), s_hist)
        y_hist = torch.where(keep[:, None, None], torch.cat([y_hist[:, 1:], y[:, None]], 1), y_hist)
        rho = torch.where(keep[:, None], torch.cat([rho[:, 1:], (1 / sy.where(keep, 1))[:, None]], 1), rho)
        rho = rho.masked_fill(failed[:, None], 0)  # restart from steepest descent
        x, value, gradient = new_x, new_value, new_gradient
    return x, value
