"""benchmarks/analytic_start.py's dry run: every run (FedAvg from scratch, each start and the
centralized reference, on the linear head, the MLP and the synthetic data's trainable tail) fits
on synthetic blobs and the report has a row and a curve for each; a start's accuracy after its two
rounds is the analytic head's, before any gradient step."""
from __future__ import annotations

from benchmarks import analytic_start


def test_the_dry_run_reports_every_run(tmp_path):
    out = tmp_path / "analytic_start.md"
    analytic_start.main(["--dry_run", "--out", str(out)])
    text = out.read_text()
    table = [line for line in text.splitlines() if line.split(" | ")[0] in ("| head", "| mlp", "| tail")]
    assert [line.split(" | ")[1] for line in table] == [name.split("/")[1] for name in analytic_start.RUNS]
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        scratch = cells[1] in ("FedAvg", "central")
        assert (cells[3] == "—") == scratch  # after the start: only the starts have one
        assert int(cells[6]) == (2 if scratch else 4)  # the two start rounds come before FedAvg's two
        assert (cells[7] == "—") == (cells[1] == "central")  # one client's epochs upload nothing to compare
    assert "Test accuracy by round" in text


def test_without_fedavg_from_scratch_no_run_is_said_not_to_reach_it(tmp_path):
    out = tmp_path / "analytic_start.md"
    analytic_start.main(["--dry_run", "--runs", "mlp/central", "mlp/AFL+FT-fixed", "--out", str(out)])
    table = [line for line in out.read_text().splitlines() if line.startswith("| mlp |")]
    assert len(table) == 2 and all(line.endswith("| — | — |") for line in table)
