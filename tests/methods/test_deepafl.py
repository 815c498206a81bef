"""DeepAFL: the closed-form layers, partition invariance, non-increasing risk, bytes and rounds."""
from __future__ import annotations

import csv
import math

import pytest
import torch
from lightning import Callback, Trainer

from tests.conftest import ROOT, InterruptAfter, relative_error
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines import LightningEngine
from workbench.engines.local import LocalClients
from workbench.federation import Federation, ProtocolView
from workbench.federation.messages import SEED_BYTES, messages_bytes
from workbench.federation.privacy import clip_features
from workbench.linalg import add_gram_
from workbench.methods import DeepAFL, Problem
from workbench.methods.deepafl import (
    RANDOM_LAYERS,
    ResidualNetwork,
    omega_from_factors,
    random_layer,
    solve_omega,
    solve_omega_eigh,
    solve_omega_factors,
)

# Overlapping blobs, so that the residual blocks have something left to fit
BLOBS = SyntheticBlobs(num_classes=4, dim=10, train_size=600, test_size=200, separation=2.5, seed=5)
SMALL = {"hidden_dim": 12, "block_dim": 16}
SCHEDULES = ["fused", "two_round"]


def data(batch_size: int = 4096, **partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=batch_size,
                             min_partition_size=1, **partition)
    dm.setup()
    return dm


def one_hot(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, BLOBS.num_classes).double()


def downlink_numbers(schedule: str, num_layers: int, h: int, f: int, classes: int) -> int:
    """Numbers one client receives over a fit with every client in every round (the seed aside):
    each Ω_t once, as its factors (r(f + h), r = min(h, C)) where smaller than f·h; W_{t−1} with
    each two_round Ω round; W_T with the final broadcast."""
    omega = min(min(h, classes) * (f + h), f * h)
    classifiers = 1 if schedule == "fused" else num_layers + 1
    return classifiers * h * classes + num_layers * omega


@pytest.mark.parametrize("h, classes", [(16, 5), (64, 3), (4, 7), (6, 6)])
def test_omega_solves_its_normal_equation(h, classes):
    """The rank-C solve (thin SVD of W, no h × h eigendecomposition) satisfies
    FᵀF Ω WWᵀ + γ_sΩ = FᵀR Wᵀ, equals the two-eigendecomposition solve, and has rank ≤ C."""
    gen = torch.Generator().manual_seed(h * 100 + classes)
    n, f, gamma_s = 300, 24, 0.05
    hidden = torch.randn(n, f, generator=gen, dtype=torch.float64).tanh()
    residual = torch.randn(n, classes, generator=gen, dtype=torch.float64)
    classifier = torch.randn(h, classes, generator=gen, dtype=torch.float64)  # WWᵀ has rank min(h, C)
    gram, cross = hidden.T @ hidden, hidden.T @ residual
    omega = solve_omega(gram, cross, classifier, gamma_s)
    assert omega.shape == (f, h)
    lhs = gram @ omega @ classifier @ classifier.T + gamma_s * omega
    rhs = cross @ classifier.T
    assert relative_error(lhs, rhs) <= 1e-8
    assert relative_error(omega, solve_omega_eigh(gram, cross, classifier, gamma_s)) <= 1e-8
    left, right = solve_omega_factors(gram, cross, classifier, gamma_s)
    assert left.shape == (f, min(h, classes)) and right.shape == (h, min(h, classes))
    assert int(torch.linalg.matrix_rank(omega)) <= classes


def test_omega_of_a_rank_deficient_classifier_solves_its_normal_equation():
    """W with rank < C (here W₀'s columns of two classes equal): zero singular values give zero columns."""
    gen = torch.Generator().manual_seed(1)
    n, f, h, classes, gamma_s = 200, 10, 8, 4, 0.05
    hidden = torch.randn(n, f, generator=gen, dtype=torch.float64)
    residual = torch.randn(n, classes, generator=gen, dtype=torch.float64)
    classifier = torch.randn(h, classes, generator=gen, dtype=torch.float64)
    classifier[:, 3] = classifier[:, 2]
    gram, cross = hidden.T @ hidden, hidden.T @ residual
    omega = solve_omega(gram, cross, classifier, gamma_s)
    lhs = gram @ omega @ classifier @ classifier.T + gamma_s * omega
    assert relative_error(lhs, cross @ classifier.T) <= 1e-8


def reference_fit(dm: FederatedDataModule, num_layers: int, hidden_dim: int, block_dim: int,
                  gamma: float, gamma_s: float, seed: int, omega_rows=None, classifier_rows=None) -> tuple[list, list]:
    """Centralized DeepAFL on the pooled data, Ω by the vectorized (Kronecker) normal equations.
    `omega_rows(t)` / `classifier_rows(t)`: the rows (bool) whose statistics solve Ω_t / W_t (default all)."""
    x, y = dm.train_features.double(), one_hot(dm.train_labels)
    every = torch.ones(len(y), dtype=torch.bool)
    omega_rows = omega_rows or (lambda t: every)
    classifier_rows = classifier_rows or (lambda t: every)
    weight, bias = random_layer(seed, 0, x.shape[1], hidden_dim)
    phi = torch.tanh(x @ weight + bias)

    def ridge(phi, rows):
        phi, labels = phi[rows], y[rows]
        regularizer = gamma * torch.eye(hidden_dim, dtype=phi.dtype)
        return torch.linalg.solve(phi.T @ phi + regularizer, phi.T @ labels)

    classifiers, omegas = [ridge(phi, classifier_rows(0))], []
    for layer in range(1, num_layers + 1):
        weight, bias = random_layer(seed, layer, hidden_dim, block_dim)
        hidden = torch.nn.functional.gelu(phi @ weight + bias)
        residual = y - phi @ classifiers[-1]
        rows = omega_rows(layer)
        # vec(F Ω W) = (Wᵀ ⊗ F) vec(Ω), vec stacking columns
        design = torch.kron(classifiers[-1].T, hidden[rows])
        normal = design.T @ design + gamma_s * torch.eye(design.shape[1], dtype=design.dtype)
        vec_omega = torch.linalg.solve(normal, design.T @ residual[rows].T.reshape(-1))
        omegas.append(vec_omega.reshape(hidden_dim, block_dim).T)
        phi = phi + hidden @ omegas[-1]
        classifiers.append(ridge(phi, classifier_rows(layer)))
    return classifiers, omegas


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_federated_model_is_the_centralized_one_for_any_partition(fit_method, schedule):
    settings = dict(num_layers=3, gamma=1.0, gamma_s=0.05, seed=11, **SMALL)
    classifiers, omegas = reference_fit(data(), **settings)
    for partition in ({"partition": "iid", "num_clients": 3, "batch_size": 250},
                      {"partition": "dirichlet", "alpha": 0.1, "num_clients": 20, "batch_size": 64},
                      {"partition": "dirichlet", "alpha": 0.5, "num_clients": 10, "batch_size": 100},
                      {"partition": "iid", "num_clients": 100, "batch_size": 128},
                      {"partition": "iid", "num_clients": 1}):
        method = DeepAFL(schedule=schedule, **settings)
        fit_method(method, data(**partition))
        for t, classifier in enumerate(classifiers):
            assert relative_error(method.classifier[t], classifier) <= 1e-8
        for t, omega in enumerate(omegas):
            assert relative_error(method.omega[t], omega) <= 1e-8


def test_the_schedules_give_the_same_model(fit_method):
    """fused (T + 1 rounds) and two_round (2T + 1) on the same clients: the same Ω_t and W_t,
    also deeper than the reference test goes and with the other activations."""
    dm = data(partition="dirichlet", alpha=0.3, num_clients=10, batch_size=50)
    for activation in ("gelu", "relu", "sigmoid"):
        fused = DeepAFL(num_layers=8, activation=activation, schedule="fused", **SMALL)
        two = DeepAFL(num_layers=8, activation=activation, schedule="two_round", **SMALL)
        fit_method(fused, dm)
        fit_method(two, dm)
        assert fused.num_rounds == 9 and two.num_rounds == 17
        assert relative_error(fused.classifier, two.classifier) <= 1e-8
        assert relative_error(fused.omega, two.omega) <= 1e-8
        assert fused.depth_accuracy == pytest.approx(two.depth_accuracy, abs=1e-12)
        # the server's kept G_T, P_T are the statistics of the pooled Φ_T
        phi = fused.features_at_depth(dm.train_features, 8)
        assert relative_error(fused.phi_gram, phi.T @ phi) <= 1e-8
        assert relative_error(fused.phi_cross, phi.T @ one_hot(dm.train_labels)) <= 1e-8


def test_float32_is_the_float64_model_in_less_precision(fit_method):
    """`dtype: float32`: the random layers of float64 (drawn in float64, then cast), the clients'
    features and statistics in float32, the server's sums and solves in float64. Both schedules
    give float64's Ω_t, W_t and logits to float32 accuracy, its predictions, and each other's model."""
    dm = data(partition="iid", num_clients=4, batch_size=100)
    reference = DeepAFL(num_layers=8, dtype="float64", **SMALL)
    fit_method(reference, dm)
    fitted = {}
    for schedule in SCHEDULES:
        method = fitted[schedule] = DeepAFL(num_layers=8, dtype="float32", schedule=schedule, **SMALL)
        fit_method(method, dm)
        for name in ("input_weight", "input_bias", "block_weight", "block_bias"):
            assert getattr(method, name).dtype == torch.float32
            assert torch.equal(getattr(method, name), getattr(reference, name).float()), name
        assert method.classifier.dtype == method.omega.dtype == torch.float32
        assert relative_error(method.classifier.double(), reference.classifier) <= 1e-4
        assert relative_error(method.omega.double(), reference.omega) <= 1e-4
        logits, reference_logits = method(dm.test_features), reference(dm.test_features)
        assert logits.dtype == torch.float32
        assert relative_error(logits.double(), reference_logits) <= 1e-5
        assert torch.equal(logits.argmax(1), reference_logits.argmax(1))
    assert fitted["fused"].phi_gram.dtype == fitted["fused"].phi_cross.dtype == torch.float64  # the server's sums
    assert relative_error(fitted["fused"].classifier.double(), fitted["two_round"].classifier.double()) <= 1e-4
    assert relative_error(fitted["fused"].omega.double(), fitted["two_round"].omega.double()) <= 1e-4


def fit_against_each_rounds_rows(fit_method, dm, federation, schedule, num_layers, rows_of_round):
    """Fits DeepAFL under `federation` and checks every W_t and Ω_t against the centralized solves
    on the rows each round used (`rows_of_round(r)`: (n,) bool): fused round t solves both on round
    t's; two_round solves Ω_t on round 2t − 1's and W_t on round 2t's. Returns (method, engine)."""
    settings = dict(num_layers=num_layers, gamma=1.0, gamma_s=0.05, seed=2, **SMALL)
    if schedule == "fused":
        omega_rows, classifier_rows = rows_of_round, rows_of_round
    else:
        omega_rows, classifier_rows = (lambda t: rows_of_round(2 * t - 1)), (lambda t: rows_of_round(2 * t))
    classifiers, omegas = reference_fit(dm, **settings, omega_rows=omega_rows, classifier_rows=classifier_rows)
    method = DeepAFL(schedule=schedule, **settings)
    engine = fit_method(method, dm, federation)
    for t, classifier in enumerate(classifiers):
        assert relative_error(method.classifier[t], classifier) <= 1e-8, t
    for t, omega in enumerate(omegas):
        assert relative_error(method.omega[t], omega) <= 1e-8, t
    # the rounds did use different rows
    assert len({tuple(rows_of_round(r).tolist()) for r in range(method.num_rounds)}) > 1
    return method, engine


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropouts_give_the_centralized_solves_on_each_rounds_participants(fit_method, schedule):
    """Under dropouts, fused round t solves Ω_t and W_t on round t's participants (the clients restate
    Φ_{t−1}ᵀΦ_{t−1}, Φ_{t−1}ᵀY); two_round solves Ω_t on round 2t − 1's and W_t on round 2t's."""
    num_clients, num_layers = 6, 3
    dm = data(partition="dirichlet", alpha=0.5, num_clients=num_clients, batch_size=64)
    federation = Federation(dropout=0.34, seed=4)

    def participants(round_index: int) -> torch.Tensor:
        kept = ~federation.dropped_clients(round_index, num_clients)
        return kept[dm.train_client_ids]

    method, engine = fit_against_each_rounds_rows(fit_method, dm, federation, schedule, num_layers, participants)
    h, f, classes = SMALL["hidden_dim"], SMALL["block_dim"], BLOBS.num_classes
    phi_stats, hidden_stats = h * (h + 1) // 2 + h * classes, f * (f + 1) // 2 + f * classes
    survivors = [round(num_clients - round(0.34 * num_clients))] * method.num_rounds
    if schedule == "fused":  # round 0: Φ₀ stats; then the restated Φ stats, F stats and M
        per_round = [phi_stats] + [phi_stats + hidden_stats + h * f] * num_layers
        flags = num_layers  # a 1-byte `restate` flag in every fused round's broadcast
    else:
        per_round = [phi_stats] + [hidden_stats, phi_stats] * num_layers
        flags = 0
    assert engine.fit_metrics["comm/bytes_up"] == 8 * sum(n * b for n, b in zip(survivors, per_round, strict=True))
    # a dropped client receives the broadcast: the downlink is that of full participation
    down = SEED_BYTES + downlink_numbers(schedule, num_layers, h, SMALL["block_dim"], classes) * 8 + flags
    assert engine.fit_metrics["comm/bytes_down"] == down * num_clients


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sampled_cohorts_give_the_centralized_solves_on_each_rounds_cohort(fit_method, schedule):
    """Under cohort sampling, as under dropouts, each round solves on its cohort's rows; a client
    that missed rounds receives the Ω_t it lacks with the broadcast (and every client, sampled or
    not, all it lacks with the final one), so its rebuilt Φ is the model's."""
    num_clients = 6
    dm = data(partition="dirichlet", alpha=0.5, num_clients=num_clients, batch_size=64)
    federation = Federation(sample_rate=0.5, seed=3)
    available = torch.arange(num_clients)

    def cohort(round_index: int) -> torch.Tensor:
        return torch.isin(dm.train_client_ids, federation.sampled_clients(round_index, available))

    method, engine = fit_against_each_rounds_rows(fit_method, dm, federation, schedule, 3, cohort)
    # the clients' half holds every Ω_t after the final broadcast, and scores as the server does
    torch.testing.assert_close(engine.client_half.omega, method.omega, rtol=0, atol=0)


def test_without_dropouts_the_fused_clients_send_no_restated_statistics():
    method = DeepAFL(num_layers=2, **SMALL)
    dm = data(partition="iid", num_clients=2)
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    clients = torch.arange(2)
    assert not method.restates and method.factored  # r(f + h) = 4·28 < f·h = 192
    method.rounds_done += 1  # fused clients upload FᵀY and M, so no round sends them W_{t−1}
    assert set(method.plan_round(clients).broadcast) == set()
    method.rounds_done += 1
    assert set(method.plan_round(clients).broadcast) == {"omega_left", "omega_right"}
    method.run_under(ProtocolView(Federation(dropout=0.2)))
    method.rounds_done += 1
    assert method.restates and set(method.plan_round(clients).broadcast) == {"omega_left", "omega_right", "restate"}
    method.run_under(ProtocolView(Federation(sample_rate=0.5)))
    assert method.restates


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("protocol", ["all", "dropout", "sampled"])
def test_the_factored_broadcast_gives_the_dense_broadcasts_model(monkeypatch, fit_method, schedule, protocol):
    """Ω_t sent as its factors L_t, U_t (r(f + h) numbers) or dense (f·h, as before): the same Ω_t
    and W_t in float64, and the clients hold the server's Ω_t bit for bit, also when they catch up
    on Ω_t they missed (cohorts) or dropped out; the downlink is smaller by the factors' saving on
    every Ω_t a client receives."""
    num_clients, num_layers = 6, 4
    h, f, classes = SMALL["hidden_dim"], SMALL["block_dim"], BLOBS.num_classes
    federation = {"all": None, "dropout": Federation(dropout=0.34, seed=4),
                  "sampled": Federation(sample_rate=0.5, seed=3)}[protocol]
    dm = data(partition="dirichlet", alpha=0.5, num_clients=num_clients, batch_size=64)
    runs = {}
    for factored in (True, False):
        with monkeypatch.context() as patch:
            if not factored:  # the dense broadcast of every Ω_t
                patch.setattr(ResidualNetwork, "factored", property(lambda self: False))  # both halves
            method = DeepAFL(num_layers=num_layers, schedule=schedule, seed=2, **SMALL)
            engine = fit_method(method, dm, federation)
            assert method.factored == factored
        torch.testing.assert_close(engine.client_half.omega, method.omega, rtol=0, atol=0)
        runs[factored] = (method, engine.fit_metrics["comm/bytes_down"])
    (method, down), (dense, dense_down) = runs[True], runs[False]
    assert relative_error(method.omega, dense.omega) <= 1e-10
    assert relative_error(method.classifier, dense.classifier) <= 1e-10
    assert method.depth_accuracy == pytest.approx(dense.depth_accuracy, abs=1e-12)
    saving = (f * h - min(h, classes) * (f + h)) * 8  # bytes per Ω_t received
    received, rest = divmod(dense_down - down, saving)  # Ω_t received, summed over the clients
    assert rest == 0
    if protocol == "sampled":  # some clients missed Ω_t and caught up on them
        assert received >= num_layers * num_clients
    else:
        assert received == num_layers * num_clients


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_papers_shape_receives_over_30_times_fewer_bytes(schedule):
    """h = f = 1024, C = 10, T = 20 in float64 (the official setting): every round's broadcast
    and the final one, counted as the engine counts them (`messages_bytes`), hold the factors of
    each Ω_t (20 480 numbers, not 1 048 576) and, fused, only W_T: 50× (fused) and 34× (two_round)
    fewer bytes than every Ω_t dense and every W_t once."""
    num_layers, h, classes = 20, 1024, 10
    method = DeepAFL(num_layers=num_layers, hidden_dim=h, block_dim=h, schedule=schedule)
    method.setup(Problem((8,), classes, 2))
    clients = torch.arange(2)
    received = 0
    for _ in range(method.num_rounds):
        received += messages_bytes(method.plan_round(clients).broadcast)
        method.rounds_done += 1
    received += messages_bytes(method.final_broadcast())
    assert received == SEED_BYTES + downlink_numbers(schedule, num_layers, h, h, classes) * 8
    dense = SEED_BYTES + ((num_layers + 1) * h * classes + num_layers * h * h) * 8  # 169.49 MB
    assert dense / received >= (50 if schedule == "fused" else 33)


def test_a_checkpoint_without_the_factors_takes_them_from_its_omega(fit_method):
    """A checkpoint from before Ω_t's factors were kept (its Ω_t and random layers saved) loads with
    factors from the SVD of its Ω_t (rank ≤ C), which rebuild Ω_t to rounding; its Ω_t itself is
    kept as saved, and its random layers are checked against the seed's."""
    dm = data(partition="iid", num_clients=3)
    method = DeepAFL(num_layers=3, **SMALL)
    fit_method(method, dm)
    state = {name: value for name, value in method.state_dict().items() if name not in ("omega_left", "omega_right")}
    state.update({name: getattr(method, name) for name in ("omega", *RANDOM_LAYERS)})
    loaded = DeepAFL(num_layers=3, **SMALL)
    loaded.setup(method.problem)
    loaded.load_state_dict(state)
    assert torch.equal(loaded.omega, method.omega)
    for t in range(3):
        rebuilt = omega_from_factors(loaded.omega_left[t], loaded.omega_right[t])
        assert relative_error(rebuilt, method.omega[t]) <= 1e-12
    other_seed = DeepAFL(num_layers=3, seed=1, **SMALL)
    other_seed.setup(method.problem)
    with pytest.raises(ValueError, match="random layer input_weight is not the one seed"):
        other_seed.load_state_dict(state)


def test_a_checkpoint_holds_what_was_learned_and_rebuilds_the_rest_bit_for_bit(fit_method):
    """The random layers (the seed's) and the dense Ω_t (the product of its factors, where it
    travels as them) are not saved; loaded, the model is the fitted one bit for bit, on both halves."""
    dm = data(partition="iid", num_clients=3)
    method = DeepAFL(num_layers=3, **SMALL)
    engine = fit_method(method, dm)
    assert method.factored
    state = method.state_dict()
    assert not {"omega", *RANDOM_LAYERS} & set(state)
    loaded = DeepAFL(num_layers=3, **SMALL)
    loaded.setup(method.problem)
    loaded.load_state_dict(state)
    for name, value in method.named_buffers():
        assert torch.equal(getattr(loaded, name), value), name
    clients = loaded.client_half()
    clients.load_state_dict(engine.client_half.state_dict())
    assert torch.equal(clients.omega, engine.client_half.omega)
    assert torch.equal(loaded(dm.test_features), method(dm.test_features))


@pytest.mark.parametrize("activation", ["gelu", "relu", "tanh", "sigmoid"])
def test_training_risk_never_increases_with_depth(fit_method, activation):
    """J_t = ‖Y − Φ_t W_t‖² + γ‖W_t‖² drops by at least γ_s‖Ω_t‖² per layer."""
    gamma, gamma_s = 0.5, 0.05
    dm = data(partition="dirichlet", alpha=0.5, num_clients=8)
    method = DeepAFL(num_layers=4, activation=activation, gamma=gamma, gamma_s=gamma_s, **SMALL)
    fit_method(method, dm)
    y = one_hot(dm.train_labels)
    risks = []
    for t in range(method.num_layers + 1):
        phi, classifier = method.features_at_depth(dm.train_features, t), method.classifier[t]
        risks.append(float(((y - phi @ classifier) ** 2).sum() + gamma * (classifier ** 2).sum()))
    for t in range(1, len(risks)):
        gain = gamma_s * float((method.omega[t - 1] ** 2).sum())
        assert risks[t] + gain <= risks[t - 1] * (1 + 1e-12)
    assert risks[-1] < risks[0]


def test_random_layers_come_from_the_seed_alone():
    dm = data(partition="iid", num_clients=2)

    def built(seed: int, num_layers: int = 3) -> DeepAFL:
        method = DeepAFL(num_layers=num_layers, seed=seed, **SMALL)
        method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
        return method

    first, again, other, deeper = built(7), built(7), built(8), built(7, num_layers=5)
    for name in ("input_weight", "input_bias", "block_weight", "block_bias"):
        assert torch.equal(getattr(first, name), getattr(again, name))
        assert not torch.allclose(getattr(first, name), getattr(other, name))
    # each layer is reproducible on its own: a deeper model shares the first layers
    assert torch.equal(deeper.block_weight[:3], first.block_weight)
    weight, bias = random_layer(7, 2, SMALL["hidden_dim"], SMALL["block_dim"])
    assert torch.equal(first.block_weight[1], weight) and torch.equal(first.block_bias[1], bias)
    # float32 is float64's draw, cast (the same random model)
    weight32, bias32 = random_layer(7, 2, SMALL["hidden_dim"], SMALL["block_dim"], torch.float32)
    assert torch.equal(weight32, weight.float()) and torch.equal(bias32, bias.float())


def test_random_layers_follow_the_default_linear_init():
    """nn.Linear's default: weight and bias uniform on ±1/√fan_in."""
    fan_in, fan_out = 400, 500
    weight, bias = random_layer(0, 1, fan_in, fan_out)
    bound = fan_in ** -0.5
    assert weight.shape == (fan_in, fan_out) and bias.shape == (fan_out,)
    assert weight.abs().max() <= bound and bias.abs().max() <= bound
    assert weight.abs().max() > 0.99 * bound
    assert abs(float(weight.std()) - bound / math.sqrt(3)) < 0.01 * bound
    assert abs(float(weight.mean())) < 0.01 * bound


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype, itemsize", [("float64", 8), ("float32", 4)])
def test_bytes_are_the_analytic_count_and_nothing_random_is_sent(fit_method, schedule, dtype, itemsize):
    num_clients, num_layers = 4, 2
    h, f, classes = SMALL["hidden_dim"], SMALL["block_dim"], BLOBS.num_classes
    method = DeepAFL(num_layers=num_layers, schedule=schedule, dtype=dtype, **SMALL)
    engine = fit_method(method, data(partition="iid", num_clients=num_clients, batch_size=100))
    omega_round = f * (f + 1) // 2 + f * classes   # packed FᵀF and FᵀR
    classifier_round = h * (h + 1) // 2 + h * classes  # packed ΦᵀΦ and ΦᵀY
    if schedule == "fused":  # W₀'s round, then FᵀF, FᵀR and M_t = Φ_{t−1}ᵀF_t (h × f, dense) per layer
        per_client = (classifier_round + num_layers * (omega_round + h * f)) * itemsize
        rounds = num_layers + 1
    else:
        per_client = (num_layers * omega_round + (num_layers + 1) * classifier_round) * itemsize
        rounds = 2 * num_layers + 1
    assert engine.fit_metrics["comm/rounds"] == rounds
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * num_clients
    # every Ω_t once, as its factors (fused: Ω_T with W_T in the final broadcast, no W_{t−1} before)
    down = SEED_BYTES + downlink_numbers(schedule, num_layers, h, f, classes) * itemsize
    assert engine.fit_metrics["comm/bytes_down"] == down * num_clients


@pytest.mark.parametrize("schedule, rounds", [("fused", 4), ("two_round", 7)])
def test_fit_runs_its_rounds_and_reports_every_depth(fit_method, schedule, rounds):
    dm = data(partition="dirichlet", alpha=0.5, num_clients=5, batch_size=128)
    method = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
    assert method.num_rounds == rounds
    trainer = Trainer(max_epochs=method.num_rounds + 3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    engine = LightningEngine(method)
    trainer.fit(engine, datamodule=dm)
    assert trainer.current_epoch == method.num_rounds and method.round == rounds and method.depth == 3
    assert engine.fit_metrics["comm/rounds"] == rounds
    assert len(method.depth_accuracy) == 4
    # the per-depth accuracy, computed one layer at a time, is the accuracy of the model at that depth
    test = trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"]
    assert method.depth_accuracy[-1] == pytest.approx(test, abs=1e-6)
    rebuilt = float((method(dm.test_features).argmax(1) == dm.test_labels).double().mean())  # all T layers again
    assert method.depth_accuracy[-1] == pytest.approx(rebuilt, abs=1e-12)
    first = (method.features_at_depth(dm.test_features, 0) @ method.classifier[0]).argmax(1)
    assert method.depth_accuracy[0] == pytest.approx(float((first == dm.test_labels).double().mean()))


def test_the_test_pass_reads_the_logits_the_last_depth_scored(monkeypatch):
    """The depth curve scored the test split at depth T: the test pass reads those logits for
    its batches (full ones and the shorter last one) instead of rebuilding T layers, equal to the
    model's to rounding; other rows, or a model loaded since, are scored afresh."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=5, batch_size=128)
    method = DeepAFL(num_layers=3, **SMALL)
    trainer = Trainer(logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    engine = LightningEngine(method)
    trainer.fit(engine, datamodule=dm)
    assert len(dm.test_features) % 128 != 0  # a shorter last batch
    batches = list(dm.test_features.split(128))
    expected = [method(batch) for batch in batches]
    rebuilt, features_at_depth = [], DeepAFL.features_at_depth

    def counted(self, *args):
        rebuilt.append(args)
        return features_at_depth(self, *args)

    monkeypatch.setattr(DeepAFL, "features_at_depth", counted)
    for index, batch in enumerate(batches):
        torch.testing.assert_close(method.logits(batch.clone(), cache_key=("test_batch", index)), expected[index],
                                   rtol=0, atol=1e-10)
    assert not rebuilt  # every batch read from what the curve kept
    test = trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"]
    assert not rebuilt and test == pytest.approx(method.depth_accuracy[-1], abs=1e-6)  # a float32 metric
    other = batches[1] + 1.0  # other rows under a kept batch's index: scored afresh
    torch.testing.assert_close(method.logits(other, cache_key=("test_batch", 1)), method(other), rtol=0, atol=0)
    rebuilt.clear()
    method.load_state_dict(method.state_dict())  # a checkpoint loaded: what was kept is of another model
    method.logits(batches[0], cache_key=("test_batch", 0))
    assert rebuilt


def local_clients(method: DeepAFL, dm: FederatedDataModule, batch_size: int = 64) -> LocalClients:
    return LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                        torch.unique(dm.train_client_ids), batch_size)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_one_cohort_call_is_the_sum_of_each_clients_own_call_in_every_round(schedule, dropout):
    """Every round, the client half vectorized over all clients equals the clients computing
    alone, each on a client half of its own built from the settings only (as on a Flower node)."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=6)
    method = DeepAFL(num_layers=2, seed=3, schedule=schedule, **SMALL)
    method.run_under(ProtocolView(Federation(dropout=dropout)))
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    together = local_clients(method, dm)
    alone = {}
    for k in together.served.tolist():  # a fresh method per client: nothing of the server's state
        own = DeepAFL(num_layers=2, seed=3, schedule=schedule, **SMALL)
        own.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
        mine = dm.train_client_ids == k
        alone[k] = LocalClients(own, dm.train_features[mine], dm.train_labels[mine], dm.train_client_ids[mine],
                                torch.tensor([k]), batch_size=7)
    for round_index in range(method.num_rounds):
        plan = method.plan_round(together.served)
        broadcast = {name: value.clone() for name, value in plan.broadcast.items()}
        uploads, _ = together.half.client_update(round_index, broadcast, together.data)
        summed = {}
        for clients in alone.values():
            upload, _ = clients.half.client_update(round_index, broadcast, clients.data)
            summed = {name: summed.get(name, 0) + value for name, value in upload.items()}
        assert set(summed) == set(uploads)
        for name in uploads:
            assert relative_error(summed[name], uploads[name]) <= 1e-8, (round_index, name)
        method.finish_round(uploads, len(alone))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_round_costs_one_layer_and_a_client_without_its_cache_rebuilds_it(monkeypatch, schedule):
    """With Φ_{t−1} kept (fused: and F_{t−1}), a round computes one block per sample; a client half
    restored from its saved state (no per-sample cache) rebuilds Φ from the Ω it kept and uploads
    the same."""
    dm = data(partition="iid", num_clients=1)
    method = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
    fused = schedule == "fused"
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    clients = local_clients(method, dm, batch_size=len(dm.train_labels))  # one chunk
    blocks = []
    original = type(clients.half).block_features
    monkeypatch.setattr(type(clients.half), "block_features",
                        lambda self, phi, layer: blocks.append(layer) or original(self, phi, layer))
    for round_index in range(method.num_rounds):
        blocks.clear()
        broadcast = method.plan_round(clients.served).broadcast
        uploads, _ = clients.half.client_update(round_index, broadcast, clients.data)
        layer = round_index if fused else (round_index + 1) // 2
        assert blocks == ([] if round_index == 0 else [layer]), round_index
        if round_index == (2 if fused else 4):  # a client whose process restarted: its saved state only
            state = clients.half.state_dict()
            assert set(state) == {"omega_left", "omega_right"}  # Ω_t is their product
            before_factors = {"omega": clients.half.omega.clone()}  # a state saved before the factors were kept
            for saved in (state, before_factors):
                rebuilt = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
                rebuilt.setup(method.problem)
                fresh = local_clients(rebuilt, dm)
                fresh.half.load_state_dict(saved)
                again, _ = fresh.half.client_update(round_index, broadcast, fresh.data)
                for name in uploads:
                    assert relative_error(again[name], uploads[name]) <= 1e-8, name
        method.finish_round(uploads, 1)
    if fused:  # Ω_T reaches the clients with the final broadcast
        clients.half.finish(method.final_broadcast(), clients.data)
        assert torch.equal(clients.half.omega, method.omega)


class ValAccuracies(Callback):
    def on_validation_epoch_end(self, trainer, module):
        self.values = [*getattr(self, "values", []), float(trainer.callback_metrics["val/acc"])]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_validation_while_fitting_scores_the_model_of_every_round(fit_method, schedule):
    """Validation during the fit advances a kept Φ one layer per depth; its accuracies must be
    those of the model itself, as a plain forward of each depth gives them."""
    dm = data(partition="iid", num_clients=3, batch_size=64, val_fraction=0.2)
    method, seen = DeepAFL(num_layers=2, schedule=schedule, **SMALL), ValAccuracies()
    Trainer(logger=False, enable_checkpointing=False, callbacks=[seen],
            enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0).fit(LightningEngine(method), datamodule=dm)

    def accuracy(depth: int) -> float:
        phi = method.features_at_depth(dm.val_features, depth)
        return float(((phi @ method.classifier[depth]).argmax(1) == dm.val_labels).double().mean())

    # the model after each round
    depths = [r - 1 if schedule == "fused" else max(r - 1, 0) // 2 for r in range(1, method.num_rounds + 1)]
    assert seen.values == pytest.approx([accuracy(t) for t in depths], abs=1e-6)
    assert len(dm.val_labels) > 64  # several validation batches, each with its own kept Φ


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sampled", [False, True])
def test_a_resumed_fit_gives_the_same_model(fit_method, tmp_path, schedule, sampled):
    """Stopping after 3 rounds and resuming from the checkpoint rebuilds the per-sample features
    (fused: the server's G, P come from the checkpoint; sampled cohorts: the Ω_t factors a client
    missed come from it)."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=5, batch_size=128)
    federation = Federation(sample_rate=0.6, seed=1) if sampled else None
    whole = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
    whole_engine = fit_method(whole, dm, federation)

    def trainer(*callbacks) -> Trainer:
        return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks))

    first_part = trainer(InterruptAfter(3))
    part = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
    first_part.fit(LightningEngine(part, federation), datamodule=dm)
    assert part.round == 3
    first_part.save_checkpoint(tmp_path / "part.ckpt")
    saved = torch.load(tmp_path / "part.ckpt", weights_only=False)["state_dict"]
    assert "client_half.omega_left" in saved  # the clients keep the Ω they received (its factors)...
    assert not any(name.startswith(("client_half.phi", "client_half.hidden"))
                   for name in saved)  # ...not their per-sample caches
    resumed = DeepAFL(num_layers=3, schedule=schedule, **SMALL)
    # the checkpoint holds the data module's hyperparameters (a SyntheticBlobs): our own file
    engine = LightningEngine(resumed, federation)
    trainer().fit(engine, datamodule=dm, ckpt_path=tmp_path / "part.ckpt", weights_only=False)
    assert resumed.fitted
    assert relative_error(resumed.classifier, whole.classifier) <= 1e-10
    assert relative_error(resumed.omega, whole.omega) <= 1e-10
    torch.testing.assert_close(engine.client_half.omega, resumed.omega, rtol=0, atol=0)
    assert engine.fit_metrics["comm/bytes_down"] == whole_engine.fit_metrics["comm/bytes_down"]


def test_cli_logs_every_depth_and_the_checkpoint_restores_the_model(tmp_path):
    common = ["--model=DeepAFL", "--model.num_layers=2", "--model.hidden_dim=32",
              "--model.block_dim=24",
              "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=6",
              "--data.partition=iid", "--trainer.enable_progress_bar=false"]
    cli = main(["fit", *common, f"--run_dir={tmp_path}"])
    assert cli.method.fitted and cli.method.schedule == "fused" and cli.method.round == 3
    run = max(tmp_path.glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    depth_rows = [row for row in rows if row.get("depth/test_acc")]
    assert [int(row["step"]) for row in depth_rows] == [0, 1, 2]
    logged = [float(row["depth/test_acc"]) for row in depth_rows]
    assert logged == pytest.approx(cli.method.depth_accuracy)
    fitted_acc = float(cli.trainer.callback_metrics["test/acc"])
    assert fitted_acc > 0.9
    tested = main(["test", *common, f"--run_dir={tmp_path / 'eval'}",
                   f"--ckpt_path={run / 'model.ckpt'}"])
    assert float(tested.trainer.callback_metrics["test/acc"]) == pytest.approx(fitted_acc)


@pytest.mark.parametrize("config", ["deepafl_demo.yaml", "deepafl_fashion.yaml"])
def test_configs_parse(config, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert done.value.code == 0
    assert "workbench.methods.DeepAFL" in capsys.readouterr().out


@pytest.mark.parametrize("bad, match", [
    ({"num_layers": -1}, "num_layers"), ({"hidden_dim": 0}, "hidden_dim"),
    ({"block_dim": 0}, "block_dim"),
    ({"activation": "swish"}, "activation"), ({"gamma": -1.0}, "gamma"), ({"gamma_s": 0.0}, "gamma_s"),
    ({"seed": -3}, "seed"), ({"dtype": "float16"}, "dtype"), ({"schedule": "fuse"}, "schedule"),
])
def test_bad_hyperparameters_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        DeepAFL(**bad)


def test_the_depth_curve_scores_the_test_split_as_the_test_pass_does_under_feature_clip():
    """With feature_clip, the clients train on clipped rows: the depth curve scores the clipped
    test rows too, so its last depth is the test pass's accuracy (and its logits are reused)."""
    dm = data(partition="dirichlet", alpha=0.5, num_clients=5, batch_size=128)
    method = DeepAFL(num_layers=2, **SMALL)
    trainer = Trainer(logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    clip = float(dm.test_features.norm(dim=1).median())  # clips about half the rows
    engine = LightningEngine(method, federation=Federation(feature_clip=clip))
    trainer.fit(engine, datamodule=dm)
    clipped = clip_features(dm.test_features, clip)
    expected = float((method(clipped).argmax(1) == dm.test_labels).double().mean())
    assert method.depth_accuracy[-1] == pytest.approx(expected, abs=1e-12)
    assert expected != pytest.approx(float((method(dm.test_features).argmax(1) == dm.test_labels).double().mean()))


@pytest.mark.parametrize("width", [7, 300, 301])
def test_a_gram_added_by_its_upper_blocks_is_the_full_product(width):
    x = torch.randn(500, width, dtype=torch.float64, generator=torch.Generator().manual_seed(width))
    start = torch.randn(width, width, dtype=torch.float64)
    start = start + start.T
    gram = add_gram_(start.clone(), x)
    torch.testing.assert_close(gram, start + x.T @ x, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(gram, gram.T, rtol=1e-12, atol=1e-10)
