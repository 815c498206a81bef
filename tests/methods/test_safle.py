"""SAFLe: the sparse Gram is the one-hot Gram, and the federated solution is centralized ridge on Φ."""
from __future__ import annotations

import csv

import pytest
import torch
import yaml

from tests.conftest import relative_error
from tests.methods.conftest import fit_rounds
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.linalg import multi_hot_gram
from workbench.methods import Problem, SAFLe

BLOBS = SyntheticBlobs(num_classes=10, dim=6, train_size=1500, test_size=300, seed=1)
# d_q = 6·3 = 18 digits, E·G = 24 > d_q (a second permutation is drawn), V = 8, E·V = 64
SMALL = dict(levels=3, experts=8, group_size=3)
MODES = ["binary_overlap", "onehot", "integer"]


def data(**partition) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, batch_size=256, min_partition_size=1,
                             **partition)
    dm.setup()
    return dm


def set_up(method: SAFLe, dm: FederatedDataModule) -> SAFLe:
    method.setup(Problem((dm.feature_dim,), dm.num_classes, dm.num_clients))
    return method


def local_clients(method: SAFLe, dm: FederatedDataModule, batch_size: int = 256) -> LocalClients:
    return LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids,
                        torch.unique(dm.train_client_ids), batch_size)


def dense_phi(active: torch.Tensor, rows: int) -> torch.Tensor:
    """The dense one-hot design the method never builds: (n, E) -> (n, E·V) float64."""
    return torch.zeros(len(active), rows, dtype=torch.float64).scatter_(1, active, 1.0)


def reference_indices(method: SAFLe, z: torch.Tensor) -> torch.Tensor:
    """The spec, step by step, from standardized features z (n, d): full digit code, groups, base k."""
    tau = method.cut_points
    over = (z[:, :, None] > tau).long()  # [z > τ_t]: (n, d, T)
    region = over.sum(2)  # thresholds below z
    if method.bucketing == "binary_overlap":
        code = over  # bit l = [z > τ_l]
    elif method.bucketing == "onehot":
        code = (region[:, :, None] == torch.arange(method.levels)).long()  # bit l = [z in bin l]
    else:
        code = region[:, :, None]  # one digit in 0..L−1
    code = code.flatten(1)  # (n, d_q)
    k, groups = method.base, method.digit_groups
    index = torch.zeros(len(z), method.experts, dtype=torch.long)
    for i in range(method.group_size):  # idx_j = Σ_i g_{j,i} k^(i−1)
        index += code[:, groups[:, i]] * k ** i
    return index + method.vocab * torch.arange(method.experts)


def per_sample_z(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return (x - x.mean(1, keepdim=True)) / x.std(1, unbiased=False, keepdim=True)


def pooled_z(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return (x - x.mean(0)) / x.std(0, unbiased=False)


# ---- the embedding ------------------------------------------------------------------------------
@pytest.mark.parametrize("bucketing", MODES)
def test_cut_points_are_standard_normal_quantiles_of_equally_likely_regions(bucketing):
    method = set_up(SAFLe(bucketing=bucketing, **SMALL), data(num_clients=2, partition="iid"))
    regions = SMALL["levels"] + 1 if bucketing == "binary_overlap" else SMALL["levels"]
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    probabilities = normal.cdf(method.cut_points)
    assert torch.allclose(probabilities, torch.arange(1, regions, dtype=torch.float64) / regions, atol=1e-12)


@pytest.mark.parametrize("bucketing", MODES)
def test_expert_indices_follow_the_spec_and_pick_exactly_one_row_per_table(bucketing):
    dm = data(num_clients=2, partition="iid")
    method = set_up(SAFLe(bucketing=bucketing, **SMALL), dm)
    active = method.expert_indices(dm.train_features)
    assert torch.equal(active, reference_indices(method, per_sample_z(dm.train_features)))
    table_of_row = active.div(method.vocab, rounding_mode="floor")
    assert torch.equal(table_of_row, torch.arange(method.experts).expand_as(active))  # one row per table
    phi = dense_phi(active, method.embedding_rows)
    assert torch.equal(phi.sum(1), torch.full((len(phi),), float(method.experts), dtype=torch.float64))
    assert len(active.unique()) > method.experts  # the tables are really indexed by the data


def test_groups_are_seeded_permutations_of_the_digits():
    dm = data(num_clients=2, partition="iid")
    num_digits = BLOBS.dim * SMALL["levels"]
    method = set_up(SAFLe(**SMALL), dm)
    used = method.digit_groups.flatten()
    assert torch.equal(used[:num_digits].sort().values, torch.arange(num_digits))  # every digit once...
    assert len(used[num_digits:].unique()) == len(used) - num_digits  # ...then a fresh permutation
    truncated = set_up(SAFLe(levels=3, experts=4, group_size=3), dm).digit_groups  # E·G = 12 < d_q = 18
    assert len(truncated.unique()) == truncated.numel()
    again = set_up(SAFLe(**SMALL), dm).digit_groups
    other_seed = set_up(SAFLe(**SMALL, seed=1), dm).digit_groups
    assert torch.equal(again, method.digit_groups) and not torch.equal(other_seed, method.digit_groups)


def scalar_codes(bucketing: str, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit codes (n, digits) of one feature swept over [−3, 3] with z = x, and its regions (n,)."""
    method = SAFLe(bucketing=bucketing, levels=levels, thresholds="calibrated", experts=1, group_size=1)
    method.setup(Problem((1,), num_classes=2, num_clients=1))  # mean 0, std 1 before calibration: z = x
    x = torch.linspace(-3, 3, 1201, dtype=torch.float64)[:, None]
    return method.digit_code(x), torch.bucketize(x[:, 0], method.cut_points)


def test_thermometer_codes_of_nearby_values_differ_in_one_bit_and_distance_grows_with_the_gap():
    levels = 7
    codes, region = scalar_codes("binary_overlap", levels)
    hamming = (codes[:, None, :] != codes[None, :, :]).sum(2)
    gap = (region[:, None] - region[None, :]).abs()
    assert torch.equal(hamming, gap)  # the code is ordinal: bits differ once per threshold crossed
    assert set(region.tolist()) == set(range(levels + 1))


@pytest.mark.parametrize("bucketing, changed_fraction", [("onehot", 2 / 7), ("integer", 1.0)])
def test_onehot_and_integer_codes_lose_all_similarity_across_any_threshold(bucketing, changed_fraction):
    """Crossing one threshold changes 2 of L one-hot bits, or the whole integer digit (the cliff),
    and a value far away is exactly as different as a neighbour."""
    codes, region = scalar_codes(bucketing, levels=7)
    hamming = (codes[:, None, :] != codes[None, :, :]).sum(2).double() / codes.shape[1]
    different = region[:, None] != region[None, :]
    assert torch.equal(hamming[different], torch.full_like(hamming[different], changed_fraction))
    assert torch.equal(hamming[~different], torch.zeros_like(hamming[~different]))
    assert set(region.tolist()) == set(range(7))


# ---- the statistics ------------------------------------------------------------------------------
def test_multi_hot_gram_equals_the_dense_product_for_any_indices():
    """Unstructured columns, repeats inside a row, several chunks of rows, several tiles of the table."""
    for size in (11, 300):
        active = torch.randint(0, size, (400, 5), generator=torch.Generator().manual_seed(size))
        phi = torch.zeros(400, size, dtype=torch.float64).scatter_add_(1, active, torch.ones(400, 5).double())
        assert (phi > 1).any()  # some row holds a column twice
        assert torch.equal(multi_hot_gram(active, size, chunk_elements=64), phi.T @ phi)


@pytest.mark.parametrize("raw_features", [False, True])
@pytest.mark.parametrize("bucketing", MODES)
def test_uploads_equal_the_dense_one_hot_products(bucketing, raw_features):
    dm = data(num_clients=3, partition="iid")
    method = set_up(SAFLe(bucketing=bucketing, raw_features=raw_features, gamma=0.0, **SMALL), dm)
    x, y = dm.train_features, dm.train_labels
    clients = local_clients(method, dm)  # several chunks of rows
    upload, _ = clients.half.client_update(0, {}, clients.data)
    rows, vocab, d = method.embedding_rows, method.vocab, dm.feature_dim
    phi = dense_phi(method.expert_indices(x), rows)
    onehot_y = torch.nn.functional.one_hot(y, dm.num_classes).double()
    raw = d if raw_features else 0
    gram, cross = upload["gram"][raw:, raw:], upload["cross"][raw:]
    assert torch.equal(gram, phi.T @ phi) and torch.equal(cross, phi.T @ onehot_y)  # exact counts
    blocks = gram.view(method.experts, vocab, method.experts, vocab)
    for j in range(method.experts):  # one active row per table: its diagonal block is diagonal
        assert torch.equal(blocks[j, :, j, :], torch.diag(blocks[j, :, j, :].diagonal()))
    if raw_features:
        design = torch.cat([x.double(), phi], 1)
        assert relative_error(upload["gram"], design.T @ design) <= 1e-12
        assert relative_error(upload["cross"], design.T @ onehot_y) <= 1e-12


@pytest.mark.parametrize("raw_features", [False, True])
@pytest.mark.parametrize("thresholds", ["fixed", "calibrated"])
def test_one_cohort_call_is_the_sum_of_each_clients_own_call(thresholds, raw_features):
    """Every round, the client half vectorized over all clients equals the clients computing
    alone, each on a client half of its own built from the settings only (as on a Flower node)."""
    dm = data(partition="dirichlet", alpha=0.3, num_clients=7)
    settings = dict(thresholds=thresholds, raw_features=raw_features, gamma=1.5, **SMALL)
    method = set_up(SAFLe(**settings), dm)
    together = local_clients(method, dm)
    alone = []
    for k in together.served.tolist():
        mine = dm.train_client_ids == k
        alone.append(LocalClients(set_up(SAFLe(**settings), dm), dm.train_features[mine], dm.train_labels[mine],
                                  dm.train_client_ids[mine], torch.tensor([k]), batch_size=50))
    for round_index in range(method.num_rounds):
        broadcast = {name: value.clone() for name, value in method.broadcast().items()}
        assert set(broadcast) == ({"feature_mean", "feature_std"} if round_index == 1 else set())
        uploads, _ = together.half.client_update(round_index, broadcast, together.data)
        summed = {}
        for clients in alone:
            upload, _ = clients.half.client_update(round_index, broadcast, clients.data)
            summed = {name: summed.get(name, 0) + value for name, value in upload.items()}
        assert set(summed) == set(uploads)
        for name in uploads:
            assert relative_error(summed[name], uploads[name]) <= 1e-12, (round_index, name)
        method.finish_round(uploads, len(alone))


# ---- federated = centralized ---------------------------------------------------------------------
PARTITIONS = [
    {"partition": "iid", "num_clients": 1},
    {"partition": "iid", "num_clients": 10},
    {"partition": "dirichlet", "alpha": 0.1, "num_clients": 20},
]


@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("thresholds", ["fixed", "calibrated"])
def test_federated_equals_centralized_ridge_on_the_embedding(fit_method, partition, thresholds):
    dm = data(**partition)
    method = SAFLe(thresholds=thresholds, gamma=2.0, gamma_out=0.5, **SMALL)
    fit_method(method, dm)
    x = dm.train_features
    if thresholds == "calibrated":  # the summed moments are the pooled ones
        assert relative_error(method.feature_mean, x.double().mean(0)) <= 1e-12
        assert relative_error(method.feature_std, x.double().std(0, unbiased=False)) <= 1e-12
    z = pooled_z(x) if thresholds == "calibrated" else per_sample_z(x)
    phi = dense_phi(reference_indices(method, z), method.embedding_rows)
    onehot_y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    ridge = 0.5 * torch.eye(phi.shape[1], dtype=phi.dtype)
    centralized = torch.linalg.solve(phi.T @ phi + ridge, phi.T @ onehot_y)
    assert relative_error(method.embedding, centralized) <= 1e-8
    test_phi = dense_phi(method.expert_indices(dm.test_features), method.embedding_rows)
    assert relative_error(method(dm.test_features), test_phi @ centralized) <= 1e-8  # forward = Φ(x)ᵀW


def test_raw_features_beside_the_embedding_is_one_centralized_ridge(fit_method):
    dm = data(partition="dirichlet", alpha=0.1, num_clients=20)
    method = SAFLe(raw_features=True, gamma=1.0, gamma_out=0.5, **SMALL)
    fit_method(method, dm)
    x = dm.train_features.double()
    design = torch.cat([x, dense_phi(reference_indices(method, per_sample_z(x)), method.embedding_rows)], 1)
    onehot_y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    centralized = torch.linalg.solve(design.T @ design + 0.5 * torch.eye(design.shape[1], dtype=x.dtype),
                                     design.T @ onehot_y)
    assert relative_error(torch.cat([method.raw_weight, method.embedding]), centralized) <= 1e-8
    test_x = dm.test_features.double()
    test_design = torch.cat([test_x, dense_phi(method.expert_indices(test_x), method.embedding_rows)], 1)
    assert relative_error(method(dm.test_features), test_design @ centralized) <= 1e-8


# ---- communication ------------------------------------------------------------------------------
@pytest.mark.parametrize("thresholds, raw_features",
                         [("fixed", False), ("calibrated", False), ("fixed", True)])
def test_bytes_and_rounds_are_the_analytic_count(fit_method, thresholds, raw_features):
    dm = data(num_clients=10, partition="iid")
    method = SAFLe(thresholds=thresholds, raw_features=raw_features, **SMALL)
    engine = fit_method(method, dm)
    d, classes, k = BLOBS.dim, BLOBS.num_classes, 10
    side = 8 * 2 ** 3 + (d if raw_features else 0)  # E·V (+ d)
    calibrated = thresholds == "calibrated"
    per_client = (side * (side + 1) // 2 + side * classes + calibrated * (2 * d + 1)) * 8  # float64
    assert engine.fit_metrics["comm/bytes_up_per_client"] == per_client
    assert engine.fit_metrics["comm/bytes_up"] == per_client * k
    assert engine.fit_metrics["comm/bytes_down"] == (side * classes + calibrated * 2 * d) * 8 * k
    assert engine.fit_metrics["comm/rounds"] == method.num_rounds == (2 if calibrated else 1)


# ---- the command line and checkpoints -------------------------------------------------------------
def test_cli_fit_then_test_from_the_checkpoint(tmp_path):
    config = {
        "model": {"class_path": "SAFLe", "init_args": {"thresholds": "calibrated", **SMALL}},
        "data": {"class_path": "FederatedDataModule",
                 "init_args": {"dataset": "synthetic", "num_clients": 5, "partition": "dirichlet",
                               "alpha": 0.5, "synthetic": {"num_classes": 4, "dim": 6, "train_size": 800,
                                                           "test_size": 200}}},
    }
    path = tmp_path / "safle.yaml"
    path.write_text(yaml.safe_dump(config))
    common = ["--config", str(path), "--trainer.enable_progress_bar=false"]
    main(["fit", *common, f"--run_dir={tmp_path / 'fit'}"])
    run = next((tmp_path / "fit").glob("*/version_0"))
    logged = {}
    for row in csv.DictReader((run / "metrics.csv").open()):
        logged.update({key: float(value) for key, value in row.items() if value})
    assert logged["comm/rounds"] == 2 and logged["test/acc"] > 0.9
    cli = main(["test", *common, f"--run_dir={tmp_path / 'eval'}", f"--ckpt_path={run / 'model.ckpt'}"])
    assert cli.trainer.callback_metrics["test/acc"] == pytest.approx(logged["test/acc"])


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (dict(bucketing="thermometer"), "bucketing"),
    (dict(thresholds="learned"), "thresholds"),
    (dict(bucketing="onehot", levels=1), "levels"),
    (dict(experts=0), "experts"),
    (dict(gamma_out=-1.0), "gamma"),
    (dict(dtype="int64"), "dtype"),
    (dict(experts=4096, group_size=6), "lower experts or group_size"),
])
def test_bad_hyperparameters_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        SAFLe(**bad)


def test_groups_larger_than_the_digits_are_rejected():
    with pytest.raises(ValueError, match="group_size"):
        set_up(SAFLe(bucketing="integer", levels=2, group_size=7), data(num_clients=2, partition="iid"))


@pytest.mark.parametrize("thresholds", ["fixed", "quantile"])
def test_cg_solver_equals_the_dense_cholesky_solve(fit_method, thresholds):
    dm = data(partition="dirichlet", alpha=0.3, num_clients=10)
    settings = dict(thresholds=thresholds, gamma=2.0, gamma_out=0.5, **SMALL)
    dense, sparse = SAFLe(**settings), SAFLe(**settings, solver="cg", cg_tolerance=1e-12)
    dense_engine, sparse_engine = fit_method(dense, dm), fit_method(sparse, dm)
    assert relative_error(sparse.embedding, dense.embedding) <= 1e-6
    assert sparse.row_ledger == []  # the rows are dropped once solved
    # the protocol's bytes: the packed Gram is counted although the cg server never forms it
    for name in ("comm/bytes_up", "comm/bytes_down", "comm/rounds"):
        assert sparse_engine.fit_metrics[name] == dense_engine.fit_metrics[name], name


def test_cg_solver_goes_beyond_the_dense_limit_and_stays_exact():
    """E·V = 2^17 rows (the dense Gram would be 128 GiB): the cg solution still satisfies the
    normal equations (ΦᵀΦ + γ_out I) W = ΦᵀY, checked row by row from the sparse design."""
    dm = data(num_clients=3, partition="iid")
    method = set_up(SAFLe(experts=4, group_size=15, levels=3, gamma_out=2.0, solver="cg", cg_tolerance=1e-12), dm)
    assert method.embedding_rows == 4 * 2 ** 15
    fit_rounds(method, [local_clients(method, dm)], 3)
    active = method.expert_indices(dm.train_features)
    onehot_y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    residual_rows = method.embedding[active].sum(1) - onehot_y  # ΦW − Y: (n, C)
    normal = torch.zeros_like(method.embedding).index_add_(0, active.flatten(),
                                                           residual_rows.repeat_interleave(active.shape[1], 0))
    normal += 2.0 * method.embedding  # Φᵀ(ΦW − Y) + γ_out W = 0
    assert float(normal.abs().max()) <= 1e-8


def test_cg_solver_without_the_clients_rows_is_a_clear_error():
    """Under Flower or several processes the server never sees the rows: the round's count
    does not match what it holds."""
    dm = data(num_clients=4, partition="iid")
    method = set_up(SAFLe(solver="cg", **SMALL), dm)
    elsewhere = local_clients(set_up(SAFLe(solver="cg", **SMALL), dm), dm)  # another process's method
    uploads, _ = elsewhere.half.client_update(0, method.broadcast(), elsewhere.data)
    with pytest.raises(ValueError, match="solver 'dense'"):
        method.server_update(uploads, 4)


def test_quantile_thresholds_are_the_pooled_empirical_quantiles_whatever_the_partition():
    dm = data(partition="dirichlet", alpha=0.1, num_clients=10)
    methods = []
    for one_by_one in (False, True):
        method = set_up(SAFLe(thresholds="quantile", **SMALL), dm)
        if one_by_one:
            clients = [LocalClients(set_up(SAFLe(thresholds="quantile", **SMALL), dm), dm.train_features[mine],
                                    dm.train_labels[mine], dm.train_client_ids[mine], torch.tensor([k]), 64)
                       for k in torch.unique(dm.train_client_ids).tolist()
                       for mine in [dm.train_client_ids == k]]
        else:
            clients = [local_clients(method, dm)]
        assert fit_rounds(method, clients, 10) == {} and method.num_rounds == 3
        methods.append(method)
    assert torch.equal(methods[0].feature_cuts, methods[1].feature_cuts)
    assert relative_error(methods[0].embedding, methods[1].embedding) <= 1e-10
    z = pooled_z(dm.train_features)
    regions = SMALL["levels"] + 1
    exact = torch.quantile(z, torch.arange(1, regions, dtype=torch.float64) / regions, dim=0).T  # (d, T)
    assert float((methods[0].feature_cuts - exact).abs().max()) <= 16 / 512  # one bin of the histogram
    shares = torch.stack([(methods[0].regions(dm.train_features) == r).double().mean(0) for r in range(regions)])
    assert float((shares - 1 / regions).abs().max()) <= 0.02  # equally likely regions, feature by feature


@pytest.mark.parametrize("solver", ["dense", "cg"])
def test_gamma_out_is_chosen_on_the_holdouts_and_refit_on_every_row(fit_method, solver):
    dm = data(partition="dirichlet", alpha=0.3, num_clients=8)
    grid = [0.01, 1.0, 100.0, 10000.0]
    method = SAFLe(gamma_grid=grid, gamma=1.0, solver=solver, cg_tolerance=1e-12, **SMALL)
    engine = fit_method(method, dm)
    assert engine.fit_metrics["comm/rounds"] == method.num_rounds == 2
    # the same choice from the definition: centralized ridge on the rows the clients kept
    from workbench.methods.ridge_selection import client_holdout
    held = client_holdout(dm.train_labels, dm.train_client_ids, torch.unique(dm.train_client_ids), 0.1, 0)
    phi = dense_phi(reference_indices(method, per_sample_z(dm.train_features)), method.embedding_rows)
    onehot_y = torch.nn.functional.one_hot(dm.train_labels, dm.num_classes).double()
    eye = torch.eye(phi.shape[1], dtype=phi.dtype)
    scores = []
    for value in grid:
        kept = torch.linalg.solve(phi[~held].T @ phi[~held] + value * eye, phi[~held].T @ onehot_y[~held])
        scores.append(float(((phi[held] @ kept).argmax(1) == dm.train_labels[held]).double().mean()))
    chosen = grid[max(range(len(grid)), key=lambda i: (scores[i], -i))]
    assert float(method.selected_gamma_out) == chosen == engine.fit_metrics["safle/gamma"]
    assert torch.allclose(method.holdout_accuracy, torch.tensor(scores, dtype=torch.float64))
    assert len(set(scores)) > 1  # the grid matters on this data
    final = torch.linalg.solve(phi.T @ phi + chosen * eye, phi.T @ onehot_y)
    assert relative_error(method.embedding, final) <= 1e-6


@pytest.mark.parametrize("bad, match", [
    (dict(solver="lsqr"), "solver"),
    (dict(solver="cg", raw_features=True), "raw_features"),
    (dict(gamma_grid=[1.0, 0.0]), "gamma_grid"),
    (dict(gamma_grid=[]), "gamma_grid"),
    (dict(holdout_fraction=1.0), "holdout_fraction"),
    (dict(experts=4096, group_size=6), "solver 'cg'"),
])
def test_bad_scale_settings_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        SAFLe(**bad)


def test_multi_hot_ridge_solves_every_column_with_its_own_ridge_and_from_a_warm_start():
    from workbench.linalg import MultiHotDesign, multi_hot_ridge
    generator = torch.Generator().manual_seed(0)
    active = torch.randint(0, 7, (200, 5), generator=generator) + 7 * torch.arange(5)  # slot j in block j
    rhs = torch.randn(35, 6, generator=generator, dtype=torch.float64)
    shifts = torch.tensor([0.1, 1.0, 10.0, 0.1, 1.0, 10.0], dtype=torch.float64)
    design = MultiHotDesign(active, 35)
    solution, iterations = multi_hot_ridge(design, rhs, shifts, tolerance=1e-13)
    gram = multi_hot_gram(active, 35)
    for c in range(6):
        exact = torch.linalg.solve(gram + shifts[c] * torch.eye(35, dtype=torch.float64), rhs[:, c])
        assert relative_error(solution[:, c], exact) <= 1e-10
    assert 0 < iterations <= 35 + 5  # CG: at most the size, up to rounding
    assert multi_hot_ridge(design, rhs, shifts, tolerance=1e-10, initial=solution)[1] == 0  # already solved
    with pytest.raises(ValueError, match="ridge > 0"):
        multi_hot_ridge(design, rhs, torch.zeros(6, dtype=torch.float64))


def test_a_fit_resumed_between_the_solve_and_select_rounds_says_what_is_lost():
    dm = data(partition="dirichlet", alpha=0.3, num_clients=4)
    method = set_up(SAFLe(gamma_grid=[0.01, 1.0], gamma=1.0, **SMALL), dm)
    clients = local_clients(method, dm)
    upload, _ = clients.half.client_update(0, method.broadcast(), clients.data)
    method.finish_round(upload, 4)  # the solve round, then "interrupted"
    assert method.round_kinds[method.round] == "select"
    resumed = set_up(SAFLe(gamma_grid=[0.01, 1.0], gamma=1.0, **SMALL), dm)
    resumed.load_state_dict(method.state_dict())
    with pytest.raises(RuntimeError, match=r"resumed between its solve and select rounds.*fit afresh"):
        resumed.broadcast()
