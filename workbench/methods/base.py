"""The method contract: one Lightning epoch is one communication round.

A method implements three things:

- `client_step(batch)`: what the clients in `batch` upload this round. It sees the cached
  features of many clients at once (vectorized over clients, keyed by `batch.client_ids`) and
  returns named tensors: the sum over those clients of their uploads. Each client's own upload
  has the same shapes, so the bytes one client sends are known from the returned tensors.
- `server_step(uploads, num_clients)`: receives the sum of all clients' uploads of the round
  (the server of every analytic method needs only this sum) and returns the broadcast.
- `forward(features)`: logits of the current model, (n, d) -> (n, C).

Gradient methods use four optional extensions: `whole_round_batch` (the data module then yields
all training samples in one batch, so one `client_step` runs every client's local epochs),
`stacked_uploads` (uploads the runtime concatenates along a leading client axis instead of
summing, e.g. OS-FED's snapshots), `upload_bytes_per_client` (bytes that are not those of a
dense tensor, e.g. top-k values + indices) and `uploading_clients` (with client sampling only
the sampled clients upload). `input_shape` holds the shape of one input, (d,) for features
or (c, H, W) for raw images (`data.inputs: images`).

The runtime here accumulates uploads, counts every message's bytes at the dtype sent, times
client and server work, logs `comm/*`, `time/*` and accuracy, and stops after `num_rounds`.
`after_broadcast()` runs at the end of every round, after the server step: work the clients do
on the new model without communicating (e.g. personalized local solves).

Protocol (`self.federation`, a `workbench.federation.Federation`; the `federation:` section of a
config), applied to every round:

- dropouts: `dropped_clients` (K,) marks the clients that fail to upload this round. A dropped
  client still takes its step (its own state, e.g. DeepAFL's features of its samples, stays
  current for the next round), but its upload is lost: it neither reaches the sum nor counts.
  A `whole_round_batch` method gets the dropped clients' rows removed from its one batch
  instead, so it never trains them; if it samples its own clients (overriding
  `uploading_clients`) it should leave them out of its count too.
- secure aggregation: `client_step` runs once per client (each client's own upload is needed
  to mask it), each upload is masked in a fixed-point ring and the server unmasks only the sum
  (`workbench.federation.secure_aggregation`). Needs summed uploads of per-client data: not
  for `whole_round_batch` or `stacked_uploads` methods.
- differential privacy: Gaussian noise on the aggregated uploads before `server_step`
  (`workbench.federation.privacy`).

Several processes (`FederatedDDPStrategy`, `--trainer.strategy=ddp`): each process gets whole
clients from the data module, runs their client steps, and the partial sums are combined across
processes before the server step, which every process runs on the same total
(`workbench.federation.distributed`). `whole_round_batch` and `stacked_uploads` methods run on
one process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from lightning import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from workbench.federation import Federation, distributed, messages_bytes
from workbench.federation.privacy import add_gaussian_noise
from workbench.federation.protocol import NOISE_STREAM
from workbench.federation.secure_aggregation import SecureAggregator
from workbench.runlog import save_per_client_table


@dataclass(frozen=True)
class ClientBatch:
    """Cached features of several clients.

    features: (n, d) float32; labels: (n,) int64; client_ids: (n,) int64 in [0, K).
    sample_index: (n,) int64 positions in the training set, for methods that keep per-sample
        state across rounds (batches are the same in every round).
    new_clients: how many clients appear in this batch for the first time this round, so a
        per-client term of an upload (e.g. AFL's γI) is added exactly once per client.
    """

    features: Tensor
    labels: Tensor
    client_ids: Tensor
    sample_index: Tensor
    new_clients: int


class FederatedMethod(LightningModule):
    """Base class of every federated method. Subclasses set up their state in `setup_problem`."""

    #: upload names sent packed as an upper triangle (symmetric matrices)
    symmetric_uploads: frozenset[str] = frozenset()
    #: upload names the runtime concatenates along dim 0 (one row per client) instead of summing
    stacked_uploads: frozenset[str] = frozenset()
    #: ask the data module for one training batch holding every sample (views, no copy)
    whole_round_batch: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # analytic methods solve; gradient methods step themselves
        self.register_buffer("rounds_done", torch.zeros((), dtype=torch.long))
        self.feature_dim = self.num_classes = self.num_clients = 0
        self.input_shape: tuple[int, ...] = ()  # one input's shape: (d,) or (c, H, W)
        self.federation = Federation()  # protocol settings: dropouts, secure aggregation, noise

    # ---- to implement -------------------------------------------------------------------
    @property
    def num_rounds(self) -> int:
        """Communication rounds of a full fit (= Lightning epochs)."""
        return 1

    def setup_problem(self, feature_dim: int, num_classes: int, num_clients: int) -> None:
        """Allocate the model once the data's shape is known (before any checkpoint restore)."""

    def client_step(self, batch: ClientBatch) -> dict[str, Tensor]:
        raise NotImplementedError

    def server_step(self, uploads: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def upload_bytes_per_client(self, uploads: dict[str, Tensor]) -> int:
        """Bytes one client sends, from the round's accumulated uploads.

        Summed uploads have one client's shapes; a stacked upload counts one row. Methods whose
        messages are not dense tensors (sparse values + indices, packed low-bit codes) override.
        """
        one_client = {name: value[0] if name in self.stacked_uploads else value
                      for name, value in uploads.items()}
        return messages_bytes(one_client, self.symmetric_uploads)

    def uploading_clients(self) -> int:
        """Clients that uploaded this round: by default every client with data in the round's
        batches (dropped clients excluded); methods that sample clients override."""
        return int(self._seen.sum())

    def after_broadcast(self) -> None:
        """Runs at the end of every round, after the server step and its broadcast (and after the
        round's metrics are set): for client work on the new model that sends nothing."""

    # ---- runtime ------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """Index of the current round, 0-based."""
        return int(self.rounds_done)

    @property
    def fitted(self) -> bool:
        return self.round >= self.num_rounds

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        if data is None:
            raise RuntimeError("a federated method needs a FederatedDataModule (`data:` in the config)")
        if stage == "fit":
            self._check_processes()
        shape = (data.feature_dim, data.num_classes, data.num_clients)
        if shape == (self.feature_dim, self.num_classes, self.num_clients):
            return  # set up by an earlier stage (fit, then test): keep the fitted model
        self.feature_dim, self.num_classes, self.num_clients = shape
        self.input_shape = tuple(getattr(data, "input_shape", (data.feature_dim,)))
        self.setup_problem(*shape)
        self.val_acc = MulticlassAccuracy(self.num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(self.num_classes, average="micro")

    def configure_optimizers(self):
        return None

    def _check_processes(self) -> None:
        strategy, name = self.trainer.strategy, type(self).__name__
        if isinstance(strategy, DDPStrategy) and not isinstance(strategy, distributed.FederatedDDPStrategy):
            raise ValueError(
                f"{name} under plain DDP would be wrapped for gradient all-reduce and fed padded, "
                "sample-split batches: use strategy=FederatedDDPStrategy() (or 'federated_ddp') in "
                "Python; on the command line --trainer.strategy=ddp selects it")
        if self.trainer.world_size > 1 and (self.whole_round_batch or self.stacked_uploads):
            raise ValueError(
                f"{name} " + ("trains all its sampled clients in one step" if self.whole_round_batch
                              else f"sends per-client uploads {sorted(self.stacked_uploads)}")
                + " on one process; run it with trainer.devices=1 (several processes split clients for "
                "methods whose uploads are sums)")

    def _check_protocol(self) -> None:
        name, protocol = type(self).__name__, self.federation
        if not isinstance(protocol, Federation):
            raise TypeError("method.federation must be a workbench.federation.Federation, "
                            f"got {type(protocol).__name__}")
        if protocol.secure_aggregation and (self.whole_round_batch or self.stacked_uploads):
            raise ValueError(
                f"secure aggregation masks each client's own summed upload, but {name} "
                + ("trains its sampled clients in one step" if self.whole_round_batch
                   else f"sends per-client uploads {sorted(self.stacked_uploads)}")
                + ": set federation.secure_aggregation=false for it")
        if protocol.dp_sigma > 0 and self.stacked_uploads:
            raise ValueError(f"federation.dp_sigma adds noise to summed statistics; {name} sends per-client "
                             f"uploads {sorted(self.stacked_uploads)}: set federation.dp_sigma=0 for it")

    def on_fit_start(self) -> None:
        self._check_protocol()
        if self.federation.secure_aggregation:  # U, the clients that take part in the masking
            self._participants = torch.unique(self.trainer.datamodule.train_client_ids).tolist()
        if self.fitted:
            raise RuntimeError(
                f"this model has already run all {self.num_rounds} rounds; start from a fresh "
                "model (drop `ckpt_path`) to fit again")
        self._totals = {"bytes_up": 0, "bytes_down": 0, "client_s": 0.0, "server_s": 0.0, "secure_s": 0.0}
        self._fit_start = time.perf_counter()

    def on_train_epoch_start(self) -> None:
        self._uploads: dict[str, Tensor] = {}
        self._seen = torch.zeros(self.num_clients, dtype=torch.bool, device=self.device)
        self._client_s = self._secure_s = 0.0
        self._empty_batch: ClientBatch | None = None
        self.dropped_clients = self.federation.dropped_clients(self.round, self.num_clients).to(self.device)
        self._secure = self._open_client = None
        if self.federation.secure_aggregation:
            self._secure = SecureAggregator(self._participants, seed=self.federation.seed, round_index=self.round,
                                            fixed_point_bits=self.federation.fixed_point_bits,
                                            symmetric=self.symmetric_uploads)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        start = time.perf_counter()
        if self._empty_batch is None:  # the layout of a process whose clients all dropped out
            self._empty_batch = self._client_batch(batch, slice(0, 0), new_clients=0)
        dropped = self.dropped_clients[batch["client_ids"]]
        if dropped.any():
            if not self.whole_round_batch:  # the step runs, so per-client state stays current; the upload is lost
                self.client_step(self._client_batch({name: value[dropped] for name, value in batch.items()},
                                                    slice(None), new_clients=0))
            batch = {name: value[~dropped] for name, value in batch.items()}
        if len(batch["client_ids"]) > 0:  # a batch of dropped clients only sends nothing
            if self._secure is not None:
                self._masked_client_steps(batch)
            else:
                self._summed_client_step(batch)
        self._client_s += time.perf_counter() - start
        # The server solves right after the last client batch, so that Lightning's validation
        # at the end of the epoch already sees this round's model.
        if batch_idx == self.trainer.num_training_batches - 1:
            self._finish_round()

    @staticmethod
    def _client_batch(batch: dict[str, Tensor], rows: slice, new_clients: int) -> ClientBatch:
        return ClientBatch(batch["features"][rows], batch["labels"][rows], batch["client_ids"][rows],
                           batch["sample_index"][rows], new_clients)

    def _summed_client_step(self, batch: dict[str, Tensor]) -> None:
        """One client step for all the clients of the batch; its uploads join the round's sum."""
        client_ids = batch["client_ids"]
        present = torch.unique(client_ids)
        new_clients = int((~self._seen[present]).sum())
        self._seen[present] = True
        uploads = self.client_step(self._client_batch(batch, slice(None), new_clients))
        for name, value in uploads.items():
            if name in self._uploads and name in self.stacked_uploads:
                self._uploads[name] = torch.cat([self._uploads[name], value])
            elif name in self._uploads:
                self._uploads[name] += value
            else:
                self._uploads[name] = value.clone()

    def _masked_client_steps(self, batch: dict[str, Tensor]) -> None:
        """Secure aggregation: one client step per client, each client's whole upload masked and sent.

        Rows are ordered by client, so only the batch's last client may continue in the next
        batch: it stays open (its partial upload kept) until another client or the round's end.
        """
        clients, counts = torch.unique_consecutive(batch["client_ids"], return_counts=True)
        first = 0
        for client, count in zip(clients.tolist(), counts.tolist()):
            rows, first = slice(first, first + count), first + count
            continuing = self._open_client is not None and self._open_client[0] == client
            if not continuing:
                self._send_open_client()
                if self._seen[client]:
                    raise RuntimeError("secure aggregation needs each client's training rows together "
                                       "(the FederatedDataModule orders them by client)")
                self._seen[client] = True
            upload = self.client_step(self._client_batch(batch, rows, new_clients=int(not continuing)))
            if continuing:
                upload = {name: self._open_client[1][name] + value for name, value in upload.items()}
            self._open_client = (client, upload)

    def _send_open_client(self) -> None:
        if self._open_client is not None:
            start = time.perf_counter()
            self._secure.add(*self._open_client)
            self._secure_s += time.perf_counter() - start
            self._open_client = None

    def _aggregate(self) -> dict[str, Tensor]:
        """The round's total upload as the server gets it: summed over clients (and processes),
        unmasked under secure aggregation, with the server's noise under differential privacy."""
        strategy, several = self.trainer.strategy, self.trainer.world_size > 1
        if several:
            self._seen = distributed.sum_across_processes(self._seen.int(), strategy) > 0
        if not self._seen.any():
            raise RuntimeError(f"every client dropped out in round {self.round} (federation.dropout = "
                               f"{self.federation.dropout}): lower the dropout")
        if self._secure is not None:
            if self._secure.layout is None:  # this process's clients all dropped out: it adds zero
                self._secure.set_layout(self.client_step(self._empty_batch))
            start = time.perf_counter()
            total = (distributed.ring_sum_across_processes(self._secure.total, strategy) if several
                     else self._secure.total)
            uploads = self._secure.unmask(total, uploaded=self._seen.nonzero().squeeze(1).tolist())
            uploads = {name: value.to(self.device) for name, value in uploads.items()}
            self._secure_s += time.perf_counter() - start
        elif several:
            if not self._uploads:  # this process's clients all dropped out: it adds zero
                self._uploads = {name: torch.zeros_like(value)
                                 for name, value in self.client_step(self._empty_batch).items()}
            uploads = {name: distributed.sum_across_processes(self._uploads[name], strategy)
                       for name in sorted(self._uploads)}  # the same order of collectives everywhere
        else:
            uploads = self._uploads
        if self.federation.dp_sigma > 0:
            uploads = add_gaussian_noise(uploads, self.federation.dp_sigma,
                                         self.federation.generator(self.round, NOISE_STREAM),
                                         symmetric=self.symmetric_uploads)
        return uploads

    def _finish_round(self) -> None:
        if self._secure is not None:  # the round's last client sends
            start = time.perf_counter()
            self._send_open_client()
            self._client_s += time.perf_counter() - start
        start = time.perf_counter()  # the server's time: combining the uploads, then its step
        uploads = self._aggregate()
        num_clients = self.uploading_clients()
        per_client_up = (self._secure.bytes_per_client if self._secure is not None
                         else self.upload_bytes_per_client(uploads))
        broadcast = self.server_step(uploads, num_clients)
        server_s = time.perf_counter() - start
        several = self.trainer.world_size > 1
        if several:  # every process holds rank 0's model, even where kernels are not bitwise reproducible
            distributed.broadcast_module_state(self)
            seconds = torch.tensor([self._client_s, self._secure_s], dtype=torch.float64, device=self.device)
            self._client_s, self._secure_s = distributed.sum_across_processes(seconds, self.trainer.strategy).tolist()
        self.rounds_done += 1
        del self._uploads
        self._secure = None

        totals = self._totals
        totals["bytes_up"] += per_client_up * num_clients
        totals["bytes_down"] += messages_bytes(broadcast) * self.num_clients
        totals["client_s"] += self._client_s
        totals["server_s"] += server_s
        totals["secure_s"] += self._secure_s
        self.fit_metrics: dict[str, float] = {  # the latest round's numbers, cumulative
            "comm/rounds": float(self.round),
            "comm/bytes_up": float(totals["bytes_up"]),
            "comm/bytes_up_per_client": float(totals["bytes_up"]) / self.num_clients,
            "comm/bytes_down": float(totals["bytes_down"]),
            "comm/clients_in_round": float(num_clients),
            "comm/clients_dropped": float(self.dropped_clients.sum()),
            "time/client_s": totals["client_s"],
            "time/server_s": totals["server_s"],
        }
        if self.federation.secure_aggregation:  # masking (client time) and unmasking (server time)
            self.fit_metrics["time/secure_aggregation_s"] = totals["secure_s"]
        if self.fitted:
            self.fit_metrics["time/fit_s"] = time.perf_counter() - self._fit_start
        self.after_broadcast()

    def on_train_epoch_end(self) -> None:
        # Every process holds the same numbers (combined in `_aggregate`); syncing keeps Lightning quiet.
        self.log_dict(self.fit_metrics, sync_dist=self.trainer.world_size > 1)
        if self.fitted:
            self.trainer.should_stop = True

    def predict_clients(self, features: Tensor, client_ids: Tensor) -> Tensor:
        """Logits of each sample under its own client's model: (n, d), (n,) -> (n, C).

        A global method serves every client with one model; personalized methods override this.
        """
        return self(features)

    def _require_fitted(self) -> None:
        if self.round == 0:
            raise RuntimeError(
                "the model is not fitted: run `fit` first, or pass `--ckpt_path` of a fitted run "
                "to `validate`/`test`")

    def _evaluate(self, batch: dict[str, Tensor], metric: MulticlassAccuracy, key: str,
                  logits: Tensor | None = None) -> None:
        """Scores `logits` of the batch (default: the forward of its features) into `metric`."""
        self._require_fitted()
        logits = self(batch["features"]) if logits is None else logits
        metric(logits.argmax(dim=1), batch["labels"])
        self.log(key, metric, on_step=False, on_epoch=True, add_dataloader_idx=False)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.round > 0:  # the model of the rounds done so far (e.g. a depth of DeepAFL)
            self._evaluate(batch, self.val_acc, "val/acc")

    def on_test_epoch_start(self) -> None:
        self._local_correct = torch.zeros(self.num_clients, dtype=torch.long, device=self.device)
        self._local_total = torch.zeros_like(self._local_correct)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        if "client_ids" not in batch:  # the global test split
            self._evaluate(batch, self.test_acc, "test/acc")
            return
        self._require_fitted()  # a client's local test split (personalized protocol)
        client_ids = batch["client_ids"]
        correct = self.predict_clients(batch["features"], client_ids).argmax(dim=1).eq(batch["labels"])
        self._local_correct.index_add_(0, client_ids, correct.long())
        self._local_total.index_add_(0, client_ids, torch.ones_like(client_ids))

    def on_test_epoch_end(self) -> None:
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
