"""Every shell block marked `<!-- runnable -->` in the README and under docs/ runs as shown.

The blocks run in order, page after page, in one temporary folder that holds copies of `configs/`,
`sweeps/` and `benchmarks/` and a `.venv` pointing at this interpreter's environment, under a
home folder of its own (so the feature cache, `runs/` and `report/` stay in the temporary folder):
a block may use what an earlier block of its page made. A block that repeats an earlier one word
for word runs once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs.conftest import runnable_blocks

BLOCKS = runnable_blocks()
#: each distinct block once, at its first place
UNIQUE = [block for i, block in enumerate(BLOCKS) if block.code not in {b.code for b in BLOCKS[:i]}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("docs_blocks")
    work, home = root / "work", root / "home"
    work.mkdir()
    for folder in ("configs", "sweeps", "benchmarks"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__", "*.png", "*.csv"))
    (work / ".venv").symlink_to(Path(sys.prefix))
    cache = Path("~/.cache/workbench/features/mnist5k").expanduser()
    if cache.is_dir():  # the demo's features, already extracted here: read, never written
        shutil.copytree(cache, home / ".cache/workbench/features/mnist5k")
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("WORKBENCH_SKIPPED_TESTS", None)
    return work, env


def params() -> list:
    found = []
    for block in UNIQUE:
        marks = [pytest.mark.ray] if block.tier == "ray" else [pytest.mark.subprocess]
        found.append(pytest.param(block, id=block.name, marks=marks))
    return found


def test_the_readme_and_the_tutorial_have_runnable_blocks():
    pages = {block.page for block in BLOCKS}
    assert {"README.md", "docs/tutorial.md"} <= pages, pages


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", params())
def test_the_block_runs_as_shown(block, workdir):
    if block.tier == "ray":
        pytest.importorskip("flwr", reason="pip install -e '.[flower]'")
    work, env = workdir
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=work, env=env,
                            capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{block.code}\n" + \
        (result.stdout + result.stderr)[-4000:]
