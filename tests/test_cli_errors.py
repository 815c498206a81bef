"""The command line as a new user meets it: what it offers, and wrong input stopped early in a few
lines (what is wrong, the choices, the fix), before any Trainer, run folder, W&B run or
extraction exists. Driven through `python -m workbench`'s entry point, in process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench.__main__ import main
from workbench.command_line import METHODS
from workbench.console import COMMANDS

SYNTHETIC = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false"]
IMAGES = ["--config", str(ROOT / "configs/demo.yaml"), "--trainer.enable_progress_bar=false"]


def refused(capsys, run_dir: Path, *args: str) -> str:
    """Runs `fit` with `args`; asserts exit status 2, a short message with no traceback and
    nothing left in `run_dir`; returns the message."""
    status = main(["fit", *args, f"--run_dir={run_dir}", "--wandb=disabled"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3, err
    assert not run_dir.exists(), "a run folder was made before the input was checked"
    return err


@pytest.mark.parametrize("flag, message", [
    ("--data.num_clients=0", "data.num_clients must be ≥ 1, got 0"),
    ("--data.alpha=0", "data.alpha must be > 0"),
    ("--model.gamma=-1", "gamma and gamma_out must be ≥ 0"),
    ("--data.val_fraction=1.5", "data.val_fraction must be in [0, 1)"),
    ("--data.synthetic.dim=-4", "data.synthetic.dim must be ≥ 1, got -4"),
    ("--data.synthetic.num_classes=1", "data.synthetic.num_classes must be ≥ 2, got 1; a classifier needs"),
    ("--data.synthetic.num_classes=0", "data.synthetic.num_classes must be ≥ 2, got 0"),
    ("--data.synthetic.test_size=0", "data.synthetic.test_size must be ≥ 1, got 0"),
])
def test_a_constructor_check_is_one_line(flag, message, capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, flag)
    assert err.startswith(f"error: {message}") and "--debug" in err


def test_an_unknown_ghofl_head_names_the_heads(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model=GHOFL", "--model.heads=[lda,nope]")
    assert "heads must be distinct names among" in err and "'qda'" in err


def test_a_misspelled_method_lists_the_methods_and_the_closest(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model=AFLL")
    assert "unknown method 'AFLL'" in err and ", ".join(sorted(METHODS)) in err
    assert "did you mean 'AFL'" in err


def test_more_clients_than_the_data_can_hold_is_refused_in_its_own_words_before_any_run_folder(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", "--model=AFL", "--data=FederatedDataModule", "--data.dataset=synthetic",
                  "--data.num_clients=100", "--data.synthetic.train_size=300")
    assert ("error: data.min_partition_size=10 for each of 100 clients needs 1000 samples but there are 300; "
            "lower data.min_partition_size or data.num_clients") in err


@pytest.mark.parametrize("method", ["AFL", "SAFLe"])
def test_a_regularizer_too_large_for_secure_aggregation_is_refused_before_any_run_folder(method, capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, f"--model={method}", "--model.gamma=1e12",
                  "--federation.secure_aggregation=true")  # every client's Gram carries γ = 1e12 · 2^32 > 2^61 / K
    assert "could wrap around the 2^62 ring; lower federation.fixed_point_bits to at most" in err


def test_a_config_that_is_not_yaml_is_named_with_its_line(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  class_path: AFL\n  init_args: {gamma: [1,\n")
    err = refused(capsys, tmp_path / "runs", "--config", str(broken))
    assert f"error: {broken} is not valid YAML, line 4, column 1" in err and "<unicode string>" not in err


def test_a_method_named_in_the_wrong_case_gets_its_spelling(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model=Scaffold")
    assert "unknown method 'Scaffold'" in err and "did you mean 'SCAFFOLD'" in err


def test_a_setting_of_workbench_0_2_names_its_new_key(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model=FedAvg", "--model.lr=0.1")
    assert "FedAvg's settings moved in workbench 0.3: model.lr is now model.local.lr" in err


@pytest.mark.parametrize("given", ["--model.compression.kind=topk", "--model.compression=topk"])
def test_the_compression_given_to_the_method_names_its_place_in_the_protocol(capsys, tmp_path, given):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model=FedAvg", given)
    assert "model.compression is now federation.compression" in err, err


def test_a_config_in_the_flat_layout_has_every_moved_key_named(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  class_path: OSFED\n  init_args:\n    num_rounds: 2\n    lr: 0.1\n    local_epochs: 2\n"
                   "    grid_size: 3\n    error_feedback: false\n")
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--config", str(old))
    for old_key, new_key in (("lr", "local.lr"), ("local_epochs", "local.epochs"), ("grid_size", "snapshot.grid_size"),
                             ("error_feedback", "error_feedback.enabled")):
        assert f"model.{old_key} is now model.{new_key}" in err, err
    assert "num_rounds" not in err  # it did not move


def test_a_misspelled_setting_names_the_closest_and_the_settings(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *SYNTHETIC, "--model.gama=2")
    assert "AFL has no setting 'gama'; did you mean 'gamma'?" in err and "gamma_out" in err


def test_an_unknown_dataset_fails_before_the_trainer(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *IMAGES, "--data.dataset=cifar11")
    assert "unknown dataset 'cifar11'; choose one of:" in err and "fashion_mnist" in err and "synthetic" in err


def test_an_unknown_backbone_fails_before_the_trainer(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *IMAGES, "--data.backbone=resnet99")
    assert "unknown backbone 'resnet99'; choose one of: efficientnet_lite0 or any timm model name" in err


def test_a_text_backbone_for_images_names_the_image_backbones(capsys, tmp_path):
    err = refused(capsys, tmp_path / "runs", *IMAGES, "--data.backbone=all_minilm_l6_v2")
    assert "holds images but backbone 'all_minilm_l6_v2' is not a image backbone" in err


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write: /proc refuses even root, who ignores permission bits."""
    if os.geteuid() == 0:
        return Path("/proc/workbench-cache")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder


def test_a_read_only_cache_without_the_features_fails_before_the_trainer(capsys, tmp_path):
    cache = unwritable_folder(tmp_path)
    err = refused(capsys, tmp_path / "runs", *IMAGES, f"--data.cache_dir={cache}")
    assert "cannot be written" in err and "set data.cache_dir to a writable folder" in err


def test_debug_shows_the_traceback_instead(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_DEBUG", "")  # restored (unset) afterwards; --debug sets it
    with pytest.raises(ValueError, match="num_clients must be ≥ 1"):
        main(["fit", *SYNTHETIC, "--data.num_clients=0", f"--run_dir={tmp_path}", "--debug"])


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """Only this package's input checks are shortened: anything else is a bug and says where."""
    import workbench.cli

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(workbench.cli, "main", broken)
    with pytest.raises(ZeroDivisionError):
        main(["fit", *SYNTHETIC])


def test_help_lists_every_command_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    commands = ("fit", "validate", "test", "sweep", "bench", "compare", "sync", "list")
    for command in commands:
        assert f"\n  {command} " in out
    assert "predict" not in out and set(COMMANDS) == set(commands)
    assert main([]) == 2  # no command: the same list, and a failing status for scripts


def test_predict_and_unknown_commands_are_refused_with_the_list(capsys):
    assert main(["predict", *SYNTHETIC]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'predict'" in err and "compare" in err


@pytest.mark.subprocess
@pytest.mark.parametrize("args, shown", [(["--help"], "commands:"), (["fit", "--help"], "--model.help AFL")])
def test_help_starts_without_torch_or_lightning(args, shown):
    """`--help` and `fit --help` answer from `workbench.console` and `workbench.command_line` alone
    (the README gives the first's time; Lightning's full parser takes some 10 s to import)."""
    code = (f"import sys, workbench.__main__ as m; m.main({args!r}); "
            "heavy = [n for n in ('torch', 'lightning', 'jsonargparse') if n in sys.modules]; "
            "sys.exit(len(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert shown in done.stdout


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_a_commands_help_names_the_keys_and_where_each_list_is(command, capsys):
    assert main([command, "--config", "configs/demo.yaml", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m workbench {command} --config FILE")
    assert all(name in out for name in METHODS) and "--model.num_rounds" in out and "--data.alpha" in out
    for pointer in ("--model.help AFL", "--data.help FederatedDataModule", "--print_config", "--help=full"):
        assert f"python -m workbench {command} " in out and pointer in out
    assert len(out.splitlines()) < 30


def test_list_prints_methods_datasets_backbones_partitions_and_engines(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for section, entry in [("methods", "DeepAFL"), ("datasets", "fashion_mnist"), ("backbones", "efficientnet_lite0"),
                           ("partitions", "dirichlet"), ("engines", "flower")]:
        assert f"{section}:\n" in out and f"\n  {entry} " in out
    assert main(["list", "partitions"]) == 0
    assert capsys.readouterr().out.startswith("partitions:\n  iid")


def test_an_explicit_wandb_flag_beats_the_environment(monkeypatch):
    from workbench.runlog import _wandb_mode

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _wandb_mode("disabled") == "disabled"
    assert _wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.setenv("HOME", "/nonexistent")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert _wandb_mode("auto") == "offline"


def test_a_missing_checkpoint_fails_before_the_trainer(capsys, tmp_path):
    status = main(["test", *SYNTHETIC, f"--ckpt_path={tmp_path / 'nothere.ckpt'}", f"--run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert status == 2 and "no checkpoint at --ckpt_path=" in err and "model.ckpt" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.subprocess
def test_the_flower_engine_without_its_extra_is_the_install_hint_alone():
    import subprocess
    import sys

    hidden = "import sys; sys.modules['flwr'] = None; import workbench.engines.flower"  # as if not installed
    done = subprocess.run([sys.executable, "-c", hidden], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().endswith("the Flower engine needs Flower, an optional extra: pip install -e '.[flower]' "
                                        "(it installs flwr[simulation], which brings Ray)")
    for chained in ("During handling of the above exception", "The above exception was the direct cause",
                    "import of flwr halted"):  # the hint alone, whoever prints the traceback
        assert chained not in done.stderr, done.stderr


def test_a_python_without_the_install_says_to_use_the_venv(monkeypatch, capsys):
    """The system's Python run from the repository root imports the package but none of its
    dependencies: the error names the venv, not only the missing module."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails as if it were not installed
    for module in ("workbench.cli", "workbench.experiment"):  # imported again, each from its first line
        monkeypatch.delitem(sys.modules, module, raising=False)
    assert main(["fit", "--config", str(ROOT / "configs/demo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "torch" in err and "source .venv/bin/activate" in err and sys.executable in err
