"""The documentation site builds with `mkdocs build --strict`: a broken link or anchor, a page
outside the nav or a docstring the API pages cannot read fails it. The site goes to the test's
temporary folder, never to ./site."""
from __future__ import annotations

import shutil

import pytest

from tests.conftest import ROOT

pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
pytest.importorskip("material", reason="pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")

from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort


def build_site(site_dir, docs_dir=ROOT / "docs"):
    config = load_config(str(ROOT / "mkdocs.yml"), docs_dir=str(docs_dir), site_dir=str(site_dir), strict=True)
    build(config)


def test_the_site_builds_strictly(tmp_path):
    build_site(tmp_path / "site")
    home = (tmp_path / "site" / "index.html").read_text()
    assert "workbench" in home and "images/dashboard.png" in home
    afl = (tmp_path / "site" / "methods" / "afl.html").read_text()
    assert "regularization intermediary" in afl  # the module's docstring is the method's page
    assert "# Changelog" not in (tmp_path / "site" / "changelog.html").read_text()  # included, rendered


def test_a_broken_anchor_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "tutorial.md"
    page.write_text(page.read_text() + "\nSee [nowhere](install.md#no-such-section).\n")
    with pytest.raises(Abort, match="strict mode"):
        build_site(tmp_path / "site", docs)
