"""Your own data: any Hugging Face `datasets` dataset as `data.dataset: hf`.

`OwnData` (the `data.hf` settings) names where the data is and which columns hold what:
- `path`: a local folder (an image folder with one subfolder per class, a folder of CSV/JSON/
  parquet files, or a `Dataset.save_to_disk` folder), a single `.csv`/`.parquet`/`.json(l)` file,
  or a builder or hub name (`csv`, `imagefolder`, `user/dataset`) with `data_files`;
- exactly one input column: `image_column` (images go through an image backbone),
  `text_column` (a text backbone) or `feature_column` (precomputed features, one fixed-length
  numeric vector per row: they go straight to the methods and no backbone runs);
- `label_column` (a `ClassLabel`, or integer classes 0..C−1: `class_count` says when the labels
  alone may set C, else `num_classes` declares it), and optionally `client_column` (who holds
  each row: writer, user, device), which `partition: natural` uses.
A dataset without the `test_split` gets a seeded split stratified by label.

Everything about the data is checked before any backbone runs, and bad data raises one
ValueError naming the setting or the rows and what to do. Hugging Face `datasets` is an optional
extra (`pip install -e '.[hf]'`), imported only when this kind of dataset is loaded.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = ["FeatureSplit", "OwnData", "OwnDataset", "load_own_data", "own_modality"]

INSTALL_HINT = "pip install -e '.[hf]'"
SUFFIX_BUILDERS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".json": "json",
                   ".jsonl": "json", ".arrow": "arrow"}
IMAGE_MODES = {"L": 1, "RGB": 3}  # the two layouts an ImageSplit holds: (H, W) and (H, W, 3)
OwnModality = Literal["image", "text", "features"]


@dataclass(frozen=True)
class OwnData:
    """Settings of `data.dataset: hf` (see the module docstring).

    path: a folder, a file, or a builder/hub name; data_files: files or globs for a builder
        name (a dict maps split names to files).
    image_column, text_column, feature_column: set exactly one.
    label_column: integer class of each row (a `ClassLabel` gives the class names).
    num_classes: the number of classes C of a plain integer label column, every label in 0..C−1
        and any class free to be absent; None: C from the labels (`class_count`), or from the
        ClassLabel's names.
    client_column: natural client of each row (any ints or strings), for `partition: natural`
        or a Flower partitioner with `by: client`.
    train_split: the split partitioned over the clients.
    test_split: the evaluation split; None means `test` when the dataset has one, else a seeded
        split of `test_fraction` of each class of the train split (seed `split_seed`).
    image_size: resize every image to image_size × image_size (bilinear, aspect ratio not
        kept); without it, images of different sizes are an error.
    image_mode: convert every image to `L` (grayscale) or `RGB`; without it, images must share
        one of these two modes.
    """

    path: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    image_column: str | None = None
    text_column: str | None = None
    feature_column: str | None = None
    label_column: str = "label"
    num_classes: int | None = None
    client_column: str | None = None
    train_split: str = "train"
    test_split: str | None = None
    test_fraction: float = 0.2
    split_seed: int = 0
    image_size: int | None = None
    image_mode: str | None = None

    def input_column(self) -> tuple[OwnModality, str]:
        """(modality, column): `image`, `text` or `features`, and the column that holds it."""
        columns: tuple[tuple[OwnModality, str | None], ...] = (("image", self.image_column),
                                                                ("text", self.text_column),
                                                                ("features", self.feature_column))
        chosen = [(kind, column) for kind, column in columns if column]
        if len(chosen) != 1:
            raise ValueError(
                "data.hf needs exactly one input column: set data.hf.image_column (images), "
                "data.hf.text_column (texts) or data.hf.feature_column (precomputed features), "
                f"got {len(chosen)}")
        return chosen[0]

    def check(self) -> None:
        """What can be checked before loading: ValueError naming the setting."""
        if not self.path:
            raise ValueError("data.dataset=hf needs data.hf.path: a folder, a .csv/.parquet/.json "
                             "file, a save_to_disk folder, or a builder/hub name with data.hf.data_files")
        local = Path(str(self.path)).expanduser()
        if str(self.path).startswith((".", "/", "~")) and not local.exists():
            raise ValueError(f"data.hf.path {local} does not exist: point it at your folder or file")
        self.input_column()
        if self.num_classes is not None and (isinstance(self.num_classes, bool) or not isinstance(
                self.num_classes, int) or self.num_classes < 1):
            raise ValueError(f"data.hf.num_classes must be a whole number ≥ 1 (or null), got {self.num_classes!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"data.hf.test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.image_size is not None and self.image_size < 1:
            raise ValueError(f"data.hf.image_size must be ≥ 1, got {self.image_size}")
        if self.image_mode is not None and self.image_mode not in IMAGE_MODES:
            raise ValueError(f"data.hf.image_mode must be one of {list(IMAGE_MODES)} or null, "
                             f"got {self.image_mode!r}")

    def cache_name(self) -> str:
        """A readable name for the feature-cache folder and logs: `hf-<folder or file stem>`."""
        return "hf-" + Path(str(self.path).rstrip("/")).stem


def own_modality(settings: OwnData) -> OwnModality:
    """`image`, `text` or `features`, known without loading anything."""
    return settings.input_column()[0]


@dataclass(frozen=True)
class FeatureSplit:
    """Precomputed features (N, d) float32 and int64 labels (N,)."""

    features: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class OwnDataset:
    """A loaded own dataset.

    data: an ImageDataset or TextDataset (the backbone turns it into features), or, for
        precomputed features, an object with `train`/`test` FeatureSplits, `classes`, `source`.
    train_client_ids: int64 (N_train,), the rank of each row's client-column value among the
        sorted distinct values; None without a client column.
    """

    data: Any
    train_client_ids: Tensor | None
    client_names: tuple[str, ...]


@dataclass(frozen=True)
class _Features:
    name: str
    train: FeatureSplit
    test: FeatureSplit
    classes: tuple[str, ...]
    source: str


def _datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"data.dataset=hf needs Hugging Face datasets: {INSTALL_HINT}") from error
    # its bars ("Downloading data" of local files, "Generating train split") say nothing the
    # extraction's own progress does not, and would surround an error about the data
    datasets.disable_progress_bars()
    return datasets


def _local_files(settings: OwnData) -> list[Path]:
    """The local files the data is read from (for the cache key); empty for a hub dataset."""
    candidates = [settings.path]
    files = settings.data_files
    candidates += list(files.values()) if isinstance(files, dict) else \
        ([files] if isinstance(files, str) else list(files or []))
    found: list[Path] = []
    for candidate in candidates:
        path = Path(str(candidate)).expanduser()
        if path.is_dir():
            found += [p for p in path.rglob("*") if p.is_file()]
        elif path.is_file():
            found.append(path)
        else:
            found += [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    return sorted(set(found))


def _identity(settings: OwnData, fingerprint: str) -> str:
    """What the features depend on: the files' identity (path, size, mtime), or the hub
    dataset's fingerprint, and every setting that selects or transforms rows."""
    files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in _local_files(settings)]
    # num_classes selects no rows and changes no input: out of the key, so caches written before it stay valid
    chosen = {name: value for name, value in asdict(settings).items() if name != "num_classes"}
    blob = json.dumps({"settings": chosen,
                       "files": files if files else None,
                       "fingerprint": None if files else fingerprint}, sort_keys=True, default=str)
    return f"hf {settings.path} sha256:{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


def _load_splits(settings: OwnData, cache_dir: Path) -> dict[str, Any]:
    """The dataset's splits as {name: datasets.Dataset}."""
    datasets = _datasets()
    library_log = logging.getLogger("datasets")
    level = library_log.level
    library_log.setLevel(logging.CRITICAL)  # its note of a file it failed to read: the ValueError below says it
    try:
        loaded = _load(datasets, settings, cache_dir)
    # what datasets raises on files it cannot read: besides its own errors, the parsers' (pandas,
    # pyarrow: ValueErrors), TypeError for a JSON line that is not an object, StopIteration for an
    # empty JSON file
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError, datasets.exceptions.DatasetGenerationError,
            ValueError, TypeError, StopIteration) as error:
        if "corresponds to no data" in str(error) or isinstance(error, StopIteration):  # an empty split
            raise ValueError(f"a split of data.hf.path={settings.path!r} (data_files={settings.data_files!r}) "
                             f"is empty ({_why(error) or 'no rows'}): give every split rows") from error
        raise ValueError(f"Hugging Face datasets cannot load data.hf.path={settings.path!r} "
                         f"(data_files={settings.data_files!r}): {_why(error)}") from error
    finally:
        library_log.setLevel(level)
    if isinstance(loaded, datasets.Dataset):
        loaded = {"train": loaded}
    return dict(loaded)


def _why(error: BaseException, limit: int = 300) -> str:
    """A library's error in one line of at most `limit` characters, with what caused it (datasets
    says only that generating the dataset failed; the parser that failed says why)."""
    cause = error.__cause__ or error.__context__
    text = " ".join(str(error).split())
    if cause is not None and str(cause).strip() and str(cause) != str(error):
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _load(datasets: Any, settings: OwnData, cache_dir: Path) -> Any:
    path = Path(str(settings.path)).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return datasets.load_from_disk(str(path))  # a save_to_disk folder
    elif path.is_file():
        builder = SUFFIX_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"data.hf.path {path} has suffix {path.suffix!r}; known file types: "
                             f"{', '.join(SUFFIX_BUILDERS)} (or point data.hf.path at a folder)")
        return datasets.load_dataset(builder, data_files=str(path), cache_dir=str(cache_dir))
    else:
        where = str(path) if path.is_dir() else str(settings.path)
        return datasets.load_dataset(where, data_files=settings.data_files, cache_dir=str(cache_dir))


def _labels(split: Any, column: str, where: str, declared: int | None) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """Integer labels of a split and the class names a ClassLabel column carries; every label in
    0..C−1 where C is declared (the ClassLabel's names, or `declared`), else ≥ 0."""
    import datasets

    feature = split.features[column]
    values = np.asarray(split[column])
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"data.hf.label_column {column!r} of {where} holds {values.dtype} values "
            f"(e.g. {values[:3].tolist()}), not integer classes: store integer class indices, or "
            f"make it a ClassLabel first (datasets: `ds.class_encode_column({column!r})`)")
    names = tuple(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    if names and declared is not None and declared != len(names):
        raise ValueError(f"data.hf.num_classes={declared} but data.hf.label_column {column!r} is a ClassLabel "
                         f"of {len(names)} names: drop data.hf.num_classes (the names set the classes)")
    count = len(names) if names else declared
    bad = (values < 0) | (values >= count if count else False)
    if bad.any():
        limit = ("≥ 0" if count is None else f"0..{count - 1} (its {count} ClassLabel names)" if names else
                 f"0..{count - 1} (data.hf.num_classes={count})")
        raise ValueError(f"data.hf.label_column {column!r} of {where} has {int(bad.sum())} labels "
                         f"outside {limit}, e.g. {values[bad][:3].tolist()}: fix or drop those rows")
    return values.astype(np.int64), names


MAX_ABSENT = 0.10  # the share of the classes 0..max label that may have no row when the labels set C


def class_count(labels: Tensor, column: str = "label") -> int:
    """C from non-negative integer labels (N,), N ≥ 1, without declared classes: max + 1, accepted
    when at most 10 % of the classes 0..max have no row (absent ≤ 0.1 · (max + 1); of 10 classes
    one may be absent). Otherwise one ValueError naming the largest label values, their rows and
    the fix: a stray label 50,000 among 0..9 would otherwise make a 50,001-class model, its
    uploads thousands of times larger, without a word.

    Memory and time are O(N log N) whatever the values (distinct values by sorting: nothing of
    the size of the largest label is ever allocated).
    """
    values, rows = torch.unique(labels, return_counts=True)  # sorted
    count, present = int(values[-1]) + 1, len(values)
    if (count - present) <= MAX_ABSENT * count:
        return count
    largest = ", ".join(f"{int(v)} ({int(n)} row{'s' if n > 1 else ''})"
                        for v, n in zip(values[-3:].flip(0), rows[-3:].flip(0), strict=True))
    raise ValueError(f"data.hf.label_column {column!r} does not hold class indices 0..C-1: its labels run up to "
                     f"{count - 1}, so {count:,} classes, of which {present} occur{'s' if present == 1 else ''} (at "
                     f"most {MAX_ABSENT:.0%} may be absent); the largest labels are {largest}: remap the labels "
                     "to 0..C-1, or declare the number of classes in data.hf.num_classes")


def _images(split: Any, settings: OwnData, where: str) -> Tensor:
    """uint8 (N, H, W) or (N, H, W, 3) from a column of images, after the checks."""
    from PIL import Image

    column = settings.image_column
    try:
        images = list(split[column])  # decodes every image (once: a column decodes on every pass)
    except (OSError, SyntaxError, ValueError) as error:  # what PIL raises on a file it cannot decode
        raise ValueError(f"data.hf.image_column {column!r} of {where}: an image cannot be decoded ({_why(error)}): "
                         "replace or delete that file") from error
    if images and not isinstance(images[0], Image.Image):
        raise ValueError(f"data.hf.image_column {column!r} of {where} holds {type(images[0]).__name__} "
                         "values, not images: name a column of images (an image folder's is `image`)")
    modes = sorted({image.mode for image in images})
    mode = settings.image_mode or (modes[0] if len(modes) == 1 else None)
    if mode not in IMAGE_MODES:
        raise ValueError(f"images of {where} have mode(s) {modes}: set data.hf.image_mode to RGB or L "
                         "to convert them all")
    sizes = sorted({image.size for image in images})
    if settings.image_size is None and len(sizes) > 1:
        raise ValueError(f"images of {where} have {len(sizes)} different sizes (width × height: "
                         f"{sizes[:4]}{' ...' if len(sizes) > 4 else ''}): set data.hf.image_size to "
                         "resize them all to one square size (bilinear, aspect ratio not kept)")
    size = (settings.image_size, settings.image_size) if settings.image_size else sizes[0]
    arrays = [np.asarray((image if image.mode == mode else image.convert(mode))
                         .resize(size, Image.Resampling.BILINEAR) if image.size != size or image.mode != mode
                         else image) for image in images]
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)).astype(np.uint8, copy=False))


def _texts(split: Any, column: str, where: str) -> tuple[str, ...]:
    texts = split[column]
    bad = [i for i, text in enumerate(texts) if not isinstance(text, str)]
    if bad:
        raise ValueError(f"data.hf.text_column {column!r} of {where} has {len(bad)} rows that are not "
                         f"text (rows {bad[:5]}, e.g. {texts[bad[0]]!r}): fill or drop them")
    return tuple(texts)


def _features(split: Any, column: str, where: str) -> Tensor:
    try:
        values = np.asarray(split.with_format("numpy")[column])
        if values.dtype == object:  # rows of different lengths stay a ragged object array
            values = np.stack(list(values))
    except ValueError:
        raise ValueError(f"data.hf.feature_column {column!r} of {where} holds vectors of different "
                         "lengths: every row needs the same number of features") from None
    if values.ndim != 2 or not np.issubdtype(values.dtype, np.number):
        raise ValueError(f"data.hf.feature_column {column!r} of {where} must hold one numeric vector "
                         f"per row, got an array of shape {values.shape} and dtype {values.dtype}")
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _stratified_test_mask(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    from workbench.data.partition import stratified_holdout

    return stratified_holdout(torch.from_numpy(labels), fraction, seed).numpy()


def load_own_data(settings: OwnData, data_dir: str | Path) -> OwnDataset:
    """Load, check and convert the dataset `settings` describe. Raises ValueError on bad data."""
    from workbench.data.datasets import ImageDataset, ImageSplit
    from workbench.data.text import TextDataset, TextSplit

    settings.check()
    kind, column = settings.input_column()
    splits = _load_splits(settings, Path(data_dir).expanduser() / "hf_cache")
    if settings.train_split not in splits:
        raise ValueError(f"data.hf.train_split {settings.train_split!r} is not in {settings.path}; "
                         f"its splits: {sorted(splits)}")
    test_name = settings.test_split or ("test" if "test" in splits else None)
    if test_name is not None and test_name not in splits:
        raise ValueError(f"data.hf.test_split {test_name!r} is not in {settings.path}; its splits: "
                         f"{sorted(splits)} (or leave test_split null for a seeded split)")
    train = splits[settings.train_split]
    needed = [c for c in (column, settings.label_column, settings.client_column) if c]
    for name, split in ((settings.train_split, train),
                        (test_name, None if test_name is None else splits.get(test_name))):
        if split is None:
            continue
        missing = [c for c in needed if c not in split.column_names]
        if missing == [settings.label_column] and kind == "image" and split.column_names == [column]:
            raise ValueError(f"split {name!r} of {settings.path} has images but no labels: an image folder has "
                             "labels when its images lie in two or more class subfolders (<split>/<class>/<file>)")
        if missing:
            raise ValueError(f"split {name!r} of {settings.path} has no column(s) {missing}; its "
                             f"columns: {split.column_names}: set data.hf.*_column accordingly")
        if len(split) == 0:
            raise ValueError(f"split {name!r} of {settings.path} is empty")

    def inputs_of(split: Any, where: str) -> Any:
        return (_images(split, settings, where) if kind == "image" else
                _texts(split, column, where) if kind == "text" else _features(split, column, where))

    # The labels first, and the number of classes from them: before any input is decoded, and
    # before anything sized by the labels (the stratified split counts rows per label value).
    where_train, where_test = f"split {settings.train_split!r}", f"split {test_name!r}"
    train_labels, names = _labels(train, settings.label_column, where_train, settings.num_classes)
    test_labels = (None if test_name is None else
                   _labels(splits[test_name], settings.label_column, where_test, settings.num_classes)[0])
    every_label = train_labels if test_labels is None else np.concatenate([train_labels, test_labels])
    num_classes = (len(names) if names else settings.num_classes
                   or class_count(torch.from_numpy(every_label), settings.label_column))
    if num_classes < 2:
        given = ("its ClassLabel has 1 name" if names else "data.hf.num_classes=1" if settings.num_classes
                 else "every label is 0")
        raise ValueError(f"data.hf.label_column {settings.label_column!r} holds 1 class ({given}); a classifier "
                         "needs at least two: add rows of another class"
                         + ("" if names else ", or declare data.hf.num_classes ≥ 2"))

    train_inputs = inputs_of(train, where_train)
    client_values = np.asarray(train[settings.client_column]) if settings.client_column else None
    if test_name is not None:
        test_inputs = inputs_of(splits[test_name], where_test)
    else:
        is_test = _stratified_test_mask(train_labels, settings.test_fraction, settings.split_seed)
        if is_test.all() or not is_test.any():
            raise ValueError(f"a test_fraction of {settings.test_fraction} of {len(train_labels)} rows "
                             "leaves an empty split: add rows or change data.hf.test_fraction")
        pick = (lambda x, m: tuple(np.asarray(x, dtype=object)[m])) if kind == "text" else (lambda x, m: x[m])
        test_inputs, test_labels = pick(train_inputs, is_test), train_labels[is_test]
        train_inputs, train_labels = pick(train_inputs, ~is_test), train_labels[~is_test]
        client_values = client_values[~is_test] if client_values is not None else None

    if kind == "features" and train_inputs.shape[1] != test_inputs.shape[1]:
        raise ValueError(f"train features have {train_inputs.shape[1]} columns but test features "
                         f"{test_inputs.shape[1]}: both splits need features of the same model")
    classes = names or tuple(str(c) for c in range(num_classes))
    client_ids: Tensor | None = None
    client_names: tuple[str, ...] = ()
    if client_values is not None:
        empty_rows = [i for i, v in enumerate(client_values) if v is None]
        if empty_rows or client_values.dtype == object:  # None cells, or mixed types
            raise ValueError(f"data.hf.client_column {settings.client_column!r} has {len(empty_rows)} empty train "
                             f"rows (e.g. rows {empty_rows[:5]}) or mixes types: every row needs its client id, "
                             "all integers or all strings")
        unique, inverse = np.unique(client_values, return_inverse=True)  # ids in sorted order
        client_ids, client_names = torch.from_numpy(inverse.astype(np.int64)), tuple(map(str, unique))

    source = _identity(settings, getattr(train, "_fingerprint", ""))
    name = settings.cache_name()
    labels_t = (torch.from_numpy(train_labels), torch.from_numpy(test_labels))
    data: ImageDataset | TextDataset | _Features
    if kind == "image":
        data = ImageDataset(name, ImageSplit(train_inputs, labels_t[0]), ImageSplit(test_inputs, labels_t[1]),
                            classes, source)
    elif kind == "text":
        data = TextDataset(name, TextSplit(tuple(train_inputs), labels_t[0]),
                           TextSplit(tuple(test_inputs), labels_t[1]), classes, source)
    else:
        data = _Features(name, FeatureSplit(train_inputs, labels_t[0]), FeatureSplit(test_inputs, labels_t[1]),
                         classes, source)
    return OwnDataset(data, client_ids, client_names)
