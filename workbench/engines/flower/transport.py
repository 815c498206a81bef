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
import time
import uuid
from collections.abc import Mapping

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from lightning import Callback
from torch import Tensor

from workbench.engines.flower.spec import RunSpec, from_record, number, numbers, text, to_record
from workbench.engines.round import Replies, RoundRequest, add_metrics
from workbench.federation import codec
from workbench.federation.secure_aggregation import ring_sum
from workbench.methods.base import FederatedMethod

NODE_WAIT_S = 600.0  # how long the ServerApp waits for every SuperNode to connect

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


def checked(replies, expected: int) -> list[Message]:
    """The replies, or one error naming the ClientApp that failed or the replies that are missing."""
    replies = list(replies)
    for reply in replies:
        if reply.has_error():
            raise RuntimeError(f"the ClientApp on SuperNode {reply.metadata.src_node_id} failed: "
                               f"{reply.error.reason}")
    if len(replies) != expected:
        raise RuntimeError(f"{expected - len(replies)} of {expected} SuperNodes did not reply")
    return replies


def wait_for_nodes(grid: Grid, count: int, timeout_s: float = NODE_WAIT_S) -> list[int]:
    """The ids of exactly `count` connected SuperNodes, waiting up to `timeout_s` for them."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(nodes)} of {count} SuperNodes connected within {timeout_s:.0f} s: start one "
                f"flower-supernode per client, with --node-config 'partition-id=k num-partitions={count}'")
        time.sleep(0.1)
    if len(nodes) > count:
        raise ValueError(f"{len(nodes)} SuperNodes are connected but the run has {count} clients: "
                         "start exactly one SuperNode per client")
    return nodes


def _layout(layout: Mapping) -> dict[str, Tensor]:
    """One client's upload layout (tensors without data) from the one a ClientApp reported."""
    return {name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for name, shape, dtype in zip(layout["names"], layout["shapes"], layout["dtypes"], strict=True)}


class FlowerClients:
    """The run's clients, each on the SuperNode that holds its partition (`partition-id` k).

    Args:
        grid: the ServerApp's grid.
        method: the server half (its settings and upload spec; the clients rebuild it from them).
        datamodule: the server's copy of the data module (set up here): the spec the clients
            rebuild it from, and the sample counts each node must confirm.
        node_wait_s: how long to wait for every SuperNode to connect.
    """

    def __init__(self, grid: Grid, method: FederatedMethod, datamodule, node_wait_s: float = NODE_WAIT_S) -> None:
        datamodule.setup("fit")
        self.grid: Grid | None = grid
        self.method, self.datamodule = method, datamodule
        self.spec = RunSpec.of(method, datamodule)
        self.digest = self.spec.digest
        self.session = uuid.uuid4().hex  # the nodes' kept state belongs to this fit
        self.traffic = FlowerTraffic()
        nodes = wait_for_nodes(grid, datamodule.num_clients, node_wait_s)
        samples = torch.bincount(datamodule.train_client_ids, minlength=datamodule.num_clients)
        self.nodes = self._introductions(nodes, samples)

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

    def _exchange(self, clients: list[int], contents: list[RecordDict], message_type: str,
                  group: str) -> dict[int, RecordDict]:
        """Sends each client its content; the replies' contents by client id, all checked."""
        messages = [Message(content, dst_node_id=self.nodes[client], message_type=message_type, group_id=group)
                    for client, content in zip(clients, contents, strict=True)]
        for content in contents:
            if "broadcast" in content.array_records:
                self.traffic.bytes_down += content.array_records["broadcast"].count_bytes()
        replies = {}
        for reply in checked(self._grid().send_and_receive(messages), len(messages)):
            content = reply.content
            report = content.metric_records["report"]
            replies[int(number(report, "client_id"))] = content
            self.traffic.bytes_up += sum(record.count_bytes() for record in content.array_records.values())
            self.traffic.client_compute_s += number(report, "client_s")
            self.traffic.client_cpu_s += number(report, "client_cpu_s")
            self.traffic.messages += 1
            self.traffic.builds += int(number(report, "built"))
            self.traffic.restores += int(number(report, "restored"))
        if sorted(replies) != sorted(clients):
            raise RuntimeError(f"{message_type} {group}: asked clients {sorted(clients)}, got replies from "
                               f"{sorted(replies)}")
        return replies

    def _introductions(self, nodes: list[int], samples: Tensor) -> dict[int, int]:
        """client id -> the SuperNode that holds it, from every node's own answer; each must hold
        the `samples[k]` training samples the server's copy of the data gives client k."""
        content = RecordDict({"spec": self.spec.to_record(), "round": self._settings()})  # the one with the spec
        messages = [Message(content, dst_node_id=node, message_type="query") for node in nodes]
        holders: dict[int, int] = {}
        for reply in checked(self._grid().send_and_receive(messages), len(nodes)):
            report = reply.content.metric_records["report"]
            client, node = int(number(report, "client_id")), reply.metadata.src_node_id
            if client in holders:
                raise ValueError(f"SuperNodes {holders[client]} and {node} both hold partition-id {client}: "
                                 "give each SuperNode its own")
            held = int(number(report, "num_samples"))
            if held != int(samples[client]):
                raise ValueError(f"SuperNode {node} holds {held} training samples of client {client} but the "
                                 f"server's data gives it {int(samples[client])}: the machines load different data")
            holders[client] = node
        return holders

    # ---- the transport's interface ------------------------------------------------------------
    def update(self, request: RoundRequest) -> Replies:
        """One round on the cohort's nodes: every client computes (its state stays current); only
        the survivors' uploads count, combined in client order (sums; stacks concatenated)."""
        start = time.perf_counter()
        survivors, lost = request.survivors.tolist(), request.lost.tolist()
        secure_settings = "" if request.secure is None else json.dumps(request.secure.settings())
        clip_norm = -1.0 if request.clip_norm is None else float(request.clip_norm)
        down = to_record(request.broadcast)  # dense, as comm/bytes_down counts it (no broadcast is symmetric)
        clients = sorted(survivors + lost)
        contents = [RecordDict({"broadcast": down, "round": self._settings(
            round=request.round_index, lost=client in lost, secure=secure_settings, clip_norm=clip_norm)})
            for client in clients]
        replies_by_client = self._exchange(clients, contents, "train", str(request.round_index))

        replies = Replies()
        symmetric = codec.symmetric_names(request.spec)
        for client in sorted(survivors):  # a fixed order: the combination does not depend on arrival
            reply = replies_by_client[client]
            add_metrics(replies.metric_sums, numbers(reply.metric_records["metrics"]))
            replies.bytes_up += int(number(reply.metric_records["report"], "bytes_up"))
            if request.secure is None:
                uploads = codec.unpack(from_record(reply.array_records["uploads"]), symmetric)
                replies.uploads = codec.combine(replies.uploads if replies.uploads is not None else {}, uploads,
                                                request.spec)
            else:
                masked = from_record(reply.array_records["masked"])["masked"]
                replies.masked = masked if replies.masked is None else ring_sum([replies.masked, masked])
                replies.layout = replies.layout or _layout(json.loads(text(reply.config_records["layout"], "json")))
        if replies.uploads is not None:
            replies.uploads = {name: value.to(_device(self.method)) for name, value in replies.uploads.items()}
        replies.client_s = time.perf_counter() - start  # the server's wait: transport included
        return replies

    def finish(self, final_broadcast: Mapping[str, Tensor]) -> tuple[dict[str, float], float]:
        """Every client receives the final broadcast and does its local work, keeping its state:
        (metric sums over the clients, the server's wait when any client had work, else 0)."""
        start = time.perf_counter()
        clients = sorted(self.nodes)
        down = to_record(final_broadcast)
        contents = [RecordDict({"broadcast": down, "round": self._settings()}) for _ in clients]
        replies = self._exchange(clients, contents, "train.finish", "finish")
        metric_sums: dict[str, float] = {}
        for client in clients:
            add_metrics(metric_sums, numbers(replies[client].metric_records["metrics"]))
        worked = any(number(replies[client].metric_records["report"], "worked") for client in clients)
        return metric_sums, (time.perf_counter() - start) if worked else 0.0

    def local_accuracy(self) -> tuple[Tensor, Tensor]:
        """Each client's own model on its own local test split, scored on its node:
        (correct (K,), total (K,)) int64, zeros without the personalized protocol."""
        correct = torch.zeros(self.method.num_clients, dtype=torch.long)
        total = torch.zeros_like(correct)
        if getattr(self.datamodule, "local_test_client_ids", None) is None:
            return correct, total
        clients = sorted(self.nodes)
        contents = [RecordDict({"round": self._settings()}) for _ in clients]
        for client, reply in self._exchange(clients, contents, "evaluate", "local_test").items():
            report = reply.metric_records["report"]
            correct[client], total[client] = int(number(report, "correct")), int(number(report, "total"))
        return correct, total

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        raise NotImplementedError("over Flower each client scores its own local test split on its node "
                                  "(FlowerClients.local_accuracy); test features are not sent to clients")

    def close(self) -> None:
        """The run ended: the nodes and their state are gone."""
        self.grid = None


def _device(method: FederatedMethod) -> torch.device:
    tensor = next(iter(method.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class LogTraffic(Callback):
    """Adds Flower's traffic to the engine's metrics of every round (logged with them)."""

    def __init__(self, traffic: FlowerTraffic) -> None:
        self.traffic = traffic

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.fit_metrics.update(self.traffic.metrics())
