"""The command line end to end on tiny synthetic data."""
from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT, last_run, metrics
from workbench.cli import main
from workbench.federation import Federation

TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false"]


def test_fit_logs_accuracy_bytes_and_time_and_reruns_into_the_same_folder(tmp_path, capsys):
    for _ in range(2):
        main(["fit", *TINY, f"--run_dir={tmp_path}"])
    runs = sorted(tmp_path.glob("*/version_*"))
    assert [r.name for r in runs] == ["version_0", "version_1"]
    logged = metrics(runs[-1])
    assert logged["test/acc"] > 0.95
    assert logged["comm/rounds"] == 1
    assert logged["comm/bytes_up"] == 10 * (32 * 33 // 2 + 32 * 10) * 8
    assert logged["time/fit_s"] > 0
    assert (runs[-1] / "config.yaml").exists() and (runs[-1] / "model.ckpt").exists()
    assert (runs[-1] / "last.ckpt").exists()  # written after every round (`--checkpoint_every_round`)
    out = capsys.readouterr().out
    assert "test accuracy" in out and str(runs[-1]) in out


def test_the_summary_shows_the_protocol_in_its_order_and_what_the_screen_rejected(tmp_path, capsys):
    main(["fit", *TINY, f"--run_dir={tmp_path}", "--federation.dropout=0.2", "--federation.adversary_fraction=0.1",
          "--federation.attack=scale", "--federation.attack_scale=-10", "--federation.aggregation=screen"])
    out = capsys.readouterr().out
    assert ("protocol          0.2 of the clients drop out → 0.1 of the clients lie (scale × -10) → screen (τ = 4)"
            in out)
    federation = Federation(dropout=0.2, adversary_fraction=0.1)
    lying = int((federation.adversaries(10) & ~federation.dropped_clients(0, 10)).sum())  # the liar, if it sent
    assert metrics(last_run(tmp_path))["screen/rejected_total"] == lying
    assert f"screen            {lying} uploads rejected, from {lying} clients" in out


def test_model_and_data_settings_are_logged_apart_even_when_they_share_a_key(tmp_path):
    # DeepAFL and the data module both take `seed`; different values are a normal experiment.
    main(["fit", *TINY, "--model=DeepAFL", "--model.num_layers=1", "--model.hidden_dim=16",
          "--model.block_dim=16", "--model.seed=3", f"--run_dir={tmp_path}"])
    hparams = yaml.safe_load((last_run(tmp_path) / "hparams.yaml").read_text())
    assert hparams["model"]["seed"] == 3 and hparams["data"]["seed"] == 0
    assert hparams["model"]["class"] == "DeepAFL" and hparams["data"]["num_clients"] == 10


def test_test_subcommand_reloads_a_fitted_checkpoint(tmp_path):
    main(["fit", *TINY, f"--run_dir={tmp_path}"])
    fitted = last_run(tmp_path)
    cli = main(["test", *TINY, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={fitted / 'model.ckpt'}"])
    assert cli.trainer.callback_metrics["test/acc"] == pytest.approx(metrics(fitted)["test/acc"])


def test_validate_uses_the_held_out_split(tmp_path):
    cli = main(["fit", *TINY, f"--run_dir={tmp_path}", "--data.val_fraction=0.1"])
    assert len(cli.datamodule.val_labels) == 200  # 10% of each class of 2000
    assert metrics(last_run(tmp_path))["val/acc"] > 0.9


def test_short_class_names_and_overrides(tmp_path):
    cli = main(["fit", "--model=AFL", "--model.gamma_out=0.5", "--data=FederatedDataModule",
                "--data.dataset=synthetic", "--data.num_clients=5", "--data.partition=iid",
                "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}"])
    assert cli.method.gamma_out == 0.5 and cli.datamodule.num_clients == 5
    assert cli.method.fitted and cli.model.method is cli.method  # the engine runs the configured method


def test_print_config_round_trips(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", *TINY, "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "workbench.methods.AFL"
    assert printed["data"]["init_args"]["partition"] == "dirichlet"
    config = tmp_path / "printed.yaml"
    config.write_text(yaml.safe_dump(printed))
    main(["fit", f"--config={config}", f"--run_dir={tmp_path}", "--trainer.enable_progress_bar=false"])


def test_unknown_key_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["fit", *TINY, "--data.num_clientz=3"])
    assert "num_clientz" in capsys.readouterr().err


def test_unknown_method_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["fit", *TINY, "--model=NoSuchMethod"])
    assert "NoSuchMethod" in capsys.readouterr().err


def test_impossible_partition_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="alpha must be > 0"):
        main(["fit", *TINY, "--data.alpha=0", f"--run_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"num_partitions|samples"):
        main(["fit", *TINY, "--data.num_clients=5000", "--data.partition=iid", f"--run_dir={tmp_path}"])


def test_validate_without_a_validation_split_says_how_to_get_one(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        main(["validate", *TINY, f"--run_dir={tmp_path}"])


def test_a_run_is_named_by_its_method_data_and_partition_without_stray_characters():
    from workbench.data import FederatedDataModule
    from workbench.methods import AFL
    from workbench.runlog import default_run_name

    data = FederatedDataModule(dataset="synthetic", num_clients=4, partition="dirichlet", alpha=0.5)
    assert default_run_name(AFL(), data) == "afl-synthetic-dirichlet_alpha=0.5-k4"
    data = FederatedDataModule(dataset="synthetic", num_clients=4, partition="iid")
    assert default_run_name(AFL(), data) == "afl-synthetic-iid-k4"


def test_resuming_removes_what_a_killed_checkpoint_write_left_in_the_interrupted_folder(tmp_path):
    import subprocess
    import sys

    from workbench.experiment import newest_last_checkpoint
    from workbench.files import _HOST

    version = tmp_path / "run" / "version_0"
    version.mkdir(parents=True)
    (version / "last.ckpt").write_bytes(b"round 2")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = version / f".last.ckpt.{_HOST}.{int(dead.stdout)}.tmp"  # its writer has exited
    left.write_bytes(b"half of round 3")
    assert newest_last_checkpoint(tmp_path / "run") == version / "last.ckpt"
    assert not left.exists() and (version / "last.ckpt").read_bytes() == b"round 2"
