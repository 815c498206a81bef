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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from lightning import LightningModule
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from workbench.federation import messages_bytes
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
        batches; methods that sample clients override."""
        return int(self._seen.sum())

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

    def on_fit_start(self) -> None:
        if self.fitted:
            raise RuntimeError(
                f"this model has already run all {self.num_rounds} rounds; start from a fresh "
                "model (drop `ckpt_path`) to fit again")
        self._totals = {"bytes_up": 0, "bytes_down": 0, "client_s": 0.0, "server_s": 0.0}
        self._fit_start = time.perf_counter()

    def on_train_epoch_start(self) -> None:
        self._uploads: dict[str, Tensor] = {}
        self._seen = torch.zeros(self.num_clients, dtype=torch.bool, device=self.device)
        self._client_s = 0.0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        start = time.perf_counter()
        client_ids = batch["client_ids"]
        present = torch.unique(client_ids)
        new_clients = int((~self._seen[present]).sum())
        self._seen[present] = True
        uploads = self.client_step(ClientBatch(batch["features"], batch["labels"], client_ids,
                                               batch["sample_index"], new_clients))
        for name, value in uploads.items():
            if name in self._uploads and name in self.stacked_uploads:
                self._uploads[name] = torch.cat([self._uploads[name], value])
            elif name in self._uploads:
                self._uploads[name] += value
            else:
                self._uploads[name] = value.clone()
        self._client_s += time.perf_counter() - start
        # The server solves right after the last client batch, so that Lightning's validation
        # at the end of the epoch already sees this round's model.
        if batch_idx == self.trainer.num_training_batches - 1:
            self._finish_round()

    def _finish_round(self) -> None:
        num_clients = self.uploading_clients()
        per_client_up = self.upload_bytes_per_client(self._uploads)
        start = time.perf_counter()
        broadcast = self.server_step(self._uploads, num_clients)
        server_s = time.perf_counter() - start
        self.rounds_done += 1
        del self._uploads

        totals = self._totals
        totals["bytes_up"] += per_client_up * num_clients
        totals["bytes_down"] += messages_bytes(broadcast) * self.num_clients
        totals["client_s"] += self._client_s
        totals["server_s"] += server_s
        self.fit_metrics: dict[str, float] = {  # the latest round's numbers, cumulative
            "comm/rounds": float(self.round),
            "comm/bytes_up": float(totals["bytes_up"]),
            "comm/bytes_up_per_client": float(totals["bytes_up"]) / self.num_clients,
            "comm/bytes_down": float(totals["bytes_down"]),
            "comm/clients_in_round": float(num_clients),
            "time/client_s": totals["client_s"],
            "time/server_s": totals["server_s"],
        }
        if self.fitted:
            self.fit_metrics["time/fit_s"] = time.perf_counter() - self._fit_start

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.fit_metrics)
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

    def _evaluate(self, batch: dict[str, Tensor], metric: MulticlassAccuracy, key: str) -> None:
        self._require_fitted()
        metric(self(batch["features"]).argmax(dim=1), batch["labels"])
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
