"""Pages in a real browser: Playwright (npm `playwright-core`) driving Debian's Chromium, offline
(tests/offline_page.cjs). `check_page` runs a check script on a page and returns what it saw."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
#: where screenshots go (.ci/run sets it outside the repository; default: the test's tmp folder)
ARTIFACTS_ENV = "WORKBENCH_TEST_ARTIFACTS"


def playwright_env() -> dict[str, str] | None:
    """The environment under which node finds playwright-core (NODE_PATH), or None."""
    node = shutil.which("node")
    if node is None:
        return None
    env = dict(os.environ)
    found = subprocess.run([node, "-e", "require.resolve('playwright-core')"], env=env, capture_output=True)
    return env if found.returncode == 0 else None


#: the marks of a test module that opens pages: the browser tier, skipped where Chromium or
#: playwright-core is absent
BROWSER_TESTS = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install chromium"),
    pytest.mark.skipif(playwright_env() is None, reason="needs node and npm playwright-core: npm install --prefix DIR "
                       "playwright-core, then NODE_PATH=DIR/node_modules (.ci/run does)"),
]


def check_page(check: Path, page: Path, screenshot_name: str, tmp_path: Path) -> dict:
    """Runs `node check page screenshot` -> what the check saw; the screenshot is kept. The page
    fetched nothing from the network and raised no error (asserted here)."""
    out = Path(os.environ.get(ARTIFACTS_ENV) or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    screenshot = out / screenshot_name
    result = subprocess.run(["node", str(check), str(page), str(screenshot)],
                            env=playwright_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["console_errors"] == [] and seen["requests"] == [], seen  # offline, nothing failed
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    return seen
