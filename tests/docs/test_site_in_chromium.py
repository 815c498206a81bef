"""The built site's home page opens in Chromium: its heading, its nav and the dashboard's picture
are there, and nothing is fetched from the network. The screenshot is kept as an artifact
($WORKBENCH_TEST_ARTIFACTS, else the test's temporary folder)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.report.test_dashboard_in_chromium import ARTIFACTS_ENV, CHROMIUM, playwright_env

pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
pytest.importorskip("material", reason="pip install -e '.[docs]'")

CHECK = Path(__file__).with_name("site_check.cjs")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install chromium"),
    pytest.mark.skipif(playwright_env() is None, reason="needs node and npm playwright-core: npm install --prefix DIR "
                       "playwright-core, then NODE_PATH=DIR/node_modules (.ci/run does)"),
]


def test_the_home_page_opens_in_chromium(tmp_path):
    from tests.docs.test_mkdocs_build import build_site

    site = tmp_path / "site"
    build_site(site)
    out = Path(os.environ.get(ARTIFACTS_ENV) or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    screenshot = out / "docs_home.png"
    result = subprocess.run(["node", str(CHECK), str(site / "index.html"), str(screenshot)],
                            env=playwright_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["console_errors"] == [] and seen["requests"] == [], seen  # it opens offline
    assert seen["heading"].startswith("workbench") and "workbench" in seen["title"]
    assert {"Install", "Benchmarks", "Changelog"} <= set(seen["nav"]), seen["nav"]
    assert seen["image"][0] and seen["image"][1] > 0  # the dashboard's picture loaded
    assert screenshot.read_bytes().startswith(b"\x89PNG")
