"""The comparison dashboard on real run folders written by the CLI."""
from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from workbench.__main__ import main
from workbench.report import find_runs, read_metrics
from workbench.report.runs import Run, last_value

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false"]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Three synthetic AFL runs: two α at K = 10, and K = 20 on harder blobs (lower accuracy),
    named to sort first by path so that sorting by accuracy has to move it."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("b_alpha0.5_k10", ["--data.alpha=0.5"]),
                        ("c_alpha0.1_k10", ["--data.alpha=0.1"]),
                        ("a_alpha0.5_k20_hard", ["--data.alpha=0.5", "--data.num_clients=20",
                                                 "--data.synthetic.separation=1.5"])):
        main(["fit", *TINY, *extra, f"--run_dir={root}", f"--run_name={name}"])
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


def rows_of(page: str) -> list[tuple[str, float]]:
    """(run name, test/acc) of each table row, in the page's order."""
    table = TableRows(page)
    column = table.headers.index("test/acc")
    return [(name, float(cells[column]["data-value"])) for name, cells in table.rows]


def test_runs_are_found_once_whether_given_by_version_folder_or_any_parent(run_dir):
    version = next(run_dir.glob("c_alpha0.1_k10/version_*"))
    runs = find_runs([run_dir, version, run_dir / "c_alpha0.1_k10"])
    assert sorted(run.name for run in runs) == [
        "a_alpha0.5_k20_hard/version_0", "b_alpha0.5_k10/version_0", "c_alpha0.1_k10/version_0"]
    low = next(run for run in runs if run.name.startswith("a_"))
    assert (low.method, low.dataset, low.backbone) == ("AFL", "synthetic", "none")
    assert low.partition == "dirichlet"
    assert (low.alpha, low.num_clients) == (0.5, 20)
    assert low.value_of("data.synthetic.separation") == 1.5  # the CLI's short key form
    assert low.value_of("model.init_args.gamma") == 1.0
    assert low.final("comm/rounds") == 1
    assert low.final("test/acc") < 0.9 < min(r.final("test/acc") for r in runs if r is not low)


def test_no_runs_and_unknown_metric_are_clear_errors(tmp_path, run_dir, capsys):
    with pytest.raises(ValueError, match="no runs"):
        find_runs([tmp_path])
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "r"), "--metric", "test/accuracy"]) == 2
    assert "test/acc" in capsys.readouterr().err  # the metrics that do exist are listed


def test_page_holds_every_run_with_its_logged_numbers_and_every_figure_exists(report, run_dir):
    page = (report / "index.html").read_text()
    runs = {run.name: run for run in find_runs([run_dir])}
    rows = rows_of(page)
    assert sorted(name for name, _ in rows) == sorted(runs)
    for name, accuracy in rows:
        logged = read_metrics(runs[name].path / "metrics.csv")
        assert accuracy == pytest.approx(last_value(logged, "test/acc"))
    linked = re.findall(r'<a href="([^"]+\.png)">', page)
    assert set(linked) == {"accuracy_vs_bytes.png", "accuracy_vs_alpha.png"}
    for png in linked:
        assert (report / png).read_bytes().startswith(b"\x89PNG")
    assert page.count("data:image/png;base64,") == len(linked)  # self-contained
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere
    assert "No run logged an accuracy at two or more depths" in page  # AFL has one round
    assert "No run logged per-client accuracies" in page


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
    assert len(accuracies) == 3 and accuracies == sorted(accuracies, reverse=True)
    written = rows_of((report / "index.html").read_text())
    assert [name for name, _ in rows_of(dom)] != [name for name, _ in written]  # the script sorted
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
