"""AnaPFL: a global branch equal to centralized ridge, plus each client's exact residual fit."""
from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as nnf

from tests.conftest import ROOT, relative_error
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.data.partition import stratified_holdout
from workbench.engines.local import LocalClients
from workbench.linalg import grouped_ridge
from workbench.methods import AnaPFL, Problem
from workbench.methods.anapfl import holdout_seed

BLOBS = SyntheticBlobs(num_classes=6, dim=12, train_size=2400, test_size=300, separation=3.0, seed=4)
HIDDEN = 48  # clients hold from a few to a few hundred samples: both the dual and the primal solve


def data(**kw) -> FederatedDataModule:
    settings = {"num_clients": 12, "partition": "dirichlet", "alpha": 0.3} | kw
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, personalized=True, min_partition_size=5,
                             batch_size=256, **settings)
    dm.setup()
    return dm


def ridge(x: torch.Tensor, y: torch.Tensor, regularization: float) -> torch.Tensor:
    return torch.linalg.solve(x.T @ x + regularization * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)


def one_hot(dm: FederatedDataModule) -> torch.Tensor:
    return nnf.one_hot(dm.train_labels, dm.num_classes).double()


def problem(dm: FederatedDataModule) -> Problem:
    return Problem((dm.feature_dim,), dm.num_classes, dm.num_clients)


def local_clients(method: AnaPFL, dm: FederatedDataModule, batch_size: int = 100) -> LocalClients:
    """The clients of `dm` in process, without an engine (for direct calls of the client half)."""
    method.setup(problem(dm))
    return LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                        torch.unique(dm.train_client_ids), batch_size)


@pytest.mark.parametrize("partition", [{"num_clients": 1, "partition": "iid"},
                                       {"num_clients": 12, "partition": "dirichlet", "alpha": 0.1},
                                       {"num_clients": 30, "partition": "shard", "num_shards_per_partition": 2}],
                         ids=["iid-1", "dirichlet0.1-12", "shard-30"])
def test_global_branch_is_centralized_ridge_on_the_main_features(fit_method, partition):
    dm = data(**partition)
    method = AnaPFL(hidden_dim=HIDDEN, gamma=0.5, gamma_out=1e-2)
    fit_method(method, dm)
    main_features = torch.tanh(dm.train_features.double() @ method.global_projection)
    assert relative_error(method.weight, ridge(main_features, one_hot(dm), 1e-2)) <= 1e-8


def test_global_branch_does_not_depend_on_the_partition(fit_method):
    weights = []
    for partition in ({"num_clients": 3, "partition": "iid"}, {"num_clients": 20, "alpha": 0.05, "seed": 2}):
        method = AnaPFL(hidden_dim=HIDDEN)
        dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, min_partition_size=1, **partition)
        dm.setup()  # not personalized: the same training pool under both partitions
        fit_method(method, dm)
        weights.append(method.weight)
    assert relative_error(weights[0], weights[1]) <= 1e-8


def test_each_clients_refinement_is_its_own_residual_ridge_and_reduces_its_residual(fit_method):
    dm = data()
    method = AnaPFL(hidden_dim=HIDDEN, beta=0.7)
    half = fit_method(method, dm).client_half
    assert torch.equal(half.served, torch.arange(dm.num_clients))  # every client has data: slot k is client k
    assert torch.equal(half.global_weight, method.weight)  # the W_g the clients received
    x = dm.train_features.double()
    residual = one_hot(dm) - torch.tanh(x @ method.global_projection) @ method.weight
    refinement = half.local_features(x)
    sizes = torch.bincount(dm.train_client_ids)
    assert (sizes < HIDDEN).any() and (sizes >= HIDDEN).any()  # both forms of the solve are used
    for k in range(dm.num_clients):
        mine = dm.train_client_ids == k
        alone = ridge(refinement[mine], residual[mine], 0.7)  # fitted on all its rows, primal
        assert relative_error(half.local_weight[k], alone) <= 1e-8
        remaining = residual[mine] - refinement[mine] @ half.local_weight[k]
        assert torch.linalg.norm(remaining) < torch.linalg.norm(residual[mine])


def test_dual_solve_equals_the_primal():
    dm = data(num_clients=40, alpha=0.2)
    refinement = local_clients(AnaPFL(hidden_dim=HIDDEN), dm).half.local_features(dm.train_features)
    targets = torch.randn(len(refinement), dm.num_classes, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(0))
    args = (refinement, targets, dm.train_client_ids, dm.num_clients, 1.0)
    primal = grouped_ridge(*args, form="primal")
    assert relative_error(grouped_ridge(*args, form="dual"), primal) <= 1e-10
    assert relative_error(grouped_ridge(*args, form="auto"), primal) <= 1e-10


def test_lambda_zero_predicts_with_the_global_branch(fit_method):
    dm = data()
    method = AnaPFL(hidden_dim=HIDDEN, lambdas=[0.0])
    half = fit_method(method, dm).client_half
    assert half.local_weight.abs().sum() > 0  # a refinement exists; λ = 0 switches it off
    x, ids = dm.local_test_features, dm.local_test_client_ids
    # two code paths (the client's copy of the global branch plus λ·0, the server's forward): equal to rounding
    assert relative_error(half.predict(x, ids), method(x)) <= 1e-12
    other = AnaPFL(hidden_dim=HIDDEN, lambdas=[0.5])
    other_half = fit_method(other, dm).client_half
    assert relative_error(other_half.predict(x, ids), other(x)) > 1e-3


def test_lambda_is_the_best_mean_holdout_accuracy_of_per_client_fits_on_the_rest(fit_method):
    dm = data()
    grid = [0.0, 0.25, 0.5, 1.0, 2.0]
    method = AnaPFL(hidden_dim=HIDDEN, lambdas=grid, holdout_fraction=0.2, seed=3)
    engine = fit_method(method, dm)
    # the same protocol, one client at a time: each client draws its own hold-out
    x, labels, ids = dm.train_features.double(), dm.train_labels, dm.train_client_ids
    main_logits = torch.tanh(x @ method.global_projection) @ method.weight
    refinement = engine.client_half.local_features(x)
    residual = one_hot(dm) - main_logits
    scores = []
    for k in range(dm.num_clients):
        mine = ids == k
        held_out = torch.zeros_like(mine)
        held_out[mine] = stratified_holdout(labels[mine], 0.2, seed=holdout_seed(3, k))
        fit, test = mine & ~held_out, mine & held_out
        if test.any():
            local = refinement[test] @ ridge(refinement[fit], residual[fit], 1.0)
            scores.append([float(((main_logits[test] + lam * local).argmax(1) == labels[test]).double().mean())
                           for lam in grid])
    expected = torch.tensor(scores, dtype=torch.float64).mean(0)
    assert torch.allclose(method.holdout_accuracy, expected, atol=1e-12)
    best = grid[int(expected.argmax())]
    assert float(method.refinement_scale) == best and engine.fit_metrics["anapfl/lambda"] == best
    assert float(engine.client_half.refinement_scale) == best  # the final broadcast's λ
    assert engine.fit_metrics["anapfl/holdout_acc"] == pytest.approx(float(expected.max()))


def test_uploads_do_not_depend_on_the_refinement_branch(fit_method, monkeypatch):
    dm = data()
    seen = []
    original = AnaPFL.server_update

    def capture(self, uploads, num_clients):
        if self.round == 0:
            seen.append({name: value.clone() for name, value in uploads.items()})
        return original(self, uploads, num_clients)

    monkeypatch.setattr(AnaPFL, "server_update", capture)
    methods = [AnaPFL(hidden_dim=HIDDEN, local_seed=1, beta=1.0),
               AnaPFL(hidden_dim=HIDDEN, local_seed=7, beta=0.1, lambdas=[0.5], holdout_fraction=0.3)]
    halves = [fit_method(method, dm).client_half for method in methods]
    assert seen[0].keys() == seen[1].keys() == {"gram", "cross"}
    assert all(torch.equal(seen[0][name], seen[1][name]) for name in seen[0])
    assert torch.equal(methods[0].weight, methods[1].weight)  # the broadcast
    assert relative_error(halves[0].local_weight, halves[1].local_weight) > 0.1


@pytest.mark.parametrize("batch_size", [100, 1 << 14])
def test_one_cohort_call_equals_each_client_alone(batch_size):
    """Every round's uploads and the local fits over the whole cohort equal the clients' own,
    computed by a fresh client half (as on another node) one client at a time."""
    dm = data()
    method = AnaPFL(hidden_dim=HIDDEN, lambdas=[0.0, 0.5, 1.0], holdout_fraction=0.2)
    clients = local_clients(method, dm, batch_size)
    alone = method.client_half()
    alone.setup_clients(clients.served, len(dm.train_labels))
    cohorts = [clients.cohort(k[None]) for k in clients.served]
    for round_index in range(method.num_rounds):
        broadcast = method.broadcast()
        together, _ = clients.half.client_update(round_index, broadcast, clients.data)
        summed = {}
        for cohort in cohorts:
            upload, _ = alone.client_update(round_index, broadcast, cohort)
            summed = {name: summed.get(name, 0) + value for name, value in upload.items()}
        assert together.keys() == summed.keys()
        for name in together:
            assert relative_error(together[name], summed[name]) <= 1e-12
        method.finish_round(together, len(clients.served))
    final = method.final_broadcast()
    clients.half.finish(final, clients.data)
    for cohort in cohorts:
        alone.finish(final, cohort)
    assert relative_error(alone.local_weight, clients.half.local_weight) <= 1e-8
    assert float(alone.refinement_scale) == float(clients.half.refinement_scale) == float(method.refinement_scale)
    x, ids = dm.local_test_features, dm.local_test_client_ids
    assert relative_error(alone.predict(x, ids), clients.half.predict(x, ids)) <= 1e-8


@pytest.mark.parametrize("lambdas", [[0.5], list(range(11))], ids=["one-lambda", "grid-of-11"])
def test_bytes_rounds_and_logged_lambda(fit_method, lambdas):
    dm = data()
    method = AnaPFL(hidden_dim=HIDDEN, lambdas=lambdas)
    metrics = fit_method(method, dm).fit_metrics
    h, classes, k, grid = HIDDEN, BLOBS.num_classes, dm.num_clients, len(lambdas)
    afl_up = (h * (h + 1) // 2 + h * classes) * 8  # packed Hg_kᵀHg_k + γI and Hg_kᵀY_k
    if grid == 1:  # one round: the seed of P_g, the statistics up, W_g down
        assert metrics["comm/rounds"] == 1
        assert metrics["comm/bytes_up_per_client"] == afl_up
        assert metrics["comm/bytes_down"] == (8 + h * classes * 8) * k
    else:  # and the λ round: W_g down, every λ's summed hold-out accuracy and a client count up; λ down
        assert metrics["comm/rounds"] == 2
        assert metrics["comm/bytes_up_per_client"] == afl_up + (grid + 1) * 8
        assert metrics["comm/bytes_down"] == (8 + h * classes * 8 + 8) * k
    assert metrics["anapfl/lambda"] in method.lambdas
    assert 0 < metrics["time/local_s"] <= metrics["time/client_s"] <= metrics["time/fit_s"]


def test_state_dict_restores_the_personalized_model(fit_method):
    dm = data()
    method = AnaPFL(hidden_dim=HIDDEN, lambdas=[0.3])
    half = fit_method(method, dm).client_half
    restored = local_clients(AnaPFL(hidden_dim=HIDDEN, lambdas=[0.0]), dm).half  # λ comes back from the buffer
    restored.load_state_dict(half.state_dict())
    x, ids = dm.local_test_features, dm.local_test_client_ids
    # equal up to rounding: a solve's output and its loaded copy may differ in memory layout
    assert relative_error(restored.predict(x, ids), half.predict(x, ids)) <= 1e-12
    assert float(restored.refinement_scale) == 0.3
    assert "global_projection" not in method.state_dict()  # regenerated from the seed
    assert not any("projection" in name for name in half.state_dict())  # the clients' too


def test_command_line_logs_local_accuracy_and_lambda(tmp_path):
    cli = main(["fit", "--model=AnaPFL", f"--model.hidden_dim={HIDDEN}", "--data=FederatedDataModule",
                "--data.dataset=synthetic", "--data.personalized=true", "--data.num_clients=8",
                "--data.alpha=0.3", "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"])
    logged = {}
    for row in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()):
        logged.update({key: float(value) for key, value in row.items() if value})
    assert {"test/acc", "test/acc_local_mean", "test/acc_local_min"} <= set(logged)
    assert logged["anapfl/lambda"] == float(cli.method.refinement_scale)
    assert logged["test/acc_local_mean"] > 0.9


@pytest.mark.parametrize("config", ["anapfl_demo.yaml", "anapfl_fashion.yaml"])
def test_configs_parse(config, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert "AnaPFL" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [{"beta": 0.0}, {"hidden_dim": 0}, {"lambdas": []}, {"lambdas": [-0.1]},
                                 {"holdout_fraction": 1.0}, {"gamma": -1.0}, {"dtype": "float16"}])
def test_bad_hyperparameters_are_rejected(bad):
    with pytest.raises(ValueError):
        AnaPFL(**bad)


def test_too_little_data_to_hold_out_is_a_clear_error(fit_method):
    with pytest.raises(ValueError, match="hold out"):
        fit_method(AnaPFL(hidden_dim=HIDDEN, holdout_fraction=1e-3), data())
