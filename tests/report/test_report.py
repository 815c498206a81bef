"""The comparison dashboard on real run folders written by the CLI."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench.__main__ import main
from workbench.report import find_runs, read_metrics
from workbench.report.plots import pareto_front
from workbench.report.runs import Run, last_value, mean_std

TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
        "--wandb=disabled"]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Three synthetic AFL runs: two α at K = 10, and K = 20 on harder blobs (lower accuracy),
    named to sort first by path so that sorting by accuracy has to move it; a repeat of one with
    another data seed; FedAvg over three rounds with a validation hold-out (per-round accuracy);
    and what a sweep leaves of runs that did not finish: one refused before it started, one
    whose process died after claiming its version folder."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("b_alpha0.5_k10", ["--data.alpha=0.5"]),
                        ("c_alpha0.1_k10", ["--data.alpha=0.1"]),
                        ("d_alpha0.1_k10_seed1", ["--data.alpha=0.1", "--data.seed=1"]),
                        ("e_fedavg", ["--model=FedAvg", "--model.num_rounds=3",
                                      "--data.val_fraction=0.1"]),
                        ("a_alpha0.5_k20_hard", ["--data.alpha=0.5", "--data.num_clients=20",
                                                 "--data.synthetic.separation=1.5"])):
        main(["fit", *TINY, *extra, f"--run_dir={root}", f"--run_name={name}"])
    refused = root / "sweep" / "alpha=0"
    refused.mkdir(parents=True)
    (refused / "status.json").write_text(json.dumps({
        "status": "failed", "params": {"data.alpha": 0.0},
        "error": "cannot be built: ValueError: data.alpha must be > 0, got 0.0"}))
    died = root / "sweep" / "k=2000"
    (died / "version_0").mkdir(parents=True)
    (died / "status.json").write_text(json.dumps({
        "status": "failed", "params": {"data.num_clients": 2000},
        "error": "Traceback (most recent call last):\nerror: 2000 clients for 2000 samples"}))
    return root


@pytest.fixture(scope="module")
def report(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert main(["compare", str(run_dir), "--out", str(out)]) == 0
    return out


class TableRows(HTMLParser):
    """Headers and rows of the page's table: each row's data-run and its cells' attributes."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.headers: list[str] = []
        self.rows: list[tuple[str, list[dict]]] = []
        self._in_header = False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "data-run" in attrs:
            self.rows.append((attrs["data-run"], []))
        elif tag == "td" and self.rows:
            self.rows[-1][1].append(attrs)
        self._in_header = tag == "th"

    def handle_data(self, data):
        if self._in_header:
            self.headers.append(data)
            self._in_header = False


def rows_of(page: str, metric: str = "test/acc") -> list[tuple[str, float]]:
    """(run names, the metric's mean) of each table row, in the page's order."""
    table = TableRows(page)
    column = table.headers.index(metric)
    return [(name, float(cells[column]["data-value"])) for name, cells in table.rows]


FINISHED = ["a_alpha0.5_k20_hard/version_0", "b_alpha0.5_k10/version_0", "c_alpha0.1_k10/version_0",
            "d_alpha0.1_k10_seed1/version_0", "e_fedavg/version_0"]


def test_runs_are_found_once_whether_given_by_version_folder_or_any_parent(run_dir):
    version = next(run_dir.glob("c_alpha0.1_k10/version_*"))
    runs = find_runs([run_dir, version, run_dir / "c_alpha0.1_k10"])
    assert sorted(run.name for run in runs if run.status == "done") == FINISHED
    unfinished = {run.name: run for run in runs if run.status != "done"}
    assert sorted(unfinished) == ["sweep/alpha=0", "sweep/k=2000/version_0"]
    assert unfinished["sweep/alpha=0"].error.endswith("data.alpha must be > 0, got 0.0")
    assert unfinished["sweep/k=2000/version_0"].error == "error: 2000 clients for 2000 samples"  # last line
    low = next(run for run in runs if run.name.startswith("a_"))
    assert (low.method, low.dataset, low.backbone, low.engine) == ("AFL", "synthetic", "none", "in process")
    assert low.partition == "dirichlet" and low.protocol == "global"
    assert (low.alpha, low.num_clients) == (0.5, 20)
    assert low.value_of("data.synthetic.separation") == 1.5  # the CLI's short key form
    assert low.value_of("model.init_args.gamma") == 1.0
    assert low.final("comm/rounds") == 1
    assert low.final("time/wall_s") > low.final("time/fit_s") > 0  # end to end includes the fit
    assert low.final("test/acc") < 0.9 < min(r.final("test/acc") for r in runs
                                             if r is not low and r.method == "AFL")


def test_repeats_over_seeds_are_one_setting_and_the_pareto_front_keeps_the_undominated():
    assert mean_std([0.8, 0.9, math.nan]) == (pytest.approx(0.85), pytest.approx(0.0707107), 2)
    assert mean_std([]) == (pytest.approx(math.nan, nan_ok=True), pytest.approx(math.nan, nan_ok=True), 0)
    points = [(10, 0.5), (10, 0.7), (20, 0.6), (30, 0.9), (5, 0.4), (40, 0.9)]
    assert pareto_front(points) == [(5, 0.4), (10, 0.7), (30, 0.9)]


def test_no_runs_and_unknown_metric_or_group_are_clear_errors(tmp_path, run_dir, capsys):
    with pytest.raises(ValueError, match="no runs"):
        find_runs([tmp_path])
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "r"), "--metric", "test/accuracy"]) == 2
    assert "test/acc" in capsys.readouterr().err  # the metrics that do exist are listed
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "r"), "--group_by", "modle.gamma"]) == 2
    err = capsys.readouterr().err
    assert "'modle.gamma'" in err and "method, engine, protocol" in err and "model.gamma" in err
    assert not (tmp_path / "r").exists()


def test_page_holds_every_run_with_its_logged_numbers_and_every_figure_exists(report, run_dir):
    page = (report / "index.html").read_text()
    runs = {run.name: run for run in find_runs([run_dir])}
    rows = rows_of(page)
    assert sorted(name for names, _ in rows for name in names.split()) == FINISHED
    for names, accuracy in rows:  # the seed repeats are one row: their mean
        logged = [last_value(read_metrics(runs[name].path / "metrics.csv"), "test/acc")
                  for name in names.split()]
        assert accuracy == pytest.approx(sum(logged) / len(logged))
    repeat = next(names for names, _ in rows if len(names.split()) == 2)
    assert repeat == "c_alpha0.1_k10/version_0 d_alpha0.1_k10_seed1/version_0"
    assert re.search(r"± [0-9.]+ \(n=2\)", page)
    for name in ("sweep/alpha=0", "sweep/k=2000/version_0"):  # unfinished runs, with their errors
        assert f'data-unfinished="{name}"' in page
    assert "data.alpha must be &gt; 0, got 0.0" in page
    linked = re.findall(r'<a href="([^"]+\.png)">', page)
    assert set(linked) == {"accuracy_vs_bytes.png", "accuracy_vs_time.png", "accuracy_vs_alpha.png",
                           "round_accuracy_vs_bytes.png", "accuracy_curves.png"}
    for png in linked:
        assert (report / png).read_bytes().startswith(b"\x89PNG")
    assert page.count("data:image/png;base64,") == len(linked)  # self-contained
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere
    assert "No run logged per-client accuracies" in page
    headers = TableRows(page).headers
    assert {"engine", "protocol", "fit time (s)", "wall time (s)", "n"} <= set(headers)


def test_per_round_accuracy_is_paired_with_the_bytes_sent_by_that_round(run_dir):
    fedavg = next(run for run in find_runs([run_dir]) if run.name.startswith("e_fedavg"))
    metric, sent, accuracy = fedavg.round_points()
    assert metric == "round/test_acc" and len(sent) == 3 and sent == sorted(sent)
    assert sent[-1] == fedavg.final("comm/bytes_up_per_client") and sent[0] == pytest.approx(sent[-1] / 3)
    assert accuracy[-1] == fedavg.final("round/test_acc") == fedavg.final("test/acc")


def test_per_client_accuracies_get_their_figure_and_stale_figures_go(run_dir, tmp_path):
    run = next(run_dir.glob("b_alpha0.5_k10/version_*"))
    (run / "per_client_acc.csv").write_text("client,acc,num_test\n0,0.9,20\n1,0.7,25\n2,1.0,10\n")
    try:
        out = tmp_path / "report"
        main(["compare", str(run_dir), "--out", str(out), "--group_by", "K"])
        assert Run.load(run).per_client_acc == [0.9, 0.7, 1.0]
        assert (out / "per_client_accuracy.png").exists()
        assert "grouped by <code>K</code>" in (out / "index.html").read_text()
    finally:
        (run / "per_client_acc.csv").unlink()
    main(["compare", str(run_dir), "--out", str(out)])
    assert not (out / "per_client_accuracy.png").exists()


def test_depth_and_round_curves_are_read_from_the_per_step_rows(tmp_path):
    run = tmp_path / "deep" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(  # the layout CSVLogger writes: one row per logging call
        "comm/rounds,depth/depth,depth/test_acc,epoch,step,test/acc\n"
        "1.0,,,0,0,\n,0.0,0.80,,0,\n3.0,,,2,2,\n,1.0,0.85,,1,\n5.0,,,4,4,\n,2.0,0.87,,2,\n,,,5,5,0.87\n")
    assert Run.load(run).curve() == ("depth/test_acc", "depth", [0.0, 1.0, 2.0], [0.80, 0.85, 0.87])
    (run / "metrics.csv").write_text("epoch,step,val/acc\n0,0,0.5\n1,1,0.6\n2,2,0.7\n")
    assert Run.load(run).curve() == ("val/acc", "round", [1.0, 2.0, 3.0], [0.5, 0.6, 0.7])
    (run / "metrics.csv").write_text("epoch,step,val/acc,test/acc\n0,0,0.5,\n1,1,,0.6\n")
    assert Run.load(run).curve() is None  # a single point is no curve


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install)")
def test_page_renders_in_headless_chromium_without_console_errors(report, tmp_path):
    """The script sorts the table by accuracy (best first) and marks it data-ready; the page
    logs nothing to the console when it works."""
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--dump-dom", (report / "index.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert result.returncode == 0 and not console, console or result.stderr[-2000:]
    dom = result.stdout
    assert re.search(r'<table id="runs"[^>]*data-ready="1"', dom)
    accuracies = [accuracy for _, accuracy in rows_of(dom)]
    assert len(accuracies) == 4 and accuracies == sorted(accuracies, reverse=True)
    assert sorted(name for names, _ in rows_of(dom) for name in names.split()) == FINISHED
    assert dom.count("data-unfinished=") == 2
    written = rows_of((report / "index.html").read_text())
    assert [name for name, _ in rows_of(dom)] != [name for name, _ in written]  # the script sorted
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def test_a_running_sweep_run_whose_runner_died_is_listed_as_stopped(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    for name, pid in (("alive", os.getpid()), ("gone", gone.pid)):
        folder = tmp_path / name
        (folder / "version_0").mkdir(parents=True)
        (folder / "status.json").write_text(json.dumps({
            "status": "running", "runner": {"host": socket.gethostname(), "pid": pid}}))
    runs = {run.name: run for run in find_runs([tmp_path])}
    assert runs["alive/version_0"].status == "running"
    assert runs["gone/version_0"].status == "stopped"
    assert "runner ended" in runs["gone/version_0"].error


def test_engine_personalized_score_and_each_head_get_columns_of_their_own(tmp_path):
    """Hand-written run folders: a GH-OFL run over Flower with two heads, and a personalized
    AnaPFL run whose test/acc (its global branch) is not what it is ranked by here."""
    for name, method, extra, personalized, metrics in (
            ("ghofl", "GHOFL", "engine: flower\n", False,
             "epoch,step,test/acc,test/acc/lda,test/acc/qda\n0,0,0.91,0.91,0.95\n"),
            ("anapfl", "AnaPFL", "", True,
             "epoch,step,test/acc,test/acc_local_mean\n0,0,0.80,0.97\n")):
        run = tmp_path / name / "version_0"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(
            f"{extra}model:\n  class_path: workbench.methods.{method}\n"
            f"data:\n  init_args:\n    dataset: mnist5k\n    personalized: {str(personalized).lower()}\n")
        (run / "metrics.csv").write_text(metrics)
    out = tmp_path / "report"
    assert main(["compare", str(tmp_path), "--out", str(out), "--metric", "test/acc_local_mean"]) == 0
    table = TableRows((out / "index.html").read_text())
    assert {"test/acc_local_mean", "test/acc", "test/acc/lda", "test/acc/qda"} <= set(table.headers)
    qda = table.headers.index("test/acc/qda")
    cells = {name: cells[qda].get("data-value") for name, cells in table.rows}
    assert cells == {"ghofl/version_0": "0.95", "anapfl/version_0": ""}  # no head, no number
    page = (out / "index.html").read_text()
    assert re.search(r'data-value="0\.8">0\.8000 †</td>', page)  # AnaPFL's global branch, marked
    assert re.search(r'data-value="0\.91">0\.9100</td>', page)  # GH-OFL's, a global model
    runs = {run.method: run for run in find_runs([tmp_path])}
    assert (runs["GHOFL"].engine, runs["GHOFL"].protocol) == ("flower", "global")
    assert (runs["AnaPFL"].engine, runs["AnaPFL"].protocol) == ("in process", "personalized")
