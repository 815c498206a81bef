"""SecAgg+ under the multi-process engines: DDP (masked vectors ring-summed across processes) and
Flower (each ClientApp masks along the same graph); the models equal the in-process ones."""
from __future__ import annotations

import pytest

from tests.conftest import relative_error
from tests.engines.conftest import TINY, fit_in_processes, logged, saved_model
from workbench.cli import main
from workbench.federation import Federation

SPARSE = ["--federation.secure_aggregation=true", "--federation.secure_aggregation_graph=sparse",
          "--federation.secagg_degree=6", "--federation.secagg_threshold=3"]


@pytest.mark.subprocess
def test_two_processes_under_secagg_plus_with_dropouts(tmp_path):
    # 10 clients, 3 drop: a survivor keeps ≥ 3 of its 6 neighbours, so every secret has t shares
    protocol = ["--federation.dropout=0.3", "--federation.seed=4", *SPARSE]
    done = fit_in_processes(tmp_path / "two", *protocol)
    assert done.returncode == 0, done.stderr[-3000:]
    main(["fit", *TINY, f"--run_dir={tmp_path / 'one'}", "--federation.dropout=0.3", "--federation.seed=4"])
    assert relative_error(saved_model(tmp_path / "two")["method.weight"],
                          saved_model(tmp_path / "one")["method.weight"]) <= 1e-8  # against the plain fit
    metrics = logged(tmp_path / "two")
    assert metrics["comm/clients_in_round"] == 7 and metrics["comm/secagg_degree"] == 6
    assert metrics["comm/secagg_mask_streams_per_client"] == pytest.approx(7 * 7 / 10)


@pytest.mark.ray
def test_fedavg_under_secagg_plus_over_flower_equals_in_process(tmp_path):
    pytest.importorskip("ray", reason="Flower simulations need Ray: pip install -e '.[flower]'")
    from tests.engines.conftest import COMM, assert_same_state, fedavg, over_both

    # 3 clients, one drops each round: each survivor keeps 1 surviving neighbour, so t = 1 (warned:
    # one share reveals a secret)
    federation = Federation(dropout=0.34, secure_aggregation=True, secure_aggregation_graph="sparse",
                            secagg_threshold=1, seed=3)
    with pytest.warns(UserWarning, match="threshold of one share"):
        engine, reference = over_both(fedavg, {"personalized": True}, federation, tmp_path)
    assert_same_state(engine.method, reference.method, 1e-6)
    for key in (*COMM, "comm/secagg_mask_streams_per_client", "comm/secagg_share_bytes_per_client"):
        assert engine.fit_metrics[key] == reference.fit_metrics[key], key
