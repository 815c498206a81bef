"""The light check of `fit|validate|test` (`workbench.command_line`): the user errors it can see
without torch or Lightning print at once, in the very lines the full parser prints; every valid
command line passes it. (`benchmarks/cli_start.py` measures how much sooner.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench import __main__ as entry
from workbench.command_line import CHOICES, METHODS, OTHER_METHOD_CLASSES, check, usage_line
from workbench.console import DEBUG_ENV

SYNTHETIC = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
             "--wandb=disabled"]
CHOOSE = "choose one of: " + ", ".join(METHODS)


def files(folder: Path) -> dict[str, Path]:
    """The configs the cases read, written into `folder`."""
    texts = {"broken.yaml": "model:\n  class_path: AFL\n  init_args: {gamma: [1,\n",
             "string.yaml": "model: Scaffold\n",
             "class_path.yaml": "model:\n  class_path: Nope\n  init_args: {gamma: 1.0}\n",
             "engine.yaml": "engine: flwr\n"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    return {name.split(".")[0]: folder / name for name in texts}


#: (name, the command line given the cases' folder, its error line)
CASES = [
    ("a missing config", lambda d: ["fit", "--config", str(d / "nope.yaml")],
     lambda d: f"""error: Parser key "config": File does not exist: '{d / "nope.yaml"}'"""),
    ("a config that is not YAML", lambda d: ["fit", "--config", str(d / "broken.yaml")],
     lambda d: f"error: {d / 'broken.yaml'} is not valid YAML, line 4, column 1: expected the node content, "
               "but found '<stream end>'"),
    ("a method in the wrong case", lambda d: ["fit", *SYNTHETIC, "--model=Scaffold"],
     lambda d: f"error: unknown method 'Scaffold' (--model); {CHOOSE} (did you mean 'SCAFFOLD'?)"),
    ("an unknown method as the next word", lambda d: ["validate", *SYNTHETIC, "--model", "Nope"],
     lambda d: f"error: unknown method 'Nope' (--model); {CHOOSE}"),
    ("a config's method as a string", lambda d: ["fit", *SYNTHETIC, "--config", str(d / "string.yaml")],
     lambda d: f"error: unknown method 'Scaffold' (--model); {CHOOSE} (did you mean 'SCAFFOLD'?)"),
    ("a config's class_path", lambda d: ["fit", *SYNTHETIC, "--config", str(d / "class_path.yaml")],
     lambda d: f"error: unknown method 'Nope' (--model); {CHOOSE}"),
    ("a bad --engine", lambda d: ["fit", *SYNTHETIC, "--engine=flwr"],
     lambda d: "error: argument --engine: invalid choice: 'flwr' (choose from 'lightning', 'flower')"),
    ("a bad --wandb", lambda d: ["fit", *SYNTHETIC, "--wandb", "on"],
     lambda d: "error: argument --wandb: invalid choice: 'on' (choose from 'auto', 'online', 'offline', 'disabled')"),
    ("a config's bad engine", lambda d: ["fit", *SYNTHETIC, "--config", str(d / "engine.yaml")],
     lambda d: """error: Parser key "engine": 'flwr' not among choices ['lightning', 'flower']"""),
    ("a missing checkpoint", lambda d: ["test", *SYNTHETIC, f"--ckpt_path={d / 'nothere.ckpt'}"],
     lambda d: f"error: no checkpoint at --ckpt_path={d / 'nothere.ckpt'}: pass a run's model.ckpt or last.ckpt "
               "(runs/<run name>/version_N/), or `last` to resume this run name's newest fit"),
]
IDS = [name for name, _, _ in CASES]


def expected_lines(args: list[str], error: str) -> list[str]:
    """A parser error's two lines (usage, error), or a run's (error, the --debug hint)."""
    return [error, "(add --debug for the traceback)"] if "checkpoint" in error else [usage_line(args[0]), error]


@pytest.mark.parametrize("name, make_args, error", CASES, ids=IDS)
def test_the_light_check_prints_what_the_full_parser_prints(name, make_args, error, monkeypatch, capsys, tmp_path):
    files(tmp_path)
    args = [*make_args(tmp_path), f"--run_dir={tmp_path / 'runs'}"]
    assert entry.main(args) == 2
    light = capsys.readouterr().err
    assert light.splitlines() == expected_lines(args, error(tmp_path))
    monkeypatch.setattr(entry, "check", lambda args: None)  # the full parser alone, as before the light check
    assert entry.main(args) == 2
    assert capsys.readouterr().err == light
    assert not (tmp_path / "runs").exists()


@pytest.mark.subprocess
@pytest.mark.parametrize("name, make_args, error", CASES, ids=IDS)
def test_a_light_error_leaves_torch_and_lightning_unimported(name, make_args, error, tmp_path):
    files(tmp_path)
    args = make_args(tmp_path)
    code = ("import sys, workbench.__main__ as m; status = m.main(sys.argv[1:]); "
            "heavy = [n for n in ('torch', 'lightning', 'jsonargparse') if n in sys.modules]; "
            "print(heavy); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == expected_lines(args, error(tmp_path))
    assert done.stdout.strip() == "[]", "the light check imported a heavy module"


def test_the_method_names_are_the_catalogs():
    from workbench.catalog import method_classes

    assert list(METHODS) == [cls.__name__ for cls in method_classes()], (
        "workbench/command_line.py reads the methods from workbench/methods/__init__.py and disagrees with the catalog")


def test_every_class_the_parser_finds_by_a_short_name_is_known():
    """A name the full parser resolves (any subclass of FederatedMethod, and itself) is never
    called unknown by the light check."""
    import workbench.experiment  # noqa: F401  (what the command line imports)
    from workbench.methods import FederatedMethod

    def family(cls: type) -> set[type]:
        return {cls}.union(*(family(sub) for sub in cls.__subclasses__()))

    names = {cls.__name__ for cls in family(FederatedMethod) if cls.__module__.startswith("workbench.")}
    assert names <= set(METHODS + OTHER_METHOD_CLASSES), (
        "list these in workbench/command_line.py (METHODS, or OTHER_METHOD_CLASSES when not a method of its own): "
        f"{sorted(names - set(METHODS + OTHER_METHOD_CLASSES))}")


def test_the_choices_are_the_parsers():
    from workbench.experiment import WorkbenchCLI

    class Recorder:
        def __init__(self) -> None:
            self.choices: dict[str, tuple] = {}

        def add_argument(self, name, **options):
            if "choices" in options:
                self.choices[name.lstrip("-")] = tuple(options["choices"])

    recorder = Recorder()
    WorkbenchCLI.add_arguments_to_parser(None, recorder)
    assert recorder.choices == CHOICES


@pytest.mark.parametrize("config", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")))
def test_every_config_passes(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert check(["fit", "--config", config]) is None
    assert check(["fit", f"--config={ROOT / config}", "--engine=lightning", "--wandb=disabled"]) is None


def test_every_sweeps_runs_pass(monkeypatch):
    from workbench.sweep import agent_flags, cli_arguments, command_argv, expand_runs, load_sweep

    monkeypatch.chdir(ROOT)
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        sweep = load_sweep(path)
        for values in expand_runs(sweep, count=3)[:20]:
            args = cli_arguments(command_argv(sweep, agent_flags(values), Path("runs/sweep/run")))
            assert check(args) is None, (path.name, args)


@pytest.mark.parametrize("args", [
    ["fit", "--model=AFL", "--data=FederatedDataModule", "--data.dataset=synthetic"],
    ["fit", "--config", "configs/method/fedavg.yaml", "--config", "configs/data/synthetic.yaml", "--model", "FedAvgM",
     "--model.num_rounds=3", "--engine", "flower", "--wandb=offline", "--run_name=x"],
    ["fit", "-c", "configs/demo.yaml", "--model=workbench.methods.SCAFFOLD"],  # a class path: the parser's
    ["fit", "--model=GradientMethod"], ["fit", "--model=FederatedMethod"],  # found by the parser; not an unknown
    ["fit", "--config", "{model: AFL, engine: flower}"],  # a config given inline
    ["fit", "--config", "-"],  # standard input
    ["test", "--config", "configs/synthetic_afl.yaml", "--ckpt_path", "last"],
    ["test", "--config", "configs/synthetic_afl.yaml", "--ckpt_path=configs/demo.yaml"],  # a file there
    ["test", "--config", "configs/synthetic_afl.yaml", "--ckpt_path=null"],
    ["fit", "--model=Nope", "--help"], ["fit", "--model=Nope", "--print_config"], ["fit", "--model.help", "Nope"],
    ["fit", "--config", "nope.yaml", "-h"],  # help first: the full parser decides what to print
    ["fit", "--mod=Nope"], ["fit", "--model.class_path=Nope"],  # not read here: the parser's
])
def test_valid_or_unjudged_command_lines_pass(args, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert check(args) is None


def test_a_later_config_that_sets_the_checkpoint_is_the_parsers(monkeypatch, tmp_path):
    (tmp_path / "resume.yaml").write_text("ckpt_path: last\n")
    monkeypatch.chdir(tmp_path)
    assert check(["test", "--ckpt_path=nothere.ckpt", "--config", "resume.yaml"]) is None
    assert "no checkpoint at --ckpt_path=nothere.ckpt" in check(["test", "--config", "resume.yaml",
                                                                 "--ckpt_path=nothere.ckpt"])


def test_debug_leaves_every_error_to_the_full_parser(monkeypatch):
    assert check(["fit", "--model=Nope"]) is not None
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert check(["fit", "--model=Nope"]) is None


def test_the_first_error_in_the_command_line_is_the_one_named(tmp_path):
    """The parser reads its arguments in order and stops at the first it refuses; so does the check."""
    first = check(["fit", "--engine=x", "--model=Nope", "--config", str(tmp_path / "nope.yaml")])
    assert first.endswith("error: argument --engine: invalid choice: 'x' (choose from 'lightning', 'flower')")
    assert "unknown method 'Nope'" in check(["fit", "--model=Nope", "--engine=x"])
