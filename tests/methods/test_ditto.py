"""Ditto: FedAvg's global model untouched, personal models pulled towards it, bytes, predictions."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.func import functional_call

from tests.conftest import ROOT
from tests.methods.conftest import data, fit64, small
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.federation.local_training import LocalTraining
from workbench.methods import Ditto, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")


def fitted(method, **data_kwargs):
    """(engine, data) of a float64 fit on 5 skewed clients; the personal models are
    `engine.client_half.personal` (every client has data: slot k is client k)."""
    dm = data(num_clients=5, partition="dirichlet", alpha=0.3, **data_kwargs)
    engine = fit64(method, dm)
    assert torch.equal(engine.client_half.served, torch.arange(5))
    return engine, dm


def test_the_global_model_and_the_bytes_are_fedavgs():
    """The personal steps draw their own random stream and never touch w."""
    ditto, _ = fitted(Ditto(lam=1.0, num_rounds=3, seed=2, **small()))
    fedavg, _ = fitted(FedAvg(num_rounds=3, seed=2, **small()))
    torch.testing.assert_close(ditto.method.flat_parameters(), fedavg.method.flat_parameters(), rtol=0, atol=0)
    for key in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
        assert ditto.fit_metrics[key] == fedavg.fit_metrics[key]


def initial_weights(seed: int, num_clients: int = 5) -> torch.Tensor:
    """w₀ of the SMALL head on the 8-d, 4-class blobs: (P,) float64."""
    method = FedAvg(num_rounds=1, seed=seed, **small())
    method.setup(Problem((8,), 4, num_clients))
    return method.flat_parameters().double()


def test_personal_models_start_at_w0_as_client_state():
    method = Ditto(lam=0.5, num_rounds=1, seed=6, **small())
    method.setup(Problem((8,), 4, 7))
    half = method.client_half()
    half.setup_clients(torch.tensor([1, 4, 6]), 30)
    assert len(half.personal) == 0  # no client has trained one yet: every v_k reads as w₀
    assert torch.equal(half.personal.read(torch.tensor([1, 4, 6])), initial_weights(seed=6).float().repeat(3, 1))
    assert {"personal.ids", "personal.rows"} <= set(half.state_dict())  # checkpoints keep them
    assert Ditto.personalized and Ditto.global_model
    logits = half.predict(torch.randn(4, 8), torch.tensor([1, 2, 4, 5]))  # 2 and 5: another process's
    assert (logits[[1, 3]] == 0).all() and (logits[[0, 2]] != 0).any()


def test_personal_models_stay_nearer_the_global_model_as_lambda_grows():
    """One round: the centre of the pull is w₀, so ‖v_k − w₀‖ shrinks as λ grows."""
    distances = []
    for lam in (0.0, 1.0, 4.0, 9.0):
        engine, _ = fitted(Ditto(lam=lam, num_rounds=1, seed=1, **small(epochs=3)))
        personal = engine.client_half.personal.read(torch.arange(5))
        distances.append((personal - initial_weights(seed=1)).norm(dim=1))
    for weaker, stronger in itertools.pairwise(distances):
        assert (stronger < weaker).all()
    assert (distances[-1] < 0.5 * distances[0]).all()


def test_without_the_pull_personal_models_ignore_the_global_training():
    """λ = 0 is local-only SGD from w₀: changing the global step size changes w, not v_k."""
    slow, _ = fitted(Ditto(lam=0.0, num_rounds=2, seed=3, server_lr=0.5, **small()))
    fast, _ = fitted(Ditto(lam=0.0, num_rounds=2, seed=3, server_lr=1.0, **small()))
    assert not torch.allclose(slow.method.flat_parameters(), fast.method.flat_parameters())
    clients = torch.arange(5)
    torch.testing.assert_close(slow.client_half.personal.read(clients), fast.client_half.personal.read(clients),
                               rtol=0, atol=0)


def test_only_sampled_clients_train_their_personal_model():
    method = Ditto(lam=0.5, num_rounds=1, sample_fraction=0.4, seed=0, **small())
    drawn = []
    original = method.sample_clients
    method.sample_clients = lambda available: drawn.append(original(available)) or drawn[-1]
    engine = fit64(method, data(num_clients=5))
    assert len(drawn) == 1 and len(drawn[0]) == 2  # one draw serves the personal and the global step
    personal = engine.client_half.personal
    moved = (personal.read(torch.arange(5)) != initial_weights(seed=0)).any(dim=1)
    assert moved.nonzero().squeeze(1).tolist() == drawn[0].tolist()
    assert personal.ids.tolist() == drawn[0].tolist()  # rows only for the sampled clients


def test_a_cohort_call_is_each_clients_call_alone():
    """Personal and global steps of a cohort equal each client's alone (per-client streams)."""
    dm = data(num_clients=5, partition="dirichlet", alpha=0.3)
    method = Ditto(lam=0.5, num_rounds=2, seed=1, **small())
    method.setup(Problem((8,), 4, 5))
    halves = []
    for _ in range(2):
        clients = LocalClients(method, dm.train_features.double(), dm.train_labels, dm.train_client_ids,
                               torch.unique(dm.train_client_ids), batch_size=64)
        clients.half.double()
        halves.append(clients)
    together, alone = halves
    for round_index in range(2):
        broadcast = {"weights": initial_weights(seed=1) + 0.01 * round_index}
        total, _ = together.half.client_update(round_index, broadcast, together.cohort(together.served))
        rows = torch.cat([alone.half.client_update(round_index, broadcast, alone.cohort(k[None]))[0]["update"]
                          for k in alone.served])
        torch.testing.assert_close(total["update"], rows, rtol=1e-12, atol=1e-12)
    clients = torch.arange(5)
    torch.testing.assert_close(together.half.personal.read(clients), alone.half.personal.read(clients),
                               rtol=1e-12, atol=1e-12)


def test_each_client_predicts_with_its_personal_model():
    engine, dm = fitted(Ditto(lam=0.5, num_rounds=2, seed=0, **small()), personalized=True)
    half = engine.client_half
    features, client_ids = dm.local_test_features.double(), dm.local_test_client_ids
    logits = half.predict(features, client_ids)
    for client in range(5):
        personal = half.personal.read(torch.tensor([client]))
        params = {name: value[0] for name, value in half.flat.unflatten(personal).items()}
        mine = client_ids == client
        torch.testing.assert_close(logits[mine], functional_call(half.net, params, (features[mine],)))
    first, second = half.personal.read(torch.tensor([0, 1]))
    assert not torch.allclose(first, second)


def test_personalization_beats_the_global_model_on_skewed_clients():
    """Overlapping classes, two per client: each client's own model only has to tell its two
    apart, which the global model, facing all four, cannot do as well."""
    dm = FederatedDataModule(dataset="synthetic", num_clients=6, partition="pathological",
                             num_classes_per_partition=2, personalized=True,
                             synthetic=SyntheticBlobs(num_classes=4, dim=8, train_size=1200,
                                                      separation=2.0, seed=0))
    dm.setup()
    method = Ditto(lam=0.1, num_rounds=5, seed=0, **small(epochs=2))
    engine = fit64(method, dm)
    features, labels, client_ids = dm.local_test_features.double(), dm.local_test_labels, dm.local_test_client_ids
    personal = engine.client_half.predict(features, client_ids).argmax(1).eq(labels).double().mean()
    global_ = method(features).argmax(1).eq(labels).double().mean()
    assert personal > global_ + 0.05
    tested = engine.trainer.test(engine, datamodule=dm, verbose=False)[0]  # the protocol uses v_k
    assert tested["test/acc_local_mean"] > tested["test/acc"]


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="lower lam or personal_lr"):
        Ditto(lam=50.0, local=LocalTraining(lr=0.1))
    with pytest.raises(ValueError, match="personal_epochs"):
        Ditto(personal_epochs=0)


def test_cli_fit_logs_local_accuracy(tmp_path):
    cli = main(["fit", "--model=Ditto", "--model.num_rounds=2", "--model.hidden_dim=8", "--model.lam=0.5",
                "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
                "--data.personalized=true", "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"])
    metrics = cli.trainer.callback_metrics
    assert 0 < float(metrics["test/acc_local_mean"]) <= 1 and "test/acc" in metrics
    assert next(tmp_path.glob("*/version_0/per_client_acc.csv")).exists()
    # a checkpoint as workbench 0.2 wrote it (personal models as one dense tensor) is refused by name
    checkpoint_path = next(tmp_path.glob("*/version_0/model.ckpt"))
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    state = checkpoint["state_dict"]
    state["client_half.personal"] = state.pop("client_half.personal.rows")
    del state["client_half.personal.ids"]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.raises(ValueError, match=r"no table client_half\.personal\.ids/\.rows .*workbench 0\.2.*refit"):
        main(["test", "--model=Ditto", "--model.num_rounds=2", "--model.hidden_dim=8", "--model.lam=0.5",
              "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
              "--data.personalized=true", "--trainer.enable_progress_bar=false",
              f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={old}"])


def test_config_parses(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(ROOT / "configs/ditto_fashion.yaml"), "--print_config"])
    assert done.value.code == 0 and "lam: 0.1" in capsys.readouterr().out
