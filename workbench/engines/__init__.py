"""Engines: how a method's rounds run and where its messages travel, a layer above the methods.

- `round.run_round`: one round as a plain function (method, transport and protocol in, a
  `RoundResult` out), over any `round.Transport`;
- `lightning.LightningEngine`: in process (one Lightning epoch per round; logging, timing,
  checkpoints); `ddp`: the same over several processes, whole clients per process;
- `flower`: the same rounds over a Flower ServerApp and ClientApps (the `flower` extra).
"""
from workbench.engines.ddp import FederatedDDPStrategy
from workbench.engines.lightning import LightningEngine

__all__ = ["FederatedDDPStrategy", "LightningEngine"]
