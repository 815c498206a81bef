"""The comparison dashboard on real run folders written by the command line (`conftest.py`): what
is read back, and the figures' data (groups, fronts, curves, lines over α) the page draws."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.report.conftest import TINY
from workbench import runlog
from workbench.__main__ import main
from workbench.report import find_runs, read_metrics
from workbench.report.dashboard import COMPARABLE, build, identity, pareto_front
from workbench.report.runs import Run, last_value, mean_std

FINISHED = ["a_alpha0.5_k20_hard", "b_alpha0.5_k10", "c_alpha0.1_k10", "d_alpha0.1_k10_seed1", "e_fedavg",
            "f_fedavg_lr", "g_deepafl", "h_ghofl", "i_afl_personal", "j_anapfl", "k_ditto", "l_scaffold_cnn",
            "m_flower"]


@pytest.fixture(scope="module")
def runs(run_dir) -> dict[str, Run]:
    return {run.name: run for run in find_runs([run_dir])}


@pytest.fixture(scope="module")
def board(run_dir) -> dict:
    return build(find_runs([run_dir]))


def by_name(board: dict) -> dict[str, dict]:
    return {record["name"].split("/")[0]: record for record in board["runs"]}


def page_data(report: Path) -> dict:
    page = (report / "index.html").read_text()
    return json.loads(re.search(r'<script type="application/json" id="dashboard-data">(.*?)</script>',
                                page, re.S).group(1).replace("<\\/", "</"))


def test_every_run_is_found_once_with_how_it_ended(run_dir, runs):
    version = run_dir / "c_alpha0.1_k10" / "version_0"
    again = find_runs([run_dir, version, run_dir / "c_alpha0.1_k10"])
    assert sorted(run.name for run in again) == sorted(runs)
    assert sorted(name.split("/")[0] for name, run in runs.items() if run.status == "done") == FINISHED
    ended = {name: (run.status, run.error) for name, run in runs.items() if run.status != "done"}
    assert ended["b_alpha0.5_k10/version_1"] == ("re-evaluation", "")  # test --ckpt_path: not a run
    assert ended["sweep/alpha=0"] == ("failed", "cannot be built: ValueError: data.alpha must be > 0, got 0.0")
    assert ended["sweep/k=2000/version_0"] == ("failed", "error: 2000 clients for 2000 samples")  # the last line
    status, error = ended["diverged/version_0"]  # not a sweep's: the command line's own status.json
    assert status == "failed" and error.startswith("FloatingPointError: round 0: FedAvg's aggregated upload "
                                                   "'update' holds")
    assert runs["b_alpha0.5_k10/version_1"].evaluated.resolve() == (run_dir / "b_alpha0.5_k10" / "version_0").resolve()


def test_a_run_says_what_it_learned_from_and_how_its_data_was_split(runs):
    hard, cnn = runs["a_alpha0.5_k20_hard/version_0"], runs["l_scaffold_cnn/version_0"]
    assert identity(hard) == {"method": "AFL", "engine": "in process", "protocol": "global", "dataset": "synthetic",
                              "inputs": "synthetic features", "partition": "dirichlet α=0.5", "K": 20}
    assert (cnn.inputs, cnn.backbone, cnn.partition_label) == ("images → cnn", "none", "iid")  # no backbone ran
    assert runs["m_flower/version_0"].engine == "flower"
    assert runs["j_anapfl/version_0"].protocol == "personalized"
    assert hard.value_of("data.synthetic.separation") == 1.5  # the CLI's short key form
    assert hard.value_of("model.init_args.gamma") == 1.0
    assert hard.final("time/wall_s") > hard.final("time/fit_s") > 0  # end to end includes the fit


def test_groups_hold_only_comparable_runs_and_each_front_is_its_undominated_settings(board):
    groups = {group["id"]: group for group in board["groups"]}
    rows = {row["id"]: row for row in board["rows"]}
    records = {record["id"]: record for record in board["runs"]}
    assert sum(group["runs"] for group in groups.values()) == len(FINISHED) == board["counts"]["runs"]
    for group in groups.values():
        members = [records[run] for setting in group["settings"] for run in rows[setting]["runs"]]
        for field in COMPARABLE:  # what one figure draws shares dataset, inputs, protocol, partition, K
            assert {json.dumps(record["values"][field]) for record in members} == {json.dumps(group["fields"][field])}
        for cost, front in group["fronts"].items():
            points = {s: (rows[s]["cells"][cost][0], rows[s]["cells"][group["score"]][0]) for s in group["settings"]
                      if rows[s]["cells"][cost][2] and rows[s]["cells"][group["score"]][2]}
            undominated = {s for s, (x, y) in points.items() if not any(
                (x2 <= x and y2 > y) or (x2 < x and y2 >= y) for x2, y2 in points.values())}
            assert set(front) == undominated, (group["label"], cost)
    labels = [group["label"] for group in groups.values()]
    assert labels[0] == "synthetic · synthetic features · global · dirichlet α=0.5 · K=10"  # most runs first
    assert "synthetic · synthetic features · personalized · dirichlet α=0.5 · K=10" in labels
    assert "mnist5k · images → cnn · global · iid · K=4" in labels


def test_a_personalized_run_is_ranked_by_its_clients_models_never_by_its_global_branch(board, runs):
    personal = next(group for group in board["groups"] if group["fields"]["protocol"] == "personalized")
    assert personal["score"] == "test/acc_local_mean"
    records = by_name(board)
    anapfl = records["j_anapfl"]
    assert anapfl["score_metric"] == "test/acc_local_mean"
    assert anapfl["score"] == pytest.approx(runs["j_anapfl/version_0"].final("test/acc_local_mean"))
    assert anapfl["score"] != pytest.approx(runs["j_anapfl/version_0"].final("test/acc"))
    for group in board["groups"]:  # no global front holds a personalized setting
        if group["fields"]["protocol"] == "global":
            rows = {row["id"]: row for row in board["rows"]}
            assert all(rows[s]["protocol"] == "global" for front in group["fronts"].values() for s in front)


def test_repeats_are_one_row_with_mean_std_and_n(board, runs):
    assert mean_std([0.8, 0.9, math.nan]) == (pytest.approx(0.85), pytest.approx(0.0707107), 2)
    rows = {tuple(sorted(by_id["name"] for by_id in board["runs"] if by_id["id"] in row["runs"])): row
            for row in board["rows"]}
    repeat = rows[("c_alpha0.1_k10/version_0", "d_alpha0.1_k10_seed1/version_0")]
    logged = [last_value(read_metrics(runs[name].path / "metrics.csv"), "test/acc")
              for name in ("c_alpha0.1_k10/version_0", "d_alpha0.1_k10_seed1/version_0")]
    mean, std, n = repeat["cells"]["test/acc"]
    assert (mean, n) == (pytest.approx(sum(logged) / 2), 2)
    assert std == pytest.approx(abs(logged[0] - logged[1]) / 2 ** 0.5)
    assert len(board["rows"]) == len(FINISHED) - 1


def test_the_table_shows_what_varies_and_keeps_the_rest_a_toggle_away(board):
    shown = {column["key"] for column in board["columns"] if column["shown"]}
    hidden = {column["key"] for column in board["columns"] if not column["shown"]}
    # the settings that vary are shown, the fields of the group of comparable runs among them
    assert {"method", "engine", "dataset", "protocol", "partition", "K", "model.local.lr",
            "data.synthetic.separation", "test/acc", "test/acc_local_mean", "curve/best", "comm/rounds",
            "comm/bytes_up_per_client", "time/fit_s"} <= shown
    assert {"test/acc/lda", "test/acc/nb_diag", "comm/bytes_down_per_client"} <= hidden  # GH-OFL's heads: one run
    assert next(c for c in board["columns"] if c["key"] == "test/acc/lda")["runs"] == 1
    varying = {column["key"] for column in board["columns"] if column["varies"]}
    assert {"dataset", "inputs", "protocol", "partition", "K"} & varying <= shown
    assert "model.gamma" not in shown and board["constant"]["model.gamma"] == 1.0  # every run that has it: 1
    assert "model.local.batch_size" not in {column["key"] for column in board["columns"]}  # the same everywhere
    head = next(row for row in board["rows"] if "test/acc/lda" in row["cells"] and row["cells"]["test/acc/lda"][2])
    assert head["cells"]["method"] == "GHOFL"


def test_every_method_has_a_learning_curve_with_the_bytes_sent_by_each_point(board, runs):
    records = by_name(board)
    fedavg = records["e_fedavg"]["curve"]
    assert fedavg["round"] == [1, 2, 3] and fedavg["up"] == sorted(fedavg["up"])
    assert fedavg["up"][-1] == runs["e_fedavg/version_0"].final("comm/bytes_up_per_client")
    assert fedavg["up"][0] == pytest.approx(fedavg["up"][-1] / 3)
    assert fedavg["acc"][-1] == pytest.approx(runs["e_fedavg/version_0"].final("test/acc"), abs=1e-6)
    latency = fedavg["latency"]  # on the simulated clock: the seconds by each point
    assert latency == sorted(latency) and latency[-1] == runs["e_fedavg/version_0"].final("latency/total_s") > 0
    afl = records["b_alpha0.5_k10"]["curve"]  # a one-round method: one point
    assert afl["latency"] == [None]  # no clock: no simulated time
    assert afl["round"] == [1] and afl["acc"] == [pytest.approx(records["b_alpha0.5_k10"]["score"])]
    ditto = records["k_ditto"]["curve"]  # personal models scored along the rounds
    assert ditto["round"] == [1, 2] and ditto["acc"][-1] == pytest.approx(records["k_ditto"]["score"], abs=1e-6)
    assert records["i_afl_personal"]["curve"]["round"] == [1]  # a global head is each client's model
    depth = records["g_deepafl"]["depth"]
    assert depth["depth"] == [0, 1, 2] and len(depth["acc"]) == 3
    best, at = records["f_fedavg_lr"]["values"]["curve/best"], records["f_fedavg_lr"]["values"]["curve/best_round"]
    curve = records["f_fedavg_lr"]["curve"]
    assert best == max(curve["acc"]) and curve["acc"][curve["round"].index(at)] == best


def test_the_invariance_lines_join_only_settings_run_at_two_or_more_alphas(board):
    (line,) = board["alpha_lines"]  # AFL at α 0.1 (two seeds) and 0.5; every other setting at one α
    assert line["label"] == "AFL" and [point["alpha"] for point in line["points"]] == [0.1, 0.5]
    assert [point["n"] for point in line["points"]] == [2, 1]
    global_k10 = [g["family"] for g in board["groups"] if g["fields"]["protocol"] == "global" and g["fields"]["K"] == 10
                  and g["fields"]["dataset"] == "synthetic"]
    assert len(set(global_k10)) == 1 and line["family"] == global_k10[0]  # drawn in both α's groups


def test_a_reevaluation_is_listed_beside_its_fit_and_counted_once(board):
    (again,) = board["reevaluations"]
    assert (again["name"], again["of"]) == ("b_alpha0.5_k10/version_1", "b_alpha0.5_k10/version_0") and again["found"]
    assert again["value"] == pytest.approx(again["fit_value"])
    assert "b_alpha0.5_k10/version_1" not in {record["name"] for record in board["runs"]}
    assert board["counts"] == {"runs": 13, "settings": 12, "unfinished": 3, "reevaluations": 1}


def test_the_page_is_one_self_contained_file_holding_the_dashboards_data(report, run_dir):
    page = (report / "index.html").read_text()
    _, bundle, script = re.findall(r"<script[^>]*>(.*?)</script>", page, re.S)  # the data, Plotly, ours
    assert "plotly.js" in bundle[:400] and "Plotly.react" in script
    ours = page.replace(bundle, "")  # the page the browser test watches for requests, Plotly's links too
    assert not re.search(r'(src|href)=["\']?(https?:)?//', ours)  # nothing fetched from elsewhere
    assert page_data(report) == json.loads(json.dumps(build(find_runs([run_dir])), allow_nan=False))
    for name in ("sweep/alpha=0", "sweep/k=2000/version_0", "diverged/version_0"):
        assert f'data-unfinished="{name}"' in page
    assert "data.alpha must be &gt; 0, got 0.0" in page and 'data-reevaluation="b_alpha0.5_k10/version_1"' in page
    assert (report / "index.html").stat().st_size < 6e6  # Plotly's bundle is most of it


def test_pareto_front_keeps_the_undominated_cheapest_first():
    points = [(10, 0.5, "a"), (10, 0.7, "b"), (20, 0.6, "c"), (30, 0.9, "d"), (5, 0.4, "e"), (40, 0.9, "f")]
    assert pareto_front(points) == ["e", "b", "d"]
    assert pareto_front([]) == []


def test_no_runs_and_unknown_metric_or_group_are_clear_errors(tmp_path, run_dir, capsys):
    with pytest.raises(ValueError, match="no runs"):
        find_runs([tmp_path])
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "r"), "--metric", "test/accuracy"]) == 2
    assert "test/acc" in capsys.readouterr().err  # the metrics that do exist are listed
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "r"), "--group_by", "modle.gamma"]) == 2
    err = capsys.readouterr().err
    assert "'modle.gamma'" in err and "method, engine, protocol" in err and "model.gamma" in err
    assert not (tmp_path / "r").exists()


def test_a_run_that_fails_or_is_stopped_says_so_in_its_folder(tmp_path, monkeypatch):
    sigterm = "stopped by SIGTERM; resume with fit --ckpt_path last"
    for error, status, text in ((SystemExit(128 + 15), "stopped", sigterm),
                                (ValueError("bad\nlast line"), "failed", "ValueError: last line"),
                                (KeyboardInterrupt(), "stopped", "interrupted")):
        folder = tmp_path / status / text[:4]
        folder.mkdir(parents=True)
        monkeypatch.setattr(runlog, "claimed", folder)
        runlog.record_ending(error, ["fit", "--config", "x.yaml"])
        written = json.loads((folder / "status.json").read_text())
        assert (written["status"], written["command"]) == (status, ["fit", "--config", "x.yaml"])
        assert written["error"].startswith(text)
        assert (Run.load(folder).status, Run.load(folder).error) == (status, written["error"])
    clean = tmp_path / "clean"
    clean.mkdir()
    monkeypatch.setattr(runlog, "claimed", clean)
    runlog.record_ending(SystemExit(0), [])
    monkeypatch.setattr(runlog, "claimed", None)  # refused before a folder was claimed: nothing ran
    runlog.record_ending(ValueError("refused"), [])
    assert not (clean / "status.json").exists()


def test_a_refused_input_leaves_no_run_folder(tmp_path):
    assert main(["fit", *TINY, "--data.alpha=0", f"--run_dir={tmp_path}"]) == 2
    assert not list(tmp_path.rglob("version_*"))


def test_a_running_sweep_run_whose_runner_died_is_listed_as_stopped(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    for name, pid in (("alive", os.getpid()), ("gone", gone.pid)):
        folder = tmp_path / name
        (folder / "version_0").mkdir(parents=True)
        (folder / "status.json").write_text(json.dumps({
            "status": "running", "runner": {"host": socket.gethostname(), "pid": pid}}))
    found = {run.name: run for run in find_runs([tmp_path])}
    assert found["alive/version_0"].status == "running"
    assert found["gone/version_0"].status == "stopped"
    assert "runner ended" in found["gone/version_0"].error


def test_per_client_accuracies_and_depth_rows_are_read_back(tmp_path):
    run = tmp_path / "deep" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(  # the layout CSVLogger writes: one row per logging call
        "comm/rounds,depth/depth,depth/test_acc,epoch,step,test/acc\n"
        "1.0,,,0,0,\n,0.0,0.80,,0,\n3.0,,,2,2,\n,1.0,0.85,,1,\n5.0,,,4,4,\n,2.0,0.87,,2,\n,,,5,5,0.87\n")
    (run / "per_client_acc.csv").write_text("client,acc,num_test\n0,0.9,20\n1,0.7,25\n2,1.0,10\n")
    loaded = Run.load(run)
    assert loaded.depth_curve() == {"depth": [0.0, 1.0, 2.0], "acc": [0.80, 0.85, 0.87]}
    assert loaded.per_client_acc == [0.9, 0.7, 1.0]
    assert loaded.curve("round/test_acc") is None
