"""The Flower engine against the in-process engine and against a bare Flower app of our own.

1. FedAvg (R rounds, K clients, MLP h on d) fitted in process, over a Flower simulation (Ray,
   one SuperNode per client, one CPU per ClientApp) and, as the anchor of what Flower itself
   costs, as a bare Flower app (`bare_server_app`, `bare_client`: Flower's Message API only, a
   ServerApp averaging a flat weight vector of the model's size, ClientApps taking the same
   local SGD steps (epochs, batch size, step size) with `torch.optim.SGD`; only the data
   generation is the workbench's) on the same simulation backend with the same K and rounds.
   Whole fit time, rounds time, the median round, the largest difference between the Flower and
   in-process models, whether `comm/*` agree, and what Flower carried (`flower/bytes_up`,
   `flower/bytes_down`: the serialized arrays; the downlink is the broadcast plus its framing).
2. The clients' compute per message over Flower (each ClientApp handler from the message in to
   its reply: the client's work with its state restored and saved) against the same client's
   compute in process: every client alone, a client half of its own, one torch thread as a
   ClientApp has (`ClientsAlone`). Wall seconds and the CPU seconds of the handler's thread
   (on a shared machine the wall of two ClientApps on two cores also counts their contention).
3. DeepAFL over Flower: the same per-message comparison, and the time of each round by depth.
   Each node keeps its client's Φ cache in its own state, so a round costs the same at every
   depth (flat), instead of rebuilding t layers in round t.

    python benchmarks/flower_engine.py                          # FedAvg R = 20, K = 10; DeepAFL T = 10
    OMP_NUM_THREADS=1 python benchmarks/flower_engine.py        # the results file's: one torch thread everywhere
    python benchmarks/flower_engine.py --rounds 3 --clients 3 --layers 2 --train_size 2000   # a smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import random
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning import Callback  # noqa: E402

from benchmarks.bare_flower_app import BareRun, synthetic_data  # noqa: E402
from benchmarks.common import load_average, machine_line, write_report  # noqa: E402
from workbench import methods  # noqa: E402
from workbench.data import FederatedDataModule  # noqa: E402
from workbench.engines import LightningEngine  # noqa: E402
from workbench.engines.flower import client_app, simulation  # noqa: E402
from workbench.engines.flower.loopback import LoopbackGrid  # noqa: E402
from workbench.engines.local import LocalClients  # noqa: E402
from workbench.engines.round import Replies, RoundRequest, add_metrics  # noqa: E402
from workbench.federation import codec  # noqa: E402


def bare_flower(data: FederatedDataModule, rounds: int, hidden: int, local) -> BareRun:
    """The bare app's rounds on the backend the workbench's simulation uses (one CPU per ClientApp)."""
    from flwr.simulation import run_simulation

    # the apps of an importable module: Ray pickles `__main__`'s functions by value, caches and all
    this = importlib.import_module("benchmarks.bare_flower_app")
    num_clients = data.num_clients
    config = {"dim": data.feature_dim, "train_size": len(data.train_labels), "clients": num_clients,
              "classes": data.num_classes, "hidden": hidden, "lr": local.lr, "epochs": local.epochs,
              "batch_size": local.batch_size}
    run = BareRun()
    backend = {"client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
               "init_args": {"include_dashboard": False, "num_cpus": max(1, min(os.cpu_count() or 1, num_clients))}}
    with tempfile.TemporaryDirectory(prefix="bare-") as root:
        os.environ.update(RAY_TMPDIR=root, FLWR_HOME=root, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
        start = time.perf_counter()
        try:
            run_simulation(server_app=this.bare_server_app(config, num_clients, rounds, run),
                           client_app=this.bare_client, num_supernodes=num_clients, backend_config=backend)
        finally:
            for name in ("RAY_TMPDIR", "FLWR_HOME", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
                os.environ.pop(name, None)
        run.whole_s = time.perf_counter() - start
    if len(run.round_s) != rounds:
        raise RuntimeError("the bare Flower simulation ended before its last round; its log above says why")
    return run


# ---- the workbench's runs --------------------------------------------------------------------
class RoundTimes(Callback):
    """Wall seconds of every round (one Lightning epoch), as the server sees them, and the clients'
    own compute seconds in it (summed over clients; Flower's `client_compute_s`)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.compute: list[float] = []

    def _computed(self, pl_module) -> float:
        traffic = getattr(pl_module.clients, "traffic", None)
        return traffic.client_compute_s if traffic is not None else 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start, self._computed_before = time.perf_counter(), self._computed(pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.compute.append(self._computed(pl_module) - self._computed_before)


class ClientsAlone:
    """The in-process reference of a ClientApp's compute: every client alone, with a client half
    of its own (one `LocalClients` each, from a fresh copy of the method's settings), timed per
    client and message (a round's update, the final broadcast's local work)."""

    def __init__(self, make_method, data: FederatedDataModule) -> None:
        data.setup("fit")
        problem = LightningEngine.problem_of(data.population())
        self.nodes = {}
        for client in range(data.num_clients):
            method = make_method()
            method.setup(problem)
            rows = data.train_client_ids == client
            self.nodes[client] = LocalClients(method, data.train_features[rows], data.train_labels[rows],
                                              data.train_client_ids[rows], torch.tensor([client]),
                                              data.hparams.batch_size)
        self.wall = self.cpu = 0.0
        self.messages = 0

    def _timed(self, work):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = work()
        self.wall += time.perf_counter() - wall
        self.cpu += time.thread_time() - cpu
        self.messages += 1
        return result

    def update(self, request: RoundRequest) -> Replies:
        if request.secure is not None:
            raise ValueError("the reference runs without secure aggregation")
        start, total, parts = time.perf_counter(), Replies(), []
        nobody = torch.tensor([], dtype=torch.long)
        for client in sorted(request.survivors.tolist() + request.lost.tolist()):
            survives = client in request.survivors
            alone = dataclasses.replace(request, survivors=torch.tensor([client]) if survives else nobody,
                                        lost=nobody if survives else torch.tensor([client]))
            reply = self._timed(lambda alone=alone, client=client: self.nodes[client].update(alone))
            if survives and reply.uploads is not None:  # combined in client order, as over Flower
                parts.append(reply.uploads)
                total.bytes_up += reply.bytes_up
                add_metrics(total.metric_sums, reply.metric_sums)
        total.uploads = codec.combine(parts, request.spec) if parts else None
        total.client_s = time.perf_counter() - start
        return total

    def finish(self, broadcast) -> tuple[dict[str, float], float]:
        start, sums = time.perf_counter(), {}
        for node in self.nodes.values():
            add_metrics(sums, self._timed(lambda node=node: node.finish(broadcast))[0])
        return sums, time.perf_counter() - start

    def predict(self, features, client_ids):
        raise NotImplementedError("the reference times the clients' rounds only")


@contextlib.contextmanager
def as_server_app():
    """Lets this process build a ServerApp's Messages outside one (Flower reads the sender's ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    names = ("_run_id", "_node_id", "_task_id")
    before = {name: TaskIdentity.__dict__.get(name) for name in names}
    for name, value in zip(names, (1, 0, 0), strict=True):
        setattr(TaskIdentity, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                delattr(TaskIdentity, name)
            else:
                setattr(TaskIdentity, name, value)


def fit_once(method, datamodule, engine_name: str, make_method=None):
    """-> (whole seconds, the engine after fit (and test, but for `alone` and `loopback`), its
    round times, the clients). `alone`: the clients one by one in process; `loopback`: the
    ClientApp's handlers in process (`LoopbackGrid`); both on one torch thread, as a ClientApp."""
    times = RoundTimes()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="flower-bench-") as root:
        trainer = simulation.quiet_trainer(default_root_dir=root, callbacks=[times])
        alone = ClientsAlone(make_method, datamodule) if engine_name == "alone" else None
        engine = LightningEngine(method, clients=alone)
        start = time.perf_counter()
        if engine_name == "flower":
            engine.flower_run = simulation.fit(trainer, engine, datamodule)
            return time.perf_counter() - start, engine, times, engine.flower_run.traffic
        if engine_name == "lightning":
            trainer.fit(engine, datamodule=datamodule)
            trainer.test(engine, datamodule=datamodule, verbose=False)
            return time.perf_counter() - start, engine, times, None
        torch.set_num_threads(1)  # as a ClientApp on one CPU
        kept = client_app._nodes
        try:
            if alone is not None:
                trainer.fit(engine, datamodule=datamodule)
                return time.perf_counter() - start, engine, times, alone
            pick = random.Random(0).randrange
            with as_server_app():
                # each message to one of two processes' copies of the nodes at random, as Ray's two actors take them
                grid = LoopbackGrid(datamodule.num_clients, processes=2, process_of=lambda node, exchange: pick(2))
                run = simulation.fit_over_grid(grid, trainer, engine, datamodule, test=False)
            return time.perf_counter() - start, engine, times, run.traffic
        finally:
            torch.set_num_threads(threads)
            client_app._nodes = kept


def largest_difference(method, reference) -> float:
    """max over tensors of max |method − reference| / max(1, max |reference|)."""
    state = method.state_dict()
    return max((float((state[name].double() - value.double()).abs().max())
                / max(1.0, float(value.double().abs().max())) for name, value in reference.state_dict().items()
                if value.numel()), default=0.0)


def slope(values: list[float]) -> float:
    """Least-squares slope of values against their index (seconds per round)."""
    mean_x, mean_y = (len(values) - 1) / 2, statistics.fmean(values)
    return (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
            / sum((x - mean_x) ** 2 for x in range(len(values))))


def per_message(wall: float, cpu: float, messages: int) -> str:
    return f"{wall / messages * 1e3:.1f} / {cpu / messages * 1e3:.1f}"


def compute_ratio(traffic, alone: ClientsAlone) -> str:
    """Wall / CPU: the ClientApp handlers' seconds per message over the clients alone in process's."""
    if traffic.messages != alone.messages:
        raise RuntimeError(f"{traffic.messages} ClientApp messages against {alone.messages} in process")
    return f"{traffic.client_compute_s / alone.wall:.2f}× / {traffic.client_cpu_s / alone.cpu:.2f}×"


def compute_row(label: str, alone: ClientsAlone, loopback, flower) -> str:
    """A row of the per-message table: the clients alone, the ClientApp in process, over Flower."""
    def handlers(traffic) -> str:
        return (f"{per_message(traffic.client_compute_s, traffic.client_cpu_s, traffic.messages)} | "
                f"{traffic.builds} / {traffic.restores}")

    return (f"| {label} | {alone.messages} | {per_message(alone.wall, alone.cpu, alone.messages)} | "
            f"{handlers(loopback)} | {handlers(flower)} | {compute_ratio(loopback, alone)} | "
            f"{compute_ratio(flower, alone)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=64, help="feature dimension of the synthetic data")
    parser.add_argument("--train_size", type=int, default=20000, help="training samples of the synthetic data")
    parser.add_argument("--clients", type=int, default=10, help="K")
    parser.add_argument("--rounds", type=int, default=20, help="FedAvg's R")
    parser.add_argument("--layers", type=int, default=10, help="DeepAFL's T")
    parser.add_argument("--hidden", type=int, default=256, help="DeepAFL's h = f (and FedAvg's MLP width)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of this process (default torch's; a ClientApp on Ray has one)")
    parser.add_argument("--out", default="benchmarks/results/flower_engine.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    load_before = load_average()
    bench_start = time.perf_counter()
    data = synthetic_data(args.dim, args.train_size, args.clients)
    data.setup("fit")

    def fedavg():
        return methods.FedAvg(num_rounds=args.rounds, architecture="mlp", hidden_dim=args.hidden)

    runs = {}
    for engine_name in ("lightning", "bare", "alone", "loopback", "flower"):  # references beside the Flower run
        if engine_name == "bare":
            bare = bare_flower(data, args.rounds, args.hidden, fedavg().local)
            print(f"FedAvg bare Flower: {bare.whole_s:.1f} s", flush=True)
            continue
        runs[engine_name] = fit_once(fedavg(), data, engine_name, fedavg)
        print(f"FedAvg {engine_name}: {runs[engine_name][0]:.1f} s", flush=True)
    (whole_here, here, here_rounds, _), (_, _, alone_rounds, alone) = runs["lightning"], runs["alone"]
    whole_flower, flower, flower_rounds, traffic = runs["flower"]
    same_bytes = all(here.fit_metrics[key] == flower.fit_metrics[key]
                     for key in ("comm/bytes_up", "comm/bytes_up_per_client", "comm/bytes_down"))
    round_ratio = statistics.median(flower_rounds.seconds) / statistics.median(bare.round_s)

    depth_rows, deep_lines = [], []
    if hasattr(methods, "DeepAFL"):
        def deepafl():  # restating, as over Flower it does unasked (its clients may go missing): the same work
            return methods.DeepAFL(num_layers=args.layers, hidden_dim=args.hidden, block_dim=args.hidden,
                                   restate=True)

        whole_deep, _, deep_rounds, deep_traffic = fit_once(deepafl(), data, "flower")
        print(f"DeepAFL T={args.layers} flower: {whole_deep:.1f} s", flush=True)
        depth_rows = list(enumerate(zip(deep_rounds.seconds, deep_rounds.compute, strict=True)))
        _, _, _, deep_alone = fit_once(deepafl(), data, "alone", deepafl)
        _, _, _, deep_loopback = fit_once(deepafl(), data, "loopback")
        _, _, deep_here, _ = fit_once(deepafl(), data, "lightning")
        deep_lines = [compute_row(f"DeepAFL, T = {args.layers}, h = f = {args.hidden}", deep_alone, deep_loopback,
                                  deep_traffic)]

    n, d = len(data.train_labels), data.feature_dim
    parallel = min(os.cpu_count() or 1, args.clients)
    lines = [
        f"Data: synthetic Gaussian blobs, d = {d}, {n} training samples, K = {args.clients}, Dirichlet α = 0.5.",
        machine_line(f"flwr {version('flwr')}, ray {version('ray')}; whole benchmark "
                     f"{(time.perf_counter() - bench_start) / 60:.1f} min", load_before),
        "Flower: `run_simulation` on Ray, one SuperNode per client, 1 CPU per ClientApp "
        f"({parallel} at once, {bare.threads} torch thread each), for the workbench and the bare app alike; each "
        "workbench node keeps its client's state in its `context.state`, the process its built method and client "
        "half.",
        "",
        f"## FedAvg, {args.rounds} rounds, MLP h = {args.hidden}",
        "",
        "whole = fit and test (for Flower: Ray's start and stop, the SuperNodes' handshake and the clients' "
        "first imports included); rounds = `time/fit_s` (bare Flower: its server's rounds); a round is the "
        "server's (the workbench's includes its bookkeeping and the learning curve's scoring, as in process). "
        "Bare Flower: our own ServerApp and ClientApps on Flower's Message API, the same data, model size, "
        "local steps (1 epoch, batch 64, lr 0.05) with `torch.optim.SGD`; no workbench code but the data. "
        "Max diff: the largest difference between the Flower and in-process models' tensors, relative to "
        "each tensor's largest entry when that exceeds 1. Compute per message: each ClientApp handler, "
        "message in to reply, wall / CPU of its thread (in process, each client alone: its update on one "
        "torch thread).",
        "",
        "| engine | whole (s) | rounds (s) | median round (s) | compute per message, wall / CPU (ms) | max diff "
        "| comm/* agree | comm/bytes_up / down (MB) | Flower carried up / down (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| in process | {whole_here:.2f} | {here.fit_metrics['time/fit_s']:.3f} "
        f"| {statistics.median(here_rounds.seconds):.3f} | | | | "
        f"{here.fit_metrics['comm/bytes_up'] / 1e6:.3f} / {here.fit_metrics['comm/bytes_down'] / 1e6:.3f} | |",
        f"| in process, each client alone | | {runs['alone'][1].fit_metrics['time/fit_s']:.3f} "
        f"| {statistics.median(alone_rounds.seconds):.3f} | {per_message(alone.wall, alone.cpu, alone.messages)} "
        "| | | | |",
        f"| bare Flower | {bare.whole_s:.1f} | {sum(bare.round_s):.2f} | {statistics.median(bare.round_s):.3f} "
        f"| {per_message(bare.client_s, bare.client_cpu_s, bare.messages)} | | | | |",
        f"| workbench over Flower | {whole_flower:.1f} | {flower.fit_metrics['time/fit_s']:.2f} "
        f"| {statistics.median(flower_rounds.seconds):.3f} "
        f"| {per_message(traffic.client_compute_s, traffic.client_cpu_s, traffic.messages)} "
        f"| {largest_difference(flower.method, here.method):.1e} "
        f"| {'yes' if same_bytes else 'NO'} | {flower.fit_metrics['comm/bytes_up'] / 1e6:.3f} / "
        f"{flower.fit_metrics['comm/bytes_down'] / 1e6:.3f} | {traffic.bytes_up / 1e6:.3f} / "
        f"{traffic.bytes_down / 1e6:.3f} |",
        "",
        f"The workbench's median round over Flower is {round_ratio:.2f}× the bare Flower app's "
        f"({statistics.median(flower_rounds.seconds):.3f} s against {statistics.median(bare.round_s):.3f} s); "
        f"per message its clients computed {traffic.client_compute_s / traffic.messages * 1e3:.1f} ms against "
        f"the bare client's {bare.client_s / bare.messages * 1e3:.1f} ms (the same local steps).",
        "",
        "## The clients' compute per message: over Flower against the same client in process",
        "",
        "Summed over every train and final message (each client, each round) and divided by their number, "
        "wall / CPU of the thread (ms), all on one torch thread. Alone: the same clients in process, each "
        "client's update on a client half of its own (`ClientsAlone`). ClientApp in process: the workbench's "
        "ClientApp handlers called in this process one message at a time, each message given to one of two "
        "processes' copies of the nodes at random as Ray's two actors take them (`LoopbackGrid`): the "
        "ClientApp's own cost. Over Flower: the same handlers in the simulation, two at once on the two cores "
        "beside the server. Built: messages that built the method and the client half (a process's first for "
        "a node); restored: messages that found the node's state saved by the other process and restored it "
        "into a fresh half.",
        "",
        "| method | messages | alone | ClientApp in process | built / restored | over Flower | built / restored "
        "| ClientApp in process / alone | over Flower / alone |",
        "|---|---|---|---|---|---|---|---|---|",
        compute_row(f"FedAvg, MLP h = {args.hidden}", alone, runs["loopback"][3], traffic),
        *deep_lines,
    ]
    if depth_rows:
        compute = [c for _, (_, c) in depth_rows][1:]  # the layer rounds (round 0 solves W₀ only)
        last = len(depth_rows) - 1
        lines += ["", f"## DeepAFL over Flower, T = {args.layers}, h = f = {args.hidden}: round time by round",
                  "", "A node keeps its client's Φ cache between messages, so a round costs one layer of client "
                  "work at every depth: the clients' compute stays flat in depth (a client rebuilding Φ would "
                  "add one layer's work per depth). "
                  f"Least-squares slope of the clients' compute over rounds 1–{last}: "
                  f"{slope(compute) * 1e3:+.2f} ms per round, against a median of "
                  f"{statistics.median(compute) * 1e3:.1f} ms per round; the same fit in process takes "
                  f"{statistics.median(deep_here.seconds[1:]) * 1e3:.1f} ms per round (median, all clients at once).",
                  "", "| round | wall seconds (server) | clients' compute (s, summed over clients) |", "|---|---|---|"]
        lines += [f"| {index} | {seconds:.3f} | {computed:.3f} |" for index, (seconds, computed) in depth_rows]
    else:
        lines += ["", "DeepAFL is not exported by workbench.methods in this tree: its depth table is skipped."]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
