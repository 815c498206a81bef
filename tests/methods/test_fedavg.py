"""FedAvg / FedProx: centralized SGD with one client, the proximal pull, sampling, bytes."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.methods.conftest import P, centralized_sgd, data, fake_images, fit64, small
from workbench.cli import main
from workbench.data import FederatedDataModule
from workbench.federation import Federation
from workbench.federation.compression import Compression, ErrorFeedback
from workbench.federation.local_training import LocalTraining
from workbench.methods import FedAvg, FedProx
from workbench.methods.gradient import GradientClient
from workbench.methods.heads import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_client_with_full_participation_is_centralized_sgd():
    dm = data(num_clients=1)
    method = FedAvg(num_rounds=3, seed=4, **small(epochs=2))
    fit64(method, dm)
    # Float64 everywhere except the wire: each round's Δw crosses it rounded to float32.
    ours = method.flat_parameters()
    reference = centralized_sgd(dm, 3, lambda round_index: 0.1)
    assert (ours - reference).norm() <= 1e-6 * reference.norm()


def client_drifts(monkeypatch, method_class, **kwargs) -> torch.Tensor:
    """‖w_k − w_t‖ of each client after one round of 3 local epochs: (K,)."""
    method = method_class(num_rounds=1, seed=1, **small(epochs=3), **kwargs)
    drifts = []
    encode = GradientClient.encode

    def spy(half, round_index, cohort, updates):
        drifts.append(updates.norm(dim=1))
        return encode(half, round_index, cohort, updates)

    monkeypatch.setattr(GradientClient, "encode", spy)
    fit64(method, data(num_clients=5, partition="dirichlet", alpha=0.3))
    return drifts[0]


def test_fedprox_keeps_clients_near_the_global_model(monkeypatch):
    """lr · μ < 1 keeps the proximal step a contraction; the drift then shrinks as μ grows."""
    drifts = [client_drifts(monkeypatch, FedProx, mu=mu) for mu in (0.0, 1.0, 3.0, 9.0)]
    torch.testing.assert_close(drifts[0], client_drifts(monkeypatch, FedAvg), rtol=0, atol=0)  # μ = 0 is FedAvg
    for weaker, stronger in itertools.pairwise(drifts):
        assert (stronger < weaker).all()
    assert (drifts[-1] < 0.4 * drifts[0]).all()


def compressed(compression: Compression, error_feedback: ErrorFeedback = ErrorFeedback(), **options) -> Federation:
    """A protocol that compresses the updates (the compress stage)."""
    return Federation(compression=compression, error_feedback=error_feedback, **options)


def residuals(half):
    """The compress stage's error feedback of `update`, held by the client half."""
    return half.protocol_state.compress.update_residuals


def test_sampled_clients_alone_upload_and_are_redrawn_every_round():
    dm = data(num_clients=10)
    method = FedAvg(num_rounds=4, sample_fraction=0.3, **small())
    drawn = []
    original = method.sample_clients
    method.sample_clients = lambda available: drawn.append(original(available)) or drawn[-1]
    engine = fit64(method, dm, compressed(Compression("topk", topk_fraction=0.2)))
    assert len(drawn) == 4 and all(len(clients) == 3 for clients in drawn)
    assert len({tuple(c.tolist()) for c in drawn}) > 1
    k = math.ceil(0.2 * P)
    assert engine.fit_metrics["comm/bytes_up"] == 4 * 3 * k * (
        4 + 1
    )  # values + uint8 indices (P < 256)
    assert engine.fit_metrics["comm/clients_in_round"] == 3
    ever = torch.zeros(10, dtype=torch.bool)
    ever[torch.cat(drawn)] = True
    half = engine.client_half
    assert torch.equal(half.served, torch.arange(10))  # every client has data: slot k is client k
    has_residual = residuals(half).residual(torch.arange(10)).abs().sum(1) > 0
    assert torch.equal(has_residual, ever)  # only clients that uploaded carry an error
    assert torch.equal(residuals(half).residuals.ids, ever.nonzero().squeeze(1))  # and only they hold a row


@pytest.mark.parametrize(
    "compression, options, per_client",
    [
        ("none", {}, 4 * P),
        ("topk", {"topk_fraction": 0.05}, math.ceil(0.05 * P) * (4 + 1)),
        ("quantize", {"quantize_bits": 8}, sum(n + 8 for n in (64, 8, 32, 4))),
        ("quantize", {"quantize_bits": 4}, sum(math.ceil(n / 2) + 8 for n in (64, 8, 32, 4))),
    ],
)
def test_upload_bytes_are_the_analytic_count(fit_method, compression, options, per_client):
    method = FedAvg(num_rounds=2, **small())
    engine = fit_method(method, data(num_clients=5), compressed(Compression(kind=compression, **options)))
    assert engine.fit_metrics["comm/bytes_up"] == 2 * 5 * per_client
    # round 0: the seed (8 bytes); round 1 and the final broadcast: the float32 model, to every client
    assert engine.fit_metrics["comm/bytes_down"] == 5 * 8 + 5 * 4 * P + 5 * 4 * P


def test_lossless_settings_of_the_compressors_are_fedavg():
    dm = data(num_clients=4, partition="dirichlet", alpha=0.5)
    reference = FedAvg(num_rounds=2, **small())
    fit64(reference, dm)
    everything = FedAvg(num_rounds=2, **small())
    fit64(everything, dm, compressed(Compression(kind="topk", topk_fraction=1.0), ErrorFeedback(enabled=False)))
    torch.testing.assert_close(
        everything.flat_parameters(), reference.flat_parameters(), rtol=0, atol=0
    )
    # with error feedback, the float32 rounding of the wire is carried over: equal to that rounding
    carried = FedAvg(num_rounds=2, **small())
    fit64(carried, dm, compressed(Compression(kind="topk", topk_fraction=1.0)))
    torch.testing.assert_close(
        carried.flat_parameters(), reference.flat_parameters(), rtol=1e-6, atol=1e-7
    )
    quantized = FedAvg(num_rounds=2, **small())
    fit64(quantized, dm, compressed(Compression(kind="quantize", quantize_bits=16)))
    gap = (quantized.flat_parameters() - reference.flat_parameters()).norm()
    assert gap < 1e-3 * reference.flat_parameters().norm()


def test_federated_training_learns(fit_method):
    """On blobs where the closed-form ridge head (AFL) scores 0.97, 10 rounds reach 0.9."""
    dm = data(num_clients=5, partition="dirichlet", alpha=0.5)
    method = FedAvg(num_rounds=10, **small())
    engine = fit_method(method, dm)
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.9


def test_the_clients_train_on_views_of_the_whole_training_set(fit_method):
    """In process the engine hands the client half the data module's rows themselves (no copy)."""
    dm = data(num_clients=5, batch_size=64)
    engine = fit_method(FedAvg(num_rounds=1, **small()), dm)
    rows = engine.clients.data
    assert rows.features.data_ptr() == dm.train_features.data_ptr()
    assert len(rows.labels) == len(dm.train_labels) and torch.equal(rows.client_ids, dm.train_client_ids)


def test_a_cohort_call_is_each_clients_call_alone():
    """One client step over every client sends the sum of each client's one-client step (own
    streams), and leaves each client the same error feedback."""
    from workbench.engines.local import LocalClients
    from workbench.federation.client_step import client_step
    from workbench.methods import Problem

    dm = data(num_clients=6, partition="dirichlet", alpha=0.3)
    method = FedAvg(num_rounds=2, **small())
    method.setup(Problem((8,), 4, 6))
    method.double()
    federation = compressed(Compression(kind="topk", topk_fraction=0.3))
    together = LocalClients(method, dm.train_features.double(), dm.train_labels, dm.train_client_ids,
                            torch.unique(dm.train_client_ids), batch_size=64, federation=federation)
    alone = LocalClients(method, dm.train_features.double(), dm.train_labels, dm.train_client_ids,
                         torch.unique(dm.train_client_ids), batch_size=64, federation=federation)
    together.half.double(), alone.half.double()
    for round_index in range(2):  # the second round starts from error feedback
        broadcast = {"weights": method.flat_parameters() + round_index}
        total = client_step(together.half, method.uploads, round_index, broadcast, together.cohort(together.served),
                            pipeline=together.pipeline).uploads["update"]
        rows = [client_step(alone.half, method.uploads, round_index, broadcast, alone.cohort(k[None]),
                            pipeline=alone.pipeline).uploads["update"] for k in alone.served]
        torch.testing.assert_close(total, torch.stack(rows).sum(0), rtol=1e-12, atol=1e-12)
    clients = together.served
    torch.testing.assert_close(residuals(together.half).residual(clients), residuals(alone.half).residual(clients),
                               rtol=1e-12, atol=1e-12)
    assert residuals(together.half).residual(clients).abs().sum() > 0


def test_raw_images_feed_a_cnn(add_dataset, fit_method):
    add_dataset("tiny_images", fake_images)
    dm = FederatedDataModule(dataset="tiny_images", inputs="images", num_clients=3, partition="iid")
    dm.setup()
    assert dm.input_shape == (1, 8, 8) and dm.feature_dim == 64
    assert dm.train_features.min() >= -1 and dm.train_features.max() <= 1
    assert dm.describe()["backbone"] == "none"
    method = FedAvg(num_rounds=5, architecture="cnn", local=LocalTraining(lr=0.1, batch_size=8))
    engine = fit_method(method, dm)
    assert method.input_shape == (1, 8, 8)
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.9


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="lr"):
        FedAvg(local=LocalTraining(lr=-0.1))
    with pytest.raises(ValueError, match="sample_fraction"):
        FedAvg(sample_fraction=0.0)
    with pytest.raises(ValueError, match="mu"):
        FedProx(mu=50.0, local=LocalTraining(lr=0.1))
    with pytest.raises(ValueError, match="inputs=features"):
        FederatedDataModule(dataset="synthetic", inputs="images")
    with pytest.raises(ValueError, match=r"data.inputs=images"):
        build_model("cnn", (32,), 4)


def logged_rows(run_dir: Path) -> list[dict[str, str]]:
    run = max(run_dir.glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    return list(csv.DictReader((run / "metrics.csv").open()))


@pytest.mark.parametrize("method", ["FedAvg", "FedProx"])
def test_cli_logs_bytes_every_round(tmp_path, method):
    cli = main(
        [
            "fit",
            f"--model={method}",
            "--model.num_rounds=3",
            "--model.hidden_dim=8",
            "--federation.compression.kind=quantize",
            "--federation.compression.quantize_bits=4",
            "--data=FederatedDataModule",
            "--data.dataset=synthetic",
            "--data.num_clients=4",
            "--trainer.enable_progress_bar=false",
            f"--run_dir={tmp_path}",
        ]
    )
    per_client = cli.model.pipeline.wire(cli.model.method.uploads)["update"].encoding.bytes_per_client()  # the engine's
    assert per_client == sum(math.ceil(n / 2) + 8 for n in cli.model.method.uploads["update"].sizes)
    rows = [row for row in logged_rows(tmp_path) if row.get("comm/bytes_up")]
    assert [float(row["comm/bytes_up"]) for row in rows] == [r * 4 * per_client for r in (1, 2, 3)]
    assert "test/acc" in cli.trainer.callback_metrics  # the fit ends with a test


@pytest.mark.parametrize(
    "config",
    ["fedavg_fashion.yaml", "fedprox_fashion.yaml", "osfed_fashion.yaml", "osfed_cnn_demo.yaml",
     "scaffold_fashion.yaml", "scaffold_demo.yaml", "osfed_paper_mnist5k.yaml", "osfed_paper_fashion.yaml"],
)
def test_configs_parse(config, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert done.value.code == 0
