"""A bare Flower app of our own, the anchor of what Flower itself costs: Flower's Message API and
torch, nothing of the engine. A ServerApp averaging a flat weight vector of an MLP's size
(`bare_rounds`: FedAvg with Flower's `send_and_receive`), ClientApps taking local SGD with
torch.optim.SGD on their node's rows (`bare_client`). `flower_engine.py` simulates it beside the
workbench on Ray; `flower_deployment.py` deploys it (`bare_server` reads its settings from the run
config, its nodes their rows from `write_partitions`' files: a deployed ClientApp process imports
only Flower, torch and numpy).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn


def mlp(dim: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))


bare_client = ClientApp()
_partitions: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per process: (settings, client) -> (x, y)


def synthetic_data(dim: int, train_size: int, clients: int):
    """The benchmarks' data (the workbench's generator, imported only here: a deployed bare node
    reads its rows from a file instead)."""
    from workbench.data import FederatedDataModule, SyntheticBlobs

    return FederatedDataModule(dataset="synthetic", num_clients=clients, partition="dirichlet", alpha=0.5,
                               synthetic=SyntheticBlobs(dim=dim, train_size=train_size))


def write_partitions(folder: Path, dim: int, train_size: int, clients: int) -> None:
    """Each client's rows of the benchmarks' data as `<folder>/<client>.npz`, for deployed nodes."""
    data = synthetic_data(dim, train_size, clients)
    data.setup("fit")
    folder.mkdir(parents=True, exist_ok=True)
    for client in range(clients):
        rows = data.train_client_ids == client
        np.savez(folder / f"{client}.npz", x=data.train_features[rows].numpy(), y=data.train_labels[rows].numpy())


def _partition(config: ConfigRecord, client: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client `client`'s rows: from `config["partitions"]`'s files when it names a folder (deployed),
    else generated (a simulation's process, the workbench already imported)."""
    key = (int(config["dim"]), int(config["train_size"]), int(config["clients"]), client)
    if key not in _partitions:
        if config.get("partitions"):
            arrays = np.load(Path(str(config["partitions"])) / f"{client}.npz")
            _partitions[key] = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
        else:
            data = synthetic_data(*key[:3])
            data.setup("fit")
            rows = data.train_client_ids == client
            _partitions[key] = data.train_features[rows], data.train_labels[rows]
    return _partitions[key]


@bare_client.query()
def bare_introduce(message: Message, context: Context) -> Message:
    """Loads this node's partition before the rounds (as the workbench's nodes do when introduced)."""
    features, _ = _partition(message.content.config_records["config"], int(context.node_config["partition-id"]))
    return Message(RecordDict({"report": MetricRecord({"num_examples": len(features)})}), reply_to=message)


@bare_client.train()
def bare_train(message: Message, context: Context) -> Message:
    """Local SGD from the received flat weights on this node's partition; replies the new weights."""
    wall, cpu = time.perf_counter(), time.thread_time()
    config = message.content.config_records["config"]
    features, labels = _partition(config, int(context.node_config["partition-id"]))
    model = mlp(int(config["dim"]), int(config["hidden"]), int(config["classes"]))
    weights = torch.from_numpy(message.content.array_records["arrays"]["weights"].numpy())
    nn.utils.vector_to_parameters(weights, model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    generator = torch.Generator().manual_seed(int(config["round"]) * 1000 + int(context.node_config["partition-id"]))
    batch = int(config["batch_size"])
    for _ in range(int(config["epochs"])):
        order = torch.randperm(len(labels), generator=generator)
        for lo in range(0, len(labels), batch):
            rows = order[lo:lo + batch]
            optimizer.zero_grad()
            F.cross_entropy(model(features[rows]), labels[rows]).backward()
            optimizer.step()
    trained = nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    report = MetricRecord({"num_examples": len(labels), "client_s": time.perf_counter() - wall,
                           "client_cpu_s": time.thread_time() - cpu, "threads": torch.get_num_threads()})
    return Message(RecordDict({"arrays": ArrayRecord({"weights": Array(trained)}), "report": report}),
                   reply_to=message)


@dataclasses.dataclass
class BareRun:
    round_s: list[float] = dataclasses.field(default_factory=list)
    client_s: float = 0.0
    client_cpu_s: float = 0.0
    messages: int = 0
    threads: int = 0
    whole_s: float = 0.0


def bare_rounds(grid: Grid, config: dict, num_clients: int, rounds: int, run: BareRun) -> None:
    """FedAvg of a flat weight vector: every round each node trains from it, the server averages
    the replies weighted by their examples (Flower's `send_and_receive`)."""
    while len(nodes := sorted(grid.get_node_ids())) < num_clients:
        time.sleep(0.1)
    hello = RecordDict({"config": ConfigRecord(config)})  # untimed: the processes start and load their data
    if len(list(grid.send_and_receive([Message(hello, dst_node_id=node, message_type="query")
                                       for node in nodes]))) != len(nodes):
        raise RuntimeError("a bare Flower node did not answer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mlp(config["dim"], config["hidden"], config["classes"])
    weights = nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    for round_index in range(rounds):
        start = time.perf_counter()
        content = RecordDict({"arrays": ArrayRecord({"weights": Array(weights)}),
                              "config": ConfigRecord({**config, "round": round_index})})
        replies = list(grid.send_and_receive([Message(content, dst_node_id=node, message_type="train",
                                                      group_id=str(round_index)) for node in nodes]))
        if len(replies) != len(nodes) or any(reply.has_error() for reply in replies):
            raise RuntimeError(f"bare Flower round {round_index}: {[r.error for r in replies if r.has_error()]}")
        total, examples = np.zeros(len(weights)), 0
        for reply in replies:
            report = reply.content.metric_records["report"]
            total += reply.content.array_records["arrays"]["weights"].numpy() * float(report["num_examples"])
            examples += int(report["num_examples"])
            run.client_s += float(report["client_s"])
            run.client_cpu_s += float(report["client_cpu_s"])
            run.threads = int(report["threads"])
            run.messages += 1
        weights = (total / examples).astype(np.float32)
        run.round_s.append(time.perf_counter() - start)


def bare_server_app(config: dict, num_clients: int, rounds: int, run: BareRun) -> ServerApp:
    """The bare rounds (`bare_rounds`) as a ServerApp."""
    app = ServerApp()

    @app.main()
    def _rounds(grid: Grid, context: Context) -> None:
        bare_rounds(grid, config, num_clients, rounds, run)

    return app


bare_server = ServerApp()


@bare_server.main()
def _deployed_rounds(grid: Grid, context: Context) -> None:
    """The bare rounds deployed: settings from the run config, the round times written to its `out`."""
    config = {key: context.run_config[key] for key in ("dim", "train_size", "clients", "classes", "hidden", "lr",
                                                        "epochs", "batch_size", "partitions")}
    run = BareRun()
    bare_rounds(grid, config, int(config["clients"]), int(context.run_config["rounds"]), run)
    Path(str(context.run_config["out"])).write_text(json.dumps(dataclasses.asdict(run)))
