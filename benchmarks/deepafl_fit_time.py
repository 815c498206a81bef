"""Where a DeepAFL fit's time goes, round by round, as `python -m workbench fit` runs it; and the
fit against the official DeepAFL code on the same features.

The fit is `configs/deepafl_fashion.yaml` (T = 20, h = f = 1024, γ = 1, γ_s = 0.05, gelu) with
`--data.num_clients=10 --data.partition=iid --eval_every 1`, run through the command line in this
process (its run folder in a temporary directory): the learning curve every round, the CSV logs and
the round's checkpoint (`last.ckpt`) as a user's fit has them. Each part of a round is timed where it
runs:

    clients     the clients' step (`time/client_s`)
    server      planning, the aggregation and the server's solve (`time/server_s`)
    protocol    the rest of the round function: dropouts, bytes counted, results gathered
    curve       the learning curve: the model scored on the 10k test rows (`time/curve_s`)
    logging     the round's metrics to Lightning and the CSV file
    checkpoint  `last.ckpt` written (atomically) after the round
    loop        what is left of the round's wall time: Lightning's loop between rounds

With `--official PATH` (a clone of github.com/tangent-heng/DeepAFL, kept outside this repository)
the official module also fits centrally on the same features, in float32 as it is written: one
client holding every training row, its DataLoader at the official batch size (256), the test pass
scoring every depth as its server's `evaluate` does. The runs alternate (official, float32,
float64, ...) `--repeats` times; medians.

    python benchmarks/deepafl_fit_time.py --official /tmp/DeepAFL
    python benchmarks/deepafl_fit_time.py --dtypes float64 --repeats 1     # the breakdown alone
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average, machine_line, write_report
from workbench.cli import main as workbench_fit
from workbench.data import FederatedDataModule
from workbench.engines import lightning as engine_module
from workbench.experiment import RoundCheckpoint

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("clients", "server", "protocol", "curve", "logging", "checkpoint", "loop")
FIT_ARGS = ["--config", str(ROOT / "configs" / "deepafl_fashion.yaml"), "--data.num_clients=10",
            "--data.partition=iid", "--eval_every=1", "--wandb=disabled", "--trainer.enable_progress_bar=false"]


class RoundClock:
    """Seconds of each part of each round, from wrappers around the functions that do them."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.round = -1
        self.starts: dict[int, float] = {}
        self.end = 0.0
        self._inside = False
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str, after) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._inside:  # a part within a part (the curve's step metrics logged): the outer one's
                return original(*args, **kwargs)
            self._inside, start = True, time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                self._inside = False
            self.end = time.perf_counter()  # the last round ends with the last part done
            after(result, self.end - start)
            return result

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def add(self, part: str):
        return lambda result, seconds: self._add(part, seconds)

    def _add(self, part: str, seconds: float) -> None:
        self.rounds[self.round][part] += seconds

    def _round_done(self, result, seconds: float) -> None:
        parts = self.rounds[self.round]
        parts["clients"] += result.client_s
        parts["server"] += result.server_s
        parts["protocol"] += seconds - result.client_s - result.server_s

    def __enter__(self) -> RoundClock:
        original_step = engine_module.LightningEngine.training_step

        def training_step(engine, batch, batch_idx):
            if batch_idx == 0:
                self.round = engine.method.round
                self.starts[self.round] = time.perf_counter()
            return original_step(engine, batch, batch_idx)

        self._undo.append((engine_module.LightningEngine, "training_step", original_step))
        engine_module.LightningEngine.training_step = training_step
        self._wrap(engine_module, "run_round", self._round_done)
        for name in ("_score_round", "_log_steps"):
            self._wrap(engine_module.LightningEngine, name, self.add("curve"))
        self._wrap(engine_module.LightningEngine, "on_train_epoch_end", self.add("logging"))
        for name in ("log_metrics", "save"):
            self._wrap(CSVLogger, name, self.add("logging"))
        self._wrap(RoundCheckpoint, "on_train_epoch_end", self.add("checkpoint"))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def table(self) -> dict[int, dict[str, float]]:
        """Each round's parts, `loop` its wall time (start to the next round's start, the last
        round's to the end of its last part) less the others, and `wall`."""
        out = {}
        starts = sorted(self.starts)
        for i, index in enumerate(starts):
            end = self.starts[starts[i + 1]] if i + 1 < len(starts) else self.end
            parts = dict(self.rounds[index])
            parts["wall"] = end - self.starts[index]
            parts["loop"] = parts["wall"] - sum(parts.get(part, 0.0) for part in PARTS if part != "loop")
            out[index] = parts
        return out


def workbench_run(dtype: str, folder: str, fit_args: list[str] = FIT_ARGS) -> dict:
    """One fit through the command line (`fit_args`) in `dtype`, its run folder under `folder`:
    its metrics, and its parts by round (`RoundClock`) and in all."""
    with RoundClock() as clock:
        cli = workbench_fit(["fit", *fit_args, f"--model.dtype={dtype}", f"--run_dir={folder}"])
    metrics = cli.model.fit_metrics
    rounds = clock.table()
    checkpoint = Path(cli.trainer.log_dir) / "last.ckpt"
    return {"run": f"workbench, {dtype}", "fit": metrics["time/fit_s"], "rounds": rounds,
            "parts": {part: sum(r.get(part, 0.0) for r in rounds.values()) for part in PARTS},
            "accuracy": cli.method.depth_accuracy[-1],  # the test split at depth T
            "up": metrics["comm/bytes_up_per_client"], "checkpoint_mb": checkpoint.stat().st_size / 1e6}


def official_run(path: Path) -> dict:
    """The official module centrally (see the module's docstring): fit, then the test pass."""
    sys.path.insert(0, str(path))
    from federated_entity.client import FederatedClient
    from federated_entity.server import FederatedServer
    from torch.utils.data import TensorDataset

    data = FederatedDataModule(dataset="fashion_mnist", backbone="efficientnet_lite0", input_size=64,
                               num_clients=10, partition="iid")
    data.setup()
    classes = data.num_classes
    train = TensorDataset(data.train_features.float(), torch.nn.functional.one_hot(data.train_labels, classes).float())
    test = TensorDataset(data.test_features.float(), torch.nn.functional.one_hot(data.test_labels, classes).float())
    args = types.SimpleNamespace(batch_size=256, workers=0, feat_size=data.feature_dim, fe=1024, hidden_dim=1024,
                                 num_classes=classes, n_layers=20, reg=1.0, reg_sand=0.05, activation="gelu")
    torch.manual_seed(0)
    start = time.perf_counter()
    server = FederatedServer(torch.nn.Identity(), train, test, args, "cpu")
    client = FederatedClient(0, torch.nn.Identity(), train, "cpu", args)
    for layer in range(args.n_layers + 1):  # the official main loop, with one client
        server.aggregate_correlation(*client.train(server.get_global_model(), layer, "top_classifiers"))
        server.update_global_model(layer, "top_classifiers")
        if layer < args.n_layers:
            server.aggregate_sandwich(*client.train(server.get_global_model(), layer, "sandwiched_layers"))
            server.update_global_model(layer, "sandwiched_layers")
    fit = time.perf_counter() - start
    accuracy = server.evaluate()[args.n_layers]
    return {"run": "official, float32", "fit": fit, "with_test": time.perf_counter() - start,
            "accuracy": float(accuracy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, help="a clone of github.com/tangent-heng/DeepAFL (not committed)")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "deepafl_fit_time.md"))
    args = parser.parse_args()
    load_at_start = load_average()
    runs: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            if args.official:
                runs["official, float32"].append(official_run(args.official))
            for dtype in args.dtypes.split(","):
                run = workbench_run(dtype, folder)
                runs[run["run"]].append(run)
                print(run["run"], f"fit {run['fit']:.1f} s", flush=True)

    def listed(done: list[dict], key: str) -> str:
        return " – ".join(f"{run[key]:.1f}" for run in done)

    official = statistics.median(run["with_test"] for run in runs["official, float32"]) if args.official else None
    summary = []
    for name, done in runs.items():
        fit = statistics.median(run["fit"] for run in done)
        if name.startswith("official"):
            summary.append(f"| {name} | {listed(done, 'fit')} | {listed(done, 'with_test')} | — | — | — | — | — | "
                           f"1.00 | {100 * done[-1]['accuracy']:.2f} | — | — |")
            continue
        parts = {part: statistics.median(run["parts"][part] for run in done) for part in PARTS}
        arithmetic = parts["clients"] + parts["server"]
        versus = f"{fit / official:.2f}" if official else "—"
        summary.append(
            f"| {name} | {listed(done, 'fit')} | — | {arithmetic:.1f} | {parts['curve']:.1f} | "
            f"{parts['checkpoint']:.1f} | {fit / arithmetic:.3f} | {fit / (arithmetic + parts['curve']):.3f} | "
            f"{versus} | {100 * done[-1]['accuracy']:.2f} | {done[-1]['up'] / 1e6:.3f} | "
            f"{done[-1]['checkpoint_mb']:.1f} |")
    breakdown = []
    ours = [name for name in runs if name.startswith("workbench")]
    last = runs["workbench, float64" if "workbench, float64" in ours else ours[0]][-1]  # float64's, if it ran
    for index, parts in last["rounds"].items():
        breakdown.append(f"| {index} | " + " | ".join(f"{parts.get(part, 0.0):.3f}" for part in PARTS)
                         + f" | {parts['wall']:.3f} |")
    totals = last["parts"]
    breakdown.append("| all | " + " | ".join(f"{totals[part]:.2f}" for part in PARTS)
                     + f" | {sum(r['wall'] for r in last['rounds'].values()):.2f} |")
    lines = [
        "# A DeepAFL fit's time, part by part",
        "",
        ("Fashion-MNIST, EfficientNet-Lite0 features at 64 px (d = 1280), 60k training rows, 10 IID clients, "
         "`configs/deepafl_fashion.yaml` (T = 20, h = f = 1024, γ = 1, γ_s = 0.05, gelu, fused) through "
         "`python -m workbench fit` with `--eval_every 1`, in this process; " + str(args.repeats)
         + " alternating repeats, each value listed, ratios of medians. `fit s` is `time/fit_s`; "
         "`clients + server` their seconds; `curve` the learning curve (`time/curve_s`: every round the "
         "model scored on the 10k test rows, one more layer of them); `checkpoint` the round's `last.ckpt`. "
         "The official code (github.com/tangent-heng/DeepAFL, run from a scratch clone, not part of this "
         "repository) fits centrally in float32 on the same features; its time counts the test pass over "
         "every depth, as the workbench's curve does."),
        "",
        ("| run | fit s | fit + test s | clients + server s | curve s | checkpoint s | fit / (clients + server) | "
         "fit / (clients + server + curve) | × official | accuracy % | MB up / client | checkpoint MB |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *summary,
        "",
        f"Round by round ({last['run']}, its last repeat), seconds:",
        "",
        "| round | " + " | ".join(PARTS) + " | wall |",
        "|---|" + "---|" * (len(PARTS) + 1),
        *breakdown,
        "",
        machine_line(args.note, load_at_start),
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
