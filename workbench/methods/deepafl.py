"""DeepAFL: deep residual analytic federated learning (ICLR 2026), layer by layer in closed form.

On backbone features X (n × d), with one-hot labels Y (n × C):

    Φ₀ = tanh(X A₀ + a₀)                        A₀: d × h, random
    F_t = σ(Φ_{t−1} B_t + b_t)                  B_t: h × f, random         (t = 1..T)
    Φ_t = Φ_{t−1} + F_t Ω_t                     Ω_t: f × h, learned
    W_t = (Σ_k Φ_tᵀΦ_t + γI)⁻¹ Σ_k Φ_tᵀY         the ridge classifier at depth t

Ω_t solves the sandwiched least squares  min_Ω ‖R − F_t Ω W_{t−1}‖² + γ_s‖Ω‖²  with the residual
R = Y − Φ_{t−1} W_{t−1}. Its normal equation  FᵀF Ω WWᵀ + γ_s Ω = FᵀR Wᵀ  is diagonalised by
FᵀF = V diag(S_F) Vᵀ and WWᵀ = U diag(S_W) Uᵀ:

    Ω = V Ω̂ Uᵀ,   Ω̂_ij = (Vᵀ FᵀR Wᵀ U)_ij / (γ_s + S_F,i · S_W,j).

WWᵀ has rank ≤ C, so the h×h eigendecomposition is not needed: with the thin SVD W = U_c diag(s) Qᵀ
(U_c: h × r, r = min(h, C)) the columns of U outside U_c have S_W = 0 and a zero numerator, so

    Ω = L U_cᵀ,   L = V [(Vᵀ FᵀR Q diag(s))_ij / (γ_s + S_F,i · s_j²)]        (f × r)

an f × f eigendecomposition and an h × C SVD; Ω has rank ≤ C (`solve_omega_factors`).

Two schedules (`schedule`), the same model when every client uploads every round:

`two_round` (2T + 1 rounds): round 0 solves W₀; then for each layer t one round for Ω_t (clients
upload FᵀF packed and FᵀR, f × C; broadcast W_{t−1}) and one for W_t (clients upload Φ_tᵀΦ_t
packed and Φ_tᵀY, h × C; broadcast Ω_t). After the last round (`final_broadcast`) W_T.

`fused` (T + 1 rounds, the default): round 0 as above, and the server keeps
G₀ = ΣΦ₀ᵀΦ₀ and P₀ = ΣΦ₀ᵀY. Round t (broadcast Ω_{t−1}, t ≥ 2) each client advances
its kept Φ_{t−2} by its kept F_{t−1}: Φ_{t−1} = Φ_{t−2} + F_{t−1}Ω_{t−1}, computes F_t once and keeps
it, and uploads FᵀF (packed), FᵀY (f × C) and M_t = Φ_{t−1}ᵀF_t (h × f). The server forms
FᵀR = FᵀY − M_tᵀW_{t−1}, solves Ω_t and then, as Φ_t = Φ_{t−1} + F_tΩ_t,

    ΣΦ_tᵀΦ_t = G_{t−1} + M_tΩ_t + (M_tΩ_t)ᵀ + Ω_tᵀ(ΣF_tᵀF_t)Ω_t
    ΣΦ_tᵀY   = P_{t−1} + Ω_tᵀ(ΣF_tᵀR + M_tᵀW_{t−1})          (= P_{t−1} + Ω_tᵀ ΣF_tᵀY)

keeps them as G_t, P_t, solves W_t in the same round; `final_broadcast` sends Ω_T and W_T. Fused
uploads M_t (h·f per layer) instead of the W_t round's Φ_tᵀΦ_t and Φ_tᵀY (h(h+1)/2 + h·C): at
h = f that is more bytes up, in half the rounds. With Ω = L U_cᵀ the server's update costs
O(h²C + f²C), not O(h²f).

Downlink: every Ω_t is broadcast once, as its factors L_t (f × r) and U_t (h × r) whenever
r(f + h) < f·h (`factored`), else as Ω_t; the clients rebuild Ω_t = L_t U_tᵀ as the server forms
its own (`omega_from_factors`), so they hold the server's Ω_t bit for bit (where both multiply
alike: the same device and library). The fused clients upload FᵀY, not FᵀR, and never read
W_{t−1}, so its rounds do not carry it; only the final broadcast carries W_T. Per client over a
fit, with every client in every round (itemsize b):

    fused      8 + (h·C + T·r(f + h))·b
    two_round  8 + ((T + 1)·h·C + T·r(f + h))·b
    dense      8 + ((T + 1)·h·C + T·f·h)·b        (every Ω_t as f × h and every W_t, both schedules)

at h = f = 1024, C = 10, T = 20 in float64: 3.36 MB and 5.00 MB instead of 169.49 MB, 50× and 34×
less (benchmarks/results/deepafl_downlink.md).

Dropouts (`federation.dropout > 0`): G_{t−1}, P_{t−1} are sums over round t−1's participants and
M_t, FᵀF over round t's, so the recursion is exact only when they are the same clients. Under
dropouts the fused server therefore asks every client (a 1-byte `restate` flag in each broadcast)
to upload Φ_{t−1}ᵀΦ_{t−1} (packed) and Φ_{t−1}ᵀY beside its round-t statistics, and forms G_{t−1},
P_{t−1} from this round's uploads. Then round t's Ω_t and W_t are exactly the centralized solves
on round t's participants (Ω_t: the sandwiched least squares of their F_t, R_t with W_{t−1};
W_t: the ridge of their Φ_t), still T + 1 rounds, at the two-round schedule's upload bytes plus
M_t. (In `two_round`, Ω_t is solved on round 2t − 1's participants and W_t on round 2t's: the two
schedules then give different, equally well-defined models.)

Statistics are sums over samples, so the server's solves equal the centralized ones for any
partition. No regularization intermediary: a client's ΦᵀΦ is sent as is and the server adds
γI once, which is exactly the formula above (adding γI per client and removing Kγ would send
the same information). The random layers are regenerated on every client from a shared seed,
so only the seed (8 bytes, in the first broadcast) stands for them on the wire. (The official
code uploads W Rᵀ F, h × f; FᵀR carries the same information in C/h of the bytes.)

The client half (`DeepAFLClient`) keeps Φ_{t−1} of every sample it serves between rounds
(n × h in `dtype`: 0.5 GB for 60k samples at h = 1024 in float64), so a round costs one layer per
sample, not t, also for a client alone on its node. In `two_round`, F_t is recomputed in the W_t
round rather than kept; in `fused` it is kept (n × f more), so each F_t is computed once. The
per-sample caches are not saved in checkpoints: a client that lacks them (a resumed fit, a new
process) rebuilds Φ from its samples and the Ω it received and keeps (its only saved state: the
factors L_t, U_t where Ω_t travels as them, from which Ω_t is formed on load). Nor are the random
layers: a checkpoint holds what was learned, and the seed stands for the rest.

Precision (`dtype`): the model (the random layers, Ω_t, W_t), the clients' per-sample features
and statistics, and so what travels, are in `dtype`. The random layers are drawn in float64 and
cast, so float32 is float64's model in less precision, not another random model. The server works
in float64 either way (`SOLVE_DTYPE`): it casts the summed statistics as it receives them (the
engine sums the K clients' uploads in `dtype`: few terms), keeps G_t, P_t in float64, solves Ω_t
and W_t in float64 (ΦᵀΦ + γI is ill-conditioned: Φ's features share a large mean) and casts them
to `dtype` to keep and broadcast. On Fashion-MNIST (T = 20, h = f = 1024) float32's W_t are then
within 4·10⁻⁴ (relative) of float64's and its test predictions differ in at most 1 of 10 000 at
any depth (float32 solves: 4·10⁻³, up to 5 of 10 000); benchmarks/results/deepafl_speed.md.

Each W_t minimizes the ridge risk J_t = ‖Y − Φ_t W_t‖² + γ‖W_t‖², and Ω = 0 is a feasible choice
for Ω_t, so J_t + γ_s‖Ω_t‖² ≤ J_{t−1}: the training risk never increases with depth.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn

from workbench.linalg import add_gram_, class_sums, identity_like, solve_spd, statistics_dtype, stream_generator
from workbench.methods.base import (
    GRAM,
    SUMMED,
    ClientHalf,
    Cohort,
    FederatedMethod,
    Metrics,
    Problem,
    RoundPlan,
    Uploads,
)

ACTIVATIONS = {"gelu": nnf.gelu, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
# The server's sums and solves, whatever `dtype` is: ΦᵀΦ + γI is ill-conditioned (Φ's features have
# a large common mean), and solving in float32 puts W_t ten times further from float64's
# (Fashion-MNIST, T = 20: 4·10⁻³ relative instead of 4·10⁻⁴).
SOLVE_DTYPE = torch.float64


def random_layer(seed: int, layer: int, fan_in: int, fan_out: int,
                 dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """The random affine map of `layer` (0: A₀, t: B_t) -> weight (fan_in, fan_out), bias (fan_out,).

    `nn.Linear`'s default initialisation, as in the official code: kaiming-uniform with a = √5
    gives U(−1/√fan_in, 1/√fan_in) for the weight, and the bias uses the same bound. Each layer
    has a generator of its own, seeded from (seed, layer), so any layer is rebuilt alone and
    the same on every machine (drawn on the CPU). Drawn in float64 and then cast to `dtype`: a
    float32 draw from the same generator gives other numbers, so float32 would be another random
    model than float64 rather than the same model in less precision.
    """
    generator = stream_generator(seed, layer)
    bound = fan_in ** -0.5
    weight = (2 * torch.rand(fan_in, fan_out, generator=generator, dtype=torch.float64) - 1) * bound
    bias = (2 * torch.rand(fan_out, generator=generator, dtype=torch.float64) - 1) * bound
    return weight.to(dtype), bias.to(dtype)


def solve_omega_factors(hidden_gram: Tensor, hidden_residual: Tensor, classifier: Tensor,
                        gamma_s: float) -> tuple[Tensor, Tensor]:
    """Ω = L U_cᵀ minimizing ‖R − F Ω W‖² + γ_s‖Ω‖², from FᵀF (f, f), FᵀR (f, C), W = W_{t−1} (h, C)
    -> L (f, r), U_c (h, r) with r = min(h, C).

    FᵀF = V S_F Vᵀ and the thin SVD W = U_c diag(s) Qᵀ (so WWᵀ = U_c diag(s²) U_cᵀ, rank ≤ C) turn the
    normal equation FᵀF Ω WWᵀ + γ_s Ω = FᵀR Wᵀ into an elementwise division in the (V, U_c) basis;
    the directions of h outside U_c have a zero right-hand side, so Ω has no part there. An f × f
    eigendecomposition and an h × C SVD instead of a second, h × h, eigendecomposition.
    """
    s_f, v = torch.linalg.eigh(hidden_gram)
    u, s_w, q_t = torch.linalg.svd(classifier, full_matrices=False)  # W = U_c diag(s) Qᵀ
    rotated = (v.T @ hidden_residual) @ (q_t.T * s_w)  # Vᵀ FᵀR Wᵀ U_c = Vᵀ FᵀR Q diag(s), (f, r)
    return v @ (rotated / (gamma_s + s_f[:, None] * (s_w * s_w)[None, :])), u


def omega_from_factors(left: Tensor, right: Tensor) -> Tensor:
    """Ω = L Uᵀ from L (f, r) and U (h, r) as they are broadcast, in their dtype -> (f, h).

    The product is taken in SOLVE_DTYPE and cast back (in float32 only the factors are rounded).
    The server forms its Ω_t from the factors it sends in exactly this way, so that a client that
    receives them holds the server's Ω_t bit for bit."""
    return (left.to(SOLVE_DTYPE) @ right.to(SOLVE_DTYPE).T).to(left.dtype)


def solve_omega(hidden_gram: Tensor, hidden_residual: Tensor, classifier: Tensor,
                gamma_s: float) -> Tensor:
    """Ω (f, h) minimizing ‖R − F Ω W‖² + γ_s‖Ω‖² (`solve_omega_factors`, multiplied out)."""
    left, right = solve_omega_factors(hidden_gram, hidden_residual, classifier, gamma_s)
    return left @ right.T


def solve_omega_eigh(hidden_gram: Tensor, hidden_residual: Tensor, classifier: Tensor,
                     gamma_s: float) -> Tensor:
    """Ω by the two eigendecompositions FᵀF = V S_F Vᵀ and WWᵀ = U S_W Uᵀ (h × h): the reference
    the rank-C solve is checked against."""
    s_f, v = torch.linalg.eigh(hidden_gram)
    s_w, u = torch.linalg.eigh(classifier @ classifier.T)
    rotated = (v.T @ hidden_residual) @ (classifier.T @ u)  # Vᵀ FᵀR Wᵀ U, (f, h)
    return v @ (rotated / (gamma_s + s_f[:, None] * s_w[None, :])) @ u.T


SCHEDULES = ("fused", "two_round")


def round_plan(round_index: int, schedule: str = "two_round") -> tuple[int, bool]:
    """(t, whether round `round_index` solves Ω_t). `two_round`: round 2t − 1 solves Ω_t, round 2t
    solves W_t (round 0: t = 0, W₀). `fused`: round t solves Ω_t and W_t (round 0: W₀)."""
    if schedule == "fused":
        return round_index, round_index > 0
    return (round_index + 1) // 2, round_index % 2 == 1


RANDOM_LAYERS = ("input_weight", "input_bias", "block_weight", "block_bias")  # A₀, a₀, B_t, b_t


def register_random_layers(module: nn.Module, seed: int, feature_dim: int, hidden_dim: int, block_dim: int,
                           num_layers: int, dtype: torch.dtype, persistent: bool) -> None:
    """A₀ (d, h), a₀ (h,), B_t (T, h, f), b_t (T, f) of `seed` as buffers of `module`."""
    input_weight, input_bias = random_layer(seed, 0, feature_dim, hidden_dim, dtype)
    block_weight = torch.empty(num_layers, hidden_dim, block_dim, dtype=dtype)
    block_bias = torch.empty(num_layers, block_dim, dtype=dtype)
    for t in range(1, num_layers + 1):
        block_weight[t - 1], block_bias[t - 1] = random_layer(seed, t, hidden_dim, block_dim, dtype)
    module.register_buffer("input_weight", input_weight, persistent=persistent)  # A₀ (d, h)
    module.register_buffer("input_bias", input_bias, persistent=persistent)      # a₀ (h,)
    module.register_buffer("block_weight", block_weight, persistent=persistent)  # B_t (T, h, f), t = 1..T
    module.register_buffer("block_bias", block_bias, persistent=persistent)      # b_t (T, f)


if TYPE_CHECKING:  # a mixin of modules: typed as one, a plain class at run time
    _ModuleMixin = nn.Module
else:
    _ModuleMixin = object


class ResidualNetwork(_ModuleMixin):
    """The residual network Φ_t, shared by the server half (its forward) and the client half (its
    uploads): needs the buffers of `register_random_layers`, `omega` (T, f, h), its factors
    `omega_left` (T, f, r) and `omega_right` (T, h, r), `activation` and `stat_dtype`."""

    hidden_dim: int  # h
    block_dim: int  # f
    stat_dtype: torch.dtype
    activation: Callable[[Tensor], Tensor]  # σ
    # buffers of `register_random_layers` and `register_omega`
    input_weight: Tensor  # A₀ (d, h)
    input_bias: Tensor  # a₀ (h,)
    block_weight: Tensor  # B_t (T, h, f)
    block_bias: Tensor  # b_t (T, f)
    omega_left: Tensor  # L_t (T, f, r)
    omega_right: Tensor  # U_t (T, h, r)
    omega: Tensor  # Ω_t (T, f, h)

    @property
    def factored(self) -> bool:
        """Whether Ω_t travels as its factors L_t, U_t: r(f + h) numbers instead of f·h."""
        rank = self.omega_left.shape[-1]
        return rank * (self.block_dim + self.hidden_dim) < self.block_dim * self.hidden_dim

    def input_features(self, features: Tensor) -> Tensor:
        """Φ₀ = tanh(X A₀ + a₀): (n, d) -> (n, h)."""
        x = features.to(self.stat_dtype)
        return torch.tanh(torch.addmm(self.input_bias, x, self.input_weight))

    def block_features(self, phi: Tensor, layer: int) -> Tensor:
        """F_t = σ(Φ_{t−1} B_t + b_t) for t = `layer` ≥ 1: (n, h) -> (n, f)."""
        weight, bias = self.block_weight[layer - 1], self.block_bias[layer - 1]
        return self.activation(torch.addmm(bias, phi, weight))

    def next_features(self, phi: Tensor, layer: int) -> Tensor:
        """Φ_t = Φ_{t−1} + F_t Ω_t for t = `layer` ≥ 1: (n, h) -> (n, h)."""
        return self.advance(phi, self.block_features(phi, layer), layer)

    def advance(self, phi: Tensor, hidden: Tensor, layer: int) -> Tensor:
        """Φ_t = Φ_{t−1} + F_t Ω_t from F_t = `hidden`: as (F_t L_t) U_tᵀ where Ω_t travels as its
        factors (`factored`), r(f + h) products a row instead of f·h (a quarter of a fused round's)."""
        if self.factored:
            return torch.addmm(phi, hidden @ self.omega_left[layer - 1], self.omega_right[layer - 1].T)
        return torch.addmm(phi, hidden, self.omega[layer - 1])

    def register_omega(self, num_layers: int, num_classes: int) -> None:
        """The buffers of the Ω_t: `omega_left` (T, f, r) and `omega_right` (T, h, r), the factors
        as broadcast, and `omega` (T, f, h) itself. Where Ω_t travels as its factors (`factored`) its
        dense form is their product (`omega_from_factors`): rebuilt on load rather than saved, a
        checkpoint then holds r(f + h) numbers a layer instead of f·h more (T = 20, h = f = 1024 in
        float64: 3.3 MB instead of 171 MB, on each half)."""
        h, f, dtype = self.hidden_dim, self.block_dim, self.stat_dtype
        rank = min(h, num_classes)
        self.register_buffer("omega_left", torch.zeros(num_layers, f, rank, dtype=dtype))
        self.register_buffer("omega_right", torch.zeros(num_layers, h, rank, dtype=dtype))
        self.register_buffer("omega", torch.zeros(num_layers, f, h, dtype=dtype), persistent=not self.factored)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        omega = state_dict.get(prefix + "omega")
        before_factors = omega is not None and prefix + "omega_left" not in state_dict
        if before_factors:
            # a state from before the factors were kept: those of its Ω_t (rank ≤ r) from their
            # SVD, Ω_t = (P_t S_t) Q_tᵀ (Ω_t to rounding)
            p, s, q_t = torch.linalg.svd(omega.to(SOLVE_DTYPE), full_matrices=False)
            kept = min(self.omega_left.shape[-1], s.shape[-1])  # the rest are zero columns
            left, right = torch.zeros_like(self.omega_left), torch.zeros_like(self.omega_right)
            left[..., :kept] = p[..., :kept] * s[..., None, :kept]
            right[..., :kept] = q_t[..., :kept, :].mT
            state_dict[prefix + "omega_left"], state_dict[prefix + "omega_right"] = left, right
        if self.factored:  # (a state from before Ω_t was left out where factored holds it too)
            state_dict.pop(prefix + "omega", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.factored:
            with torch.no_grad():
                if before_factors:  # its Ω_t as saved
                    self.omega.copy_(omega)
                else:  # one layer at a time, as the server and the clients form them: the same bits
                    for t in range(len(self.omega)):
                        self.omega[t] = omega_from_factors(self.omega_left[t], self.omega_right[t])

    def features_at_depth(self, features: Tensor, depth: int) -> Tensor:
        """Φ_depth from backbone features: (n, d) -> (n, h)."""
        phi = self.input_features(features)
        for layer in range(1, depth + 1):
            phi = self.next_features(phi, layer)
        return phi


class DeepAFLClient(ResidualNetwork, ClientHalf):
    """The clients: the random layers rebuilt from the seed, the Ω_t they received (`omega`; their
    saved state, as its factors where it travels as them) and Φ_{t−1} of every sample they serve
    (`phi`, a cache rebuilt when missing)."""

    # caches from `setup_state` (not saved); `hidden`, `hidden_layer` in the fused schedule only
    phi: Tensor  # (num_samples, h) Φ
    phi_depth: Tensor  # (num_samples,) int64, −1: not computed
    hidden: Tensor  # (num_samples, f) F_t
    hidden_layer: Tensor  # (num_samples,) int64, −1: none

    def __init__(self, problem: Problem, method: DeepAFL) -> None:
        super().__init__(problem)
        self.num_layers, self.hidden_dim, self.block_dim = method.num_layers, method.hidden_dim, method.block_dim
        self.activation, self.seed, self.stat_dtype = method.activation, method.seed, method.stat_dtype
        self.schedule = method.schedule
        # regenerated from the seed: not state, so not saved
        register_random_layers(self, self.seed, problem.feature_dim, self.hidden_dim, self.block_dim,
                               self.num_layers, self.stat_dtype, persistent=False)
        self.register_omega(self.num_layers, problem.num_classes)  # Ω_t as received

    def setup_state(self) -> None:
        # Φ of every served sample and its depth (−1: not computed). Caches, not checkpointed.
        device = self.omega.device
        self.register_buffer("phi", torch.empty(self.num_samples, self.hidden_dim, dtype=self.stat_dtype,
                                                 device=device), persistent=False)
        self.register_buffer("phi_depth", torch.full((self.num_samples,), -1, dtype=torch.long, device=device),
                             persistent=False)
        if self.schedule == "fused":  # F_t of every served sample and its layer t (−1: none)
            self.register_buffer("hidden", torch.empty(self.num_samples, self.block_dim, dtype=self.stat_dtype,
                                                        device=device), persistent=False)
            self.register_buffer("hidden_layer", torch.full((self.num_samples,), -1, dtype=torch.long,
                                                            device=device), persistent=False)

    def _previous_features(self, part: Cohort, rows: Tensor | slice, depth: int, kept: bool) -> Tensor:
        """Φ_depth of the rows (`rows`: theirs in the caches, `_rows`): from the cache (`kept`: it
        holds them all), or rebuilt from the received Ω."""
        if kept:
            return self.phi[rows]
        return self._keep(rows, self.features_at_depth(part.features, depth), depth)

    def _rows(self, part: Cohort) -> Tensor | slice:
        """The rows of `part` in the per-sample caches: a slice where they are consecutive (a whole
        cohort's chunks are) and known on the host (read without waiting for a device), whose reads
        are views and writes in place, not gathered copies."""
        rows = part.sample_index
        if rows.device.type == "cpu" and len(rows) and bool((rows.diff() == 1).all()):
            return slice(int(rows[0]), int(rows[0]) + len(rows))
        return rows.to(self.phi.device)

    def _keep(self, rows: Tensor | slice, phi: Tensor, depth: int) -> Tensor:
        self.phi[rows] = phi
        self.phi_depth[rows] = depth
        return phi

    def _receive_omega(self, broadcast, layers: int) -> None:
        """Keep the Ω_t a broadcast carries: the last of Ω_1..Ω_`layers`, as many as were sent (one
        when the client took part in every round; more when cohort sampling made it miss some),
        dense or as factors L_t, U_t (rebuilt as the server forms its Ω_t: `omega_from_factors`)."""
        if "omega_left" in broadcast:
            left, right = broadcast["omega_left"].to(self.omega), broadcast["omega_right"].to(self.omega)
            first = layers - len(left)
            self.omega_left[first:layers], self.omega_right[first:layers] = left, right
            for k in range(len(left)):  # one layer at a time, as the server: the same bits
                self.omega[first + k] = omega_from_factors(left[k], right[k])
        elif "omega" in broadcast:
            omega = broadcast["omega"].to(self.omega)
            self.omega[layers - len(omega):layers] = omega

    def _check_seed(self, broadcast) -> None:
        if int(broadcast["seed"]) != self.seed:
            raise ValueError(f"the server's DeepAFL seed {int(broadcast['seed'])} differs from this client's "
                             f"{self.seed}: build the clients from the same DeepAFL settings as the server")

    def _fused_sources(self, cohort: Cohort, layer: int) -> list[tuple[bool, ...]]:
        """Per chunk, for `_fused_previous`: (Φ_{t−1} kept, Φ_{t−2} and F_{t−1} kept)."""
        rows, depth = cohort.sample_index.to(self.phi.device), layer - 1
        kept = self.phi_depth[rows] == depth
        one_back = (self.phi_depth[rows] == depth - 1) & (self.hidden_layer[rows] == depth) & (depth >= 1)
        return cohort.holds_per_batch(kept, one_back)

    def _fused_previous(self, part: Cohort, rows: Tensor | slice, layer: int, sources: tuple[bool, ...]) -> Tensor:
        """Φ_{t−1} for round t = `layer` of the fused schedule (`rows`: the chunk's in the caches): kept;
        or Φ_{t−2} + F_{t−1}Ω_{t−1} from the kept Φ_{t−2} and F_{t−1} (one product, F not recomputed);
        or rebuilt from the samples."""
        depth = layer - 1
        kept, one_back = sources
        if kept:
            return self.phi[rows]
        if one_back:
            phi = self.advance(self.phi[rows], self.hidden[rows], depth)
        else:
            phi = self.features_at_depth(part.features, depth)
        return self._keep(rows, phi, depth)

    def _fused_update(self, round_index, broadcast, cohort: Cohort):
        """Round t of the fused schedule: FᵀF, FᵀY and M = Φ_{t−1}ᵀF of F_t (kept for the next round),
        and, when the server asks (`restate`, under dropouts), Φ_{t−1}ᵀΦ_{t−1} and Φ_{t−1}ᵀY. Reads
        no W_{t−1} (the server forms FᵀR), so the broadcast carries none."""
        layer, classes = round_index, self.num_classes
        h, f = self.hidden_dim, self.block_dim
        self._receive_omega(broadcast, layer - 1)  # Ω_{t−1} (and any missed before it)
        restate = bool(broadcast["restate"]) if "restate" in broadcast else False
        hidden_gram, mixed = self.omega.new_zeros(f, f), self.omega.new_zeros(h, f)
        hidden_labels = self.omega.new_zeros(f, classes)
        gram, cross = (self.omega.new_zeros(h, h), self.omega.new_zeros(h, classes)) if restate else (None, None)
        for part, sources in zip(cohort.batches(), self._fused_sources(cohort, layer), strict=True):
            rows = self._rows(part)
            phi = self._fused_previous(part, rows, layer, sources)
            hidden = self.block_features(phi, layer)  # F_t, computed once
            self.hidden[rows] = hidden
            self.hidden_layer[rows] = layer
            add_gram_(hidden_gram, hidden)
            mixed.addmm_(phi.T, hidden)
            hidden_labels += class_sums(hidden, part.labels, classes)
            if gram is not None and cross is not None:  # restate
                add_gram_(gram, phi)
                cross += class_sums(phi, part.labels, classes)
        # FᵀY, not FᵀR = FᵀY − MᵀW_{t−1}: the server forms FᵀR from M (same bytes), and what one
        # sample adds to the uploads is then bounded without W_{t−1} (`statistics_sensitivity`)
        uploads = {"hidden_gram": hidden_gram, "hidden_labels": hidden_labels, "mixed": mixed}
        if gram is not None and cross is not None:  # restate
            uploads.update(gram=gram, cross=cross)
        return uploads, {}

    def finish(self, broadcast: Mapping[str, Tensor], cohort: Cohort) -> Metrics:
        self._receive_omega(broadcast, self.num_layers)  # Ω_T (fused; any missed ones), kept as the others
        return {}

    def client_update(self, round_index: int, broadcast: Mapping[str, Tensor],
                      cohort: Cohort) -> tuple[Uploads, Metrics]:
        if self.schedule == "fused" and round_index > 0:
            return self._fused_update(round_index, broadcast, cohort)
        layer, solves_omega = round_plan(round_index)
        h, f, classes = self.hidden_dim, self.block_dim, self.num_classes
        if round_index == 0:
            self._check_seed(broadcast)
        elif solves_omega:
            classifier = broadcast["classifier"].to(self.omega)  # W_{t−1}
            self._receive_omega(broadcast, layer - 1)  # only Ω_s a sampled-out client missed
        else:
            self._receive_omega(broadcast, layer)  # Ω_t (and any missed), kept to rebuild Φ
        side = f if solves_omega else h
        gram = self.omega.new_zeros(side, side)
        cross = self.omega.new_zeros(side, classes)
        kept = (itertools.repeat((False,)) if round_index == 0 else  # per chunk: Φ_{t−1} kept
                cohort.holds_per_batch(self.phi_depth[cohort.sample_index.to(self.phi.device)] == layer - 1))
        for part, (part_kept,) in zip(cohort.batches(), kept, strict=False):  # round 0: `kept` repeats
            rows = self._rows(part)
            if round_index == 0:
                phi = self._keep(rows, self.input_features(part.features), 0)
            else:
                phi_previous = self._previous_features(part, rows, layer - 1, part_kept)
                hidden = self.block_features(phi_previous, layer)
                if solves_omega:  # FᵀF and FᵀR with R = Y − Φ_{t−1} W_{t−1}
                    add_gram_(gram, hidden)
                    cross += class_sums(hidden, part.labels, classes) - hidden.T @ (phi_previous @ classifier)
                    continue
                phi = self._keep(rows, self.advance(phi_previous, hidden, layer), layer)
            add_gram_(gram, phi)
            cross += class_sums(phi, part.labels, classes)
        if solves_omega:
            return {"hidden_gram": gram, "hidden_residual": cross}, {}
        return {"gram": gram, "cross": cross}, {}


class DeepAFL(ResidualNetwork, FederatedMethod):
    """Deep residual analytic federated learning: T gradient-free residual blocks, T + 1 rounds
    (`fused`) or 2T + 1 (`two_round`).

    Args:
        num_layers: T, the residual blocks (0 = a ridge classifier on Φ₀ alone, one round).
        hidden_dim: h, the width of Φ_t (the random map A₀ takes d -> h).
        block_dim: f, the width of each block's random features F_t (B_t takes h -> f).
        activation: σ of the blocks, `gelu`, `relu`, `tanh` or `sigmoid` (layer 0 is always tanh).
        gamma: γ, the ridge regularization of every classifier W_t.
        gamma_s: γ_s > 0, the regularization of the sandwiched least squares for Ω_t.
        seed: the shared seed every client rebuilds the random layers from.
        dtype: dtype of the model (the random layers, Ω_t, W_t), of the clients' per-sample
            features and statistics, and so of what is sent. The server sums and solves in
            float64 either way (`SOLVE_DTYPE`). The random layers are drawn in float64 and cast,
            so float32 is the float64 model in less precision, not another random model.
        schedule: `fused` (T + 1 rounds: Ω_t and W_t in one round, clients also upload
            M_t = Φ_{t−1}ᵀF_t) or `two_round` (2T + 1 rounds: Ω_t, then W_t). Same model; under
            `federation.dropout > 0` see the module docstring.
        omega_norm: c, a bound on each Ω_t's spectral norm: the server scales a solved Ω_t down to
            ‖Ω_t‖₂ ≤ c (unset: no bound, the paper's model). It bounds every sample's Φ_t by
            constants alone, so that noise on the statistics (`federation.dp_sigma`) has a stated
            sensitivity (`statistics_sensitivity`, fused schedule).
        restate: whether fused rounds ask every client for Φ_{t−1}ᵀΦ_{t−1} and Φ_{t−1}ᵀY again
            (see the module docstring). Unset: whenever a round's clients may differ from the
            previous round's: under dropouts, cohort sampling, or clients that may go missing
            without notice (the Flower engine's lost nodes; there it costs the restated sums).
            False is refused under dropouts or cohorts; over Flower a round that then misses a
            client ends the fit (resumable from its last checkpoint).

    After a fit, `depth_accuracy[t]` is the test accuracy of the model of depth t (also logged
    as `depth/test_acc` with step t, through `step_metrics`).
    """

    uploads = MappingProxyType({"gram": GRAM, "cross": SUMMED, "hidden_gram": GRAM, "hidden_residual": SUMMED,
               "hidden_labels": SUMMED, "mixed": SUMMED})

    # buffers from `setup_problem` (and ResidualNetwork's); `phi_gram`, `phi_cross` in the fused schedule only
    classifier: Tensor  # W_t (T + 1, h, C)
    omega_sent: Tensor  # (K,) int64, the Ω_t each client holds
    phi_gram: Tensor  # G_t (h, h) in SOLVE_DTYPE
    phi_cross: Tensor  # P_t (h, C) in SOLVE_DTYPE

    def __init__(self, num_layers: int = 20, hidden_dim: int = 1024, block_dim: int = 1024,
                 activation: str = "gelu", gamma: float = 1.0, gamma_s: float = 0.05, seed: int = 0,
                 dtype: str = "float64", schedule: str = "fused", omega_norm: float | None = None,
                 restate: bool | None = None) -> None:
        super().__init__()
        if num_layers < 0:
            raise ValueError(f"num_layers (T) must be ≥ 0, got {num_layers}")
        if hidden_dim < 1 or block_dim < 1:
            raise ValueError(f"hidden_dim and block_dim must be ≥ 1, got {hidden_dim}, {block_dim}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if gamma < 0:
            raise ValueError(f"gamma must be ≥ 0, got {gamma}")
        if not gamma_s > 0:
            raise ValueError(f"gamma_s must be > 0 (it makes the sandwiched least squares solvable), "
                             f"got {gamma_s}; the official default is 0.05")
        if not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2⁶³), got {seed}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        if omega_norm is not None and not omega_norm > 0:
            raise ValueError(f"omega_norm must be > 0 (a bound on each ‖Ω_t‖₂) or unset, got {omega_norm}")
        self.schedule, self.omega_norm, self.restate = schedule, omega_norm, restate
        self.save_hyperparameters()
        self.num_layers, self.hidden_dim, self.block_dim = num_layers, hidden_dim, block_dim
        self.activation = ACTIVATIONS[activation]
        self.gamma, self.gamma_s, self.seed = gamma, gamma_s, seed
        self.stat_dtype = statistics_dtype(dtype)
        self.depth_accuracy: list[float] = []
        # Φ of evaluation data while fitting, advanced one layer per depth instead of rebuilt:
        # key ("test",) or ("val", batch index) -> (depth, features, Φ)
        self._eval_phi: dict[tuple, tuple[int, Tensor, Tensor]] = {}
        # the fitted model's logits of the test split the depth curve scored last: (features, logits)
        self._test_logits: tuple[Tensor, Tensor] | None = None

    @property
    def fused(self) -> bool:
        return self.schedule == "fused"

    @property
    def num_rounds(self) -> int:
        return self.num_layers + 1 if self.fused else 2 * self.num_layers + 1

    @property
    def depth(self) -> int:
        """Depth of the latest classifier: W₀ after round 1; W_t after round t + 1 (`fused`) or
        round 2t + 1 (`two_round`)."""
        return max(self.round - 1, 0) if self.fused else max(self.round - 1, 0) // 2

    @property
    def restates(self) -> bool:
        """Whether fused rounds ask the clients for Φ_{t−1}ᵀΦ_{t−1} and Φ_{t−1}ᵀY again: where the
        server's kept sums may be over other clients than the round's (`restate`)."""
        varies = self.federation.dropout > 0 or self.samples_cohorts or self.clients_may_go_missing
        return self.fused and (self.restate if self.restate is not None else varies)

    def check_protocol(self, federation) -> None:
        if self.fused and self.restate is False and (self.federation.dropout > 0 or self.samples_cohorts):
            raise ValueError("DeepAFL(restate=false) recurses sums kept from the previous round, which holds "
                             "other clients under dropouts, cohorts or a systems deadline: leave model.restate unset "
                             "(or true)")

    def check_missing(self, round_index: int) -> None:
        if self.fused and not self.restates and round_index > 0:
            raise RuntimeError(f"DeepAFL(restate=false) recurses round {round_index - 1}'s sums, which hold the "
                               "clients missing now: its fused round cannot be exact without them; leave "
                               "model.restate unset (it then restates every round where clients may go missing)")

    def setup_problem(self, problem: Problem) -> None:
        h, f, layers = self.hidden_dim, self.block_dim, self.num_layers
        # The random layers are the seed's (rebuilt here, as on every client): not saved, a
        # checkpoint holds only what was learned (and the seed, in its hyperparameters).
        register_random_layers(self, self.seed, problem.feature_dim, h, f, layers, self.stat_dtype,
                               persistent=False)
        # Ω_t (T, f, h) and its factors L_t, U_t as broadcast, kept for clients that catch up later
        self.register_omega(layers, problem.num_classes)
        self.register_buffer("classifier",  # W_t (T + 1, h, C), t = 0..T
                             torch.zeros(layers + 1, h, problem.num_classes, dtype=self.stat_dtype))
        # how many Ω_t each client holds: a cohort's broadcast carries those its least informed lacks
        self.register_buffer("omega_sent", torch.zeros(problem.num_clients, dtype=torch.long))
        if self.fused:  # G_t = ΣΦ_tᵀΦ_t and P_t = ΣΦ_tᵀY of the latest depth (checkpointed: a resumed fit needs them),
            # kept in SOLVE_DTYPE: the recursion adds to them every layer
            self.register_buffer("phi_gram", torch.zeros(h, h, dtype=SOLVE_DTYPE))
            self.register_buffer("phi_cross", torch.zeros(h, problem.num_classes, dtype=SOLVE_DTYPE))

    def client_half(self) -> DeepAFLClient:
        if self.problem is None:
            raise RuntimeError("DeepAFL builds its clients once set up for a problem (`setup`)")
        return DeepAFLClient(self.problem, self)

    def forward(self, features: Tensor) -> Tensor:
        """Logits of the latest depth, Φ_t W_t: (n, d) -> (n, C)."""
        return self.features_at_depth(features, self.depth) @ self.classifier[self.depth]

    # ---- rounds -----------------------------------------------------------------------------
    def plan_round(self, available: Tensor) -> RoundPlan:
        """Round 0: the seed of the random layers (SEED_BYTES); the Ω_t round: W_{t−1}; the W_t round: Ω_t.
        Fused round t: Ω_{t−1} (t ≥ 2; not W_{t−1}, which its clients do not read), and under
        dropouts or cohort sampling the `restate` flag (1 byte). Ω goes as a stack (`_with_omega`):
        one Ω_t when every client took part in every round, more when a sampled cohort holds a
        client that missed some."""
        layer, solves_omega = round_plan(self.round, self.schedule)
        if self.round == 0:
            return RoundPlan(available, {"seed": torch.tensor(self.seed, dtype=torch.int64)})
        message = {"classifier": self.classifier[layer - 1]} if not self.fused and solves_omega else {}
        if self.fused and self.restates:
            message["restate"] = torch.tensor(True)
        layers = self._omega_needed(self.round)
        message = self._with_omega(message, available, layers)
        self.omega_sent[available] = layers
        return RoundPlan(available, message)

    def forget_clients(self, clients: Tensor) -> None:
        """Clients on new nodes hold no Ω_t: the next broadcast to them carries every one."""
        super().forget_clients(clients)
        self.omega_sent[clients.to(self.omega_sent.device)] = 0

    def _omega_needed(self, round_index: int) -> int:
        """How many Ω_t (Ω_1..Ω_t) round `round_index`'s clients need: those below its layer t, and Ω_t
        itself in a W_t round of `two_round`."""
        layer, solves_omega = round_plan(round_index, self.schedule)
        return max(layer - 1, 0) if self.fused or solves_omega else layer

    def _with_omega(self, message: dict[str, Tensor], clients: Tensor, layers: int) -> dict[str, Tensor]:
        """`message` and Ω_{s+1..layers}: what the least informed of `clients` lacks (s = the fewest
        Ω_t any of them holds), as factors under `omega_left`, `omega_right` (`factored`) or under
        `omega`; none when they hold them all."""
        known = int(self.omega_sent[clients].min()) if len(clients) else layers
        if known >= layers:
            return message
        if self.factored:
            return {**message, "omega_left": self.omega_left[known:layers],
                    "omega_right": self.omega_right[known:layers]}
        return {**message, "omega": self.omega[known:layers]}

    def _keep_omega(self, layer: int, left: Tensor, right: Tensor) -> None:
        """Ω_t = L U_cᵀ, kept as the factors broadcast (in `dtype`) and formed from them as the
        clients form it (`omega_from_factors`; in float64 the solve's L U_cᵀ to rounding)."""
        self.omega_left[layer - 1] = left.to(self.stat_dtype)
        self.omega_right[layer - 1] = right.to(self.stat_dtype)
        self.omega[layer - 1] = omega_from_factors(self.omega_left[layer - 1], self.omega_right[layer - 1])

    def _omega_scale(self, spectral_norm: Tensor) -> float:
        """The factor that brings ‖Ω_t‖₂ within `omega_norm` (1 without a bound, or within it)."""
        if self.omega_norm is None or float(spectral_norm) <= self.omega_norm:
            return 1.0
        return self.omega_norm / float(spectral_norm)

    def statistics_sensitivity(self, feature_norm: float) -> float | None:
        """Δ of every fused round's uploads to one sample, from constants alone (`omega_norm` set):
        ‖φ₀‖ ≤ √h (tanh); ‖F_t‖ ≤ c_F,t = √f for tanh/sigmoid, else ‖φ_{t−1}‖·‖B_t‖₂ + ‖b_t‖
        (|relu(z)|, |gelu(z)| ≤ |z|); ‖φ_t‖ ≤ ‖φ_{t−1}‖ + c_F,t·c. One sample adds ffᵀ, f yᵀ and
        φ fᵀ (and, restated, φφᵀ and φ yᵀ) to round t's uploads; round 0 adds φ₀φ₀ᵀ and φ₀yᵀ. The
        largest round's Δ bounds them all (`feature_norm` is not needed: layer 0's tanh bounds Φ₀).
        None without `omega_norm` or in `two_round`, whose FᵀR depends on the released W_{t−1}."""
        if self.omega_norm is None or not self.fused:
            return None
        bounded = self.activation in (torch.tanh, torch.sigmoid)
        phi = math.sqrt(self.hidden_dim)
        worst = phi ** 4 + phi ** 2  # round 0
        for layer in range(1, self.num_layers + 1):
            if bounded:
                hidden = math.sqrt(self.block_dim)
            else:
                weight = self.block_weight[layer - 1].to(SOLVE_DTYPE)
                hidden = phi * float(torch.linalg.matrix_norm(weight, 2)) + float(self.block_bias[layer - 1].norm())
            squared = hidden ** 4 + hidden ** 2 + (phi * hidden) ** 2
            if self.restates:
                squared += phi ** 4 + phi ** 2
            worst = max(worst, squared)
            phi += hidden * self.omega_norm
        return math.sqrt(worst)

    def _solve_classifier(self, layer: int, gram: Tensor, cross: Tensor) -> None:
        """W_t from SOLVE_DTYPE sums, kept (and broadcast) in the model's dtype."""
        gram = gram + self.gamma * identity_like(gram)
        classifier = solve_spd(gram, cross, what=f"DeepAFL's Gram matrix at depth {layer}")
        self.classifier[layer] = classifier.to(self.stat_dtype)

    def _fused_server_update(self, uploads: dict[str, Tensor]) -> dict[str, float]:
        """Round t: Ω_t from FᵀF and FᵀR, then G_t, P_t from G_{t−1}, P_{t−1} (kept, or restated by
        this round's clients) and M_t, and W_t. Ω_t = L U_cᵀ has rank ≤ C, so
        M_tΩ_t = (M_t L) U_cᵀ and Ω_tᵀ(FᵀF)Ω_t = U_c (Lᵀ FᵀF L) U_cᵀ cost O(h²C + f²C)."""
        layer = self.round
        if layer == 0 or self.restates:
            gram, cross = uploads["gram"], uploads["cross"]
        else:
            gram, cross = self.phi_gram, self.phi_cross
        if layer > 0:
            previous = self.classifier[layer - 1].to(SOLVE_DTYPE)  # W_{t−1} as broadcast
            hidden_gram, hidden_labels, mixed = uploads["hidden_gram"], uploads["hidden_labels"], uploads["mixed"]
            hidden_residual = hidden_labels - mixed.T @ previous  # FᵀR = FᵀY − MᵀW_{t−1}
            left, right = solve_omega_factors(hidden_gram, hidden_residual, previous, self.gamma_s)
            left = left * self._omega_scale(torch.linalg.matrix_norm(left, 2))  # ‖Ω_t‖₂ = ‖L‖₂
            self._keep_omega(layer, left, right)
            coupling = (mixed @ left) @ right.T  # M_t Ω_t, (h, h)
            inner = right @ ((left.T @ hidden_gram @ left) @ right.T)  # Ω_tᵀ FᵀF Ω_t
            gram = gram + coupling + coupling.T + (inner + inner.T) / 2
            cross = cross + right @ (left.T @ hidden_labels)
        self.phi_gram.copy_(gram)
        self.phi_cross.copy_(cross)
        self._solve_classifier(layer, gram, cross)
        return {}

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        # The clients' statistics arrive in `dtype`; the server works on them in SOLVE_DTYPE (a
        # no-op in float64) and casts Ω_t and W_t back to `dtype` to keep and broadcast them.
        uploads = {name: value.to(SOLVE_DTYPE) for name, value in uploads.items()}
        if self.fused:
            return self._fused_server_update(uploads)
        layer, solves_omega = round_plan(self.round)
        if solves_omega:
            left, right = solve_omega_factors(uploads["hidden_gram"], uploads["hidden_residual"],
                                              self.classifier[layer - 1].to(SOLVE_DTYPE), self.gamma_s)
            left = left * self._omega_scale(torch.linalg.matrix_norm(left, 2))  # ‖Ω_t‖₂ = ‖L‖₂
            self._keep_omega(layer, left, right)
            return {}
        self._solve_classifier(layer, uploads["gram"], uploads["cross"])
        return {}

    def final_broadcast(self) -> dict[str, Tensor]:
        """W_T, the classifier of the last depth, and the Ω_t some client lacks (`_with_omega`): Ω_T
        in `fused` (not sent before), and under cohort sampling those a client missed (every client
        receives the final model, sampled or not: all Ω_t when one never took part)."""
        assert self.problem is not None  # (set up before any round)
        everyone = torch.arange(self.problem.num_clients, device=self.omega_sent.device)
        return self._with_omega({"classifier": self.classifier[self.depth]}, everyone, self.depth)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        self._eval_phi, self._test_logits = {}, None  # of the model being replaced
        for name in RANDOM_LAYERS:  # a checkpoint from before they were left out: they must be the seed's
            saved = state_dict.pop(prefix + name, None)
            if saved is not None and not torch.equal(saved.to(getattr(self, name)), getattr(self, name)):
                raise ValueError(f"this checkpoint's DeepAFL random layer {name} is not the one seed {self.seed} "
                                 "draws here: it was saved by a DeepAFL with other settings (seed, widths, "
                                 "dtype); load it into a DeepAFL built with its own hyperparameters")
        # a checkpoint from before `omega_sent` was kept: every client took part in every round
        rounds = state_dict.get(prefix + "rounds_done")
        if rounds is not None and prefix + "omega_sent" not in state_dict:
            sent = self._omega_needed(int(rounds) - 1) if int(rounds) > 0 else 0
            state_dict[prefix + "omega_sent"] = torch.full_like(self.omega_sent, sent)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- accuracy at every depth ------------------------------------------------------------
    def _evaluation_features(self, key: tuple, features: Tensor, depth: int) -> Tensor:
        """Φ_depth of evaluation data (n, d) -> (n, h), one layer on from the previous depth's
        Φ when it is kept under `key` for the same data: evaluating every depth costs T layers,
        not T²/2."""
        kept = self._eval_phi.get(key)  # (depth, features, Φ)
        if kept is not None and not _same_rows(kept[1], features):
            kept = None  # other data under the same key: start again
        if kept is not None and kept[0] == depth:
            return kept[2]
        phi = (self.next_features(kept[2], depth) if depth > 0 and kept is not None and kept[0] == depth - 1
               else self.features_at_depth(features, depth))
        self._eval_phi[key] = (depth, features, phi)
        return phi

    def logits(self, features: Tensor, cache_key: tuple | None = None) -> Tensor:
        """Logits of the latest depth; with `cache_key` (a validation batch while fitting) from a
        kept Φ advanced one layer per depth; a batch of the test pass (("test_batch", i)) reads the
        logits the depth curve computed at the last depth where they are of the same rows."""
        if cache_key is None:
            return self(features)
        if cache_key[0] == "test_batch":
            kept = self._kept_test_logits(features, cache_key[1])
            return self(features) if kept is None else kept
        return self._evaluation_features(cache_key, features, self.depth) @ self.classifier[self.depth]

    def _kept_test_logits(self, features: Tensor, batch_index: int) -> Tensor | None:
        """The kept test logits of `features` where they are batch `batch_index` of the test split
        the curve scored (rows i·n.. of n-row batches, or its last n rows), compared row for row."""
        if self._test_logits is None:
            return None
        test_features, test_logits = self._test_logits
        rows = len(features)
        for start in (batch_index * rows, len(test_features) - rows):  # a full batch; the last, shorter one
            window = test_features[start:start + rows]
            if 0 <= start and _same_rows(window, features):
                return test_logits[start:start + rows]
        return None

    @torch.no_grad()
    def step_metrics(self, test_features: Tensor | None, test_labels: Tensor | None,
                     fit_metrics: dict[str, float]) -> list[tuple[int, dict[str, float]]]:
        """After a round that solved W_t (every fused round; every other two-round one): the test
        accuracy of depth t (step t), advancing the test set's Φ by one layer."""
        if test_features is None or test_labels is None:  # no test split
            return []
        if not self.fused and self.round % 2 == 0:  # an Ω round: no new classifier
            return []
        depth = self.depth
        if depth == 0:
            self.depth_accuracy, self._test_logits = [], None
        accuracy = self.accuracy(test_features, test_labels)  # the test split's Φ kept, one layer on
        self.depth_accuracy.append(accuracy)
        if self.round >= self.num_rounds:  # the last depth: the kept Φ was only needed while fitting
            test_chunks = sorted(key for key in self._eval_phi if key[0] == "test")  # ("test", i), in row order
            # the fitted model's test logits, for the test pass to read rather than rebuild T layers
            self._test_logits = (test_features, torch.cat([self._eval_phi[key][2] @ self.classifier[depth]
                                                           for key in test_chunks]))
            for key in [key for key in self._eval_phi if key[0] != "val"]:  # the curve's test and validation
                del self._eval_phi[key]
        return [(depth, {"depth/test_acc": accuracy, "depth/depth": float(depth),
                         "depth/bytes_up": fit_metrics["comm/bytes_up"]})]


def _same_rows(a: Tensor, b: Tensor) -> bool:
    """Whether two evaluation batches hold the same rows (what a kept Φ or logits were computed from)."""
    return a.shape == b.shape and a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
