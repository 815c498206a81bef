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
3. It uploads Δw_k (float32, 4·P bytes), or a compressed version (`compression.kind`: `topk`,
   `quantize` or `sign`, see workbench/federation/compression.py) with error feedback:
   g_k = Δw_k + e_k, sent_k = C(g_k), e_k ← g_k − sent_k (optionally bounded or decayed:
   `error_feedback.bound`, `error_feedback.decay`).
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
client shuffling with a stream of its own (the same alone on a Flower node). The client half
keeps each client's error-feedback residual. With one client, full participation and η_s = 1,
FedAvg is centralized minibatch SGD (tested).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import Tensor

from workbench.federation.compression import Compression, ErrorFeedback
from workbench.methods.base import MODEL_UPDATE, Cohort, Metrics, Problem, Upload, Uploads
from workbench.methods.gradient import GradientClient, GradientMethod


class FedAvgClient(GradientClient):
    """Clients of FedAvg: local SGD from the broadcast w_t, Δw compressed with error feedback.

    State: the model as last received (`net`), each served client's residual e_k (`feedback`).
    """

    def __init__(self, problem: Problem, method: FedAvg) -> None:
        super().__init__(problem, method)
        self.compression, self.error_feedback = method.compression, method.error_feedback
        self.compressor = method.compression.build([p.numel() for p in self.net.parameters()])

    def setup_state(self) -> None:
        lossy = self.compression.lossy and self.error_feedback.enabled
        self.feedback = self.error_feedback.residuals(self.flat.vector().numel()) if lossy else None

    def encode(self, round_index: int, cohort: Cohort, updates: Tensor) -> tuple[Uploads, Metrics]:
        """The clients' messages, one row each: compressed Δw with error feedback -> {"update": (m, P)}
        (the protocol clips them under client-level DP and sums them)."""
        slots = self.client_slots(cohort.clients)
        target = self.feedback.target(slots, updates) if self.feedback is not None else updates
        sent = self.compressor(target)
        if self.feedback is not None:
            self.feedback.keep(slots, target, sent, updates)
        return {"update": sent}, {}


class FedAvg(GradientMethod):
    """Federated averaging of local SGD updates, optionally compressed.

    Args:
        compression: how Δw travels (`Compression`: kind none/topk/quantize/sign, topk_fraction,
            quantize_bits, quantize_symmetric).
        error_feedback: each client's carry of what compression lost (`ErrorFeedback`: enabled,
            bound, decay).
        **kwargs: every gradient method's settings (`GradientMethod`: num_rounds, architecture,
            hidden_dim, local, sample_fraction, server_lr, seed).
    """

    # with the compressor as its encoding once set up
    uploads: Mapping[str, Upload] = MappingProxyType({"update": MODEL_UPDATE})
    client_class: type[FedAvgClient] = FedAvgClient

    def __init__(self, compression: Compression = Compression(), error_feedback: ErrorFeedback = ErrorFeedback(),
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if compression.kind == "quantize" and not compression.quantize_symmetric and compression.quantize_bits < 4 \
                and error_feedback.enabled:
            raise ValueError(f"{compression.quantize_bits}-bit min-max quantization is not contractive (no level at "
                             "0), so its error feedback can grow without bound: set "
                             "compression.quantize_symmetric=true (or compression.kind=sign for 1 bit), or "
                             "error_feedback.enabled=false")
        self.compression, self.error_feedback = compression, error_feedback

    def setup_problem(self, problem: Problem) -> None:
        super().setup_problem(problem)
        compressor = self.compression.build([p.numel() for p in self.net.parameters()])
        self.uploads = {"update": Upload(model_update=True, encoding=compressor)}

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
