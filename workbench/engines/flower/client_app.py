"""The ClientApp: one node serves one client, keeping the client's state between messages.

Every message carries the run's spec (`RunSpec`); the handler rebuilds the method from it (its
settings, never learned state), builds the client half for this node's client k
(`partition-id`), restores the half's buffers and parameters from the node's own
`context.state` (Flower keeps it per node and run; it never leaves the node), does the work and
saves the state back. The data module is set up once per process and reused.

Message types (content records in quotes):
- `query`: which client this node is and how many training and local test rows it holds;
- `train`: one round: "broadcast" (the plan's broadcast), "round" (round index, session, whether
  this client's upload is lost, the secure aggregation settings as JSON or "", client-level DP's
  clip norm or -1); the client runs the protocol's client step (`workbench.federation.client_step`,
  as the in-process clients do) and replies "uploads" (packed: symmetric uploads as upper
  triangles) or, under secure aggregation, "masked" (the ring vector) with "layout" (names,
  shapes, dtypes); "metrics" (sums) and "report" (with its message's bytes on the wire);
- `train.finish`: the final broadcast; the client's local work (`ClientHalf.finish`);
- `evaluate`: the client scores its own local test split with `half.predict`: correct / total.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor

from workbench.engines.flower.spec import RunSpec, flag, from_record, half_state, number, restore_half, text, to_record
from workbench.federation import codec
from workbench.federation.client_step import client_step, wire_spec
from workbench.federation.secure_aggregation import SecureAggregator
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Problem

STATE_KEY, NODE_KEY = "workbench.client_state", "workbench.node"

app = ClientApp()


@dataclasses.dataclass
class ClientData:
    """Client k's rows. features (n_k, *input_shape), labels (n_k,); local_test_* (t_k, ...) or
    None without the personalized protocol."""

    client: int
    problem: Problem
    features: Tensor
    labels: Tensor
    batch_size: int
    local_test_features: Tensor | None = None
    local_test_labels: Tensor | None = None

    def cohort(self) -> Cohort:
        n, k = len(self.labels), self.client
        return Cohort(self.features, self.labels, torch.full((n,), k, dtype=torch.long),
                      torch.tensor([k]), torch.arange(n), self.batch_size)


_datamodules: dict[tuple[str, str], Any] = {}  # (data class, args) -> set-up data module, one per process


def _rows(ids: Tensor, client: int) -> slice:
    """Client `client`'s rows of `ids` (ordered by client): one slice."""
    lo, hi = torch.searchsorted(ids, torch.tensor([client, client + 1])).tolist()
    return slice(lo, hi)


def client_data(spec: RunSpec, client: int, num_partitions: int) -> ClientData:
    """Client `client`'s rows of the spec's data (the data module is set up once per process)."""
    key = (spec.data, spec.data_args)
    if key not in _datamodules:
        _datamodules.clear()
        datamodule = spec.build_data()
        datamodule.setup("fit")
        _datamodules[key] = datamodule
    data = _datamodules[key]
    if num_partitions != data.num_clients:
        raise ValueError(f"the federation has num-partitions = {num_partitions} in its node config but the "
                         f"run's data has num_clients = {data.num_clients}: start one SuperNode per client")
    if not 0 <= client < num_partitions:
        raise ValueError(f"partition-id {client} is outside [0, {num_partitions})")
    problem = Problem(tuple(getattr(data, "input_shape", (data.feature_dim,))), data.num_classes, data.num_clients)
    rows = _rows(data.train_client_ids, client)
    share = ClientData(client, problem, data.train_features[rows], data.train_labels[rows], data.hparams.batch_size)
    if getattr(data, "local_test_client_ids", None) is not None:
        rows = _rows(data.local_test_client_ids, client)
        share.local_test_features, share.local_test_labels = (data.local_test_features[rows],
                                                              data.local_test_labels[rows])
    return share


@dataclasses.dataclass
class Node:
    """What one message's handler works with."""

    spec: RunSpec
    method: FederatedMethod
    half: ClientHalf
    data: ClientData
    context: Context
    session: str

    def save(self) -> None:
        """The half's state back into the node's state, for the next message."""
        self.context.state[STATE_KEY] = to_record(half_state(self.half))
        self.context.state[NODE_KEY] = ConfigRecord({"session": self.session})


def node(message: Message, context: Context) -> Node:
    """Rebuild the method and this node's client half from the spec, with its kept state."""
    spec = RunSpec.from_record(message.content.config_records["spec"])
    data = client_data(spec, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    method = spec.build_method()
    method.setup(data.problem)
    half = method.client_half()
    half.setup_clients(torch.tensor([data.client]), len(data.labels))
    session = text(message.content.config_records["round"], "session")
    kept = context.state.config_records.get(NODE_KEY)
    if kept is not None and str(kept["session"]) == session and STATE_KEY in context.state.array_records:
        restore_half(half, from_record(context.state.array_records[STATE_KEY]))
    return Node(spec, method, half, data, context, session)


def _report(**values: float) -> MetricRecord:
    return MetricRecord({name: float(value) if isinstance(value, float) else int(value)
                         for name, value in values.items()})


@app.query()
def introduce(message: Message, context: Context) -> Message:
    """Which client this node is, and how many training (and local test) rows it holds."""
    spec = RunSpec.from_record(message.content.config_records["spec"])
    data = client_data(spec, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    tests = 0 if data.local_test_labels is None else len(data.local_test_labels)
    report = _report(client_id=data.client, num_samples=len(data.labels), num_local_test=tests)
    return Message(RecordDict({"report": report}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of this client: the client step on the broadcast and its own data and state."""
    here = node(message, context)
    settings = message.content.config_records["round"]
    round_index, lost, secure = int(number(settings, "round")), flag(settings, "lost"), text(settings, "secure")
    clip_norm = number(settings, "clip_norm") if number(settings, "clip_norm") >= 0 else None  # -1: no clipping
    broadcast = from_record(message.content.array_records["broadcast"])
    start = time.perf_counter()
    sent = client_step(here.half, here.method.uploads, round_index, broadcast, here.data.cohort(), clip_norm)
    content = RecordDict()
    bytes_up = 0
    if lost:  # dropped: it computed (its state stays current), but nothing it sends arrives
        pass
    elif secure:
        options = json.loads(secure)
        aggregator = SecureAggregator.from_settings(options, round_index)
        content["masked"] = to_record({"masked": aggregator.masked_upload(here.data.client, sent.uploads)})
        layout = {"names": list(sent.uploads), "shapes": [list(v.shape) for v in sent.uploads.values()],
                  "dtypes": [str(v.dtype).removeprefix("torch.") for v in sent.uploads.values()]}
        content["layout"] = ConfigRecord({"json": json.dumps(layout)})
        bytes_up = aggregator.bytes_per_client
    else:
        symmetric = codec.symmetric_names(wire_spec(here.method.uploads, clip_norm is not None))
        content["uploads"] = to_record(codec.pack(sent.uploads, symmetric))
        bytes_up = sent.bytes_up
    seconds = time.perf_counter() - start
    here.save()
    if not lost:
        content["metrics"] = MetricRecord(dict(sent.metrics))
    content["report"] = _report(client_id=here.data.client, client_s=seconds, bytes_up=bytes_up)
    return Message(content, reply_to=message)


@app.train("finish")
def finish(message: Message, context: Context) -> Message:
    """The final broadcast: the client's local work on it (`ClientHalf.finish`), state kept."""
    here = node(message, context)
    worked = type(here.half).finish is not ClientHalf.finish
    start = time.perf_counter()
    final = from_record(message.content.array_records["broadcast"])
    metrics = here.half.finish(final, here.data.cohort()) if worked else {}
    seconds = time.perf_counter() - start
    here.save()
    content = RecordDict({"metrics": MetricRecord({name: float(value) for name, value in metrics.items()}),
                          "report": _report(client_id=here.data.client, client_s=seconds, worked=int(worked))})
    return Message(content, reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """This client's own model (`half.predict`) on its own local test split: correct / total."""
    here = node(message, context)
    features, labels = here.data.local_test_features, here.data.local_test_labels
    correct = total = 0
    start = time.perf_counter()
    if features is not None and labels is not None and len(labels):
        size = here.data.batch_size
        with torch.no_grad():
            for lo in range(0, len(labels), size):
                rows = slice(lo, lo + size)
                ids = torch.full((len(labels[rows]),), here.data.client, dtype=torch.long)
                logits = here.half.predict(features[rows], ids)
                correct += int(logits.argmax(dim=1).eq(labels[rows]).sum())
        total = len(labels)
    report = _report(client_id=here.data.client, correct=correct, total=total,
                     client_s=time.perf_counter() - start)
    return Message(RecordDict({"report": report}), reply_to=message)
