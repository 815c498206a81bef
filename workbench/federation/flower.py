"""The Flower engine (`engine: flower`): a method's rounds over a Flower ServerApp and ClientApps.

The math is the method's own `client_step` and `server_step`, unchanged, and the round is the
runtime's own (`workbench.methods.base`): the ServerApp runs Lightning's `Trainer.fit` on the
method as in process, with two differences while it runs.

- The server's training data holds no samples: each round is one batch that names the clients
  with data (`RoundBatches`), so the runtime's dropouts, byte accounting, noise, server step,
  logging and validation apply as in process.
- The method's `client_step` is replaced by `FlowerClients`: it sends each client of the batch
  (through the SuperNode that holds its partition) the method's learned state and the run's
  spec, and returns the sum of the replies. The ClientApp on SuperNode k (`partition-id` k)
  builds the method from the spec (method and data class names with their init arguments, as
  JSON), loads that state, runs the real `client_step` on client k's training data only and
  replies with its uploads.

What travels down is the learned state: the entries of `state_dict()` that differ from a freshly
built method, so random layers a client rebuilds from the config's seeds never travel; it is
usually more than the broadcast `comm/bytes_down` counts. Symmetric uploads travel packed to
their upper triangle, as `comm/bytes_up` counts them. Replies are summed in client order in the
upload dtype. Besides the runtime's metrics (where `time/client_s` is the server's wait for its
clients, transport included), this engine logs `flower/bytes_up` and `flower/bytes_down` (the
serialized arrays of every message: numpy .npy bytes with headers and names, protocol framing not
counted) and `flower/client_compute_s` (the clients' own `client_step` seconds, summed).

Clients keep nothing between rounds: a method with per-sample client state (DeepAFL's Φ cache)
rebuilds it each round from the state it receives, t layers in round t instead of one.

Locally, `fit` runs a Flower simulation (`run_simulation` on Ray, one SuperNode per client, one
CPU per ClientApp) with Ray's and Flower's files in the run folder; a Ray process keeps its data
module between messages. Deployed, `server_app` and `client_app` are the same apps started by a
SuperLink and SuperNodes (see the README; `write_app` writes the Flower App to submit). There,
Flower 1.42 starts a fresh ClientApp process for every message, so each round also pays the
client's Python start (torch and Lightning imports) and data loading.

Supported: methods whose round is the runtime's plain client step / server step (AFL, DeepAFL,
GHOFL, SAFLe). Methods that train every client in one step, stack uploads, sample clients or do
client work outside the messages (FedAvg, FedProx, OS-FED, AnaPFL, Local-only), secure
aggregation and several processes are rejected with a clear error.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import json
import math
import os
import shlex
import sys
import tempfile
import time
import typing
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from lightning import Callback, LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader

INSTALL_HINT = ("the Flower engine needs Flower, an optional extra: pip install -e '.[flower]' "
                "(it installs flwr[simulation], which brings Ray)")

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as missing:  # the extra is not installed
    raise ImportError(INSTALL_HINT) from missing

from workbench import data as data_classes
from workbench import methods as method_classes
from workbench.linalg import packed_symmetric_numel
from workbench.methods.base import ClientBatch, FederatedMethod

NODE_WAIT_S = 600.0  # how long the ServerApp waits for every SuperNode to connect
# The runtime's round, which this engine runs as is: a method that overrides any of these runs
# its round differently (or does client work outside the messages) and is rejected.
RUNTIME_HOOKS = ("training_step", "on_train_epoch_start", "_finish_round", "uploading_clients",
                 "after_broadcast")

# Set by the deployed ServerApp while it runs `workbench fit`: the grid its rounds go over.
_DEPLOYED_GRID: contextvars.ContextVar[Grid | None] = contextvars.ContextVar("grid", default=None)


# ---- which methods ----------------------------------------------------------------------------
def unsupported_reason(method_class: type[FederatedMethod]) -> str | None:
    """Why the Flower engine cannot run this method class, or None when it can."""
    if method_class.whole_round_batch:
        return "it trains every client in one step (whole_round_batch)"
    if method_class.stacked_uploads:
        return f"it stacks uploads ({', '.join(sorted(method_class.stacked_uploads))}) instead of summing them"
    for hook in RUNTIME_HOOKS:
        if getattr(method_class, hook, None) is not getattr(FederatedMethod, hook, None):
            return f"it changes the runtime's round ({hook})"
    return None


def _is_method(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, FederatedMethod) and value is not FederatedMethod


def supported_methods() -> list[str]:
    """Names of the exported methods the Flower engine runs."""
    return [name for name in method_classes.__all__ if _is_method(getattr(method_classes, name))
            and unsupported_reason(getattr(method_classes, name)) is None]


def check_supported(method: FederatedMethod, trainer) -> None:
    """One clear error for a method, protocol or trainer this engine does not run."""
    name = type(method).__name__
    reason = unsupported_reason(type(method))
    if reason is not None:
        raise ValueError(f"the Flower engine cannot run {name}: {reason}. It runs "
                         f"{', '.join(supported_methods())}; run {name} with engine: lightning")
    if getattr(getattr(method, "federation", None), "secure_aggregation", False):
        raise ValueError("the Flower engine sends each client's own upload: set "
                         "federation.secure_aggregation=false, or run with engine: lightning")
    if trainer.world_size > 1:
        raise ValueError("the Flower engine runs the server in one process: set trainer.devices=1")


# ---- what a client needs to rebuild the method and its data -----------------------------------
def _plain(value):
    """Init arguments as JSON values: dataclasses become dicts, tuples lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _construct(cls: type, init_args: dict):
    """`cls(**init_args)`, turning dicts back into the dataclasses the signature names."""
    hints = typing.get_type_hints(cls.__init__)
    kwargs = {}
    for name, value in init_args.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints.get(name)):
            value = hints[name](**value)
        kwargs[name] = value
    return cls(**kwargs)


def _init_args(module) -> str:
    """A module's init arguments as JSON, without the CLI's `_class_path`/`_instantiator` entries."""
    arguments = {key: value for key, value in module.hparams_initial.items() if not key.startswith("_")}
    try:
        return json.dumps(_plain(arguments))
    except TypeError as error:
        raise TypeError(f"{type(module).__name__}'s init arguments reach the clients as JSON (numbers, "
                        f"strings, lists, dicts, dataclasses): {error}") from error


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The method and data classes (names exported by `workbench.methods` / `workbench.data`)
    with their init arguments as JSON: all a ClientApp needs to rebuild both."""

    method: str
    method_args: str
    data: str
    data_args: str

    @classmethod
    def of(cls, method: FederatedMethod, datamodule) -> RunSpec:
        return cls(type(method).__name__, _init_args(method), type(datamodule).__name__, _init_args(datamodule))

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(dataclasses.asdict(self))

    @classmethod
    def from_record(cls, record: ConfigRecord) -> RunSpec:
        return cls(**{field.name: str(record[field.name]) for field in dataclasses.fields(cls)})

    def build_method(self) -> FederatedMethod:
        # Only classes the package exports: a message never names arbitrary code to run.
        method_class = getattr(method_classes, self.method, None)
        if self.method not in method_classes.__all__ or not _is_method(method_class):
            raise ValueError(f"unknown method {self.method!r}; this install has {method_classes.__all__}")
        return _construct(method_class, json.loads(self.method_args))

    def build_data(self) -> LightningDataModule:
        data_class = getattr(data_classes, self.data, None)
        if self.data not in data_classes.__all__ or not (
                isinstance(data_class, type) and issubclass(data_class, LightningDataModule)):
            raise ValueError(f"unknown data module {self.data!r}; this install has {data_classes.__all__}")
        return _construct(data_class, json.loads(self.data_args))


# ---- symmetric uploads travel packed ----------------------------------------------------------
def pack_symmetric(uploads: dict[str, Tensor], symmetric: frozenset[str]) -> dict[str, Tensor]:
    """Symmetric (..., d, d) uploads -> their upper triangles (..., d(d+1)/2); others as they are."""
    packed = {}
    for name, value in uploads.items():
        if name in symmetric:
            rows, cols = torch.triu_indices(value.shape[-1], value.shape[-1], device=value.device)
            value = value[..., rows, cols]
        packed[name] = value
    return packed


def unpack_symmetric(uploads: dict[str, Tensor], symmetric: frozenset[str]) -> dict[str, Tensor]:
    """Inverse of `pack_symmetric`: upper triangles (..., d(d+1)/2) -> full (..., d, d)."""
    full = {}
    for name, value in uploads.items():
        if name in symmetric:
            length = value.shape[-1]
            side = round(((8 * length + 1) ** 0.5 - 1) / 2)
            if packed_symmetric_numel(side) != length:
                raise ValueError(f"upload {name!r} is not a packed symmetric matrix ({length} values)")
            rows, cols = torch.triu_indices(side, side, device=value.device)
            matrix = value.new_zeros(*value.shape[:-1], side, side)
            matrix[..., rows, cols] = value
            matrix[..., cols, rows] = value
            value = matrix
        full[name] = value
    return full


# ---- the ClientApp ----------------------------------------------------------------------------
@dataclasses.dataclass
class ClientShare:
    """One client's training data, with what a method's setup and fit-start hooks read from
    `trainer.datamodule` (the problem's shape; DeepAFL sizes its per-sample cache from
    `train_labels`).

    features: (n_k, d) or (n_k, c, H, W); labels: (n_k,) int64.
    """

    features: Tensor
    labels: Tensor
    client_id: int
    num_clients: int
    num_classes: int
    batch_size: int
    test_features: Tensor | None = None  # a client never tests

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.features.shape[1:])

    @property
    def feature_dim(self) -> int:
        return math.prod(self.input_shape)

    @property
    def train_labels(self) -> Tensor:
        return self.labels


@dataclasses.dataclass
class _ClientTrainer:
    """What a method's setup and fit-start hooks read from their trainer, on a client that runs
    no Lightning loop: one process, its own data."""

    datamodule: object  # a ClientShare (or, for the server's fresh copy, the data module)
    loggers: tuple = ()
    strategy: None = None
    world_size: int = 1


client_app = ClientApp()
_client_data: dict[str, LightningDataModule] = {}  # data args -> the set-up data module (one per process)


def client_share(spec: RunSpec, client_id: int, num_partitions: int) -> ClientShare:
    """Client `client_id`'s rows of the spec's training data. The data module is set up once per
    process and reused by every ClientApp call that process serves."""
    if spec.data_args not in _client_data:
        _client_data.clear()
        datamodule = spec.build_data()
        datamodule.setup("fit")
        _client_data[spec.data_args] = datamodule
    datamodule = _client_data[spec.data_args]
    if num_partitions != datamodule.num_clients:
        raise ValueError(f"the federation has num-partitions = {num_partitions} in its node config but the "
                         f"run's data has num_clients = {datamodule.num_clients}: start one SuperNode per client")
    if not 0 <= client_id < num_partitions:
        raise ValueError(f"partition-id {client_id} is outside [0, {num_partitions})")
    ids = datamodule.train_client_ids  # ordered by client: each client's rows are one slice
    lo, hi = torch.searchsorted(ids, torch.tensor([client_id, client_id + 1])).tolist()
    return ClientShare(datamodule.train_features[lo:hi], datamodule.train_labels[lo:hi], client_id,
                       datamodule.num_clients, datamodule.num_classes, datamodule.hparams.batch_size)


def client_round(method: FederatedMethod, share: ClientShare) -> tuple[dict[str, Tensor], float]:
    """One client's uploads of a round, summed over its batches as the runtime sums them, and the
    seconds its `client_step` calls took. Empty when the client has no training data."""
    uploads: dict[str, Tensor] = {}
    seconds = 0.0
    for lo in range(0, len(share.labels), share.batch_size):
        labels = share.labels[lo:lo + share.batch_size]
        batch = ClientBatch(share.features[lo:lo + share.batch_size], labels,
                            torch.full_like(labels, share.client_id), torch.arange(lo, lo + len(labels)),
                            new_clients=int(lo == 0))
        start = time.perf_counter()
        for name, value in method.client_step(batch).items():
            uploads[name] = uploads[name] + value if name in uploads else value
        seconds += time.perf_counter() - start
    return uploads, seconds


def _node_share(message: Message, context: Context) -> tuple[RunSpec, ClientShare]:
    spec = RunSpec.from_record(message.content["spec"])
    return spec, client_share(spec, int(context.node_config["partition-id"]),
                              int(context.node_config["num-partitions"]))


@client_app.query()
def _introduce(message: Message, context: Context) -> Message:
    """Which client this SuperNode is, and how many training samples it holds."""
    _, share = _node_share(message, context)
    report = MetricRecord({"client_id": share.client_id, "num_samples": len(share.labels)})
    return Message(RecordDict({"report": report}), reply_to=message)


@client_app.train()
def _train(message: Message, context: Context) -> Message:
    """One round on this client: the method rebuilt from the spec and the server's state, then
    its `client_step` on this client's data; replies with the uploads."""
    spec, share = _node_share(message, context)
    method = spec.build_method()
    method.trainer = _ClientTrainer(share)
    method.setup("fit")
    _, unexpected = method.load_state_dict(message.content["state"].to_torch_state_dict(), strict=False)
    if unexpected:
        raise ValueError(f"the server sent state this {spec.method} does not have ({unexpected}): the "
                         "server and the clients run different versions of workbench")
    method.on_fit_start()
    uploads, seconds = client_round(method, share)
    content = RecordDict({
        "uploads": ArrayRecord(OrderedDict(pack_symmetric(uploads, method.symmetric_uploads))),
        "report": MetricRecord({"client_id": share.client_id, "client_s": seconds}),
    })
    return Message(content, reply_to=message)


# ---- the ServerApp's side ---------------------------------------------------------------------
@dataclasses.dataclass
class FlowerTraffic:
    """What Flower carried (serialized array bytes, all clients and rounds) and the time it took."""

    bytes_up: int = 0
    bytes_down: int = 0
    client_compute_s: float = 0.0  # the clients' own client_step seconds, summed
    wall_s: float = 0.0  # the whole engine call (a simulation: Ray's start and stop included)

    def metrics(self) -> dict[str, float]:
        return {"flower/bytes_up": float(self.bytes_up), "flower/bytes_down": float(self.bytes_down),
                "flower/client_compute_s": self.client_compute_s}


class RoundBatches(LightningDataModule):
    """The server's data under Flower: the real data module for what the server reads (the
    problem's shape, the validation split), but one training batch per round that only names the
    clients with training data, whose samples stay on their SuperNodes.

    The batch: client_ids (K',) the clients, sorted; features zeros (K', *input_shape) (an
    expanded view, no memory); labels zeros; sample_index −1.
    """

    def __init__(self, datamodule) -> None:
        super().__init__()
        self.data = datamodule
        self.save_hyperparameters(dict(datamodule.hparams_initial))  # the checkpoint keeps the data's settings
        self._log_hyperparams = datamodule._log_hyperparams  # whoever logs the data's settings still does

    def __getattr__(self, name: str):
        if name == "data":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.data, name)

    def prepare_data(self) -> None:
        self.data.prepare_data()

    def setup(self, stage: str) -> None:
        self.data.setup(stage)

    def train_dataloader(self) -> DataLoader:
        clients = torch.unique(self.data.train_client_ids)
        count = len(clients)
        batch = {"client_ids": clients,
                 "features": torch.zeros(1, *self.data.input_shape).expand(count, *self.data.input_shape),
                 "labels": torch.zeros(count, dtype=torch.long),
                 "sample_index": torch.full((count,), -1, dtype=torch.long)}
        return DataLoader([batch], batch_size=None)

    def val_dataloader(self):
        return self.data.val_dataloader()


def _changed_state(method: FederatedMethod, fresh: dict[str, Tensor]) -> OrderedDict[str, Tensor]:
    """The entries of the method's state a freshly built copy does not already have."""
    return OrderedDict((name, value) for name, value in method.state_dict().items()
                       if name not in fresh or not torch.equal(value, fresh[name]))


class FlowerClients:
    """The server method's `client_step` under Flower: the round's clients, over the grid.

    Called by the runtime with a batch that names the uploading clients; sends each of them the
    method's learned state and returns the sum of their uploads, in client order.
    """

    def __init__(self, grid: Grid, method: FederatedMethod, datamodule, node_wait_s: float) -> None:
        self.grid, self.method = grid, method
        self.spec = RunSpec.of(method, datamodule)
        fresh = self.spec.build_method()  # what every client rebuilds from the spec
        fresh.trainer = _ClientTrainer(datamodule)
        fresh.setup("fit")
        self.fresh_state = fresh.state_dict()
        nodes = wait_for_nodes(grid, datamodule.num_clients, node_wait_s)
        self.nodes = self._introductions(nodes, torch.bincount(datamodule.train_client_ids,
                                                               minlength=datamodule.num_clients))
        self.traffic = FlowerTraffic()

    def _introductions(self, nodes: list[int], samples: Tensor) -> dict[int, int]:
        """client id -> the SuperNode that holds it, from every node's own answer; each must hold
        the `samples[k]` training samples the server's copy of the data gives client k."""
        content = RecordDict({"spec": self.spec.to_record()})
        replies = self.grid.send_and_receive(
            [Message(content, dst_node_id=node, message_type="query") for node in nodes])
        holders: dict[int, int] = {}
        for reply in _checked(replies, len(nodes)):
            client, node = int(reply.content["report"]["client_id"]), reply.metadata.src_node_id
            if client in holders:
                raise ValueError(f"SuperNodes {holders[client]} and {node} both hold partition-id {client}: "
                                 "give each SuperNode its own")
            held = int(reply.content["report"]["num_samples"])
            if held != int(samples[client]):
                raise ValueError(f"SuperNode {node} holds {held} training samples of client {client} but the "
                                 f"server's data gives it {int(samples[client])}: the machines load different data")
            holders[client] = node
        return holders

    def __call__(self, batch: ClientBatch) -> dict[str, Tensor]:
        method, clients = self.method, torch.unique(batch.client_ids).tolist()
        content = RecordDict({"state": ArrayRecord(_changed_state(method, self.fresh_state)),
                              "spec": self.spec.to_record()})
        messages = [Message(content, dst_node_id=self.nodes[client], message_type="train",
                            group_id=str(method.round)) for client in clients]
        replies = {int(reply.content["report"]["client_id"]): reply
                   for reply in _checked(self.grid.send_and_receive(messages), len(messages))}
        if sorted(replies) != clients:
            raise RuntimeError(f"round {method.round}: asked clients {clients}, "
                               f"got replies from {sorted(replies)}")
        self.traffic.bytes_down += content["state"].count_bytes() * len(messages)
        uploads: dict[str, Tensor] = {}
        for client in clients:  # a fixed order: the sum does not depend on arrival
            reply = replies[client].content
            self.traffic.bytes_up += reply["uploads"].count_bytes()
            self.traffic.client_compute_s += float(reply["report"]["client_s"])
            received = unpack_symmetric(reply["uploads"].to_torch_state_dict(), method.symmetric_uploads)
            for name, value in received.items():
                value = value.to(method.device)
                uploads[name] = uploads[name] + value if name in uploads else value
        return uploads


def _checked(replies, expected: int) -> list[Message]:
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


class _LogTraffic(Callback):
    """Logs Flower's traffic at the end of every round, beside the runtime's metrics."""

    def __init__(self, traffic: FlowerTraffic) -> None:
        self.traffic = traffic

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log_dict(self.traffic.metrics())


def fit_over_grid(grid: Grid, trainer, method: FederatedMethod, datamodule, *,
                  node_wait_s: float = NODE_WAIT_S) -> FlowerTraffic:
    """`trainer.fit` with every round's client work done by the SuperNodes of `grid`."""
    clients = FlowerClients(grid, method, datamodule, node_wait_s)
    log_traffic = _LogTraffic(clients.traffic)
    method.client_step = clients  # for this fit only: the server's clients are the SuperNodes
    trainer.callbacks.append(log_traffic)
    try:
        trainer.fit(method, datamodule=RoundBatches(datamodule))
    finally:
        trainer.callbacks.remove(log_traffic)
        del method.client_step
    return clients.traffic


# ---- running the apps -------------------------------------------------------------------------
@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Environment variables set for the block only."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _short_link(target: Path) -> Iterator[Path]:
    """A short symlink to `target` in the system temp folder, for the block only.

    Ray puts Unix sockets under RAY_TMPDIR and a socket path may not exceed 107 bytes, which a
    run folder is usually too deep for; through the link, Ray's files still land in `target`.
    """
    link = Path(tempfile.mkdtemp(prefix="wb-ray-"))
    link.rmdir()
    link.symlink_to(target.resolve(), target_is_directory=True)
    try:
        yield link
    finally:
        link.unlink()


def fit(trainer, method: FederatedMethod, datamodule, *, client_cpus: float = 1.0,
        ray_init_args: dict | None = None, node_wait_s: float = NODE_WAIT_S) -> FlowerTraffic:
    """`trainer.fit(method, datamodule)` with the Flower engine; the method ends fitted.

    Inside a deployed ServerApp (`server_app`) the rounds go over its SuperNodes. Otherwise a
    Flower simulation runs one SuperNode per client on Ray: `client_cpus` CPUs per ClientApp (so
    at most cores / client_cpus of them at once), `ray_init_args` added to `ray.init`'s; Ray's
    temporary files (RAY_TMPDIR) and FLWR_HOME go to `<trainer.log_dir>/flower`.
    """
    check_supported(method, trainer)
    start = time.perf_counter()
    datamodule.setup("fit")  # before any client: fills the feature cache the clients then read
    grid = _DEPLOYED_GRID.get()
    if grid is not None:
        traffic = fit_over_grid(grid, trainer, method, datamodule, node_wait_s=node_wait_s)
    else:
        traffic = _simulate(trainer, method, datamodule, client_cpus, ray_init_args or {}, node_wait_s)
    traffic.wall_s = time.perf_counter() - start
    return traffic


def _simulate(trainer, method, datamodule, client_cpus: float, ray_init_args: dict,
              node_wait_s: float) -> FlowerTraffic:
    if importlib.util.find_spec("ray") is None:
        raise ImportError(INSTALL_HINT)
    from flwr.simulation import run_simulation

    outcome: dict[str, FlowerTraffic] = {}
    server = ServerApp()

    @server.main()
    def _rounds(grid: Grid, context: Context) -> None:
        outcome["traffic"] = fit_over_grid(grid, trainer, method, datamodule, node_wait_s=node_wait_s)

    num_clients = datamodule.num_clients
    cpus = max(1, min(os.cpu_count() or 1, math.ceil(num_clients * client_cpus)))  # no idle Ray workers
    backend = {"client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0},
               "init_args": {"include_dashboard": False, "num_cpus": cpus, **ray_init_args}}
    run_dir = Path(trainer.log_dir) / "flower"
    (run_dir / "ray").mkdir(parents=True, exist_ok=True)
    with _short_link(run_dir / "ray") as ray_dir, _environment(
            RAY_TMPDIR=str(ray_dir), FLWR_HOME=str(run_dir.resolve()),
            RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0"):  # no GPUs involved; silences Ray's notice
        run_simulation(server_app=server, client_app=client_app, num_supernodes=num_clients,
                       backend_config=backend)
    if "traffic" not in outcome or not method.fitted:
        raise RuntimeError("the Flower simulation ended before the last round; its log above says why")
    return outcome["traffic"]


# Deployment: a SuperLink and SuperNodes run these two apps (the Flower App's components).
server_app = ServerApp()
APP_PYPROJECT = """\
# A Flower App whose code is the installed workbench package (pip install -e '.[flower]' on the
# SuperLink's machine and on every SuperNode's). Submit it with
#   flwr run <this folder> <superlink connection> --stream \\
#       --run-config "workbench-args='--config /abs/path/config.yaml --run_dir /abs/path/runs'"
[project]
name = "workbench-flower"
version = "0.1.0"
description = "workbench methods over Flower: the engine of `engine: flower`"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "workbench"

[tool.flwr.app.components]
serverapp = "workbench.federation.flower:server_app"
clientapp = "workbench.federation.flower:client_app"

[tool.flwr.app.config]
workbench-args = ""
"""


def write_app(directory: str | Path) -> Path:
    """Write the Flower App that `flwr run` submits to a SuperLink (only a pyproject.toml: the
    apps' code is the installed package); returns its path."""
    path = Path(directory) / "pyproject.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(APP_PYPROJECT)
    return path


@server_app.main()
def _serve(grid: Grid, context: Context) -> None:
    """`workbench fit` with the run config's `workbench-args`, its rounds over this grid. The
    run folder, `model.ckpt` and the logs are written where the ServerApp runs, as locally."""
    from workbench.cli import main

    arguments = shlex.split(str(context.run_config.get("workbench-args", "")))
    if not arguments:
        raise ValueError("the run config has no workbench-args; pass them to flwr run, e.g. "
                         "--run-config \"workbench-args='--config /abs/path/afl_flower.yaml'\"")
    # LightningCLI would echo this process's own arguments (flwr-serverapp's token) in a warning
    own_arguments, sys.argv = sys.argv, sys.argv[:1]
    grid_token = _DEPLOYED_GRID.set(grid)
    try:
        main(["fit", *arguments, "--engine=flower"])
    finally:
        _DEPLOYED_GRID.reset(grid_token)
        sys.argv = own_arguments


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workbench.federation.flower app <folder>`: write the Flower App for deployment."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.federation.flower", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    app = commands.add_parser("app", help="write the Flower App (a pyproject.toml) that flwr run submits")
    app.add_argument("folder")
    args = parser.parse_args(argv)
    print(f"wrote {write_app(args.folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
