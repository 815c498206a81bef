"""Local differential privacy as a stage of one's own: each client noises its statistics before
they leave it — the documented draws and nothing else, per client under secure aggregation, the
per-client ε logged, AFL's failed solve naming the sum's noise, and what it cannot run with
refused before any work."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import last_run, metrics
from tests.federation.test_stages import run
from tests.federation.test_systems import data
from tests.test_cli import TINY
from workbench.cli import main
from workbench.engines.round import FitProtocol
from workbench.federation import Federation
from workbench.federation.local_noise import LOCAL_NOISE_STREAM, LocalNoise
from workbench.federation.privacy import add_gaussian_noise, clip_features, gaussian_epsilon
from workbench.methods import AFL, OSFED, FedAvg, Problem
from workbench.methods.base import Cohort

pytestmark = pytest.mark.usefixtures("one_thread")
CLIP, SIGMA = 1.0, 0.3


def exact(dm, clients: list[int]) -> dict[str, torch.Tensor]:
    """AFL's uploads of `clients` on rows clipped to norm `CLIP`, computed together, noiseless."""
    method = AFL(gamma=1.0)
    method.setup(Problem.of(dm.population()))
    mine = torch.isin(dm.train_client_ids, torch.tensor(clients))
    half = method.client_half()
    half.setup_clients(torch.tensor(clients), int(mine.sum()))
    uploads, _ = half.client_update(0, {}, Cohort(clip_features(dm.train_features[mine], CLIP), dm.train_labels[mine],
                                                  dm.train_client_ids[mine], torch.tensor(clients),
                                                  torch.arange(int(mine.sum()))))
    return uploads


def draw(like: dict[str, torch.Tensor], sigma: float, seed: int, first_client: int) -> dict[str, torch.Tensor]:
    """The documented noise of one message: N(0, σ²) from (seed, round 0, the stream, its first client)."""
    state = np.random.SeedSequence([seed, 0, LOCAL_NOISE_STREAM, first_client]).generate_state(1, np.uint64)[0]
    zeros = {name: torch.zeros_like(value) for name, value in like.items()}
    return add_gaussian_noise(zeros, sigma, torch.Generator().manual_seed(int(state)), symmetric={"gram"})


def test_clients_computed_together_send_their_sum_with_one_draw_of_the_sums_noise():
    dm = data(6)
    (result,) = run(AFL(gamma=1.0, gamma_out=10.0), dm, Federation(feature_clip=CLIP), [LocalNoise(SIGMA, seed=3)])
    honest = exact(dm, list(range(6)))
    noise = draw(honest, SIGMA * math.sqrt(6), seed=3, first_client=0)
    for name in ("gram", "cross"):
        assert torch.allclose(result.uploads[name] - honest[name], noise[name], atol=1e-9), name
    assert torch.equal(result.uploads["gram"], result.uploads["gram"].T)  # symmetric noise on the Gram


def test_without_a_seed_of_its_own_the_noise_follows_the_federations_seed():
    dm = data(4)
    honest = exact(dm, list(range(4)))
    for seed in (5, 6):
        (result,) = run(AFL(gamma=1.0, gamma_out=10.0), dm, Federation(feature_clip=CLIP, seed=seed),
                        [LocalNoise(SIGMA)])
        noise = draw(honest, SIGMA * 2.0, seed=seed, first_client=0)
        assert torch.allclose(result.uploads["cross"] - honest["cross"], noise["cross"], atol=1e-9)


def test_under_secure_aggregation_each_client_noises_its_own_before_it_masks():
    dm = data(5)
    federation = Federation(feature_clip=CLIP, secure_aggregation=True)
    (result,) = run(AFL(gamma=1.0, gamma_out=10.0), dm, federation, [LocalNoise(SIGMA, seed=3)])
    honest = exact(dm, list(range(5)))
    noises = [draw(honest, SIGMA, seed=3, first_client=k) for k in range(5)]
    for name in ("gram", "cross"):
        total = sum(noise[name] for noise in noises)
        assert torch.allclose(result.uploads[name] - honest[name], total, atol=1e-7), name  # (fixed-point rounding)


def test_each_round_logs_the_per_client_epsilon_of_its_uploads():
    dm = data(4)
    method = AFL(gamma=1.0, gamma_out=10.0)
    (result,) = run(method, dm, Federation(feature_clip=CLIP, dp_delta=1e-6), [LocalNoise(SIGMA)])
    epsilon = gaussian_epsilon(SIGMA, method.statistics_sensitivity(CLIP), 1e-6)
    assert result.metrics["privacy/local_epsilon"] == pytest.approx(epsilon, rel=1e-12)
    assert "privacy/epsilon" not in result.metrics  # no server noise, no central ε


def test_afl_names_the_ridge_that_outweighs_the_sums_noise():
    dm = data(6)
    with pytest.raises(ValueError, match=r"indefinite.*σ = 2449\.49 on the sum.*gamma_out ≥"):
        run(AFL(gamma=1.0, gamma_out=0.0), dm, Federation(feature_clip=CLIP), [LocalNoise(1000.0)])


def test_what_local_noise_cannot_run_with_is_refused_before_any_work():
    noise = [LocalNoise(SIGMA)]
    with pytest.raises(ValueError, match=r"FedAvg sends model updates: use client-level DP"):
        fedavg = FedAvg(architecture="linear")
        fedavg.setup(Problem((6,), 4, 5))
        FitProtocol.check(fedavg, Federation(), 5, stages=noise)
    afl = AFL()
    afl.setup(Problem((6,), 4, 5))
    with pytest.raises(ValueError, match=r"each upload apart \(federation.aggregation=screen\).*aggregation=mean"):
        FitProtocol.check(afl, Federation(feature_clip=CLIP, aggregation="screen"), 5, stages=noise)
    with pytest.raises(ValueError, match=r"LocalNoise runs on the clients, and a remote transport's nodes"):
        FitProtocol.check(afl, Federation(), 5, remote=True, stages=noise)
    osfed = OSFED(num_rounds=1, architecture="linear")
    osfed.setup(Problem((6,), 4, 5))
    with pytest.raises(ValueError, match=r"OSFED sends per-client uploads"):
        FitProtocol.check(osfed, Federation(), 5, stages=noise)
    with pytest.warns(UserWarning, match=r"no stated sensitivity here \(set federation.feature_clip"):
        FitProtocol.check(afl, Federation(), 5, stages=noise)
    with pytest.raises(ValueError, match=r"sigma must be > 0"):
        LocalNoise(0.0)


def test_a_config_adds_the_stage_and_the_summary_names_it_and_its_epsilon(tmp_path, capsys):
    config = tmp_path / "stages.yaml"
    config.write_text("stages:\n  - class_path: workbench.federation.local_noise.LocalNoise\n"
                      "    init_args: {sigma: 0.5}\n")
    main(["fit", *TINY, "--config", str(config), f"--run_dir={tmp_path}", "--federation.feature_clip=1",
          "--model.gamma_out=100"])
    out = capsys.readouterr().out
    assert "protocol          clip rows to norm 1 → each client noises its statistics, σ = 0.5" in out
    logged = metrics(last_run(tmp_path))
    hparams = yaml.safe_load((last_run(tmp_path) / "hparams.yaml").read_text())  # the pipeline in order
    assert hparams["protocol"] == ["clip rows to norm 1", "each client noises its statistics, σ = 0.5"]
    assert hparams["stages"] == [{"stage": "workbench.federation.local_noise.LocalNoise",
                                  "settings": {"sigma": 0.5, "seed": None}}]
    assert f"local privacy     ε = {logged['privacy/local_epsilon']:.3g} at δ = 1e-05 for each client's own" in out
    assert logged["test/acc"] > 0.5
