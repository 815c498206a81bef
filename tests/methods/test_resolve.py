"""A fitted model solved again at another value of a server setting (`FederatedMethod.resolve`)
is the model a fit at that value gives: what lets a leaderboard's γ grid cost one fit."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.methods import AFL, GHOFL, AnaPFL, Fed3R, FedAvg
from workbench.methods.ghofl import FisherSynthesis, ProtoHyperTraining, TrainingSchedule

pytestmark = pytest.mark.usefixtures("one_thread")
BLOBS = SyntheticBlobs(num_classes=4, dim=6, train_size=600, test_size=200, separation=2.0, seed=5)
QUICK = {"synthesis": FisherSynthesis(per_class=60), "fishermix": TrainingSchedule(epochs=2, lr=0.1, batch_size=100),
         "proto_hyper": ProtoHyperTraining(epochs=2, lr=0.05, batch_size=100)}


@pytest.fixture(scope="module")
def data() -> FederatedDataModule:
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=6, alpha=0.3, min_partition_size=1)
    dm.setup()
    return dm


def model(method) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in method.state_dict().items()}


@pytest.mark.parametrize(("build", "setting", "first", "other"), [
    (lambda value: AFL(gamma=1.0, gamma_out=value), "gamma_out", 0.01, 10.0),
    (lambda value: AFL(gamma=0.5, gamma_out=value, bias=True), "gamma_out", 3.0, 0.0),
    (lambda value: Fed3R(ridge=value, random_features=16), "ridge", 0.01, 1.0),
    (lambda value: GHOFL(shrinkage=value, **QUICK), "shrinkage", 0.05, 0.5),
    (lambda value: GHOFL(heads=["fedcgs"], fedcgs_ridge=value), "fedcgs_ridge", 0.0, 0.1),
], ids=["afl", "afl-bias-to-least-squares", "fed3r-rf", "ghofl-every-head", "fedcgs"])
def test_a_fit_solved_again_is_the_fit_at_the_new_value(fit_method, data, build, setting, first, other):
    resolved, direct = build(first), build(other)
    fit_method(resolved, data)
    fit_method(direct, data)
    before = model(resolved)
    resolved.resolve(**{setting: other})
    after, expected = model(resolved), model(direct)
    assert after.keys() == expected.keys()
    moved = [name for name in after if not torch.equal(after[name], before[name])]
    assert moved, "nothing was solved again"
    for name, value in expected.items():
        assert relative_error(after[name], value) <= 1e-10, name
    assert resolved.hparams[setting] == other  # a checkpoint of it says what it is
    x = data.test_features
    assert torch.equal(resolved(x).argmax(1), direct(x).argmax(1))


def test_only_server_settings_of_a_fitted_model_can_be_solved_again(fit_method, data):
    afl = AFL(gamma_out=1.0)
    with pytest.raises(RuntimeError, match="not fitted"):
        afl.resolve(gamma_out=2.0)
    fit_method(afl, data)
    with pytest.raises(ValueError, match=r"cannot resolve \['gamma'\].*resolves: gamma_out"):
        afl.resolve(gamma=2.0)  # each client adds its γ: the clients read it
    with pytest.raises(ValueError, match="gamma_out must be ≥ 0"):
        afl.resolve(gamma_out=-1.0)
    fed3r = Fed3R(ridge=0.01)
    fit_method(fed3r, data)
    with pytest.raises(ValueError, match="ridge must be > 0"):
        fed3r.resolve(ridge=0.0)  # as a fit refuses it
    chosen = AFL(gamma_grid=[0.1, 1.0])
    fit_method(chosen, data)
    with pytest.raises(ValueError, match="chosen on the clients' hold-outs"):
        chosen.resolve(gamma_out=3.0)
    for method, setting in ((AnaPFL(hidden_dim=8, lambdas=[0.5]), "gamma_out"),
                            (FedAvg(num_rounds=1, hidden_dim=4), "lr")):
        fit_method(method, data)
        with pytest.raises(ValueError, match="settings it resolves: none"):
            method.resolve(**{setting: 1.0})
