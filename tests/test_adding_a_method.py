"""docs/adding-a-method.md's steps alone make a method the workbench runs: in a copy of the
package, one new file under `workbench/methods/`, its line in `workbench/methods/__init__.py` and
a config; nothing else is edited, and `list`, the command line's check and a fit all know it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, last_run, metrics

pytestmark = pytest.mark.subprocess

TOY = '''"""ToyAvg: FedAvg whose server takes a fraction c of the clients' mean update.

    w_{t+1} = w_t − c · (1/m) Σ_k Δw_k        (c = 1 is FedAvg)
"""
from __future__ import annotations

from workbench.methods.base import Metrics, Uploads
from workbench.methods.fedavg import FedAvg


class ToyAvg(FedAvg):
    """FedAvg with its server step scaled by c.

    Args:
        fraction: c > 0.
        **kwargs: FedAvg's arguments.
    """

    def __init__(self, fraction: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fraction = fraction

    def server_update(self, uploads: Uploads, num_clients: float) -> Metrics:
        self.apply_update(self.fraction * uploads["update"] / num_clients)
        return {}
'''

CONFIG = """model:
  class_path: {method}
  init_args: {{num_rounds: 3, architecture: mlp, hidden_dim: 16, seed: 0, local: {{lr: 0.1, batch_size: 32}}}}
data:
  class_path: FederatedDataModule
  init_args: {{dataset: synthetic, num_clients: 4, synthetic: {{num_classes: 3, dim: 8, train_size: 300,
               test_size: 100}}}}
wandb: disabled
"""


def test_a_method_added_by_the_guides_steps_alone_runs(tmp_path):
    shutil.copytree(ROOT / "workbench", tmp_path / "workbench", ignore=shutil.ignore_patterns("__pycache__"))
    # steps 1-5: the method's file
    (tmp_path / "workbench/methods/toy_avg.py").write_text(TOY)
    # step 6: its line in workbench/methods/__init__.py (the import and its name in __all__), a config
    init = tmp_path / "workbench/methods/__init__.py"
    text = init.read_text().replace('__all__ = ["AFL",', '__all__ = ["AFL", "ToyAvg",')
    init.write_text(text.replace("\n\n__all__", "\nfrom workbench.methods.toy_avg import ToyAvg\n\n__all__"))
    for method in ("ToyAvg", "FedAvg"):
        (tmp_path / f"{method}.yaml").write_text(CONFIG.format(method=method))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "WANDB_MODE": "disabled"}

    def workbench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    listed = workbench("list", "methods")
    assert listed.returncode == 0 and re.search(r"^\s*ToyAvg\s+FedAvg with its server step", listed.stdout, re.M), \
        listed.stdout + listed.stderr
    misspelled = workbench("fit", "--config", "FedAvg.yaml", "--model=ToyAvgg")  # the fast check knows it too
    assert misspelled.returncode == 2 and "did you mean 'ToyAvg'" in misspelled.stderr, misspelled.stderr
    finals = {}
    for method in ("ToyAvg", "FedAvg"):
        done = workbench("fit", "--config", f"{method}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        run = last_run(tmp_path / "runs")
        assert run.name == "version_0"
        finals[method] = metrics(run)["test/acc"]
    assert finals["ToyAvg"] == pytest.approx(finals["FedAvg"], abs=1e-12)  # c = 1 is FedAvg
