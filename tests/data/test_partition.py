"""Tests for the client partitioners in workbench.data.partition."""
import numpy as np
import pytest

from workbench.data.partition import (
    PARTITIONERS,
    UNASSIGNED,
    describe,
    dirichlet,
    iid,
    partition,
    pathological,
    shard,
)

NUM_CLASSES = 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return np.random.default_rng(1234).integers(0, NUM_CLASSES, 5000)


@pytest.fixture(scope="module")
def many_labels() -> np.ndarray:
    # Enough samples that sampling noise is far below the gaps in Dirichlet skew.
    return np.random.default_rng(7).integers(0, NUM_CLASSES, 50_000)


def classes_per_client(client_ids: np.ndarray, labels: np.ndarray, num_partitions: int):
    return np.array([np.unique(labels[client_ids == k]).size for k in range(num_partitions)])


COMPLETE_CASES = [
    ("iid", 1, {}),
    ("iid", 10, {}),
    ("iid", 100, {}),
    ("dirichlet", 1, {"alpha": 0.5}),
    ("dirichlet", 10, {"alpha": 0.5}),
    ("dirichlet", 100, {"alpha": 0.5}),
    ("dirichlet", 10, {"alpha": 0.1, "self_balancing": True}),
    ("shard", 1, {}),
    ("shard", 10, {}),
    ("shard", 100, {"num_shards_per_partition": 3}),
    ("pathological", 1, {"num_classes_per_partition": NUM_CLASSES}),
    ("pathological", 10, {"num_classes_per_partition": 1}),
    ("pathological", 100, {"num_classes_per_partition": 2}),
]


@pytest.mark.parametrize("scheme, num_partitions, params", COMPLETE_CASES)
def test_every_sample_goes_to_exactly_one_nonempty_client(labels, scheme, num_partitions, params):
    client_ids = partition(labels, scheme, num_partitions, seed=3, **params)
    assert client_ids.dtype == np.int64 and client_ids.shape == labels.shape
    assert client_ids.min() >= 0 and client_ids.max() < num_partitions
    assert np.all(np.bincount(client_ids, minlength=num_partitions) > 0)
    summary = describe(client_ids, labels, num_partitions)
    assert summary["num_unassigned"] == 0 and summary["num_empty_partitions"] == 0


@pytest.mark.parametrize(
    "scheme, num_partitions, params",
    [case for case in COMPLETE_CASES if case[1] == 10],
)
def test_same_seed_same_split_other_seed_other_split(labels, scheme, num_partitions, params):
    first = partition(labels, scheme, num_partitions, seed=11, **params)
    assert np.array_equal(first, partition(labels, scheme, num_partitions, seed=11, **params))
    assert not np.array_equal(first, partition(labels, scheme, num_partitions, seed=12, **params))


def test_iid_sizes_differ_by_at_most_one(labels):
    sizes = np.bincount(iid(labels, 7), minlength=7)
    assert sizes.max() - sizes.min() <= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_dirichlet_skew_grows_as_alpha_falls(many_labels, seed):
    def skew(client_ids):
        return describe(client_ids, many_labels, 10)["label_skew_tv"]

    skews = [skew(dirichlet(many_labels, 10, alpha, seed=seed)) for alpha in (100, 5.0, 0.5, 0.05)]
    iid_skew = skew(iid(many_labels, 10, seed=seed))
    assert iid_skew < skews[0] < skews[1] < skews[2] < skews[3]


def test_dirichlet_self_balancing_caps_client_size(labels):
    even_share = labels.size / 10
    largest_class = np.bincount(labels).max()
    plain, balanced = [], []
    for seed in range(4):
        plain.append(np.bincount(dirichlet(labels, 10, 0.05, seed=seed)).max())
        balanced_ids = dirichlet(labels, 10, 0.05, self_balancing=True, seed=seed)
        balanced.append(np.bincount(balanced_ids).max())
    # A client stops receiving once it reaches the even share, so it overshoots by < one class.
    assert max(balanced) < even_share + largest_class
    assert np.mean(balanced) < np.mean(plain)


def test_dirichlet_meets_min_partition_size(labels):
    # Strong skew with 50 clients of 100 samples on average: the bound needs redraws.
    sizes = np.bincount(dirichlet(labels, 50, 0.3, min_partition_size=30), minlength=50)
    assert sizes.min() >= 30


def test_dirichlet_unreachable_min_partition_size_says_what_to_change(labels):
    with pytest.raises(ValueError, match=r"raise alpha.*lower min_partition_size.*num_partitions"):
        dirichlet(labels, 100, 0.01, min_partition_size=40, max_retries=20)
    with pytest.raises(ValueError, match="lower min_partition_size or num_partitions"):
        dirichlet(labels, 10, 1.0, min_partition_size=501)


@pytest.mark.parametrize("num_partitions, classes_each", [(10, 1), (10, 3), (100, 2), (37, 4)])
def test_pathological_clients_hold_exact_class_count_and_cover_all(labels, num_partitions,
                                                                    classes_each):
    client_ids = pathological(labels, num_partitions, classes_each, seed=5)
    held = classes_per_client(client_ids, labels, num_partitions)
    assert np.all(held == classes_each)
    holders = [np.unique(client_ids[labels == c]).size for c in range(NUM_CLASSES)]
    assert min(holders) >= 1 and max(holders) - min(holders) <= 1


def test_pathological_leaves_only_unheld_classes_unassigned(labels):
    client_ids = pathological(labels, 3, 2, seed=0)  # 6 class slots for 10 classes
    assigned = client_ids != UNASSIGNED
    held_classes = np.unique(labels[assigned])
    assert held_classes.size == 6
    assert np.all(np.isin(labels, held_classes) == assigned)
    assert np.all(classes_per_client(client_ids, labels, 3) == 2)


@pytest.mark.parametrize("num_partitions, shards_each", [(10, 2), (100, 2), (50, 3)])
def test_shard_clients_hold_few_classes(labels, num_partitions, shards_each):
    client_ids = shard(labels, num_partitions, shards_each, seed=2)
    # Shards are smaller than any class here, so one shard spans at most two classes.
    assert labels.size // (num_partitions * shards_each) < np.bincount(labels).min()
    assert np.all(classes_per_client(client_ids, labels, num_partitions) <= 2 * shards_each)
    sizes = np.bincount(client_ids, minlength=num_partitions)
    assert sizes.max() - sizes.min() <= shards_each


def test_shard_explicit_size_leaves_only_leftovers_unassigned(labels):
    client_ids = shard(labels, 20, num_shards_per_partition=2, shard_size=120, seed=4)
    assigned = client_ids[client_ids != UNASSIGNED]
    assert np.all(np.bincount(assigned, minlength=20) == 2 * 120)
    assert np.sum(client_ids == UNASSIGNED) == labels.size - 20 * 2 * 120
    assert np.all((client_ids == UNASSIGNED) | ((client_ids >= 0) & (client_ids < 20)))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda y: dirichlet(y, 10, alpha=0.0), "alpha must be a positive"),
        (lambda y: dirichlet(y, 10, alpha=-1.0), "alpha must be a positive"),
        (lambda y: iid(y, 0), "num_partitions must be an integer >= 1"),
        (lambda y: iid(y, y.size + 1), "lower num_partitions"),
        (lambda y: pathological(y, 10, NUM_CLASSES + 1), "lower num_classes_per_partition"),
        (lambda y: shard(y, 2000, 3), "lower num_shards_per_partition or num_partitions"),
        (lambda y: shard(y, 10, 2, shard_size=300), "only 16 fit"),
        (lambda y: iid(y.reshape(50, 100), 10), "1-D integer array"),
        (lambda y: iid(y.astype(float), 10), "1-D integer array"),
        (lambda y: pathological(np.array([0] + [1] * 20), 4, 1), "class 0 has 1 samples"),
        (lambda y: partition(y, "powerlaw", 10), "known schemes: iid, dirichlet, shard"),
        (lambda y: partition(y, "iid", 10, alpha=0.5), "unexpected parameter.*'alpha'"),
        (lambda y: partition(y, "shard", 10, alpha=0.5), "accepts num_shards_per_partition"),
        (lambda y: partition(y, "dirichlet", 10), "missing required parameter.*alpha"),
    ],
)
def test_impossible_requests_raise_value_error(labels, call, message):
    with pytest.raises(ValueError, match=message):
        call(labels)


def test_partition_dispatches_to_the_named_function(labels):
    assert set(PARTITIONERS) == {"iid", "dirichlet", "shard", "pathological", "natural", "flower"}
    direct = dirichlet(labels, 10, alpha=0.3, min_partition_size=5, seed=9)
    assert np.array_equal(direct, partition(labels, "dirichlet", 10, seed=9, alpha=0.3,
                                            min_partition_size=5))


def test_describe_on_a_hand_made_split():
    labels = np.array([0, 0, 1, 1, 2, 2])
    client_ids = np.array([0, 0, 1, 1, 1, UNASSIGNED])
    summary = describe(client_ids, labels, 3)
    assert summary["num_assigned"] == 5 and summary["num_unassigned"] == 1
    assert summary["num_empty_partitions"] == 1
    assert (summary["size_min"], summary["size_median"], summary["size_max"]) == (0, 2.0, 3)
    assert summary["mean_classes_per_partition"] == 1.5
    # Pool over assigned samples: (2/5, 2/5, 1/5); client 0 is all class 0, client 1 (0, 2/3, 1/3).
    assert summary["label_skew_tv"] == pytest.approx((0.6 + 0.4) / 2)


# --------------------------------------------------------------------------- Flower Datasets


def flower_assignment(labels: np.ndarray, partitioner, seed: int) -> np.ndarray:
    """Client of each row under a Flower Datasets partitioner, used the documented way: on a
    Hugging Face dataset shuffled with `Dataset.shuffle(seed=seed)`."""
    datasets = pytest.importorskip("datasets", reason="pip install -e '.[hf]'")
    partitioner.dataset = datasets.Dataset.from_dict(
        {"label": labels, "row": np.arange(labels.size)}).shuffle(seed=seed)
    client_ids = np.full(labels.size, UNASSIGNED)
    for k in range(partitioner.num_partitions):
        client_ids[np.asarray(partitioner.load_partition(k)["row"])] = k
    return client_ids


@pytest.mark.parametrize("num_partitions", [1, 7, 100])
@pytest.mark.parametrize("seed", [0, 5])
def test_iid_assigns_exactly_as_flowers_iid_partitioner(labels, num_partitions, seed):
    flwr = pytest.importorskip("flwr_datasets.partitioner", reason="pip install -e '.[hf]'")
    theirs = flower_assignment(labels, flwr.IidPartitioner(num_partitions), seed)
    assert np.array_equal(iid(labels, num_partitions, seed=seed), theirs)
    assert np.array_equal(partition(labels, "flower", num_partitions, seed=seed, partitioner="iid"), theirs)


@pytest.mark.parametrize("scheme, params", [
    ("dirichlet", {"alpha": 0.5, "min_partition_size": 10}),
    ("dirichlet", {"alpha": 0.1, "min_partition_size": 1}),
    ("shard", {"num_shards_per_partition": 2}),
])
def test_dirichlet_and_shard_agree_with_flower_in_distribution(labels, scheme, params):
    # Exact parity cannot hold: ours shuffles each class before cutting it (dirichlet) or
    # shuffles ties before the sort (shard), so the seed's stream is consumed differently. Over
    # 12 seeds the label skew and classes per client must agree within sampling noise.
    pytest.importorskip("flwr_datasets", reason="pip install -e '.[hf]'")
    stats = {}
    for who, run in (("ours", lambda s: partition(labels, scheme, 10, seed=s, **params)),
                     ("flower", lambda s: partition(labels, "flower", 10, seed=s, partitioner=scheme, **params))):
        runs = [describe(run(seed), labels, 10) for seed in range(12)]
        stats[who] = {key: np.array([r[key] for r in runs])
                      for key in ("label_skew_tv", "mean_classes_per_partition")}
    for key, ours in stats["ours"].items():
        theirs = stats["flower"][key]
        noise = 3 * np.hypot(ours.std(), theirs.std()) / np.sqrt(len(ours))
        assert abs(ours.mean() - theirs.mean()) <= max(noise, 1e-9), key


def test_pathological_differs_from_flower_by_design(labels):
    # Same classes per client; but ours deals classes to the least-held first, so every class is
    # held and sizes stay near N/K, while Flower picks classes at random and may leave some
    # unheld (their samples unassigned).
    pytest.importorskip("flwr_datasets", reason="pip install -e '.[hf]'")
    ours = [describe(pathological(labels, 10, 2, seed=s), labels, 10) for s in range(5)]
    with pytest.warns(UserWarning, match="will NOT be used"):  # Flower says which classes no client holds
        theirs = [describe(partition(labels, "flower", 10, seed=s, partitioner="pathological",
                                     num_classes_per_partition=2), labels, 10) for s in range(5)]
    assert all(r["mean_classes_per_partition"] == 2 for r in ours + theirs)
    assert all(r["num_unassigned"] == 0 for r in ours)
    assert sum(r["num_unassigned"] for r in theirs) > 0


def test_any_flower_partitioner_by_name_with_its_arguments(labels):
    pytest.importorskip("flwr_datasets", reason="pip install -e '.[hf]'")
    sizes = np.bincount(partition(labels, "flower", 4, seed=0, partitioner="LinearPartitioner"))
    assert np.allclose(sizes / sizes.sum(), np.arange(1, 5) / 10, atol=1e-3)  # sizes ∝ 1, 2, 3, 4
    inner = partition(labels, "flower", 5, seed=0, partitioner="inner_dirichlet",
                      partition_sizes=[1000] * 5, alpha=0.5)
    assert np.array_equal(np.bincount(inner), [1000] * 5)
    with pytest.raises(ValueError, match=r"unknown Flower partitioner 'powerlaw'.*LinearPartitioner"):
        partition(labels, "flower", 4, partitioner="powerlaw")
    with pytest.raises(ValueError, match="rejects the arguments \\['beta'\\]"):
        partition(labels, "flower", 4, partitioner="linear", beta=1)
    writers = np.repeat(np.arange(6), 3)
    with pytest.raises(ValueError, match=r"makes 6 partitions.*set num_clients to 6"):
        partition(writers, "flower", 4, partitioner="natural_id")
    assert np.array_equal(np.sort(partition(writers, "flower", 6, partitioner="natural_id")),
                          np.repeat(np.arange(6), 3))
