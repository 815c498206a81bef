"""The comparison page in a real browser: Playwright (npm `playwright-core`) driving Debian's
Chromium opens the page built from the run folder of every kind (`conftest.py`) and uses it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from workbench.report import find_runs

CHROMIUM = Path("/usr/bin/chromium")
CHECK = Path(__file__).with_name("dashboard_check.cjs")
#: where the screenshot goes (.ci/run sets it outside the repository; default: the test's tmp folder)
ARTIFACTS_ENV = "WORKBENCH_TEST_ARTIFACTS"


def playwright_env() -> dict[str, str] | None:
    """The environment under which node finds playwright-core (NODE_PATH), or None."""
    node = shutil.which("node")
    if node is None:
        return None
    env = dict(os.environ)
    found = subprocess.run([node, "-e", "require.resolve('playwright-core')"], env=env, capture_output=True)
    return env if found.returncode == 0 else None


pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install chromium"),
    pytest.mark.skipif(playwright_env() is None, reason="needs node and npm playwright-core: npm install --prefix DIR "
                       "playwright-core, then NODE_PATH=DIR/node_modules (.ci/run does)"),
]


def test_the_page_works_in_chromium(report, run_dir, tmp_path):
    out = Path(os.environ.get(ARTIFACTS_ENV) or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    screenshot = out / "dashboard.png"
    result = subprocess.run(["node", str(CHECK), str(report / "index.html"), str(screenshot)],
                            env=playwright_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["console_errors"] == [] and seen["requests"] == []  # nothing fetched, nothing failed
    done = sorted(run.name for run in find_runs([run_dir]) if run.status == "done")
    assert sorted(name for row in seen["rows"] for name in row.split()) == done  # every run, once
    assert seen["table_fits"], seen["table_widths"]  # at 1400 px, no column off-screen (table, room)
    assert [name for row in seen["rows_without_fedavg"] for name in row.split()] == [
        name for row in seen["rows"] for name in row.split() if "fedavg" not in name]  # the filter hid FedAvg's
    down = "comm/bytes_down_per_client"
    assert down not in seen["headers"] and down in seen["headers_toggled"]
    assert "engine" in seen["headers"] and "engine" not in seen["headers_toggled"]
    assert seen["sorted_bytes"] == sorted(seen["sorted_bytes"], reverse=True)
    assert "version_0" in seen["hover"] and "test/acc 0." in seen["hover"] and "kB" in seen["hover"]
    assert seen["personal_axis"] == "test/acc_local_mean"  # a personalized group's figure: the clients' score
    assert dict(seen["figures"])["fig-final"] == "plot" and dict(seen["figures"])["fig-rounds"] == "plot"
    assert screenshot.read_bytes().startswith(b"\x89PNG")
