"""The built site's home page opens in Chromium: its heading, its nav and the dashboard's picture
are there, a menu link clicked from file:// lands on its page, and nothing is fetched from the
network. The screenshot is kept as an artifact
($WORKBENCH_TEST_ARTIFACTS, else the test's temporary folder)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.chromium import BROWSER_TESTS, check_page

pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
pytest.importorskip("material", reason="pip install -e '.[docs]'")

CHECK = Path(__file__).with_name("site_check.cjs")

pytestmark = BROWSER_TESTS


def test_the_home_page_opens_in_chromium(tmp_path):
    from tests.docs.test_mkdocs_build import build_site

    site = tmp_path / "site"
    build_site(site)
    seen = check_page(CHECK, site / "index.html", "docs_home.png", tmp_path)
    assert seen["heading"].startswith("workbench") and "workbench" in seen["title"]
    assert {"Install", "Benchmarks", "Changelog"} <= set(seen["nav"]), seen["nav"]
    assert seen["image"][0] and seen["image"][1] > 0  # the dashboard's picture loaded
    # from file:// a menu link lands on its page (a directory URL would open a listing there)
    assert seen["clicked_url"].endswith("/install.html"), seen["clicked_url"]
    assert seen["clicked_heading"] and seen["clicked_heading"].startswith("Install"), seen["clicked_heading"]
