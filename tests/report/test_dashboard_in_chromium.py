"""The comparison page in a real browser: Playwright (npm `playwright-core`) driving Debian's
Chromium opens the page built from the run folder of every kind (`conftest.py`) and uses it."""
from __future__ import annotations

from pathlib import Path

from tests.chromium import BROWSER_TESTS, check_page
from workbench.report import find_runs

CHECK = Path(__file__).with_name("dashboard_check.cjs")

pytestmark = BROWSER_TESTS


def test_the_page_works_in_chromium(report, run_dir, tmp_path):
    seen = check_page(CHECK, report / "index.html", "dashboard.png", tmp_path)
    done = sorted(run.name for run in find_runs([run_dir]) if run.status == "done")
    assert sorted(name for row in seen["rows"] for name in row.split()) == done  # every run, once
    assert seen["table_fits"], seen["table_widths"]  # at 1400 px, no column off-screen (table, room)
    assert [name for row in seen["rows_without_fedavg"] for name in row.split()] == [
        name for row in seen["rows"] for name in row.split() if "fedavg" not in name]  # the filter hid FedAvg's
    # the α figure: a label at each α run (no bare minor digits), its axis around AFL's flat 0.998
    assert seen["alpha_ticks"] == ["0.1", "0.5"], seen["alpha_ticks"]
    assert 0.9 < seen["alpha_range"][0] < 0.998 < seen["alpha_range"][1] < 1.1, seen["alpha_range"]
    assert seen["alpha_title"].startswith("accuracy against the Dirichlet α")  # the tutorial's name for it
    assert seen["toolbar_overlaps"] == []  # no figure's toolbar covers its title
    assert {"rounds", "MB up / client", "fit s", "test/acc"} <= set(seen["parallel_axes"]), seen["parallel_axes"]
    # one-round methods' single points (AFL, GH-OFL at round 1) are open markers: neither hides the other
    assert len(seen["single_point_symbols"]) >= 2 and all(s.endswith("-open") for s in seen["single_point_symbols"])
    halo = {text: (order, width) for text, order, width in seen["parallel_tick_halo"]}
    assert halo["in process"] == ("stroke", "4px"), halo  # legible over the lines it sits on
    labels = seen["toggle_labels"]
    assert "test/acc/lda (one run)" in labels and "model.gamma" not in " ".join(labels)  # one run has it; constant
    assert {"partition", "K", "dataset"} <= set(labels)  # they vary: no "(same)"
    down = "comm/bytes_down_per_client"
    assert down not in seen["headers"] and down in seen["headers_toggled"]
    assert "engine" in seen["headers"] and "engine" not in seen["headers_toggled"]
    # a header's sort keeps each group of comparable runs together, and bytes go fewest (best) first
    groups = [group for group, _ in seen["sorted_bytes"]]
    assert groups == sorted(groups, key=seen["group_order"].index) and len(set(groups)) > 1
    for group in set(groups):
        values = [value for g, value in seen["sorted_bytes"] if g == group and value == value]  # NaN: no bytes
        assert values == sorted(values), (group, values)
    assert "version_0" in seen["hover"] and "test/acc 0." in seen["hover"] and "kB" in seen["hover"]
    assert seen["personal_axis"] == "test/acc_local_mean"  # a personalized group's figure: the clients' score
    assert dict(seen["figures"])["fig-final"] == "plot" and dict(seen["figures"])["fig-rounds"] == "plot"
    assert dict(seen["figures"])["fig-latency"] == "plot"  # the FedAvg runs' simulated clock
