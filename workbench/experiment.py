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

A fit survives interruption: after every round the run folder's `last.ckpt` is replaced
atomically (`--checkpoint_every_round`); SIGINT or SIGTERM lets the round under way finish, writes
`last.ckpt` and exits non-zero; `fit --ckpt_path last` (the newest `last.ckpt` of the same run
name, or a file) continues exactly, into a new version folder, with its `comm/*` totals
continuing, and may ask for more rounds (`--model.num_rounds`). Version folders are claimed
exclusively, so concurrent runs into one `--run_dir` never share one.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from workbench import runlog
from workbench.catalog import data_classes, method_classes
from workbench.command_line import CHECKPOINT_WORDS, config_files, missing_checkpoint, usage_line, yaml_error
from workbench.console import DEBUG_ENV, condense_parse_error
from workbench.data import FederatedData
from workbench.data.sites import NOT_HERE
from workbench.engines import LightningEngine
from workbench.engines.ddp import end_processes
from workbench.engines.flower_settings import FlowerSettings
from workbench.engines.lightning import check_epoch_limit
from workbench.engines.stopping import Stopping
from workbench.federation import Federation
from workbench.federation.stages import Stage
from workbench.federation.systems import Systems
from workbench.files import NoRoom, out_of_room, remove_orphaned_temporaries, replaced_atomically, write_text_atomically
from workbench.methods import FederatedMethod
from workbench.runlog import default_run_name, finish_run, log_hparams, make_loggers, print_summary

#: test hook: `<round>` or `<round>:<SIGNAL>` sends the signal (default SIGTERM) to this process at
#: the end of that round, an interruption at a known point taking the path of a real one
SIGNAL_AFTER_ROUND_ENV = "WORKBENCH_SIGNAL_AFTER_ROUND"


class DirectCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint straight into the file it is given (`save_atomically`'s temporary):
    Lightning's own writer stages it in the system temp folder first, where a failed write left
    a copy behind for every checkpoint."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("DirectCheckpointIO takes no storage_options")
        torch.save(checkpoint, path)


def checkpoint_bytes(trainer, path: Path) -> int:
    """About what writing `path` again takes: the previous file's size, else the model's tensors."""
    if path.exists():
        return path.stat().st_size
    state = trainer.lightning_module.state_dict()
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def save_atomically(trainer, path: Path) -> None:
    """`trainer.save_checkpoint` to a temporary file renamed over `path` (`workbench.files`): a
    reader (or a crash) never sees half a checkpoint, and a full disk leaves the previous one
    whole and no temporary anywhere. Every process calls it; rank 0 writes."""
    try:
        with replaced_atomically(path) as temporary:
            trainer.save_checkpoint(temporary, weights_only=False)  # the whole state: a fit resumes from it
    except (OSError, RuntimeError) as error:
        if not out_of_room(error):
            raise
        kept = f"; the previous {path.name} is intact" if path.exists() else ""
        # the new file is written beside the old one, so its whole size must be free
        raise NoRoom(path.name, path.parent, checkpoint_bytes(trainer, path), "free some space" + kept) from None


class RoundCheckpoint(Callback):
    """Writes `<folder>/last.ckpt` (atomically) after every round (`every_round`), and turns
    SIGINT/SIGTERM into a clean stop: the round under way finishes, its checkpoint is written and
    the fit ends (`stopped_by` holds the signal; a second signal interrupts at once)."""

    def __init__(self, folder: str | Path | None = None, every_round: bool = True) -> None:
        self.folder, self.every_round = folder, every_round
        self.stopped_by: int | None = None
        self.path: Path | None = None
        self.superseded: Path | None = None  # the resumed fit's source (`retire`)
        # the handlers replaced ({signal: what `signal.signal` returned}), put back by `_restore`
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.stopped_by is not None:  # a second signal: stop now (Lightning's KeyboardInterrupt path)
            self._restore()
            raise KeyboardInterrupt
        self.stopped_by = signum
        print(f"\n{signal.Signals(signum).name}: stopping after the round under way; its checkpoint "
              "is written for `fit --ckpt_path last` (signal again to stop at once)", file=sys.stderr)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning's own handlers are set
        self.stopped_by = None
        self.path = Path(self.folder or trainer.log_dir or trainer.default_root_dir) / "last.ckpt"
        with contextlib.suppress(ValueError):  # signals can only be handled in the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        rounds_done = pl_module.method.round
        hook = os.environ.get(SIGNAL_AFTER_ROUND_ENV)
        if hook and int(hook.split(":")[0]) == rounds_done and not pl_module.method.fitted:
            name = hook.split(":")[1] if ":" in hook else "SIGTERM"
            os.kill(os.getpid(), getattr(signal, name if name.startswith("SIG") else "SIG" + name))
        if self.every_round or self.stopped_by is not None:
            assert self.path is not None  # set by on_train_start
            save_atomically(trainer, self.path)
            self.retire(trainer)
        if self.stopped_by is not None:
            trainer.should_stop = True

    def retire(self, trainer) -> None:
        """Once this fit's folder holds a checkpoint of its own, the interrupted fit's `last.ckpt`
        it resumed from is removed (rank 0), and that folder's status.json says where the fit went
        on: each resume would otherwise keep one more full checkpoint."""
        source, self.superseded = self.superseded, None
        if source is None or not trainer.is_global_zero:
            return
        source.unlink(missing_ok=True)
        status = source.parent / "status.json"
        record: dict = {}
        with contextlib.suppress(OSError, ValueError):  # how it had ended (its command) is kept
            record = json.loads(status.read_text())
        # self.path is set by on_train_start, which a fit that trains no round may skip
        record.update(status="continued", continued_in=str(self.path.parent))  # type: ignore[union-attr]
        write_text_atomically(status, json.dumps(record, indent=2) + "\n")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()


def newest_last_checkpoint(run_folder: Path, exclude: Path | None = None) -> Path:
    """The `last.ckpt` of the newest version folder under `run_folder` that holds one."""
    def number(path: Path) -> int:
        match = re.fullmatch(r"version_(\d+)", path.parent.name)
        return int(match.group(1)) if match else -1

    found = [p for p in run_folder.glob("version_*/last.ckpt")
             if exclude is None or p.parent.resolve() != exclude.resolve()]
    if not found:
        raise FileNotFoundError(f"no last.ckpt under {run_folder}/version_*: pass --ckpt_path=<file>, or "
                                "the --run_dir/--run_name of the interrupted fit")
    newest = max(found, key=number)
    remove_orphaned_temporaries(newest.parent)  # a write the interruption killed: the resume writes elsewhere
    return newest


def _describe(class_path: str) -> tuple[list[str], dict[str, str]]:
    """The settings of the class at `class_path` (its keyword names, and those its `**kwargs`
    pass on to its bases), and its settings of workbench 0.2 that moved ({old: new key})."""
    from importlib import import_module

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return [], {}
    names: list[str] = []
    for owner in inspect.getmro(cls):
        if "__init__" not in vars(owner):
            continue
        parameters = inspect.signature(vars(owner)["__init__"]).parameters.values()  # its own (checked above)
        names += [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name != "self" and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    moved = {old: new for old, new in getattr(cls, "moved_settings", {}).items()
             if ((new.split(".")[0] in names or new.startswith("federation.")) and old not in names)
             or (old in names and new.startswith(f"{old}."))}
    return names, moved


def _model_settings(args: list[str], cwd: Path) -> dict[str, object]:
    """The model settings a command line run in `cwd` gives, by top-level key: `--model.KEY=VALUE`
    flags (a nested `--model.KEY.SUB=...` gives a dict) and the keys under `model:` (or its
    `init_args:`) of its `--config` files."""
    import yaml

    given: dict[str, object] = {}
    for path in config_files(args, cwd):
        try:
            model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(model, dict):
            given.update({**model, **(model.get("init_args") or {})})
    for arg in args:
        if arg.startswith("--model."):
            key, _, value = arg[len("--model."):].removeprefix("init_args.").partition("=")
            name, _, sub = key.partition(".")
            given[name] = {sub: value} if sub else value
    return given


class WorkbenchParser(LightningArgumentParser):
    """A config error in a few lines (the valid choices, a close match, the new key of a moved
    setting) instead of every type the parser tried and the whole usage; with --debug
    (`WORKBENCH_DEBUG=1`) the parser's own report."""

    #: the command line being parsed and where (`run` sets them; the parser changes the working
    #: folder while it reads a config file): what a config error may list
    given: tuple[list[str], Path] = ([], Path())

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get(DEBUG_ENV):
            super().error(message, ex)
        command = (getattr(ex, "subcommand_parser", None) or self).prog.split()[-1]
        command = command if command in ("fit", "validate", "test") else "<command>"
        choices = {"model": [cls.__name__ for cls in method_classes()],
                   "data": [cls.__name__ for cls in data_classes()]}
        if "<unicode string>" in message:
            message = yaml_error(*WorkbenchParser.given) or message
        print(f"{usage_line(command)}\n"
              f"error: {condense_parse_error(message, choices, _describe, _model_settings(*WorkbenchParser.given))}",
              file=sys.stderr)
        raise SystemExit(2)


class WorkbenchCLI(LightningCLI):
    """LightningCLI whose `model:` is a `FederatedMethod` (not a LightningModule): the engine,
    a LightningModule, is built around it from `federation:` and `--engine`."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test (a method predicts through its `forward`, in Python)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_subclass_arguments(FederatedMethod, "model", fail_untyped=False, required=True)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)
        # `data:` is any FederatedData; without a class_path, `--data.KEY` settings are FederatedDataModule's
        parser.set_defaults({"data": {"class_path": "workbench.data.FederatedDataModule"}})

    def instantiate_classes(self) -> None:
        missing = missing_checkpoint(self._get(self.config, "ckpt_path"))
        if missing is not None:
            raise FileNotFoundError(missing)
        self.config_init = self.parser.instantiate(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.method = self._get(self.config_init, "model")
        self.model = LightningEngine(self.method, self._get(self.config_init, "federation"),
                                     eval_every=self._get(self.config, "eval_every", default=1),
                                     stopping=self._get(self.config_init, "stopping"),
                                     systems=self._get(self.config_init, "systems"),
                                     stages=self._get(self.config_init, "stages", default=[]),
                                     other_data=self._get(self.config, "other_data", default=False))
        if os.environ.get("LOCAL_RANK", "0") == "0":
            # the data first (partition, labels, features, the cache), then the method, protocol and
            # stopping rule against it: an error there stops the run before its folder and W&B run
            # exist; the other processes of a fit read the cache later
            self.datamodule.setup()
            if not (self.datamodule.learns_from_nodes and self.subcommand == "fit"):
                self.model.check_data(self.datamodule, fitting=self.subcommand == "fit")
            elif self._get(self.config, "engine") != "flower":
                raise ValueError(NOT_HERE)
            # (else cross-silo sites: checked once the fit's SuperNodes told their sizes)
            self._check_checkpoint()
        self.trainer = self.instantiate_trainer()

    def _check_checkpoint(self) -> None:
        """A checkpoint of another method, settings, data or engine is refused before the run's
        folder exists (Lightning's own load checks it again, from Python too)."""
        ckpt_path = self._get(self.config, "ckpt_path")
        if ckpt_path is None or (ckpt_path in CHECKPOINT_WORDS and ckpt_path != "last"):  # Lightning's own words
            return
        if ckpt_path == "last":
            name = self._get(self.config, "run_name") or default_run_name(self.method, self.datamodule)
            ckpt_path = newest_last_checkpoint(Path(self._get(self.config, "run_dir")) / name)
        self.model.check_checkpoint_file(ckpt_path, self.datamodule, resuming=self.subcommand == "fit",
                                         engine=self._get(self.config, "engine"))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_dir", default="runs", help="folder that holds every run's logs")
        parser.add_argument("--run_name", default=None, help="default: <method>-<dataset>-<partition>-K<K>")
        parser.add_argument("--wandb", default="auto", choices=["auto", "online", "offline", "disabled"],
                            help="W&B mode; auto = online when an API key is configured, else offline")
        parser.add_argument("--wandb_project", default="workbench")
        parser.add_argument("--engine", default="lightning", choices=["lightning", "flower"],
                            help="who runs a fit's rounds: lightning (in this process) or flower (a Flower "
                                 "ServerApp and ClientApps, simulated locally on Ray; pip install -e '.[flower]')")
        parser.add_argument("--eval_every", type=int, default=1,
                            help="the learning curve: score the global model on the test split every N rounds "
                                 "(and after the last), logged as round/test_acc with the bytes sent so far; 0: none")
        parser.add_argument("--stopping", type=Stopping, default=Stopping(),
                            help="the stopping rule: patience (rounds without a gain of more than min_delta in "
                                 "validation accuracy, then the fit stops; 0: every round), min_delta; needs "
                                 "data.val_fraction, best with data.val_split=clients")
        parser.add_argument("--systems", type=Systems, default=Systems(),
                            help="the clients' devices and links, a simulated clock (latency/round_s, "
                                 "latency/total_s) and a round deadline: preset (cellular, wifi, datacenter), "
                                 "down_mbps, up_mbps, rtt_ms, speed, spread, availability, deadline_s, over_select, "
                                 "row_s, seed")
        parser.add_argument("--other_data", type=bool, default=False,
                            help="with --ckpt_path: accept a checkpoint made under other data settings (dataset, "
                                 "partition, K, seeds, features, splits) on purpose; refused by default")
        parser.add_argument("--keep_resumed_checkpoint", type=bool, default=False,
                            help="with --ckpt_path: keep the interrupted fit's last.ckpt; by default it is removed "
                                 "once this fit has written a checkpoint of its own (its status.json names where "
                                 "the fit went on)")
        parser.add_argument("--checkpoint_every_round", type=bool, default=True,
                            help="replace the run folder's last.ckpt after every round (a fit stopped by "
                                 "SIGINT/SIGTERM writes it anyway); resume with `fit --ckpt_path last`")
        parser.add_argument("--flower", type=FlowerSettings, default=FlowerSettings(),
                            help="with --engine flower: deadline_s (seconds a round waits for its clients' replies; "
                                 "those that miss it are dropped from the round), connect_s (seconds to wait for "
                                 "every SuperNode), client_cpus (CPUs per ClientApp in a local simulation)")
        parser.add_argument("--federation", type=Federation, default=Federation(),
                            help="protocol settings: dropout, secure_aggregation, fixed_point_bits, dp_sigma, seed")
        parser.add_argument("--stages", type=list[Stage], default=[],
                            help="protocol stages of one's own, each a class_path (a Stage subclass, e.g. "
                                 "workbench.federation.local_noise.LocalNoise) with init_args, placed after the "
                                 "built-in stage it names (workbench.federation.stages)")

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        check_epoch_limit(config.get("max_epochs"), self.method.num_rounds)  # before any run folder exists
        if config.get("strategy") == "ddp":  # Lightning's DDP, splitting clients instead of samples
            from workbench.engines.ddp import FederatedDDPStrategy

            kwargs["strategy"] = FederatedDDPStrategy()
        if config.get("logger") in (None, True):
            loggers = make_loggers(self.method, self.datamodule, run_dir=self._get(self.config, "run_dir"),
                                   run_name=self._get(self.config, "run_name"),
                                   wandb_mode=self._get(self.config, "wandb"),
                                   wandb_project=self._get(self.config, "wandb_project"),
                                   engine=self._get(self.config, "engine"))
            kwargs["logger"] = loggers
            kwargs.setdefault("default_root_dir", loggers[0].log_dir)
        trainer = super().instantiate_trainer(**kwargs)
        trainer.strategy.checkpoint_io = DirectCheckpointIO()
        if self.subcommand == "fit":
            self.round_checkpoint = RoundCheckpoint(
                every_round=self._get(self.config, "checkpoint_every_round", default=True))
            trainer.callbacks.append(self.round_checkpoint)
        return trainer

    def before_fit(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule, self._get(self.config, "engine"))

    def before_test(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule, self._get(self.config, "engine"))

    def before_validate(self) -> None:
        log_hparams(self.trainer, self.model, self.datamodule, self._get(self.config, "engine"))
        if not self.datamodule.has_validation:
            raise ValueError("there is no validation split to validate on: set data.val_fraction "
                             "(e.g. 0.1) to hold out part of the training pool, or run `test`")

    def fit(self, model, datamodule=None, **kwargs) -> None:
        """The rounds run in this process (Lightning's loop) or over Flower (`--engine flower`)."""
        if kwargs.get("ckpt_path") == "last":  # the newest of this run name's interrupted fits
            log_dir = self.trainer.log_dir
            assert log_dir is not None  # the CSV logger's folder, or default_root_dir without loggers
            here = Path(log_dir)
            kwargs["ckpt_path"] = str(newest_last_checkpoint(here.parent, exclude=here))
        if kwargs.get("ckpt_path") is not None:
            kwargs.setdefault("weights_only", False)  # our own files (they hold the data's settings)
            print(f"resuming from {kwargs['ckpt_path']}", file=sys.stderr)
            source = Path(kwargs["ckpt_path"])
            if (source.name == "last.ckpt" and re.fullmatch(r"version_\d+", source.parent.name)
                    and not self._get(self.config, "keep_resumed_checkpoint", default=False)):
                self.round_checkpoint.superseded = source
        if self._get(self.config, "engine") != "flower":
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
            return
        from workbench.engines.flower import simulation  # an optional extra: its import says how to install it

        traffic = simulation.fit(self.trainer, model, datamodule, settings=self._get(self.config_init, "flower"),
                                 **kwargs)
        print(f"Flower carried {traffic.bytes_up / 1e6:,.3f} MB up, {traffic.bytes_down / 1e6:,.3f} MB down "
              f"(serialized arrays); {traffic.wall_s:.1f} s with its start-up")

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        stopper = getattr(self, "round_checkpoint", None)
        if stopper is not None and stopper.stopped_by is not None:  # a clean stop at a round's end
            name = signal.Signals(stopper.stopped_by).name
            if self.trainer.is_global_zero:
                print(f"{name}: stopped after round {self.method.round} of {self.method.num_rounds}; checkpoint "
                      f"{stopper.path}; resume with the same command and --ckpt_path last (or that path)",
                      file=sys.stderr)
            raise SystemExit(128 + stopper.stopped_by)
        # Analytic fits take no optimizer steps, so Lightning's step-based checkpointing never
        # fires: the fitted model is saved here, for `test --ckpt_path`.
        log_dir = self.trainer.log_dir
        assert log_dir is not None  # the CSV logger's folder, or default_root_dir without loggers
        checkpoint = Path(log_dir) / "model.ckpt"
        save_atomically(self.trainer, checkpoint)
        if stopper is not None:
            stopper.retire(self.trainer)
        if self._get(self.config, "engine") != "flower":  # over Flower the test ran with the clients
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        # Every process takes part (reading trainer.log_dir is a collective); only rank 0 prints.
        quiet = contextlib.nullcontext() if self.trainer.is_global_zero else contextlib.redirect_stdout(io.StringIO())
        wall_s = finish_run(self.trainer)
        with quiet:
            print_summary(self.trainer, self.model, checkpoint, wall_s=wall_s)


#: Lightning's notices that say nothing about a federated run, each with why
QUIET_WARNINGS = (
    ".*does not have many workers",  # the loaders hold cached features in memory: workers would only copy them
    ".*no `val_dataloader`",  # validation is `validate`'s business (data.val_fraction), not fit's
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated",  # Lightning's own use of a torch API, not ours
    ".*LightningCLI's args parameter is intended",  # run(args) from Python: sys.argv is the caller's
    ".*Total length of `list` across ranks is zero",  # no test split (sites keeping their rows): the summary says so
)
QUIET_LOGS = (
    "Tip:",  # advertisements for Lightning's cloud
    "Seed set to",  # the global seed; every method and partition seeds its own generators
    "GPU available: False", "TPU available: False", "HPU available: False",  # nothing to use, nothing to say
    "`Trainer.fit` stopped: `max_epochs",  # the summary says how many rounds ran
)


def quiet_libraries() -> None:
    """Normal runs print their progress and summary, not library noise (QUIET_* say what and why)."""
    for notice in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=notice)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed"):
        logging.getLogger(name).addFilter(lambda record: not any(q in record.getMessage() for q in QUIET_LOGS))
    os.environ.setdefault("WANDB_SILENT", "true")


def run(args: list[str] | None = None) -> WorkbenchCLI:
    """Parse `args` (default: the command line) and run the subcommand; returns the finished CLI
    (`.method`, `.model` the engine, `.datamodule`, `.trainer`)."""
    quiet_libraries()
    WorkbenchParser.given = (list(sys.argv[1:] if args is None else args), Path.cwd())
    runlog.claimed = None
    try:
        return WorkbenchCLI(
            LightningEngine, FederatedData, parser_class=WorkbenchParser,
            subclass_mode_model=True, subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,  # set, so Lightning does not warn that it chose one
            trainer_defaults={"num_sanity_val_steps": 0, "enable_model_summary": False,
                              "enable_checkpointing": False, "log_every_n_steps": 1},  # a round is one step
            args=args,
        )
    except BaseException as error:
        runlog.record_ending(error, WorkbenchParser.given[0])
        if out_of_room(error) and not isinstance(error, NoRoom):  # a library's write: one line, not its traceback
            written = getattr(error, "filename", None)  # torch's writer does not name its file
            folder = Path(written).parent if written else runlog.claimed or WorkbenchParser.given[1]
            raise NoRoom(Path(written).name if written else "the run's files", folder, None,
                         "free some space; the run's last.ckpt, if it has one, is whole") from None
        raise
    finally:
        end_processes()  # with --trainer.strategy=ddp: before the interpreter's exit, not during it



