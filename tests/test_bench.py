"""The leaderboard harness: a tiny synthetic scenario end to end, the choice on the hold-outs, the
statistics, resuming, failures, and the scenario file's errors."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from workbench.bench import leaderboard, main
from workbench.bench.runner import latest, read_records
from workbench.bench.scenario import ScenarioError, load_scenario
from workbench.report.runs import find_runs

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {
    "name": "tiny",
    "data": {"dataset": "synthetic", "min_partition_size": 1,
             "synthetic": {"num_classes": 4, "dim": 8, "train_size": 600, "test_size": 200, "seed": 0}},
    "settings": {"num_clients": [4], "partition": [{"partition": "dirichlet", "alpha": 0.5}]},
    "seeds": [0, 1, 2],
    "budget": {"rounds": 3, "patience": 2, "min_delta": 0.001},
    "references": {"hidden_dim": 8, "lrs": [0.3], "l2": [1.0e-4]},
    "methods": {
        "AFL": {"class_path": "AFL", "grid": {"gamma_out": [0.1, 10.0]}},
        "FedAvg": {"class_path": "FedAvg",
                   "init_args": {"architecture": "mlp", "hidden_dim": 8, "local": {"batch_size": 32}},
                   "grid": {"local.lr": [0.01, 0.3]}},
    },
}


def write(tmp_path: Path, scenario: dict) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def bench(tmp_path: Path, scenario: dict, *options: str) -> tuple[int, list[dict]]:
    code = main([str(write(tmp_path, scenario)), "--out", str(tmp_path / "out"), "--run_dir",
                 str(tmp_path / "runs"), *options])
    return code, read_records(tmp_path / "out" / "results.jsonl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny scenario run once, with a method that fails on every seed beside the others."""
    tmp_path = tmp_path_factory.mktemp("bench")
    broken = {**TINY, "methods": {**TINY["methods"],
                                  "Broken": {"class_path": "FedAvg", "init_args": {"hidden_dim": 0}}}}
    code, records = bench(tmp_path, broken)
    return tmp_path, broken, code, records


def test_every_run_is_recorded_and_a_failing_one_does_not_stop_the_rest(tiny):
    _, _, code, records = tiny
    # 3 seeds × (logistic 1 + MLP 1 + AFL 2 + FedAvg 2 + Broken 1)
    assert len(records) == 3 * 7 and code == 1  # a failed run: exit status 1, after every run
    failed = [r for r in records if r["status"] == "failed"]
    assert {r["method"] for r in failed} == {"Broken"} and len(failed) == 3
    assert "hidden_dim" in failed[0]["error"]
    assert all(r["status"] == "done" for r in records if r["method"] != "Broken")
    page = (tiny[0] / "out" / "leaderboard.md").read_text()
    assert "## Failed runs" in page and "Broken" in page


def test_a_rerun_skips_every_finished_run_and_retries_failed_ones_only_when_asked(tiny, capsys):
    tmp_path, scenario, _, before = tiny
    capsys.readouterr()
    code, after = bench(tmp_path, scenario)
    assert code == 1 and after == before  # nothing ran, nothing appended
    assert "21 recorded, 0 to run" in capsys.readouterr().out
    bench(tmp_path, scenario, "--retry_failed", "--methods", "Broken", "--seeds", "0")
    retried = read_records(tmp_path / "out" / "results.jsonl")[len(before):]
    assert [(r["method"], r["seed"], r["status"]) for r in retried] == [("Broken", 0, "failed")]


def test_a_diverging_grid_point_is_an_outcome_never_chosen_nor_rerun(tmp_path):
    """A rate whose steps blow up stops at the round's check for non-finite uploads: recorded as
    diverged, listed apart from failures, the other point chosen, the exit status 0."""
    scenario = {**TINY, "seeds": [0], "references": {"enabled": False},
                "methods": {"FedAvg": {**TINY["methods"]["FedAvg"], "grid": {"local.lr": [0.3, 1.0e30]}}}}
    code, records = bench(tmp_path, scenario)
    assert code == 0
    assert [(r["point_label"], r["status"]) for r in records] == [("local.lr=0.3", "done"),
                                                                 ("local.lr=1e+30", "diverged")]
    assert "non-finite" in records[1]["error"]
    assert leaderboard.choose(records)[(records[0]["setting"], 0, "FedAvg")]["point_label"] == "local.lr=0.3"
    page = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "## Diverged runs" in page and "## Failed runs" not in page
    assert bench(tmp_path, scenario, "--retry_failed") == (0, records)  # nothing runs again


def test_the_table_holds_the_runs_own_metrics(tiny):
    """Each chosen run's test accuracy is the one its run folder logged, and the table's mean is theirs."""
    tmp_path, _, _, records = tiny
    chosen = leaderboard.choose(records)
    fedavg = [chosen[(r_setting, seed, "FedAvg")] for (r_setting, seed, method) in chosen if method == "FedAvg"]
    runs = {str(run.path): run for run in find_runs([tmp_path / "runs"])}
    for record in fedavg:
        run = runs[str(Path(record["run_folder"]).resolve())]
        assert run.final("test/acc") == pytest.approx(record["test_acc"], abs=1e-12)
        assert run.method == "FedAvg" and run.num_clients == 4
    mean = sum(r["test_acc"] for r in fedavg) / len(fedavg)
    row = next(line for line in (tmp_path / "out" / "leaderboard.md").read_text().splitlines()
               if line.startswith("| ") and "FedAvg" in line)
    assert f"{100 * mean:.2f} ±" in row
    csv_rows = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert sum(",True," in line for line in csv_rows) == 3 * 4  # one chosen point per seed and working row


def test_a_grid_of_server_settings_is_one_fit_solved_again_at_each_point(tiny, tmp_path):
    """AFL's γ_out points of a cell share one fit (the first point's), solved again at the others;
    each such record is what a fit of its own at that point gives, down to its run folder."""
    _, _, _, records = tiny
    afl = [r for r in records if r["method"] == "AFL"]
    assert [r.get("solved_from") for r in afl] == [None, "gamma_out=0.1"] * 3
    alone = {**TINY, "references": {"enabled": False}, "methods": {"AFL": {"class_path": "AFL",
                                                                           "grid": {"gamma_out": [10.0]}}}}
    _, fitted = bench(tmp_path, alone)
    assert [r.get("solved_from") for r in fitted] == [None] * 3
    runs = {str(run.path): run for run in find_runs([tiny[0] / "runs"])}
    for solved, own in zip([r for r in afl if r.get("solved_from")], fitted, strict=True):
        assert solved["key"] == own["key"]  # the same run, however it was computed
        for number in ("test_acc", "holdout_acc", "best_test_acc", "rounds", "up_mb", "down_mb"):
            assert solved[number] == pytest.approx(own[number], abs=1e-12), number
        for point, own_point in zip(solved["curve"], own["curve"], strict=True):  # round, accuracy, MB up
            assert point == pytest.approx(own_point, abs=1e-12)
        assert solved["wall_s"] < own["wall_s"] and solved["solve_s"] < solved["fit_s"]
        run = runs[str(Path(solved["run_folder"]).resolve())]
        assert run.final("test/acc") == pytest.approx(own["test_acc"], abs=1e-12) and run.num_clients == 4


def test_the_hold_outs_choose_and_the_test_split_never_does(tiny):
    """Every chosen run has its group's best hold-out score; and records whose test accuracy ranks
    the other way round do not move the choice."""
    _, _, _, records = tiny
    for (setting, seed, method), record in leaderboard.choose(records).items():
        group = [r for r in records if r["status"] == "done" and (r["setting"], r["seed"], r["method"]) ==
                 (setting, seed, method)]
        assert record["holdout_acc"] == max(r["holdout_acc"] for r in group)
    base = {"status": "done", "setting": "s", "seed": 0, "method": "M", "class_path": "FedAvg"}
    low_test = {**base, "point_label": "a", "holdout_acc": 0.9, "test_acc": 0.5}
    high_test = {**base, "point_label": "b", "holdout_acc": 0.8, "test_acc": 0.99}
    for order in ([low_test, high_test], [high_test, low_test]):
        assert leaderboard.choose(order)[("s", 0, "M")]["point_label"] == "a"
    tie = {**base, "point_label": "c", "holdout_acc": 0.9, "test_acc": 0.99}
    assert leaderboard.choose([low_test, tie])[("s", 0, "M")]["point_label"] == "a"  # ties: the grid's first


def test_a_personalized_scenario_chooses_and_ranks_by_the_clients_own_models(tmp_path):
    """Under the personalized protocol a run's hold-out score is each client's own model on its own
    hold-out rows (so LocalOnly, which has no global model, is chosen too) and the table ranks by
    the local test accuracy; a record with no hold-out score is flagged where it was chosen."""
    scenario = {**TINY, "protocol": "personalized", "seeds": [0, 1],
                "data": {**TINY["data"], "local_test_fraction": 0.25},
                "methods": {"AFL": TINY["methods"]["AFL"],
                            "LocalOnly": {"class_path": "LocalOnly", "grid": {"gamma": [0.01, 100.0]}}}}
    code, records = bench(tmp_path, scenario)
    assert code == 0 and all(r["status"] == "done" for r in records)
    local = [r for r in records if r["method"] == "LocalOnly"]
    assert all(math.isnan(r["test_acc"]) and 0 < r["holdout_acc"] <= 1 and 0 < r["personal_acc"] <= 1 for r in local)
    assert {r["holdout_acc"] for r in local} != {local[0]["holdout_acc"]}  # the γ grid is told apart
    page = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "personal accuracy %" in page and "rounds (MB up) to" not in page and "no hold-out score" not in page
    unscored = [{**r, "holdout_acc": math.nan} for r in records]
    assert "(no hold-out score: the grid's first)" in leaderboard.render(load_scenario(tmp_path / "scenario.yaml"),
                                                                         unscored)


def test_statistics_over_seeds():
    mean, std, half = leaderboard.summary([0.80, 0.82, 0.84])
    assert mean == pytest.approx(0.82) and std == pytest.approx(0.02)
    assert half == pytest.approx(4.302652729911275 * 0.02 / math.sqrt(3))  # t(0.975, 2)
    # paired: a constant lead is certain, a lead that changes sign is not
    assert leaderboard.paired_p([0.9, 0.8, 0.7], [0.89, 0.79, 0.69]) == 0.0
    assert leaderboard.paired_p([0.9, 0.8, 0.7], [0.8, 0.9, 0.69]) > 0.05
    assert leaderboard.paired_p([0.9], [0.1]) == 1.0  # one seed tells nothing


def test_best_needs_a_paired_lead_over_every_other_method():
    def record(method, seed, acc):
        return {"status": "done", "setting": "s", "seed": seed, "method": method, "class_path": "FedAvg",
                "point_label": "—", "point": {}, "holdout_acc": acc, "test_acc": acc, "rounds": 1, "up_mb": 1.0,
                "down_mb": 1.0, "fit_s": 1.0, "curve": [], "wall_s": 1.0}
    scenario = load_scenario_of({**TINY, "methods": {m: {"class_path": "FedAvg"} for m in "ABC"}})
    clear = [record("A", s, 0.9 + s / 100) for s in range(3)] + [record("B", s, 0.8 + s / 100) for s in range(3)]
    lines = leaderboard.setting_table(scenario, clear, "s")
    assert any(line.startswith("| **best** A") for line in lines)
    close = [*clear, record("C", 0, 0.95), record("C", 1, 0.85), record("C", 2, 0.92)]
    lines = leaderboard.setting_table(scenario, close, "s")
    assert not any("**best**" in line for line in lines)
    assert any(line.startswith("| ≈ A") for line in lines) and any(line.startswith("| ≈ C") for line in lines)


def load_scenario_of(raw: dict, tmp: Path | None = None):
    import tempfile

    folder = Path(tmp or tempfile.mkdtemp())
    return load_scenario(write(folder, raw))


def test_an_edge_choice_is_flagged():
    scenario = load_scenario_of(TINY)
    assert leaderboard.edges(scenario, "FedAvg", {"local.lr": 0.3}) == ["local.lr"]
    wider = load_scenario_of({**TINY, "methods": {"FedAvg": {**TINY["methods"]["FedAvg"],
                                                             "grid": {"local.lr": [0.01, 0.1, 0.3]}}}})
    assert leaderboard.edges(wider, "FedAvg", {"local.lr": 0.1}) == []
    ridge = load_scenario_of({**TINY, "methods": {"AFL": {"class_path": "AFL",
                                                          "grid": {"gamma_out": [0.0, 1.0, 10.0]}}}})
    assert leaderboard.edges(ridge, "AFL", {"gamma_out": 0.0}) == []  # nothing below no regularizer
    assert leaderboard.edges(ridge, "AFL", {"gamma_out": 10.0}) == ["gamma_out"]


def test_one_round_methods_alone_get_no_columns_to_reach_them():
    """`rounds to AFL's` needs a method with a curve to reach it on: a table of one-round methods has none."""
    base = {"status": "done", "setting": "s", "class_path": "AFL", "point_label": "—", "point": {},
            "holdout_acc": 0.9, "test_acc": 0.9}
    one_round = [{**base, "seed": 0, "method": name, "rounds": 1} for name in ("AFL", "LDA")]
    scenario = load_scenario_of({**TINY, "methods": {"AFL": {"class_path": "AFL"}, "LDA": {"class_path": "GHOFL"}}})
    assert leaderboard.targets_of(scenario, leaderboard.choose(one_round), "s") == []
    longer = [*one_round, {**base, "seed": 0, "method": "LDA", "rounds": 3, "point_label": "x", "holdout_acc": 0.95}]
    assert leaderboard.targets_of(scenario, leaderboard.choose(longer), "s") == ["AFL"]


def test_a_reference_run_is_keyed_by_what_decides_it_alone():
    def keys(scenario: dict) -> dict[tuple[str, str], str]:
        loaded = load_scenario_of(scenario)
        return {(run.method.name, run.point_label): run.key(loaded) for run in loaded.runs()
                if run.method.is_reference and run.seed == 0}

    logistic, mlp = ("Centralized logistic regression", "l2=0.0001"), ("Centralized MLP", "lr=0.3")
    before = keys(TINY)
    wider = keys({**TINY, "references": {**TINY["references"], "lrs": [0.1, 0.3], "l2": [1.0e-4, 1.0e-2]}})
    assert wider[logistic] == before[logistic] and wider[mlp] == before[mlp]  # a widened grid keeps its runs
    assert len(wider) == 4
    longer = keys({**TINY, "budget": {**TINY["budget"], "rounds": 9}})  # the MLP trains to the budget
    assert longer[logistic] == before[logistic] and longer[mlp] != before[mlp]
    wider_net = keys({**TINY, "references": {**TINY["references"], "hidden_dim": 16}})
    assert wider_net[logistic] == before[logistic] and wider_net[mlp] != before[mlp]


@pytest.mark.parametrize(("change", "message"), [
    ({"colour": 1}, "unknown keys"),
    ({"methods": {"X": {"class_path": "FedAvv"}}}, "unknown method class 'FedAvv'"),
    ({"methods": {"X": {"class_path": "FedAvg", "grid": {"lrr": [0.1]}}}}, "has no setting 'lrr'"),
    ({"methods": {"X": {"class_path": "FedAvg", "grid": {"local.lr": []}}}}, "non-empty list"),
    ({"data": {"dataset": "synthetic", "seed": 3}}, "data.seed is the harness's"),
    ({"settings": {"num_clients": [4], "dataset": ["mnist5k"]}}, "cannot vary per cell"),
    ({"seeds": []}, "seeds must be"),
    ({"budget": {"round": 3}}, "budget: rounds, patience, min_delta"),
    ({"protocol": "local"}, "protocol must be one of"),
])
def test_a_bad_scenario_names_the_key_and_the_fix(tmp_path, change, message):
    with pytest.raises(ScenarioError, match=message):
        load_scenario(write(tmp_path, {**TINY, **change}))


def test_the_command_refuses_a_bad_scenario_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "benchmarks/scenarios/" in err


def test_the_shipped_scenarios_load_and_their_committed_pages_are_current():
    for path in sorted(Path("benchmarks/scenarios").glob("*.yaml")):
        scenario = load_scenario(path)
        assert len(scenario.seeds) >= 3 and scenario.runs()
        keys = [run.key(scenario) for run in scenario.runs()]
        assert len(set(keys)) == len(keys), f"{path}: two runs share a key"
        folder = Path("benchmarks/results/leaderboard") / scenario.name
        if (folder / "results.jsonl").exists():  # the committed page is what its records and this scenario render
            current = [r for key, r in latest(read_records(folder / "results.jsonl")).items() if key in set(keys)]
            assert current, f"{path}: no committed record is of this scenario: rerun the bench"
            assert (folder / "leaderboard.md").read_text() == leaderboard.render(scenario, current), \
                f"{folder / 'leaderboard.md'} is stale: python -m workbench bench {path} --render"
