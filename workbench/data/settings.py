"""The data's settings in three groups, each a frozen dataclass that checks its own values:

- `FeatureSource`: where the inputs come from: the dataset, the backbone that turns its images or
  texts into features (or none: raw images, synthetic blobs, feature vectors of one's own), its
  preprocessing, the feature cache;
- `Partitioning`: which client holds each training row (`assign`);
- `ClientSplits`: how the training rows are split into each client's training rows, a validation
  hold-out and the clients' local test rows (`plan`, a `RowPlan`).

`FederatedDataModule` takes their settings as flat arguments (`data.alpha`, `data.backbone`; its
docstring says what each one does, as `fit --data.help` shows) and builds one of each. Each group
names its settings that decide the data's rows, labels, clients and splits (`identity`) and
labels itself in a word or two (`describe`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from workbench.data.hf import OwnData, own_modality
from workbench.data.partition import partition as assign_clients
from workbench.data.partition import stratified_holdout
from workbench.settings import plain

if TYPE_CHECKING:
    from workbench.data.datamodule import SyntheticBlobs

# The source's settings that say where the data lives and how fast it is read, not what its rows are
WHERE_NOT_WHAT = frozenset({"data_dir", "download", "cache_dir", "extract_batch_size", "device", "weights_path"})
# Each partition scheme's own parameters (Flower Datasets' names)
PARTITION_PARAMS = {
    "iid": (),
    "dirichlet": ("alpha", "min_partition_size", "self_balancing"),
    "shard": ("num_shards_per_partition", "shard_size"),
    "pathological": ("num_classes_per_partition",),
    "natural": (),
    "flower": ("flower",),
}


def values_of(group: Any) -> dict[str, Any]:
    """A settings group's values by name, in the order it declares them."""
    return {field.name: getattr(group, field.name) for field in fields(group)}


Group = TypeVar("Group", "FeatureSource", "Partitioning", "ClientSplits")


def group_from(cls: type[Group], arguments: Mapping[str, Any]) -> Group:
    """The settings group `cls` of the data module's flat `arguments`, by field name."""
    return cls(**{field.name: arguments[field.name] for field in fields(cls)})


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
class FeatureSource:
    """Where the inputs come from.

    The dataset: dataset, synthetic (dataset `synthetic`), hf (dataset `hf`), data_dir, download.
    What a row holds: inputs, backbone features (`features`) or raw pixels (`images`).
    The backbone: backbone, pretrained, weights_path, feature_layers, trainable_tail.
    Its preprocessing: input_size, mean, std (images), max_length, pooling (texts), precision.
    Standardization of the features from the clients' sums: standardize.
    The feature cache and the extraction: cache_dir, extract_batch_size, device.
    """

    dataset: str
    data_dir: str
    download: bool
    inputs: Literal["features", "images"]
    backbone: str
    pretrained: bool
    weights_path: str | None
    input_size: int | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    max_length: int | None
    pooling: str | None
    precision: Literal["float32", "bf16"]
    feature_layers: list[str] | None
    trainable_tail: int
    standardize: bool
    cache_dir: str
    extract_batch_size: int
    device: str
    synthetic: SyntheticBlobs
    hf: OwnData

    @property
    def own_features(self) -> bool:
        """Whether the inputs are feature vectors of one's own (dataset `hf` with a feature column)."""
        return self.dataset == "hf" and own_modality(self.hf) == "features"

    @property
    def has_backbone(self) -> bool:
        """Whether a backbone turns the inputs into features (not for synthetic blobs, raw images or
        feature vectors of one's own)."""
        return not (self.dataset == "synthetic" or self.inputs == "images" or self.own_features)

    def check(self) -> None:
        """ValueError naming the setting; what `check_inputs` (or the generator's check) finds."""
        if self.inputs not in ("features", "images"):
            raise ValueError(f"data.inputs must be 'features' or 'images', got {self.inputs!r}")
        if self.inputs == "images" and self.dataset == "synthetic":
            raise ValueError("the synthetic dataset is drawn in feature space and has no images: "
                             "use data.inputs=features, or an image dataset such as mnist5k")
        if self.precision not in ("float32", "bf16"):
            raise ValueError(f"data.precision must be 'float32' or 'bf16', got {self.precision!r}")
        if self.feature_layers and (self.dataset == "synthetic" or self.inputs == "images"):
            raise ValueError("data.feature_layers picks backbone layers, and this data has no backbone "
                             f"(dataset {self.dataset!r}, inputs {self.inputs!r}): drop feature_layers or use "
                             "backbone features")
        tail = self.trainable_tail
        if isinstance(tail, bool) or int(tail) != tail or tail < 0:
            raise ValueError(f"data.trainable_tail must be an integer ≥ 0 (the backbone's last stages left "
                             f"trainable), got {tail!r}")
        if tail:
            if self.inputs == "images":
                raise ValueError("data.trainable_tail caches a backbone's inner activations, and data.inputs=images "
                                 "has no backbone: use data.inputs=features")
            if self.feature_layers or self.standardize:
                raise ValueError("data.trainable_tail caches the input maps of the backbone's last stages, not "
                                 "feature vectors: drop data.feature_layers and data.standardize")
            if self.dataset != "synthetic" and _is_text_backbone(self.backbone):
                raise ValueError(f"data.trainable_tail needs an image backbone with a tail builder (EfficientNet, "
                                 f"ResNet); {self.backbone!r} is a text backbone: set data.trainable_tail=0")
        if self.standardize and self.inputs == "images":
            raise ValueError("data.standardize applies to feature vectors: use data.inputs=features or drop it")
        if self.dataset == "synthetic":
            self.synthetic.check()
        else:
            check_inputs(self.dataset, self.inputs, self.backbone, self.cache_dir, self.hf)

    def identity(self) -> dict[str, Any]:
        """The settings that decide the inputs, as plain values: not where the data lives or how fast
        it is read, nor another dataset's settings; the generator's and one's own data's settings one
        by one (`synthetic.dim`)."""
        flat: dict[str, Any] = {}
        for name, value in values_of(self).items():
            if name in WHERE_NOT_WHAT or (name in ("synthetic", "hf") and name != self.dataset):
                continue
            if name in ("synthetic", "hf"):
                flat.update({f"{name}.{key}": item for key, item in plain(value).items()})
            else:
                flat[name] = plain(value)
        return flat

    def describe(self) -> dict[str, str]:
        """The dataset's and the backbone's short names (`none` without one)."""
        return {"dataset": self.hf.cache_name() if self.dataset == "hf" else self.dataset,
                "backbone": self.backbone if self.has_backbone else "none"}


@dataclass(frozen=True)
class Partitioning:
    """Which client holds each training row.

    num_clients: K; partition: the scheme; seed: its seed (and the hold-outs').
    The schemes' parameters: alpha, min_partition_size, self_balancing (`dirichlet`),
    num_shards_per_partition, shard_size (`shard`), num_classes_per_partition (`pathological`),
    flower (`flower`: a Flower Datasets partitioner and its arguments).
    """

    num_clients: int
    partition: Literal["iid", "dirichlet", "shard", "pathological", "natural", "flower"]
    alpha: float
    min_partition_size: int
    self_balancing: bool
    num_shards_per_partition: int
    shard_size: int | None
    num_classes_per_partition: int
    seed: int
    flower: dict[str, Any] | None

    @property
    def by_client(self) -> bool:
        """Whether the clients follow the data's own client ids (`natural`, `flower` with `by: client`)
        rather than the labels."""
        return self.partition == "natural" or (self.partition == "flower" and (self.flower or {}).get("by") == "client")

    def params(self) -> dict[str, Any]:
        """The scheme's parameters by the partitioner's names."""
        if self.partition == "flower":
            assert self.flower is not None  # check() refuses flower without settings
            return {name: value for name, value in self.flower.items() if name != "by"}
        return {name: getattr(self, name) for name in PARTITION_PARAMS[self.partition]}

    def check(self) -> None:
        """ValueError naming the setting: a known scheme with its parameters, K ≥ 1."""
        if self.partition not in PARTITION_PARAMS:
            raise ValueError(f"unknown partition {self.partition!r}; choose one of {sorted(PARTITION_PARAMS)}")
        if self.partition == "dirichlet" and not self.alpha > 0:
            raise ValueError(f"data.alpha must be > 0 for a Dirichlet partition, got {self.alpha}; "
                             "small values (0.05) mean strong label skew, large ones (100) near-iid")
        if self.num_clients < 1:
            raise ValueError(f"data.num_clients must be ≥ 1, got {self.num_clients}")
        flower = self.flower or {}
        if self.partition == "flower" and (not flower.get("partitioner") or flower.get("by", "label") not in
                                           ("label", "client")):
            raise ValueError("data.partition=flower needs data.flower.partitioner, a Flower Datasets "
                             "partitioner name (e.g. linear, inner_dirichlet), its arguments in data.flower, "
                             f"and optionally by: label (default) or client; got {self.flower!r}")

    def check_source(self, source: FeatureSource) -> None:
        """A partition by the data's own client ids needs data that names them."""
        if self.by_client and (source.dataset != "hf" or not source.hf.client_column):
            raise ValueError(f"data.partition={self.partition} partitions by the data's own client ids: use "
                             "data.dataset=hf and name the column in data.hf.client_column")

    def assign(self, labels: Tensor, natural_ids: Tensor | None = None) -> Tensor:
        """(n,) int64 client of each row of `labels` (n,), by label or by the data's own client ids
        (`natural_ids`); -1 for a row no client holds (`shard`, `pathological`)."""
        params = self.params()
        if self.by_client and natural_ids is None:
            raise ValueError(f"data.partition={self.partition} partitions by client ids, and this data has "
                             "none: name the column in data.hf.client_column")
        keys = natural_ids if self.by_client else labels
        assert keys is not None  # by client without natural ids raised above
        try:
            ids = assign_clients(keys.numpy(), self.partition, self.num_clients, seed=self.seed, **params)
        except ValueError as error:
            if self.partition == "flower":  # its settings are Flower's, as the user gave them
                raise
            raise ValueError(in_data_settings(str(error), params)) from None
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))

    def identity(self) -> dict[str, Any]:
        """The settings that decide the clients, as plain values: not another scheme's parameters."""
        unused = {name for scheme, names in PARTITION_PARAMS.items() if scheme != self.partition for name in names}
        return {name: plain(value) for name, value in values_of(self).items() if name not in unused}

    def describe(self) -> dict[str, str]:
        """The scheme with the parameter that sets its skew (a Flower partitioner by name), and K."""
        params = ",".join(f"{name}={getattr(self, name)}" for name in PARTITION_PARAMS[self.partition][:1])
        if self.partition == "flower":  # the Flower partitioner's name, not its whole settings
            params = str(self.params()["partitioner"])
        return {"partition": f"{self.partition}({params})" if params else self.partition,
                "num_clients": str(self.num_clients)}


@dataclass(frozen=True)
class RowPlan:
    """Positions in the training split's rows of each split's rows (`ClientSplits.plan`): train (n,)
    ordered by client with its train_client_ids; holdout (h,) (with client ids when each client
    holds its own, else None) or None; local_test (t,) with its client ids, or None."""

    train: Tensor
    train_client_ids: Tensor
    holdout: Tensor | None = None
    holdout_client_ids: Tensor | None = None
    local_test: Tensor | None = None
    local_test_client_ids: Tensor | None = None


@dataclass(frozen=True)
class ClientSplits:
    """How the training rows are split, seeded by the partition's seed.

    val_fraction: the share held out for validation (0: none); val_split: from the pool before
    partitioning (`pool`) or from each client's share (`clients`).
    personalized: each client's share also gives its own local test rows, local_test_fraction of it.
    """

    personalized: bool
    local_test_fraction: float
    val_fraction: float
    val_split: Literal["pool", "clients"]

    @property
    def has_validation(self) -> bool:
        """Whether part of the training pool is held out for validation."""
        return self.val_fraction > 0

    def check(self) -> None:
        """ValueError naming the setting: the fractions leave rows on both sides, a known hold-out."""
        if not 0 < self.local_test_fraction < 1:
            raise ValueError(f"data.local_test_fraction must be in (0, 1), got {self.local_test_fraction}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_split not in ("pool", "clients"):
            raise ValueError(f"data.val_split must be pool (held out before partitioning) or clients (each "
                             f"client's own hold-out), got {self.val_split!r}")

    def plan(self, labels: Tensor, partitioning: Partitioning, natural_ids: Tensor | None = None) -> RowPlan:
        """Which of the training split's rows (`labels` (n,)) each split takes, from the labels and
        the data's own client ids alone: the pooled hold-out (stratified by class, before
        partitioning), the partition, each client's own hold-out and local test rows (stratified
        within the client), and the training rows ordered by client."""
        seed, natural = partitioning.seed, natural_ids
        rows = torch.arange(len(labels))
        holdout = holdout_ids = local_test = local_test_ids = None
        pooled = self.has_validation and self.val_split == "pool"
        if pooled:
            held = stratified_holdout(labels, self.val_fraction, seed)
            holdout, rows = rows[held], rows[~held]
            natural = None if natural is None else natural[~held]
        client_ids = partitioning.assign(labels[rows], natural)
        on_a_client = client_ids >= 0  # shard and pathological partitions may leave samples out
        rows, client_ids = rows[on_a_client], client_ids[on_a_client]
        if self.has_validation and not pooled:  # each client's own hold-out, before any local test split
            held = stratified_holdout(labels[rows], self.val_fraction, seed + 1, groups=client_ids)
            order = torch.argsort(client_ids[held], stable=True)
            holdout, holdout_ids = rows[held][order], client_ids[held][order]
            rows, client_ids = rows[~held], client_ids[~held]
        if self.personalized:
            held = stratified_holdout(labels[rows], self.local_test_fraction, seed, groups=client_ids)
            order = torch.argsort(client_ids[held], stable=True)
            local_test, local_test_ids = rows[held][order], client_ids[held][order]
            rows, client_ids = rows[~held], client_ids[~held]
        order = torch.argsort(client_ids, stable=True)
        return RowPlan(rows[order], client_ids[order], holdout, holdout_ids, local_test, local_test_ids)

    def identity(self) -> dict[str, Any]:
        """The settings that decide the splits, as plain values: not those of a split there is not."""
        unused = ({"local_test_fraction"} if not self.personalized else set()) | (
            {"val_split"} if not self.has_validation else set())
        return {name: plain(value) for name, value in values_of(self).items() if name not in unused}
