"""Faults over Flower. A SuperNode that dies or stalls mid-fit: its client is dropped from the
round after the deadline (at once when Flower reports it gone), the round completes with the
others — the same model as the in-process fit with that client dropped in that round — and a node
that comes back serves its client again from the next round. A server that stops: its fit
resumes from the checkpoint over new nodes.

The nodes live in this process (`LoopbackGrid`); a real deployment on loopback, a SuperNode
killed by its process id, is `test_deployment.py`.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

from tests.conftest import InterruptAfter, quiet_trainer
from tests.engines.conformance import METHODS, data, protocol_of
from tests.engines.conftest import assert_same_state, dropping_clients
from workbench.engines import LightningEngine
from workbench.engines.flower.loopback import FIRST_NODE, LoopbackGrid
from workbench.engines.flower.simulation import fit_over_grid
from workbench.engines.flower.transport import wait_for_nodes
from workbench.engines.flower_settings import FlowerSettings
from workbench.federation import Federation
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, AnaPFL, DeepAFL, FedAvg

pytestmark = pytest.mark.usefixtures("one_thread", "as_server")
QUICK = FlowerSettings(deadline_s=0.05)  # a silent node is given up after 50 ms


class StagedGrid(LoopbackGrid):
    """A loopback grid on which, when round r's train messages go out, `silenced[r]` nodes stop
    answering, `stalled[r]` answer late, `gone[r]` are reported gone by Flower and `joined[r]`
    partitions get a new node."""

    def __init__(self, num_clients: int, silenced=None, gone=None, joined=None, stalled=None) -> None:
        super().__init__(num_clients)
        self.staged = {"silence": silenced or {}, "lose": gone or {}, "join": joined or {}, "stall": stalled or {},
                       "expire": {}}

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train":
            round_index = int(messages[0].metadata.group_id)
            for action, rounds in self.staged.items():
                for target in rounds.pop(round_index, []):
                    getattr(self, action)(target)
        return super().push_messages(messages)


def in_process(make, dropped: dict[int, list[int]], federation: Federation | None = None, num_clients: int = 3):
    """The in-process fit of `make()` with `dropped[r]` clients' replies lost in round r."""
    method, dm = make(), data(num_clients)
    engine = LightningEngine(method, federation)
    with dropping_clients(dropped):
        quiet_trainer().fit(engine, datamodule=dm)
    return method, engine


def over_grid(make, grid: LoopbackGrid, federation: Federation | None = None, settings=QUICK):
    method, dm = make(), data(grid.num_clients)
    engine = LightningEngine(method, federation)
    run = fit_over_grid(grid, quiet_trainer(), engine, dm, settings=settings)
    return method, engine, run


def fedavg():
    return FedAvg(num_rounds=4, architecture="mlp", hidden_dim=8, seed=3, local=LocalTraining(lr=0.1, batch_size=16))


def test_a_silent_node_is_dropped_after_the_deadline_and_afl_is_the_ridge_of_the_others():
    method, engine, _ = over_grid(lambda: AFL(gamma=1.0, gamma_out=0.1), StagedGrid(3, silenced={0: [FIRST_NODE + 1]}))
    assert engine.fit_metrics["comm/clients_missing"] == 1 and engine.fit_metrics["comm/clients_in_round"] == 2
    assert engine.client_events == [[0, 1, "missing", "no reply within 0.05 s"]]
    reference, _ = in_process(lambda: AFL(gamma=1.0, gamma_out=0.1), {0: [1]})
    assert_same_state(method, reference, 1e-8)
    # and that is the centralized ridge on clients 0 and 2's rows, not a model of all three
    dm = data()
    rows = dm.train_client_ids != 1
    alone = AFL(gamma=1.0, gamma_out=0.1)
    fit_alone = LightningEngine(alone)
    alone_dm = data()
    alone_dm.train_features, alone_dm.train_labels = dm.train_features[rows], dm.train_labels[rows]
    alone_dm.train_client_ids = dm.train_client_ids[rows]
    quiet_trainer().fit(fit_alone, datamodule=alone_dm)
    assert_same_state(method, alone, 1e-8)


def test_fedavg_with_a_node_lost_mid_fit_equals_in_process_with_its_client_dropped_from_then_on():
    method, engine, run = over_grid(fedavg, StagedGrid(3, silenced={1: [FIRST_NODE + 2]}))
    reference, reference_engine = in_process(fedavg, {1: [2], 2: [2], 3: [2]})  # away until a node comes back
    assert_same_state(method, reference, 1e-6)
    assert [event[:3] for event in engine.client_events] == [[1, 2, "missing"], [2, 2, "missing"],
                                                             [3, 2, "missing"]]
    assert engine.client_events[1][3].startswith("its SuperNode was lost in round 1")
    assert engine.fit_metrics["comm/bytes_up"] == reference_engine.fit_metrics["comm/bytes_up"]
    # no broadcast goes to the away client in rounds 2 and 3: two models less (the MLP 8-8-4's 108 float32s)
    assert reference_engine.fit_metrics["comm/bytes_down"] - engine.fit_metrics["comm/bytes_down"] == 2 * 108 * 4
    # replies of rounds 0-3 and of the final broadcast: the away node is not sent to again
    assert run.traffic.messages == 3 + 2 + 2 + 2 + 2


def test_flowers_report_of_a_gone_node_drops_its_client_without_waiting():
    settings = FlowerSettings(deadline_s=3600)  # a silent node would hang the test
    method, engine, _ = over_grid(fedavg, StagedGrid(3, gone={2: [FIRST_NODE]}), settings=settings)
    reference, _ = in_process(fedavg, {2: [0], 3: [0]})
    assert_same_state(method, reference, 1e-6)
    assert engine.client_events[0] == [2, 0, "missing", "its SuperNode stopped sending heartbeats"]


def test_a_slow_node_is_dropped_from_the_round_then_serves_again_once_it_answers():
    method, engine, _ = over_grid(fedavg, StagedGrid(3, stalled={1: [FIRST_NODE + 2]}))
    reference, _ = in_process(fedavg, {1: [2]})  # asked again at round 1's end, it answers
    assert_same_state(method, reference, 1e-6)
    assert engine.client_events[-1] == [2, 2, "rejoined", "its node answered again: its client state as it went away"]


def test_a_slow_deepafl_node_back_with_its_state_gets_the_omegas_it_missed():
    def make():
        return DeepAFL(num_layers=4, hidden_dim=16, block_dim=12, seed=1, restate=True)

    method, engine, _ = over_grid(make, StagedGrid(3, stalled={2: [FIRST_NODE + 2]}))  # it misses Ω_1
    assert engine.client_events[-1][:3] == [3, 2, "rejoined"]
    reference, _ = in_process(make, {2: [2]})
    assert_same_state(method, reference, 1e-8)


def test_a_slow_anapfl_node_back_with_its_state_gets_the_global_head_it_missed():
    def make():
        return AnaPFL(hidden_dim=16, lambdas=[0.0, 0.5, 1.0])

    grid = StagedGrid(3, stalled={0: [FIRST_NODE + 1]})
    method, engine, _ = over_grid(make, grid)
    assert [event[:3] for event in engine.client_events] == [[0, 1, "missing"], [1, 1, "rejoined"]]
    from workbench.engines.flower.client_app import STATE_KEY
    from workbench.engines.flower.spec import record_views

    kept = record_views(grid.contexts[FIRST_NODE + 1].state.array_records[STATE_KEY])
    assert torch.equal(kept["global_weight"], method.weight.to(kept["global_weight"].dtype))


def test_a_node_whose_reply_was_lost_on_the_way_is_asked_again_and_serves_from_the_next_round():
    grid = StagedGrid(3)
    grid.staged["expire"] = {1: [FIRST_NODE + 2]}
    method, engine, _ = over_grid(fedavg, grid)
    assert engine.client_events == [[1, 2, "missing", "the message expired before its SuperNode took it"],
                                    [2, 2, "rejoined", "its node answered again: its client state as it went away"]]
    reference, _ = in_process(fedavg, {1: [2]})
    assert_same_state(method, reference, 1e-6)


class StrangerGrid(StagedGrid):
    """Also `stranger[r]`: a node of another federation (4 partitions) holding that partition connects."""

    def stranger(self, partition: int) -> None:
        from flwr.app import Context, RecordDict

        node = self.join(partition)
        self.contexts[node] = Context(run_id=1, node_id=node, state=RecordDict(), run_config={},
                                      node_config={"partition-id": partition, "num-partitions": 4})


def test_a_newcomer_that_answers_wrongly_is_left_out_and_the_fit_goes_on(capsys):
    grid = StrangerGrid(3, silenced={1: [FIRST_NODE + 2]}, joined={1: [0]})  # a second node holding partition 0
    grid.staged["stranger"] = {1: [2]}
    method, engine, _ = over_grid(fedavg, grid)
    assert method.fitted and [event[1:3] for event in engine.client_events] == [[2, "missing"]] * 3
    stranger = "a SuperNode left out: SuperNode 104: the ClientApp on SuperNode 104 failed (query)"
    assert stranger in capsys.readouterr().err


def test_a_restarted_node_serves_its_client_again_from_the_next_round():
    grid = StagedGrid(3, silenced={1: [FIRST_NODE + 2]}, joined={1: [2]})  # killed and restarted in round 1
    method, engine, _ = over_grid(fedavg, grid)
    reference, _ = in_process(fedavg, {1: [2]})
    assert_same_state(method, reference, 1e-6)
    assert [event[:3] for event in engine.client_events] == [[1, 2, "missing"], [2, 2, "rejoined"]]


def test_a_node_back_after_the_last_round_gets_the_final_broadcast_with_every_omega():
    def make():
        return DeepAFL(num_layers=2, hidden_dim=16, block_dim=12, seed=1)

    grid = StagedGrid(3, silenced={2: [FIRST_NODE + 1]}, joined={2: [1]})  # lost and back in the last round
    method, engine, _ = over_grid(make, grid)
    assert engine.client_events[-1][:3] == [3, 1, "rejoined"]
    node = grid.contexts[max(grid.contexts)]  # the new node's client: a fresh half that received Ω_1, Ω_2
    from workbench.engines.flower.client_app import STATE_KEY
    from workbench.engines.flower.spec import record_views

    omega = record_views(node.state.array_records[STATE_KEY])["omega"]
    assert torch.equal(omega, method.omega)


def test_deepafl_restates_over_flower_and_a_rejoined_client_gets_every_omega_again():
    def make():
        return DeepAFL(num_layers=3, hidden_dim=16, block_dim=12, seed=1, schedule="fused")

    grid = StagedGrid(3, silenced={2: [FIRST_NODE]}, joined={2: [0]})
    method, engine, _ = over_grid(make, grid)
    assert method.restates  # clients that may go missing: the recursion's sums asked again every round

    def make_restating():
        return DeepAFL(num_layers=3, hidden_dim=16, block_dim=12, seed=1, schedule="fused", restate=True)

    reference, _ = in_process(make_restating, {2: [0]})
    assert_same_state(method, reference, 1e-8)
    assert engine.client_events[-1][:3] == [3, 0, "rejoined"]


def test_deepafl_told_not_to_restate_ends_the_fit_when_a_fused_round_misses_a_client():
    def make():
        return DeepAFL(num_layers=2, hidden_dim=16, block_dim=12, restate=False)

    method, _, _ = over_grid(make, LoopbackGrid(3))  # no loss: fine, and no restated sums sent
    assert not method.restates
    with pytest.raises(RuntimeError, match=r"restate=false\) recurses round 1's sums.*leave model.restate unset"):
        over_grid(make, StagedGrid(3, silenced={2: [FIRST_NODE]}))


@pytest.mark.parametrize("graph", ["complete", "sparse"])
def test_secure_aggregation_recovers_a_lost_clients_masks_from_the_others(graph):
    # SecAgg+ over 6 clients, each linked to 4 with a threshold of 2: one lost neighbour leaves 3 shares
    federation = Federation(secure_aggregation=True, secure_aggregation_graph=graph, seed=2,
                            **({"secagg_degree": 4, "secagg_threshold": 2} if graph == "sparse" else {}))
    method, engine, _ = over_grid(fedavg, StagedGrid(6, silenced={1: [FIRST_NODE + 1]}), federation)
    reference, _ = in_process(fedavg, {1: [1], 2: [1], 3: [1]}, federation, num_clients=6)
    assert_same_state(method, reference, 1e-6)
    assert engine.fit_metrics["comm/clients_in_round"] == 5


def test_a_sparse_round_that_loses_too_many_neighbours_fails_naming_them():
    federation = Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=2,
                            secagg_threshold=2, seed=2)
    with pytest.raises(RuntimeError, match=r"round 1: .*lost this round: client 1 \(no reply within 0.05 s\)"):
        over_grid(fedavg, StagedGrid(3, silenced={1: [FIRST_NODE + 1]}), federation)


def test_a_round_that_reaches_no_client_ends_the_fit_naming_them():
    grid = StagedGrid(3, silenced={1: [FIRST_NODE + k for k in range(3)]})
    with pytest.raises(RuntimeError, match=r"round 1: no client's reply reached the server \(client 0 \(no reply"):
        over_grid(fedavg, grid)


def test_a_clientapp_that_fails_is_an_error_naming_its_node():
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    class FailingGrid(LoopbackGrid):
        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            for message, i in zip(messages, ids, strict=True):
                if message.metadata.message_type == "train" and message.metadata.dst_node_id == FIRST_NODE + 1:
                    self._replies[i] = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=message)
            return ids

    with pytest.raises(RuntimeError, match=rf"the ClientApp on SuperNode {FIRST_NODE + 1} failed \(train\): boom"):
        over_grid(fedavg, FailingGrid(3))


class ChangingGrid:
    """A grid whose connected node ids go through `views`, one call each (the last one stays)."""

    def __init__(self, *views) -> None:
        self.views = list(views)

    def get_node_ids(self):
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


def test_a_stopped_node_still_counted_is_waited_out_and_too_many_nodes_fail_at_the_deadline():
    # a killed SuperNode counts until its heartbeats lapse: 4 nodes for 3 clients, then 3
    assert wait_for_nodes(ChangingGrid([1, 2, 3, 4], [1, 2, 3, 4], [2, 3, 4]), 3, timeout_s=5) == [2, 3, 4]
    assert wait_for_nodes(ChangingGrid([1], [3, 1, 2]), 3, timeout_s=5) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"4 SuperNodes stayed connected for 0 s but the run has 3 clients"):
        wait_for_nodes(ChangingGrid([1, 2, 3, 4]), 3, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"2 of 3 SuperNodes connected within 0 s"):
        wait_for_nodes(ChangingGrid([1, 2]), 3, timeout_s=0.2)


def test_flower_settings_are_checked():
    with pytest.raises(ValueError, match=r"flower.deadline_s must be a number of seconds > 0"):
        FlowerSettings(deadline_s=0)


# ---- a fit resumed over new nodes ------------------------------------------------------------------
@pytest.mark.parametrize("make", [fedavg, lambda: DeepAFL(num_layers=3, hidden_dim=16, block_dim=12, seed=1)],
                         ids=["FedAvg", "DeepAFL"])
def test_a_fit_resumed_from_its_checkpoint_over_new_nodes_equals_the_uninterrupted_fit(make, tmp_path):
    """The server stops after round 2 (its checkpoint holds the global model and the round); the
    resumed fit is a new Flower run: new nodes, every client's state afresh (DeepAFL resends its
    Ω_t), the same model as the fit that never stopped."""
    method, _, _ = over_grid(make, LoopbackGrid(3))
    first, dm = make(), data()
    stopped = quiet_trainer(callbacks=[InterruptAfter(2)], default_root_dir=tmp_path)
    fit_over_grid(LoopbackGrid(3), stopped, LightningEngine(first), dm, settings=QUICK)
    assert first.round == 2 and not first.fitted
    stopped.save_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    resumed = make()
    engine = LightningEngine(resumed)
    fit_over_grid(LoopbackGrid(3), quiet_trainer(), engine, data(), settings=QUICK,
                  ckpt_path=tmp_path / "last.ckpt", weights_only=False)
    assert resumed.fitted and resumed.round == method.round
    assert_same_state(resumed, method, 1e-8)


@pytest.mark.parametrize("name", [name for name in METHODS if name != "LocalOnly"])  # (no round to miss)
def test_every_method_fits_through_a_client_lost_in_its_first_round_and_back_afresh(name):
    """Whatever a client keeps between rounds, one back on a new node with nothing kept gets again
    what it needs (a seed, Ω_t, W_g: `clients_missed_broadcasts`, `forget_clients`)."""
    build, _ = METHODS[name]
    grid = StagedGrid(3, silenced={0: [FIRST_NODE + 1]}, joined={0: [1]})
    method, dm = build(), data(name=name)
    engine = LightningEngine(method, protocol_of(name))
    fit_over_grid(grid, quiet_trainer(), engine, dm, settings=QUICK)
    assert method.fitted
    assert [event[1:3] for event in engine.client_events] == [[1, "missing"], [1, "rejoined"]]
    assert all(bool(torch.isfinite(value).all()) for value in method.state_dict().values() if value.is_floating_point())
