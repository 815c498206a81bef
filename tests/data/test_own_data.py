"""Your own data (`data.dataset: hf`): image folders, parquet/CSV/JSON files and save_to_disk
folders the tests write, each run through the CLI; natural partitions; bad data fails early."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets", reason="pip install -e '.[hf]'")  # the module skips without it

from tests.conftest import centralized_ridge, last_run, metrics, relative_error  # noqa: E402
from workbench.cli import main  # noqa: E402
from workbench.data import FederatedDataModule  # noqa: E402
from workbench.data.hf import OwnData, load_own_data  # noqa: E402
from workbench.methods import AFL  # noqa: E402

COLORS = np.array([(220, 30, 30), (30, 220, 30), (30, 30, 220)])


def image_folder(root: Path, per_class: dict[str, int] | None = None, size=(12, 12),
                 mode: str = "RGB") -> Path:
    """root/<split>/<class>/<i>.png (`per_class[split]` images each): one colour per class plus noise."""
    from PIL import Image

    per_class = per_class or {"train": 8, "test": 3}
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for label, name in enumerate(("red", "green", "blue")):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(COLORS[label] + rng.normal(0, 20, (*size[::-1], 3)), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).convert(mode).save(root / split / name / f"{i}.png")
    return root


def blobs_table(n: int = 600, dim: int = 8, num_writers: int = 12, seed: int = 0) -> dict[str, list]:
    """Precomputed features of 4 Gaussian classes, each row written by one of `num_writers`."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    means = rng.normal(0, 3, (4, dim))
    features = means[labels] + rng.normal(0, 1, (n, dim))
    writers = [f"writer{w:02d}" for w in rng.integers(0, num_writers, n)]
    return {"emb": features.tolist(), "label": labels.tolist(), "writer": writers}


def cli(tmp_path: Path, *args: str) -> Path:
    main(["fit", "--model=AFL", "--model.gamma_out=1.0", "--data=FederatedDataModule", "--data.dataset=hf",
          f"--data.data_dir={tmp_path / 'data'}", f"--data.cache_dir={tmp_path / 'cache'}",
          "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path / 'runs'}", *args])
    return last_run(tmp_path / "runs")


def test_image_folder_through_the_cli(tmp_path):
    folder = image_folder(tmp_path / "colours")
    run = cli(tmp_path, f"--data.hf.path={folder}", "--data.hf.image_column=image",
              "--data.input_size=32", "--data.num_clients=3", "--data.partition=iid")
    assert metrics(run)["test/acc"] > 0.6  # three flat colours; chance is 1/3
    cached = list((tmp_path / "cache" / "hf-colours").glob("*.pt"))
    assert len(cached) == 2  # train and test features, under the folder's own cache name


def test_parquet_features_skip_the_backbone_and_natural_gives_one_client_per_writer(tmp_path):
    import pandas as pd

    table = blobs_table()
    file = tmp_path / "features.parquet"
    pd.DataFrame(table).to_parquet(file)
    run = cli(tmp_path, f"--data.hf.path={file}", "--data.hf.feature_column=emb",
              "--data.hf.client_column=writer", "--data.partition=natural", "--data.num_clients=12")
    assert metrics(run)["test/acc"] > 0.9
    assert not (tmp_path / "cache").exists()  # no backbone ran, nothing was cached
    own = load_own_data(OwnData(path=str(file), feature_column="emb", client_column="writer"), tmp_path)
    assert own.client_names == tuple(sorted(set(table["writer"])))


def test_csv_of_texts_through_the_cli_with_a_seeded_test_split(tmp_path):
    pytest.importorskip("transformers", reason="pip install -e '.[text]'")
    rows = [("the match ended with a late goal", 0), ("the striker scored twice", 0),
            ("shares fell as markets closed", 1), ("the bank raised interest rates", 1)] * 5
    file = tmp_path / "news.csv"
    file.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))
    run = cli(tmp_path, f"--data.hf.path={file}", "--data.hf.text_column=text",
              "--data.backbone=all_minilm_l6_v2", "--data.num_clients=2", "--data.partition=iid")
    assert metrics(run)["test/acc"] == 1.0  # 4 held-out copies of training sentences


def test_save_to_disk_folder_and_json_files_load_the_same_rows(tmp_path):
    table = blobs_table(n=50)
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_dict(table).to_json(str(tmp_path / "rows.jsonl"))
    loaded = [load_own_data(OwnData(path=str(path), feature_column="emb"), tmp_path).data
              for path in (tmp_path / "saved", tmp_path / "rows.jsonl")]
    for split in ("train", "test"):
        assert torch.equal(getattr(loaded[0], split).features, getattr(loaded[1], split).features)
    # the seeded split holds out 20 % of each class
    assert len(loaded[0].test) == sum(round(0.2 * c) for c in np.bincount(table["label"]))


@pytest.mark.parametrize("num_clients", [12, 5])
@pytest.mark.parametrize("gamma_out", [0.0, 0.5])
def test_afl_is_centralized_ridge_on_natural_partitions(fit_method, tmp_path, num_clients, gamma_out):
    file = tmp_path / "features.parquet"
    datasets.Dataset.from_dict(blobs_table(dim=24)).to_parquet(str(file))
    dm = FederatedDataModule(dataset="hf", hf=OwnData(path=str(file), feature_column="emb", client_column="writer"),
                             partition="natural", num_clients=num_clients, data_dir=str(tmp_path), batch_size=64)
    dm.setup()
    assert torch.bincount(dm.train_client_ids, minlength=num_clients).min() > 0
    method = AFL(gamma=1.0, gamma_out=gamma_out)
    fit_method(method, dm)
    assert relative_error(method.weight, centralized_ridge(dm, gamma_out)) <= 1e-8


def test_natural_ids_are_grouped_whole_when_there_are_fewer_clients(tmp_path):
    from workbench.data.partition import natural

    ids = np.repeat(np.arange(10), 3) * 7  # ten writers with arbitrary ids
    clients = natural(ids, 4, seed=1)
    assert all(len(set(clients[ids == w])) == 1 for w in np.unique(ids))  # no writer split
    assert sorted(np.bincount(clients) // 3) == [2, 2, 3, 3]  # 10 writers over 4 clients
    assert np.array_equal(natural(ids, 10), ids // 7)  # one client per id, in id order
    with pytest.raises(ValueError, match="at most 10"):
        natural(ids, 11)


def test_cache_key_follows_the_files(tmp_path):
    file = tmp_path / "features.parquet"
    settings = OwnData(path=str(file), feature_column="emb")
    datasets.Dataset.from_dict(blobs_table(n=40)).to_parquet(str(file))
    first = load_own_data(settings, tmp_path).data.source
    assert load_own_data(settings, tmp_path).data.source == first
    declared = OwnData(path=str(file), feature_column="emb", num_classes=7)  # the classes are not the features
    assert load_own_data(declared, tmp_path).data.source == first
    os.utime(file, ns=(0, 10**9))  # same bytes, other mtime: a new key
    assert load_own_data(settings, tmp_path).data.source != first
    assert load_own_data(OwnData(path=str(file), feature_column="emb", test_fraction=0.3),
                         tmp_path).data.source != first


def test_json_lines_features_with_a_flower_partitioner_through_the_cli(tmp_path):
    pytest.importorskip("flwr_datasets", reason="pip install -e '.[hf]'")
    file = tmp_path / "features.jsonl"
    datasets.Dataset.from_dict(blobs_table()).to_json(str(file))
    run = cli(tmp_path, f"--data.hf.path={file}", "--data.hf.feature_column=emb", "--data.num_clients=4",
              "--data.partition=flower", "--data.flower={partitioner: linear}")
    assert metrics(run)["test/acc"] > 0.9


# --------------------------------------------------------------------------- bad data


def own(tmp_path: Path, table: dict, **settings) -> FederatedDataModule:
    file = tmp_path / "data.parquet"
    datasets.Dataset.from_dict(table).to_parquet(str(file))
    return FederatedDataModule(dataset="hf", hf=OwnData(path=str(file), **settings), data_dir=str(tmp_path),
                               num_clients=2, partition="iid")


@pytest.mark.parametrize("change, message", [
    ({"label_column": "class"}, r"no column\(s\) \['class'\]"),
    ({"feature_column": None}, "exactly one input column"),
    ({"feature_column": "emb", "text_column": "writer"}, "exactly one input column"),
    ({"test_split": "validation"}, "'validation' is not in"),
    ({"test_fraction": 1.5}, "test_fraction must be in"),
])
def test_bad_settings_name_the_setting(tmp_path, change, message):
    settings = {"feature_column": "emb", **change}
    with pytest.raises(ValueError, match=message):
        own(tmp_path, blobs_table(n=40), **settings).setup()


def test_bad_labels_are_clear_errors(tmp_path):
    table = blobs_table(n=40)
    with pytest.raises(ValueError, match=r"not integer classes.*class_encode_column"):
        own(tmp_path, {**table, "label": [str(v) for v in table["label"]]}, feature_column="emb").setup()
    with pytest.raises(ValueError, match="1 labels outside"):
        own(tmp_path, {**table, "label": [-1, *table["label"][1:]]}, feature_column="emb").setup()
    with pytest.raises(ValueError, match="not integer classes"):
        own(tmp_path, {**table, "label": [v + 0.5 for v in table["label"]]}, feature_column="emb").setup()


def ten_classes(labels: list[int]) -> dict[str, list]:
    """Precomputed features (4 numbers a row) of the given labels."""
    rng = np.random.default_rng(0)
    return {"emb": rng.normal(0, 1, (len(labels), 4)).tolist(), "label": labels}


def test_a_stray_label_is_one_error_naming_it_and_the_fix_before_any_input_is_read(tmp_path, monkeypatch):
    import workbench.data.hf as hf

    def never(*args):
        raise AssertionError("the inputs were read before the labels were checked")

    monkeypatch.setattr(hf, "_features", never)
    labels = [i % 10 for i in range(200)]
    labels[17] = 50_000
    with pytest.raises(ValueError) as error:
        own(tmp_path, ten_classes(labels), feature_column="emb").setup()
    assert str(error.value) == (
        "data.hf.label_column 'label' does not hold class indices 0..C-1: its labels run up to 50000, so 50,001 "
        "classes, of which 11 occur (at most 10% may be absent); the largest labels are 50000 (1 row), 9 (20 rows), "
        "8 (20 rows): remap the labels to 0..C-1, or declare the number of classes in data.hf.num_classes")


def test_a_label_of_a_billion_is_the_error_in_little_time_and_memory(tmp_path):
    import resource
    import time

    labels = [i % 10 for i in range(200)]
    labels[3] = labels[150] = 10**9
    dm = own(tmp_path, ten_classes(labels), feature_column="emb")
    peak_kib, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(ValueError, match=r"up to 1000000000, so 1,000,000,001 classes, of which 11 occur"
                                         r".*are 1000000000 \(2 rows\), 9 \(20 rows\)"):
        dm.setup()
    assert time.perf_counter() - start < 10
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib) / 1024  # (a bincount: 8 GB)
    assert grown_mib < 500, f"the peak memory grew by {grown_mib:.0f} MiB"


def test_a_class_without_rows_among_ten_is_still_ten_classes(tmp_path):
    labels = [i % 10 for i in range(200) if i % 10 != 4]
    dm = own(tmp_path, ten_classes(labels), feature_column="emb")
    dm.setup()
    assert dm.num_classes == 10 and 4 not in dm.train_labels.tolist()
    with pytest.raises(ValueError, match=r"up to 9, so 10 classes, of which 8 occur"):
        own(tmp_path, ten_classes([v for v in labels if v != 8]), feature_column="emb").setup()  # two absent


def test_declared_classes_may_be_sparse_and_bound_the_labels(tmp_path):
    labels = [(0, 5, 9)[i % 3] for i in range(60)]
    dm = own(tmp_path, ten_classes(labels), feature_column="emb", num_classes=10)
    dm.setup()
    assert dm.num_classes == 10
    with pytest.raises(ValueError, match=r"20 labels outside 0..8 \(data.hf.num_classes=9\), e.g. \[9, 9, 9\]"):
        own(tmp_path, ten_classes(labels), feature_column="emb", num_classes=9, test_split="train").setup()
    with pytest.raises(ValueError, match=r"data\.hf\.num_classes must be a whole number ≥ 1"):
        own(tmp_path, ten_classes(labels), feature_column="emb", num_classes=0)


def test_a_stray_label_through_the_command_is_exit_status_2_and_two_lines(tmp_path, capsys):
    from workbench.__main__ import main as command

    labels = [i % 10 for i in range(200)]
    labels[17] = 50_000
    file = tmp_path / "features.parquet"
    datasets.Dataset.from_dict(ten_classes(labels)).to_parquet(str(file))
    capsys.readouterr()
    status = command(["fit", "--model=AFL", "--data=FederatedDataModule", "--data.dataset=hf", f"--data.hf.path={file}",
                      "--data.hf.feature_column=emb", f"--data.data_dir={tmp_path / 'data'}", "--data.partition=iid",
                      "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path / 'runs'}", "--wandb=disabled"])
    err = capsys.readouterr().err.strip().splitlines()  # (and no progress lines of the datasets library)
    assert status == 2 and len(err) == 2, err
    assert err[-2].startswith("error: data.hf.label_column 'label' does not hold class indices 0..C-1: its labels "
                              "run up to 50000")
    assert err[-2].endswith("declare the number of classes in data.hf.num_classes") and "--debug" in err[-1]
    assert not (tmp_path / "runs").exists()  # the data is loaded before the run folder is claimed


def test_one_class_is_an_error_before_any_model(tmp_path):
    table = blobs_table(n=40)
    with pytest.raises(ValueError, match=r"holds 1 class \(every label is 0\); a classifier needs at least two"):
        own(tmp_path, {**table, "label": [0] * 40}, feature_column="emb").setup()
    with pytest.raises(ValueError, match=r"holds 1 class \(data.hf.num_classes=1\)"):
        own(tmp_path, {**table, "label": [0] * 40}, feature_column="emb", num_classes=1).setup()


def test_an_image_folder_of_one_class_is_an_error_saying_why_it_has_no_labels(tmp_path):
    folder = image_folder(tmp_path / "one", {"train": 3})
    for name in ("green", "blue"):
        for file in (folder / "train" / name).iterdir():
            file.unlink()
        (folder / "train" / name).rmdir()
    with pytest.raises(ValueError, match=r"has images but no labels: an image folder has labels when its images lie "
                                         r"in two or more class subfolders"):
        load_own_data(OwnData(path=str(folder), image_column="image"), tmp_path)


def test_images_that_do_not_decode_are_an_error_naming_the_file(tmp_path):
    folder = image_folder(tmp_path / "broken", {"train": 3, "test": 2})
    (folder / "train" / "red" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    with pytest.raises(ValueError, match=r"an image cannot be decoded \(cannot identify image file .*red/1.png"):
        load_own_data(OwnData(path=str(folder), image_column="image"), tmp_path)
    whole = (folder / "train" / "red" / "0.png").read_bytes()
    (folder / "train" / "red" / "1.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"an image cannot be decoded \(image file is truncated.*replace or delete"):
        load_own_data(OwnData(path=str(folder), image_column="image"), tmp_path)


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "", r"is empty \(no rows\)"),
    ("number.jsonl", '{"emb": [1.0], "label": 0}\n42\n', r"not a mapping \(ArrowInvalid: JSON parse error"),
    ("text.jsonl", '{"emb": [1.0], "label": 0}\nnot json\n', r"\(ArrowInvalid: JSON parse error: Invalid value"),
    ("ragged.csv", "emb,label\n1,0\n2,1,3\n", r"\(ParserError: Error tokenizing data.*Expected 2 fields in line 3"),
    ("empty.csv", "", r"\(EmptyDataError: No columns to parse from file\)"),
])
def test_a_file_datasets_cannot_parse_is_one_error_saying_why(tmp_path, name, text, message):
    import logging

    (tmp_path / name).write_text(text)
    noted = []  # datasets' own note of the failed read: the error says it already
    handler = logging.Handler()
    handler.emit = noted.append
    logging.getLogger("datasets").addHandler(handler)
    try:
        with pytest.raises(ValueError, match=message) as error:
            load_own_data(OwnData(path=str(tmp_path / name), feature_column="emb"), tmp_path)
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert "\n" not in str(error.value) and not noted


def test_bad_feature_rows_are_clear_errors(tmp_path):
    table = {"emb": [[1.0, 2.0], [1.0], [3.0, 4.0]] * 5, "label": [0, 1, 1] * 5}
    with pytest.raises(ValueError, match="vectors of different lengths"):
        own(tmp_path, table, feature_column="emb").setup()
    with pytest.raises(ValueError, match="one numeric vector per row"):
        own(tmp_path, {**table, "emb": ["a", "b", "c"] * 5}, feature_column="emb").setup()


def test_nan_in_your_own_features_names_your_file_not_the_cache(tmp_path):
    table = {"emb": [[1.0, 2.0], [float("nan"), 1.0], [3.0, 4.0]] * 10, "label": [0, 1, 1] * 10}
    with pytest.raises(ValueError, match=r"NaN/inf features.*\(they come from your file's 'emb' column, "
                                         rf"{tmp_path / 'data.parquet'}\)") as error:
        own(tmp_path, table, feature_column="emb").setup()
    assert "cache" not in str(error.value)


def test_a_row_without_its_client_is_an_error(tmp_path):
    table = blobs_table(n=40)
    with pytest.raises(ValueError, match=r"1 empty train rows \(e.g. rows \[0\]\)"):
        own(tmp_path, {**table, "writer": [None, *table["writer"][1:]]}, feature_column="emb",
            client_column="writer", test_split="train").setup()


def test_an_empty_split_is_an_error(tmp_path):
    rows = datasets.Dataset.from_dict(blobs_table(n=20))
    rows.to_parquet(str(tmp_path / "train.parquet"))
    rows.select([]).to_parquet(str(tmp_path / "test.parquet"))
    files = {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    with pytest.raises(ValueError, match=r"is empty.*Instruction \"test\""):
        load_own_data(OwnData(path="parquet", data_files=files, feature_column="emb"), tmp_path)


def test_natural_without_a_client_column_fails_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="client_column"):
        FederatedDataModule(dataset="hf", hf=OwnData(path=str(tmp_path), feature_column="emb"),
                            partition="natural")
    with pytest.raises(ValueError, match=r"needs data.hf.path"):
        FederatedDataModule(dataset="hf", hf=OwnData(feature_column="emb"))
    with pytest.raises(ValueError, match="does not exist"):
        FederatedDataModule(dataset="hf", hf=OwnData(path=str(tmp_path / "none"), feature_column="emb"))


def test_a_client_with_no_samples_under_natural_is_an_error(tmp_path):
    dm = own(tmp_path, blobs_table(n=60, num_writers=3), feature_column="emb", client_column="writer")
    dm.partitioning = replace(dm.partitioning, partition="natural", num_clients=5)  # as if configured so
    with pytest.raises(ValueError, match="at most 3"):
        dm.setup()


def test_mixed_image_sizes_and_modes(tmp_path):
    folder = image_folder(tmp_path / "mixed", {"train": 3, "test": 2})
    image_folder(tmp_path / "mixed", {"train": 2}, size=(16, 10))  # overwrites 0.png, 1.png
    with pytest.raises(ValueError, match=r"2 different sizes .* set data.hf.image_size"):
        load_own_data(OwnData(path=str(folder), image_column="image"), tmp_path)
    data = load_own_data(OwnData(path=str(folder), image_column="image", image_size=8), tmp_path).data
    assert data.train.images.shape == (9, 8, 8, 3) and data.classes == ("blue", "green", "red")

    gray = image_folder(tmp_path / "gray", {"train": 2, "test": 1})
    image_folder(tmp_path / "gray", {"train": 1}, mode="L")
    with pytest.raises(ValueError, match=r"mode\(s\) \['L', 'RGB'\].*image_mode"):
        load_own_data(OwnData(path=str(gray), image_column="image"), tmp_path)
    data = load_own_data(OwnData(path=str(gray), image_column="image", image_mode="L"), tmp_path).data
    assert data.train.images.shape == (6, 12, 12)


def test_a_flower_partitioner_on_the_client_column(tmp_path):
    pytest.importorskip("flwr_datasets", reason="pip install -e '.[hf]'")
    file = tmp_path / "features.parquet"
    datasets.Dataset.from_dict(blobs_table()).to_parquet(str(file))  # 12 writers
    hf = OwnData(path=str(file), feature_column="emb", client_column="writer")
    grouped = {"partitioner": "grouped_natural_id", "by": "client", "group_size": 4}
    dm = FederatedDataModule(dataset="hf", hf=hf, data_dir=str(tmp_path), partition="flower", num_clients=3,
                             flower=grouped)
    dm.setup()
    assert torch.bincount(dm.train_client_ids).min() > 0 and dm.train_client_ids.max() == 2
    assert dm.describe()["partition"] == "flower(grouped_natural_id)"
    with pytest.raises(ValueError, match=r"makes 3 partitions.*set num_clients to 3"):
        FederatedDataModule(dataset="hf", hf=hf, data_dir=str(tmp_path), partition="flower", num_clients=5,
                            flower=grouped).setup()
