"""The Flower engine: the same method over a Flower simulation gives the in-process model and bytes.

Tests marked `flower` start a Flower simulation on Ray (tens of seconds, mostly Ray's start and
the client processes' imports); they skip where the `flower` extra is not installed.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from lightning import Trainer

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.methods import DeepAFL, FedAvg

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--data.num_clients=3",
        "--trainer.enable_progress_bar=false"]
COMM = ("comm/rounds", "comm/bytes_up", "comm/bytes_up_per_client", "comm/bytes_down", "comm/clients_in_round")
NPY_HEADER_MAX = 256  # numpy's .npy header of a small array (128 bytes here) plus its name


def quiet_trainer(method, root: Path) -> Trainer:
    return Trainer(max_epochs=method.num_rounds, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   default_root_dir=root)


def three_clients() -> FederatedDataModule:
    # batch_size 256 < the clients' shares: in process a client's rows span several batches
    return FederatedDataModule(dataset="synthetic", num_clients=3, partition="dirichlet", alpha=0.5,
                               synthetic=SyntheticBlobs(dim=16, train_size=1200, test_size=300), batch_size=256)


def assert_same_state(flower_method, reference) -> None:
    state, expected = flower_method.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == state[name].dtype, name
        scale = max(1.0, float(value.double().abs().max()))
        assert float((state[name].double() - value.double()).abs().max()) <= 1e-8 * scale, name


def metrics(run: Path) -> dict[str, float]:
    merged = {}
    for row in csv.DictReader((run / "metrics.csv").open()):
        merged.update({k: float(v) for k, v in row.items() if v})
    return merged


# ---- without Ray -------------------------------------------------------------------------------
def test_without_flower_engine_flower_says_how_to_install_it(tmp_path, monkeypatch):
    from workbench.cli import main

    monkeypatch.setitem(sys.modules, "flwr", None)  # as if the extra were not installed
    monkeypatch.delitem(sys.modules, "workbench.federation.flower", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[flower\]'"):
        main(["fit", *TINY, "--engine=flower", f"--run_dir={tmp_path}"])


def test_methods_that_change_the_round_are_refused_with_the_supported_list(tmp_path):
    flower = pytest.importorskip("workbench.federation.flower")
    assert {"AFL", "DeepAFL", "GHOFL", "SAFLe"} <= set(flower.supported_methods())
    assert not {"FedAvg", "FedProx", "OSFED", "AnaPFL", "LocalOnly"} & set(flower.supported_methods())
    refusal = r"cannot run FedAvg: .*whole_round_batch.* It runs AFL.*engine: lightning"
    with pytest.raises(ValueError, match=refusal):
        flower.fit(quiet_trainer(FedAvg(), tmp_path), FedAvg(), three_clients())


def test_symmetric_uploads_travel_as_upper_triangles():
    flower = pytest.importorskip("workbench.federation.flower")
    x = torch.randn(50, 6, dtype=torch.float64)
    stacked = torch.stack([x.T @ x, 2 * x.T @ x])  # (2, 6, 6): a batch of symmetric matrices
    uploads = {"gram": x.T @ x, "moments": stacked, "cross": torch.randn(6, 3, dtype=torch.float64)}
    packed = flower.pack_symmetric(uploads, frozenset({"gram", "moments"}))
    assert packed["gram"].shape == (21,) and packed["moments"].shape == (2, 21)
    assert packed["cross"] is uploads["cross"]
    restored = flower.unpack_symmetric(packed, frozenset({"gram", "moments"}))
    for name, value in uploads.items():
        torch.testing.assert_close(restored[name], value, rtol=0, atol=1e-12)


def test_a_client_rebuilds_the_same_method_and_data_from_the_spec():
    flower = pytest.importorskip("workbench.federation.flower")
    method, data = DeepAFL(num_layers=2, hidden_dim=24, block_dim=16, seed=7), three_clients()
    spec = flower.RunSpec.from_record(flower.RunSpec.of(method, data).to_record())
    rebuilt, rebuilt_data = spec.build_method(), spec.build_data()
    assert type(rebuilt) is DeepAFL and dict(rebuilt.hparams_initial) == dict(method.hparams_initial)
    assert rebuilt_data.synthetic == data.synthetic  # a dataclass argument survives the JSON
    share = flower.client_share(spec, client_id=1, num_partitions=3)
    data.setup("fit")
    assert torch.equal(share.features, data.train_features[data.train_client_ids == 1])
    with pytest.raises(ValueError, match="num-partitions = 4 .* num_clients = 3"):
        flower.client_share(spec, client_id=1, num_partitions=4)


# ---- over a Flower simulation --------------------------------------------------------------------
@pytest.mark.flower
def test_afl_from_the_command_line_over_flower_equals_in_process(tmp_path, capsys):
    pytest.importorskip("flwr")
    from workbench.cli import main

    reference = main(["fit", *TINY, f"--run_dir={tmp_path / 'lightning'}"])
    cli = main(["fit", *TINY, "--engine=flower", f"--run_dir={tmp_path / 'flower'}"])
    assert_same_state(cli.model, reference.model)
    run = next((tmp_path / "flower").glob("*/version_0"))
    logged, expected = metrics(run), metrics(next((tmp_path / "lightning").glob("*/version_0")))
    for key in COMM:
        assert logged[key] == expected[key], key
    assert logged["comm/bytes_up"] == 3 * (32 * 33 // 2 + 32 * 10) * 8  # AFL's packed Gram + XᵀY, float64
    assert logged["test/acc"] == expected["test/acc"]
    # Flower carried exactly the packed uploads, plus a small header per array
    assert 0 < logged["flower/bytes_up"] - logged["comm/bytes_up"] <= 3 * 2 * NPY_HEADER_MAX
    assert (run / "model.ckpt").exists() and (run / "flower" / "ray").is_dir()
    assert "Flower carried" in capsys.readouterr().out
    tested = main(["test", *TINY, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={run / 'model.ckpt'}"])
    assert float(tested.trainer.callback_metrics["test/acc"]) == pytest.approx(expected["test/acc"])


@pytest.mark.flower
def test_deepafl_over_flower_equals_in_process(tmp_path):
    flower = pytest.importorskip("workbench.federation.flower")

    def deepafl() -> DeepAFL:
        return DeepAFL(num_layers=2, hidden_dim=24, block_dim=16)

    reference = deepafl()
    quiet_trainer(reference, tmp_path / "lightning").fit(reference, datamodule=three_clients())
    method = deepafl()
    trainer = quiet_trainer(method, tmp_path / "flower")
    traffic = flower.fit(trainer, method, three_clients())

    assert method.round == reference.round == 5  # 2T + 1 rounds
    assert_same_state(method, reference)
    for key in COMM:
        assert method.fit_metrics[key] == reference.fit_metrics[key], key
    assert method.depth_accuracy == reference.depth_accuracy  # Lightning's epoch hooks ran on the server
    arrays_up = 5 * 3 * 2  # rounds × clients × uploads
    assert 0 < traffic.bytes_up - reference.fit_metrics["comm/bytes_up"] <= arrays_up * NPY_HEADER_MAX
    assert traffic.bytes_down > 0 and traffic.client_compute_s > 0
    assert float(trainer.callback_metrics["flower/bytes_up"]) == traffic.bytes_up
    assert "client_step" not in method.__dict__  # the server's method is itself again
