"""FederatedDataModule: raw data (images or texts) -> cached backbone features -> clients."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor
from torch.utils.data import DataLoader

from workbench.data.federated import FeatureBatches, FederatedData
from workbench.data.hf import OwnData, own_modality
from workbench.data.population import Population, Rows
from workbench.data.settings import PARTITION_PARAMS as PARTITION_PARAMS  # (the catalog lists the schemes)
from workbench.data.settings import ClientSplits, FeatureSource, Partitioning, RowPlan, group_from


@dataclass(frozen=True)
class SyntheticBlobs:
    """Gaussian class blobs drawn directly in feature space (dataset `synthetic`, no backbone).

    Class means are N(0, separation²/dim · I); each sample adds N(0, I) noise.
    """

    num_classes: int = 10
    dim: int = 32
    train_size: int = 2000
    test_size: int = 500
    separation: float = 6.0
    seed: int = 0

    def check(self) -> None:
        """ValueError naming the setting: both splits hold rows, a row holds numbers, and there
        are at least two classes (a classifier needs them)."""
        for name, least in (("train_size", 1), ("test_size", 1), ("dim", 1), ("num_classes", 2)):
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"data.synthetic.{name} must be ≥ {least}, got {value}"
                                 + ("; a classifier needs at least two classes" if name == "num_classes" else ""))

    def generate(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> train features (n, dim) float32, train labels (n,), test features, test labels."""
        gen = torch.Generator().manual_seed(self.seed)
        means = torch.randn(self.num_classes, self.dim, generator=gen) * self.separation / self.dim ** 0.5

        def draw(n: int) -> tuple[Tensor, Tensor]:
            labels = torch.arange(n) % self.num_classes
            labels = labels[torch.randperm(n, generator=gen)]
            return means[labels] + torch.randn(n, self.dim, generator=gen), labels

        return (*draw(self.train_size), *draw(self.test_size))


class FederatedDataModule(FederatedData):
    """Cached frozen-backbone features of a dataset, partitioned across clients.

    The training rows (`train_features`, `train_labels`, `train_client_ids`) are ordered by
    client; the engine hands whole clients to the methods' client halves. Test batches hold
    `features` and `labels` of the global test split.

    The settings come as flat arguments and fall into three groups (`workbench.data.settings`),
    each checking its own: `source`, where the inputs come from (`FeatureSource`); `partitioning`,
    which client holds each row (`Partitioning`); `splits`, how the rows are split (`ClientSplits`).
    `batch_size` is the module's own.

    Args:
        dataset: a name from `workbench.data.datasets.list_datasets()` (image or text), or
            `synthetic`.
        data_dir: where raw datasets are looked for (and downloaded to with `download`).
        download: download a missing dataset into `data_dir` (needs internet).
        inputs: `features` (cached backbone features, (n, d)) or `images`: the raw images at
            their native size as float (n, c, H, W) scaled to [-1, 1], no backbone (for models
            that train on pixels, e.g. a small CNN); `backbone`, `input_size`, `mean` and `std`
            are then unused.
        backbone: for an image dataset `efficientnet_lite0` (packaged ImageNet weights) or any
            timm model name; for a text dataset a text backbone (`all_minilm_l6_v2`, `gpt2`, ...:
            `list_backbones(modality="text")`).
        pretrained: load pretrained weights (else a seeded random init, for smoke tests).
        weights_path: a local weights file for an image backbone, a model directory for a text one.
        input_size, mean, std: image preprocessing; default to the backbone's own.
        max_length, pooling: text tokenization length and token pooling; default to the
            backbone's own (256 tokens; mean pooling).
        precision: `float32`, or `bf16` for a bfloat16-autocast forward (faster only on hardware
            with native bfloat16; features are stored float32 either way, and the precision is
            part of the cache key).
        feature_layers: multi-depth features: inner layers whose pooled outputs are cached and
            concatenated before the final pooled vector, e.g. `[all_stages]` or `[blocks.2,
            blocks.4]` (timm module names; text backbones: hidden-state indices);
            `workbench.backbones.layers` says how each is pooled. Part of the cache key; empty:
            the final vector only (the same cache as before the setting existed).
        trainable_tail: k ≥ 1 leaves the backbone's last k stages trainable
            (`workbench.backbones.tail`): the cache holds the activation map at their input
            ((C, H, W) per image, under a key of its own; e.g. (192, 2, 2) for
            EfficientNet-Lite0 at 64 px, the input of `blocks.6`; ResNet-18's `layer4` input),
            `tail` is those stages with their pretrained weights (BatchNorms folded into trainable
            affines), and the gradient methods train it with a linear head (`architecture: tail`).
            For EfficientNet and ResNet image backbones; `synthetic` has a seeded tail of its own
            on the blobs as (dim, 1, 1) maps. Analytic methods refuse these inputs (they fit on
            feature vectors). 0: the pooled features.
        standardize: per-feature standardization from federated sums, before any method sees the
            data: each client sends Σx, Σx² (d each) and its count, the server broadcasts mean and
            std (d each), and every split is mapped to (x − mean) / std. These 2d + 1 numbers up
            and 2d down per client are in `standardization_bytes`, not in the methods' `comm/*`.
            What it changes: AFL, DeepAFL, SAFLe and the other ridge heads (the same γ is a
            different regularization on rescaled features; AFL stays exactly centralized ridge on
            the standardized features), LDA-type heads only through their shrinkage (without it
            LDA is invariant to per-feature affine maps), SAFLe's `fixed` buckets (per-sample
            z-scores) and the gradient methods' optimization.
        cache_dir: where extracted features are stored.
        extract_batch_size: images or texts per backbone forward.
        device: device of the backbone forward (`auto`: CUDA when present).
        num_clients: K.
        partition: `iid`, `dirichlet`, `shard` or `pathological`; the parameters below that
            the scheme uses follow Flower datasets' names. `natural`: the data's own clients
            (`hf.client_column`; ids grouped when num_clients is smaller). `flower`: a Flower
            Datasets partitioner, see `flower`.
        seed: seed of the partition and of the validation hold-out.
        personalized: the personalized protocol: after partitioning, each client's share is
            split (stratified by class, seeded) into its own train and local test data; test
            batches then also cover every client's local test split (`client_ids` set).
        local_test_fraction: the share of each client's data that becomes its local test split.
        val_fraction: share of the training data held out as a validation split for tuning (a
            learning rate, the stopping round: `--stopping`); 0 = none, and `validate` then has
            nothing to run.
        val_split: where the validation split comes from: `pool`, the training pool before
            partitioning (stratified by class: data no client holds), or `clients`, each client's
            own share after partitioning (stratified by class within the client, seeded), as a
            federated validation would have it: every client keeps its hold-out and reports how
            many of it the global model gets right (`val/acc` pools them).
        batch_size: samples per evaluation batch, and per chunk where a client computes its
            statistics in chunks to bound memory.
        synthetic: parameters of the `synthetic` dataset.
        hf: dataset `hf`, your own data through Hugging Face `datasets` (`workbench.data.hf.OwnData`:
            path, columns, splits).
        flower: for `partition: flower`, `{partitioner: <name>, by: label|client, <its arguments>}`,
            e.g. `{partitioner: linear}` or `{partitioner: inner_dirichlet, partition_sizes: [...],
            alpha: 0.5}` (`pip install -e '.[hf]'`).
    """

    def __init__(
        self,
        dataset: str = "mnist5k",
        data_dir: str = "~/.cache/workbench/data",
        download: bool = False,
        inputs: Literal["features", "images"] = "features",
        backbone: str = "efficientnet_lite0",
        pretrained: bool = True,
        weights_path: str | None = None,
        input_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        max_length: int | None = None,
        pooling: str | None = None,
        precision: Literal["float32", "bf16"] = "float32",
        feature_layers: list[str] | None = None,
        trainable_tail: int = 0,
        standardize: bool = False,
        cache_dir: str = "~/.cache/workbench/features",
        extract_batch_size: int = 256,
        device: str = "auto",
        num_clients: int = 10,
        partition: Literal["iid", "dirichlet", "shard", "pathological", "natural", "flower"] = "dirichlet",
        alpha: float = 0.5,
        min_partition_size: int = 10,
        self_balancing: bool = False,
        num_shards_per_partition: int = 2,
        shard_size: int | None = None,
        num_classes_per_partition: int = 2,
        seed: int = 0,
        personalized: bool = False,
        local_test_fraction: float = 0.25,
        val_fraction: float = 0.0,
        val_split: Literal["pool", "clients"] = "pool",
        batch_size: int = 4096,
        synthetic: SyntheticBlobs = SyntheticBlobs(),
        hf: OwnData = OwnData(),
        flower: dict[str, Any] | None = None,
    ) -> None:
        arguments = dict(locals())  # the flat arguments as given (the command line's hparams hold dicts)
        super().__init__()
        self.source = group_from(FeatureSource, arguments)
        self.partitioning = group_from(Partitioning, arguments)
        self.splits = group_from(ClientSplits, arguments)
        self.partitioning.check()
        self.splits.check()
        if batch_size < 1 or extract_batch_size < 1:
            raise ValueError("batch_size and extract_batch_size must be ≥ 1")
        self.partitioning.check_source(self.source)
        self.source.check()  # last: it looks for the dataset, the backbone and the cache
        self.save_hyperparameters()
        hparams = self.hparams
        assert isinstance(hparams, AttributeDict)  # what save_hyperparameters stores
        self.args = hparams
        self._natural_ids: Tensor | None = None  # dataset hf: the train rows' client-column ids
        self._tail: torch.nn.Module | None = None  # data.trainable_tail: the backbone's last stages
        self._shares: dict[int, Population] = {}  # the clients' rows `population(client)` gave
        self._ready = False

    # ---- the shape of the problem ---------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return self.partitioning.num_clients

    @property
    def synthetic(self) -> SyntheticBlobs:
        """The generator's settings (dataset `synthetic`)."""
        return self.source.synthetic

    @property
    def hf(self) -> OwnData:
        """One's own data's settings (dataset `hf`)."""
        return self.source.hf

    @property
    def num_classes(self) -> int:
        self._require_setup()
        return self._num_classes

    @property
    def tail(self) -> torch.nn.Module | None:
        """With data.trainable_tail: the backbone's last stages, pretrained (n, C, H, W) -> (n, d),
        which the inputs still pass through (`Problem.tail`); None otherwise."""
        self._require_setup()
        return self._tail

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input: (d,) for features, (c, H, W) for images and a tail's input maps."""
        self._require_setup()
        return tuple(self.train_features.shape[1:])

    @property
    def feature_dim(self) -> int:
        """Numbers per input: d for features, c·H·W for images."""
        return math.prod(self.input_shape)

    def identity(self) -> dict[str, Any]:
        """The settings that decide this data's rows, labels, clients and splits, as plain values
        by dotted key (`synthetic.dim`): what a checkpoint made on it must match. Where the data
        lives, batch sizes, and the settings of another partition scheme, an unused split or
        another dataset's generator are left out."""
        return {**self.source.identity(), **self.partitioning.identity(), **self.splits.identity()}

    def describe(self) -> dict[str, str]:
        """Short labels of this data setup, for run names, tags and tables."""
        return {**self.source.describe(), **self.partitioning.describe()}

    def population(self, client: int | None = None, path: str | None = None) -> Population:
        """This data across the boundary (`workbench.data.population`): the splits' own tensors,
        K, the classes, the tail, the settings that decide the rows and their short labels.

        With `client` (a Flower node's partition), that client's rows alone (`Population.only`):
        for the first client asked, backbone features are read (memory-mapped, from the cache) or
        extracted for its rows only — the same rows as the whole data's, chosen from the labels
        alone. Data that is its own inputs (synthetic blobs, raw images, a file of your own
        features) is loaded whole, `standardize` needs every client's sums, and a process asked
        for a second client (one serving several nodes) loads once: those set up the whole data.
        """
        if path is not None:
            raise ValueError(f"the node config names data-path {path}, and this data is one dataset the server's "
                             "settings partition: fit with data SiteData for sites that hold their own files, or "
                             "drop data-path")
        if client is not None:
            return self._client_population(client)
        self._require_setup()
        holdout = (Rows(self.val_features, self.val_labels, getattr(self, "val_client_ids", None))
                   if self.has_validation else None)
        local_test = (Rows(self.local_test_features, self.local_test_labels, self.local_test_client_ids)
                      if self.splits.personalized else None)
        return Population(Rows(self.train_features, self.train_labels, self.train_client_ids),
                          Rows(self.test_features, self.test_labels), self.num_clients, self.num_classes,
                          self.args.batch_size, holdout, local_test, self._tail, self.identity(), self.describe())

    def _client_population(self, client: int) -> Population:
        source = self.source
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is outside the federation's [0, {self.num_clients})")
        if client in self._shares:  # (a node asks twice: its introduction, its first round)
            return self._shares[client]
        # a second client in one process (a simulation's worker, the loopback grid): the whole data
        # set up once and sliced, as every node did before, instead of one load per client
        if self._ready or self._shares or source.standardize or not source.has_backbone:
            self.setup()
            share = self._shares[client] = self.population().only(client)
            return share
        raw = self._raw_data()
        plan = self._plan(raw.train.labels)
        parts = [plan.train[plan.train_client_ids == client]]
        if plan.holdout is not None and plan.holdout_client_ids is not None:
            parts.append(plan.holdout[plan.holdout_client_ids == client])
        if plan.local_test is not None and plan.local_test_client_ids is not None:
            parts.append(plan.local_test[plan.local_test_client_ids == client])
        x_rows, y_train, x_test, y_test = self._backbone_features(torch.cat(parts), raw)
        from workbench.data.features import all_finite

        if not all_finite(x_rows):
            raise ValueError(f"data '{source.dataset}': client {client}'s rows hold NaN/inf features (extracted by "
                             f"{source.backbone} from its raw inputs), so no model is fitted on them: repair or drop "
                             "those inputs")
        features = iter(x_rows.split([len(part) for part in parts]))

        def rows(positions: Tensor) -> Rows:
            return Rows(next(features), y_train[positions], torch.full_like(positions, client))

        train = rows(parts[0])
        holdout = rows(parts[1]) if plan.holdout_client_ids is not None else None
        local_test = rows(parts[-1]) if plan.local_test is not None else None
        share = self._shares[client] = Population(train, Rows(x_test, y_test[:0]), self.num_clients,
                                                  self._num_classes, self.args.batch_size, holdout, local_test,
                                                  self._tail, self.identity(), self.describe())
        return share

    # ---- loading ----------------------------------------------------------------------------
    def _require_setup(self) -> None:
        if not self._ready:
            raise RuntimeError("call setup() on the data module first")

    def prepare_data(self) -> None:
        # With several processes Lightning runs this on one process per node while the others
        # wait: it extracts and caches the backbone features once, and every process's `setup`
        # then reads them from the cache.
        several = getattr(self.trainer, "world_size", 1) > 1
        source = self.source
        if several and not self._ready and source.dataset != "synthetic" and source.inputs == "features":
            self._backbone_features()

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        source = self.source
        if source.dataset == "synthetic":
            x_train, y_train, x_test, y_test = source.synthetic.generate()
            self._num_classes = source.synthetic.num_classes
            if source.trainable_tail:  # the blobs as (dim, 1, 1) maps, a seeded tail of their own
                from workbench.backbones.tail import synthetic_tail

                x_train, x_test = x_train[:, :, None, None], x_test[:, :, None, None]
                self._tail = synthetic_tail(source.synthetic.dim, source.trainable_tail, source.synthetic.seed)
        elif source.inputs == "images":
            x_train, y_train, x_test, y_test = self._images()
        else:
            x_train, y_train, x_test, y_test = self._backbone_features()
        plan = self._plan(y_train)
        self.train_features, self.train_labels, self.train_client_ids = (
            x_train[plan.train], y_train[plan.train], plan.train_client_ids)
        if plan.holdout is not None:
            self.val_features, self.val_labels = x_train[plan.holdout], y_train[plan.holdout]
            if plan.holdout_client_ids is not None:
                self.val_client_ids = plan.holdout_client_ids
        if plan.local_test is not None and plan.local_test_client_ids is not None:
            self.local_test_features, self.local_test_labels = x_train[plan.local_test], y_train[plan.local_test]
            self.local_test_client_ids = plan.local_test_client_ids
        self.test_features, self.test_labels = x_test, y_test
        if source.standardize:
            self._standardize()
        self._check_finite()
        self._ready = True

    def _plan(self, labels: Tensor) -> RowPlan:
        """Which of the training split's rows each split takes (`ClientSplits.plan`)."""
        return self.splits.plan(labels, self.partitioning, self._natural_ids)

    def _standardize(self) -> None:
        """Maps every split with the mean/std the server derives from the clients' sums."""
        from workbench.data.features import client_sums, standardization

        if not self.train_features.is_floating_point() or self.train_features.ndim != 2:
            raise ValueError("data.standardize applies to feature vectors: use data.inputs=features")
        sums = client_sums(self.train_features, self.train_client_ids, self.num_clients)
        mean, std = standardization(*sums)
        d = len(mean)
        self.standardization_bytes = {"up_per_client": 8 * (2 * d + 1), "down_per_client": 8 * 2 * d}
        dtype = self.train_features.dtype
        for name in ("train_features", "test_features", "val_features", "local_test_features"):
            if hasattr(self, name):
                setattr(self, name, ((getattr(self, name).double() - mean) / std).to(dtype))

    def _check_finite(self) -> None:
        """NaN/inf in any split's inputs is an error naming the split, the rows and their clients."""
        from workbench.data.features import all_finite

        splits = [("training", self.train_features, self.train_client_ids),
                  ("test", self.test_features, None)]
        if self.has_validation:
            splits.append(("validation", self.val_features, None))
        if self.splits.personalized:
            splits.append(("local test", self.local_test_features, self.local_test_client_ids))
        for split, features, client_ids in splits:
            if not features.is_floating_point() or all_finite(features):  # the rows only when some are bad
                continue
            bad_rows = ~torch.isfinite(features.reshape(len(features), -1)).all(dim=1)
            count = int(bad_rows.sum())
            if count == 0:
                continue
            where = ""
            if client_ids is not None:
                clients = torch.unique(client_ids[bad_rows]).tolist()
                shown = clients if len(clients) <= 10 else [*clients[:10], "..."]
                where = f" of client{'s' if len(clients) > 1 else ''} {shown}"
            source = self.source
            if source.own_features:  # the user's own vectors
                origin = f"your file's {source.hf.feature_column!r} column, {source.hf.path}"
            else:
                origin = "the generated data" if source.dataset == "synthetic" else (
                    "the raw images" if source.inputs == "images" else
                    f"the backbone's features cached in {source.cache_dir}; a damaged cache file is rebuilt once "
                    "deleted")
            raise ValueError(
                f"data '{source.dataset}': {count} {split} row{'s' if count > 1 else ''}{where} "
                f"hold{'s' if count == 1 else ''} NaN/inf features, so no model is fitted on them: repair or drop "
                f"those rows (they come from {origin})")

    def _backbone_features(self, rows: Tensor | None = None, data=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Both splits' features and labels of the raw `data` (default: loaded here); with `rows`
        (positions in the training split), the training features of those rows alone, read or
        extracted for them only, and no test rows."""
        from workbench.backbones import build_backbone
        from workbench.backbones.layers import with_layers
        from workbench.data.features import cached_features, cached_rows, check_cache_room
        from workbench.data.registry import dataset_modality

        source = self.source
        data = self._raw_data() if data is None else data
        self._num_classes = len(data.classes)
        if source.own_features:  # precomputed: no backbone
            if source.trainable_tail:
                raise ValueError("data.trainable_tail needs a backbone, and data.hf.feature_column holds "
                                 "precomputed features: set data.trainable_tail=0")
            return data.train.features, data.train.labels, data.test.features, data.test.labels
        kind = own_modality(source.hf) if source.dataset == "hf" else dataset_modality(source.dataset)
        backbone = build_backbone(source.backbone, pretrained=source.pretrained, weights_path=source.weights_path,
                                  input_size=source.input_size, mean=source.mean, std=source.std,
                                  max_length=source.max_length, pooling=source.pooling)
        backbone = with_layers(backbone, source.feature_layers)
        if source.trainable_tail:
            from workbench.backbones.tail import build_tail, with_tail_input

            self._tail = build_tail(backbone, source.trainable_tail)
            backbone = with_tail_input(backbone, source.trainable_tail)
        device = source.device if source.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        where = dict(cache_dir=source.cache_dir, dataset=data.name if source.dataset == "hf" else source.dataset,
                     source=data.source, precision=source.precision)
        if rows is None:
            check_cache_room(backbone, {"train": data.train.labels, "test": data.test.labels}, **where)
        where.update(batch_size=source.extract_batch_size, device=device)
        splits = []
        for split_name, split in (("train", data.train), ("test", data.test)):
            inputs = split.texts if kind == "text" else split.images
            if rows is None:
                features = cached_features(backbone, inputs, split.labels, split=split_name, **where)
            elif split_name == "train":  # a node's own training rows
                features = cached_rows(backbone, inputs, split.labels, rows, split=split_name, **where)
            else:  # and no test rows
                features = torch.zeros(0, backbone.feature_dim)
            if getattr(backbone, "feature_shape", ()):  # a tail's input maps, cached flattened (image backbones only)
                features = features.view(len(features), *backbone.feature_shape)
            splits += [features, split.labels]
        return tuple(splits)

    def _images(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Raw images as float (n, c, H, W) in [-1, 1] (a fixed, data-free scaling)."""
        data = self._raw_data()
        self._num_classes = len(data.classes)

        def to_float(images: Tensor) -> Tensor:  # (n, H, W[, 3]) uint8 -> (n, c, H, W)
            x = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
            return (x.float() / 127.5 - 1).contiguous()

        return to_float(data.train.images), data.train.labels, to_float(data.test.images), data.test.labels

    def _raw_data(self):
        """The raw dataset; for dataset hf also keeps the train rows' natural client ids."""
        source = self.source
        if source.dataset == "hf":
            from workbench.data.hf import load_own_data

            own = load_own_data(source.hf, source.data_dir)
            self._natural_ids = own.train_client_ids
            return own.data
        from workbench.data.registry import load_dataset

        return load_dataset(source.dataset, data_dir=source.data_dir, download=source.download)

    # ---- loaders ----------------------------------------------------------------------------
    @property
    def has_validation(self) -> bool:
        """Whether part of the training pool is held out for validation (`val_fraction` > 0)."""
        return self.splits.has_validation

    def val_dataloader(self) -> DataLoader | list:
        if not self.has_validation:
            return []  # no validation split: Lightning skips the loop
        return DataLoader(FeatureBatches(self.args.batch_size, features=self.val_features,
                                         labels=self.val_labels), batch_size=None)

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """The global test split; with `personalized`, also every client's local test split."""
        global_test = DataLoader(FeatureBatches(self.args.batch_size, features=self.test_features,
                                                labels=self.test_labels), batch_size=None)
        if not self.splits.personalized:
            return global_test
        local_test = DataLoader(FeatureBatches(self.args.batch_size, features=self.local_test_features,
                                               labels=self.local_test_labels,
                                               client_ids=self.local_test_client_ids), batch_size=None)
        return [global_test, local_test]
