"""Partial participation: dropped clients send nothing; AFL is exact on whoever took part, and
clients can join or leave a fitted AFL model exactly."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT, relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.local_training import LocalTraining
from workbench.linalg import class_sums
from workbench.methods import AFL, Cohort, DeepAFL, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")

BLOBS = SyntheticBlobs(num_classes=6, dim=16, train_size=1500, test_size=300, seed=4)


def data(num_clients: int = 10, **partition) -> FederatedDataModule:
    partition = partition or {"partition": "dirichlet", "alpha": 0.3}
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=num_clients, min_partition_size=5,
                             batch_size=200, **partition)
    dm.setup()
    return dm


def ridge(features: torch.Tensor, labels: torch.Tensor, num_classes: int, gamma: float) -> torch.Tensor:
    x = features.double()
    return torch.linalg.solve(x.T @ x + gamma * torch.eye(x.shape[1], dtype=x.dtype),
                              class_sums(x, labels, num_classes))


def uploads_of(method: AFL, dm: FederatedDataModule, clients: list[int]) -> dict[str, torch.Tensor]:
    """What `clients` upload, summed over them (each adds its γI once)."""
    mine = torch.isin(dm.train_client_ids, torch.tensor(clients))
    half = method.client_half()
    half.setup_clients(torch.tensor(sorted(clients)), int(mine.sum()))
    cohort = Cohort(dm.train_features[mine], dm.train_labels[mine], dm.train_client_ids[mine],
                    torch.tensor(sorted(clients)), torch.arange(int(mine.sum())))
    uploads, _ = half.client_update(0, {}, cohort)
    return uploads


class RecordingAFL(AFL):
    """AFL that records what its server step receives."""

    def server_update(self, uploads, num_clients):
        self.received = ({name: value.clone() for name, value in uploads.items()}, num_clients)
        return super().server_update(uploads, num_clients)


def test_dropouts_are_a_seeded_fraction_drawn_anew_each_round():
    protocol = Federation(dropout=0.3, seed=1)
    dropped = protocol.dropped_clients(0, 20)
    assert int(dropped.sum()) == 6
    assert torch.equal(dropped, protocol.dropped_clients(0, 20))
    assert not torch.equal(dropped, protocol.dropped_clients(1, 20))
    assert not torch.equal(dropped, Federation(dropout=0.3, seed=2).dropped_clients(0, 20))
    assert not Federation().dropped_clients(0, 20).any()


def test_dropped_clients_uploads_never_reach_the_server(fit_method):
    dm = data()
    method = RecordingAFL(gamma=2.0)
    engine = fit_method(method, dm, Federation(dropout=0.3, seed=3))
    dropped = method.federation.dropped_clients(0, 10).nonzero().squeeze(1).tolist()
    survivors = [k for k in range(10) if k not in dropped]
    received, num_clients = method.received
    expected = uploads_of(method, dm, survivors)
    assert len(dropped) == 3 and num_clients == 7
    assert all(relative_error(received[name], expected[name]) <= 1e-12 for name in expected)
    assert engine.fit_metrics["comm/clients_in_round"] == 7
    assert engine.fit_metrics["comm/clients_dropped"] == 3
    per_client = (16 * 17 // 2 + 16 * 6) * 8
    assert engine.fit_metrics["comm/bytes_up"] == 7 * per_client


@pytest.mark.parametrize("partition", [{"partition": "iid"}, {"partition": "dirichlet", "alpha": 0.1},
                                       {"partition": "shard", "num_shards_per_partition": 2}],
                         ids=lambda p: p["partition"])
@pytest.mark.parametrize("gamma_out", [0.0, 0.5])
def test_afl_with_dropouts_is_the_centralized_ridge_on_the_participants(fit_method, partition, gamma_out):
    dm = data(num_clients=20, **partition)
    method = AFL(gamma=2.0, gamma_out=gamma_out)
    fit_method(method, dm, Federation(dropout=0.4, seed=5))
    took_part = ~method.federation.dropped_clients(0, 20)[dm.train_client_ids]
    expected = ridge(dm.train_features[took_part], dm.train_labels[took_part], dm.num_classes, gamma_out)
    assert relative_error(method.weight, expected) <= 1e-8
    assert int(method.pooled_clients) == 12


def test_late_clients_join_a_finished_model_exactly(fit_method):
    dm = data()
    late = AFL(gamma=1.0, gamma_out=0.1)
    fit_method(late, dm, Federation(dropout=0.3, seed=8))
    dropped = late.federation.dropped_clients(0, 10).nonzero().squeeze(1).tolist()
    late.add_clients(uploads_of(late, dm, dropped), num_clients=len(dropped))
    everyone = AFL(gamma=1.0, gamma_out=0.1)
    fit_method(everyone, dm)
    assert relative_error(late.weight, everyone.weight) <= 1e-8
    assert int(late.pooled_clients) == 10


def test_a_removed_client_is_forgotten_exactly(fit_method):
    dm = data()
    method = AFL(gamma=1.0, gamma_out=0.0)
    fit_method(method, dm)
    leaving = [2, 7]
    method.remove_clients(uploads_of(method, dm, leaving), num_clients=len(leaving))

    rest = ~torch.isin(dm.train_client_ids, torch.tensor(leaving))  # a refit from scratch without them
    refit_data = data()
    refit_data.train_features, refit_data.train_labels = dm.train_features[rest], dm.train_labels[rest]
    refit_data.train_client_ids = dm.train_client_ids[rest]
    refit = AFL(gamma=1.0, gamma_out=0.0)
    fit_method(refit, refit_data)
    assert relative_error(method.weight, refit.weight) <= 1e-8
    assert relative_error(method.weight, ridge(dm.train_features[rest], dm.train_labels[rest], 6, 0.0)) <= 1e-8
    assert int(method.pooled_clients) == 8


def test_adding_or_removing_clients_checks_its_input(fit_method):
    dm = data()
    method = AFL()
    with pytest.raises(RuntimeError, match="not fitted"):
        method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
        method.add_clients({"gram": torch.eye(16), "cross": torch.zeros(16, 6)}, 1)
    fit_method(method, dm)
    with pytest.raises(ValueError, match="'gram' \\(16, 16\\)"):
        method.add_clients({"gram": torch.eye(3)}, 1)
    with pytest.raises(ValueError, match="cannot remove 11 clients"):
        method.remove_clients(uploads_of(method, dm, list(range(10))), 11)


def test_deepafl_continues_with_whoever_uploads(fit_method):
    dm = data()
    method = DeepAFL(num_layers=2, hidden_dim=16, block_dim=16, schedule="two_round")
    engine = fit_method(method, dm, Federation(dropout=0.3, seed=1))
    assert method.round == 5 and len(method.depth_accuracy) == 3
    assert torch.isfinite(method.classifier).all()
    # W_t (round 2t) is the ridge on Φ_t of that round's participants, Φ_t of every sample current
    for depth in (0, 2):
        took_part = ~method.federation.dropped_clients(2 * depth, 10)[dm.train_client_ids]
        phi = method.features_at_depth(dm.train_features[took_part], depth)
        expected = torch.linalg.solve(phi.T @ phi + method.gamma * torch.eye(16, dtype=phi.dtype),
                                      class_sums(phi, dm.train_labels[took_part], dm.num_classes))
        assert relative_error(method.classifier[depth], expected) <= 1e-8
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.95


def test_fedavg_continues_and_averages_only_the_updates_that_arrive(fit_method):
    dm = data()
    averaged_over = []

    class RecordingFedAvg(FedAvg):
        def server_update(self, uploads, num_clients):
            averaged_over.append(num_clients)
            return super().server_update(uploads, num_clients)

    method = RecordingFedAvg(num_rounds=4, architecture="linear", local=LocalTraining(lr=0.1))
    engine = fit_method(method, dm, Federation(dropout=0.3, seed=2))
    assert method.round == 4 and averaged_over == [10 - 3] * 4
    assert engine.fit_metrics["comm/clients_in_round"] == 10 - 3
    assert engine.fit_metrics["comm/clients_dropped"] == 3
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.8


def test_every_client_dropping_out_is_a_clear_error(fit_method):
    method = AFL()
    with pytest.raises(RuntimeError, match=r"every client dropped out.*lower the dropout"):
        fit_method(method, data(num_clients=2, partition="iid"), Federation(dropout=0.75))  # 2 of 2 drop


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"federation.dropout"):
        Federation(dropout=1.0)
    with pytest.raises(ValueError, match=r"federation.dp_sigma"):
        Federation(dp_sigma=-1.0)
    with pytest.raises(ValueError, match=r"federation.fixed_point_bits"):
        Federation(fixed_point_bits=60)


def test_the_federation_section_of_a_config_reaches_the_method(tmp_path):
    import yaml

    from workbench.cli import main

    root = ROOT
    config = yaml.safe_load((root / "configs/synthetic_afl.yaml").read_text())
    config["federation"] = {"dropout": 0.2, "secure_aggregation": True, "seed": 3}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cli = main(["fit", "--config", str(tmp_path / "config.yaml"), "--trainer.enable_progress_bar=false",
                f"--run_dir={tmp_path / 'runs'}", "--federation.dp_sigma=0.01", "--model.gamma_out=1.0"])
    assert cli.method.federation == Federation(dropout=0.2, secure_aggregation=True, seed=3, dp_sigma=0.01)
    assert cli.model.fit_metrics["comm/clients_dropped"] == 2 and cli.model.fit_metrics["comm/clients_in_round"] == 8
    run = next((tmp_path / "runs").glob("*/version_0"))
    assert yaml.safe_load((run / "hparams.yaml").read_text())["federation"]["dropout"] == 0.2
