"""W&B under a sweep agent, simulated: the agent's variables, W&B offline, one real fit.

The offline run is read back from its `run-<id>.wandb` file: W&B writes it in LevelDB's log format
(32 KiB blocks of checksummed chunks after a 7-byte `:W&B` header), one protobuf Record each."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from workbench.__main__ import main
from workbench.report import read_metrics
from workbench.runlog import PARAMS_ENV, _wandb_mode
from workbench.sync import offline_runs

BLOCK, HEADER = 32768, 7
FULL, LAST = 1, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        pending += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wait_until_written(path: Path, timeout_s: float = 60.0) -> None:
    """W&B's writer is a process of its own: `wandb.finish()` may return before it has written
    the run's last records; the exit record comes last."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(record.WhichOneof("record_type") == "exit" for record in records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def read_run(path: Path) -> tuple[dict, dict, object]:
    """(config, summary, the run record) of an offline run's `.wandb` file. Config and summary
    updates come as records of their own or, made before the run record was written, inside it."""
    config, summary, run = {}, {}, None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        updates = {"config": run.config if kind == "run" else record.config,
                   "summary": run.summary if kind == "run" else record.summary}
        if kind in ("run", "config"):
            config.update({item.key: json.loads(item.value_json) for item in updates["config"].update})
        if kind in ("run", "summary"):
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in updates["summary"].update})
    return config, summary, run



@pytest.fixture(scope="module")
def agent_run(tmp_path_factory) -> Path:
    """A DeepAFL fit (three depths) as `wandb agent` would start it for one grid point."""
    root = tmp_path_factory.mktemp("agent")
    params = root / "sweep-params.yaml"  # the agent's file: {key: {value: v}}
    params.write_text(yaml.safe_dump({"model.num_layers": {"value": 2},
                                      "data.alpha": {"value": 0.3}}, sort_keys=False))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_SWEEP_ID", "sweep123")
        env.setenv("WANDB_SWEEP_PARAM_PATH", str(params))
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv(PARAMS_ENV, "")  # so that the run's copy of the file's path is removed after
        assert main(["fit", "--config", str(ROOT / "configs/synthetic_afl.yaml"), "--model=DeepAFL",
                     "--model.hidden_dim=32", "--model.block_dim=32", "--model.num_layers=2",
                     "--data.alpha=0.3", "--trainer.enable_progress_bar=false",
                     f"--run_dir={root / 'runs'}"]) == 0
        import wandb

        wandb.finish()  # in a CLI process the interpreter's exit does it
    for log in (root / "runs").glob("*/wandb/offline-run-*/run-*.wandb"):
        wait_until_written(log)
    return root / "runs"


def test_a_swept_run_is_named_by_its_values_and_its_config_holds_each_key_once(agent_run):
    (folder,) = agent_run.iterdir()
    assert folder.name.endswith(",num_layers=2,alpha=0.3")
    (log,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    config, summary, run = read_run(log)
    assert "data.alpha" not in config and "model.num_layers" not in config  # no flat copies
    assert config["data"]["alpha"] == 0.3 and config["model"]["num_layers"] == 2
    assert config["model"]["class"] == "DeepAFL" and config["engine"] == "lightning"
    assert config["sweep"] == "sweep123" and run.display_name == folder.name
    assert {"engine=lightning", "sweep=sweep123"} <= set(run.tags)
    version = folder / "version_0"
    assert config["run_folder"] == str(version.resolve())
    link = json.loads((version / "wandb.json").read_text())
    assert link["id"] == run.run_id and link["mode"] == "offline" and log.parent == Path(link["files"])
    # the summary keeps the best depth beside the last one, as the CSV log shows them
    rows = read_metrics(version / "metrics.csv")
    depths = {row["depth/depth"]: row["depth/test_acc"] for row in rows if "depth/test_acc" in row}
    assert len(depths) == 3
    assert summary["depth/test_acc.best"] == pytest.approx(max(depths.values()))
    assert summary["depth/test_acc.final"] == pytest.approx(depths[max(depths)])
    assert depths[summary["depth/test_acc.best_depth"]] == pytest.approx(max(depths.values()))
    wall = [row["time/wall_s"] for row in rows if "time/wall_s" in row]
    fit = [row["time/fit_s"] for row in rows if "time/fit_s" in row]
    assert wall and summary["time/wall_s"] == pytest.approx(wall[0]) and wall[0] > fit[-1]


def test_sync_finds_every_offline_run_below_the_folder(agent_run, capsys):
    (log,) = agent_run.glob("*/wandb/offline-run-*")
    assert offline_runs([agent_run.parent]) == [log]
    assert main(["sync", str(agent_run), "--dry_run"]) == 0
    assert f"1 offline runs: wandb sync {log}" in capsys.readouterr().out
    (log / f"run-{log.name.rsplit('-', 1)[-1]}.wandb.synced").touch()
    assert offline_runs([agent_run]) == [] and offline_runs([agent_run], include_synced=True) == [log]


def test_wandb_goes_online_when_a_server_or_key_is_configured(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_CONFIG_DIR", raising=False)
    assert _wandb_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine wandb.example.org\n  login user\n  password x\n")
    assert _wandb_mode("auto") == "offline"  # a login to a host W&B is not set to use
    (tmp_path / ".config" / "wandb").mkdir(parents=True)
    (tmp_path / ".config" / "wandb" / "settings").write_text(
        "[default]\nbase_url = https://wandb.example.org\n")
    assert _wandb_mode("auto") == "online"  # `wandb login --host https://wandb.example.org`
    (tmp_path / ".config" / "wandb" / "settings").unlink()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert _wandb_mode("auto") == "online"
    monkeypatch.delenv("WANDB_BASE_URL")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert _wandb_mode("auto") == "online"


def test_sync_without_credentials_says_how_to_log_in_before_listing_anything(agent_run, monkeypatch, tmp_path,
                                                                            capsys):
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert main(["sync", str(agent_run)]) == 2
    out, err = capsys.readouterr()
    assert "offline runs" not in out and "no W&B credentials here: run `wandb login`" in err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err
    assert main(["sync", str(agent_run), "--dry_run"]) == 0  # listing needs none
