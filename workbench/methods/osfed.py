"""OS-FED: each client uploads one learned snapshot per round that regenerates its update.

Round t, global model w_t with loss L, sampled clients k = 1..m (sampling and local training as
in FedAvg, workbench/methods/fedavg.py):

1. Client k trains locally and gets Δw_k = w_t − w_k; its target is Δg_k = Δw_k + e_k
   (error feedback, e_k = 0 at first).
2. Snapshot S_k = (Z_k, ℓ_k): a grid map Z_k and M² learnable label embeddings ℓ_k (M², C).
   The multi-grid function F(Z) gives M² synthetic inputs:
   - images (c, H, W): Z is one (c, R, R) map cut into M×M cells of (R/M)² pixels, each
     bilinearly upsampled to H×W. R = M · round(cell_scale · H): by default (cell_scale 1)
     every cell has the input's own resolution (no upsampling; a 2×2 map of 28×28 digits is
     56×56, c·R² + M²·C = 3176 float32, 12.7 kB); `snapshot_resolution` sets R directly;
   - feature vectors (d,): Z is M² learnable vectors (M², d), F the identity.
   The snapshot's gradient is g(S) = ∇_w L_S(w_t) with the soft cross-entropy
   L_S(w) = (1/M²) Σ_i −ℓ_iᵀ log softmax(f(F(Z)_i; w)); ℓ_i is a free vector (not constrained
   to the simplex), so the snapshot can set both the direction and the size of its gradient.
3. S_k* = argmin_S ‖g(S) − Δg_k‖² / (‖Δg_k‖² + ε), by L-BFGS through double backprop; the
   problems of the m clients are solved at once but independently (per-client histories and
   line searches, workbench/federation/local_training.lbfgs; a backtrack evaluates only the
   clients that have not yet accepted a step). g is linear in ℓ, so the scale
   of ℓ is solved in closed form inside the objective: with α(S) = ⟨g(S), Δg⟩ / ‖g(S)‖²,
   L-BFGS minimizes ‖α g(S) − Δg‖² / (‖Δg‖² + ε) — the same minimum over S (α ℓ is a label
   embedding too), without the flat start where g(S) ⟂ Δg — and the client sends α* ℓ*.
   Start: M² inputs drawn from a Gaussian with the client's input mean and standard deviation
   (per dimension for features, per channel for images; the noise from the client's own stream,
   `client_generator(round seed, k)`, the same alone on a Flower node) and labels ℓ₀ = ∂⟨g(Z₀, ℓ), Δg⟩/∂ℓ,
   the labels whose gradient correlates most with the target (one backward; no real sample
   or label enters the snapshot).
4. e_k ← Δg_k − g(S_k*) (client state: the client half's `feedback`; optionally bounded,
   ‖e_k‖ ≤ c · ‖Δw_k‖, or decayed, e ← γ e: a snapshot is not a contractive compressor, and
   with the plain form the residual can grow to many times the update); client k uploads only
   S_k* (float32), as stacked uploads (one row per client): M²·d + M²·C numbers for features,
   c·R² + M²·C for images.
5. Server: one forward/backward on the concatenation of the m snapshots (m·M² samples) gives
   ∇L_mean = (1/m) Σ_k g(S_k*), and w_{t+1} = w_t − η_s ∇L_mean (η_s = `server_lr`, 1 in the
   paper). It estimates FedAvg's w_t − (1/m) Σ_k Δw_k.

The snapshot geometry (F, L_S, g, the fit) is `SnapshotGeometry`, shared by the client half
(`OSFEDClient`, which fits) and the server (which recovers), each on its own copy of the model.
Diagnostics, every round. The clients report, as sums over clients (the engine logs their
means): `osfed/match_loss`, the normalized matching loss at S* against the error-fed target
Δg_k; `osfed/match_loss_fresh`, ‖g(S_k*) − Δw_k‖² / ‖Δw_k‖², against this round's update alone;
`osfed/residual_norm`, ‖e_k‖ after the round; `osfed/residual_ratio`, ‖e_k‖ / ‖Δw_k‖. With
`diagnostics=True` the clients also upload Σ_k Δw_k (a summed float32 vector that is not part of
the protocol and not counted in the bytes), and the server logs `osfed/update_rel_error`,
‖ĝ − mean Δw‖ / ‖mean Δw‖ with ĝ = ∇L_mean the update it applies (sending nothing scores 1,
so above 1 the round moved the model farther from FedAvg's step than not moving it),
`osfed/update_cosine` between ĝ and mean Δw, and `osfed/update_norm_ratio` ‖ĝ‖ / ‖mean Δw‖.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, vmap

from workbench.federation.codec import WireSize
from workbench.federation.compression import ErrorFeedback, as_sent
from workbench.federation.local_training import client_generator, lbfgs
from workbench.methods.base import STACKED, Cohort, Metrics, Problem, Upload, Uploads
from workbench.methods.gradient import MOVED_SETTINGS, SNAPSHOTS, GradientClient, GradientMethod, round_seed


def multi_grid(grid_map: Tensor, grid_size: int, size: tuple[int, int]) -> Tensor:
    """(..., c, R, R) -> (..., M², c, H, W): M×M cells of (R/M)² pixels, each upsampled to size."""
    *lead, channels, side, _ = grid_map.shape
    cell = side // grid_size
    cells = grid_map.reshape(-1, channels, grid_size, cell, grid_size, cell).permute(
        0, 2, 4, 1, 3, 5
    )
    cells = cells.reshape(-1, channels, cell, cell)
    samples = F.interpolate(cells, size=size, mode="bilinear", align_corners=False)
    return samples.reshape(*lead, grid_size * grid_size, channels, *size)


def soft_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """mean_i −ℓ_iᵀ log softmax(z_i): (n, C), (n, C) -> ()."""
    return -(labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()


@dataclass(frozen=True)
class Snapshot:
    """One client's synthetic snapshot and its fit.

    grid_size: M; the snapshot makes M² synthetic samples.
    resolution: R, side of the image snapshot map, a multiple of M (default
        M · round(cell_scale · H)). Unused for feature vectors.
    cell_scale: side of one cell as a share of the image side (1: cells at the input's own
        resolution, R = M · H), when `resolution` is not set.
    lbfgs_steps: L-BFGS iterations per snapshot fit; lbfgs_history: its stored pairs.
    match_eps: ε of the normalized matching loss.
    """

    grid_size: int = 2
    resolution: int | None = None
    cell_scale: float = 1.0
    lbfgs_steps: int = 30
    lbfgs_history: int = 10
    match_eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.grid_size < 1 or self.lbfgs_steps < 0 or self.lbfgs_history < 1 or not self.match_eps > 0:
            raise ValueError(f"OSFED needs snapshot.grid_size ≥ 1, snapshot.lbfgs_steps ≥ 0, snapshot.lbfgs_history "
                             f"≥ 1 and snapshot.match_eps > 0, got {self.grid_size}, {self.lbfgs_steps}, "
                             f"{self.lbfgs_history}, {self.match_eps}")
        if self.resolution is not None and (self.resolution < self.grid_size or self.resolution % self.grid_size):
            raise ValueError(f"snapshot.resolution must be a multiple of snapshot.grid_size = {self.grid_size}, "
                             f"got {self.resolution}")
        if not self.cell_scale > 0:
            raise ValueError(f"snapshot.cell_scale must be > 0 (1: cells at the input's resolution), got "
                             f"{self.cell_scale}")


class SnapshotGeometry:
    """F(Z), L_S and g(S) = ∇_w L_S(w) of snapshots under a model `net`, and the snapshot fit.

    Shared by the client half (fits snapshots) and the server (recovers from them); each calls
    `setup_snapshots` with its own net and the method's `Snapshot` settings.
    """

    net: nn.Module

    def setup_snapshots(self, input_shape: tuple[int, ...], num_classes: int, snapshot: Snapshot) -> None:
        grid_size = snapshot.grid_size
        self.input_shape, self.grid_size = tuple(input_shape), grid_size
        self.lbfgs_steps, self.lbfgs_history = snapshot.lbfgs_steps, snapshot.lbfgs_history
        self.match_eps = snapshot.match_eps
        self.on_images = len(self.input_shape) == 3
        cells = grid_size**2
        if self.on_images:
            side = snapshot.resolution or grid_size * max(1, round(snapshot.cell_scale * self.input_shape[1]))
            if side % grid_size:
                raise ValueError(f"the snapshot side {side} (snapshot.resolution) must be a multiple of "
                                 f"snapshot.grid_size = {grid_size}")
            self.snapshot_shape: tuple[int, ...] = (self.input_shape[0], side, side)
        else:
            self.snapshot_shape = (cells, *self.input_shape)
        self.label_shape = (cells, num_classes)
        self.snapshot_numel = torch.Size(self.snapshot_shape).numel()

    # ---- the snapshot's gradient ------------------------------------------------------------
    def synthetic_samples(self, snapshot: Tensor) -> Tensor:
        """F(Z): (..., *snapshot_shape) -> (..., M², *input_shape)."""
        if self.on_images:
            return multi_grid(snapshot, self.grid_size, (self.input_shape[1], self.input_shape[2]))
        return snapshot

    def snapshot_loss(self, params: dict[str, Tensor], snapshot: Tensor, labels: Tensor) -> Tensor:
        """L_S(w) of snapshots (..., *snapshot_shape), labels (..., M², C), mean over samples."""
        samples = self.synthetic_samples(snapshot)
        samples = samples.reshape(-1, *self.input_shape)
        logits = functional_call(self.net, params, (samples,))
        return soft_cross_entropy(logits, labels.reshape(-1, labels.shape[-1]))

    def synthetic_gradient(
        self, params: dict[str, Tensor], snapshot: Tensor, labels: Tensor
    ) -> Tensor:
        """g(S) = ∇_w L_S(w), flattened to (P,) in the model's parameter order."""
        grads = grad(self.snapshot_loss)(params, snapshot, labels)
        return torch.cat([grads[name].reshape(-1) for name in params])

    def gradient_match(
        self, params: dict[str, Tensor], variables: Tensor, target: list[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(⟨g, Δg⟩, ‖g‖²) of one client's snapshot, summed tensor by tensor (no flat copy of g)."""
        grads = grad(self.snapshot_loss)(params, *self.unpack(variables))
        inner = sum((grads[name] * part).sum() for name, part in zip(params, target, strict=True))
        square = sum((grads[name] ** 2).sum() for name in params)
        return inner, square

    def parameters_now(self) -> dict[str, Tensor]:
        return {name: p.detach() for name, p in self.net.named_parameters()}

    def recover(self, snapshots: Tensor, labels: Tensor) -> Tensor:
        """The server's recovery: ∇L_mean of the stacked snapshots: (m, ...), (m, M², C) -> (P,)."""
        params = self.parameters_now()
        dtype = next(iter(params.values())).dtype  # snapshots arrive as float32
        return self.synthetic_gradient(params, snapshots.to(dtype), labels.to(dtype))

    # ---- the client's compression: fit the snapshot ------------------------------------------
    def pack(self, snapshot: Tensor, labels: Tensor) -> Tensor:
        return torch.cat([snapshot.reshape(len(snapshot), -1), labels.reshape(len(labels), -1)], 1)

    def unpack(self, variables: Tensor) -> tuple[Tensor, Tensor]:
        lead = variables.shape[:-1]
        snapshot, labels = variables.split(
            [self.snapshot_numel, variables.shape[-1] - self.snapshot_numel], -1
        )
        return snapshot.reshape(*lead, *self.snapshot_shape), labels.reshape(
            *lead, *self.label_shape
        )

    def matching_loss(self, snapshot: Tensor, labels: Tensor, targets: Tensor) -> Tensor:
        """The normalized matching loss of each client: (m, ...), (m, M², C), (m, P) -> (m,)."""
        recovered = vmap(self.synthetic_gradient, in_dims=(None, 0, 0))(
            self.parameters_now(), snapshot, labels
        )
        return ((recovered - targets) ** 2).sum(1) / ((targets**2).sum(1) + self.match_eps)

    def correlated_labels(self, snapshot: Tensor, targets: Tensor) -> Tensor:
        """ℓ₀ = ∂⟨g(Z, ℓ), Δg⟩/∂ℓ (the same at every ℓ: g is linear in ℓ).

        snapshot (m, *snapshot_shape), targets (m, P) -> labels (m, M², C).
        """
        params = self.parameters_now()

        def correlation(labels: Tensor, grid_map: Tensor, target: Tensor) -> Tensor:
            return (self.synthetic_gradient(params, grid_map, labels) * target).sum()

        zeros = snapshot.new_zeros(len(snapshot), *self.label_shape)
        return vmap(grad(correlation))(zeros, snapshot, targets)

    def fit_snapshots(
        self,
        targets: Tensor,
        snapshot: Tensor,
        labels: Tensor | None = None,
        steps: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """L-BFGS on each client's matching loss (label scale in closed form), all clients at once.

        targets: Δg (m, P); snapshot (m, *snapshot_shape): the start; labels (m, M², C): the
        start, by default `correlated_labels`. steps: L-BFGS iterations (default lbfgs_steps).
        Returns (snapshot*, labels* (scaled by α), g(S*) (m, P), matching loss at S* (m,)), the
        snapshot rounded to the float32 that is sent and g(S*) computed from it, as the server will.
        """
        params = self.parameters_now()
        squares = (targets**2).sum(1)
        tiny = torch.finfo(targets.dtype).tiny
        target_parts = [
            part.reshape(len(targets), *value.shape)
            for part, value in zip(
                targets.split([v.numel() for v in params.values()], 1), params.values(), strict=True
            )
        ]

        def matching_loss(variables: Tensor, target: list[Tensor], square: Tensor) -> Tensor:
            # ‖α g − Δg‖² at the best α = ⟨g, Δg⟩ / ‖g‖² is ‖Δg‖² − ⟨g, Δg⟩² / ‖g‖²
            inner, g_square = self.gradient_match(params, variables, target)
            return (square - inner**2 / (g_square + tiny)) / (square + self.match_eps)

        per_client = vmap(grad_and_value(matching_loss))

        def objective(variables: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
            """Values and gradients of the clients `rows` (None: all m); the line search's
            backtracks ask only for the clients still searching."""
            if rows is None:
                gradient, value = per_client(variables, target_parts, squares)
                return value, gradient
            # vmap over a batch of one row takes other kernels than over two or more (the packed
            # row's views are contiguous then: another summation order, ~1e-8 off the batch's
            # values), so a lone client among several is evaluated as a pair
            lone = len(rows) == 1 < len(targets)
            if lone:
                variables, rows = variables.repeat(2, 1), rows.repeat(2)
            gradient, value = per_client(variables, [part[rows] for part in target_parts], squares[rows])
            return (value[:1], gradient[:1]) if lone else (value, gradient)

        if labels is None:
            labels = self.correlated_labels(snapshot, targets)
        variables, _ = lbfgs(
            objective,
            self.pack(snapshot, labels),
            history=self.lbfgs_history,
            steps=self.lbfgs_steps if steps is None else steps,
        )
        snapshot, labels = self.unpack(variables)
        snapshot = as_sent(snapshot)
        unscaled = vmap(self.synthetic_gradient, in_dims=(None, 0, 0))(params, snapshot, labels)
        alpha = (unscaled * targets).sum(1) / ((unscaled**2).sum(1) + tiny)  # the label scale
        labels = as_sent(labels * alpha[:, None, None])
        recovered = vmap(self.synthetic_gradient, in_dims=(None, 0, 0))(params, snapshot, labels)
        loss = ((recovered - targets) ** 2).sum(1) / (squares + self.match_eps)
        return snapshot, labels, recovered, loss



class OSFEDClient(SnapshotGeometry, GradientClient):
    """OS-FED's clients: local SGD, then each Δw_k + e_k fitted by a snapshot.

    State: the model as last received (`net`), each served client's residual e_k (`feedback`).
    """

    def __init__(self, problem: Problem, method: OSFED) -> None:
        super().__init__(problem, method)
        self.error_feedback, self.diagnostics = method.error_feedback, method.diagnostics
        self.setup_snapshots(problem.input_shape, problem.num_classes, method.snapshot)

    def setup_state(self) -> None:  # a snapshot loses: error feedback carries what it missed
        enabled = self.error_feedback.enabled
        self.feedback = self.error_feedback.residuals(self.flat.vector().numel()) if enabled else None

    def initial_snapshots(self, round_index: int, cohort: Cohort) -> Tensor:
        """Random start (m, *snapshot_shape): inputs ~ N(client mean, client std²), per dimension
        for features, per channel for images; client k's noise from its own stream."""
        clients = cohort.clients
        m = len(clients)
        rows = torch.searchsorted(clients, cohort.client_ids)  # each row's position in the cohort
        # (n, d, 1) for features, (n, c, H·W) for images: moments per dimension / per channel
        x = cohort.features.to(self.dtype).reshape(len(cohort), *self.input_shape[:1], -1)
        count = torch.bincount(rows, minlength=m).clamp_min(1).to(x.dtype)
        mean = x.new_zeros(m, *x.shape[1:]).index_add_(0, rows, x).mean(-1) / count[:, None]
        square = x.new_zeros(m, *x.shape[1:]).index_add_(0, rows, x**2).mean(-1) / count[:, None]
        std = (square - mean**2).clamp_min(0).sqrt()
        seed = round_seed(self.seed, round_index, SNAPSHOTS)
        noise = torch.stack([
            torch.randn(self.snapshot_shape, generator=client_generator(seed, int(client)), dtype=torch.float32)
            for client in clients.tolist()
        ]).to(x) if m else x.new_zeros(0, *self.snapshot_shape)
        if self.on_images:  # per channel
            return mean[:, :, None, None] + std[:, :, None, None] * noise
        return mean[:, None, :] + std[:, None, :] * noise  # per dimension

    def encode(self, round_index: int, cohort: Cohort, updates: Tensor) -> tuple[Uploads, Metrics]:
        """Fit S_k* to Δg_k = Δw_k + e_k, keep e_k ← Δg_k − g(S_k*), upload the snapshots (stacked)."""
        start = time.perf_counter()
        slots = self.client_slots(cohort.clients)
        targets = self.feedback.target(slots, updates) if self.feedback is not None else updates
        snapshot, labels, recovered, loss = self.fit_snapshots(targets, self.initial_snapshots(round_index, cohort))
        if self.feedback is not None:
            residual = self.feedback.keep(slots, targets, recovered, updates)
        else:
            residual = targets - recovered  # what EF would carry: reported all the same
        size = updates.norm(dim=1)
        tiny = torch.finfo(size.dtype).tiny
        fresh = ((recovered - updates) ** 2).sum(1) / (size**2 + self.match_eps)
        metrics = {"osfed/match_loss": float(loss.sum()), "osfed/match_loss_fresh": float(fresh.sum()),
                   "osfed/residual_norm": float(residual.norm(dim=1).sum()),
                   "osfed/residual_ratio": float((residual.norm(dim=1) / size.clamp_min(tiny)).sum()),
                   "time/compress_s": time.perf_counter() - start}  # the snapshot fit is its compression
        uploads = {"snapshot_inputs": snapshot.float(), "snapshot_labels": labels.float()}
        if self.diagnostics:
            uploads["diagnostic_update"] = updates.sum(0).float()  # Σ Δw_k, for the server's diagnostics
        return uploads, metrics


class OSFED(SnapshotGeometry, GradientMethod):
    """OS-FED (CVPR 2026): local SGD whose clients each upload one learned synthetic snapshot per round.

    Args:
        snapshot: the snapshot and its fit (`Snapshot`: grid_size, resolution, cell_scale,
            lbfgs_steps, lbfgs_history, match_eps).
        error_feedback: carry e_k = Δg_k − g(S_k*) to the next round (`ErrorFeedback`: enabled,
            bound, decay).
        diagnostics: also upload Σ_k Δw_k (not counted, not part of the protocol) so the server
            logs how far its update is from FedAvg's.
        **kwargs: every gradient method's settings (`GradientMethod`: num_rounds, architecture,
            hidden_dim, local, sample_fraction, server_lr, seed).
    """

    # a snapshot is no model update: client-level DP does not apply. The diagnostic upload (only with
    # `diagnostics`) is not part of the protocol: no bytes counted
    uploads = MappingProxyType({"snapshot_inputs": STACKED, "snapshot_labels": STACKED,
               "diagnostic_update": Upload(encoding=WireSize(0))})
    client_class = OSFEDClient
    # its error feedback is its own (of the snapshots), not the protocol's compression
    moved_settings = MappingProxyType({**MOVED_SETTINGS, "error_feedback": "error_feedback.enabled",
                                       "error_feedback_bound": "error_feedback.bound",
                                       "error_feedback_decay": "error_feedback.decay"})

    def __init__(self, snapshot: Snapshot = Snapshot(), error_feedback: ErrorFeedback = ErrorFeedback(),
                 diagnostics: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot, self.error_feedback, self.diagnostics = snapshot, error_feedback, diagnostics

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)
        self.setup_snapshots(problem.input_shape, problem.num_classes, self.snapshot)

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        """w ← w − η_s ∇L_mean of the stacked snapshots (the survivors', in client order)."""
        update = self.recover(uploads["snapshot_inputs"], uploads["snapshot_labels"])
        self.apply_update(update)
        if "diagnostic_update" not in uploads:
            return {}
        fedavg = uploads["diagnostic_update"].to(update) / num_clients  # mean Δw, FedAvg's step
        size = fedavg.norm().clamp_min(torch.finfo(update.dtype).tiny)
        tiny = torch.finfo(update.dtype).tiny
        return {"osfed/update_rel_error": float((update - fedavg).norm() / size),
                "osfed/update_cosine": float(update @ fedavg / (update.norm() * size).clamp_min(tiny)),
                "osfed/update_norm_ratio": float(update.norm() / size)}
