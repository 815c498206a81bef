"""The methods × engines conformance matrix: what every engine must reproduce.

Each entry builds a method on tiny data; every engine must end with the same global model
(analytic methods ≤ 1e-8 in float64, gradient methods with the same seeds ≤ 1e-6), the same
`comm/bytes_up` / `comm/bytes_down`, and, for personalized methods, the same local accuracies.
Run as a script (`python tests/engines/conformance.py OUT_DIR`) it fits every method on two CPU
processes (Lightning's DDP) and saves the models and metrics to OUT_DIR: Lightning's launcher
starts the second process by running this script again.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation
from workbench.federation.compression import Compression
from workbench.federation.local_training import LocalTraining
from workbench.methods import (
    AFL,
    GHOFL,
    OSFED,
    SCAFFOLD,
    AnaPFL,
    DeepAFL,
    Ditto,
    Fed3R,
    FedAvg,
    FedAvgM,
    FedNCM,
    FedProx,
    LocalOnly,
    SAFLe,
)
from workbench.methods.analytic_start import AnalyticStart
from workbench.methods.osfed import Snapshot

BLOBS = SyntheticBlobs(num_classes=4, dim=8, train_size=480, test_size=120, seed=7)
GRADIENT = dict(num_rounds=3, architecture="mlp", hidden_dim=8, seed=3, local=LocalTraining(lr=0.1, batch_size=16))

# name -> (a fresh method, tolerance of its final model)
METHODS = {
    "AFL": (lambda: AFL(gamma=1.0, gamma_out=0.1), 1e-8),
    "Fed3R": (lambda: Fed3R(ridge=0.1), 1e-8),
    "Fed3R-RF": (lambda: Fed3R(ridge=0.1, random_features=16, seed=4), 1e-8),  # the seed broadcast
    "FedNCM": (lambda: FedNCM(temperature=2.0), 1e-8),
    "DeepAFL": (lambda: DeepAFL(num_layers=2, hidden_dim=16, block_dim=12, seed=1, schedule="two_round"), 1e-8),
    # restating every round, as over Flower (whose clients may go missing) it does unasked
    "DeepAFL-fused": (lambda: DeepAFL(num_layers=2, hidden_dim=16, block_dim=12, seed=1, schedule="fused",
                                      restate=True), 1e-8),
    "SAFLe": (lambda: SAFLe(levels=2, group_size=2, experts=16, thresholds="calibrated"), 1e-8),
    "GHOFL": (lambda: GHOFL(heads=["nb_diag", "lda", "qda", "fedcgs"]), 1e-8),
    "AnaPFL": (lambda: AnaPFL(hidden_dim=16, lambdas=[0.0, 0.5, 1.0]), 1e-8),
    "LocalOnly": (lambda: LocalOnly(), 1e-8),
    "FedAvg": (lambda: FedAvg(sample_fraction=0.67, **GRADIENT), 1e-6),  # its updates compressed (`OWN_PROTOCOL`)
    "FedProx": (lambda: FedProx(mu=0.5, **GRADIENT), 1e-6),
    # the analytic start: AFL's head and its temperature on the hold-outs, two rounds before FedAvg's
    "AFL+FedAvg": (lambda: FedAvg(**GRADIENT, init_from=AnalyticStart(
        method="AFL", settings={"gamma_out": 0.5, "bias": True}, temperatures=(0.25, 0.5, 1.0))), 1e-6),
    "FedAvgM": (lambda: FedAvgM(server_momentum=0.9, server_lr=0.5, **GRADIENT), 1e-6),
    "Ditto": (lambda: Ditto(lam=0.5, **GRADIENT), 1e-6),
    # float32 L-BFGS line searches amplify the last-bit differences of batched and one-client
    # arithmetic: measured 1.05e-6 after 3 rounds
    "OSFED": (lambda: OSFED(**GRADIENT, snapshot=Snapshot(grid_size=1, lbfgs_steps=3)), 1e-5),
    "SCAFFOLD": (lambda: SCAFFOLD(sample_fraction=0.67, **GRADIENT), 1e-6),
    # a trainable tail (data.trainable_tail): the synthetic data's seeded tail and a linear head, its
    # parameters in every update
    "FedAvg-tail": (lambda: FedAvg(**{**GRADIENT, "architecture": "tail"}), 1e-6),
}
#: rows whose data differ from `data()`'s: their extra data settings
DATA = {"FedAvg-tail": {"trainable_tail": 1}}
# the protocol's parts each method supports (secure aggregation and noise need summed uploads)
PROTOCOLS = {
    "dropout": Federation(dropout=0.34, seed=2),
    "secure": Federation(secure_aggregation=True, seed=2),
    "dp": Federation(dp_sigma=1e-3, seed=2),
    # client-level DP: per-client clipping (adaptive, from the noised count of clients within C) and noise
    "client_dp": Federation(dp_clip=0.05, dp_noise_multiplier=0.5, dp_clip_quantile=0.5, seed=2),
    # a cohort of 2 of the 3 clients each round: a client must catch up on what it missed
    "sampled": Federation(sample_rate=0.67, seed=2),
}


#: rows run under a protocol of their own: FedAvg's updates top-k compressed with error feedback
#: (each client's residual is client state), with every part of `PROTOCOLS` but secure aggregation's
#: masks (which a compressed message gains nothing under: refused)
OWN_PROTOCOL = {"FedAvg": Federation(compression=Compression("topk", topk_fraction=0.3))}


def protocol_of(name: str, protocol: str | None = None) -> Federation | None:
    """Row `name`'s federation under the matrix's `protocol` (None: the row's own only)."""
    own = OWN_PROTOCOL.get(name)
    if protocol is None:
        return own
    chosen = PROTOCOLS[protocol]
    if own is None or chosen.secure_aggregation:
        return chosen
    return replace(chosen, compression=own.compression, error_feedback=own.error_feedback)


def supports(name: str, protocol: str) -> bool:
    if protocol in ("dp", "client_dp") and name == "AFL+FedAvg":
        return False  # the start's statistics have no DP accounting: refused with a clear error
    if protocol == "client_dp":
        return METHODS[name][0]().clips_updates  # clients that upload summed updates
    if protocol == "sampled":  # methods that sample with their own sample_fraction refuse a second sampler
        return name != "LocalOnly" and getattr(METHODS[name][0](), "sample_fraction", 1.0) == 1.0
    if protocol in ("secure", "dp"):
        return name != "OSFED"  # stacked snapshots: refused with a clear error (tested elsewhere)
    return name != "LocalOnly"  # no round to drop out of


def data(num_clients: int = 3, name: str | None = None) -> FederatedDataModule:
    """The matrix's data; for row `name` with its `DATA` settings."""
    dm = FederatedDataModule(dataset="synthetic", synthetic=BLOBS, num_clients=num_clients, partition="dirichlet",
                             alpha=0.5, min_partition_size=10, batch_size=64, personalized=True,
                             local_test_fraction=0.25, **DATA.get(name or "", {}))
    dm.setup()
    return dm


def comparable_state(method) -> dict[str, torch.Tensor]:
    """The global model's floating-point state."""
    return {name: value.detach().cpu() for name, value in method.state_dict().items() if value.is_floating_point()}


def ddp_main(out_dir: str) -> None:
    from lightning import Trainer

    from workbench.engines import FederatedDDPStrategy, LightningEngine
    from workbench.engines.ddp import end_processes

    torch.set_num_threads(1)
    for name, (build, _) in METHODS.items():
        method = build()
        engine = LightningEngine(method, protocol_of(name))
        trainer = Trainer(strategy=FederatedDDPStrategy(), devices=2,
                          accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
        dm = data(name=name)
        trainer.fit(engine, datamodule=dm)
        tested = trainer.test(engine, datamodule=dm, verbose=False)
        if trainer.is_global_zero:
            torch.save({"state": comparable_state(method), "metrics": dict(engine.fit_metrics),
                        "tested": tested, "curve": engine.curve}, Path(out_dir) / f"{name}.pt")
    end_processes()


if __name__ == "__main__":
    ddp_main(sys.argv[1])
