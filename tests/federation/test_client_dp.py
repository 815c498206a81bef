"""Client-level DP (clipping, noise, accounting, budget) and the protocol's cohort sampling."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import ROOT, InterruptAfter
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.client_step import client_step
from workbench.federation.local_training import LocalTraining
from workbench.federation.privacy import (
    WITHIN_CLIP,
    ClientLevelDP,
    gaussian_epsilon,
    gaussian_statistics_epsilon,
    ridge_sensitivity,
)
from workbench.methods import AFL, SCAFFOLD, DeepAFL, FedAvg, FedProx
from workbench.methods.base import Cohort

pytestmark = pytest.mark.usefixtures("one_thread")
dp_accounting = pytest.importorskip("dp_accounting", reason="pip install dp-accounting")

BLOBS = SyntheticBlobs(num_classes=4, dim=16, train_size=600, test_size=200, seed=2)


def data(num_clients: int = 20) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=num_clients, partition="iid",
                             batch_size=256)
    dm.setup()
    return dm


def rdp_epsilon(event, rounds: int, delta: float, relation: str = "ADD_OR_REMOVE_ONE") -> float:
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=getattr(dp_accounting.NeighboringRelation, relation))
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


# ---- accounting ----------------------------------------------------------------------------------
def test_epsilon_of_a_known_configuration_equals_the_accountants():
    gaussian = dp_accounting.GaussianDpEvent
    poisson = ClientLevelDP(Federation(sample_rate=0.1, sampling="poisson", dp_clip=1.0, dp_noise_multiplier=1.1,
                                       dp_delta=1e-5), population=1000)
    expected = rdp_epsilon(dp_accounting.PoissonSampledDpEvent(0.1, gaussian(1.1)), 50, 1e-5)
    assert poisson.epsilon(50) == pytest.approx(expected, rel=1e-12)
    assert 1 < expected < 10 and poisson.epsilon(0) == 0 and poisson.epsilon(10) < poisson.epsilon(50)
    # a fixed cohort of 100: sampling without replacement, replace-one, the sum moves by ≤ 2C
    fixed = ClientLevelDP(Federation(sample_rate=0.1, dp_clip=1.0, dp_noise_multiplier=1.1), population=1000)
    expected = rdp_epsilon(dp_accounting.SampledWithoutReplacementDpEvent(1000, 100, gaussian(0.55)), 50, 1e-5,
                           "REPLACE_ONE")
    assert fixed.epsilon(50) == pytest.approx(expected, rel=1e-12)
    # adaptive clipping: the noised count is a second Gaussian on the same cohort
    adaptive = ClientLevelDP(Federation(sample_rate=0.1, sampling="poisson", dp_clip=1.0, dp_noise_multiplier=1.1,
                                        dp_clip_quantile=0.5), population=1000)
    assert adaptive.count_stddev == 5.0  # E[m] / 20
    combined = (1.1 ** -2 + 5.0 ** -2) ** -0.5
    expected = rdp_epsilon(dp_accounting.PoissonSampledDpEvent(0.1, gaussian(combined)), 50, 1e-5)
    assert adaptive.epsilon(50) == pytest.approx(expected, rel=1e-12) and adaptive.epsilon(50) > poisson.epsilon(50)
    full = ClientLevelDP(Federation(dp_clip=1.0, dp_noise_multiplier=2.0), population=20)  # everyone, every round
    assert full.epsilon(4) == pytest.approx(rdp_epsilon(dp_accounting.PoissonSampledDpEvent(1.0, gaussian(2.0)), 4,
                                                        1e-5), rel=1e-12)
    assert ClientLevelDP(Federation(dp_clip=1.0), population=10).epsilon(3) == math.inf  # clipping, no noise


def test_composed_noisy_statistics_equal_the_pld_accountants_epsilon():
    from dp_accounting.pld import pld_privacy_accountant

    protocol, rounds = Federation(dp_sigma=6.0, feature_clip=1.0), 5
    multiplier = 6.0 / ridge_sensitivity(1.0)
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(multiplier), rounds)
    epsilon = gaussian_statistics_epsilon(AFL(), protocol, rounds)
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert gaussian_statistics_epsilon(AFL(), protocol, 1) == gaussian_epsilon(6.0, ridge_sensitivity(1.0))
    expected = gaussian_epsilon(6.0, ridge_sensitivity(2 ** 0.5))
    assert gaussian_statistics_epsilon(AFL(bias=True), protocol, 1) == expected
    assert gaussian_statistics_epsilon(AFL(), Federation(dp_sigma=6.0), 1) is None  # no bound enforced: no claim


# ---- clipping ------------------------------------------------------------------------------------
def client_updates(method, clip: float, num_clients: int = 6) -> tuple[dict, list[dict]]:
    """One round of the protocol's client step on fresh client halves under the clip norm: the
    cohort's uploads and each client's alone (fresh halves: SCAFFOLD's clients keep state)."""
    from workbench.methods.base import Problem

    dm = data(num_clients)
    method.setup(Problem((BLOBS.dim,), BLOBS.num_classes, num_clients))
    cohort = Cohort(dm.train_features, dm.train_labels, dm.train_client_ids, torch.arange(num_clients),
                    torch.arange(len(dm.train_labels)))
    broadcast = {"seed": torch.tensor(0)}

    def update(part: Cohort) -> dict:
        half = method.client_half()
        half.setup_clients(torch.arange(num_clients), len(dm.train_labels))
        return client_step(half, method.uploads, 0, broadcast, part, clip_norm=clip).uploads

    return update(cohort), [update(cohort.of(torch.tensor([k]))) for k in range(num_clients)]


@pytest.mark.parametrize("method", [cls(architecture="linear", local=LocalTraining(lr=0.5))
                                    for cls in (FedAvg, FedProx, SCAFFOLD)], ids=lambda m: type(m).__name__)
def test_clipping_bounds_every_clients_contribution(method):
    clip = 0.05  # far below these updates' norms: every client is clipped
    together, alone = client_updates(method, clip)
    names = [name for name in together if name != WITHIN_CLIP]
    for upload in alone:
        norm = torch.cat([upload[name].reshape(-1) for name in names]).norm()  # SCAFFOLD: (Δy, Δc) jointly
        assert norm == pytest.approx(clip, rel=1e-5) and float(upload[WITHIN_CLIP]) == 0
    for name in names:  # the cohort's sum is the sum of the clipped clients
        assert torch.allclose(together[name], sum(upload[name] for upload in alone), atol=1e-6)
    loose, _ = client_updates(method, 1e6)  # no clipping: all within, the plain update
    assert float(loose[WITHIN_CLIP]) == 6


# ---- noise ---------------------------------------------------------------------------------------
def test_the_server_adds_gaussian_noise_of_std_z_times_c():
    protocol = Federation(dp_clip=0.5, dp_noise_multiplier=2.0, seed=3)
    dp = ClientLevelDP(protocol, population=10)
    total = {"update": torch.zeros(40_000), WITHIN_CLIP: torch.tensor(4.0)}
    noisy, metrics = dp.privatize(total, protocol.generator(0, 1))
    noise = noisy["update"].double()
    assert WITHIN_CLIP not in noisy and metrics["privacy/clip_norm"] == 0.5
    assert abs(float(noise.std()) - 1.0) < 0.02 and abs(float(noise.mean())) < 0.02  # 40,000 draws of N(0, 1)
    # normal quantiles: P(|x| > 1.96) = 0.05 (± 4 standard errors)
    assert abs(float((noise.abs() > 1.96).double().mean()) - 0.05) < 4 * (0.05 * 0.95 / 40_000) ** 0.5


def test_a_dp_fit_moves_the_model_by_the_clipped_mean_plus_its_noise(fit_method):
    dm = data()
    runs = {}
    for z in (0.0, 3.0):
        method = FedAvg(num_rounds=1, architecture="mlp", hidden_dim=64, local=LocalTraining(lr=0.1))
        engine = fit_method(method, dm, Federation(dp_clip=0.2, dp_noise_multiplier=z, seed=5))
        runs[z] = (method.flat_parameters().double(), engine.fit_metrics)
    difference = runs[3.0][0] - runs[0.0][0]  # the noise / m, alone
    assert abs(float(difference.std()) / (3.0 * 0.2 / 20) - 1) < 0.1  # 1,348 parameters
    assert runs[3.0][1]["privacy/epsilon"] == ClientLevelDP(Federation(dp_clip=0.2, dp_noise_multiplier=3.0),
                                                            20).epsilon(1)
    assert runs[0.0][1]["privacy/epsilon"] == math.inf


def test_adaptive_clipping_steps_geometrically_towards_the_quantile():
    protocol = Federation(dp_clip=1.0, dp_clip_quantile=0.5, dp_clip_lr=0.2, dp_count_stddev=1e-9)
    dp = ClientLevelDP(protocol, population=10)
    generator = protocol.generator(0, 1)
    dp.privatize({"update": torch.zeros(3), WITHIN_CLIP: torch.tensor(10.0)}, generator)  # all within: shrink
    assert dp.clip_norm == pytest.approx(math.exp(-0.2 * 0.5))
    dp.privatize({"update": torch.zeros(3), WITHIN_CLIP: torch.tensor(0.0)}, generator)  # none within: grow
    assert dp.clip_norm == pytest.approx(1.0)


def test_adaptive_clipping_in_a_fit_finds_the_median_update_norm(fit_method):
    dm = data()
    method = FedAvg(num_rounds=30, architecture="linear", local=LocalTraining(lr=0.2))
    engine = fit_method(method, dm, Federation(dp_clip=100.0, dp_clip_quantile=0.5, dp_clip_lr=1.0,
                                               dp_count_stddev=1e-6))
    metrics = engine.fit_metrics  # the last round's: from C = 100 (every client within) to the median
    assert metrics["privacy/clip_norm"] < 1.0 and 0.2 <= metrics["privacy/within_clip_fraction"] <= 0.8


def test_clipping_composes_with_secure_aggregation(fit_method):
    dm = data(8)
    protocol = dict(dp_clip=0.1, dp_noise_multiplier=1.0, dp_clip_quantile=0.5, seed=2)
    plain, masked = FedAvg(num_rounds=2, architecture="linear"), FedAvg(num_rounds=2, architecture="linear")
    fit_method(plain, dm, Federation(**protocol))
    engine = fit_method(masked, dm, Federation(**protocol, secure_aggregation=True))
    assert torch.allclose(plain.flat_parameters(), masked.flat_parameters(), atol=1e-6)
    assert engine.fit_metrics["privacy/clip_norm"] != 0.1  # the masked count moved C


# ---- budget --------------------------------------------------------------------------------------
def test_a_run_over_its_privacy_budget_is_refused_before_its_first_round(fit_method):
    dm = data()
    protocol = dict(dp_clip=1.0, dp_noise_multiplier=0.8, sample_rate=0.5, sampling="poisson")
    spent = ClientLevelDP(Federation(**protocol), 20).epsilon(3)
    method = FedAvg(num_rounds=3, architecture="linear")
    with pytest.raises(ValueError, match=r"ε = .* over the budget federation\.target_epsilon = .*raise the noise"):
        fit_method(method, dm, Federation(**protocol, target_epsilon=0.9 * spent))
    assert method.round == 0  # refused before any round
    engine = fit_method(FedAvg(num_rounds=3, architecture="linear"), dm,
                        Federation(**protocol, target_epsilon=1.1 * spent))
    assert engine.fit_metrics["privacy/epsilon"] == spent
    with pytest.raises(ValueError, match="over the budget"):  # noisy statistics too
        fit_method(AFL(gamma_out=100.0), dm, Federation(dp_sigma=1.0, feature_clip=1.0, target_epsilon=1.0))


@pytest.mark.parametrize("activation, sampled", [("gelu", False), ("tanh", True)])
def test_deepafl_states_a_sensitivity_that_every_sample_respects(fit_method, activation, sampled):
    """With ‖Ω_t‖₂ ≤ c, what one sample adds to any fused round's uploads is within the stated Δ,
    whatever the feature scale (no feature clipping); ε composes the T + 1 rounds."""
    dm = data(num_clients=6)
    dm.train_features.mul_(50)  # far beyond any clip: layer 0's tanh bounds Φ₀ anyway
    method = DeepAFL(num_layers=3, hidden_dim=12, block_dim=10, activation=activation, gamma_s=1.0,
                     omega_norm=0.5, seed=1)
    federation = Federation(dp_sigma=1e-3, sample_rate=0.5 if sampled else 1.0, seed=3)
    engine = fit_method(method, dm, federation)
    sensitivity = method.statistics_sensitivity(0.0)
    assert engine.fit_metrics["privacy/epsilon"] == pytest.approx(
        gaussian_epsilon(1e-3 / math.sqrt(method.num_rounds), sensitivity), rel=1e-12)
    assert all(torch.linalg.matrix_norm(omega, 2) <= 0.5 * (1 + 1e-12) for omega in method.omega)
    assert (torch.linalg.matrix_norm(method.omega, 2) > 0.4).any()  # the bound was reached: it binds
    phi = method.input_features(dm.train_features)
    worst = (phi.norm(dim=1) ** 4 + phi.norm(dim=1) ** 2).max()
    for layer in range(1, method.num_layers + 1):
        hidden = method.block_features(phi, layer)
        f, p = hidden.norm(dim=1), phi.norm(dim=1)
        added = f ** 4 + f ** 2 + (p * f) ** 2 + ((p ** 4 + p ** 2) if sampled else 0)  # ffᵀ, f yᵀ, φfᵀ (φφᵀ, φyᵀ)
        worst = max(worst, added.max())
        phi = method.next_features(phi, layer)
    assert float(worst.sqrt()) <= sensitivity
    with pytest.raises(ValueError, match="over the budget"):  # and a budget below it is refused up front
        fit_method(DeepAFL(num_layers=3, hidden_dim=12, block_dim=10, omega_norm=0.5), dm,
                   Federation(dp_sigma=1e-3, target_epsilon=1.0))


def test_deepafl_states_no_sensitivity_without_a_bound_on_omega():
    from workbench.methods.base import Problem

    for method in (DeepAFL(num_layers=2, hidden_dim=8, block_dim=8),
                   DeepAFL(num_layers=2, hidden_dim=8, block_dim=8, omega_norm=1.0, schedule="two_round")):
        method.setup(Problem((4,), 3, 2))
        assert method.statistics_sensitivity(1.0) is None
    with pytest.raises(ValueError, match="omega_norm must be > 0"):
        DeepAFL(omega_norm=0.0)


def test_bad_privacy_settings_name_their_fix(fit_method):
    with pytest.raises(ValueError, match=r"set federation.dp_clip > 0"):
        Federation(dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="needs a noised protocol"):
        Federation(target_epsilon=1.0)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        Federation(sample_rate=0.0)
    with pytest.raises(ValueError, match=r"set federation.dp_clip=0"):
        fit_method(AFL(), data(), Federation(dp_clip=1.0))
    with pytest.raises(ValueError, match="sample_fraction=1"):
        fit_method(FedAvg(num_rounds=1, sample_fraction=0.5), data(), Federation(sample_rate=0.5))


# ---- feature clipping -----------------------------------------------------------------------------
def test_feature_clipping_bounds_the_rows_the_statistics_are_made_of(fit_method):
    dm = data()
    method = AFL(gamma_out=1.0)
    fit_method(method, dm, Federation(feature_clip=0.5))
    x = dm.train_features.double()
    x = x * (0.5 / x.norm(dim=1, keepdim=True)).clamp(max=1)
    assert float(dm.train_features.norm(dim=1).min()) > 0.5  # every row was clipped
    assert torch.allclose(method.pooled_gram, x.T @ x, atol=1e-6)
    engine = fit_method(AFL(gamma_out=20.0), dm, Federation(feature_clip=0.5, dp_sigma=2.0))
    assert engine.fit_metrics["privacy/epsilon"] == gaussian_epsilon(2.0, ridge_sensitivity(0.5))
    # the model is scored on inputs clipped as the clients' were (a bias makes the scale matter)
    method = AFL(gamma_out=1.0, bias=True)
    engine = fit_method(method, dm, Federation(feature_clip=0.5))
    tested = engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"]
    clipped = dm.test_features * (0.5 / dm.test_features.norm(dim=1, keepdim=True)).clamp(max=1)
    assert tested == pytest.approx(float((method(clipped).argmax(1) == dm.test_labels).double().mean()), abs=1e-9)


# ---- cohort sampling ------------------------------------------------------------------------------
def test_cohorts_are_seeded_per_round_fixed_or_poisson():
    available = torch.arange(0, 2000, 2)
    fixed = Federation(sample_rate=0.1, seed=1)
    first, again, later = (fixed.sampled_clients(r, available) for r in (0, 0, 1))
    assert len(first) == 100 and torch.equal(first, again) and not torch.equal(first, later)
    assert torch.isin(first, available).all() and torch.equal(first, first.sort().values)
    poisson = Federation(sample_rate=0.1, sampling="poisson", seed=1)
    sizes = torch.tensor([len(poisson.sampled_clients(r, available)) for r in range(50)], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 100) < 4 * (1000 * 0.1 * 0.9 / 50) ** 0.5 and sizes.std() > 0
    assert Federation().sampled_clients(0, available) is available


@pytest.mark.parametrize("method", [FedAvg(num_rounds=2, architecture="linear"),
                                    SCAFFOLD(num_rounds=2, architecture="linear")], ids=lambda m: type(m).__name__)
def test_a_fit_runs_each_round_on_the_protocols_cohort(fit_method, method):
    engine = fit_method(method, data(), Federation(sample_rate=0.25, seed=4))
    assert engine.fit_metrics["comm/clients_in_round"] == 5


def test_a_resumed_dp_fit_continues_with_its_adaptive_clip_norm(tmp_path):
    from lightning import Trainer

    from workbench.engines import LightningEngine

    dm, protocol = data(), Federation(dp_clip=1.0, dp_noise_multiplier=0.5, dp_clip_quantile=0.5, seed=3)

    def trainer(*callbacks, **settings) -> Trainer:
        return Trainer(callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
                       num_sanity_val_steps=0, default_root_dir=tmp_path, **settings)

    straight = LightningEngine(FedAvg(num_rounds=4, architecture="linear"), protocol)
    trainer(enable_checkpointing=False).fit(straight, datamodule=dm)
    first = LightningEngine(FedAvg(num_rounds=4, architecture="linear"), protocol)
    stopped = trainer(InterruptAfter(2), enable_checkpointing=False)
    stopped.fit(first, datamodule=dm)
    stopped.save_checkpoint(tmp_path / "round2.ckpt")
    resumed = LightningEngine(FedAvg(num_rounds=4, architecture="linear"), protocol)
    trainer(enable_checkpointing=False).fit(resumed, datamodule=dm, ckpt_path=tmp_path / "round2.ckpt",
                                               weights_only=False)  # our own file: it holds the data settings
    assert resumed.fit_metrics["privacy/clip_norm"] == straight.fit_metrics["privacy/clip_norm"] != 1.0
    assert torch.equal(resumed.method.flat_parameters(), straight.method.flat_parameters())
    assert resumed.fit_metrics["privacy/epsilon"] == straight.fit_metrics["privacy/epsilon"]


def test_the_run_summary_states_the_privacy_spent(tmp_path, capsys):

    from workbench.__main__ import main

    config = ROOT / "configs/synthetic_afl.yaml"
    status = main(["fit", f"--config={config}", "--model=FedAvg", "--model.num_rounds=2", "--federation.dp_clip=1",
                   "--federation.dp_noise_multiplier=1", "--federation.sample_rate=0.5",
                   "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}", "--wandb=disabled"])
    out = capsys.readouterr().out
    assert status == 0 and "privacy           ε = " in out and "at δ = 1e-05" in out
