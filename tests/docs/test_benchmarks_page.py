"""The benchmarks page is generated: docs/benchmarks.md is what docs/gen_benchmarks.py writes from
its template and benchmarks/results/*.md, so no table on it can drift from its results file."""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("gen_benchmarks", ROOT / "docs" / "gen_benchmarks.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_the_committed_page_is_what_the_generator_writes():
    expected = gen.render(gen.TEMPLATE.read_text())
    assert gen.PAGE.read_text() == expected, "docs/benchmarks.md is out of date: run python docs/gen_benchmarks.py"


def test_every_table_of_a_cited_file_is_on_the_page_verbatim():
    page = gen.PAGE.read_text()
    cited = {m["file"] for line in gen.TEMPLATE.read_text().splitlines() if (m := gen.DIRECTIVE.match(line.strip()))}
    for name in sorted(cited):
        for block in gen.blocks((gen.RESULTS / name).read_text()):
            if block[0].startswith("|") and "tables=" not in "".join(
                    line for line in gen.TEMPLATE.read_text().splitlines() if f"results {name} " in line):
                assert "\n".join(block) in page, f"a table of {name} is missing from the page"


def test_every_results_file_is_on_the_page():
    page = gen.PAGE.read_text()
    for path in sorted([*gen.RESULTS.glob("*.md"), *gen.RESULTS.glob("leaderboard/*/leaderboard.md")]):
        name = path.relative_to(gen.RESULTS).as_posix()
        assert f"`benchmarks/results/{name}`" in page, name


def test_a_directive_takes_the_tables_asked_for_with_their_captions(tmp_path):
    (tmp_path / "x.md").write_text("# X\n\nintro\n\nFirst:\n\n| a |\n|---|\n| 1 |\n\nMachine: here\n\n"
                                   "## Part\n\n| b |\n|---|\n| 2 |\n")
    page = gen.render("# Page\n\n## Section\n\n<!-- results x.md tables=1 machine -->\n", tmp_path)
    assert "First:\n\n| a |\n|---|\n| 1 |\n\nMachine: here" in page and "| b |" not in page
    whole = gen.render("# Page\n\n## Section\n\n<!-- results x.md -->\n", tmp_path)
    assert "# X" not in whole and "### Part" in whole and "| b |" in whole  # the title dropped, headings moved


def test_a_results_file_the_template_does_not_name_goes_under_other_results(tmp_path):
    (tmp_path / "x.md").write_text("# X\n\n| a |\n|---|\n| 1 |\n")
    (tmp_path / "new.md").write_text("# A new benchmark\n\n| b |\n|---|\n| 2 |\n")
    page = gen.render("# Page\n\n<!-- results x.md -->\n", tmp_path)
    assert "## Other results" in page and "### A new benchmark" in page and "| b |" in page


def test_a_leaderboard_is_named_by_its_path_and_one_not_named_is_appended(tmp_path):
    for scenario in ("a", "b"):
        (tmp_path / "leaderboard" / scenario).mkdir(parents=True)
        (tmp_path / "leaderboard" / scenario / "leaderboard.md").write_text(
            f"# Leaderboard: {scenario}\n\nintro\n\n## K=10 iid\n\n| m |\n|---|\n| {scenario} |\n")
    page = gen.render("# Page\n\n## Board\n\n<!-- results leaderboard/a/leaderboard.md sections -->\n", tmp_path)
    assert "### K=10 iid\n\n| m |\n|---|\n| a |" in page and "intro" not in page.split("## Other")[0]
    assert "### Leaderboard: b" in page and "`benchmarks/results/leaderboard/b/leaderboard.md`" in page


def test_a_missing_results_file_or_table_is_an_error(tmp_path):
    (tmp_path / "x.md").write_text("| a |\n|---|\n| 1 |\n")
    with pytest.raises(SystemExit, match="does not exist"):
        gen.render("<!-- results gone.md -->\n", tmp_path)
    with pytest.raises(SystemExit, match="table 2"):
        gen.render("<!-- results x.md tables=2 -->\n", tmp_path)
