"""FedAvg and FedProx: local SGD on the sampled clients, the server averages their updates.

Round t, global model w_t (P parameters), K clients (steps 1–2 are every gradient method's,
`workbench.methods.gradient`):

1. The server samples m = max(1, round(q·K')) of the K' clients with data (q = `sample_fraction`,
   seeded by (seed, t)) and sends them w_t (w₀ travels as its seed).
2. Each sampled client k runs `local.epochs` epochs of minibatch SGD (batch `local.batch_size`,
   step η_t) from w_t on its own data, minimizing the cross-entropy, plus μ/2 ‖w − w_t‖² for
   FedProx, and gets Δw_k = w_t − w_k. η_t = `local.lr` by default; `local.lr_schedule` decays it
   over the rounds (cosine or step, `workbench.federation.local_training.scheduled_lr`: a function
   of t and R only, so every client, in process or on a Flower node, uses the same).
   `local.momentum` and `local.weight_decay` act as in `torch.optim.SGD`, the momentum buffer local
   to the round.
3. It uploads Δw_k (float32, 4·P bytes), or, under the protocol's compression
   (`federation.compression.kind`: `topk`, `quantize` or `sign`, the compress stage of
   workbench/federation/stages.py), a compressed version with error feedback: g_k = Δw_k + e_k,
   sent_k = C(g_k), e_k ← g_k − sent_k (optionally bounded or decayed:
   `federation.error_feedback.bound`, `federation.error_feedback.decay`).
4. The server: w_{t+1} = w_t − η_s · (1/m) Σ_k sent_k  (η_s = `server_lr`; 1 is FedAvg).

Under client-level DP (`federation.dp_clip`, workbench/federation/privacy.py) the protocol clips
each client's sent_k to the round's norm C (after the compressor: the residual e_k is the
compressor's error only) and sends the bit ‖sent_k‖ ≤ C beside it; the server noises the sum, and
with Poisson cohorts (`federation.sample_rate`) the server averages by the fixed E[m] = qK'. The
protocol's cohort sampling replaces `sample_fraction` there (the accountant knows only the
protocol's).

Clients are averaged with equal weights, the 1/m Σ_k of OS-FED's recovery, so that every
method here aggregates the same way (weighting by n_k would also send n_k). The m clients
train at once in process, vectorized (`workbench.federation.local_training.local_sgd`), each
client shuffling with a stream of its own (the same alone on a Flower node); the client half
holds each client's error-feedback residual for the compress stage. With one client, full
participation and η_s = 1, FedAvg is centralized minibatch SGD (tested).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from workbench.methods.base import Metrics, Upload, Uploads
from workbench.methods.gradient import UPDATE, GradientMethod


class FedAvg(GradientMethod):
    """Federated averaging of local SGD updates.

    Args:
        **kwargs: every gradient method's settings (`GradientMethod`: num_rounds, architecture,
            hidden_dim, local, sample_fraction, server_lr, seed). How the updates travel
            (compressed, clipped, masked) is the protocol's: `federation.compression`, ...
    """

    uploads: Mapping[str, Upload] = MappingProxyType({"update": UPDATE})

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        self.apply_update(uploads["update"] / num_clients)
        return {}


class FedProx(FedAvg):
    """FedAvg whose clients minimize CE + μ/2 ‖w − w_t‖² (a proximal pull to the global model).

    Args:
        mu: μ ≥ 0 (0 is FedAvg). Plain SGD on the proximal term is stable only for lr · μ < 2.
        **kwargs: FedAvg's arguments.
    """

    def __init__(self, mu: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        lr = self.local.lr
        if not 0 <= mu or lr * mu >= 2:  # lr 0: no step at all
            raise ValueError(f"FedProx needs 0 ≤ mu < 2 / local.lr = {2 / lr:g} (local SGD diverges on the proximal "
                             f"term beyond), got mu = {mu}: lower mu or local.lr")
        self.prox_mu = mu
