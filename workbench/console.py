"""What the command line says before and after a run: the list of commands, and user errors in a
few lines instead of a traceback.

Kept free of heavy imports (no torch, no Lightning): `python -m workbench --help` answers from
here alone.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

#: every command of `python -m workbench`, with its one line of help
COMMANDS = {
    "fit": "fit a method on a federated dataset, test it and print a summary (--config configs/X.yaml)",
    "validate": "score a method on the held-out validation split (data.val_fraction > 0)",
    "test": "test a fitted model (--ckpt_path runs/<name>/version_N/model.ckpt)",
    "sweep": "run a W&B sweep file here, without the W&B server (sweeps/X.yaml)",
    "bench": "a leaderboard: a scenario's methods × settings × seeds, tuned on hold-outs (benchmarks/scenarios/X.yaml)",
    "compare": "one HTML page comparing finished runs: table, figures, PNGs",
    "sync": "upload every offline W&B run under runs/ (wandb sync on each run's wandb/ folder)",
    "list": "the methods, datasets, backbones and partitions this install offers",
}

USAGE = """usage: python -m workbench <command> [options]     (or: workbench <command> ...)

commands:
{commands}

`python -m workbench <command> --help` shows a command's options; fit/validate/test take
`--config configs/X.yaml` and `--key=value` overrides. Add --debug to see a failure's traceback.
"""

DEBUG_FLAG = "--debug"
DEBUG_ENV = "WORKBENCH_DEBUG"  # set by --debug, so that the processes a run starts see it too
SWEEP_ENV = "WORKBENCH_SWEEP"  # set by the offline sweep runner for its runs, which tag themselves with it
DEBUG_HINT = f"(add {DEBUG_FLAG} for the traceback)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    return USAGE.format(commands="\n".join(f"  {name:<{width}}  {line}" for name, line in COMMANDS.items()))


# ---- user errors -------------------------------------------------------------------------------
#: exception types that, raised by this package's own code, report a wrong input (a setting, a
#: file, a missing extra) with a message that names the fix; anything else is a bug and keeps its
#: traceback
class RunOutcome(RuntimeError):
    """A fit that cannot go on because of what its settings make happen (no client makes a round's
    deadline, none is online): told in one line like a bad setting, not as a fault."""


USER_ERROR_TYPES = (ValueError, OSError, ImportError, FloatingPointError, RunOutcome)
PACKAGE = Path(__file__).resolve().parent


def _raised_here(error: BaseException) -> bool:
    """Whether the innermost frame that raised `error` is in this package."""
    traceback, frame_file = error.__traceback__, None
    while traceback is not None:
        frame_file = traceback.tb_frame.f_code.co_filename
        traceback = traceback.tb_next
    return frame_file is not None and PACKAGE in Path(frame_file).resolve().parents


def user_error(error: BaseException) -> BaseException | None:
    """The wrong input behind `error`: the first exception along its chain (`raise ... from`,
    or raised while handling) that this package raised as a user error (a constructor's check
    that the config parser wrapped, a file not found), or None when `error` is a bug."""
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, USER_ERROR_TYPES) and _raised_here(current):
            return current
        current = (current.__cause__ if current.__cause__ is not None or current.__suppress_context__
                   else current.__context__)
    return None


#: import names of the install's own dependencies (pyproject.toml): one missing means that this
#: Python is not the one the workbench was installed into (the system's, not the venv's)
INSTALLED_WITH = {"torch", "torchvision", "lightning", "jsonargparse", "timm", "torchmetrics", "numpy", "scipy",
                  "wandb", "yaml", "tqdm"}


def print_user_error(error: BaseException, file=None) -> None:
    lines = [f"error: {error}"]
    if isinstance(error, ModuleNotFoundError) and (error.name or "").partition(".")[0] in INSTALLED_WITH:
        lines.append(f"this Python ({sys.executable}) lacks what the install put in its venv: activate it first "
                     "(`source .venv/bin/activate`) or run `.venv/bin/python -m workbench ...`")
    print("\n".join([*lines, DEBUG_HINT]), file=file or sys.stderr)


# ---- the config parser's messages --------------------------------------------------------------
# jsonargparse explains a bad value by every type it tried (the class, then None); these lines say
# nothing the first ones do not.
_NOISE = re.compile(r"^\s*(- )?(Expected a <class 'NoneType'>|Does not validate against any of the Union "
                    r"subtypes|Subtypes: |Errors:|Given value type: |Given value: |Expected a path but )")
_UNKNOWN_CLASS = re.compile(r"Parser key \"(model|data)\".*?Expected a dot import path string: (\S+)", re.S)
_UNKNOWN_OPTION = re.compile(r"class_path '([\w.]+)':\s*(?:Option '([\w.]+)' is not accepted|"
                             r"unrecognized arguments: --([\w.]+))")
_NOT_A_GROUP = re.compile(r"class_path '([\w.]+)':\s*Parser key \"(\w+)\":\s*Unable to load config")
# a value of the wrong type for a method's or the data's setting, under two levels of nesting
# (an optional setting's message lists the union's subtypes first)
_WRONG_TYPE = re.compile(r"Parser key \"(model|data)\":.*?class_path '[\w.]+':\s*Parser key \"([\w.]+)\":"
                         r"(?:\s*(?:Does not validate[^\n]*|Subtypes:[^\n]*|Errors:))*"
                         r"\s*(?:- )?Expected a (?:<class '(?:\w+\.)*(\w+)'>|typing\.Literal\[([^\]]*)\])", re.S)
_GIVEN_VALUE = re.compile(r"(?:Got value|Given value): ([^\n]*)")
_REQUIRED = re.compile(r"Parser key \"(model|data)\":.*?Problem with given class_path '([\w.]+)':\s*"
                       r"the following arguments are required: ([\w., ]+)", re.S)
#: how a type of the parser's messages reads in ours
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "Sequence": "a list, e.g. [0.1, 1.0]", "list": "a list, e.g. [0.1, 1.0]", "dict": "a mapping"}


def moved_message(class_name: str, found: dict[str, str]) -> str:
    """The settings a config still gives under their workbench 0.2 names, each with its new key."""
    moves = ", ".join(f"model.{old} is now {new if new.startswith('federation.') else 'model.' + new}"
                      for old, new in found.items())
    return (f"{class_name}'s settings moved in workbench 0.3: {moves}; CHANGELOG.md lists every move "
            f"(--print_config shows the new layout)")


def closest(name: str, options: list[str], cutoff: float = 0.6) -> list[str]:
    """The option `name` most likely meant: one that differs only in case (`Scaffold` ->
    `SCAFFOLD`), else the closest spelling ignoring case; [] when none is close."""
    import difflib

    lowered = {option.lower(): option for option in options}
    if name.lower() in lowered:
        return [lowered[name.lower()]]
    return [lowered[match] for match in difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)]


def unknown_class_message(key: str, name: str, choices: list[str]) -> str:
    """`--model`/`--data` (`key`) naming no class among `choices`: the choices and the closest."""
    kind = "method" if key == "model" else "data module"
    close = closest(name, choices, cutoff=0.5)
    return (f"unknown {kind} {name!r} (--{key}); choose one of: {', '.join(choices)}"
            + (f" (did you mean {close[0]!r}?)" if close else ""))


def condense_parse_error(message: str, choices: dict[str, list[str]], describe, given=None) -> str:
    """A config error in a few lines. `choices` names the classes each of `model`/`data` accepts;
    `describe(class_path)` gives a class's setting names and its moved ones ({old: new key}), for
    close matches and for the settings a config still names the old way; `given` are the model's
    settings the command line and its config files give ({key: value}: every old one is listed
    at once)."""
    unknown = _UNKNOWN_CLASS.search(message)
    if unknown:
        key, name = unknown.groups()
        return unknown_class_message(key, name, choices[key])
    option, group = _UNKNOWN_OPTION.search(message), _NOT_A_GROUP.search(message)
    found_option = option or group
    if found_option:
        class_path, *names = found_option.groups()
        name = next(given_name for given_name in names if given_name)
        known, moved = describe(class_path)
        head = name if name in moved else name.split(".")[0]  # a moved group's key: `compression.kind`
        if head in moved:
            given = given or {}
            found = {old: new for old, new in moved.items() if old == head or (old in given and (
                old not in known or not isinstance(given[old], dict)))}  # a group given a plain value
            return moved_message(class_path.rsplit(".", 1)[-1], found)
        if option:
            close = closest(name, known)
            return (f"{class_path.rsplit('.', 1)[-1]} has no setting {name!r}"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" Its settings: {', '.join(known)}")
    required = _REQUIRED.search(message)
    if required:
        key, class_path, listed = required.groups()
        settings = [name.strip() for name in listed.split(",") if name.strip()]
        return (f"{class_path.rsplit('.', 1)[-1]} needs {', '.join(f'{key}.{name}' for name in settings)}: give "
                + " ".join(f"--{key}.{name}=..." for name in settings))
    wrong = _WRONG_TYPE.search(message)
    if wrong:
        key, name, kind, allowed = wrong.groups()
        value = _GIVEN_VALUE.search(message, wrong.end())
        given = f", got {value[1].strip()!r}" if value else ""
        expected = f"one of {allowed}" if allowed is not None else _KINDS.get(kind, f"a {kind}")
        return f"{key}.{name} must be {expected}{given}"
    kept = [line for line in message.splitlines() if line.strip() and not _NOISE.match(line)]
    return "\n".join(kept)
