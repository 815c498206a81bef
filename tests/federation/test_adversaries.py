"""Adversarial clients: a seeded share of the federation that lies — flipped labels, sign-flipped or
scaled uploads, noised updates — and an analytic method's aggregate is then exactly the honest
clients' statistics plus the adversaries' poisoned ones."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import fit
from tests.engines.conformance import comparable_state
from tests.federation.test_systems import data, rounds
from workbench.federation import Federation
from workbench.federation.adversaries import flip_labels, segments
from workbench.federation.stages import Outgoing, Pipeline
from workbench.methods import AFL, OSFED, FedAvg, Problem
from workbench.methods.base import MODEL_UPDATE, Cohort
from workbench.methods.osfed import Snapshot

pytestmark = pytest.mark.usefixtures("one_thread")


def one_round(method, dm, federation: Federation):
    """Round 0 of `method` by `run_round` under `federation`."""
    (result,), _ = rounds(method, dm, None, federation)
    return result


def statistics(dm, clients: list[int], flipped: bool = False) -> dict[str, torch.Tensor]:
    """AFL's uploads of `clients` computed honestly (on flipped labels if `flipped`)."""
    method = AFL(gamma=1.0)
    method.setup(Problem.of(dm.population()))
    mine = torch.isin(dm.train_client_ids, torch.tensor(clients))
    labels = dm.train_labels[mine]
    labels = flip_labels(labels, 4) if flipped else labels
    half = method.client_half()
    half.setup_clients(torch.tensor(clients), int(mine.sum()))
    uploads, _ = half.client_update(0, {}, Cohort(dm.train_features[mine], labels, dm.train_client_ids[mine],
                                                  torch.tensor(clients), torch.arange(int(mine.sum()))))
    return uploads


def test_the_adversaries_are_a_seeded_share_the_same_every_round():
    federation = Federation(adversary_fraction=0.3, seed=4)
    chosen = federation.adversaries(20)
    assert int(chosen.sum()) == 6 and torch.equal(chosen, federation.adversaries(20))
    assert not torch.equal(chosen, Federation(adversary_fraction=0.3, seed=5).adversaries(20))
    assert not Federation().adversaries(20).any()
    runs = segments(torch.arange(6), torch.tensor([False, True, True, False, False, True]))
    assert [(run.tolist(), kind) for run, kind in runs] == [([0], False), ([1, 2], True), ([3, 4], False), ([5], True)]


@pytest.mark.parametrize("attack, factor", [("sign_flip", -1.0), ("scale", 7.0)])
def test_an_analytic_aggregate_is_the_honest_statistics_plus_the_poisoned_ones(attack, factor):
    dm = data(10)
    federation = Federation(adversary_fraction=0.3, attack=attack, attack_scale=7.0, seed=1)
    liars = torch.nonzero(federation.adversaries(10)).flatten().tolist()
    honest = [k for k in range(10) if k not in liars]
    result = one_round(AFL(gamma=1.0), dm, federation)
    good, bad = statistics(dm, honest), statistics(dm, liars)
    for name in ("gram", "cross"):
        assert torch.allclose(result.uploads[name], good[name] + factor * bad[name], rtol=1e-12, atol=1e-9), name
    assert result.metrics["attack/adversaries_in_round"] == 3


def test_flipped_labels_send_the_statistics_of_flipped_labels():
    dm = data(10)
    federation = Federation(adversary_fraction=0.3, attack="label_flip", seed=1)
    liars = torch.nonzero(federation.adversaries(10)).flatten().tolist()
    honest = [k for k in range(10) if k not in liars]
    result = one_round(AFL(gamma=1.0), dm, federation)
    expected = statistics(dm, honest)["cross"] + statistics(dm, liars, flipped=True)["cross"]
    assert torch.allclose(result.uploads["cross"], expected, rtol=1e-12, atol=1e-9)
    assert torch.allclose(result.uploads["gram"], statistics(dm, list(range(10)))["gram"], rtol=1e-12, atol=1e-9)


def test_noised_updates_move_the_model_and_no_adversary_changes_nothing():
    dm = data(10)
    plain = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm, Federation())
    none = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm, Federation(attack="noise"))
    noised = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm,
                       Federation(adversary_fraction=0.2, attack="noise", attack_scale=5.0, seed=2))
    again = one_round(FedAvg(num_rounds=1, architecture="linear", seed=0), dm,
                      Federation(adversary_fraction=0.2, attack="noise", attack_scale=5.0, seed=2))
    assert torch.equal(plain.uploads["update"], none.uploads["update"])  # no adversary: the same round
    gap = (noised.uploads["update"] - plain.uploads["update"]).norm()
    assert gap > 5.0 and torch.equal(noised.uploads["update"], again.uploads["update"])  # seeded
    assert noised.bytes_up == plain.bytes_up  # lying costs no bytes


def test_stacked_uploads_stay_in_client_order():
    dm = data(6)
    federation = Federation(adversary_fraction=0.5, attack="sign_flip", seed=3)
    honest = one_round(OSFED(hidden_dim=8, snapshot=Snapshot(lbfgs_steps=2), seed=0), dm, Federation())
    lying = one_round(OSFED(hidden_dim=8, snapshot=Snapshot(lbfgs_steps=2), seed=0), dm, federation)
    liars, stacked = federation.adversaries(6), [name for name, upload in OSFED.uploads.items() if upload.stacked]
    assert stacked and 0 < int(liars.sum()) < 6
    for name in stacked:
        value = honest.uploads[name]
        assert value.shape[0] == 6, name  # a row per client
        sign = torch.where(liars, -1.0, 1.0).to(value.dtype).view(-1, *[1] * (value.dim() - 1))
        assert torch.allclose(lying.uploads[name], sign * value, rtol=1e-6, atol=1e-7), name


def test_a_fit_refuses_noise_for_a_method_without_model_updates_and_lies_otherwise():
    dm = data(10)
    with pytest.raises(ValueError, match="attack=noise noises model updates, which AFL does not send"):
        fit(AFL(), dm, Federation(adversary_fraction=0.2, attack="noise"))
    honest = fit(FedAvg(num_rounds=3, architecture="linear", seed=0), dm, Federation())
    flipped = fit(FedAvg(num_rounds=3, architecture="linear", seed=0), dm,
                  Federation(adversary_fraction=0.4, attack="sign_flip", attack_scale=1.0, seed=0))
    assert not all(torch.equal(a, b) for a, b in zip(comparable_state(honest.method).values(),
                                                     comparable_state(flipped.method).values(), strict=True))
    assert flipped.fit_metrics["comm/bytes_up"] == honest.fit_metrics["comm/bytes_up"]


@pytest.mark.parametrize("settings, message", [
    ({"adversary_fraction": 1.0}, r"adversary_fraction must be in \[0, 1\)"),
    ({"attack": "backdoor"}, "attack must be label_flip, sign_flip, scale or noise"),
    ({"attack_scale": 0.0}, "attack_scale must be nonzero"),
    ({"attack": "noise", "attack_scale": -1.0}, r"> 0 for noise"),
])
def test_bad_attack_settings_are_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        Federation(**settings)


@pytest.mark.parametrize("aggregation", ["mean", "median"])
def test_each_noising_adversary_adds_its_own_noise_of_the_stated_spread(aggregation):
    """Three adversaries computed together: summed, their noise is N(0, 3s²); one row each (robust
    aggregation), every row gets N(0, s²), not the run's."""
    federation = Federation(adversary_fraction=0.5, attack="noise", attack_scale=2.0, aggregation=aggregation)
    pipeline = Pipeline.of(federation)
    spec = {"update": MODEL_UPDATE}
    rows = {"update": torch.zeros(3, 20_000, dtype=torch.float64)}
    sent = pipeline.client_message(Outgoing(rows, spec, 0, torch.arange(3), liars=True,
                                            generator=torch.Generator().manual_seed(0)))
    spreads = sent.uploads["update"].reshape(-1 if aggregation == "mean" else 3, 20_000).std(dim=1)
    expected = 2.0 * (3 ** 0.5 if aggregation == "mean" else 1.0)
    assert torch.allclose(spreads, torch.full_like(spreads, expected), rtol=0.03)
