"""Cross-silo sites on a real Flower deployment on loopback (tier `deployment`): three SuperNodes,
each started with its own parquet file in its node config (`data-path`: different sizes, one
site lacking a class), and an AFL fit submitted whose config names no file: its model is that of
the fit in one process on the union of the files. (FedAvg over sites is checked against the same
union on the loopback grid, tests/engines/test_sites.py: a second deployed fit here would repeat it
at twice the time.)"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("flwr", reason="a Flower deployment needs the `flower` extra: pip install -e '.[flower]'")
pytest.importorskip("pyarrow", reason="parquet needs pyarrow: pip install -e '.[hf]'")

from workbench.engines.flower.local_deployment import BIN, LocalDeployment
from workbench.experiment import run

pytestmark = pytest.mark.deployment
SIZES, CLASSES = (31, 12, 47), ((0, 1, 2), (0, 1, 2), (0, 2))  # site 2 lacks class 1
AFL = ["--model=AFL", "--model.gamma=1.0", "--model.gamma_out=0.1"]


def site_files(folder) -> list[str]:
    paths = []
    for k, (n, classes) in enumerate(zip(SIZES, CLASSES, strict=True)):
        gen = np.random.default_rng(k)
        labels = gen.choice(classes, n)
        features = gen.normal(size=(n, 6)) + 2.0 * np.eye(3, 6)[labels]
        path = folder / f"site{k}" / "rows.parquet"  # each site a folder of its own
        path.parent.mkdir()
        pd.DataFrame({"features": list(features), "label": labels}).to_parquet(path)
        paths.append(str(path))
    return paths


def test_sites_holding_their_own_files_fit_the_model_of_their_union(tmp_path):
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flower-superlink is not in this venv: pip install -e '.[flower]'")
    paths = site_files(tmp_path)
    data = ["--data=SiteData", "--data.num_sites=3", "--data.num_classes=3", "--data.feature_column=features",
            "--wandb=disabled", "--trainer.enable_progress_bar=false"]
    federation = LocalDeployment(tmp_path / "flower", 3, isolation="process",
                                 env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
                                 node_config={k: {"data-path": path} for k, path in enumerate(paths)})
    try:
        submitted = federation.submit([*AFL, *data, f"--run_dir={tmp_path}", "--run_name=afl",
                                       "--flower.deadline_s=30"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _out, err = submitted.communicate(timeout=300)
        assert submitted.returncode == 0, err[-3000:]
        folder = tmp_path / "afl" / "version_0"
        saved = torch.load(folder / "model.ckpt", weights_only=False)
        for logged in ("hparams.yaml", "model.ckpt"):  # the server was never told where the sites' files are
            assert f"{tmp_path}/site".encode() not in (folder / logged).read_bytes(), logged
        here = run(["fit", *AFL, *data, f"--data.sites={paths}", f"--run_dir={tmp_path / 'here'}"]).method
        for key, value in here.state_dict().items():
            torch.testing.assert_close(saved["state_dict"][f"method.{key}"], value, rtol=0, atol=1e-6, msg=key)
    finally:
        stayed = federation.stop()
        print("\n".join(f"---- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(federation.logs.iterdir())))
    assert not stayed, f"outlived their SuperNodes: {stayed}"
