"""`FlowerClients`: the engine's clients are Flower SuperNodes, one per client.

The same interface as `workbench.engines.local.LocalClients` (`update`, `finish`, `predict`), so
`LightningEngine(method, federation, clients=FlowerClients(grid, method, datamodule))` runs the
same rounds, with the clients' work done by the ClientApps (`client_app`) and their state kept
on their nodes. Instead of `predict` (which would ship test features to the clients), each
client scores its own local test split (`local_accuracy`).
"""
from __future__ import annotations

import contextvars
import dataclasses
import json
import re
import sys
import time
import uuid
from collections.abc import Mapping

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from lightning import Callback
from torch import Tensor

from workbench.data.population import population_of
from workbench.data.sites import check_widths
from workbench.engines.flower.spec import RunSpec, from_record, number, numbers, text, to_record
from workbench.engines.flower_settings import FlowerSettings
from workbench.engines.round import Replies, RoundRequest, add_metrics
from workbench.federation import codec
from workbench.federation.secure_aggregation import ring_sum
from workbench.federation.stages import NO_PROTOCOL, Pipeline
from workbench.methods.base import FederatedMethod

# Flower's errors that mean a node's reply is lost, not that its ClientApp failed: the client is
# dropped from the round (and asked again once its node is connected with nothing pending)
NODE_LOST = {ErrorCode.NODE_UNAVAILABLE: "its SuperNode stopped sending heartbeats",
             ErrorCode.MESSAGE_UNAVAILABLE: "the message expired before its SuperNode took it",
             ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "its reply expired",
             ErrorCode.CLIENT_APP_CRASHED: "its ClientApp process died"}
POLL_S = (0.002, 0.02)  # replies are looked for after 2 ms, then twice as long each time, up to 20 ms

# Set by the deployed ServerApp while its experiment runs: the grid its rounds go over.
DEPLOYED_GRID: contextvars.ContextVar[Grid | None] = contextvars.ContextVar("workbench_grid", default=None)


@dataclasses.dataclass
class FlowerTraffic:
    """What Flower carried (serialized arrays: numpy .npy bytes with their headers and names, all
    clients and rounds) and the clients' own time: each ClientApp handler's, from the message in
    to its reply (the client's work, its state restored and saved), summed over the messages."""

    bytes_up: int = 0
    bytes_down: int = 0
    client_compute_s: float = 0.0  # the handlers' wall seconds, summed
    client_cpu_s: float = 0.0  # the CPU seconds of the handlers' threads, summed
    messages: int = 0  # the train / finish / evaluate messages answered
    builds: int = 0  # of them, those that built the method and the client half (a process's first for a node)
    restores: int = 0  # those that restored the node's state saved by another process
    wall_s: float = 0.0  # the whole engine call (a simulation: Ray's start and stop included)

    def metrics(self) -> dict[str, float]:
        return {"flower/bytes_up": float(self.bytes_up), "flower/bytes_down": float(self.bytes_down),
                "flower/client_compute_s": self.client_compute_s, "flower/client_cpu_s": self.client_cpu_s}


def wait_for_nodes(grid: Grid, count: int, timeout_s: float) -> list[int]:
    """The ids of exactly `count` connected SuperNodes, waiting up to `timeout_s` for them.

    More than `count` may be connected for a while: a SuperNode that stopped counts until its
    heartbeats lapse (Flower: about two of its 30 s intervals), e.g. just after nodes restart."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) != count:
        if time.monotonic() > deadline:
            if len(nodes) > count:
                raise ValueError(f"{len(nodes)} SuperNodes stayed connected for {timeout_s:.0f} s but the run "
                                 f"has {count} clients: start exactly one SuperNode per client")
            raise TimeoutError(
                f"{len(nodes)} of {count} SuperNodes connected within {timeout_s:.0f} s: start one "
                f"flower-supernode per client, with --node-config 'partition-id=k num-partitions={count}'")
        time.sleep(0.1)
    return nodes


def _layout(layout: Mapping) -> dict[str, Tensor]:
    """One client's upload layout (tensors without data) from the one a ClientApp reported."""
    return {name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for name, shape, dtype in zip(layout["names"], layout["shapes"], layout["dtypes"], strict=True)}


class FlowerClients:
    """The run's clients, each on the SuperNode that holds its partition (`partition-id` k).

    A client whose node misses a deadline or is reported gone is dropped from that round
    (`Replies.missing`) and is away from then on: later rounds drop it at once, without waiting.
    It is served again from the round after its node's late reply arrives (a slow node: its state
    kept), or after a SuperNode holding its partition connects (a restarted node, introduced at a
    round's end), starting from a fresh client state (the method forgets what it sent the old
    node: `FederatedMethod.forget_clients`). Both are `rejoined`.

    Args:
        grid: the ServerApp's grid.
        method: the server half (its settings and upload spec; the clients rebuild it from them).
        datamodule: the server's copy of the data module (set up here): the spec the clients
            rebuild it from, and the sample counts each node must confirm.
        settings: the deadlines (`FlowerSettings`).
        pipeline: the fit's protocol (`LightningEngine.pipeline`): the nodes run its client stages
            that keep state (the compression), told at their introduction.
    """

    def __init__(self, grid: Grid, method: FederatedMethod, datamodule, settings: FlowerSettings | None = None,
                 pipeline: Pipeline = NO_PROTOCOL) -> None:
        datamodule.setup("fit")
        self.grid: Grid | None = grid
        self.method = method
        # cross-silo sites (SiteData without files here): the server learns their sizes from the nodes
        self.sites = datamodule.learns_from_nodes
        self.settings = settings or FlowerSettings()
        self.protocol = pipeline.node_settings()  # what the nodes run of the fit's protocol from the start
        self.spec = RunSpec.of(method, datamodule, self.protocol)
        self.digest = self.spec.digest
        self.session = uuid.uuid4().hex  # the nodes' kept state belongs to this fit
        self.traffic = FlowerTraffic()
        self.samples: Tensor | None = None if self.sites else population_of(datamodule).rows_per_client()
        # a site's node's introduction: client -> (its training rows, their width, "SuperNode n, its file")
        self.told: dict[int, tuple[int, int, str]] = {}
        self.nodes: dict[int, int] = {}  # client -> the SuperNode serving it
        self.away: dict[int, str] = {}  # client -> why it has no reachable node
        self.spares: dict[int, int] = {}  # an introduced node serving no one yet -> the client it holds
        self.retired: set[int] = set()  # nodes that lost their client: never asked again
        self._introducing: dict[str, int] = {}  # newcomers' introductions not answered yet: message id -> node
        self._late: dict[str, int] = {}  # messages past their deadline whose reply may still come: id -> node
        self._rejoined: dict[int, bool] = {}  # client served again -> whether its state starts afresh
        nodes = wait_for_nodes(grid, datamodule.num_clients, self.settings.connect_s)
        holders, missing = self._introductions(nodes)
        if missing:
            raise RuntimeError(f"SuperNodes {sorted(missing)} did not answer the fit's first message: "
                               + "; ".join(sorted(set(missing.values()))))
        self.nodes = {client: node for node, client in holders.items()}
        if self.sites:  # every site's rows and their width, as the nodes told them
            check_widths({where: width for _, width, where in self.told.values()})
            datamodule.learn([self.told[k][0] for k in range(datamodule.num_clients)], self.told[0][1])
        population = population_of(datamodule)
        self.samples = population.rows_per_client()
        self.local_tests = population.local_test is not None  # the clients score their own local tests

    # ---- messages -----------------------------------------------------------------------------
    def _grid(self) -> Grid:
        if self.grid is None:
            raise RuntimeError("the Flower run has ended and the clients' state with it: test inside "
                               "`workbench.engines.flower.simulation.fit` (it tests by default)")
        return self.grid

    def _settings(self, **values) -> ConfigRecord:
        """A message's "round" record: the fit's session and the spec's digest (the nodes keep the
        spec itself from their introduction), and the values."""
        return ConfigRecord({"session": self.session, "spec": self.digest, **values})

    def _send(self, contents: Mapping[int, RecordDict], message_type: str, group: str = "",
              deadline_s: float | None = None) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Sends each node (key) its content and waits at most `deadline_s` (default the
        settings' `deadline_s`) for the replies: ({node: reply content}, {node: why its reply
        never came}). A ClientApp that failed is an error; a node that is gone or silent is only
        missing."""
        waiting, missing = self._push(contents, message_type, group)
        replies, lost = self._collect(waiting, message_type, self.settings.deadline_s if deadline_s is None
                                      else deadline_s)
        self._late.update(waiting)  # the replies still due: a late one shows its node alive
        return replies, {**missing, **lost}

    def _push(self, contents: Mapping[int, RecordDict], message_type: str,
              group: str = "") -> tuple[dict[str, int], dict[int, str]]:
        """Sends each node (key) its content: ({message id: node}, {node: why it was not sent})."""
        messages = {node: Message(content, dst_node_id=node, message_type=message_type, group_id=group)
                    for node, content in contents.items()}
        for content in contents.values():
            if "broadcast" in content.array_records:
                self.traffic.bytes_down += content.array_records["broadcast"].count_bytes()
        taken = {str(i) for i in self._grid().push_messages(list(messages.values())) if i}
        waiting = {message.metadata.message_id: node for node, message in messages.items()
                   if message.metadata.message_id in taken}
        missing = {node: "the SuperLink did not take its message" for node, message in messages.items()
                   if message.metadata.message_id not in taken}
        return waiting, missing

    def _collect(self, waiting: dict[str, int], message_type: str, deadline_s: float, counted: bool = True,
                 failed_ok: bool = False) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """The replies to the `waiting` messages ({message id: node}; those answered are taken
        out) that come within `deadline_s` (0: those already there): ({node: reply content},
        {node: why it sent none}); nodes still waiting after a deadline > 0 are missing (and
        stay in `waiting`). `counted`: the replies are the rounds' traffic. A ClientApp's failure
        is an error, or with `failed_ok` (a newcomer's introduction) missing too."""
        counted = counted and message_type != "query"  # not the introductions
        replies: dict[int, RecordDict] = {}
        missing: dict[int, str] = {}
        deadline, pause = time.monotonic() + deadline_s, POLL_S[0]
        while waiting:
            for reply in self._grid().pull_messages(list(waiting)):
                node = waiting.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    why = _reason(reply.error.reason or "")
                    failure = f"the ClientApp on SuperNode {node} failed ({message_type}): {why}"
                    if reply.error.code not in NODE_LOST and not failed_ok:
                        raise RuntimeError(failure)
                    missing[node] = NODE_LOST.get(reply.error.code, failure)
                    continue
                replies[node] = reply.content
                if counted:
                    self._count(reply.content)
            if not waiting or deadline_s == 0:
                break
            if time.monotonic() >= deadline:
                missing.update({node: f"no reply within {deadline_s:g} s" for node in waiting.values()})
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        return replies, missing

    def _count(self, content: RecordDict) -> None:
        report = content.metric_records["report"]
        self.traffic.bytes_up += sum(record.count_bytes() for record in content.array_records.values())
        self.traffic.client_compute_s += number(report, "client_s")
        self.traffic.client_cpu_s += number(report, "client_cpu_s")
        self.traffic.messages += 1
        self.traffic.builds += int(number(report, "built"))
        self.traffic.restores += int(number(report, "restored"))

    def _exchange(self, contents: Mapping[int, RecordDict], message_type: str, group: str,
                  round_index: int | None = None) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Sends each reachable client (key) its content: ({client: reply content}, {client: why it
        sent none}). A client that does not answer is away from then on; an away one is not sent to."""
        missing = {client: self.away[client] for client in contents if client in self.away}
        sent = {self.nodes[client]: content for client, content in contents.items() if client not in self.away}
        by_node, lost = self._send(sent, message_type, group)
        served = {node: client for client, node in self.nodes.items()}
        replies = {}
        for node, content in by_node.items():
            client = int(number(content.metric_records["report"], "client_id"))
            if client != served[node]:
                raise RuntimeError(f"SuperNode {node} answered for client {client} but serves client {served[node]}")
            replies[client] = content
        when = f"round {round_index}" if round_index is not None else message_type
        for node, why in lost.items():
            client = served[node]
            missing[client] = why
            self.away[client] = f"its SuperNode was lost in {when} ({why})"
        return replies, missing

    def _introduction(self) -> RecordDict:
        return RecordDict({"spec": self.spec.to_record(), "round": self._settings()})  # the one with the spec

    def _introductions(self, nodes: list[int]) -> tuple[dict[int, int], dict[int, str]]:
        """({node: the client it holds}, {node: why it did not answer}) from each node's own
        answer, waiting at most `connect_s` (a node's first message may set up its data: a
        feature extraction); see `_holders`."""
        replies, missing = self._send(dict.fromkeys(nodes, self._introduction()), "query",
                                      deadline_s=self.settings.connect_s)
        self._late.clear()  # a node that does not answer its introduction ends the fit (or is asked again)
        holders, refused = self._holders(replies)
        if refused:
            raise ValueError(refused[0])
        return holders, missing

    def _holders(self, replies: Mapping[int, RecordDict]) -> tuple[dict[int, int], list[str]]:
        """({node: the client it holds}, why each other node was refused) from the nodes' answers to
        their introduction; each must hold the `samples[k]` training samples the server's copy of
        the data gives its client k (sites: what they told when introduced first, `told`), and
        no two of them the same client."""
        holders: dict[int, int] = {}
        refused: list[str] = []
        for node, reply in sorted(replies.items()):
            report = reply.metric_records["report"]
            client = int(number(report, "client_id"))
            held = int(number(report, "num_samples"))
            if client in holders.values():
                other = next(n for n, c in holders.items() if c == client)
                refused.append(f"SuperNodes {other} and {node} both hold partition-id {client}: "
                               "give each SuperNode its own")
            elif self.samples is not None and held != int(self.samples[client]):
                expected = int(self.samples[client])
                refused.append(f"SuperNode {node} holds {held} training samples of client {client} but "
                               + (f"the site held {expected} when the fit began: its file changed" if self.sites else
                                  f"the server's data gives it {expected}: the machines load different data"))
            else:
                holders[node] = client
                if self.samples is None:
                    site = reply.config_records.get("site")
                    where = f"SuperNode {node}" + (f", {text(site, 'data-path')}" if site is not None else "")
                    self.told[client] = (held, int(number(report, "feature_dim")), where)
        return holders, refused

    def _admit(self) -> None:
        """Brings away clients back, without waiting, at a round's end: one whose node answers
        (its late reply; or the introduction it is asked again once connected with no
        introduction pending: a node that recovered, or restarted under its old id) serves again
        from the next round on that node; a SuperNode that connected since the fit began is introduced
        (a new node may take long to set up its data: its answer is read at a later round's end)
        and, holding an away client's partition, serves it from the next round. A newcomer that
        answers wrongly (other data, a partition held twice, a failure) is named and left out."""
        late, _ = self._collect(self._late, "late", deadline_s=0, counted=False, failed_ok=True)
        for client, node in list(self.nodes.items()):
            if node in late and client in self.away:
                del self.away[client]
                self._rejoined[client] = False
        if not self.away and not self._introducing:
            return
        connected = set(self._grid().get_node_ids())
        asked = set(self._introducing.values())  # (not its late train message: a restart under its old id drops it)
        again = {self.nodes[client] for client in self.away} - self.retired - asked
        known = set(self.nodes.values()) | set(self.spares) | self.retired | asked
        if ask := sorted((connected - known) | (again & connected)):
            waiting, _ = self._push(dict.fromkeys(ask, self._introduction()), "query")
            self._introducing.update(waiting)
        replies, failed = self._collect(self._introducing, "query", deadline_s=0, failed_ok=True)
        holders, refused = self._holders(replies)
        for why in [*refused, *(f"SuperNode {node}: {why}" for node, why in failed.items())]:
            print(f"a SuperNode left out: {why}", file=sys.stderr)
        self.retired.update(set(replies) - set(holders))
        served = {node: client for client, node in self.nodes.items()}
        for node, client in holders.items():
            if served.get(node) == client:  # its own node, answering again
                if client in self.away:
                    del self.away[client]
                    self._rejoined[client] = False
            else:
                self.spares[node] = client
        for node, client in list(self.spares.items()):
            if client in self.away:
                del self.away[client], self.spares[node]
                self.retired.add(self.nodes[client])  # its old node: never asked again
                self.nodes[client] = node
                self._rejoined[client] = True

    # ---- the transport's interface ------------------------------------------------------------
    def rejoined(self) -> dict[int, bool]:
        """The clients served again since the last call -> whether on a new SuperNode (their state
        afresh) rather than their own node (its state as it was: it did nothing while away)."""
        clients, self._rejoined = dict(sorted(self._rejoined.items())), {}
        return clients

    def update(self, request: RoundRequest) -> Replies:
        """One round on the cohort's nodes: every client computes (its state stays current); only
        the survivors' uploads count, combined in client order (sums; stacks concatenated). A
        survivor whose reply does not come is missing."""
        if request.pipeline.node_settings() != self.protocol:
            raise ValueError(f"the SuperNodes were introduced to a fit under another protocol "
                             f"({Pipeline.of(self.protocol).line() or 'none of its parts'} on the clients) than "
                             f"this round's: build FlowerClients with the fit's pipeline (engine.pipeline)")
        start = time.perf_counter()
        survivors, lost = request.survivors.tolist(), request.lost.tolist()
        secure_settings = "" if request.secure is None else json.dumps(request.secure.settings())
        clip_norm = -1.0 if request.clip_norm is None else float(request.clip_norm)
        down = to_record(request.broadcast)  # dense, as comm/bytes_down counts it (no broadcast is symmetric)
        contents = {client: RecordDict({"broadcast": down, "round": self._settings(
            round=request.round_index, lost=client in lost, secure=secure_settings, clip_norm=clip_norm)})
            for client in sorted(survivors + lost)}
        not_sent = sum(client in self.away for client in contents)  # away already: no message goes to them
        replies_by_client, missing = self._exchange(contents, "train", str(request.round_index), request.round_index)

        replies = Replies(missing={client: why for client, why in missing.items() if client in survivors},
                          not_sent=not_sent)
        symmetric = codec.symmetric_names(request.spec)
        parts = []
        for client in sorted(set(survivors) - set(missing)):  # a fixed order: the sum does not depend on arrival
            reply = replies_by_client[client]
            add_metrics(replies.metric_sums, numbers(reply.metric_records["metrics"]))
            replies.bytes_up += int(number(reply.metric_records["report"], "bytes_up"))
            if request.secure is None:
                parts.append(codec.unpack(from_record(reply.array_records["uploads"]), symmetric))
            else:
                masked = from_record(reply.array_records["masked"])["masked"]
                replies.masked = masked if replies.masked is None else ring_sum([replies.masked, masked])
                replies.layout = replies.layout or _layout(json.loads(text(reply.config_records["layout"], "json")))
        if parts:
            replies.uploads = {name: value.to(_device(self.method))
                               for name, value in codec.combine(parts, request.spec).items()}
        self._admit()
        replies.client_s = time.perf_counter() - start  # the server's wait: transport included
        return replies

    def finish(self, final_broadcast: Mapping[str, Tensor]) -> tuple[dict[str, float], float]:
        """Every client receives the final broadcast and does its local work, keeping its state:
        (metric sums over the clients, the server's wait when any client had work, else 0). A
        client that does not answer does without it (named on stderr)."""
        start = time.perf_counter()
        down = to_record(final_broadcast)
        contents = {client: RecordDict({"broadcast": down, "round": self._settings()}) for client in sorted(self.nodes)}
        replies, missing = self._exchange(contents, "train.finish", "finish")
        _warn_missing("the final broadcast", missing)
        metric_sums: dict[str, float] = {}
        for reply in replies.values():
            add_metrics(metric_sums, numbers(reply.metric_records["metrics"]))
        worked = any(number(reply.metric_records["report"], "worked") for reply in replies.values())
        return metric_sums, (time.perf_counter() - start) if worked else 0.0

    def local_accuracy(self) -> tuple[Tensor, Tensor]:
        """Each client's own model on its own local test split, scored on its node:
        (correct (K,), total (K,)) int64, zeros without the personalized protocol (and for a
        client that does not answer, named on stderr)."""
        correct = torch.zeros(self.method.num_clients, dtype=torch.long)
        total = torch.zeros_like(correct)
        if not self.local_tests:
            return correct, total
        contents = {client: RecordDict({"round": self._settings()}) for client in sorted(self.nodes)}
        replies, missing = self._exchange(contents, "evaluate", "local_test")
        _warn_missing("the local tests", missing)
        for client, reply in replies.items():
            report = reply.metric_records["report"]
            correct[client], total[client] = int(number(report, "correct")), int(number(report, "total"))
        return correct, total

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        raise NotImplementedError("over Flower each client scores its own local test split on its node "
                                  "(FlowerClients.local_accuracy); test features are not sent to clients")

    def close(self) -> None:
        """The run ended: the nodes and their state are gone."""
        self.grid = None


def _reason(reason: str) -> str:
    """A ClientApp's exception as Flower reports it (`<class 'pkg.SomeError'>:<'its message'>`) in
    plain words: `SomeError: its message`."""
    raised = re.fullmatch(r"<class '(?:[\w]+\.)*(\w+)'>:<['\"](.*)['\"]>", reason.strip(), re.S)
    return f"{raised[1]}: {raised[2]}" if raised else reason


def _warn_missing(what: str, missing: Mapping[int, str]) -> None:
    if missing:
        print(f"{what} reached no reply from: " + "; ".join(f"client {client} ({why})"
                                                            for client, why in sorted(missing.items())),
              file=sys.stderr)


def _device(method: FederatedMethod) -> torch.device:
    tensor = next(iter(method.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class LogTraffic(Callback):
    """Adds Flower's traffic to the engine's metrics of every round (logged with them)."""

    def __init__(self, traffic: FlowerTraffic) -> None:
        self.traffic = traffic

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.fit_metrics.update(self.traffic.metrics())
