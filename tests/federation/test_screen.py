"""The screen (`federation.aggregation: screen`): each client's Grams checked — positive
semidefinite, their trace per row within a factor of the median client's — before the statistics
are summed; with nobody rejected it is the plain sum, and the rejected count as dropped."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import fit
from tests.engines.conformance import comparable_state
from tests.federation.test_adversaries import one_round, statistics
from tests.federation.test_systems import data, rounds
from workbench.engines.local import LocalClients
from workbench.engines.round import FitProtocol, run_round
from workbench.federation import Federation
from workbench.federation.screen import ROWS, decide, valid_gram
from workbench.federation.stages import EveryClientRejected
from workbench.methods import AFL, GHOFL, AnaPFL, DeepAFL, FedAvg, FedNCM, Problem
from workbench.methods.base import GRAM, SUMMED

pytestmark = pytest.mark.usefixtures("one_thread")

SCREEN = Federation(aggregation="screen")


def test_an_honest_gram_is_valid_and_a_negated_or_scaled_negative_one_is_not():
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 40, generator=generator, dtype=torch.float64) + 3.0  # fewer rows than features
    gram = wide.T @ wide
    assert valid_gram(gram) and valid_gram(gram.float()) and valid_gram(torch.zeros(40, 40))
    tall = torch.randn(20000, 64, generator=generator) + 1.0  # float32 rounding over many rows
    assert valid_gram(tall.T @ tall)
    assert not valid_gram(-gram) and not valid_gram(-0.1 * gram)
    per_class = torch.stack([gram, torch.zeros(40, 40), 2 * gram])  # a class the client lacks is a zero block
    assert valid_gram(per_class) and not valid_gram(torch.stack([gram, -gram]))
    isotropic = torch.eye(40, dtype=torch.float64)  # the flip hardest to see: every eigenvalue equal
    assert valid_gram(isotropic) and not valid_gram(-isotropic)


def test_the_trace_per_row_is_checked_against_the_median_client():
    generator = torch.Generator().manual_seed(1)
    rows = torch.tensor([10, 20, 40, 80, 160, 30])
    grams = []
    for n in rows.tolist():
        x = torch.randn(n, 6, generator=generator, dtype=torch.float64)
        grams.append(x.T @ x)
    grams = torch.stack(grams)
    spec = {"gram": GRAM, "cross": SUMMED}
    uploads = {"gram": grams, "cross": torch.zeros(6, 6, 3), ROWS: rows}
    nobody = torch.zeros(6, dtype=torch.bool)
    assert decide(uploads, spec, 4.0, nobody).kept.all()  # clients of 10 to 160 rows alike
    scaled = grams.clone()
    scaled[1] *= 5.0
    scaled[4] *= 0.2
    scaled[5] *= -1.0
    decision = decide({**uploads, "gram": scaled}, spec, 4.0, nobody)
    assert decision.kept.tolist() == [True, False, True, True, False, False]
    assert decision.out_of_scale.tolist() == [False, True, False, False, True, False]
    assert decision.invalid.tolist() == [False] * 5 + [True]
    assert decide({**uploads, "gram": scaled}, spec, 6.0, nobody).kept.tolist() == [True] * 5 + [False]  # looser
    barred = decide(uploads, spec, 4.0, torch.tensor([False, False, True, False, False, False]))
    assert barred.kept.tolist() == [True, True, False, True, True, True] and barred.barred[2]


def deepafl(**settings):
    return DeepAFL(num_layers=2, hidden_dim=16, block_dim=16, **settings)


@pytest.mark.parametrize("method, restated", [
    (lambda: AFL(gamma=1.0), None), (lambda: GHOFL(heads=["lda"], primary_head="lda"), None),
    # who takes part may vary under the screen, so DeepAFL restates: the bytes of restate=true
    (deepafl, lambda: deepafl(restate=True))])
def test_with_no_attacker_the_screen_rejects_nobody_and_equals_the_plain_sum(method, restated):
    dm = data(8)
    plain, screened = fit(method(), dm, Federation()), fit(method(), dm, SCREEN)
    for (name, a), b in zip(comparable_state(plain.method).items(), comparable_state(screened.method).values(),
                            strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), name  # (summed in another order)
    sent = (fit(restated(), dm, Federation()) if restated else plain).fit_metrics["comm/bytes_up"]
    # one row count (8 bytes) per client and round more; nobody rejected
    assert screened.fit_metrics["comm/bytes_up"] == sent + 8 * 8 * screened.method.round
    assert screened.fit_metrics["comm/clients_in_round"] == 8


@pytest.mark.parametrize("attack, scale", [("sign_flip", 1.0), ("scale", -10.0), ("scale", 10.0)])
def test_liars_are_rejected_and_the_round_is_exactly_the_honest_clients(attack, scale):
    dm = data(10)
    federation = Federation(adversary_fraction=0.3, attack=attack, attack_scale=scale, aggregation="screen", seed=1)
    liars = torch.nonzero(federation.adversaries(10)).flatten().tolist()
    honest = [k for k in range(10) if k not in liars]
    result = one_round(AFL(gamma=1.0), dm, federation)
    assert result.survivors.tolist() == honest and sorted(result.lost.tolist()) == liars
    expected = statistics(dm, honest)
    for name in ("gram", "cross"):
        assert torch.allclose(result.uploads[name], expected[name], rtol=1e-12, atol=1e-9), name
    assert result.metrics["screen/rejected"] == 3 and result.metrics["attack/adversaries_rejected"] == 3
    assert result.metrics["attack/adversaries_in_round"] == 0 and result.metrics["comm/clients_in_round"] == 7


@pytest.mark.parametrize("method", [lambda: AFL(gamma=1.0, gamma_grid=[0.01, 1.0, 100.0]),
                                    lambda: AnaPFL(hidden_dim=16)])
def test_a_rejected_client_stays_out_of_the_rounds_that_send_no_gram(method):
    """AFL's γ scoring round and AnaPFL's λ round carry no Gram to check: the liars rejected in the
    first round stay out of them (they once sent negative hold-out counts into the sum)."""
    dm = data(10)
    federation = Federation(adversary_fraction=0.2, attack="scale", attack_scale=-10.0, aggregation="screen", seed=0)
    results, _ = rounds(method(), dm, None, federation, count=2)
    assert [r.metrics["attack/adversaries_in_round"] for r in results] == [0.0, 0.0]
    assert results[0].screened_out == torch.nonzero(federation.adversaries(10)).flatten().tolist()
    assert results[1].screened_out == [] and results[1].metrics["screen/rejected"] == 2


def test_a_resumed_fit_keeps_its_rejected_clients_out():
    dm = data(6)
    method = AFL(gamma=1.0)
    method.setup(Problem.of(dm.population()))
    available = torch.unique(dm.train_client_ids)
    clients = LocalClients(method, dm.train_features, dm.train_labels, dm.train_client_ids, available, 64, SCREEN)
    protocol = FitProtocol.start(method, SCREEN, len(available), rejected=[1, 4])
    result = run_round(method, clients, protocol, available)
    assert result.survivors.tolist() == [0, 2, 3, 5] and result.screened_out == []
    assert torch.allclose(result.uploads["gram"], statistics(dm, [0, 2, 3, 5])["gram"], rtol=1e-12, atol=1e-9)


def test_a_round_with_every_client_rejected_is_one_line_and_a_lone_client_is_warned_of():
    dm = data(6)
    liars = Federation(adversary_fraction=0.5, attack="sign_flip", aggregation="screen", sample_rate=0.2, seed=3)
    assert liars.adversaries(6)[liars.sampled_clients(0, torch.arange(6))].all()  # the round's one client lies
    with pytest.warns(UserWarning, match="a round here keeps about 1"), \
            pytest.raises(EveryClientRejected, match="1 sent a Gram that is not positive semidefinite"):
        rounds(AFL(gamma=1.0), dm, None, liars)


def test_flipped_labels_pass_the_screen():
    """What the screen cannot see: a Gram does not depend on the labels (docs/robustness.md)."""
    dm = data(10)
    federation = Federation(adversary_fraction=0.3, attack="label_flip", aggregation="screen", seed=1)
    result = one_round(AFL(gamma=1.0), dm, federation)
    assert result.metrics["screen/rejected"] == 0 and result.metrics["attack/adversaries_in_round"] == 3


@pytest.mark.filterwarnings("ignore:DeepAFL's Gram matrix")  # (the undefended fit's poisoned Gram)
def test_a_multi_round_method_drops_the_liars_every_round_and_keeps_its_accuracy():
    dm = data(10)
    federation = Federation(adversary_fraction=0.2, attack="scale", attack_scale=-10.0, aggregation="screen", seed=0)
    results, _ = rounds(deepafl(), dm, None, federation, count=3)
    assert [r.metrics["attack/adversaries_rejected"] for r in results] == [2.0, 2.0, 2.0]
    honest = fit(deepafl(), dm, Federation())
    defended = fit(deepafl(), dm, federation)
    attacked = fit(deepafl(), dm,
                   Federation(adversary_fraction=0.2, attack="scale", attack_scale=-10.0, seed=0))
    rejected = 2.0 * defended.method.round  # the fit's totals: both liars, every round
    assert defended.fit_metrics["screen/rejected_total"] == defended.fit_metrics["attack/adversaries_rejected_total"] \
        == rejected
    honest_acc, defended_acc, attacked_acc = (engine.trainer.test(engine, datamodule=dm, verbose=False)[0]["test/acc"]
                                              for engine in (honest, defended, attacked))
    assert defended_acc > honest_acc - 0.05 and attacked_acc < defended_acc - 0.2, (honest_acc, defended_acc,
                                                                                      attacked_acc)


def test_the_screen_is_refused_where_it_cannot_check():
    dm = data(6)
    with pytest.raises(ValueError, match="FedAvg sends model updates: use median"):
        fit(FedAvg(num_rounds=1, architecture="linear"), dm, SCREEN)
    with pytest.raises(ValueError, match="FedNCM sends no Gram to check"):
        fit(FedNCM(), dm, SCREEN)
    with pytest.raises(ValueError, match="FedNCM sends no Gram to check"):  # without an engine, by run_round alone
        rounds(FedNCM(), dm, None, SCREEN)
    with pytest.raises(ValueError, match="secure aggregation shows the server only their sum"):
        Federation(aggregation="screen", secure_aggregation=True)
    with pytest.raises(ValueError, match="aggregation_threshold must be > 1"):
        Federation(aggregation="screen", aggregation_threshold=1.0)
    with pytest.raises(ValueError, match=r"which dp_sigma's accounting .* does not cover"):
        Federation(aggregation="screen", dp_sigma=1.0, feature_clip=1.0)
