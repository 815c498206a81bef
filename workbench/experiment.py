"""An experiment from a config: method, data and engine, built and run the same way by the
command line (`workbench.cli`) and by the deployed Flower ServerApp (`workbench.engines.flower`).

`python -m workbench fit|validate|test --config configs/X.yaml`: the method (`model:`, its server
half; the client half is built from it) and the data module (`data:`) are chosen by `class_path`
(a short class name such as `AFL` works) with their `init_args`; `federation:` holds the protocol
and `--engine` the engine (`lightning`: in process, or several processes with
`--trainer.strategy=ddp`; `flower`: a Flower ServerApp and ClientApps). The method runs inside
`workbench.engines.LightningEngine`. A fit also tests the fitted model and prints a summary. Logs
go to `<run_dir>/<run_name>/version_N/` as CSV, and to Weights & Biases (offline when no API key
is configured).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from workbench.data import FederatedDataModule
from workbench.engines import LightningEngine
from workbench.federation import Federation
from workbench.methods import FederatedMethod
from workbench.runlog import log_hparams, make_loggers, print_summary


class WorkbenchCLI(LightningCLI):
    """LightningCLI whose `model:` is a `FederatedMethod` (not a LightningModule): the engine,
    a LightningModule, is built around it from `federation:` and `--engine`."""

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_subclass_arguments(FederatedMethod, "model", fail_untyped=False, required=True)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)

    def instantiate_classes(self) -> None:
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.method = self._get(self.config_init, "model")
        self.model = LightningEngine(self.method, self._get(self.config_init, "federation"))
        self.trainer = self.instantiate_trainer()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_dir", default="runs", help="folder that holds every run's logs")
        parser.add_argument("--run_name", default=None, help="default: <method>-<dataset>-<partition>-K<K>")
        parser.add_argument("--wandb", default="auto", choices=["auto", "online", "offline", "disabled"],
                            help="W&B mode; auto = online when an API key is configured, else offline")
        parser.add_argument("--wandb_project", default="workbench")
        parser.add_argument("--engine", default="lightning", choices=["lightning", "flower"],
                            help="who runs a fit's rounds: lightning (in this process) or flower (a Flower "
                                 "ServerApp and ClientApps, simulated locally on Ray; pip install -e '.[flower]')")
        parser.add_argument("--federation", type=Federation, default=Federation(),
                            help="protocol settings: dropout, secure_aggregation, fixed_point_bits, dp_sigma, seed")

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        if config.get("max_epochs") is None:  # one epoch is one round
            kwargs["max_epochs"] = max(self.method.num_rounds, 1)
        if config.get("strategy") == "ddp":  # Lightning's DDP, splitting clients instead of samples
            from workbench.engines.ddp import FederatedDDPStrategy

            kwargs["strategy"] = FederatedDDPStrategy()
        if config.get("logger") in (None, True):
            loggers = make_loggers(self.method, self.datamodule, run_dir=self._get(self.config, "run_dir"),
                                   run_name=self._get(self.config, "run_name"),
                                   wandb_mode=self._get(self.config, "wandb"),
                                   wandb_project=self._get(self.config, "wandb_project"))
            kwargs["logger"] = loggers
            kwargs.setdefault("default_root_dir", loggers[0].log_dir)
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule)

    def before_test(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule)

    def before_validate(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule)
        if self.datamodule.hparams.val_fraction == 0:
            raise ValueError("there is no validation split to validate on: set data.val_fraction "
                             "(e.g. 0.1) to hold out part of the training pool, or run `test`")

    def fit(self, model, datamodule=None, **kwargs) -> None:
        """The rounds run in this process (Lightning's loop) or over Flower (`--engine flower`)."""
        if self._get(self.config, "engine") != "flower":
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
            return
        from workbench.engines.flower import simulation  # an optional extra: its import says how to install it

        if kwargs.get("ckpt_path") is not None:
            raise ValueError("the Flower engine fits a fresh model: drop ckpt_path")
        traffic = simulation.fit(self.trainer, model, datamodule)
        print(f"Flower carried {traffic.bytes_up / 1e6:,.3f} MB up, {traffic.bytes_down / 1e6:,.3f} MB down "
              f"(serialized arrays); {traffic.wall_s:.1f} s with its start-up")

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        # Analytic fits take no optimizer steps, so Lightning's step-based checkpointing never
        # fires: the fitted model is saved here, for `test --ckpt_path`.
        checkpoint = Path(self.trainer.log_dir) / "model.ckpt"
        self.trainer.save_checkpoint(checkpoint)
        if self._get(self.config, "engine") != "flower":  # over Flower the test ran with the clients
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        # Every process takes part (reading trainer.log_dir is a collective); only rank 0 prints.
        quiet = contextlib.nullcontext() if self.trainer.is_global_zero else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            print_summary(self.trainer, self.model, checkpoint)


def run(args: list[str] | None = None) -> WorkbenchCLI:
    """Parse `args` (default: the command line) and run the subcommand; returns the finished CLI
    (`.method`, `.model` the engine, `.datamodule`, `.trainer`)."""
    # An analytic method has no optimizer by design; Lightning's notice about it is noise here.
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers",
                   ".*no `val_dataloader`", ".*smaller than the logging interval"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "Tip:" not in record.getMessage())  # advertisements for Lightning's cloud
    os.environ.setdefault("WANDB_SILENT", "true")
    return WorkbenchCLI(
        LightningEngine, FederatedDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"num_sanity_val_steps": 0, "enable_model_summary": False,
                          "enable_checkpointing": False},
        args=args,
    )



