"""What secure aggregation costs AFL as the number of clients grows: SecAgg+ against all pairs.

For each K, the same AFL fit (in process, one round, 5 % of the clients dropping out) three ways:
plain (no masking), SecAgg+ (`secure_aggregation_graph: sparse`, k and t chosen by the rule of
`workbench.federation.secure_aggregation` for γ = 0.05 and the dropout) and all pairs (`complete`).
Fit time: median of `--repeats`, the three variants interleaved within each repeat so that the
machine's load hits them alike; the ratios are to the plain fit of the same run. All pairs is
skipped where its time, extrapolated as K² from the largest K it ran at, would exceed
`--complete_budget_s`. Also: the mask streams and share bytes each client pays (the engine's
`comm/secagg_*` metrics), the server's unmasking time (Shamir reconstruction and its mask streams)
and the distance of the masked model from the plain one (only the fixed-point rounding differs).

Per client (second table): for `--cost_clients` clients of each K, its own compute (the engine's
`client_step` on its rows: AFL's G_k, H_k), its encoding, and its masks (`SecureAggregator.mask`:
k + 1 AES-CTR streams as long as the upload, summed), medians; masks / compute is what masking
adds to each client whatever the simulation around it does. Keystream: OpenSSL's AES-128-CTR
writing as many words under one key, nothing else (no key schedules, no sums) — the PRG's own
speed, and with it the floor of a masked fit: the plain fit plus every stream's keystream
(`floor` in the first table).

Flower's own SecAgg+ (`--flower_clients K`, third table): `SecAggPlusWorkflow` + `secaggplus_mod`
over a Flower simulation (Ray, one CPU per ClientApp), K SuperNodes whose NumPyClient uploads one
float vector of the same length L (no training), with k + 1 shares (Flower counts the client
itself), the same t and the same share of clients dropping out after the key sharing (their
ClientApp fails at the masked-vector stage, so the server recovers their masks). Its round time
is the workflow's four stages; a simulation's start is not part of it.

Features: synthetic class blobs (`SyntheticBlobs`, d = `--dim`, 10 classes, `--per_client` rows per
client, iid), so the upload is d(d+1)/2 + 10d ring elements. One torch thread: the per-client
steps are tiny, and on a shared machine a thread pool's wake-ups would dominate them.

    python benchmarks/secagg.py                       # K = 10, 100, 1000
    python benchmarks/secagg.py --clients 10 100 --repeats 1   # quick
    python benchmarks/secagg.py --dim 256 --per_client 200 --flower_clients 1000 --out benchmarks/results/secagg_d256.md
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fit_engine, load_average, machine_line, write_report
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation, codec
from workbench.federation.client_step import client_step
from workbench.federation.secure_aggregation import COUNTER_ZERO, secagg_plus_parameters, secure_aggregator
from workbench.methods import AFL, Cohort, Problem

VARIANTS = ("plain", "sparse", "complete")


def federation(variant: str, dropout: float) -> Federation:
    if variant == "plain":
        return Federation(dropout=dropout, seed=1)
    return Federation(dropout=dropout, seed=1, secure_aggregation=True, secure_aggregation_graph=variant)


def client_costs(dm: FederatedDataModule, dropout: float, sample: int) -> dict[str, float]:
    """Medians over `sample` clients (evenly spaced ids) of a client's own compute, encoding and
    masks under SecAgg+, in seconds, with the round's k and the words each client draws."""
    method = AFL(gamma=1.0, gamma_out=0.1)
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    spec = method.uploads  # (AFL: its uploads travel as they are, summed)
    aggregator = secure_aggregator(federation("sparse", dropout), range(dm.num_clients), 0, codec.symmetric_names(spec))
    ends = torch.cumsum(torch.bincount(dm.train_client_ids, minlength=dm.num_clients), 0).tolist()
    times: dict[str, list[float]] = {"compute": [], "encode": [], "masks": [], "keystream": []}
    for client in torch.linspace(0, dm.num_clients - 1, min(sample, dm.num_clients)).round().long().tolist():
        rows = slice(ends[client - 1] if client else 0, ends[client])
        half = method.client_half()
        half.setup_clients(torch.tensor([client]), rows.stop - rows.start)
        cohort = Cohort(dm.train_features[rows], dm.train_labels[rows], dm.train_client_ids[rows],
                        torch.tensor([client]), torch.arange(rows.stop - rows.start))
        start = time.perf_counter()
        uploads = client_step(half, spec, 0, {}, cohort).uploads
        encoding = time.perf_counter()
        layout = aggregator.set_layout(uploads)
        layout.flatten(uploads, aggregator.fixed_point_bits, dm.num_clients)
        masking = time.perf_counter()
        aggregator.mask(client)
        end = time.perf_counter()
        keystream = (aggregator.degree + 1) * aggregator.layout.length * 8
        words = np.empty(keystream, dtype=np.uint8)
        zeros = bytes(keystream)
        cipher = time.perf_counter()
        Cipher(algorithms.AES(bytes(16)), COUNTER_ZERO).encryptor().update_into(zeros, words)
        times["keystream"].append(time.perf_counter() - cipher)
        for name, seconds in (("compute", encoding - start), ("encode", masking - encoding), ("masks", end - masking)):
            times[name].append(seconds)
    streams = aggregator.degree + 1
    return {**{name: statistics.median(t) for name, t in times.items()}, "streams": streams,
            "words": streams * aggregator.layout.length if aggregator.layout else 0,
            "rows": len(dm.train_labels) / dm.num_clients}


def flower_round(num_clients: int, length: int, degree: int, threshold: int, dropout: float) -> dict[str, float]:
    """Seconds of one round of Flower's own SecAgg+ (each of its four stages, and the whole
    workflow) among `num_clients` simulated SuperNodes uploading `length` floats each."""
    import tempfile

    from flwr.app import Context, Message
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    dropped = set(np.random.default_rng(1).choice(num_clients, round(dropout * num_clients), replace=False).tolist())
    seconds: dict[str, float] = {}

    class Vector(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client = client

        def get_parameters(self, config):
            return [np.zeros(length, dtype=np.float32)]

        def fit(self, parameters, config):
            rng = np.random.default_rng(self.client)
            return [rng.uniform(-1, 1, length).astype(np.float32)], 50, {}

    def drop(message: Message, context: Context, call_next):
        """A dropped client fails at the masked-vector stage: its key shares are out, its upload never arrives."""
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
        if (configs is not None and configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
                and int(context.node_config["partition-id"]) in dropped):
            raise RuntimeError("dropped out")
        return call_next(message, context)

    class Timed(SecAggPlusWorkflow):
        def __call__(self, grid, context) -> None:
            start = time.perf_counter()
            super().__call__(grid, context)
            seconds["round"] = time.perf_counter() - start

    for stage in ("setup_stage", "share_keys_stage", "collect_masked_vectors_stage", "unmask_stage"):
        def timed(self, *args, _stage=stage):
            start = time.perf_counter()
            done = getattr(SecAggPlusWorkflow, _stage)(self, *args)
            seconds[_stage.removesuffix("_stage")] = time.perf_counter() - start
            return done
        setattr(Timed, stage, timed)

    client = ClientApp(client_fn=lambda context: Vector(int(context.node_config["partition-id"])).to_client(),
                       mods=[drop, secaggplus_mod])
    server = ServerApp()

    @server.main()
    def _round(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_fit=1.0, min_fit_clients=num_clients, min_available_clients=num_clients,
                          fraction_evaluate=0.0, min_evaluate_clients=0, accept_failures=True)
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=Timed(num_shares=degree + 1, reconstruction_threshold=threshold))(grid, legacy)

    home = tempfile.mkdtemp(prefix="fl-")  # short: Ray's socket paths must stay under 108 bytes
    os.environ.update(RAY_TMPDIR=home, FLWR_HOME=home, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    run_simulation(server_app=server, client_app=client, num_supernodes=num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"include_dashboard": False, "num_cpus": os.cpu_count() or 1}})
    if "round" not in seconds:
        raise RuntimeError("Flower's SecAgg+ round did not finish; its log above says why")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--per_client", type=int, default=50, help="training rows per client")
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--complete_budget_s", type=float, default=60.0,
                        help="skip all pairs where its extrapolated fit time exceeds this")
    parser.add_argument("--cost_clients", type=int, default=100, help="clients timed one by one per K")
    parser.add_argument("--flower_clients", type=int, default=0,
                        help="K of the Flower SecAgg+ anchor (0: not run; it takes minutes)")
    parser.add_argument("--out", default="benchmarks/results/secagg.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: no banners
    torch.set_num_threads(1)
    load_at_start, run_start = load_average(), time.perf_counter()

    rows, cost_rows, complete_at = [], [], None  # (K, seconds) of the largest all-pairs fit
    fits: dict[int, dict[str, float]] = {}
    for num_clients in args.clients:
        blobs = SyntheticBlobs(num_classes=10, dim=args.dim, train_size=args.per_client * num_clients,
                               test_size=200, seed=0)
        dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=num_clients, partition="iid")
        dm.setup()
        variants = list(VARIANTS)
        if complete_at is not None:
            predicted = complete_at[1] * (num_clients / complete_at[0]) ** 2
            if predicted > args.complete_budget_s:
                variants.remove("complete")
        times = {v: [] for v in variants}
        metrics, models = {}, {}
        for _ in range(args.repeats):
            for variant in variants:
                engine, _ = fit_engine(AFL(gamma=1.0, gamma_out=0.1), dm, federation(variant, args.dropout), test=False)
                times[variant].append(engine.fit_metrics["time/fit_s"])
                metrics[variant], models[variant] = engine.fit_metrics, engine.method
        fit_s = fits[num_clients] = {v: statistics.median(t) for v, t in times.items()}
        if "complete" in fit_s:
            complete_at = (num_clients, fit_s["complete"])
        plain = models["plain"].weight
        distance = float(torch.linalg.norm(models["sparse"].weight - plain) / torch.linalg.norm(plain))
        sparse = metrics["sparse"]
        complete = metrics.get("complete")
        cost = client_costs(dm, args.dropout, args.cost_clients)
        # every stream the clients drew (fit total), each as long as the upload, at the keystream's speed
        words = sparse["comm/secagg_mask_streams_per_client"] * num_clients * cost["words"] / cost["streams"]
        floor = fit_s["plain"] + words * cost["keystream"] / cost["words"]
        rows.append(
            f"| {num_clients} | {fit_s['plain']:.2f} s | {fit_s['sparse']:.2f} s | "
            f"**{fit_s['sparse'] / fit_s['plain']:.2f}** | {floor / fit_s['plain']:.2f} | "
            + (f"{fit_s['complete']:.2f} s | {fit_s['complete'] / fit_s['plain']:.2f} | " if complete else
               f"skipped (≈ {complete_at[1] * (num_clients / complete_at[0]) ** 2:.0f} s by K²) | – | ")
            + f"{int(sparse['comm/secagg_degree'])} / {int(sparse['comm/secagg_threshold'])} | "
            f"{sparse['comm/secagg_mask_streams_per_client']:.1f} | "
            + (f"{complete['comm/secagg_mask_streams_per_client']:.1f} | " if complete else "– | ")
            + f"{sparse['comm/secagg_share_bytes_per_client'] / 1e3:.1f} kB | "
            f"{sparse['comm/bytes_up_per_client'] / 1e3:.1f} kB | {sparse['time/secure_aggregation_s']:.2f} s | "
            f"{distance:.1e} |")
        print(rows[-1], flush=True)
        cost_rows.append(
            f"| {num_clients} | {cost['rows']:.0f} | {cost['streams']} | {cost['words'] / 1e6:.2f} M | "
            f"{cost['compute'] * 1e3:.2f} ms | {cost['encode'] * 1e3:.2f} ms | {cost['masks'] * 1e3:.2f} ms | "
            f"**{cost['masks'] / cost['compute']:.2f}** | {cost['keystream'] * 1e3:.2f} ms | "
            f"{cost['keystream'] / cost['compute']:.2f} | {cost['masks'] / cost['words'] * 1e9:.2f} ns | "
            f"{cost['keystream'] / cost['words'] * 1e9:.2f} ns |")
        print(cost_rows[-1], flush=True)

    anchor = []
    if args.flower_clients:
        num_clients, length = args.flower_clients, args.dim * (args.dim + 1) // 2 + 10 * args.dim
        degree, threshold = secagg_plus_parameters(num_clients, args.dropout, 0.05)
        flower = flower_round(num_clients, length, degree, threshold, args.dropout)
        ours = fits.get(num_clients)
        anchor.append(
            f"| {num_clients} | {length} | {degree + 1} / {threshold} | {flower['setup']:.1f} s | "
            f"{flower['share_keys']:.1f} s | {flower['collect_masked_vectors']:.1f} s | {flower['unmask']:.1f} s | "
            f"**{flower['round']:.1f} s** | "
            + (f"{ours['sparse']:.2f} s | {flower['round'] / ours['sparse']:.0f} | {ours['plain']:.2f} s |"
               if ours else "– | – | – |"))
        print(anchor[-1], flush=True)

    upload = args.dim * (args.dim + 1) // 2 + 10 * args.dim
    lines = [
        "# Secure aggregation at scale: SecAgg+ (sparse graph) against all pairs, AFL",
        "",
        f"Synthetic blobs, d = {args.dim}, 10 classes, {args.per_client} rows per client (iid); upload "
        f"{upload} ring elements (8 bytes each); dropout {args.dropout:g}; AFL γ = 1, γ_out = 0.1; in-process "
        f"engine, one torch thread. Fit time: median of {args.repeats}, the variants interleaved; ratios to the "
        "plain fit of this run (the machine is shared: compare within the table only).",
        machine_line(f"whole run {time.perf_counter() - run_start:.0f} s", load_at_start),
        "",
        "SecAgg+: k and t from the rule (γ = 0.05 corrupt, δ = the dropout, σ = 40, η = 30; k = n − 1 where no "
        "smaller k meets the bounds). Streams / client and share bytes / client: the engine's "
        "`comm/secagg_mask_streams_per_client` and `comm/secagg_share_bytes_per_client` (fit totals / K: "
        "survivors draw k + 1 streams, all pairs n − 1; every participant deals 2k shares, survivors reveal k, "
        "16 bytes each). Unmask: the server's time (`time/secure_aggregation_s`: Shamir reconstruction and its "
        "mask streams). Distance: ‖W_SecAgg+ − W_plain‖ / ‖W_plain‖. Floor: the ratio were the masks only "
        "their keystream (second table).",
        "",
        "| K | fit, plain | fit, SecAgg+ | ratio | floor | fit, all pairs | ratio | k / t | streams / client, SecAgg+ "
        "| streams / client, all pairs | shares / client | upload / client | unmask, SecAgg+ | distance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Each client's mask cost against its own compute (SecAgg+; medians over "
        f"{args.cost_clients} clients, or all of them below that): compute = the engine's client step on its rows "
        "(AFL's G_k, H_k), encode = its fixed-point ring elements, masks = its k + 1 AES-128-CTR streams as long "
        "as the upload, summed (`SecureAggregator.mask`). Words: the 8-byte stream words it draws. Keystream: "
        "OpenSSL's AES-128-CTR writing as many words under one key and nothing else (no key schedules, no sums): "
        "the PRG's own speed on this machine. `floor` in the table above: the plain fit plus every stream the "
        "clients draw at that speed, over the plain fit — what no implementation of these masks goes below.",
        "",
        "| K | rows / client | streams / client | words / client | compute | encode | masks | masks / compute "
        "| keystream | keystream / compute | masks per word | keystream per word |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *cost_rows,
    ]
    if anchor:
        lines += [
            "",
            "Flower's own SecAgg+ as the anchor (`SecAggPlusWorkflow` + `secaggplus_mod`, flwr 1.42, one round of a "
            "simulation on Ray, one CPU per ClientApp): the same K and upload length L (float32, no training), "
            "k + 1 shares (Flower counts the client itself) and t from the rule, the same dropout (after the key "
            "sharing, so the server recovers those masks). Its stages: setup (keys), share keys (encrypted Shamir "
            "shares), masked vectors (the clients' masking), unmask (the server's reconstruction and mask removal); "
            "beside it this workbench's SecAgg+ fit at the same K from the first table.",
            "",
            "| K | L | shares / t | setup | share keys | masked vectors | unmask | round, Flower | fit, SecAgg+ here "
            "| Flower / here | fit, plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *anchor,
        ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
