"""A fuzz test (hypothesis) of the command line and of small malformed data files.

Every case runs `python -m workbench fit ...` in process (`workbench.__main__.main`) into its own
run and cache folders, and must end in one of two ways: exit 0 with a fitted `model.ckpt` in the
run's version folder, or exit 2 with at most 3 lines on stderr, no traceback, and no run folder
(no `version_*`, no W&B folder). Anything else — another status, an exception escaping `main`,
a case running past `CASE_SECONDS` (a hang), the process's peak memory growing by more than
`MEMORY_BOUND_MIB` over a test — fails the test with the case that caused it.

The cases: (1) command-line values on the synthetic data (clients, partitions and their
parameters, the generator's sizes, a few fast methods and their settings, junk for numbers);
(2) small, often malformed files read through `data.dataset=hf`: CSV, parquet, JSON lines (all
with precomputed feature columns, so no backbone runs) and image folders (raw pixels,
`data.inputs=images`, a linear FedAvg head). Each test prints how many cases it ran
(`pytest -s`), writes it to `$WORKBENCH_TEST_ARTIFACTS/fuzz-<kind>-<tier>.txt` when that is
set, and fails when it ran none. The fast tier runs a small derandomized instance of each (and a
plain fit of each method and file kind); the `slow` tier a larger random one.

What it found is fixed, each with a regression test here or beside the code it concerns.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("hypothesis", reason="pip install -e '.[test]'")

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from workbench.__main__ import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny problems: one thread each

CASE_SECONDS = 60  # a case still running after this is a hang
MEMORY_BOUND_MIB = 1536  # the process's peak RSS may grow by at most this over one test
MAX_ERROR_LINES = 3
ARTIFACTS_ENV = "WORKBENCH_TEST_ARTIFACTS"
TIERS = {"fast": {"max_examples": 10, "derandomize": True},  # and the explicit cases
         "slow": {"max_examples": 150, "derandomize": False}}
TIER_PARAMS = [pytest.param("fast", id="fast"), pytest.param("slow", id="slow", marks=pytest.mark.slow)]

COMMON = ["--trainer.enable_progress_bar=false", "--wandb=disabled", "--data=FederatedDataModule"]


@pytest.fixture(scope="module", autouse=True)
def hypothesis_home(tmp_path_factory):
    """Hypothesis writes what it gathers (the code's constants, unicode tables) under its home folder,
    `.hypothesis/` in the working directory by default, even without a database: a temporary one here."""
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


class Hang(Exception):
    """A case ran past CASE_SECONDS."""


@dataclass
class Case:
    """One command: its arguments after `fit` (the folders are added per case), and the files it
    reads, written into the case's folder by `write(folder)` before it runs."""

    args: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content

    def write(self, folder: Path) -> None:
        for name, content in self.files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)


@dataclass
class Tally:
    """What the cases of one test did."""

    outcomes: Counter = field(default_factory=Counter)  # by exit status
    seconds: float = 0.0
    slowest: float = 0.0

    @property
    def cases(self) -> int:
        return sum(self.outcomes.values())


def run_case(case: Case, root: Path, capsys) -> tuple[int, str]:
    """Run one case in a fresh folder under `root` and check how it ended; (status, stderr)."""
    folder = Path(tempfile.mkdtemp(dir=root))  # per example: hypothesis reuses the test's fixtures
    try:
        case.write(folder)
        args = [arg.replace("{folder}", str(folder)) for arg in case.args]
        run_dir = folder / "runs"
        argv = ["fit", *args, *COMMON, f"--run_dir={run_dir}", f"--data.cache_dir={folder / 'cache'}",
                f"--data.data_dir={folder / 'data'}"]
        capsys.readouterr()
        status = call_with_alarm(main, argv)
        out, err = capsys.readouterr()
        shown = f"\nargv: {argv}\nstdout (tail): {out[-2000:]}\nstderr: {err[-4000:]}"
        assert status in (0, 2), f"exit status {status}{shown}"
        assert "Traceback" not in err + out, f"a traceback{shown}"
        if status == 0:
            versions = list(run_dir.glob("*/version_*"))
            assert len(versions) == 1 and (versions[0] / "model.ckpt").is_file(), \
                f"exit 0 without a model.ckpt (version folders: {versions}){shown}"
        else:
            lines = [line for line in err.splitlines() if line.strip()]
            assert any(line.startswith("error: ") for line in lines), f"exit 2 without an `error:` line{shown}"
            left = sorted(str(p.relative_to(folder)) for p in run_dir.rglob("*")
                          if p.name.startswith("version_") or p.name == "wandb") if run_dir.exists() else []
            assert len(lines) <= MAX_ERROR_LINES, f"exit 2 in {len(lines)} lines, more than {MAX_ERROR_LINES}{shown}"
            assert not left, f"exit 2 left run folders {left}{shown}"
        return status, err
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def call_with_alarm(function, *args):
    """function(*args), raising Hang after CASE_SECONDS; the previous SIGALRM handler and timer (e.g.
    pytest-timeout's) are restored afterwards."""

    def hang(signum, frame):
        raise Hang(f"the case ran past {CASE_SECONDS} s")

    previous_handler = signal.signal(signal.SIGALRM, hang)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    start = time.monotonic()
    try:
        return function(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - start), 0.001))


def fuzz(kind: str, tier: str, cases: st.SearchStrategy[Case], capsys, tmp_path: Path,
         explicit: tuple[Case, ...] = ()) -> Tally:
    """Run the `explicit` cases and the tier's examples of `cases`, report how many ran, check the
    memory bound."""
    tally = Tally()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    @settings(**TIERS[tier], deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.function_scoped_fixture])
    @given(case=cases)
    def one(case: Case) -> None:
        start = time.perf_counter()
        status, _ = run_case(case, tmp_path, capsys)
        took = time.perf_counter() - start
        tally.outcomes[status] += 1
        tally.seconds += took
        tally.slowest = max(tally.slowest, took)

    for case in explicit:
        one = example(case=case)(one)
    one()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    line = (f"fuzz {kind} ({tier} tier): {tally.cases} cases, {tally.outcomes[0]} fitted (exit 0), "
            f"{tally.outcomes[2]} refused (exit 2); {tally.seconds:.1f} s (slowest {tally.slowest:.2f} s), "
            f"peak RSS grew {grown_mib:.0f} MiB (bound {MEMORY_BOUND_MIB})")
    print(f"\n{line}", file=sys.__stdout__, flush=True)  # past capsys: shown with -s
    if os.environ.get(ARTIFACTS_ENV):
        out = Path(os.environ[ARTIFACTS_ENV])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fuzz-{kind}-{tier}.txt").write_text(line + "\n")
    assert tally.cases > 0, "the fuzz ran no case"
    assert grown_mib <= MEMORY_BOUND_MIB, line
    return tally


# ---- strategies: values ------------------------------------------------------------------------
JUNK = st.sampled_from(["abc", "", "1.5.2", "0x10", "1e999", "nan", "inf", "-inf", "[1]", "{a: 1}", "None",
                        "true", "\uff11\uff12", "2 3"])  # the last but one: 12 in full-width digits


def number(*values) -> st.SearchStrategy[str]:
    """A setting's value on the command line: one of `values` (good and bad), or, one time in eight, junk."""
    given = st.sampled_from([str(v) for v in values])
    return st.integers(0, 7).flatmap(lambda pick: JUNK if pick == 7 else given)  # 0 first: hypothesis's simplest


def options(draw, choices: dict[str, st.SearchStrategy[str]], most: int | None = None) -> list[str]:
    """`--key=value` for a drawn subset of `choices`."""
    most = min(most or len(choices), len(choices))
    count = draw(st.sampled_from([0, 0, 0, *range(1, most + 1)])) if most else 0  # none in half or more
    if not count:
        return []
    keys = draw(st.lists(st.sampled_from(sorted(choices)), unique=True, min_size=count, max_size=count))
    return [f"--{key}={draw(choices[key])}" for key in keys]


METHODS = {
    "AFL": {"model.gamma": number(1.0, 0.0, -1, 1e-12, 1e12), "model.gamma_out": number(0.0, 1.0, -0.5),
            "model.bias": st.sampled_from(["true", "false", "maybe"]),
            "model.dtype": st.sampled_from(["float64", "float32", "float16", "int", "x"]),
            "model.gamma_grid": st.sampled_from(["[0.1, 1.0]", "[]", "[-1]", "[0.5]", "x"]),
            "model.holdout_fraction": number(0.1, 0.5, 0, 1, -0.2)},
    "FedAvg": {"model.num_rounds": number(1, 2, 0, -1), "model.architecture": st.sampled_from(["linear", "lin", "cnn"]),
               "model.local.lr": number(0.1, 0, -1, 1e6), "model.local.epochs": number(1, 0, -1),
               "model.local.batch_size": number(16, 1, 0, -3), "model.sample_fraction": number(1.0, 0.5, 0, 1.5),
               "model.server_lr": number(1.0, 0, -1)},
    "GHOFL": {"model.heads": st.sampled_from(["[lda]", "[nb_diag, lda]", "[qda]", "[fedcgs]", "[]", "[lda, lda]",
                                              "[nope]", "lda"]),
              "model.shrinkage": number(0.05, 0, 1, -0.1, 2), "model.sketch_dim": number(4, 1, 0, -2, "null"),
              "model.fedcgs_ridge": number(0.0, 1.0, -1),
              "model.dtype": st.sampled_from(["float64", "float32", "x"])},
}
FEDAVG_FAST = ["--model.architecture=linear", "--model.num_rounds=1"]  # the drawn settings may change them


@st.composite
def method_args(draw, methods=tuple(METHODS), most: int = 3) -> list[str]:
    name = draw(st.sampled_from(methods))
    head = [f"--model={name}"] + (FEDAVG_FAST if name == "FedAvg" else [])
    if name == "GHOFL":
        head.append("--model.heads=[lda, nb_diag]")
    return head + options(draw, METHODS[name], most=most)


PARTITIONS = {
    "iid": {},
    "dirichlet": {"data.alpha": number(0.5, 0.05, 100, 0, -1), "data.min_partition_size": number(0, 1, 10, -1),
                  "data.self_balancing": st.sampled_from(["true", "false"])},
    "shard": {"data.num_shards_per_partition": number(1, 2, 0, -3),
              "data.shard_size": number(1, 5, 0, -2, "null", 10**6)},
    "pathological": {"data.num_classes_per_partition": number(1, 2, 0, 5, -1)},
}


@st.composite
def partition_args(draw, extra: tuple[str, ...] = ()) -> list[str]:
    name = draw(st.sampled_from([*PARTITIONS, *extra, "nope"]))
    return [f"--data.partition={name}", *options(draw, PARTITIONS.get(name, {}))]


#: the command's own settings, for the synthetic cases
RUN_SETTINGS = {"eval_every": number(1, 0, 2, -1), "federation.dropout": number(0.0, 0.3, 1, -0.1),
                "federation.dp_sigma": number(0.0, 0.5, -1), "federation.secure_aggregation": st.sampled_from(["true"]),
                "federation.seed": number(0, 1, -1), "stopping.patience": number(0, 1, -1),
                "checkpoint_every_round": st.sampled_from(["false", "true"])}
DATA_SETTINGS = {"data.num_clients": number(1, 2, 3, 5, 64, 0, -1, 10**9), "data.seed": number(0, 7, -1),
                 "data.val_fraction": number(0.0, 0.2, 1, -0.1),
                 "data.personalized": st.sampled_from(["true", "false"]),
                 "data.local_test_fraction": number(0.25, 0, 1), "data.standardize": st.sampled_from(["true", "false"]),
                 "data.batch_size": number(64, 1, 0)}


# ---- (1) the command line on synthetic data ------------------------------------------------------
SYNTHETIC = {"data.synthetic.train_size": number(120, 1, 2, 10, 0, -5),
             "data.synthetic.test_size": number(30, 1, 0, -1),
             "data.synthetic.dim": number(8, 1, 2, 0, -4), "data.synthetic.num_classes": number(3, 2, 10, 1, 0, -1),
             "data.synthetic.separation": number(6.0, 0, -1), "data.synthetic.seed": number(0, 3, -1)}


@st.composite
def synthetic_cases(draw) -> Case:
    return Case([*draw(method_args()), *SMALL, *draw(partition_args()), *options(draw, DATA_SETTINGS, most=3),
                 *options(draw, SYNTHETIC, most=3), *options(draw, RUN_SETTINGS, most=2)])


# ---- (2) small malformed files through data.dataset=hf -------------------------------------------
# Half the files are broken and half the cases give odd settings: the rest fit a model.
BREAKAGES = ["label-negative", "label-huge", "label-string", "label-float", "label-none", "emb-short", "emb-string",
             "emb-none", "emb-nan", "emb-scalar", "emb-nested", "emb-empty", "writer-none", "writer-int", "drop-label",
             "drop-emb"]


@st.composite
def table(draw, broken: bool) -> list[dict]:
    """Rows {emb, label, writer} of precomputed features (3 classes, 4 writers), some broken."""
    rows = draw(st.sampled_from([40, 0, 1, 3, 20, 60])) if broken else draw(st.sampled_from([40, 24, 60]))
    dim = draw(st.sampled_from([3, 1]))
    classes = draw(st.sampled_from([3, 1, 2])) if broken else 3
    records = [{"emb": [float((i * 7 + j) % 5 + 3 * (i % classes)) for j in range(dim)], "label": i % classes,
                "writer": f"w{i % 4}"} for i in range(rows)]
    for _ in range(draw(st.integers(0, 2)) if broken and rows else 0):  # each in one row
        row = records[draw(st.integers(0, rows - 1))]
        column, _, change = draw(st.sampled_from(BREAKAGES)).partition("-")
        if column == "drop":
            row.pop(change, None)
            continue
        emb = row.get("emb")
        row[column] = {"negative": -1, "huge": 10**9, "string": "x", "float": 0.5, "none": None,
                       "short": list(emb)[:-1] if isinstance(emb, list) else [], "nan": [float("nan")] * dim,
                       "scalar": 1.0, "nested": [[1.0] * dim], "empty": [], "int": 3}[change]
    return records


def csv_text(records: list[dict], draw) -> bytes:
    """The rows as CSV (the features a string cell: never a vector column), or something broken."""
    kind = draw(st.sampled_from(["rows", "empty", "header", "ragged", "text", "numbers"]))
    if kind == "empty":
        return b""
    if kind == "header":
        return b"emb,label,writer\n"
    if kind == "text":
        return draw(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=200)).encode()
    if kind == "numbers":  # one numeric cell per feature: a plain table, no vector column
        return ("x0,x1,label\n" + "".join(f"{i},{i * 2},{i % 2}\n" for i in range(len(records)))).encode()
    lines = ["emb,label,writer"]
    for row in records:
        cells = ['"' + json.dumps(row.get("emb")) + '"', str(row.get("label", "")), str(row.get("writer", ""))]
        if kind == "ragged" and draw(st.booleans()):
            cells = cells[: draw(st.integers(0, 2))] + (["extra"] if draw(st.booleans()) else [])
        lines.append(",".join(cells))
    return ("\n".join(lines) + "\n").encode()


def jsonl_text(records: list[dict], draw, broken: bool) -> bytes:
    """JSON lines; when broken, with malformed lines among them."""
    lines = [json.dumps(row) for row in records]
    for _ in range(draw(st.integers(0, 2)) if broken else 0):
        kind = draw(st.sampled_from(["truncated", "text", "blank", "array", "number", "nested"]))
        line = {"truncated": (lines[0][: len(lines[0]) // 2] if lines else "{"), "text": "not json at all",
                "blank": "", "array": "[1, 2, 3]", "number": "42",
                "nested": json.dumps({"emb": {"a": 1}, "label": [0]})}[kind]
        lines.insert(draw(st.integers(0, len(lines))), line)
    return ("\n".join(lines) + ("\n" if lines else "")).encode()


def parquet_bytes(records: list[dict], draw, broken: bool) -> bytes:
    """The rows as parquet; when broken, sometimes a schema with no rows or columns of the wrong type."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = draw(st.sampled_from(["rows", "schema-only", "label-float", "label-string", "emb-string"])) if broken \
        else "rows"
    if kind == "schema-only":
        data = pa.table({"emb": pa.array([], pa.list_(pa.float32())), "label": pa.array([], pa.int64())})
    else:
        columns = {name: [row.get(name) for row in records] for name in ("emb", "label", "writer")}
        if kind == "label-float":
            columns["label"] = [float(v) if isinstance(v, int) else v for v in columns["label"]]
        elif kind in ("label-string", "emb-string"):
            name = kind.split("-")[0]
            columns[name] = [json.dumps(v) for v in columns[name]]
        try:
            data = pa.table(columns)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):  # mixed types: as text
            data = pa.table({name: [json.dumps(v) for v in values] for name, values in columns.items()})
    sink = io.BytesIO()
    pq.write_table(data, sink)
    return sink.getvalue()


HF_SETTINGS = {"data.hf.label_column": st.sampled_from(["label", "class"]),
               "data.hf.num_classes": number(3, 2, 1, 0, -1, "null"),
               "data.hf.test_fraction": number(0.2, 0.5, 0, 1, 0.01),
               "data.hf.test_split": st.sampled_from(["null", "test", "train", "validation"]),
               "data.hf.train_split": st.sampled_from(["train", "nope"]),
               "data.hf.split_seed": number(0, 1, -1)}


@st.composite
def file_cases(draw) -> Case:
    """A parquet, JSON lines or CSV file of precomputed features."""
    broken, odd = draw(st.booleans()), draw(st.booleans())
    records = draw(table(broken))
    fmt = draw(st.sampled_from(["parquet", "jsonl", "csv"] if broken else ["parquet", "jsonl"]))
    content = (csv_text(records, draw) if fmt == "csv" else
               parquet_bytes(records, draw, broken) if fmt == "parquet" else jsonl_text(records, draw, broken))
    name = f"features.{fmt}"
    column = draw(st.sampled_from(["emb", "emb", "label", "nope"])) if odd else "emb"
    partition = draw(partition_args(extra=("natural",))) if odd else \
        [draw(st.sampled_from(["--data.partition=iid", "--data.partition=natural"]))]
    natural = "--data.partition=natural" in partition
    clients = ["--data.hf.client_column=writer"] if natural or draw(st.booleans()) else []
    settings = [*options(draw, HF_SETTINGS, most=2), *options(draw, DATA_SETTINGS, most=2)] if odd else []
    return Case([*draw(method_args(most=1 if odd else 0)), "--data.dataset=hf", f"--data.hf.path={{folder}}/{name}",
                 f"--data.hf.feature_column={column}", "--data.num_clients=2", *clients, *partition, *settings],
                {name: content})


def image_bytes(draw, size: tuple[int, int], mode: str, fmt: str) -> bytes:
    import io

    from PIL import Image

    shade = draw(st.integers(0, 255))
    image = Image.new("RGB", size, (shade, 255 - shade, shade // 2)).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


IMAGE_KINDS = ["png", "jpeg", "size", "mode", "text", "broken", "truncated"]


def image_file(draw, kind: str) -> tuple[str, bytes]:
    """(suffix, content) of one file of an image folder."""
    if kind == "text":
        return ".txt", b"not an image"
    if kind == "broken":
        return ".png", b"\x89PNG\r\n\x1a\n" + bytes(20)  # a PNG signature, then nothing readable
    if kind == "truncated":
        whole = image_bytes(draw, (8, 8), "RGB", "PNG")
        return ".png", whole[: len(whole) * 2 // 3]
    if kind == "jpeg":
        return ".jpg", image_bytes(draw, (8, 8), "RGB", "JPEG")
    mode = draw(st.sampled_from(["L", "RGBA", "P", "1", "LA", "I;16"])) if kind == "mode" else "RGB"
    return ".png", image_bytes(draw, (12, 8) if kind == "size" else (8, 8), mode, "PNG")


@st.composite
def image_folder_cases(draw) -> Case:
    """root/[train|test/]<class>/<file>; when broken: empty class folders, non-image files, files that
    do not decode, mixed sizes and modes."""
    broken, odd = draw(st.booleans()), draw(st.booleans())
    files: dict[str, bytes] = {}
    for split in draw(st.sampled_from([("train/", "test/"), ("",)])):
        for label in draw(st.sampled_from([("a", "b"), ("a",), ("a", "b", "c")] if broken else [("a", "b", "c")])):
            count = draw(st.sampled_from([4, 0, 1, 2])) if broken else 4
            if count == 0:
                files[f"images/{split}{label}/.keep"] = b""  # an empty class folder (a hidden file only)
            for i in range(count):
                kind = draw(st.sampled_from(["png", "png", *IMAGE_KINDS])) if broken else "png"
                suffix, content = image_file(draw, kind)
                files[f"images/{split}{label}/{i}{suffix}"] = content
    image_settings = {"data.hf.image_size": number(8, 4, 0, -1, "null"),
                      "data.hf.image_mode": st.sampled_from(["RGB", "L", "null", "CMYK"]),
                      "data.hf.test_fraction": number(0.5, 0.2, 0)}
    settings = [*options(draw, image_settings, most=2), *options(draw, {"data.num_clients": number(1, 3, 0)})] \
        if odd else []
    architecture = draw(st.sampled_from(["linear", "cnn"]))
    return Case(["--model=FedAvg", *FEDAVG_FAST, f"--model.architecture={architecture}", "--data.dataset=hf",
                 "--data.hf.path={folder}/images", "--data.hf.image_column=image", "--data.inputs=images",
                 "--data.num_clients=2", "--data.partition=iid", *settings], files)


def hf_cases() -> st.SearchStrategy[Case]:
    return st.one_of(file_cases(), image_folder_cases())


@pytest.fixture
def quiet_hf():
    """Hugging Face datasets without its progress lines (they are not the error's); skips without it."""
    datasets = pytest.importorskip("datasets", reason="pip install -e '.[hf]'")
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    yield datasets
    if shown:
        datasets.enable_progress_bars()


# ---- the tests ------------------------------------------------------------------------------------
SMALL = ["--data.dataset=synthetic", "--data.num_clients=3", "--data.partition=iid", "--data.synthetic.train_size=120",
         "--data.synthetic.test_size=30", "--data.synthetic.dim=8", "--data.synthetic.num_classes=3"]
#: a plain fit of each method, so that every tier fits models too
FITS = (Case(["--model=AFL", *SMALL]), Case(["--model=FedAvg", *FEDAVG_FAST, *SMALL]),
        Case(["--model=GHOFL", "--model.heads=[lda, nb_diag]", *SMALL]))


def plain_files() -> tuple[Case, ...]:
    """A clean parquet file of features with its writers, and a clean image folder."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rows = [{"emb": [float(i % 3), float(i % 5), 1.0], "label": i % 3, "writer": f"w{i % 4}"} for i in range(40)]
    parquet = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    images = {}
    for split, count in (("train", 4), ("test", 2)):
        for label, colour in zip("abc", ((200, 20, 20), (20, 200, 20), (20, 20, 200)), strict=True):
            for i in range(count):
                png = io.BytesIO()
                Image.new("RGB", (8, 8), colour).save(png, format="PNG")
                images[f"images/{split}/{label}/{i}.png"] = png.getvalue()
    return (Case(["--model=AFL", "--data.dataset=hf", "--data.hf.path={folder}/features.parquet",
                  "--data.hf.feature_column=emb", "--data.hf.client_column=writer", "--data.partition=natural",
                  "--data.num_clients=4"], {"features.parquet": parquet.getvalue()}),
            Case(["--model=FedAvg", *FEDAVG_FAST, "--data.dataset=hf", "--data.hf.path={folder}/images",
                  "--data.hf.image_column=image", "--data.inputs=images", "--data.num_clients=2",
                  "--data.partition=iid"], images))


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fuzz_the_command_line_on_synthetic_data(tier, capsys, tmp_path):
    fuzz("cli", tier, synthetic_cases(), capsys, tmp_path, explicit=FITS)


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fuzz_small_malformed_files(tier, quiet_hf, capsys, tmp_path):
    fuzz("files", tier, hf_cases(), capsys, tmp_path, explicit=plain_files())


@pytest.mark.parametrize("args", [
    ["--model=FedAvg", *FEDAVG_FAST, "--model.architecture=cnn"],
    ["--model=GHOFL", "--model.heads=[lda]", "--model.sketch_dim=8"],
    ["--model=AFL", "--stopping.patience=1"],
], ids=["cnn-on-features", "ghofl-sketch-as-wide-as-the-data", "stopping-without-validation"])
def test_a_method_that_cannot_take_the_data_claims_no_run_folder(args, capsys, tmp_path):
    """Found by the fuzz: these checks ran in the fit, once the run folder was claimed."""
    status, err = run_case(Case([*args, *SMALL]), tmp_path, capsys)
    assert status == 2 and err.startswith("error: ")


# ---- more of what it found, as plain regression tests ------------------------------------------


def test_a_value_of_the_wrong_type_is_one_line_naming_the_setting(capsys, tmp_path):
    _, err = run_case(Case(["--model=AFL", *SMALL, "--data.num_clients=abc"]), tmp_path, capsys)
    assert "error: data.num_clients must be an integer, got 'abc'" in err


@pytest.mark.parametrize("args", [["--model=AFL", "--model.dtype=x"], ["--model=AFL", "--model.dtype=int"],
                                  ["--model=AFL", "--model.dtype=float16"], ["--model=GHOFL", "--model.dtype=x"]],
                         ids=["afl-x", "afl-int", "afl-float16", "ghofl-x"])
def test_a_dtype_the_solve_cannot_use_is_a_user_error(args, capsys, tmp_path):
    status, err = run_case(Case([*args, *SMALL]), tmp_path, capsys)
    assert status == 2 and "dtype must be one of float32, float64" in err


def test_afl_on_raw_images_is_a_user_error(quiet_hf, capsys, tmp_path):
    from PIL import Image

    for split, count in (("train", 4), ("test", 2)):
        for label in "ab":
            (tmp_path / "images" / split / label).mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (8, 8), (200 * (label == "a"), 90, i))
                image.save(tmp_path / "images" / split / label / f"{i}.png")
    status, err = run_case(Case(["--model=AFL", "--data.dataset=hf", f"--data.hf.path={tmp_path / 'images'}",
                                 "--data.hf.image_column=image", "--data.inputs=images", "--data.num_clients=2",
                                 "--data.partition=iid"]), tmp_path, capsys)
    assert status == 2 and "AFL fits on feature vectors" in err
