"""The learning curve: every method scores its global model on the test split after its rounds
(`round/test_acc`), personalized methods their clients' own models on the local test splits
(`round/test_acc_local_mean`), each point beside the bytes sent so far per client."""
from __future__ import annotations

import pytest
from lightning import Trainer

from tests.conftest import last_run, metrics, quiet_trainer
from tests.engines.conformance import data
from workbench.cli import main
from workbench.engines import LightningEngine
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, AnaPFL, DeepAFL, Ditto, FedAvg, LocalOnly
from workbench.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
LOGGED = 1e-6  # the test's accuracies are torchmetrics' float32
GRADIENT = dict(num_rounds=4, architecture="mlp", hidden_dim=8, seed=3, local=LocalTraining(lr=0.1, batch_size=16))


def fitted(method, eval_every: int = 1) -> tuple[LightningEngine, Trainer]:
    engine, dm = LightningEngine(method, eval_every=eval_every), data()
    trainer = quiet_trainer()
    trainer.fit(engine, datamodule=dm)
    trainer.test(engine, datamodule=dm, verbose=False)
    return engine, trainer


def test_a_gradient_method_scores_every_round_and_its_last_point_is_the_test():
    engine, trainer = fitted(FedAvg(**GRADIENT))
    curve = engine.curve
    assert [point["round"] for point in curve] == [1, 2, 3, 4]
    assert curve[-1]["round/test_acc"] == pytest.approx(float(trainer.callback_metrics["test/acc"]), abs=LOGGED)
    # under the personalized protocol a global model is each client's model: scored on the local splits too
    assert all("round/test_acc_local_mean" in point for point in curve)
    assert curve[-1]["round/test_acc_local_mean"] == pytest.approx(
        float(trainer.callback_metrics["test/acc_local_mean"]), abs=LOGGED)
    uploads = [point["round/bytes_up_per_client"] for point in curve]
    assert uploads == sorted(uploads) and uploads[0] > 0  # cumulative
    # the model every client receives at the end comes after the last round's point
    final_model = 4 * (8 * 8 + 8 + 8 * 4 + 4)
    assert curve[-1]["round/bytes_down_per_client"] + final_model == engine.fit_metrics["comm/bytes_down_per_client"]


def test_eval_every_scores_every_nth_round_and_the_last():
    engine, _ = fitted(FedAvg(**{**GRADIENT, "num_rounds": 5}), eval_every=2)
    assert [point["round"] for point in engine.curve] == [2, 4, 5]
    engine, _ = fitted(FedAvg(**GRADIENT), eval_every=0)
    assert engine.curve == [] and "round/test_acc" not in engine.fit_metrics
    with pytest.raises(ValueError, match="eval_every"):
        LightningEngine(AFL(), eval_every=-1)


def test_a_one_round_method_is_one_point():
    engine, trainer = fitted(AFL(gamma=1.0, gamma_out=0.1))
    (point,) = engine.curve
    assert point["round"] == 1 and point["round/test_acc"] == pytest.approx(
        float(trainer.callback_metrics["test/acc"]), abs=LOGGED)
    assert point["round/bytes_up_per_client"] == engine.fit_metrics["comm/bytes_up_per_client"]


def test_deepafl_scores_each_depth_from_the_test_splits_kept_features():
    method = DeepAFL(num_layers=2, hidden_dim=16, block_dim=12, seed=1, schedule="fused")
    engine, _ = fitted(method)
    assert [point["round/test_acc"] for point in engine.curve] == pytest.approx(method.depth_accuracy, abs=1e-12)


def test_personal_models_are_scored_along_the_rounds_where_they_exist():
    ditto, trainer = fitted(Ditto(lam=0.5, **GRADIENT))
    assert all("round/test_acc_local_mean" in point for point in ditto.curve) and len(ditto.curve) == 4
    assert ditto.curve[-1]["round/test_acc_local_mean"] == pytest.approx(
        float(trainer.callback_metrics["test/acc_local_mean"]), abs=LOGGED)
    # AnaPFL's residual branch and local-only's heads exist after the final broadcast: one point
    anapfl, trainer = fitted(AnaPFL(hidden_dim=16, lambdas=[0.5]))
    assert ["round/test_acc_local_mean" in point for point in anapfl.curve] == [True]
    assert anapfl.curve[-1]["round/test_acc_local_mean"] == pytest.approx(
        float(trainer.callback_metrics["test/acc_local_mean"]), abs=LOGGED)
    local, _ = fitted(LocalOnly())
    (point,) = local.curve
    assert point["round"] == 0 and "round/test_acc" not in point and point["round/bytes_up_per_client"] == 0


def test_the_command_line_logs_the_curve_to_the_csv(tmp_path):
    main(["fit", "--model=FedAvg", "--model.num_rounds=3", "--model.hidden_dim=8", "--data=FederatedDataModule",
          "--data.dataset=synthetic", "--data.num_clients=4", "--trainer.enable_progress_bar=false",
          f"--run_dir={tmp_path}"])
    rows = read_metrics(last_run(tmp_path) / "metrics.csv")
    curve = [(row["round/round"], row["round/test_acc"], row["round/bytes_up_per_client"]) for row in rows
             if "round/test_acc" in row]
    assert [round for round, _, _ in curve] == [1, 2, 3]  # one point a round, with the bytes so far
    assert curve[1][2] == pytest.approx(2 * curve[0][2])  # FedAvg's uploads are equal every round
    assert curve[-1][1] == pytest.approx(metrics(last_run(tmp_path))["test/acc"], abs=LOGGED)


def test_the_curve_has_its_own_seconds_beside_the_clients_and_the_server(monkeypatch):
    """`time/curve_s` holds the learning curve's scoring, and only it: a curve made 50 ms a point
    slower adds those seconds there, not to the clients' or the server's; the fit holds all three."""
    import time as clock

    scored = []
    original = FedAvg.accuracy

    def slow_accuracy(self, *args, **kwargs):
        scored.append(1)
        clock.sleep(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FedAvg, "accuracy", slow_accuracy)
    engine, _ = fitted(FedAvg(**GRADIENT))
    times = engine.fit_metrics
    assert len(scored) == 4  # one point a round
    assert times["time/curve_s"] >= 4 * 0.05
    assert times["time/client_s"] + times["time/server_s"] + times["time/curve_s"] <= times["time/fit_s"]
