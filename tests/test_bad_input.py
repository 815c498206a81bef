"""Bad input is an error naming where it appeared, never a model fitted on it: NaN/inf features
(which split, how many rows, which clients), non-finite aggregated uploads (which upload, which
round), and a checkpoint of another method, settings, data shape or data settings."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from workbench.cli import main
from workbench.data.datamodule import SyntheticBlobs

DATA = ["--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=4",
        "--data.partition=iid", "--data.synthetic.train_size=240", "--data.synthetic.test_size=60",
        "--data.synthetic.dim=8", "--data.synthetic.num_classes=3",
        "--trainer.enable_progress_bar=false", "--wandb=disabled"]
METHODS = {
    "AFL": ["--model=AFL"],
    "DeepAFL": ["--model=DeepAFL", "--model.num_layers=1", "--model.hidden_dim=16", "--model.block_dim=16"],
    "FedAvg": ["--model=FedAvg", "--model.num_rounds=2", "--model.architecture=linear"],
}


def poisoned(split: str, rows: list[int], value: float = float("nan")):
    """SyntheticBlobs.generate with `value` in one feature of `rows` of the train or test split."""
    original = SyntheticBlobs.generate

    def generate(self):
        x_train, y_train, x_test, y_test = original(self)
        x = x_train if split == "train" else x_test
        x[rows, 3] = value
        return x_train, y_train, x_test, y_test

    return generate


@pytest.mark.parametrize("method", list(METHODS))
def test_a_nan_training_feature_is_an_error_naming_split_rows_and_client(method, monkeypatch, tmp_path):
    monkeypatch.setattr(SyntheticBlobs, "generate", poisoned("train", [5]))
    with pytest.raises(ValueError, match=r"1 training row of client \[\d\] holds NaN/inf features") as error:
        main(["fit", *METHODS[method], *DATA, f"--run_dir={tmp_path}"])
    assert "repair or drop" in str(error.value)
    assert not list(tmp_path.glob("*/version_*/model.ckpt")) and not list(tmp_path.glob("*/version_*/last.ckpt"))


def test_non_finite_test_features_and_several_clients_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(SyntheticBlobs, "generate", poisoned("test", [0, 7], float("inf")))
    with pytest.raises(ValueError, match="2 test rows hold NaN/inf"):
        main(["fit", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path}"])
    monkeypatch.setattr(SyntheticBlobs, "generate", poisoned("train", list(range(240))))
    with pytest.raises(ValueError, match=r"240 training rows of clients \[0, 1, 2, 3\]"):
        main(["fit", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path}"])


@pytest.mark.subprocess
def test_the_command_exits_non_zero_on_a_nan_feature(tmp_path):
    script = ("import sys; from tests.test_bad_input import poisoned; from workbench.data.datamodule import "
              "SyntheticBlobs; SyntheticBlobs.generate = poisoned('train', [5]); from workbench.__main__ import main; "
              "sys.argv[0] = 'workbench'; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", script, "fit", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path}"],
                          cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0
    assert "training row of client" in done.stderr and "NaN/inf" in done.stderr
    assert not list(tmp_path.glob("*/version_*/model.ckpt"))


@pytest.mark.parametrize("method", ["AFL", "FedAvg"])
def test_a_non_finite_upload_stops_the_round_before_the_server_update(method, monkeypatch, tmp_path):
    from workbench.engines.local import LocalClients

    original = LocalClients.update

    def update(self, *args, **kwargs):
        replies = original(self, *args, **kwargs)
        name = sorted(replies.uploads)[0]
        replies.uploads[name] = replies.uploads[name].clone().fill_(float("nan"))
        self.poisoned = name
        return replies

    monkeypatch.setattr(LocalClients, "update", update)
    with pytest.raises(FloatingPointError, match=r"round 0: .*aggregated upload '\w+' holds \d+ non-finite"):
        main(["fit", *METHODS[method], *DATA, f"--run_dir={tmp_path}"])
    assert not list(tmp_path.glob("*/version_*/model.ckpt"))


def test_a_checkpoint_of_another_method_or_settings_is_refused(tmp_path):
    main(["fit", "--model=SAFLe", *DATA, f"--run_dir={tmp_path / 'safle'}"])
    safle = next((tmp_path / "safle").glob("*/version_0/model.ckpt"))
    with pytest.raises(ValueError, match=r"holds a workbench.methods.safle.SAFLe model but the config asks for "
                                         r"workbench.methods.afl.AFL: pass that run's config"):
        main(["test", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={safle}"])
    main(["fit", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path / 'afl'}"])
    afl = next((tmp_path / "afl").glob("*/version_0/model.ckpt"))
    with pytest.raises(ValueError, match=r"model.gamma: checkpoint 1.0, config 2.0\): pass the config"):
        main(["test", *METHODS["AFL"], "--model.gamma=2.0", *DATA, f"--run_dir={tmp_path / 'eval'}",
              f"--ckpt_path={afl}"])
    with pytest.raises(ValueError, match="data input_shape: checkpoint \\[8\\], config \\[6\\]"):
        main(["test", *METHODS["AFL"], *DATA, "--data.synthetic.dim=6", f"--run_dir={tmp_path / 'eval'}",
              f"--ckpt_path={afl}"])
    tested = main(["test", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={afl}"])
    assert float(tested.trainer.callback_metrics["test/acc"]) > 0.5


def test_a_checkpoint_made_on_other_data_is_refused_unless_asked(tmp_path):
    main(["fit", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path / 'afl'}"])
    afl = next((tmp_path / "afl").glob("*/version_0/model.ckpt"))
    test = ["test", *METHODS["AFL"], *DATA, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={afl}"]
    with pytest.raises(ValueError, match=r"\(data.partition: checkpoint 'iid', config 'dirichlet'; data.seed: "
                                         r"checkpoint 0, config 7\): pass the config .*\(--other_data=true loads it"):
        main([*test, "--data.partition=dirichlet", "--data.seed=7"])
    assert not (tmp_path / "eval").exists()  # refused before any run folder
    with pytest.raises(ValueError, match=r"\(data.synthetic.seed: checkpoint 0, config 3; data.val_fraction: "
                                         r"checkpoint 0.0, config 0.2\)"):
        main([*test, "--data.synthetic.seed=3", "--data.val_fraction=0.2"])
    main([*test, "--data.extract_batch_size=7", "--data.batch_size=16"])  # where and how fast: the same data
    other = main([*test, "--data.seed=7", "--other_data=true"])  # on purpose
    assert float(other.trainer.callback_metrics["test/acc"]) > 0.5


@pytest.mark.subprocess
def test_a_resumed_fit_under_another_protocol_is_refused(tmp_path):
    from workbench.experiment import SIGNAL_AFTER_ROUND_ENV

    env = {**os.environ, "WANDB_MODE": "disabled", SIGNAL_AFTER_ROUND_ENV: "1"}
    args = [sys.executable, "-m", "workbench", "fit", *METHODS["FedAvg"], *DATA, f"--run_dir={tmp_path}",
            "--run_name=run"]
    stopped = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    with pytest.raises(ValueError, match=r"federation.dropout: checkpoint 0.0, config 0.5"):
        main(["fit", *METHODS["FedAvg"], *DATA, f"--run_dir={tmp_path}", "--run_name=run",
              "--federation.dropout=0.5", "--ckpt_path=last"])
    with pytest.raises(ValueError, match=r"data.num_clients: checkpoint 4, config 5; data.seed: checkpoint 0, "
                                         r"config 7"):  # rounds on one partition, then on another: refused
        main(["fit", *METHODS["FedAvg"], *DATA, f"--run_dir={tmp_path}", "--run_name=run",
              "--data.num_clients=5", "--data.seed=7", "--ckpt_path=last"])


def test_a_full_disk_is_one_line_naming_the_folder_with_the_last_checkpoint_intact(tmp_path, monkeypatch, capsys):
    import tempfile

    import torch

    from workbench.__main__ import main as command

    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))  # where Lightning's own writer staged a copy
    save, writes = torch.save, []

    def save_until_full(obj, f, *args, **kwargs):
        writes.append(f)
        if len(writes) > 1 and str(f).endswith(".tmp"):  # the second round's checkpoint: the disk is full
            Path(f).write_bytes(b"\0" * 1000)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    status = command(["fit", *METHODS["FedAvg"], "--model.num_rounds=3", *DATA, f"--run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    (version,) = (tmp_path / "runs").glob("*/version_0")
    assert f"error: no room for last.ckpt in {version} (" in err and "the previous last.ckpt is intact" in err
    monkeypatch.setattr(torch, "save", save)
    kept = torch.load(version / "last.ckpt", weights_only=False)  # round 1's, whole
    assert kept["workbench"]["totals"]["bytes_up"] > 0
    assert sorted(path.name for path in version.iterdir()) == ["config.yaml", "hparams.yaml", "last.ckpt",
                                                               "metrics.csv", "status.json"]  # no temporary left
    assert not list(system_temp.iterdir())


def test_a_trainer_limited_to_fewer_epochs_than_the_rounds_is_refused_and_none_is_needed(tmp_path):
    """One epoch is one round: the engine sets the Trainer's epochs from the method's rounds, and
    a limit below them (once an unfitted model without a word) is one line, before any run folder."""
    from lightning import Trainer

    from workbench.data import FederatedDataModule
    from workbench.engines import LightningEngine
    from workbench.methods import FedAvg

    with pytest.raises(ValueError, match=r"^trainer.max_epochs=1 stops the fit before the method's 2 rounds"):
        main(["fit", *METHODS["FedAvg"], *DATA, "--trainer.max_epochs=1", f"--run_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())
    dm = FederatedDataModule(dataset="synthetic", num_clients=4, partition="iid")
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False}
    with pytest.raises(ValueError, match=r"trainer.max_epochs=2 stops the fit before the method's 3 rounds"):
        Trainer(max_epochs=2, **quiet).fit(LightningEngine(FedAvg(num_rounds=3)), datamodule=dm)
    method = FedAvg(num_rounds=3)
    trainer = Trainer(**quiet)
    with warnings.catch_warnings(record=True) as seen:  # (the filters as a user's process has them)
        trainer.fit(LightningEngine(method), datamodule=dm)
    assert method.fitted and method.round == 3 and trainer.current_epoch == 3
    assert not [w for w in seen if "max_epochs" in str(w.message)]  # no "Setting it to 1000 epochs"


def test_a_fit_resumed_under_another_engine_is_one_line_before_any_run_folder(tmp_path):
    """The clients' state lives in this process (`client_half.*` in the checkpoint) or on the
    Flower nodes (none in it): a resume under the other engine is refused, either way, before a
    run folder (or a Ray session) exists."""
    from workbench.engines.lightning import check_checkpoint_matches

    main(["fit", *METHODS["FedAvg"], *DATA, f"--run_dir={tmp_path}", "--run_name=run"])
    checkpoint = next((tmp_path / "run").glob("version_0/model.ckpt"))
    with pytest.raises(ValueError, match=r"^the checkpoint is of a fit whose clients ran under --engine lightning, "
                                         r"and their state does not carry over to --engine flower: resume it with "
                                         r"--engine lightning"):
        main(["fit", *METHODS["FedAvg"], *DATA, f"--run_dir={tmp_path}", "--run_name=run", "--engine=flower",
              f"--ckpt_path={checkpoint}"])
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]
    saved = torch.load(checkpoint, weights_only=False)["workbench"]
    with pytest.raises(ValueError, match=r"under --engine flower, .* resume it with --engine flower"):
        check_checkpoint_matches({**saved, "engine": "flower"}, saved, resuming=True)
    check_checkpoint_matches({**saved, "engine": "flower"}, saved, resuming=False)  # tested anywhere


@pytest.mark.parametrize("method", ["FedAvg", "Ditto"])
def test_a_checkpoint_of_a_fit_over_flower_is_tested_here_unless_its_models_were_the_clients(method, tmp_path):
    """A Flower fit's checkpoint holds no client state (it stayed on the nodes): its global model
    is tested in this process; a personalized method's models were the clients' own: one line."""
    args = {"FedAvg": METHODS["FedAvg"], "Ditto": ["--model=Ditto", "--model.num_rounds=2"]}[method]
    main(["fit", *args, *DATA, f"--run_dir={tmp_path}", "--run_name=here"])
    here = torch.load(next((tmp_path / "here").glob("version_0/model.ckpt")), weights_only=False)
    assert any(name.startswith("client_half.") for name in here["state_dict"])
    over_flower = {**here, "state_dict": {name: value for name, value in here["state_dict"].items()
                                          if not name.startswith("client_half.")},
                   "workbench": {**here["workbench"], "engine": "flower"}}
    torch.save(over_flower, tmp_path / "flower.ckpt")
    test = ["test", *args, *DATA, f"--run_dir={tmp_path}", f"--ckpt_path={tmp_path / 'flower.ckpt'}"]
    if method == "Ditto":
        with pytest.raises(ValueError, match=r"^the checkpoint is of a Ditto fit over Flower: its clients' personal "
                                             r"models stayed on the nodes, so it cannot be tested here"):
            main(test)
        return
    tested = main(test)
    reference = main(["test", *args, *DATA, f"--run_dir={tmp_path}",
                      f"--ckpt_path={next((tmp_path / 'here').glob('version_0/model.ckpt'))}"])
    assert tested.trainer.callback_metrics["test/acc"] == reference.trainer.callback_metrics["test/acc"]
