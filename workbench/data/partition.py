"""Assign the samples of a labelled pool to federated clients.

Every partitioner maps `labels` (shape `(N,)`, integer classes) to `client_ids` (shape `(N,)`,
int64): `client_ids[i]` is the client that holds sample `i`, in `[0, num_partitions)`, and every
client holds at least one sample. Two documented cases leave samples out, marked `UNASSIGNED`
(-1): `shard` with an explicit `shard_size`, and `pathological` with fewer class slots than
classes. Parameter names follow the Flower Datasets partitioners. All randomness comes from
`np.random.default_rng(seed)`, so a seed fixes the split.

`natural` partitions by the data's own client ids instead of by labels, and `flower` runs any
Flower Datasets partitioner itself (optional extra `hf`). `iid` assigns exactly as Flower's
`IidPartitioner` after `Dataset.shuffle(seed=seed)`; `dirichlet` and `shard` draw from the same
distributions as Flower's namesakes but use the random stream differently, so the same seed gives
a different, equally distributed assignment; `pathological` deals classes to the least-held first
where Flower's picks them at random (tests/data/test_partition.py). `stratified_holdout` splits a pool
(or each client's share) by class, seeded: validation, local test and hold-out rows.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

UNASSIGNED = -1
DIRICHLET_MAX_RETRIES = 100  # full redraws before giving up on `min_partition_size`


# --- validation and small helpers ---------------------------------------------------------------


def _validated_labels(labels: Any) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D integer array of class indices, got shape {labels.shape} and "
            f"dtype {labels.dtype}; pass integer labels of shape (N,)"
        )
    return labels


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _validated_request(labels: Any, num_partitions: Any) -> tuple[np.ndarray, int]:
    labels = _validated_labels(labels)
    num_partitions = _require_int("num_partitions", num_partitions, 1)
    if num_partitions > labels.size:
        raise ValueError(
            f"num_partitions={num_partitions} exceeds the {labels.size} samples, so some "
            f"partition would be empty; lower num_partitions to at most {labels.size}"
        )
    return labels, num_partitions


def _rng(seed: Any) -> np.random.Generator:
    # Only plain integer seeds: None would draw fresh OS entropy and break reproducibility.
    return np.random.default_rng(_require_int("seed", seed, 0))


def _even_split_ids(num_items: int, num_blocks: int) -> np.ndarray:
    """Block ids, shape `(num_items,)`, of consecutive blocks whose sizes differ by at most one."""
    sizes = np.full(num_blocks, num_items // num_blocks, dtype=np.int64)
    sizes[: num_items % num_blocks] += 1
    return np.repeat(np.arange(num_blocks, dtype=np.int64), sizes)


def _indices_by_class(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sorted distinct classes, shape `(C,)`, and the sample indices of each, ascending."""
    classes, counts = np.unique(labels, return_counts=True)
    by_label = np.argsort(labels, kind="stable")
    return classes, np.split(by_label, np.cumsum(counts)[:-1])


# --- partitioners --------------------------------------------------------------------------------


def iid(labels: np.ndarray, num_partitions: int, seed: int = 0) -> np.ndarray:
    """Random split into `num_partitions` parts whose sizes differ by at most one.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64.
    """
    labels, num_partitions = _validated_request(labels, num_partitions)
    rng = _rng(seed)
    client_ids = np.empty(labels.size, dtype=np.int64)
    client_ids[rng.permutation(labels.size)] = _even_split_ids(labels.size, num_partitions)
    return client_ids


def dirichlet(
    labels: np.ndarray,
    num_partitions: int,
    alpha: float,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    max_retries: int = DIRICHLET_MAX_RETRIES,
    seed: int = 0,
) -> np.ndarray:
    """Label-skewed split: each class is divided by proportions drawn from Dir(alpha · 1_K).

    Small `alpha` (e.g. 0.1) concentrates each class on few clients; large `alpha` (e.g. 100)
    approaches IID. With `self_balancing`, a client already holding at least the even share N/K
    takes no part of later classes (if that would exclude every client, the draw is used as is).
    The whole draw is repeated, continuing the same random stream, until every client holds
    at least `max(min_partition_size, 1)` samples; after `max_retries` draws a ValueError says
    what to change.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64.
    """
    labels, num_partitions = _validated_request(labels, num_partitions)
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}") from None
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(
            f"alpha must be a positive finite number, got {alpha}; use a small alpha (e.g. 0.1) "
            f"for strong label skew and a large one (e.g. 100) for nearly IID partitions"
        )
    min_partition_size = _require_int("min_partition_size", min_partition_size, 0)
    max_retries = _require_int("max_retries", max_retries, 1)
    num_samples = labels.size
    required_size = max(min_partition_size, 1)  # an empty client is never acceptable
    if required_size * num_partitions > num_samples:
        raise ValueError(
            f"min_partition_size={min_partition_size} for each of {num_partitions} partitions "
            f"needs {required_size * num_partitions} samples but there are {num_samples}; "
            f"lower min_partition_size or num_partitions"
        )

    rng = _rng(seed)
    _, class_members = _indices_by_class(labels)
    concentration = np.full(num_partitions, alpha)
    even_share = num_samples / num_partitions
    client_range = np.arange(num_partitions, dtype=np.int64)
    smallest_size = 0
    for _ in range(max_retries):
        client_ids = np.empty(num_samples, dtype=np.int64)
        sizes = np.zeros(num_partitions, dtype=np.int64)
        for members in class_members:
            proportions = rng.dirichlet(concentration)
            if self_balancing:
                open_proportions = np.where(sizes < even_share, proportions, 0.0)
                if open_proportions.sum() > 0:
                    proportions = open_proportions / open_proportions.sum()
            cuts = np.minimum((np.cumsum(proportions)[:-1] * members.size).astype(np.int64),
                              members.size)
            counts = np.diff(np.concatenate(([0], cuts, [members.size])))
            client_ids[rng.permutation(members)] = np.repeat(client_range, counts)
            sizes += counts
        smallest_size = int(sizes.min())
        if smallest_size >= required_size:
            return client_ids
    raise ValueError(
        f"dirichlet partitioning found no draw in {max_retries} tries where every one of the "
        f"{num_partitions} partitions holds at least {required_size} samples (smallest in the "
        f"last try: {smallest_size}); raise alpha (now {alpha}), lower min_partition_size "
        f"(now {min_partition_size}) or lower num_partitions"
    )


def shard(
    labels: np.ndarray,
    num_partitions: int,
    num_shards_per_partition: int = 2,
    shard_size: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Sort samples by label, cut the order into shards, and deal each client random shards.

    Ties within a class are shuffled before the cut, so a shard is a random subset of its
    classes. Each client gets `num_shards_per_partition` shards.
    - `shard_size=None`: the sorted order is cut into exactly K·num_shards_per_partition shards
      whose sizes differ by at most one, so every sample is assigned.
    - explicit `shard_size`: the order is cut into N // shard_size full shards; K·num_shards_per_
      partition of them, chosen at random, are dealt out. Samples in the unused shards and in
      the incomplete tail get `UNASSIGNED` (-1); each client holds exactly
      num_shards_per_partition·shard_size samples.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64.
    """
    labels, num_partitions = _validated_request(labels, num_partitions)
    num_shards_per_partition = _require_int("num_shards_per_partition", num_shards_per_partition, 1)
    num_samples = labels.size
    num_shards_needed = num_partitions * num_shards_per_partition
    if shard_size is None:
        if num_shards_needed > num_samples:
            raise ValueError(
                f"shard partitioning needs num_partitions x num_shards_per_partition = "
                f"{num_shards_needed} non-empty shards but there are only {num_samples} samples; "
                f"lower num_shards_per_partition or num_partitions"
            )
        num_shards = num_shards_needed
        shard_of_position = _even_split_ids(num_samples, num_shards)
    else:
        shard_size = _require_int("shard_size", shard_size, 1)
        num_shards = num_samples // shard_size
        if num_shards_needed > num_shards:
            raise ValueError(
                f"shard partitioning needs num_partitions x num_shards_per_partition = "
                f"{num_shards_needed} shards of shard_size={shard_size}, but only {num_shards} "
                f"fit in {num_samples} samples; lower shard_size, num_shards_per_partition or "
                f"num_partitions, or pass shard_size=None"
            )
        shard_of_position = np.repeat(np.arange(num_shards, dtype=np.int64), shard_size)

    rng = _rng(seed)
    shuffled = rng.permutation(num_samples)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    client_of_shard = np.full(num_shards, UNASSIGNED, dtype=np.int64)
    dealt_shards = rng.permutation(num_shards)[:num_shards_needed]
    client_of_shard[dealt_shards] = np.arange(num_shards_needed) // num_shards_per_partition
    client_ids = np.full(num_samples, UNASSIGNED, dtype=np.int64)
    client_ids[by_label[: shard_of_position.size]] = client_of_shard[shard_of_position]
    return client_ids


def pathological(
    labels: np.ndarray,
    num_partitions: int,
    num_classes_per_partition: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """Each client holds exactly `num_classes_per_partition` classes.

    Clients pick classes in turn, each taking the classes held by the fewest clients so far,
    ties broken at random. So the number of holders per class differs by at most one, every
    class is held once K·num_classes_per_partition >= C, and the class combinations are random.
    Each class's samples are then shuffled and split evenly among its holders. When
    K·num_classes_per_partition < C, the samples of classes no client holds get `UNASSIGNED`.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64.
    """
    labels, num_partitions = _validated_request(labels, num_partitions)
    classes_per_client = _require_int("num_classes_per_partition", num_classes_per_partition, 1)
    classes, class_members = _indices_by_class(labels)
    num_classes = classes.size
    if classes_per_client > num_classes:
        raise ValueError(
            f"num_classes_per_partition={classes_per_client} exceeds the {num_classes} classes "
            f"present in labels; lower num_classes_per_partition to at most {num_classes}"
        )

    rng = _rng(seed)
    holds = np.zeros((num_partitions, num_classes), dtype=bool)
    holder_counts = np.zeros(num_classes, dtype=np.int64)
    for client in range(num_partitions):
        # Integer load plus a [0, 1) jitter: least-held classes first, random among equals.
        chosen = np.argsort(holder_counts + rng.random(num_classes))[:classes_per_client]
        holds[client, chosen] = True
        holder_counts[chosen] += 1

    class_sizes = np.array([members.size for members in class_members])
    too_small = np.flatnonzero(class_sizes < holder_counts)
    if too_small.size:
        worst = too_small[0]
        raise ValueError(
            f"class {classes[worst]} has {class_sizes[worst]} samples but is shared by "
            f"{holder_counts[worst]} partitions, so some would get none of it; lower "
            f"num_partitions or num_classes_per_partition"
        )

    client_ids = np.full(labels.size, UNASSIGNED, dtype=np.int64)
    for class_index, members in enumerate(class_members):
        holders = np.flatnonzero(holds[:, class_index])
        if holders.size:
            client_ids[rng.permutation(members)] = holders[_even_split_ids(members.size,
                                                                           holders.size)]
    return client_ids


def natural(labels: np.ndarray, num_partitions: int, seed: int = 0) -> np.ndarray:
    """The data's own clients: `labels` here are natural client ids (writer, user, device).

    With as many partitions as distinct ids, partition k holds the k-th smallest id. With fewer,
    the ids are dealt at random (seeded) into `num_partitions` groups whose numbers of ids differ
    by at most one, and a partition holds all samples of its ids, so no id is ever split.

    labels: shape `(N,)`, integer client ids. Returns client ids, shape `(N,)`, int64.
    """
    labels = _validated_labels(labels)
    num_partitions = _require_int("num_partitions", num_partitions, 1)
    _, dense = np.unique(labels, return_inverse=True)
    num_ids = int(dense.max()) + 1 if dense.size else 0
    if num_partitions > num_ids:
        raise ValueError(
            f"natural partitioning into num_partitions={num_partitions} clients needs at least as "
            f"many distinct client ids, but the data has {num_ids}, so some client would hold no "
            f"samples; set num_clients to at most {num_ids} (ids are grouped when it is smaller)"
        )
    if num_partitions == num_ids:
        return dense.astype(np.int64)
    group_of_id = np.empty(num_ids, dtype=np.int64)
    group_of_id[_rng(seed).permutation(num_ids)] = _even_split_ids(num_ids, num_partitions)
    return group_of_id[dense]


def flower(
    labels: np.ndarray, num_partitions: int, partitioner: str, seed: int = 0, **params: Any
) -> np.ndarray:
    """Any Flower Datasets partitioner, by class name (`LinearPartitioner`) or short name
    (`linear`, `inner_dirichlet`), with its own keyword arguments `params`.

    The partitioner sees a Hugging Face dataset with one column, `partition_by`, holding
    `labels` (class labels, or client ids for `NaturalIdPartitioner`), shuffled first with
    `Dataset.shuffle(seed=seed)` as Flower's `FederatedDataset(shuffle=True, seed=seed)` does;
    partitioners that take a `seed` get it too. Needs `pip install -e '.[hf]'`.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64; samples in no partition
    get `UNASSIGNED`.
    """
    labels = _validated_labels(labels)
    num_partitions = _require_int("num_partitions", num_partitions, 1)
    seed = _require_int("seed", seed, 0)
    try:
        import datasets
        from flwr_datasets import partitioner as flower_partitioners
    except ImportError as error:
        raise ImportError("partition 'flower' needs Flower Datasets: pip install -e '.[hf]'") from error
    names = {name for name in flower_partitioners.__all__ if name.endswith("Partitioner")
             and name not in ("Partitioner",) and not name.startswith("Vertical")}
    wanted = str(partitioner).replace("_", "").replace("-", "").lower()
    matches = [n for n in names if wanted in (n.lower(), n.lower().removesuffix("partitioner"))]
    if not matches:
        raise ValueError(f"unknown Flower partitioner {partitioner!r}; known: {', '.join(sorted(names))}")
    cls = getattr(flower_partitioners, matches[0])
    accepted = inspect.signature(cls).parameters
    given = {"num_partitions": num_partitions, "partition_by": "partition_by", "seed": seed}
    kwargs = {name: value for name, value in given.items() if name in accepted} | params
    try:
        instance = cls(**kwargs)
    except TypeError as error:
        options = ", ".join(n for n in accepted if n not in given)
        raise ValueError(f"Flower {matches[0]} rejects the arguments {sorted(params)} ({error}); "
                         f"it accepts {options}") from None
    rows = np.arange(labels.size)
    shuffled = np.random.default_rng(seed).permutation(labels.size)  # = Dataset.shuffle(seed=seed)
    instance.dataset = datasets.Dataset.from_dict(
        {"partition_by": labels[shuffled], "row": rows[shuffled]})
    if instance.num_partitions != num_partitions:
        raise ValueError(f"Flower {matches[0]} makes {instance.num_partitions} partitions of these "
                         f"data but num_partitions={num_partitions}: set num_clients to "
                         f"{instance.num_partitions}")
    client_ids = np.full(labels.size, UNASSIGNED, dtype=np.int64)
    for client in range(num_partitions):
        held = np.asarray(instance.load_partition(client)["row"], dtype=np.int64)
        if held.size == 0:
            raise ValueError(f"Flower {matches[0]} left partition {client} empty; lower num_clients "
                             "or change its arguments")
        if np.any(client_ids[held] != UNASSIGNED):
            raise ValueError(f"Flower {matches[0]} put some samples in two partitions")
        client_ids[held] = client
    return client_ids


PARTITIONERS: dict[str, Callable[..., np.ndarray]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shard": shard,
    "pathological": pathological,
    "natural": natural,
    "flower": flower,
}
_COMMON_PARAMS = ("labels", "num_partitions", "seed")


def partition(
    labels: np.ndarray, scheme: str, num_partitions: int, seed: int = 0, **params: Any
) -> np.ndarray:
    """Run the partitioner named `scheme` with exactly `params`.

    labels: shape `(N,)`. Returns client ids, shape `(N,)`, int64 (see the chosen partitioner for
    when `UNASSIGNED` appears).
    """
    if scheme not in PARTITIONERS:
        raise ValueError(
            f"unknown partition scheme {scheme!r}; known schemes: {', '.join(PARTITIONERS)}"
        )
    partitioner = PARTITIONERS[scheme]
    if scheme == "flower":  # its parameters are the chosen Flower partitioner's own
        return partitioner(labels, num_partitions, seed=seed, **params)
    signature = inspect.signature(partitioner).parameters
    accepted = [name for name in signature if name not in _COMMON_PARAMS]
    unexpected = sorted(set(params) - set(accepted))
    missing = [name for name in accepted
               if signature[name].default is inspect.Parameter.empty and name not in params]
    if unexpected or missing:
        problem = (f"got unexpected parameter(s) {unexpected}" if unexpected
                   else f"is missing required parameter(s) {missing}")
        options = ", ".join(accepted) or "no parameters besides num_partitions and seed"
        raise ValueError(f"{scheme!r} partitioning {problem}; it accepts {options}")
    return partitioner(labels, num_partitions, seed=seed, **params)


def describe(client_ids: np.ndarray, labels: np.ndarray, num_partitions: int) -> dict[str, Any]:
    """Summary of a partition, for logs and checks.

    client_ids, labels: shape `(N,)`; `UNASSIGNED` samples are left out of every statistic.
    Returns a dict of plain Python numbers:
    - `num_assigned`, `num_unassigned`, `num_empty_partitions`;
    - `size_min`, `size_median`, `size_max`: samples per partition, over all partitions;
    - `mean_classes_per_partition`: distinct classes per non-empty partition, averaged;
    - `label_skew_tv`: total-variation distance between each non-empty partition's label
      distribution and that of all assigned samples, averaged over partitions (0 when every
      partition mirrors the pool, 1 when partitions and pool share no class).
    """
    labels = _validated_labels(labels)
    num_partitions = _require_int("num_partitions", num_partitions, 1)
    client_ids = np.asarray(client_ids)
    if client_ids.shape != labels.shape or not np.issubdtype(client_ids.dtype, np.integer):
        raise ValueError(
            f"client_ids must be an integer array shaped like labels {labels.shape}, got shape "
            f"{client_ids.shape} and dtype {client_ids.dtype}"
        )
    assigned = client_ids != UNASSIGNED
    if np.any(client_ids[assigned] < 0) or np.any(client_ids[assigned] >= num_partitions):
        raise ValueError(
            f"client_ids must lie in [0, {num_partitions}) or equal {UNASSIGNED} (unassigned)"
        )

    classes, class_index = np.unique(labels, return_inverse=True)
    num_classes = classes.size
    counts = np.bincount(
        client_ids[assigned] * num_classes + class_index[assigned],
        minlength=num_partitions * num_classes,
    ).reshape(num_partitions, num_classes)
    sizes = counts.sum(axis=1)
    nonempty = sizes > 0
    pool_distribution = counts.sum(axis=0) / max(int(sizes.sum()), 1)
    client_distributions = counts[nonempty] / sizes[nonempty, None]
    skew = 0.5 * np.abs(client_distributions - pool_distribution).sum(axis=1)
    return {
        "num_assigned": int(assigned.sum()),
        "num_unassigned": int((~assigned).sum()),
        "num_empty_partitions": int((~nonempty).sum()),
        "size_min": int(sizes.min()),
        "size_median": float(np.median(sizes)),
        "size_max": int(sizes.max()),
        "mean_classes_per_partition": float((counts[nonempty] > 0).sum(axis=1).mean())
        if nonempty.any() else 0.0,
        "label_skew_tv": float(skew.mean()) if nonempty.any() else 0.0,
    }


def holdout_strata(labels: Tensor, groups: Tensor | None = None) -> Tensor:
    """Each sample's stratum of `stratified_holdout`, its (group, class) as one int64 key: (n,)."""
    labels = labels.long()
    return labels if groups is None or not len(labels) else groups.long() * (int(labels.max()) + 1) + labels


def holdout_sizes(labels: Tensor, fraction: float, groups: Tensor | None = None) -> Tensor:
    """How many rows `stratified_holdout` holds out of each stratum: round(fraction · size), whatever the seed."""
    return torch.round(fraction * torch.bincount(holdout_strata(labels, groups)))


def stratified_holdout(labels: Tensor, fraction: float, seed: int, groups: Tensor | None = None) -> Tensor:
    """A seeded boolean mask (n,) holding out round(fraction · size) of every class of every group.

    groups: (n,) int64, e.g. client ids, so that each client's share is split by class; None
        means one group. Vectorized: a random order, stably sorted by (group, class), ranks
        each sample inside its stratum.
    """
    strata = holdout_strata(labels, groups)
    shuffled = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    order = shuffled[torch.argsort(strata[shuffled], stable=True)]
    sizes = torch.bincount(strata)
    first = torch.cumsum(sizes, 0) - sizes
    sorted_strata = strata[order]
    rank = torch.arange(len(labels)) - first[sorted_strata]
    mask = torch.zeros(len(labels), dtype=torch.bool)
    mask[order] = rank < torch.round(fraction * sizes[sorted_strata])
    return mask
