"""A round is a plain function: `run_round` and `run_final` in a loop, without Lightning, are the
in-process engine's fit (the same model, the same bytes), and what a round reports is what its
messages cost on the wire."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import fit, relative_error
from tests.engines.conformance import METHODS, comparable_state, data, protocol_of, supports
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, run_final, run_round
from workbench.federation import Federation, codec
from workbench.federation.privacy import CLIP_NORM_BYTES, WITHIN_CLIP
from workbench.methods import AFL, FedAvg, Problem
from workbench.methods.base import MODEL_UPDATE

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_fit(method, dm, federation: Federation):
    """Every round by `run_round`, then `run_final`: (the results, the final result)."""
    method.setup(Problem.of(dm.population()))
    available = torch.unique(dm.train_client_ids)
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids, available,
                           dm.hparams.batch_size, federation)
    protocol = FitProtocol.start(method, federation, len(available))
    results = [run_round(method, clients, protocol, available) for _ in range(method.num_rounds)]
    return results, run_final(method, clients)


@pytest.mark.parametrize("name, protocol", [(name, None) for name in METHODS]
                         + [(name, "client_dp") for name in METHODS if supports(name, "client_dp")])
def test_rounds_in_a_loop_are_the_engines_fit(name, protocol):
    federation = protocol_of(name, protocol) or Federation()
    method = METHODS[name][0]()
    results, final = plain_fit(method, data(name=name), federation)
    engine = fit(METHODS[name][0](), data(name=name), federation)
    ours, theirs = comparable_state(method), comparable_state(engine.method)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert relative_error(ours[key], theirs[key]) <= METHODS[name][1], key
    assert sum(r.bytes_up for r in results) == engine.fit_metrics["comm/bytes_up"]
    assert sum(r.bytes_down for r in results) + final.bytes_down == engine.fit_metrics["comm/bytes_down"]
    assert method.fitted and len(results) == method.round == engine.method.round


def test_a_round_counts_each_survivors_message_and_the_broadcast_to_the_cohort():
    dm = data()
    method = AFL(gamma=1.0)
    (result,), final = plain_fit(method, dm, Federation(dropout=0.34, seed=2))
    one_client = {"gram": torch.zeros(8, 8, dtype=torch.float64), "cross": torch.zeros(8, 4, dtype=torch.float64)}
    assert len(result.survivors) == 2 and len(result.lost) == 1 and len(result.cohort) == 3
    assert result.bytes_up == 2 * codec.client_bytes(one_client, method.uploads)  # the packed Gram and XᵀY
    assert result.bytes_up == 2 * (8 * 9 // 2 + 8 * 4) * 8
    assert result.bytes_down == 0 and method.round == 1  # AFL broadcasts nothing before its round
    assert final.bytes_down == 3 * (8 * 4 * 8)  # W to every client
    assert result.metrics["comm/clients_dropped"] == 1


def test_client_level_dp_is_the_protocols_part_of_the_message():
    """The clip norm travels beside the method's broadcast (8 bytes a client), the clients clip
    their model updates and add the count within it (a float32), and the server's update never
    sees that count: the method only declared which upload is its model update."""
    dm = data()
    method = FedAvg(num_rounds=1, architecture="linear", seed=0)
    assert method.uploads["update"].model_update and method.clips_updates
    federation = Federation(dp_clip=0.01, dp_noise_multiplier=0.0)
    (result,), _ = plain_fit(method, dm, federation)
    assert WITHIN_CLIP not in result.uploads and result.metrics["privacy/clip_norm"] == 0.01
    parameters = 8 * 4 + 4
    assert result.bytes_up == 3 * (4 * parameters + 4)  # float32 Δw and the count
    assert result.bytes_down == 3 * (8 + CLIP_NORM_BYTES)  # w₀'s seed and C
    assert float(result.uploads["update"].norm()) <= 3 * 0.01 * (1 + 1e-6)  # three updates clipped to C


def test_a_method_that_uploads_no_model_update_is_refused_client_level_dp():
    assert not AFL().clips_updates and MODEL_UPDATE.model_update
    with pytest.raises(ValueError, match="dp_clip clips clients' model updates"):
        fit(AFL(), data(), Federation(dp_clip=1.0))
