"""benchmarks/adversaries.py: one cell per method × share of adversaries for each attack, a fit the
attack made fail shown as such with its error, the screen's decisions as its fits counted them, and
each row's method built as stated."""
from __future__ import annotations

from benchmarks import adversaries
from workbench.methods import AFL, DeepAFL, FedAvg


def test_each_cell_is_its_fit_and_a_failed_fit_says_why():
    records = [{"row": row, "attack": attack, "fraction": fraction, "accuracy": 0.5 + fraction, "rounds": 1,
                "adversaries": round(100 * fraction)}
               for attack in adversaries.ATTACKS for row in adversaries.ROWS for fraction in adversaries.FRACTIONS]
    for record in records:
        if adversaries.ROWS[record["row"]][2] == "screen":
            record.update(rejected=round(100 * record["fraction"]) + 2, liars_rejected=round(100 * record["fraction"]))
    broken = next(r for r in records if (r["row"], r["attack"], r["fraction"]) == ("AFL", "sign flipped", 0.2))
    del broken["accuracy"]
    broken["failed"] = "LinAlgError: the Gram is not positive definite"
    text = "\n".join(adversaries.report(records, 60.0, "Machine: test.", smoke=False))
    assert "| AFL | 50.00 | 51.00 | 55.00 | 60.00 | fails |" in text
    assert "- AFL, sign flipped, 20 %: LinAlgError: the Gram is not positive definite" in text
    assert text.count("| FedAvg (median) |") == len(adversaries.ATTACKS) and text.endswith("Machine: test.")
    # the screen's decisions: 2 honest clients and every adversary rejected, of 1, 5, 10, 20 adversaries
    assert "| AFL (screen) | 2 + 0 of 0 | 2 + 1 of 1 | 2 + 5 of 5 | 2 + 10 of 10 | 2 + 20 of 20 |" in text


def test_the_rows_build_the_methods_they_name():
    assert isinstance(adversaries.build("AFL", smoke=False), AFL)
    deep = adversaries.build("DeepAFL", smoke=True)
    assert isinstance(deep, DeepAFL) and deep.num_layers == 2
    fedavg = adversaries.build("FedAvg (median)", smoke=False)
    assert isinstance(fedavg, FedAvg) and fedavg.num_rounds == 30 and fedavg.local.lr == 0.03
    assert {aggregation for *_, aggregation in adversaries.ROWS.values()} == {"mean", "median", "trimmed_mean",
                                                                             "multi_krum", "screen"}


def test_the_honest_spread_is_tabled_as_measured():
    spread = [{"clients": 100, "alpha": 0.5, "seeds": 3, "smallest": 7,
               "ranges": [[0.66, 1.29], [0.72, 1.34], [0.7, 1.5]]},
              {"clients": 1000, "alpha": None, "seeds": 3, "smallest": 4,
               "ranges": [[0.43, 1.69], [0.52, 1.59], [0.8, 1.24]]}]
    records = [{"row": row, "attack": attack, "fraction": fraction, "accuracy": 0.5, "rounds": 1, "adversaries": 0}
               for attack in adversaries.ATTACKS for row in adversaries.ROWS for fraction in adversaries.FRACTIONS]
    text = "\n".join(adversaries.report(records, 60.0, "Machine: test.", smoke=False, spread=spread))
    assert "| 100 | 0.5 | 3 | 7 | 0.66 – 1.29 | 0.72 – 1.34 | 0.70 – 1.50 |" in text
    assert "| 1000 | iid | 3 | 4 | 0.43 – 1.69 | 0.52 – 1.59 | 0.80 – 1.24 |" in text
    assert "spread" not in "\n".join(adversaries.report(records, 60.0, "Machine: test.", smoke=False))
