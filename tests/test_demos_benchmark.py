"""benchmarks/demos.py: it finds every demo config, and a fit's row carries what its run folder says."""
from __future__ import annotations

import pytest

from benchmarks import demos


def test_every_demo_config_is_timed_the_readme_demo_first():
    names = [path.name for path in demos.demo_configs()]
    assert names[0] == "demo.yaml"
    assert set(names) == {path.name for path in demos.ROOT.glob("configs/*demo*.yaml")}


@pytest.mark.subprocess
def test_a_fit_row_reads_the_runs_metrics(tmp_path):
    out = tmp_path / "demos.md"
    demos.main(["--configs", str(demos.ROOT / "configs/synthetic_afl.yaml"), "--out", str(out)])
    row = next(line for line in out.read_text().splitlines() if line.startswith("| `configs/synthetic_afl.yaml`"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:3] == ["AFL", "1"]
    assert 50 < float(cells[3]) <= 100 and 0 <= float(cells[4]) <= float(cells[5])
    assert cells[6] == "yes"
