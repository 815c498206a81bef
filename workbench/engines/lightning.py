"""The in-process engine: a LightningModule that runs the rounds of any method.

One Lightning epoch is one communication round: `workbench.engines.round.run_round` (plan, drop,
mask, move, combine, count; a plain function) over this engine's transport — the clients of this
process (`LocalClients`, vectorized over the cohort), a share of whole clients per process
(`ddp.ProcessClients`, with `trainer.strategy=ddp`), or Flower SuperNodes (`FlowerClients`). The
engine adds what Lightning is for: the loop, logging (`comm/*`, `time/*`, the method's and the
protocol's metrics, the method's own steps), evaluation, checkpoints.

With `federation.sample_rate` < 1 each round's cohort is a seeded sample of the clients
(`Federation.sampled_clients`); `federation.dropout` drops a seeded share of it; under secure
aggregation the clients mask their messages and the server sees only the sum; `dp_sigma` noises
the aggregated statistics and client-level DP (`federation.dp_clip`) clips the clients' model
updates and noises their sum, logging `privacy/epsilon` (the ε spent so far at `dp_delta`); a run
whose final ε would exceed `target_epsilon` is refused before its first round
(`workbench.federation.privacy.FitPrivacy`). The current clip norm (adaptive clipping) is kept
with the fit's running totals in checkpoints.

After the last round every client receives `method.final_broadcast()` and does its local work
(`ClientHalf.finish`, `run_final`). The engine sums every message's bytes at the dtype sent
(`comm/bytes_up`: each surviving client's message on the wire; `comm/bytes_down`: the broadcast to
each client of the cohort, and the final model to all K), times the clients and the server, and
stops after `num_rounds`: one Lightning epoch is one round, so the engine sets the Trainer's epoch
limit from the method's rounds (leave `max_epochs` unset) and refuses one below them.

With several processes (`trainer.strategy=ddp`, `workbench.engines.ddp`) each process serves a
disjoint set of whole clients; the partial sums (or stacks, or masked ring sums) are combined
across processes by the transport, and every process runs the same server update on the same total.

Checkpoints hold the global model (`method.*`), the round counter and the clients' own state
(`client_half.*`), and under `workbench` the method's class and settings, the problem's shape and
the fit's running totals (bytes, seconds), so a fit resumed from one continues exactly (its
`comm/*` and `time/*` numbers too). A checkpoint of another method, settings or data shape is
refused before anything is loaded; a resumed fit may ask for more rounds (`num_rounds`). Each
round's aggregated uploads are checked for NaN/inf before the server solves or steps on it.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch
from lightning import LightningDataModule, LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from workbench.data.population import Population, population_of
from workbench.engines import ddp
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, Rejoins, RoundResult, Transport, run_final, run_round
from workbench.engines.stopping import Stopping
from workbench.federation import Federation
from workbench.federation.privacy import clip_features
from workbench.federation.stages import Pipeline, Stage
from workbench.federation.systems import SimulatedClock, Systems
from workbench.methods.base import FederatedMethod, Problem
from workbench.runlog import save_client_events, save_per_client_table
from workbench.settings import init_arguments, plain

REJECTED = "rejected"  # a client event: the screen rejected the client, left out of the fit from then on


def check_epoch_limit(max_epochs: int | None, num_rounds: int) -> None:
    """One epoch is one round: a Trainer limited to fewer epochs than the method's rounds would
    stop with an unfitted model."""
    if max_epochs is not None and max_epochs != -1 and max_epochs < max(num_rounds, 1):
        raise ValueError(f"trainer.max_epochs={max_epochs} stops the fit before the method's {num_rounds} rounds "
                         "(one epoch is one round): leave max_epochs unset, the engine runs model.num_rounds")


def rejoined_events(round_index: int, rejoined: dict[int, bool]) -> list[list]:
    """[round, client, "rejoined", why] rows of the clients served again (-> whether afresh)."""
    return [[round_index, client, "rejoined", "a new node: its client state afresh" if fresh
             else "its node answered again: its client state as it went away"] for client, fresh in rejoined.items()]


@runtime_checkable
class ScoresLocally(Protocol):
    """A transport whose clients score their own local test splits where they live (Flower's)."""

    def local_accuracy(self) -> tuple[Tensor, Tensor]:
        """(correct (K,), total (K,)) int64 of every client's own model on its local test split."""
        ...


#: the engine's names of the splits it scores (Lightning's `val`) -> the population's
SPLITS = {"test": "test", "val": "holdout", "local_test": "local_test"}


class LightningEngine(LightningModule):
    """Runs `method`'s rounds under `federation`'s protocol, one Lightning epoch per round.

    Args:
        method: the server half (a `FederatedMethod`); its client half is built from it.
        federation: the protocol (dropouts, secure aggregation, noise: `workbench.federation.stages`);
            default none of its parts. The method gets its read-only view (`ProtocolView`) when the
            fit is checked.
        clients: who runs the client halves; default the clients of this process
            (`LocalClients`); the Flower engine passes its SuperNodes.
        eval_every: the learning curve: every `eval_every` rounds (and after the last) the global
            model is scored on the test split (`round/test_acc`) and, under the personalized
            protocol, each client's model on its local test split (`round/test_acc_local_mean`: the
            global model for a global method; personal models where they exist along the rounds;
            the other personalized methods score theirs once, after the final broadcast), beside
            the bytes sent so far; 0: no curve. `curve` keeps the points. With a validation split
            each point also holds `round/val_acc`.
        stopping: the stopping rule (`workbench.engines.stopping`): a plateau of validation
            accuracy ends the fit before `num_rounds`; default none.
        other_data: load a checkpoint made under other data settings (another partition, seed,
            K, features, split) on purpose; by default that is refused, each difference named.
        systems: the clients' device and network profiles (`workbench.federation.systems`): a
            simulated clock logs `latency/round_s` and `latency/total_s`, and a round deadline
            drops late clients as stragglers; default none.
        stages: protocol stages of one's own (`workbench.federation.stages.Stage`; e.g. the
            clients' local noise, `workbench.federation.local_noise.LocalNoise`), placed in the
            federation's pipeline after the built-in stage each names; default none.
    """

    def __init__(self, method: FederatedMethod, federation: Federation | None = None,
                 clients: Transport | None = None, eval_every: int = 1, stopping: Stopping | None = None,
                 other_data: bool = False, systems: Systems | None = None, stages: Sequence[Stage] = ()) -> None:
        super().__init__()
        # A Trainer without max_epochs is how to run the engine (it sets the limit from the rounds):
        # Lightning's notice that it chose 1000 epochs says nothing here (set here, not at import, so
        # that it holds wherever the engine is built, inside any caller's warning filters)
        warnings.filterwarnings("ignore", message="`max_epochs` was not set", category=PossibleUserWarning)
        if not isinstance(method, FederatedMethod):
            raise TypeError(f"the engine runs a workbench FederatedMethod, got {type(method).__name__}")
        self.automatic_optimization = False
        self.method = method
        if not isinstance(federation, Federation | None):
            raise TypeError(f"federation must be a workbench.federation.Federation, got {type(federation).__name__}")
        self.federation = federation or Federation()  # the protocol it runs (default: none of its parts)
        self.stages = tuple(stages)
        self._protocol_checked = False  # `check_data` checked the protocol (and gave its warnings)
        self.pipeline = Pipeline.of(self.federation, self.stages)  # (a stage that is none, or misplaced, fails here)
        if not (isinstance(eval_every, int) and eval_every >= 0):
            raise ValueError(f"eval_every must be an integer ≥ 0 (rounds between two points of the learning curve; "
                             f"0: none), got {eval_every!r}")
        self.eval_every = eval_every
        self.stopping = stopping or Stopping()
        self.systems = systems or Systems()
        self.other_data = other_data
        self._stop = False  # the stopping rule ended the fit after this round
        self.curve: list[dict[str, float]] = []  # the learning curve's points, one per scored round
        self.remote_clients = clients
        self.clients: Transport | None = None
        self.fit_metrics: dict[str, float] = {}
        self.local_accuracy: dict[str, list] | None = None
        self._totals: dict[str, float] = {}  # the fit's running bytes and seconds
        self._restored_totals: dict[str, float] | None = None  # a checkpoint's, until the resumed fit starts
        # clients whose replies never came, or that came back on a new node (remote transports):
        # [round, client, event, why] rows
        self.client_events: list[list] = []
        self._restored_events: list[list] | None = None
        self._population: tuple[Any, Population] | None = None  # (its data module, the population it assembled)

    @property
    def data(self) -> Population | None:
        """The run's data (`Population`) from its FederatedDataModule (Lightning sets
        `trainer.datamodule` at run time; assembled once per data module); None before."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return None
        if self._population is None or self._population[0] is not datamodule:
            self._population = (datamodule, population_of(datamodule))
        return self._population[1]

    @property
    def population(self) -> Population:
        """The run's data, once Lightning has given the engine its data module."""
        data = self.data
        if data is None:
            raise RuntimeError("the engine reads its data from the Trainer's data module: call trainer.fit/test first")
        return data

    @property
    def transport(self) -> Transport:
        """Who runs the clients (set up in `setup`)."""
        if self.clients is None:
            raise RuntimeError("the engine's clients are set up with the data: call trainer.fit/test first")
        return self.clients

    # ---- setup ----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        data = self.data
        if data is None:
            raise RuntimeError("a federated method needs a FederatedDataModule (`data:` in the config)")
        if stage == "fit":
            self._check_processes()
            check_epoch_limit(self.trainer.fit_loop.max_epochs, self.method.num_rounds)
            self.trainer.fit_loop.max_epochs = max(self.method.num_rounds, 1)  # the engine stops there anyway
            if data.holdout is None:  # no validation split: no validation loop to set up
                self.trainer.limit_val_batches = 0
        problem = self.problem_of(data)
        if self.method.setup(problem) or self.clients is None:
            self.val_acc = MulticlassAccuracy(problem.num_classes, average="micro")
            self.test_acc = MulticlassAccuracy(problem.num_classes, average="micro")
            self.clients = self.remote_clients or self._local_clients(data)
            local = self.clients.local if isinstance(self.clients, ddp.ProcessClients) else self.clients
            if isinstance(local, LocalClients):
                self.client_half = local.half  # a submodule: checkpoints keep the clients' state
                # each process keeps its own clients' state: never synchronized across processes
                self._ddp_params_and_buffers_to_ignore = [
                    f"client_half.{name}" for name, _ in self.client_half.named_parameters()] + [
                    f"client_half.{name}" for name, _ in self.client_half.named_buffers()]

    @staticmethod
    def problem_of(data: Population) -> Problem:
        """The shape of the data's federated problem."""
        return Problem.of(data)

    def check_data(self, data: Population | LightningDataModule, fitting: bool) -> None:
        """Before any run folder exists (the command line calls it once the data is set up): the
        method set up for the data (a model it cannot build for this shape fails here), and for a
        fit the protocol and the stopping rule checked against it."""
        data = population_of(data)
        self.method.setup(self.problem_of(data))
        if fitting:
            FitProtocol.check(self.method, self.federation, len(data.clients),
                              self.systems if self.systems.active else None, in_process=self.remote_clients is None,
                              remote=self.remote_clients is not None, stages=self.stages)
            self._protocol_checked = True
            self._check_stopping(data)
            self.method.check_data(data)

    def _check_stopping(self, data: Population) -> None:
        if self.stopping.active and data.holdout is None:
            raise ValueError(f"stopping.patience={self.stopping.patience} watches validation accuracy, and there "
                             "is no validation split: set data.val_fraction (e.g. 0.1) with data.val_split=clients")

    def _local_clients(self, data: Population) -> Transport:
        """This process's clients: all of them, or with several processes its whole clients'
        share, combined across the processes each round (`ddp.ProcessClients`)."""
        rows = slice(None)
        if self.trainer.world_size > 1:
            rows = ddp.client_shard(data.client_ids, self.trainer.global_rank, self.trainer.world_size)
        client_ids = data.client_ids[rows]
        local = LocalClients(self.method, data.train.features[rows].to(self.device),
                             data.train.labels[rows].to(self.device), client_ids.to(self.device),
                             torch.unique(client_ids).to(self.device), data.batch_size, self.federation,
                             self.stages)
        return ddp.ProcessClients(local, self.trainer.strategy) if self.trainer.world_size > 1 else local

    def _check_processes(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy) and not isinstance(strategy, ddp.FederatedDDPStrategy):
            raise ValueError(
                "a federated method under plain DDP would be wrapped for gradient all-reduce and fed padded, "
                "sample-split batches: use strategy=FederatedDDPStrategy() (or 'federated_ddp') in "
                "Python; on the command line --trainer.strategy=ddp selects it")

    def configure_optimizers(self) -> list:
        return []  # the rounds update the model themselves: no optimizer (and nothing for Lightning to warn about)

    # ---- rounds -----------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if self.method.fitted:  # its final broadcast went out: the clients hold the delivered model
            raise ValueError(
                f"this checkpoint is of a finished fit ({self.method.round} rounds and the final broadcast): it "
                "cannot run longer; fit afresh with the rounds you want (drop --ckpt_path), or resume the "
                "last.ckpt of an unfinished fit")
        self.available = self.population.clients.to(self.device)  # clients with data
        if self.method.round > 0 and isinstance(self.clients, Rejoins):
            # a resumed fit over new nodes (a new Flower run): every client's state starts afresh there
            self.method.forget_clients(self.available)
        self._totals = {"bytes_up": 0, "bytes_down": 0, "client_s": 0.0, "server_s": 0.0, "secure_s": 0.0,
                        "curve_s": 0.0}
        restored = self._restored_totals or {}
        self._totals.update(restored)  # a resumed fit: its numbers continue from the checkpoint's
        self._fit_start = time.perf_counter() - float(restored.get("fit_s", 0.0))
        self._totals.pop("fit_s", None)
        self._restored_totals = None
        self.client_events, self._restored_events = list(self._restored_events or []), None
        clock = None
        if self.systems.active:  # a resumed fit keeps the clock's measurements
            rows = self.population.rows_per_client()
            clock = SimulatedClock(self.systems, rows, row_s=self._totals.pop("latency_row_s", None),
                                   upload_bytes=self._totals.pop("latency_upload_bytes", None))
            self._totals.setdefault("latency_s", 0.0)
        with warnings.catch_warnings():
            if self._protocol_checked:  # its warnings were given when the command line checked it
                warnings.simplefilter("ignore")
            self.protocol = FitProtocol.start(self.method, self.federation, len(self.available),
                                              clip_norm=self._totals.pop("dp_clip_norm", None), clock=clock,
                                              in_process=self.remote_clients is None and self.trainer.world_size == 1,
                                              remote=self.remote_clients is not None,
                                              rejected=[event[1] for event in self.client_events
                                                        if event[2] == REJECTED],
                                              stages=self.stages)
        self.curve = []
        self._stop = False
        self._check_stopping(self.population)

    def training_step(self, batch, batch_idx: int) -> None:
        """One round per epoch: the clients' data comes from the data module's training rows, not
        from the batches (FederatedDataModule yields one item per epoch)."""
        if batch_idx > 0:
            return
        self.fit_metrics = {}
        if self.method.rounds_left:
            self._run_round()
        if not self.method.rounds_left or self._stop:
            self._finish()

    def _run_round(self) -> None:
        result = run_round(self.method, self.transport, self.protocol, self.available)
        if self.trainer.world_size > 1:  # every process holds rank 0's model
            ddp.broadcast_module_state(self.method)
        self._add_round(result)
        self._set_totals()
        method = self.method
        due = bool(self.eval_every) and (method.round % self.eval_every == 0 or not method.rounds_left)
        with self._curve_time():
            if due or self.stopping.active:
                # a global method's personal model is its global one: scored on the local splits too
                self._score_round(personal=method.personal_every_round or not method.personalized, test=due)
            if self.stopping.active:  # the last round too: its accuracy may be the best
                stops = self.stopping.stops(self._totals, method.round, self.curve[-1]["round/val_acc"])
                self._stop = stops and method.rounds_left
                self.fit_metrics.update({"stop/best_val_acc": self._totals["stop_best"],
                                         "stop/best_round": float(self._totals["stop_best_round"])})
            self._log_steps()

    @contextlib.contextmanager
    def _curve_time(self) -> Iterator[None]:
        """Times the block into `time/curve_s`: the learning curve's scoring (and the method's
        step metrics), the fit's arithmetic beside the clients' and the server's."""
        start = time.perf_counter()
        yield
        self._totals["curve_s"] += time.perf_counter() - start
        self.fit_metrics["time/curve_s"] = self._totals["curve_s"]

    def _add_round(self, result: RoundResult) -> None:
        """The round's numbers into the fit's running totals and this round's metrics."""
        totals = self._totals
        totals["bytes_up"] += result.bytes_up
        totals["bytes_down"] += result.bytes_down
        totals["client_s"] += result.client_s
        totals["server_s"] += result.server_s
        totals["secure_s"] += result.secure_s
        for name, value in result.secagg_costs.items():  # the clients' mask streams and shares, the server's streams
            totals[f"secagg_{name}"] = totals.get(f"secagg_{name}", 0) + value
        times: dict[str, float] = {}  # the clients' time/* metrics: totals over the clients and rounds
        for name, seconds in result.client_time_sums.items():
            totals[name] = times[name] = totals.get(name, 0.0) + seconds
        self.fit_metrics.update({**result.metrics, **times})
        missing = sorted(result.missing.items())
        self._log_events(rejoined_events(result.round_index, result.rejoined)
                         + [[result.round_index, client, "missing", why] for client, why in missing]
                         + [[result.round_index, client, REJECTED, "the screen: left out from now on"]
                            for client in result.screened_out])
        if self.protocol.privacy.clip_norm is not None:
            totals["dp_clip_norm"] = self.protocol.privacy.clip_norm
        for name in ("screen/rejected", "attack/adversaries_rejected"):  # the screen's decisions over the fit
            if name in result.metrics:
                totals[name] = totals.get(name, 0.0) + result.metrics[name]
        clock = self.protocol.clock
        if clock is not None and result.latency_s is not None:  # the clock's measurements go on after a resume
            totals["latency_s"] += result.latency_s
            totals["latency_stragglers"] = totals.get("latency_stragglers", 0.0) + result.metrics["latency/stragglers"]
            totals["latency_row_s"] = clock.row_s or 0.0
            totals["latency_upload_bytes"] = clock.upload_bytes or 0.0

    def _log_events(self, events: list[list]) -> None:
        """Clients' [round, client, event, why] rows: into `client_events.csv` and on stderr."""
        if not events:
            return
        self.client_events += events
        save_client_events(self.client_events, self.trainer)
        if self.trainer.is_global_zero:
            for round_index, client, event, why in events:
                print(f"round {round_index}: client {client} {event} ({why})", file=sys.stderr)

    def _finish(self) -> None:
        """The final broadcast to every client, and their local work on it."""
        final = run_final(self.method, self.transport)
        self._log_events(rejoined_events(self.method.round, final.rejoined))
        self._totals["bytes_down"] += final.bytes_down
        self._totals["client_s"] += final.client_s
        served = max(len(self.available), 1)
        self.fit_metrics.update({name: value / served for name, value in final.metric_sums.items()})
        if final.client_s > 0:
            self.fit_metrics["time/local_s"] = final.client_s
        self._set_totals()
        if self.eval_every and self.method.personalized:  # the personal models as delivered
            with self._curve_time():
                self._score_round(personal=True)
        self.fit_metrics["time/fit_s"] = time.perf_counter() - self._fit_start

    def _set_totals(self) -> None:
        totals, method = self._totals, self.method
        self.fit_metrics.update({
            "comm/rounds": float(method.round),
            "comm/bytes_up": float(totals["bytes_up"]),
            "comm/bytes_up_per_client": float(totals["bytes_up"]) / method.num_clients,
            "comm/bytes_down": float(totals["bytes_down"]),
            "comm/bytes_down_per_client": float(totals["bytes_down"]) / method.num_clients,
            "time/client_s": totals["client_s"],
            "time/server_s": totals["server_s"],
            "time/curve_s": totals["curve_s"],
        })
        if "latency_s" in totals:  # the simulated clock: seconds the rounds took on the clients' links
            self.fit_metrics["latency/total_s"] = totals["latency_s"]
            self.fit_metrics["latency/stragglers_total"] = totals.get("latency_stragglers", 0.0)
            if self.protocol.clock is not None and self.protocol.clock.row_s is not None:  # what the clock took
                self.fit_metrics["latency/row_s"] = self.protocol.clock.row_s
        self.fit_metrics.update({f"{name}_total": totals[name] for name in ("screen/rejected",
                                                                            "attack/adversaries_rejected")
                                 if name in totals})
        if self.federation.screens:
            self.fit_metrics["screen/clients_rejected"] = float(len(self.protocol.rejected))
        if self.federation.secure_aggregation:  # masking (client time) and unmasking (server time)
            self.fit_metrics["time/secure_aggregation_s"] = totals["secure_s"]
            self.fit_metrics.update({  # beside comm/bytes_up_per_client: totals over the fit / K
                "comm/secagg_mask_streams_per_client": totals.get("secagg_mask_streams", 0) / method.num_clients,
                "comm/secagg_share_bytes_per_client": totals.get("secagg_share_bytes", 0) / method.num_clients,
                "comm/secagg_server_mask_streams": float(totals.get("secagg_server_mask_streams", 0))})

    @torch.no_grad()
    def _score_round(self, personal: bool, test: bool = True) -> None:
        """One point of the learning curve, after round `method.round` (added to that round's point
        when it has one): the global model on the test split, the personal models (`personal`) on
        the clients' local test splits, and the bytes up and down per client sent by then, logged
        with the round's metrics as `round/*` (`round/round` the round: a method without rounds
        scores round 0)."""
        method, data = self.method, self.population
        point = {"round": float(method.round)}
        if self.curve and self.curve[-1]["round"] == method.round:  # the final broadcast's, after the last round's
            point = self.curve.pop()
        # (the validation split's chunks are cached apart from Lightning's validation batches)
        for split, key, cache, wanted in (("test", "round/test_acc", "test", test),
                                          ("val", "round/val_acc", "curve_val", True)):
            rows = data.split(SPLITS[split])
            if (wanted and key not in point and method.global_model and method.has_model and rows is not None
                    and len(rows) > 0):  # (cross-silo sites may have no test split)
                point[key] = method.accuracy(self._curve_inputs(rows.features), rows.labels.to(self.device), name=cache)
        if test and personal and data.local_test is not None:
            local_mean = self.personal_accuracy()
            if math.isfinite(local_mean):
                point["round/test_acc_local_mean"] = local_mean
        if len(point) > 1:  # its own bytes: the row's comm/* hold the totals when the row is logged
            point.update({f"round/{key}": self.fit_metrics[f"comm/{key}"]
                          for key in ("bytes_up_per_client", "bytes_down_per_client")})
            if "latency/total_s" in self.fit_metrics:
                point["round/latency_s"] = self.fit_metrics["latency/total_s"]
            self.curve.append(point)
            self.fit_metrics.update({"round/round": point["round"],
                                     **{key: value for key, value in point.items() if key.startswith("round/")}})

    def resolve(self, **settings: float) -> None:
        """The fitted method at other values of its server settings (`FederatedMethod.resolve`):
        the last learning-curve point and the fit's `round/*` metrics scored again on its model."""
        self.method.resolve(**settings)
        last = self.curve.pop()
        self.curve.append({key: value for key, value in last.items()
                           if key not in ("round/test_acc", "round/val_acc", "round/test_acc_local_mean")})
        self._score_round(personal=not self.method.personalized)

    def _curve_inputs(self, features: Tensor) -> Tensor:
        """Evaluation inputs outside Lightning's loops, as its loops pass them: on the device, in
        the trainer's precision, clipped where the clients clip."""
        return self._inputs(self.trainer.precision_plugin.convert_input(features.to(self.device)))

    @torch.no_grad()
    def personal_accuracy(self, split: str = "local_test") -> float:
        """The mean over the clients of each client's own model (the global one for a global
        method) on its own rows of `split`: `local_test` (`test/acc_local_mean`), or `val` (the
        clients' hold-outs: the personalized protocol's score to choose settings on); NaN when no
        client has rows there."""
        correct, total = self._local_scores(split)
        tested = total > 0
        return float((correct[tested].double() / total[tested]).mean()) if tested.any() else math.nan

    def _local_scores(self, split: str = "local_test") -> tuple[Tensor, Tensor]:
        """(correct (K,), total (K,)) int64: each client's own model on its rows of `split`, scored
        where the clients live (a transport that scores its local test split locally, e.g.
        Flower's) or here in chunks (this process's clients; summed over the processes)."""
        if split == "local_test" and isinstance(self.clients, ScoresLocally) and self._scored_remotely():
            correct, total = self.clients.local_accuracy()
            return correct.to(self.device), total.to(self.device)
        if split != "local_test" and self._scored_remotely():
            raise ValueError(f"the clients score only their local test split where they live, not {split!r}")
        data = self.population
        correct = torch.zeros(self.method.num_clients, dtype=torch.long, device=self.device)
        total = torch.zeros_like(correct)
        scored = data.split(SPLITS[split])
        if scored is None or scored.client_ids is None:
            raise ValueError(f"the data has no {split!r} rows of the clients' own")
        rows = data.batch_size
        parts = zip(scored.features.split(rows), scored.labels.split(rows), scored.client_ids.split(rows),
                    strict=True)
        for features, labels, client_ids in parts:
            self._add_local_scores(correct, total, self._curve_inputs(features), labels.to(self.device),
                                   client_ids.to(self.device))
        if self.trainer.world_size > 1:
            correct = ddp.sum_across_processes(correct, self.trainer.strategy)
            total = ddp.sum_across_processes(total, self.trainer.strategy)
        return correct, total

    def _add_local_scores(self, correct: Tensor, total: Tensor, features: Tensor, labels: Tensor,
                          client_ids: Tensor) -> None:
        """Adds each local test row's hit under its own client's model (the global one for a method
        without personal models) to `correct`/`total` (K,): this process's clients only."""
        clients = self.transport
        if isinstance(clients, ddp.ProcessClients):  # each process scores the clients it serves
            mine = torch.isin(client_ids, clients.served)
            features, labels, client_ids = features[mine], labels[mine], client_ids[mine]
        logits = clients.predict(features, client_ids) if self.method.personalized else self.method(features)
        correct.index_add_(0, client_ids, logits.argmax(dim=1).eq(labels).long())
        total.index_add_(0, client_ids, torch.ones_like(client_ids))

    @torch.no_grad()
    def _log_steps(self) -> None:
        """The method's metrics against its own steps (`step_metrics`)."""
        test = self.population.test
        if not len(test):  # no test split (cross-silo sites without the server's own rows)
            return
        labels = test.labels.to(self.device)
        features = self._inputs(test.features.to(self.device))  # as the test pass's
        for step, metrics in self.method.step_metrics(features, labels, self.fit_metrics):
            for logger in self.loggers:
                logger.log_metrics(metrics, step=step)

    def on_train_epoch_end(self) -> None:
        # Every process holds the same numbers (combined in `_aggregate`); syncing keeps Lightning quiet.
        self.log_dict(self.fit_metrics, sync_dist=self.trainer.world_size > 1)
        if self.method.fitted:
            self.trainer.should_stop = True

    # ---- evaluation -------------------------------------------------------------------------
    def forward(self, features: Tensor) -> Tensor:
        return self.method(features)

    def _evaluate(self, logits: Tensor, labels: Tensor, metric: MulticlassAccuracy, key: str) -> None:
        metric(logits.argmax(dim=1), labels)
        self.log(key, metric, on_step=False, on_epoch=True, add_dataloader_idx=False)

    def _inputs(self, features: Tensor) -> Tensor:
        """Evaluation inputs as the clients train on them: rows clipped to `feature_clip` (part of the
        feature map), else unchanged."""
        clip = self.federation.feature_clip
        return clip_features(features, clip) if clip > 0 else features

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.method.has_model and self.method.global_model:  # the model of the rounds done so far
            logits = self.method.logits(self._inputs(batch["features"]), cache_key=("val", batch_idx))
            self._evaluate(logits, batch["labels"], self.val_acc, "val/acc")

    def on_test_epoch_start(self) -> None:
        self.method.require_fitted()
        self._local_correct = torch.zeros(self.method.num_clients, dtype=torch.long, device=self.device)
        self._local_total = torch.zeros_like(self._local_correct)
        # one accuracy per further head (GH-OFL's), registered before anything is logged
        heads = self.method.head_logits(torch.zeros(0, *self.method.input_shape, device=self.device))
        self.head_acc = torch.nn.ModuleDict({head: MulticlassAccuracy(self.method.num_classes, average="micro")
                                             for head in heads}).to(self.device)
        self._metric_attributes = None  # Lightning finds the metrics it logs among the submodules

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        method, inputs = self.method, self._inputs(batch["features"])
        if "client_ids" not in batch:  # the global test split
            if method.global_model:  # a method may read logits its fit computed for these rows
                logits = method.logits(inputs, cache_key=("test_batch", batch_idx))
                self._evaluate(logits, batch["labels"], self.test_acc, "test/acc")
            for head, logits in method.head_logits(inputs).items():
                self._evaluate(logits, batch["labels"], cast(MulticlassAccuracy, self.head_acc[head]),
                               f"test/acc/{head}")
            return
        if self._scored_remotely():  # a client's local test split (personalized protocol): on its node
            return
        self._add_local_scores(self._local_correct, self._local_total, inputs, batch["labels"], batch["client_ids"])

    def _scored_remotely(self) -> bool:
        """The clients score their own local test splits where they live (a transport with
        `local_accuracy() -> (correct (K,), total (K,))`, e.g. Flower's) instead of `predict`."""
        return self.method.personalized and isinstance(self.clients, ScoresLocally)

    def on_test_epoch_end(self) -> None:
        if isinstance(self.clients, ScoresLocally) and self._scored_remotely():
            correct, total = self.clients.local_accuracy()
            self._local_correct += correct.to(self.device)
            self._local_total += total.to(self.device)
        if self.trainer.world_size > 1:
            self._local_correct = ddp.sum_across_processes(self._local_correct, self.trainer.strategy)
            self._local_total = ddp.sum_across_processes(self._local_total, self.trainer.strategy)
        tested = self._local_total > 0
        if not tested.any():
            return
        accuracy = self._local_correct[tested].double() / self._local_total[tested]
        self.log_dict({"test/acc_local_mean": accuracy.mean(),
                       "test/acc_local_std": accuracy.std(correction=0),
                       "test/acc_local_min": accuracy.min()}, add_dataloader_idx=False)
        self.local_accuracy = {"client": tested.nonzero().squeeze(1).tolist(), "acc": accuracy.tolist(),
                               "num_test": self._local_total[tested].tolist()}
        save_per_client_table(self.local_accuracy, self.trainer)

    # ---- checkpoints ------------------------------------------------------------------------
    def checkpoint_identity(self, engine: str | None = None, data=None) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this engine: the method's class and
        settings, the problem's shape, the data's settings, the protocol (plain values) and who ran
        the clients (`engine`: `lightning` in this process, `flower` over nodes; default: this
        engine's transport). `data`: default, the Trainer's data module."""
        method, problem = self.method, self.method.problem
        if data is None:
            data_identity = None if self.data is None else dict(self.data.identity)
        else:  # (a data module's own: cross-silo sites know their rows only once their nodes told them)
            data_identity = dict(data.identity if isinstance(data, Population) else data.identity())
        return {
            "engine": engine or ("flower" if self.remote_clients is not None else "lightning"),
            "method": f"{type(method).__module__}.{type(method).__qualname__}",
            "settings": plain(init_arguments(method)),
            "problem": None if problem is None else {"input_shape": list(problem.input_shape),
                                                     "num_classes": problem.num_classes,
                                                     "num_clients": problem.num_clients},
            "data": data_identity,
            "federation": plain(self.federation),
            "stages": self.pipeline.identity(),
        }

    def check_checkpoint_file(self, path: str | Path, data, *, resuming: bool, engine: str) -> None:
        """Before any run folder exists (the command line calls it once the method is set up for
        `data`): the checkpoint at `path` against this run, one error naming what differs."""
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("workbench")
        if saved is not None:
            check_checkpoint_matches(saved, self.checkpoint_identity(engine, data), resuming=resuming,
                                     other_data=self.other_data)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        saved = self.checkpoint_identity()
        totals = getattr(self, "_totals", None)
        if totals is not None and self.trainer.state.fn == "fit":
            saved["totals"] = {**totals, "fit_s": time.perf_counter() - self._fit_start}
            saved["client_events"] = self.client_events
        checkpoint["workbench"] = saved

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuses a checkpoint of another method, settings or data shape; restores the fit's
        running totals; a method whose buffers' shapes are found by the fit reshapes them."""
        saved = checkpoint.get("workbench")
        if saved is not None:  # checkpoints written before these checks were saved hold none
            resuming = self.trainer.state.fn == "fit"
            check_checkpoint_matches(saved, self.checkpoint_identity(), resuming=resuming,
                                     other_data=self.other_data)
            self._restored_totals = dict(saved.get("totals") or {}) if resuming else None
            self._restored_events = list(saved.get("client_events") or []) if resuming else None
        self._fill_clients_left_on_nodes(checkpoint["state_dict"])
        tables = [name[:-len(".rows")] for name in self.state_dict() if name.endswith(".rows")]
        lacking = [name for name in tables if f"{name}.rows" not in checkpoint["state_dict"]]
        if lacking:  # workbench 0.2 kept per-client state as one dense (clients, ...) tensor
            raise ValueError(f"the checkpoint has no table {lacking[0]}.ids/.rows of per-client state: it was "
                             "written by workbench 0.2, which kept that state as one dense tensor; refit "
                             "(or resume it with workbench 0.2)")
        prefix = "method."
        state = {name[len(prefix):]: value for name, value in checkpoint["state_dict"].items()
                 if name.startswith(prefix)}
        self.method.before_restore(state)


    def _fill_clients_left_on_nodes(self, state: dict[str, Tensor]) -> None:
        """A fit over Flower left its clients' state on the nodes: testing its global model here
        needs none of it (the clients of this process keep their fresh state); a personalized
        method's models were the clients' own."""
        mine = {name: value for name, value in self.state_dict().items() if name.startswith("client_half.")}
        if not mine or any(name.startswith("client_half.") for name in state):
            return
        if self.method.personalized:
            raise ValueError(f"the checkpoint is of a {type(self.method).__name__} fit over Flower: its clients' "
                             "personal models stayed on the nodes, so it cannot be tested here; its run folder "
                             "holds their test/acc_local_* (scored on the nodes)")
        state.update(mine)


def check_checkpoint_matches(saved: dict, configured: dict, *, resuming: bool, other_data: bool = False) -> None:
    """One error naming what differs between a checkpoint and the configured run. A resumed fit
    may run more rounds than the checkpointed one (`num_rounds`); the protocol only matters there.
    The data's settings are compared unless `other_data` (a checkpoint tested on other data, or
    resumed on it, on purpose)."""
    if resuming and saved.get("engine", configured["engine"]) != configured["engine"]:
        raise ValueError(f"the checkpoint is of a fit whose clients ran under --engine {saved['engine']}, and their "
                         f"state does not carry over to --engine {configured['engine']}: resume it with --engine "
                         f"{saved['engine']}, or fit afresh")
    if saved.get("method") != configured["method"]:
        raise ValueError(f"the checkpoint holds a {saved.get('method')} model but the config asks for "
                         f"{configured['method']}: pass that run's config (its config.yaml) or a checkpoint "
                         "of this method")
    diffs = []
    ignore = {"num_rounds"} if resuming else set()
    mine, theirs = configured["settings"], saved.get("settings", {})
    for key in sorted((set(mine) | set(theirs)) - ignore):
        if mine.get(key, "<unset>") != theirs.get(key, "<unset>"):
            diffs.append(f"model.{key}: checkpoint {theirs.get(key, '<unset>')!r}, config {mine.get(key, '<unset>')!r}")
    data_diffs: set[str] = set()
    if not other_data and saved.get("data") is not None and configured["data"] is not None:
        mine, theirs = configured["data"], saved["data"]
        # a setting on one side only follows from one both hold (the partition scheme, a split's
        # fraction, the dataset), which is named
        data_diffs = {key for key in set(mine) & set(theirs) if mine[key] != theirs[key]}
        diffs += [f"data.{key}: checkpoint {theirs[key]!r}, config {mine[key]!r}" for key in sorted(data_diffs)]
    if saved.get("problem") is not None and configured["problem"] is not None:
        for key, value in configured["problem"].items():
            if saved["problem"].get(key) != value and key not in data_diffs:  # named once
                diffs.append(f"data {key}: checkpoint {saved['problem'].get(key)!r}, config {value!r}")
    if resuming and saved.get("federation") is not None:
        for key, value in configured["federation"].items():
            if saved["federation"].get(key, value) != value:
                diffs.append(f"federation.{key}: checkpoint {saved['federation'][key]!r}, config {value!r}")
    if resuming and saved.get("stages", []) != configured["stages"]:
        diffs.append(f"stages: checkpoint {saved.get('stages', [])!r}, config {configured['stages']!r}")
    if diffs:
        other = " (--other_data=true loads it under other data settings on purpose)" if data_diffs else ""
        raise ValueError("the checkpoint does not match the config (" + "; ".join(diffs) + "): pass the "
                         f"config it was made with (its run folder's config.yaml), or fit afresh{other}")
