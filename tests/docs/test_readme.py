"""The README is a front page: short, its first two code blocks the ones `.ci/run` runs verbatim
(the install line with the demo, then the tests), and every link in it pointing at a file here."""
from __future__ import annotations

import re

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 200


def test_its_first_two_code_blocks_are_the_install_and_the_test_commands_ci_runs():
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", README, re.S)  # .ci/run's own extraction
    assert blocks[0].startswith("python3 -m venv .venv && .venv/bin/pip install torch==") and \
        blocks[0].rstrip().endswith(".venv/bin/python -m workbench fit --config configs/demo.yaml")
    assert blocks[1] == ".venv/bin/python -m pytest\n"
    first_runnable = README.find("<!-- runnable")
    assert first_runnable == -1 or first_runnable > README.find(blocks[1])  # CI runs them; the docs' test does not


def test_every_relative_link_points_at_a_file():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_every_benchmark_script_is_in_its_table():
    section = README[README.index("## Benchmarks"):README.index("## Documentation")]
    scripts = {path.name for path in (ROOT / "benchmarks").glob("*.py")}
    assert not {script for script in scripts if f"`{script}`" not in section}


def methods_table(text: str) -> list[str]:
    """The rows of the first table whose header begins `| method | `class_path` |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method | `class_path` |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_the_methods_table_is_the_docs_one_and_names_every_method():
    """Written twice (the front page and docs/methods/index.md), checked once: the same rows, and
    every method `--model` accepts (read from workbench/methods/__init__.py) in a `class_path` cell."""
    from workbench.command_line import METHODS

    table = methods_table(README)
    assert table == methods_table((ROOT / "docs/methods/index.md").read_text())
    named = {name for row in table[2:] for name in re.findall(r"`(\w+)`", row.split("|")[2])}
    assert set(METHODS) <= named, f"add a row (README.md and docs/methods/index.md) for {sorted(set(METHODS) - named)}"
