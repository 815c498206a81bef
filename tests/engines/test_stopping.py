"""The stopping rule (a plateau of validation accuracy on the clients' hold-outs) and where those
hold-outs come from (`data.val_split: clients`)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import last_run, metrics, quiet_trainer
from tests.engines.conftest import three_clients
from workbench.cli import main
from workbench.engines import LightningEngine
from workbench.engines.stopping import Stopping
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg
from workbench.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(features: torch.Tensor, labels: torch.Tensor) -> list[tuple]:
    return sorted(zip(map(tuple, features.tolist()), labels.tolist(), strict=True))


def test_the_rule_stops_after_patience_rounds_without_a_gain_above_min_delta():
    rule, state = Stopping(patience=2, min_delta=0.01), {}
    decisions = [rule.stops(state, r, acc) for r, acc in enumerate([0.5, 0.6, 0.605, 0.62, 0.625, 0.629], 1)]
    # 0.605 and 0.625 are within min_delta of the best before them: no gain; 0.62 is one
    assert decisions == [False, False, False, False, False, True]
    assert (state["stop_best"], state["stop_best_round"]) == (0.62, 4)
    assert not Stopping().active and Stopping(patience=1).active
    for bad in ({"patience": -1}, {"patience": 1.5}, {"min_delta": -0.1}):
        with pytest.raises(ValueError, match="stopping"):
            Stopping(**bad)


def test_clients_hold_outs_are_carved_from_their_own_shares_by_class():
    whole = three_clients()
    held = three_clients(val_fraction=0.2, val_split="clients")
    whole.setup(), held.setup()
    # the partition is the same; each client's hold-out rows are its own, out of its training rows
    assert rows(torch.cat([held.train_features, held.val_features]), torch.cat([held.train_labels, held.val_labels])) \
        == rows(whole.train_features, whole.train_labels)
    owner = {row: int(client) for row, client in zip(map(tuple, whole.train_features.tolist()),
                                                     whole.train_client_ids, strict=True)}
    assert [owner[tuple(row)] for row in held.val_features.tolist()] == held.val_client_ids.tolist()
    for client in range(3):
        labels = whole.train_labels[whole.train_client_ids == client]
        kept = held.val_labels[held.val_client_ids == client]
        for label in labels.unique():  # round(0.2 · count) of each class of each client
            assert int((kept == label).sum()) == round(0.2 * int((labels == label).sum()))
    pooled = three_clients(val_fraction=0.2)  # the training pool's hold-out, before partitioning
    pooled.setup()
    assert not hasattr(pooled, "val_client_ids") and len(pooled.val_labels) == pytest.approx(0.2 * 600, abs=10)
    with pytest.raises(ValueError, match="val_split"):
        three_clients(val_split="server")


def fit(data, **stopping) -> LightningEngine:
    method = FedAvg(num_rounds=40, architecture="mlp", hidden_dim=8, seed=1, local=LocalTraining(lr=0.1, batch_size=32))
    engine = LightningEngine(method, stopping=Stopping(**stopping))
    quiet_trainer().fit(engine, datamodule=data)
    return engine


def test_a_plateau_of_validation_accuracy_ends_the_fit_with_its_final_broadcast():
    data = three_clients(val_fraction=0.2, val_split="clients")
    engine = fit(data, patience=3, min_delta=0.005)
    method, curve, metrics = engine.method, engine.curve, engine.fit_metrics
    stopped = int(metrics["comm/rounds"])
    assert method.fitted and 3 < stopped < 40  # stopped early, the final model delivered
    val = [point["round/val_acc"] for point in curve]
    best = max(range(stopped), key=lambda r: (val[r], -r))  # the first round at the best accuracy
    assert metrics["stop/best_round"] <= stopped - 3 and max(val[stopped - 3:]) <= metrics["stop/best_val_acc"] + 0.005
    assert val[best] == pytest.approx(max(val))
    model = 8 * 12 + 8 + 8 * 10 + 10  # the MLP's parameters (12 features, 10 classes)
    assert metrics["comm/bytes_down_per_client"] == curve[-1]["round/bytes_down_per_client"] + 4 * model
    # the test split plays no part in the decision: other test labels, the same stop and model
    shuffled = three_clients(val_fraction=0.2, val_split="clients")
    shuffled.setup()
    shuffled.test_labels = shuffled.test_labels[torch.randperm(len(shuffled.test_labels))]
    again = fit(shuffled, patience=3, min_delta=0.005)
    assert again.fit_metrics["comm/rounds"] == stopped
    assert all(torch.equal(a, b) for a, b in zip(again.method.state_dict().values(), method.state_dict().values(),
                                                 strict=True))


def test_a_fit_that_spends_its_budget_still_reports_its_best_round():
    data = three_clients(val_fraction=0.2, val_split="clients")
    engine = fit(data, patience=100)  # never stops early: the last round counts too
    val = [point["round/val_acc"] for point in engine.curve]
    assert engine.fit_metrics["comm/rounds"] == 40 and len(val) == 40
    best = max(range(40), key=lambda r: (val[r], -r))
    assert engine.fit_metrics["stop/best_val_acc"] == val[best]
    assert engine.fit_metrics["stop/best_round"] == best + 1


def test_stopping_without_a_validation_split_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no validation split: set data\.val_fraction"):
        fit(three_clients(), patience=2)


def test_the_command_line_takes_the_rule_and_logs_the_validation_curve(tmp_path):
    main(["fit", "--model=FedAvg", "--model.num_rounds=30", "--model.hidden_dim=8", "--model.local.lr=0.1",
          "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
          "--data.val_fraction=0.2", "--data.val_split=clients", "--stopping.patience=2",
          "--stopping.min_delta=0.01", "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"])
    logged = metrics(last_run(tmp_path))
    assert logged["comm/rounds"] < 30 and "test/acc" in logged
    curve = [row for row in read_metrics(last_run(tmp_path) / "metrics.csv") if "round/val_acc" in row]
    assert [row["round/round"] for row in curve] == list(range(1, int(logged["comm/rounds"]) + 1))
