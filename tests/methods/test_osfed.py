"""OS-FED: snapshot fits, the multi-grid function, error feedback, the server's recovery, bytes."""

from __future__ import annotations

import csv
import itertools
from functools import partial

import pytest
import torch

from tests.methods.conftest import fake_images  # a tiny image dataset
from workbench.cli import main
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.engines.local import LocalClients
from workbench.federation import codec
from workbench.federation.compression import ErrorFeedback
from workbench.federation.local_training import LocalTraining, lbfgs, local_sgd
from workbench.methods import OSFED, Cohort, Problem
from workbench.methods.osfed import OSFEDClient, Snapshot, multi_grid

pytestmark = pytest.mark.usefixtures("one_thread")
BLOBS = SyntheticBlobs(num_classes=4, dim=8, train_size=400, test_size=200, seed=0)


def prepared(grid_size: int = 2, num_clients: int = 4, lbfgs_steps: int = 30, diagnostics: bool = False,
             error_feedback: ErrorFeedback = ErrorFeedback(),
             dtype: torch.dtype = torch.float64) -> tuple[OSFEDClient, Cohort]:
    """An OS-FED client half serving every client of tiny blobs, in float64 (or `dtype`), and the
    whole training set as its cohort (every client has data: slot k is client k)."""
    dm = FederatedDataModule(
        dataset="synthetic",
        synthetic=BLOBS,
        num_clients=num_clients,
        partition="dirichlet",
        alpha=0.5,
        min_partition_size=5,
    )
    dm.setup()
    method = OSFED(architecture="mlp", hidden_dim=8, diagnostics=diagnostics, error_feedback=error_feedback,
                   snapshot=Snapshot(grid_size=grid_size, lbfgs_steps=lbfgs_steps),
                   local=LocalTraining(lr=0.1, batch_size=16))
    method.setup(Problem(tuple(dm.input_shape), dm.num_classes, num_clients))
    clients = LocalClients(method, dm.train_features.to(dtype), dm.train_labels, dm.train_client_ids,
                           torch.unique(dm.train_client_ids), batch_size=1 << 14)
    assert torch.equal(clients.served, torch.arange(num_clients))
    return clients.half.to(dtype), clients.data


def local_updates(method: OSFEDClient, batch: Cohort, clients: torch.Tensor) -> torch.Tensor:
    """Δw = w_t − w_k after 2 local epochs: (m, P)."""
    trained = local_sgd(
        method.net,
        batch.features,
        batch.labels,
        batch.client_ids,
        clients,
        epochs=2,
        lr=0.1,
        batch_size=16,
        seed=0,
    )
    return method.flat.vector() - method.flat.flatten(trained)


def recovered(method, snapshot: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each client's g(S) alone: (m, ...) -> (m, P)."""
    params = method.parameters_now()
    return torch.stack(
        [
            method.synthetic_gradient(params, one, its_labels)
            for one, its_labels in zip(snapshot, labels, strict=True)
        ]
    )


CLIENTS = torch.tensor([0, 1, 3])


def test_the_snapshot_matches_better_than_a_random_one_and_better_with_more_steps():
    method, batch = prepared()
    targets = local_updates(method, batch, CLIENTS)
    start = method.initial_snapshots(0, batch.of(CLIENTS))
    random_labels = torch.randn(
        3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    g = recovered(method, start, random_labels)
    best_scale = (g * targets).sum(1) / (g * g).sum(1)  # a random snapshot at its best label scale
    random_loss = method.matching_loss(start, random_labels * best_scale[:, None, None], targets)
    losses = [method.fit_snapshots(targets, start, steps=steps)[3] for steps in (0, 3, 10, 40)]
    for fewer, more in itertools.pairwise(losses):
        assert (more <= fewer + 1e-12).all()
    assert (losses[-1] < 0.5 * random_loss).all()
    assert (losses[-1] < 0.8 * losses[0]).all()  # the start (correlated labels) is already good


def test_the_returned_loss_labels_and_gradient_agree():
    method, batch = prepared()
    targets = local_updates(method, batch, CLIENTS)
    snapshot, labels, gradient, loss = method.fit_snapshots(
        targets, method.initial_snapshots(0, batch.of(CLIENTS)), steps=5
    )
    torch.testing.assert_close(
        gradient, recovered(method, snapshot, labels)
    )  # labels carry the scale α
    torch.testing.assert_close(loss, method.matching_loss(snapshot, labels, targets))


def test_more_grid_cells_never_match_worse():
    """Proposition 1: M = 2 contains M = 1 (its cells can repeat the M = 1 sample): the minimum
    loss can only drop."""
    coarse, batch = prepared(grid_size=1)
    fine, _ = prepared(grid_size=2)
    targets = local_updates(coarse, batch, CLIENTS)
    one, one_labels, _, one_loss = coarse.fit_snapshots(
        targets, coarse.initial_snapshots(0, batch.of(CLIENTS)), steps=30
    )
    repeated, repeated_labels = one.repeat(1, 4, 1), one_labels.repeat(1, 4, 1)
    torch.testing.assert_close(fine.matching_loss(repeated, repeated_labels, targets), one_loss)
    _, _, _, refined = fine.fit_snapshots(targets, repeated, repeated_labels, steps=30)
    assert (refined <= one_loss + 1e-12).all()
    _, _, _, alone = fine.fit_snapshots(targets, fine.initial_snapshots(0, batch.of(CLIENTS)), steps=30)
    assert alone.mean() <= one_loss.mean()  # and from its own random start


def test_multi_grid_cuts_cells_in_row_major_order_and_upsamples_each():
    cells = torch.arange(4.0).reshape(2, 2)
    grid_map = cells.repeat_interleave(3, 0).repeat_interleave(3, 1)[None]  # (1, 6, 6)
    samples = multi_grid(grid_map, 2, (12, 12))
    assert samples.shape == (4, 1, 12, 12)
    for cell in range(4):
        assert torch.allclose(samples[cell], torch.full((1, 12, 12), float(cell)))
    image = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(
        multi_grid(image, 1, (8, 8)), image[:, None]
    )  # M = 1, R = H: the image
    tiled = image.repeat(1, 1, 2, 2)  # M = 2 on a tiled map repeats the M = 1 sample
    torch.testing.assert_close(multi_grid(tiled, 2, (8, 8)), image[:, None].expand(2, 4, 3, 8, 8))


def test_error_feedback_carries_exactly_target_minus_recovered():
    method, batch = prepared()
    updates = local_updates(method, batch, CLIENTS)
    carried = torch.randn(
        4, updates.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    method.feedback.residuals.write(torch.arange(4), 0.1 * carried)
    method.lbfgs_steps = 5
    uploads, metrics = method.encode(0, batch.of(CLIENTS), updates)
    sent = recovered(
        method, uploads["snapshot_inputs"].double(), uploads["snapshot_labels"].double()
    )
    expected = updates + 0.1 * carried[CLIENTS] - sent
    torch.testing.assert_close(method.feedback.residual(CLIENTS), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(method.feedback.residual(torch.tensor([2]))[0], 0.1 * carried[2])  # not sampled: kept
    # metric sums over the clients (the engine reports their mean)
    assert metrics["osfed/residual_norm"] == pytest.approx(float(expected.norm(dim=1).sum()), rel=1e-12)
    assert uploads["snapshot_inputs"].shape[0] == uploads["snapshot_labels"].shape[0] == 3  # stacked
    assert (
        uploads["snapshot_inputs"].dtype == uploads["snapshot_labels"].dtype == torch.float32
    )  # as sent


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_the_servers_batched_recovery_is_the_mean_of_each_clients_gradient(architecture):
    method = OSFED(architecture=architecture, hidden_dim=8, server_lr=0.5, snapshot=Snapshot(grid_size=2))
    shape = (8,) if architecture == "mlp" else (1, 8, 8)
    method.setup(Problem(shape, 3, 5))
    method.double()
    gen = torch.Generator().manual_seed(0)
    snapshots = torch.randn(5, *method.snapshot_shape, generator=gen, dtype=torch.float64)
    labels = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64)
    mean = recovered(method, snapshots, labels).mean(0)
    torch.testing.assert_close(method.recover(snapshots, labels), mean, rtol=1e-10, atol=1e-12)
    before = method.flat_parameters()
    method.server_update({"snapshot_inputs": snapshots, "snapshot_labels": labels}, 5)
    torch.testing.assert_close(
        method.flat_parameters(), before - 0.5 * mean, rtol=1e-10, atol=1e-12
    )


def test_a_cohort_call_is_the_stack_of_each_clients_call_alone():
    """Local SGD, snapshot start (per-client noise streams), fit and error feedback of a cohort are
    each client's alone: the uploads are the client-ordered stack, the metrics the sums."""
    together, batch = prepared(lbfgs_steps=6)
    alone, _ = prepared(lbfgs_steps=6)
    weights = together.flat.vector() + 0.01
    for round_index in (1, 2):  # the second round starts from error feedback
        broadcast = {"weights": weights * round_index}
        uploads, metrics = together.client_update(round_index, broadcast, batch.of(CLIENTS))
        rows = [alone.client_update(round_index, broadcast, batch.of(k[None])) for k in CLIENTS]
        for name in ("snapshot_inputs", "snapshot_labels"):
            torch.testing.assert_close(uploads[name], torch.cat([r[0][name] for r in rows]),
                                       rtol=1e-6, atol=1e-7)
        for name in ("osfed/match_loss", "osfed/residual_norm"):
            assert metrics[name] == pytest.approx(sum(r[1][name] for r in rows), rel=1e-6)
    slots = torch.arange(4)
    torch.testing.assert_close(together.feedback.residual(slots), alone.feedback.residual(slots), rtol=1e-6, atol=1e-9)
    start = together.initial_snapshots(3, batch.of(CLIENTS))
    for k, client in enumerate(CLIENTS):
        torch.testing.assert_close(start[k], together.initial_snapshots(3, batch.of(client[None]))[0],
                                   rtol=0, atol=0)
    assert not torch.equal(start, together.initial_snapshots(4, batch.of(CLIENTS)))  # redrawn each round


def test_batched_snapshot_fits_equal_each_client_fitted_alone():
    method, batch = prepared()
    targets = local_updates(method, batch, CLIENTS)
    start = method.initial_snapshots(0, batch.of(CLIENTS))
    together = method.fit_snapshots(targets, start, steps=8)
    for k in range(3):
        alone = method.fit_snapshots(targets[k : k + 1], start[k : k + 1], steps=8)
        torch.testing.assert_close(together[0][k], alone[0][0], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(together[3][k], alone[3][0], rtol=1e-7, atol=1e-12)


# ---- the batched line search: only the rows still searching ----------------------------------


def reference_lbfgs(objective, start, *, steps, history=10, max_backtracks=12, armijo=1e-4, curvature_eps=1e-10,
                    searching=None):
    """The reference: `local_training.lbfgs` as it was before its line search gathered the rows still
    searching, a faithful copy of the old loop (also what benchmarks/osfed_line_search.py times).
    Every evaluation is of all m rows (`objective(x, None)`); each backtrack re-evaluates the rows
    that already accepted a step where they stand, until the slowest accepts. `searching` (a list)
    gets each evaluation's rows whose value was needed: every row at the start, then those that
    had not accepted a step."""
    x = start.detach().clone()
    m, n = x.shape
    value, gradient = objective(x, None)
    if searching is not None:
        searching.append(torch.ones(m, dtype=torch.bool))
    s_hist = x.new_zeros(m, history, n)  # oldest ... newest along dim 1
    y_hist = x.new_zeros(m, history, n)
    rho = x.new_zeros(m, history)  # 1 / sᵀy, 0 for an empty slot
    tiny = torch.finfo(x.dtype).tiny
    for _ in range(steps):
        q = -gradient
        alphas = []
        for slot in reversed(range(history)):
            alpha = rho[:, slot] * (s_hist[:, slot] * q).sum(1)
            q = q - alpha[:, None] * y_hist[:, slot]
            alphas.append(alpha)
        newest_yy = (y_hist[:, -1] ** 2).sum(1)
        has_history = rho[:, -1] > 0
        scale = torch.where(
            has_history, 1 / (rho[:, -1] * newest_yy).clamp_min(tiny), torch.ones_like(newest_yy)
        )
        direction = q * scale[:, None]
        for slot, alpha in zip(range(history), reversed(alphas), strict=True):
            beta = rho[:, slot] * (y_hist[:, slot] * direction).sum(1)
            direction = direction + (alpha - beta)[:, None] * s_hist[:, slot]
        restart = (gradient * direction).sum(1) >= 0
        direction = torch.where(restart[:, None], -gradient, direction)
        rho = rho.masked_fill(restart[:, None], 0)
        has_history = has_history & ~restart
        slope = (gradient * direction).sum(1)
        descent = slope < 0
        step = torch.where(
            has_history,
            torch.ones_like(slope),
            (1 / gradient.abs().sum(1).clamp_min(tiny)).clamp(max=1),
        )
        accepted = ~descent
        new_x, new_value, new_gradient = x, value, gradient
        for _ in range(max_backtracks):
            trial = torch.where(accepted[:, None], new_x, x + step[:, None] * direction)
            if searching is not None:
                searching.append(~accepted)
            trial_value, trial_gradient = objective(trial, None)
            ok = ~accepted & (trial_value <= value + armijo * step * slope)
            new_x = torch.where(ok[:, None], trial, new_x)
            new_value = torch.where(ok, trial_value, new_value)
            new_gradient = torch.where(ok[:, None], trial_gradient, new_gradient)
            accepted = accepted | ok
            step = torch.where(accepted, step, step / 2)
            if bool(accepted.all()):
                break
        failed = ~accepted
        s, y = new_x - x, new_gradient - gradient
        sy = (s * y).sum(1)
        keep = accepted & descent & (sy > curvature_eps)
        s_hist = torch.where(keep[:, None, None], torch.cat([s_hist[:, 1:], s[:, None]], 1), s_hist)
        y_hist = torch.where(keep[:, None, None], torch.cat([y_hist[:, 1:], y[:, None]], 1), y_hist)
        rho = torch.where(keep[:, None], torch.cat([rho[:, 1:], (1 / sy.where(keep, 1))[:, None]], 1), rho)
        rho = rho.masked_fill(failed[:, None], 0)
        x, value, gradient = new_x, new_value, new_gradient
    return x, value


def logging_lbfgs(lbfgs_function, log):
    """`lbfgs_function` whose objective appends (x, its rows (r,), values) of every evaluation to `log`."""

    def run(objective, start, **options):
        def logged(x, rows):
            value, gradient = objective(x, rows)
            log.append((x.clone(), torch.arange(len(x)) if rows is None else rows.clone(), value.clone()))
            return value, gradient

        return lbfgs_function(logged, start, **options)

    return run


def trials_by_row(log, m, searching=None):
    """Each row's evaluations in order, (x, value) as one row each: only those `searching` marks."""
    trials = [[] for _ in range(m)]
    for index, (x, rows, value) in enumerate(log):
        for position, row in enumerate(rows.tolist()):
            if searching is None or searching[index][row]:
                trials[row].append(torch.cat([x[position], value[position : position + 1]]))
    return [torch.stack(row) for row in trials]


def cnn_client(num_clients, dtype=torch.float32):
    """A CNN client half on 1×8×8 images (2×2 snapshots of side 4) in `dtype`, random targets and starts."""
    method = OSFED(architecture="cnn", snapshot=Snapshot(grid_size=2, resolution=4, lbfgs_steps=30))
    method.setup(Problem((1, 8, 8), 3, num_clients))
    client = method.client_half().to(dtype)
    gen = torch.Generator().manual_seed(3)
    size = client.flat.vector().numel()
    targets = torch.randn(num_clients, size, generator=gen, dtype=dtype) * 1e-2
    return client, targets, torch.randn(num_clients, *client.snapshot_shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_the_line_search_evaluates_only_the_rows_still_searching(architecture, monkeypatch):
    """Each backtrack evaluates only the clients that have not accepted a step: every client's
    trial points and values (so its accepted steps and iterates) and its final snapshot are the
    reference's (to 1e-6), which re-evaluates every client until the slowest accepts. The MLP in
    float32; the CNN in float64: where the CPU's convolution kernels depend on the batch's size
    (AVX-512), float32 rounds a gathered subset differently from all rows, and 30 L-BFGS steps
    carry that far beyond 1e-6."""
    import workbench.methods.osfed as osfed

    if architecture == "mlp":
        method, batch = prepared(num_clients=8, dtype=torch.float32)
        clients = torch.arange(8)
        targets = local_updates(method, batch, clients)
        start = method.initial_snapshots(0, batch.of(clients))
    else:
        method, targets, start = cnn_client(6, torch.float64)
    m = len(targets)
    reference_log, searching, log = [], [], []
    monkeypatch.setattr(osfed, "lbfgs", logging_lbfgs(partial(reference_lbfgs, searching=searching), reference_log))
    expected = method.fit_snapshots(targets, start)
    monkeypatch.setattr(osfed, "lbfgs", logging_lbfgs(lbfgs, log))
    fitted = method.fit_snapshots(targets, start)
    for got, want in zip(fitted, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    reference_trials, trials = trials_by_row(reference_log, m, searching), trials_by_row(log, m)
    for row, (got, want) in enumerate(zip(trials, reference_trials, strict=True)):
        assert got.shape == want.shape, f"client {row}: {len(got)} evaluations, the reference's {len(want)}"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    evaluated = sum(len(rows) for _, rows, _ in log)
    assert evaluated == sum(len(row) for row in reference_trials)  # nothing but the rows still searching
    assert evaluated < 0.8 * m * len(reference_log)  # the reference evaluates every row every time


def test_uploads_are_the_snapshot_bytes_and_training_learns(fit_method):
    """On blobs where FedAvg reaches 0.96 in 6 rounds (the closed-form ridge head 0.97)."""
    dm = FederatedDataModule(
        dataset="synthetic",
        synthetic=BLOBS,
        num_clients=5,
        partition="dirichlet",
        alpha=0.5,
        min_partition_size=5,
    )
    method = OSFED(num_rounds=6, architecture="mlp", hidden_dim=8, snapshot=Snapshot(grid_size=2, lbfgs_steps=10),
                   local=LocalTraining(lr=0.1, batch_size=16))
    engine = fit_method(method, dm)
    assert (
        engine.fit_metrics["comm/bytes_up"] == 6 * 5 * 4 * (8 + 4) * 4
    )  # M²·(d + C) float32 per client
    assert 0 < engine.fit_metrics["osfed/match_loss"] < 1
    assert engine.fit_metrics["osfed/residual_norm"] > 0
    assert engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"] > 0.8


def test_cnn_snapshots_on_raw_images(add_dataset, fit_method):
    add_dataset("tiny_images", fake_images)
    dm = FederatedDataModule(dataset="tiny_images", inputs="images", num_clients=3, partition="iid")
    method = OSFED(num_rounds=2, architecture="cnn", diagnostics=True,
                   snapshot=Snapshot(grid_size=2, resolution=4, lbfgs_steps=5),
                   local=LocalTraining(lr=0.1, batch_size=8))
    engine = fit_method(method, dm)
    assert method.snapshot_shape == engine.client_half.snapshot_shape == (1, 4, 4)
    assert (
        engine.fit_metrics["comm/bytes_up"] == 2 * 3 * (1 * 4 * 4 + 4 * 3) * 4
    )  # c·R² + M²·C float32; the diagnostic upload is not counted
    assert engine.fit_metrics["osfed/match_loss"] < 1
    assert 0 < engine.fit_metrics["osfed/update_rel_error"] and -1 <= engine.fit_metrics["osfed/update_cosine"] <= 1


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="grid_size"):
        OSFED(snapshot=Snapshot(grid_size=0))
    with pytest.raises(ValueError, match=r"multiple of snapshot.grid_size"):
        OSFED(snapshot=Snapshot(grid_size=3, resolution=28))


def test_cli_logs_bytes_and_the_matching_loss_every_round(tmp_path):
    main(
        [
            "fit",
            "--model=OSFED",
            "--model.num_rounds=2",
            "--model.hidden_dim=8",
            "--model.snapshot.lbfgs_steps=5",
            "--data=FederatedDataModule",
            "--data.dataset=synthetic",
            "--data.num_clients=4",
            "--trainer.enable_progress_bar=false",
            f"--run_dir={tmp_path}",
        ]
    )
    run = max(tmp_path.glob("*/version_*"), key=lambda p: p.stat().st_mtime)
    rows = [row for row in csv.DictReader((run / "metrics.csv").open()) if row.get("comm/bytes_up")]
    per_client = 4 * (32 + 10) * 4  # M = 2: four 32-d inputs and four 10-class label embeddings
    assert [float(row["comm/bytes_up"]) for row in rows] == [4 * per_client, 8 * per_client]
    assert all(0 < float(row["osfed/match_loss"]) < 1 for row in rows)
    assert all(float(row["osfed/residual_norm"]) > 0 for row in rows)
    fitted = [row for row in csv.DictReader((run / "metrics.csv").open()) if row.get("test/acc")][
        -1
    ]
    tested = main(
        [
            "test",
            "--model=OSFED",
            "--model.num_rounds=2",
            "--model.hidden_dim=8",
            "--model.snapshot.lbfgs_steps=5",
            "--data=FederatedDataModule",
            "--data.dataset=synthetic",
            "--data.num_clients=4",
            "--trainer.enable_progress_bar=false",
            f"--run_dir={tmp_path / 'eval'}",
            f"--ckpt_path={run / 'model.ckpt'}",
        ]
    )
    assert float(tested.trainer.callback_metrics["test/acc"]) == pytest.approx(
        float(fitted["test/acc"])
    )


def test_diagnostics_compare_the_applied_update_with_fedavgs_mean_update():
    client, batch = prepared(lbfgs_steps=5, diagnostics=True)
    weights = client.flat.vector() + 0.01
    uploads, metrics = client.client_update(1, {"weights": weights}, batch.of(CLIENTS))
    fresh = weights - client.flat.flatten(client.local_sgd(1, batch.of(CLIENTS)))  # Δw_k again: (3, P)
    torch.testing.assert_close(uploads["diagnostic_update"].double(), fresh.sum(0), rtol=1e-6, atol=1e-7)
    sent = recovered(client, uploads["snapshot_inputs"].double(), uploads["snapshot_labels"].double())
    fresh_loss = ((sent - fresh) ** 2).sum(1) / ((fresh**2).sum(1) + client.match_eps)
    assert metrics["osfed/match_loss_fresh"] == pytest.approx(float(fresh_loss.sum()), rel=1e-5)
    residual = client.feedback.residual(CLIENTS)
    assert metrics["osfed/residual_ratio"] == pytest.approx(
        float((residual.norm(dim=1) / fresh.norm(dim=1)).sum()), rel=1e-5)

    server = OSFED(architecture="mlp", hidden_dim=8, diagnostics=True, snapshot=Snapshot(grid_size=2),
                   local=LocalTraining(lr=0.1, batch_size=16))
    server.setup(Problem((8,), 4, 4))
    server.double()
    server.flat.load(weights)
    applied = sent.mean(0)
    mean = uploads["diagnostic_update"].double() / 3
    logged = server.server_update(uploads, 3)
    assert logged["osfed/update_rel_error"] == pytest.approx(float((applied - mean).norm() / mean.norm()), rel=1e-5)
    assert logged["osfed/update_norm_ratio"] == pytest.approx(float(applied.norm() / mean.norm()), rel=1e-5)
    assert codec.upload_bytes(uploads, server.uploads) == 4 * 4 * (8 + 4)  # the snapshots alone
    assert "diagnostic_update" not in prepared(lbfgs_steps=1)[0].client_update(
        1, {"weights": weights}, batch.of(CLIENTS))[0]  # off by default: nothing extra on the wire


def test_bounded_error_feedback_keeps_each_residual_within_c_times_the_update():
    client, batch = prepared(lbfgs_steps=3, error_feedback=ErrorFeedback(bound=0.25))
    plain, _ = prepared(lbfgs_steps=3)
    weights = client.flat.vector()
    for round_index in (1, 2, 3):
        broadcast = {"weights": weights + 0.01 * round_index}
        _, metrics = client.client_update(round_index, broadcast, batch.of(CLIENTS))
        _, plain_metrics = plain.client_update(round_index, broadcast, batch.of(CLIENTS))
        fresh = client.flat.vector() - client.flat.flatten(client.local_sgd(round_index, batch.of(CLIENTS)))
        ratio = client.feedback.residual(CLIENTS).norm(dim=1) / fresh.norm(dim=1)
        assert (ratio <= 0.25 * (1 + 1e-9)).all()
        assert metrics["osfed/residual_ratio"] <= 3 * 0.25 * (1 + 1e-9)
    assert plain_metrics["osfed/residual_ratio"] > 3 * 0.25  # unbounded, it is larger here


def test_cells_keep_the_inputs_resolution_by_default():
    problem = Problem((1, 8, 8), 3, 2)
    for options, side in (({}, 16), ({"cell_scale": 0.5}, 8), ({"resolution": 4}, 4), ({"grid_size": 3}, 24)):
        method = OSFED(architecture="cnn", snapshot=Snapshot(**{"grid_size": 2, **options}))
        method.setup(problem)
        assert method.snapshot_shape == (1, side, side)
        cells = method.grid_size**2
        one_client = {"snapshot_inputs": torch.zeros(1, *method.snapshot_shape),
                      "snapshot_labels": torch.zeros(1, *method.label_shape)}
        assert codec.upload_bytes(one_client, method.uploads) == 4 * (side * side + cells * 3)
    with pytest.raises(ValueError, match="cell_scale"):
        OSFED(snapshot=Snapshot(cell_scale=0))
