"""FederatedDataModule: raw data (images or texts) -> cached backbone features -> clients."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from lightning import LightningDataModule
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from workbench.data.hf import OwnData, own_modality
from workbench.data.partition import partition as assign_clients
from workbench.data.partition import stratified_holdout
from workbench.data.population import Population, Rows
from workbench.settings import init_arguments, plain

# Settings that say where the data lives and how fast it is read, not what its rows are
WHERE_NOT_WHAT = frozenset({"data_dir", "download", "cache_dir", "extract_batch_size", "device", "batch_size",
                            "weights_path"})
PARTITION_PARAMS = {
    "iid": (),
    "dirichlet": ("alpha", "min_partition_size", "self_balancing"),
    "shard": ("num_shards_per_partition", "shard_size"),
    "pathological": ("num_classes_per_partition",),
    "natural": (),
    "flower": ("flower",),
}



def in_data_settings(message: str, params: dict[str, Any]) -> str:
    """A partitioner's message in the data module's words: its `num_partitions` is
    data.num_clients, its parameters are data.<name>, and a partition is a client."""
    for name in params:
        message = re.sub(rf"\b{name}\b", f"data.{name}", message)
    message = re.sub(r"\bnum_partitions\b", "data.num_clients", message)
    return re.sub(r"\bpartition(s?)\b", r"client\1", message)


def check_inputs(dataset: str, inputs: str, backbone: str, cache_dir: str, hf: OwnData | None = None) -> None:
    """What can be known about the data before anything is loaded: the dataset and backbone exist
    and suit each other, and the feature cache can take the features. ValueError naming the
    choices (PermissionError for the cache). `hf`: the settings of dataset `hf`."""
    from workbench.backbones import backbone_modality, list_backbones
    from workbench.data.features import check_writable
    from workbench.data.registry import DATASETS

    if dataset == "hf":
        hf = hf or OwnData()
        hf.check()
        kind, dataset = own_modality(hf), hf.cache_name()
        if kind == "features":  # precomputed: no backbone, nothing cached
            if inputs == "images":
                raise ValueError("data.hf.feature_column holds precomputed features, not images: "
                                 "use data.inputs=features")
            return
    elif dataset not in DATASETS:
        names = ", ".join([*DATASETS.names(), "synthetic", "hf"])
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {names} (`python -m workbench list` "
                         "describes them)")
    else:
        kind = DATASETS.modality(dataset)
    if inputs == "images":
        if kind != "image":
            raise ValueError(f"data.inputs=images needs an image dataset; {dataset!r} holds texts: "
                             "use data.inputs=features with a text backbone")
        return
    try:
        backbone_kind = backbone_modality(backbone)
    except ValueError:
        raise ValueError(f"unknown backbone {backbone!r}; choose one of: {', '.join(list_backbones(modality=kind))}"
                         + (" or any timm model name (timm.list_models())" if kind == "image" else "")) from None
    if backbone_kind != kind:
        choices = ", ".join(list_backbones(modality=kind))
        raise ValueError(f"dataset {dataset!r} holds {kind}s but backbone {backbone!r} is not a {kind} backbone; "
                         f"set data.backbone to one of {choices}"
                         + (" or any timm model name" if kind == "image" else ""))
    check_writable(cache_dir, dataset)

def _is_text_backbone(backbone: str) -> bool:
    from workbench.backbones import backbone_modality

    try:
        return backbone_modality(backbone) == "text"
    except ValueError:  # an unknown name: check_inputs says so
        return False


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


@dataclass(frozen=True)
class RowPlan:
    """Positions in the training split's rows of each split's rows (`FederatedDataModule._plan`):
    train (n,) ordered by client with its train_client_ids; holdout (h,) (with client ids when each
    client holds its own, else None) or None; local_test (t,) with its client ids, or None."""

    train: Tensor
    train_client_ids: Tensor
    holdout: Tensor | None = None
    holdout_client_ids: Tensor | None = None
    local_test: Tensor | None = None
    local_test_client_ids: Tensor | None = None


class FeatureBatches(Dataset):
    """Contiguous slices of in-memory tensors; one item is one whole batch (no per-sample collate)."""

    def __init__(self, batch_size: int, **tensors: Tensor) -> None:
        self.tensors, self.batch_size = tensors, batch_size
        self.length = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return -(-self.length // self.batch_size)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return {name: t[window] for name, t in self.tensors.items()}


class FederatedDataModule(LightningDataModule):
    """Cached frozen-backbone features of a dataset, partitioned across clients.

    The training rows (`train_features`, `train_labels`, `train_client_ids`) are ordered by
    client; the engine hands whole clients to the methods' client halves. Test batches hold
    `features` and `labels` of the global test split.

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
        super().__init__()
        if partition not in PARTITION_PARAMS:
            raise ValueError(f"unknown partition {partition!r}; choose one of {sorted(PARTITION_PARAMS)}")
        if partition == "dirichlet" and not alpha > 0:
            raise ValueError(f"data.alpha must be > 0 for a Dirichlet partition, got {alpha}; "
                             "small values (0.05) mean strong label skew, large ones (100) near-iid")
        if num_clients < 1:
            raise ValueError(f"data.num_clients must be ≥ 1, got {num_clients}")
        if inputs not in ("features", "images"):
            raise ValueError(f"data.inputs must be 'features' or 'images', got {inputs!r}")
        if inputs == "images" and dataset == "synthetic":
            raise ValueError("the synthetic dataset is drawn in feature space and has no images: "
                             "use data.inputs=features, or an image dataset such as mnist5k")
        if not 0 < local_test_fraction < 1:
            raise ValueError(f"data.local_test_fraction must be in (0, 1), got {local_test_fraction}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if val_split not in ("pool", "clients"):
            raise ValueError(f"data.val_split must be pool (held out before partitioning) or clients (each "
                             f"client's own hold-out), got {val_split!r}")
        if batch_size < 1 or extract_batch_size < 1:
            raise ValueError("batch_size and extract_batch_size must be ≥ 1")
        if precision not in ("float32", "bf16"):
            raise ValueError(f"data.precision must be 'float32' or 'bf16', got {precision!r}")
        if feature_layers and (dataset == "synthetic" or inputs == "images"):
            raise ValueError("data.feature_layers picks backbone layers, and this data has no backbone "
                             f"(dataset {dataset!r}, inputs {inputs!r}): drop feature_layers or use backbone features")
        if isinstance(trainable_tail, bool) or int(trainable_tail) != trainable_tail or trainable_tail < 0:
            raise ValueError(f"data.trainable_tail must be an integer ≥ 0 (the backbone's last stages left "
                             f"trainable), got {trainable_tail!r}")
        if trainable_tail:
            if inputs == "images":
                raise ValueError("data.trainable_tail caches a backbone's inner activations, and data.inputs=images "
                                 "has no backbone: use data.inputs=features")
            if feature_layers or standardize:
                raise ValueError("data.trainable_tail caches the input maps of the backbone's last stages, not "
                                 "feature vectors: drop data.feature_layers and data.standardize")
            if dataset != "synthetic" and _is_text_backbone(backbone):
                raise ValueError(f"data.trainable_tail needs an image backbone with a tail builder (EfficientNet, "
                                 f"ResNet); {backbone!r} is a text backbone: set data.trainable_tail=0")
        if standardize and inputs == "images":
            raise ValueError("data.standardize applies to feature vectors: use data.inputs=features or drop it")
        by_client = partition == "natural" or (partition == "flower" and (flower or {}).get("by") == "client")
        if by_client and (dataset != "hf" or not hf.client_column):
            raise ValueError(f"data.partition={partition} partitions by the data's own client ids: use "
                             "data.dataset=hf and name the column in data.hf.client_column")
        if partition == "flower" and (not (flower or {}).get("partitioner")
                                      or (flower or {}).get("by", "label") not in ("label", "client")):
            raise ValueError("data.partition=flower needs data.flower.partitioner, a Flower Datasets "
                             "partitioner name (e.g. linear, inner_dirichlet), its arguments in data.flower, "
                             f"and optionally by: label (default) or client; got {flower!r}")
        if dataset == "synthetic":
            synthetic.check()
        else:
            check_inputs(dataset, inputs, backbone, cache_dir, hf)
        self.save_hyperparameters()
        hparams = self.hparams
        assert isinstance(hparams, AttributeDict)  # what save_hyperparameters stores
        self.args = hparams
        self.synthetic = synthetic
        self.hf = hf
        self._natural_ids: Tensor | None = None  # dataset hf: the train rows' client-column ids
        self._tail: torch.nn.Module | None = None  # data.trainable_tail: the backbone's last stages
        self._shares: dict[int, Population] = {}  # the clients' rows `population(client)` gave
        self._ready = False

    # ---- the shape of the problem ---------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return self.args.num_clients

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
        settings = plain(init_arguments(self))
        args = self.args
        unused = set(WHERE_NOT_WHAT) | {name for scheme, names in PARTITION_PARAMS.items()
                                        if scheme != args.partition for name in names}
        if not args.personalized:
            unused.add("local_test_fraction")
        if not self.has_validation:
            unused.add("val_split")
        unused |= {name for name in ("synthetic", "hf") if args.dataset != name}
        flat: dict[str, Any] = {}
        for key, value in settings.items():
            if key in unused:
                continue
            if isinstance(value, dict) and key != "flower":  # the generator's and own data's settings, one by one
                flat.update({f"{key}.{name}": item for name, item in value.items()})
            else:
                flat[key] = value
        return flat

    def describe(self) -> dict[str, str]:
        """Short labels of this data setup, for run names, tags and tables."""
        args = self.args
        main_param = PARTITION_PARAMS[args.partition][:1]  # the one that sets the skew
        params = ",".join(f"{name}={args[name]}" for name in main_param)
        if args.partition == "flower":  # the Flower partitioner's name, not its whole settings
            params = str(args.flower["partitioner"])
        no_backbone = (args.dataset == "synthetic" or args.inputs == "images"
                       or (args.dataset == "hf" and own_modality(self.hf) == "features"))
        return {"dataset": self.hf.cache_name() if args.dataset == "hf" else args.dataset,
                "backbone": "none" if no_backbone else args.backbone,
                "partition": f"{args.partition}({params})" if params else args.partition,
                "num_clients": str(args.num_clients)}

    def population(self, client: int | None = None) -> Population:
        """This data across the boundary (`workbench.data.population`): the splits' own tensors,
        K, the classes, the tail, the settings that decide the rows and their short labels.

        With `client` (a Flower node's partition), that client's rows alone (`Population.only`):
        for the first client asked, backbone features are read (memory-mapped, from the cache) or
        extracted for its rows only — the same rows as the whole data's, chosen from the labels
        alone. Data that is its own inputs (synthetic blobs, raw images, a file of your own
        features) is loaded whole, `standardize` needs every client's sums, and a process asked
        for a second client (one serving several nodes) loads once: those set up the whole data.
        """
        if client is not None:
            return self._client_population(client)
        self._require_setup()
        holdout = (Rows(self.val_features, self.val_labels, getattr(self, "val_client_ids", None))
                   if self.has_validation else None)
        local_test = (Rows(self.local_test_features, self.local_test_labels, self.local_test_client_ids)
                      if self.args.personalized else None)
        return Population(Rows(self.train_features, self.train_labels, self.train_client_ids),
                          Rows(self.test_features, self.test_labels), self.num_clients, self.num_classes,
                          self.args.batch_size, holdout, local_test, self._tail, self.identity(), self.describe())

    def _client_population(self, client: int) -> Population:
        args = self.args
        if not 0 <= client < args.num_clients:
            raise ValueError(f"client {client} is outside the federation's [0, {args.num_clients})")
        if client in self._shares:  # (a node asks twice: its introduction, its first round)
            return self._shares[client]
        own_features = args.dataset == "hf" and own_modality(self.hf) == "features"
        # a second client in one process (a simulation's worker, the loopback grid): the whole data
        # set up once and sliced, as every node did before, instead of one load per client
        if (self._ready or self._shares or args.standardize or args.dataset == "synthetic"
                or args.inputs == "images" or own_features):
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
            raise ValueError(f"data '{args.dataset}': client {client}'s rows hold NaN/inf features (extracted by "
                             f"{args.backbone} from its raw inputs), so no model is fitted on them: repair or drop "
                             "those inputs")
        features = iter(x_rows.split([len(part) for part in parts]))

        def rows(positions: Tensor) -> Rows:
            return Rows(next(features), y_train[positions], torch.full_like(positions, client))

        train = rows(parts[0])
        holdout = rows(parts[1]) if plan.holdout_client_ids is not None else None
        local_test = rows(parts[-1]) if plan.local_test is not None else None
        share = self._shares[client] = Population(train, Rows(x_test, y_test[:0]), args.num_clients, self._num_classes,
                                                  args.batch_size, holdout, local_test, self._tail, self.identity(),
                                                  self.describe())
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
        if several and not self._ready and self.args.dataset != "synthetic" and self.args.inputs == "features":
            self._backbone_features()

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        if self.args.dataset == "synthetic":
            x_train, y_train, x_test, y_test = self.synthetic.generate()
            self._num_classes = self.synthetic.num_classes
            if self.args.trainable_tail:  # the blobs as (dim, 1, 1) maps, a seeded tail of their own
                from workbench.backbones.tail import synthetic_tail

                x_train, x_test = x_train[:, :, None, None], x_test[:, :, None, None]
                self._tail = synthetic_tail(self.synthetic.dim, self.args.trainable_tail, self.synthetic.seed)
        elif self.args.inputs == "images":
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
        if self.args.standardize:
            self._standardize()
        self._check_finite()
        self._ready = True

    def _plan(self, labels: Tensor) -> RowPlan:
        """Which of the training split's rows each split takes, from the labels (and the data's own
        client ids) alone: the pooled hold-out (stratified by class, before partitioning), the
        partition, each client's own hold-out and local test rows (stratified within the client),
        and the training rows ordered by client."""
        args, natural = self.args, self._natural_ids
        rows = torch.arange(len(labels))
        holdout = holdout_ids = local_test = local_test_ids = None
        pooled = args.val_fraction > 0 and args.val_split == "pool"
        if pooled:
            held = stratified_holdout(labels, args.val_fraction, args.seed)
            holdout, rows = rows[held], rows[~held]
            natural = None if natural is None else natural[~held]
        client_ids = self._partition(labels[rows], natural)
        on_a_client = client_ids >= 0  # shard and pathological partitions may leave samples out
        rows, client_ids = rows[on_a_client], client_ids[on_a_client]
        if args.val_fraction > 0 and not pooled:  # each client's own hold-out, before any local test split
            held = stratified_holdout(labels[rows], args.val_fraction, args.seed + 1, groups=client_ids)
            order = torch.argsort(client_ids[held], stable=True)
            holdout, holdout_ids = rows[held][order], client_ids[held][order]
            rows, client_ids = rows[~held], client_ids[~held]
        if args.personalized:
            held = stratified_holdout(labels[rows], args.local_test_fraction, args.seed, groups=client_ids)
            order = torch.argsort(client_ids[held], stable=True)
            local_test, local_test_ids = rows[held][order], client_ids[held][order]
            rows, client_ids = rows[~held], client_ids[~held]
        order = torch.argsort(client_ids, stable=True)
        return RowPlan(rows[order], client_ids[order], holdout, holdout_ids, local_test, local_test_ids)

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
        if self.args.personalized:
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
            if self.args.dataset == "hf" and own_modality(self.hf) == "features":  # the user's own vectors
                source = f"your file's {self.hf.feature_column!r} column, {self.hf.path}"
            else:
                source = "the generated data" if self.args.dataset == "synthetic" else (
                    "the raw images" if self.args.inputs == "images" else
                    f"the backbone's features cached in {self.args.cache_dir}; a damaged cache file is rebuilt once "
                    "deleted")
            raise ValueError(
                f"data '{self.args.dataset}': {count} {split} row{'s' if count > 1 else ''}{where} "
                f"hold{'s' if count == 1 else ''} NaN/inf features, so no model is fitted on them: repair or drop "
                f"those rows (they come from {source})")

    def _backbone_features(self, rows: Tensor | None = None, data=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Both splits' features and labels of the raw `data` (default: loaded here); with `rows`
        (positions in the training split), the training features of those rows alone, read or
        extracted for them only, and no test rows."""
        from workbench.backbones import build_backbone
        from workbench.backbones.layers import with_layers
        from workbench.data.features import cached_features, cached_rows, check_cache_room
        from workbench.data.registry import dataset_modality

        args = self.args
        data = self._raw_data() if data is None else data
        self._num_classes = len(data.classes)
        if args.dataset == "hf" and own_modality(self.hf) == "features":  # precomputed: no backbone
            if args.trainable_tail:
                raise ValueError("data.trainable_tail needs a backbone, and data.hf.feature_column holds "
                                 "precomputed features: set data.trainable_tail=0")
            return data.train.features, data.train.labels, data.test.features, data.test.labels
        kind = own_modality(self.hf) if args.dataset == "hf" else dataset_modality(args.dataset)
        backbone = build_backbone(args.backbone, pretrained=args.pretrained, weights_path=args.weights_path,
                                  input_size=args.input_size, mean=args.mean, std=args.std,
                                  max_length=args.max_length, pooling=args.pooling)
        backbone = with_layers(backbone, args.feature_layers)
        if args.trainable_tail:
            from workbench.backbones.tail import build_tail, with_tail_input

            self._tail = build_tail(backbone, args.trainable_tail)
            backbone = with_tail_input(backbone, args.trainable_tail)
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        where = dict(cache_dir=args.cache_dir, dataset=data.name if args.dataset == "hf" else args.dataset,
                     source=data.source, precision=args.precision)
        if rows is None:
            check_cache_room(backbone, {"train": data.train.labels, "test": data.test.labels}, **where)
        where.update(batch_size=args.extract_batch_size, device=device)
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
        if self.args.dataset == "hf":
            from workbench.data.hf import load_own_data

            own = load_own_data(self.hf, self.args.data_dir)
            self._natural_ids = own.train_client_ids
            return own.data
        from workbench.data.registry import load_dataset

        return load_dataset(self.args.dataset, data_dir=self.args.data_dir, download=self.args.download)

    def _partition(self, labels: Tensor, natural_ids: Tensor | None = None) -> Tensor:
        """Client of each training row, by label, or by the data's own client ids (`natural`,
        and `flower` with `by: client`)."""
        args = self.args
        if args.partition == "flower":
            params = {name: value for name, value in args.flower.items() if name != "by"}
            by_client = args.flower.get("by", "label") == "client"
        else:
            params = {name: args[name] for name in PARTITION_PARAMS[args.partition]}
            by_client = args.partition == "natural"
        if by_client and natural_ids is None:
            raise ValueError(f"data.partition={args.partition} partitions by client ids, and this data has "
                             "none: name the column in data.hf.client_column")
        keys = natural_ids if by_client else labels
        assert keys is not None  # by client without natural ids raised above
        try:
            ids = assign_clients(keys.numpy(), args.partition, args.num_clients, seed=args.seed, **params)
        except ValueError as error:
            if args.partition == "flower":  # its settings are Flower's, as the user gave them
                raise
            raise ValueError(in_data_settings(str(error), params)) from None
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))

    # ---- loaders ----------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        """One item per epoch: an epoch is one communication round, and the engine reads the
        clients' training rows itself, through the data's `population()` (ordered by client),
        whole clients per process."""
        # a list is a map-style dataset (__getitem__ and __len__), which the stubs do not accept
        return DataLoader([{"round": torch.zeros((), dtype=torch.long)}], batch_size=None)  # type: ignore[arg-type]

    @property
    def has_validation(self) -> bool:
        """Whether part of the training pool is held out for validation (`val_fraction` > 0)."""
        return self.args.val_fraction > 0

    def val_dataloader(self) -> DataLoader | list:
        if not self.has_validation:
            return []  # no validation split: Lightning skips the loop
        return DataLoader(FeatureBatches(self.args.batch_size, features=self.val_features,
                                         labels=self.val_labels), batch_size=None)

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """The global test split; with `personalized`, also every client's local test split."""
        global_test = DataLoader(FeatureBatches(self.args.batch_size, features=self.test_features,
                                                labels=self.test_labels), batch_size=None)
        if not self.args.personalized:
            return global_test
        local_test = DataLoader(FeatureBatches(self.args.batch_size, features=self.local_test_features,
                                               labels=self.local_test_labels,
                                               client_ids=self.local_test_client_ids), batch_size=None)
        return [global_test, local_test]
