"""The ClientApp: one node serves one client, keeping the client's state between messages.

The fit's first message to a node (`query`) carries the run's spec (`RunSpec`); the node keeps
it in its own `context.state` (Flower keeps that per node and run; it never leaves the node).
Every later message carries only what its round needs, with the fit's session and the spec's
digest. The first message after that builds the method from the kept spec (its settings, never
learned state) and the client half for this node's client k (`partition-id`), with the state the
protocol's client stages keep (the compressor's error feedback, `RunSpec.protocol`); the process keeps
both (`Node`, per run and node) for the messages after, so a message neither re-parses the
spec nor rebuilds anything. After its work a message saves the half's buffers and parameters
back into `context.state`, with a token: a process whose half does not hold the saved state
(a Ray simulation sends a node's messages to any of its actors; a deployed SuperNode starts a
process per message) starts from a fresh half and restores the saved one. The data module is
set up once per process and reused.

Message types (content records in quotes; "round" always holds the session and the spec's digest):
- `query`: "spec"; which client this node is, how many training and local test rows it holds and
  their width (and a site's data-path: `SiteData`);
- `train`: one round: "broadcast" (the plan's broadcast), "round" (round index, whether
  this client's upload is lost, the secure aggregation settings as JSON or "", client-level DP's
  clip norm or -1); the client runs the protocol's client step (`workbench.federation.client_step`,
  as the in-process clients do) and replies "uploads" (packed: symmetric uploads as upper
  triangles) or, under secure aggregation, "masked" (the ring vector) with "layout" (names,
  shapes, dtypes); "metrics" (sums) and "report" (with its message's bytes on the wire);
- `train.finish`: the final broadcast; the client's local work (`ClientHalf.finish`);
- `evaluate`: the client scores its own local test split with `half.predict`: correct / total.

Every reply's "report" holds the handler's own seconds, wall (`client_s`) and CPU of its thread
(`client_cpu_s`): everything the node did for the message, state restored and saved included.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from workbench.data.population import ClientData
from workbench.engines.flower.spec import (
    RunSpec,
    flag,
    from_record,
    half_state,
    number,
    record_views,
    restore_half,
    text,
    to_record,
)
from workbench.federation import codec
from workbench.federation.client_step import client_step
from workbench.federation.protocol import Federation
from workbench.federation.secure_aggregation import SecureAggregator
from workbench.federation.stages import Pipeline
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Problem

STATE_KEY, NODE_KEY = "workbench.client_state", "workbench.node"

#: Flower's notices that say nothing to a workbench run, each with why
QUIET_FLOWER = (
    "`run_simulation` function is deprecated",  # `flwr run` (its successor) needs an app project; this is the fit's
    "Manually terminating",  # every Ray actor says it at the simulation's normal end
)


def _said_something(record: logging.LogRecord) -> bool:
    return not any(notice in record.getMessage() for notice in QUIET_FLOWER)


def quiet_flower() -> None:
    """Flower's logger without QUIET_FLOWER's notices (called on this module's import: in each
    Ray worker too, which imports it to run the ClientApp), and the DeprecationWarnings flwr's Ray
    transport turns on for everyone (`filterwarnings("once")` on its import) off again for
    Lightning's own calls."""
    logger = logging.getLogger("flwr")
    if _said_something not in logger.filters:
        logger.addFilter(_said_something)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="lightning.pytorch.cli")


quiet_flower()
app = ClientApp()


@dataclasses.dataclass(frozen=True)
class NodeData:
    """What a node serves: its client's share of the data (`ClientData`), the problem the method is
    set up for, and the rows a chunked computation or an evaluation batch takes."""

    share: ClientData
    problem: Problem
    batch_size: int

    @property
    def client(self) -> int:
        return self.share.client

    def cohort(self) -> Cohort:
        """Its training rows as the client half reads them."""
        rows, k = self.share.train, self.client
        return Cohort(rows.features, rows.labels, torch.full((len(rows),), k, dtype=torch.long),
                      torch.tensor([k]), torch.arange(len(rows)), self.batch_size)


_datamodules: dict[tuple[str, str], Any] = {}  # (data class, args) -> its data module, one per process


def client_data(spec: RunSpec, client: int, num_partitions: int, path: str | None = None) -> NodeData:
    """Client `client`'s share of the spec's data, built for that client alone where the data
    allows (`FederatedDataModule.population(client)`: backbone features read or extracted for its
    rows only), or read from the node's own file (`path`, its node config's data-path: `SiteData`,
    a cross-silo site); the data module is kept per process, for the other nodes a process serves."""
    key = (spec.data, spec.data_args)
    if key not in _datamodules:
        _datamodules.clear()
        _datamodules[key] = spec.build_data()
    datamodule = _datamodules[key]
    if num_partitions != datamodule.num_clients:
        raise ValueError(f"the federation has num-partitions = {num_partitions} in its node config but the "
                         f"run's data has {datamodule.num_clients} clients: start one SuperNode per client")
    if not 0 <= client < num_partitions:
        raise ValueError(f"partition-id {client} is outside [0, {num_partitions})")
    data = datamodule.population(client, path=path)
    return NodeData(data.client(client), Problem.of(data), data.batch_size)  # (the data's tail too)


def _node_data(spec: RunSpec, context: Context) -> NodeData:
    path = context.node_config.get("data-path")
    return client_data(spec, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                       None if path is None else str(path))


@dataclasses.dataclass
class Node:
    """One node's client of one fit, kept by this process between messages."""

    session: str
    digest: str
    method: FederatedMethod
    half: ClientHalf
    data: NodeData
    protocol: Federation  # what the node runs of the protocol from the start (`RunSpec.protocol`)
    holds: str | None = None  # the token of the node's saved state the half holds; None: fresh
    built: bool = True  # this message built the method and the half
    restored: bool = False  # this message restored the node's saved state into a fresh half
    # each state tensor's (storage, version) when the half was built or last saved or restored:
    # one that has not moved since is not copied again
    marks: dict[str, tuple] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.marks = _marks(self.half)

    def fresh_half(self) -> None:
        self.half = client_half(self.method, self.data, self.protocol)
        self.holds = None
        self.marks = _marks(self.half)

    def events(self) -> dict[str, int]:
        """What this message cost beyond the client's work, for its report."""
        return {"built": int(self.built), "restored": int(self.restored)}

    def save(self, context: Context) -> None:
        """The half's state into the node's state, for the next message (whichever process gets
        it). Only what moved is copied: a tensor unchanged since the half was built (DeepAFL's
        random layers, rebuilt from the seed by any fresh half) is left out, one unchanged since
        the last save keeps its saved bytes."""
        kept = context.state.array_records.get(STATE_KEY)
        marks = _marks(self.half)
        arrays = OrderedDict()
        for name, value in half_state(self.half).items():
            if marks[name] != self.marks.get(name):
                arrays[name] = to_record({name: value})[name]
            elif kept is not None and name in kept:
                arrays[name] = kept[name]
        self.marks, self.holds = marks, uuid.uuid4().hex
        context.state[STATE_KEY] = ArrayRecord(arrays)
        context.state.config_records[NODE_KEY]["state"] = self.holds


def client_half(method: FederatedMethod, data: NodeData, protocol: Federation) -> ClientHalf:
    """A fresh half serving the node's client, with the state its protocol keeps per client."""
    half = method.client_half()
    half.setup_clients(torch.tensor([data.client]), len(data.share.train))
    Pipeline.for_node(None, protocol).keep_state(half, method.uploads)
    return half


def _marks(half: ClientHalf) -> dict[str, tuple]:
    """Each state tensor's identity, storage and in-place version: one of them changes when the
    tensor does (a write through `.data` aside, which the client halves do not make)."""
    return {name: (id(value), value.data_ptr(), value._version, value.dtype, tuple(value.shape))
            for name, value in half_state(half).items()}


# (run id, node id) -> its client; a process keeps one fit's (a deployed SuperNode runs each
# message in a process of its own: there the node's context.state is all that carries over)
_nodes: dict[tuple[int, int], Node] = {}


def node(message: Message, context: Context) -> Node:
    """This node's client for the message's fit: kept by this process, or built from the spec the
    node kept; holding the node's saved state."""
    settings = message.content.config_records["round"]
    session, digest = text(settings, "session"), text(settings, "spec")
    kept = context.state.config_records.get(NODE_KEY)
    if kept is None or kept.get("session") != session or kept.get("digest") != digest:
        raise RuntimeError(f"SuperNode {context.node_id} was not introduced to this fit (session {session}): the "
                           "fit's first message to a node (query) carries the run's spec")
    key = (context.run_id, context.node_id)
    here, built = _nodes.get(key), False
    if here is None or (here.session, here.digest) != (session, digest):  # a new fit or changed settings
        built = True
        spec = RunSpec.from_record(kept)
        data = _node_data(spec, context)
        method = spec.build_method()
        method.setup(data.problem)
        for other in [other for other, held in _nodes.items() if other[0] != key[0] or held.session != session]:
            del _nodes[other]  # another run's or fit's clients: done with
        protocol = spec.build_protocol()
        here = _nodes[key] = Node(session, digest, method, client_half(method, data, protocol), data, protocol)
    here.built, here.restored = built, False
    token = kept.get("state")
    if token != here.holds:  # the node's state moved on elsewhere (or the half was never restored)
        # into a fresh half, as the saved state expects: a used one may keep Python-side caches
        # of an older state (AnaPFL's host copy of its seed, say)
        if here.holds is not None:
            here.fresh_half()
        if token is not None:
            restore_half(here.half, record_views(context.state.array_records[STATE_KEY]))
            here.restored = True
            here.marks = _marks(here.half)
        here.holds = None if token is None else str(token)
    return here


def _report(**values: float) -> MetricRecord:
    return MetricRecord({name: float(value) if isinstance(value, float) else int(value)
                         for name, value in values.items()})


def timed(handler: Callable[[Message, Context], tuple[RecordDict, int]]) -> Callable[[Message, Context], Message]:
    """The handler's reply, with its seconds in its "report" (wall and CPU of this thread). A
    handler that fails drops this process's copy of the node (it may have stopped half-way):
    the node's saved state stays the truth."""

    @functools.wraps(handler)
    def reply(message: Message, context: Context) -> Message:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            content, client = handler(message, context)
        except BaseException:
            _nodes.pop((context.run_id, context.node_id), None)
            raise
        report = content.metric_records["report"]
        report["client_s"], report["client_cpu_s"] = time.perf_counter() - wall, time.thread_time() - cpu
        report["client_id"] = client
        return Message(content, reply_to=message)

    return reply


@app.query()
@timed
def introduce(message: Message, context: Context) -> tuple[RecordDict, int]:
    """The fit's spec, kept in the node's state; which client this node is, and how many training
    (and local test) rows it holds."""
    spec = RunSpec.from_record(message.content.config_records["spec"])
    session = text(message.content.config_records["round"], "session")
    data = _node_data(spec, context)
    kept = context.state.config_records.get(NODE_KEY)
    if kept is None or kept.get("session") != session:  # a new fit: the client starts afresh
        context.state.array_records.pop(STATE_KEY, None)
        context.state[NODE_KEY] = ConfigRecord({**dataclasses.asdict(spec), "digest": spec.digest,
                                                "session": session})
    tests = 0 if data.share.local_test is None else len(data.share.local_test)
    content = RecordDict({"report": _report(num_samples=len(data.share.train), num_local_test=tests,
                                            feature_dim=data.problem.feature_dim)})
    if "data-path" in context.node_config:  # a site: its file, named to the server only in its errors
        content["site"] = ConfigRecord({"data-path": str(context.node_config["data-path"])})
    return content, data.client


@app.train()
@timed
def train(message: Message, context: Context) -> tuple[RecordDict, int]:
    """One round of this client: the client step on the broadcast and its own data and state."""
    here = node(message, context)
    settings = message.content.config_records["round"]
    round_index, lost, secure = int(number(settings, "round")), flag(settings, "lost"), text(settings, "secure")
    clip_norm = number(settings, "clip_norm") if number(settings, "clip_norm") >= 0 else None  # -1: no clipping
    broadcast = from_record(message.content.array_records["broadcast"])
    pipeline = Pipeline.for_node(clip_norm, here.protocol)
    sent = client_step(here.half, here.method.uploads, round_index, broadcast, here.data.cohort(), clip_norm, pipeline)
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
        symmetric = codec.symmetric_names(pipeline.wire(here.method.uploads))
        content["uploads"] = to_record(codec.pack(sent.uploads, symmetric))
        bytes_up = sent.bytes_up
    here.save(context)
    if not lost:
        content["metrics"] = MetricRecord(dict(sent.metrics))
    content["report"] = _report(bytes_up=bytes_up, **here.events())
    return content, here.data.client


@app.train("finish")
@timed
def finish(message: Message, context: Context) -> tuple[RecordDict, int]:
    """The final broadcast: the client's local work on it (`ClientHalf.finish`), state kept."""
    here = node(message, context)
    worked = type(here.half).finish is not ClientHalf.finish
    metrics = {}
    if worked:
        metrics = here.half.finish(from_record(message.content.array_records["broadcast"]), here.data.cohort())
        here.save(context)
    content = RecordDict({"metrics": MetricRecord({name: float(value) for name, value in metrics.items()}),
                          "report": _report(worked=int(worked), **here.events())})
    return content, here.data.client


@app.evaluate()
@timed
def evaluate(message: Message, context: Context) -> tuple[RecordDict, int]:
    """This client's own model (`half.predict`) on its own local test split: correct / total."""
    here = node(message, context)
    local_test = here.data.share.local_test
    correct = total = 0
    if local_test is not None and len(local_test):
        features, labels = local_test.features, local_test.labels
        size = here.data.batch_size
        with torch.no_grad():
            for lo in range(0, len(labels), size):
                rows = slice(lo, lo + size)
                ids = torch.full((len(labels[rows]),), here.data.client, dtype=torch.long)
                logits = here.half.predict(features[rows], ids)
                correct += int(logits.argmax(dim=1).eq(labels[rows]).sum())
        total = len(labels)
    return RecordDict({"report": _report(correct=correct, total=total, **here.events())}), here.data.client


#: the handler of each message type, as the ClientApp dispatches them (for grids that call them in process)
HANDLERS = {"query": introduce, "train": train, "train.finish": finish, "evaluate": evaluate}
