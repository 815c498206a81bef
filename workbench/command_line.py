"""The checks of a `fit|validate|test` command line that need neither torch nor Lightning: a user
error they find prints in a fraction of a second instead of after the imports of the full parser
(`benchmarks/cli_start.py` measures both), in the words the full parser uses.

`check` reads the command line in the order the parser does and stops at the first of: a
`--config` file that does not exist or is not valid YAML, an unknown method (`--model=NAME` or a
config's `model:`), a bad choice of `--engine` or `--wandb`, and a `--ckpt_path` file that does
not exist. Anything it does not understand is left to the full parser: it never refuses a command
line that parser would accept. Imports only the standard library and PyYAML.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from workbench.console import DEBUG_ENV, DEBUG_HINT, unknown_class_message


def exported_methods() -> tuple[str, ...]:
    """The methods `workbench/methods/__init__.py` exports (its `__all__`, less what it re-exports
    from the contract, `methods/base.py`), read from its source without importing torch: the one
    list a method is added to, in the order `python -m workbench list` gives them."""
    import ast

    tree = ast.parse((Path(__file__).parent / "methods" / "__init__.py").read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets))
    contract = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "workbench.methods.base" for alias in node.names}
    return tuple(sorted((name for name in exported if name not in contract), key=str.lower))


#: the methods `--model` accepts by name (tests/test_cli_start.py: the catalog's, the same order)
METHODS = exported_methods()
#: the other classes the parser finds by a short name (bases of the methods): left to it
OTHER_METHOD_CLASSES = ("FederatedMethod", "GradientMethod", "ServerOptimizer")
#: the choices of the top-level options that have them (`WorkbenchCLI.add_arguments_to_parser`)
CHOICES = {"engine": ("lightning", "flower"), "wandb": ("auto", "online", "offline", "disabled")}
#: the values of --ckpt_path that are not a file
CHECKPOINT_WORDS = ("last", "best", "hpc", "registry")

_NAME = re.compile(r"[A-Za-z_]\w*")
#: --help in any form, the help of a class (`--model.help`) and --print_config: the full parser's
_HELP = re.compile(r"-h|--help|--([\w.]+\.)?help(=.*)?|--print_config(=.*)?")


def usage_line(command: str) -> str:
    """The first line of every parser error (`WorkbenchParser.error` prints the same)."""
    return (f"usage: python -m workbench {command} --config FILE [--key=value ...]   "
            f"(python -m workbench {command} --help lists the keys)")


def short_help(command: str, what: str) -> str:
    """`python -m workbench fit --help`: what a run is made of and where each list of keys is, in
    a fraction of a second (Lightning's parser lists several hundred keys, mostly the Trainer's,
    after some 10 s of imports: `--help=full`)."""
    import textwrap

    run = f"python -m workbench {command}"
    what = what.split(" (")[0]
    methods = textwrap.wrap(f"the method: {', '.join(METHODS)}", 78)
    return "\n".join([
        f"usage: {run} --config FILE [--config FILE ...] [--KEY=VALUE ...]", "",
        *textwrap.wrap(f"{what[0].upper()}{what[1:]}. A config names the method (model) and the data; configs "
                       "compose (a later one wins) and every key can be set on the command line, e.g. "
                       "--model.num_rounds=10 --data.alpha=0.1.", 99), "",
        "  -c, --config FILE    a config file, e.g. configs/demo.yaml; repeat to compose",
        f"  --model CLASS        {methods[0]}", *(f"{'':23}{line}" for line in methods[1:]),
        "  --model.KEY=VALUE    one of the method's settings (num_rounds, local.lr, gamma, ...)",
        "  --data.KEY=VALUE     one of the data's settings (dataset, backbone, num_clients, partition, alpha, ...)",
        "  --federation.KEY=VALUE",
        "                       the protocol (dropout, secure_aggregation, dp_sigma, sample_rate, aggregation,",
        "                       adversary_fraction, compression.kind, ...): docs/protocol.md",
        "  --systems.KEY=VALUE  the clients' links and devices, a simulated clock (preset, deadline_s, ...):",
        "                       docs/latency.md",
        "  --stages FILE        protocol stages of one's own, e.g. local noise (a list of class_path, init_args):",
        "                       docs/protocol.md#the-protocol-as-stages",
        *(f"  --{option} {'|'.join(choices)}" for option, choices in CHOICES.items()),
        "  --ckpt_path FILE     resume a run",
        "  --trainer.KEY=VALUE  Lightning's Trainer", "",
        f"One method's settings:  {run} --model.help AFL",
        f"The data's settings:    {run} --data.help FederatedDataModule  (sites with files of their own: SiteData)",
        f"A config in full:       {run} --config configs/demo.yaml --print_config",
        f"Every key (Lightning's parser, several hundred lines): {run} --help=full",
        "The methods and the configs that run them: python -m workbench list"])


def config_files(args: list[str], cwd: Path) -> list[Path]:
    """The `--config` files of a command line run in `cwd`, in order."""
    files = []
    for i, arg in enumerate(args):
        if (arg in ("--config", "-c") and i + 1 < len(args)) or arg.startswith("--config="):
            value = os.path.expanduser(args[i + 1] if "=" not in arg else arg.split("=", 1)[1])
            files.append(Path(os.path.normpath(cwd / value)))
    return files


def _load(path: Path, text: str) -> tuple[str | None, object]:
    """`text`, the contents of `path`, read as YAML: (None, what it holds), or (why it is not
    valid YAML, with where; None)."""
    import yaml

    try:
        return None, yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        return f"{path} is not valid YAML{where}: {problem}", None


def yaml_error(args: list[str], cwd: Path) -> str | None:
    """The first `--config` file that is not valid YAML, with where (the parser's own message
    names a "<unicode string>", not the file), or None."""
    for path in config_files(args, cwd):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        problem, _ = _load(path, text)
        if problem is not None:
            return problem
    return None


def missing_checkpoint(ckpt_path) -> str | None:
    """Why `--ckpt_path` names no checkpoint (a file that is not there), or None."""
    if ckpt_path is None or ckpt_path in CHECKPOINT_WORDS or Path(ckpt_path).is_file():
        return None
    return (f"no checkpoint at --ckpt_path={ckpt_path}: pass a run's model.ckpt or last.ckpt "
            "(runs/<run name>/version_N/), or `last` to resume this run name's newest fit")


class _Stop(Exception):
    """The check cannot tell what the parser would do from here on: the rest is the parser's."""


def _unknown_method(value, cwd: Path) -> str | None:
    """The parser's message for a `model` that names no method, or None (a known name, a dotted
    class path, a file, anything else: the parser's)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value in METHODS + OTHER_METHOD_CLASSES:
        return None
    if (cwd / value).exists():  # a file of that name: the parser may read it as a config
        return None
    return unknown_class_message("model", value, list(METHODS))


def _bad_choice(option: str, value: str) -> str | None:
    """argparse's own message for a value of `--engine`/`--wandb` not among its choices, or None."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument(f"--{option}", choices=CHOICES[option])
    try:
        parser.parse_known_args([f"--{option}={value}"])
    except argparse.ArgumentError as error:
        return str(error)
    return None


def _config(value: str, cwd: Path) -> tuple[str | None, dict]:
    """A `--config` value: (the parser's error, {}) or (None, its settings)."""
    import yaml

    if value in ("", "-") or "://" in value:  # standard input, a URL: the parser's
        raise _Stop
    expanded = os.path.expanduser(value)
    where = expanded if os.path.isabs(expanded) else os.path.join(cwd, expanded)
    if not os.access(where, os.F_OK):
        try:
            inline = yaml.safe_load(value)
        except yaml.YAMLError:
            raise _Stop from None
        if isinstance(inline, str):
            return f'Parser key "config": File does not exist: {where!r}', {}
        if isinstance(inline, dict):  # a config given inline
            return None, inline
        raise _Stop
    path = Path(os.path.normpath(cwd / expanded))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):  # a folder, unreadable: the parser says so
        raise _Stop from None
    problem, settings = _load(path, text)
    if problem is not None:
        return problem, {}
    if settings is None:
        return None, {}
    if not isinstance(settings, dict):
        raise _Stop
    return None, settings


def _config_problem(settings: dict, cwd: Path) -> str | None:
    """The first setting of a config the parser refuses as it reads it: `model:`, a choice."""
    model = settings.get("model")
    if isinstance(model, dict):
        model = model.get("class_path")
    problem = _unknown_method(model, cwd)
    if problem is not None:
        return problem
    for option, choices in CHOICES.items():
        value = settings.get(option)
        if isinstance(value, str) and value not in choices:
            return f'Parser key "{option}": {value!r} not among choices {list(choices)}'
    return None


def check(args: list[str]) -> str | None:
    """What `python -m workbench <args>` (`fit|validate|test ...`) would print for a user error
    this module can see without the full parser, or None: nothing found (or nothing it can
    judge; the full parser runs either way). The text is the parser's two lines (usage, error)
    or, for a missing checkpoint, the run's (`error: ...` and the --debug hint)."""
    command, rest = args[0], list(args[1:])
    if os.environ.get(DEBUG_ENV) or any(_HELP.fullmatch(arg) for arg in rest):
        return None
    cwd = Path.cwd()  # relative paths are the process's, as for the parser and the run
    checkpoint: str | None = None  # the last --ckpt_path flag, unless a later config sets ckpt_path
    try:
        i = 0
        while i < len(rest):
            option, equals, value = rest[i].partition("=")
            option = {"-c": "--config"}.get(option, option) if not equals else option
            if option not in ("--config", "--model", "--engine", "--wandb", "--ckpt_path"):
                i += 1
                continue
            if not equals:  # the value is the next word
                if i + 1 >= len(rest) or rest[i + 1].startswith("-"):
                    raise _Stop
                value, i = rest[i + 1], i + 1
            i += 1
            problem = None
            if option == "--config":
                problem, settings = _config(value, cwd)
                problem = problem or _config_problem(settings, cwd)
                if "ckpt_path" in settings:
                    checkpoint = None
            elif option == "--model":
                problem = _unknown_method(value, cwd)
            elif option == "--ckpt_path":
                checkpoint = value
            else:
                problem = _bad_choice(option[2:], value)
            if problem is not None:
                return f"{usage_line(command)}\nerror: {problem}"
    except _Stop:
        return None
    if checkpoint is not None:
        import yaml

        try:
            plain = yaml.safe_load(checkpoint) == checkpoint  # not `null`, a number, a quoted word
        except yaml.YAMLError:
            plain = False
        problem = missing_checkpoint(checkpoint) if plain else None
        if problem is not None:
            return f"error: {problem}\n{DEBUG_HINT}"
    return None
