"""Command line: `python -m workbench fit|validate|test --config configs/X.yaml`.

(`sweep` and `compare` are dispatched before this module is imported: see `__main__.py`.)

The method (`model:`) and the data module (`data:`) are chosen by `class_path` (a short class
name such as `AFL` works) with their `init_args`. A fit also tests the fitted model and prints a
summary. Logs go to `<run_dir>/<run_name>/version_N/` as CSV, and to Weights & Biases (offline
when no API key is configured).
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from workbench.data import FederatedDataModule
from workbench.methods import FederatedMethod
from workbench.runlog import log_hparams, make_loggers, print_summary


class WorkbenchCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_dir", default="runs", help="folder that holds every run's logs")
        parser.add_argument("--run_name", default=None, help="default: <method>-<dataset>-<partition>-K<K>")
        parser.add_argument("--wandb", default="auto", choices=["auto", "online", "offline", "disabled"],
                            help="W&B mode; auto = online when an API key is configured, else offline")
        parser.add_argument("--wandb_project", default="workbench")

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        if config.get("max_epochs") is None:  # one epoch is one round
            kwargs["max_epochs"] = self.model.num_rounds
        if config.get("logger") in (None, True):
            loggers = make_loggers(self.model, self.datamodule, run_dir=self._get(self.config, "run_dir"),
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

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        # Analytic fits take no optimizer steps, so Lightning's step-based checkpointing never
        # fires: the fitted model is saved here, for `test --ckpt_path`.
        checkpoint = Path(self.trainer.log_dir) / "model.ckpt"
        self.trainer.save_checkpoint(checkpoint)
        self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        print_summary(self.trainer, self.model, checkpoint)


def main(args: list[str] | None = None) -> WorkbenchCLI:
    # An analytic method has no optimizer by design; Lightning's notice about it is noise here.
    for notice in (".*configure_optimizers.* returned `None`", ".*does not have many workers",
                   ".*no `val_dataloader`", ".*smaller than the logging interval"):
        warnings.filterwarnings("ignore", message=notice)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "Tip:" not in record.getMessage())  # advertisements for Lightning's cloud
    os.environ.setdefault("WANDB_SILENT", "true")
    return WorkbenchCLI(
        FederatedMethod, FederatedDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"num_sanity_val_steps": 0, "enable_model_summary": False,
                          "enable_checkpointing": False},
        args=args,
    )


if __name__ == "__main__":
    main()
