"""Cross-silo data: each site holds its own rows in its own file, and no machine holds them all.

`SiteData` is the data of such a federation (`data: {class_path: SiteData, ...}`). Deployed (the
Flower engine on a SuperLink), each SuperNode names its own file in its node config —

    flower-supernode ... --node-config 'partition-id=0 num-partitions=3 data-path="/data/site0.parquet"'

— reads it alone, and tells the server its row count and feature width when introduced
(`SiteData.learn`), and its file's name for the server's errors: the server never reads a site's
rows, and its config and the spec the nodes receive name no site's file. In one process (the Lightning
engine, a Flower simulation) `sites` lists the K files instead, site k's rows client k's: the same
fit, row for row.

A site's file (`read_site`): a table — parquet, CSV, JSON lines — with an integer label column and
either one column holding each row's feature vector or one numeric column per feature; a tensor
file — `.pt` (a dict) or `.npz` — holding the features (n, d) and the labels (n,) under those two
column names; or a folder of images, one subfolder per class, whose features the site extracts
itself with the federation's backbone (`data.image_backbone`; the subfolders named by
`data.class_names`, so that a site lacking a class labels the others as every site does).
Everything is checked as it is read: one ValueError naming the file, what is wrong and what to do.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from workbench.data.federated import FeatureBatches, FederatedData
from workbench.data.population import Population, Rows
from workbench.settings import plain

TABLES = {".parquet": "parquet", ".csv": "CSV", ".jsonl": "JSON lines", ".json": "JSON"}  # (.json: lines or one array)
TENSORS = {".pt": "torch", ".npz": "numpy"}
IMAGES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class SiteFileError(ValueError):
    """A site's file cannot serve as its rows: the message names the file and the fix."""


def read_site(path: str | Path, num_classes: int, *, label_column: str = "label", feature_column: str | None = None,
              feature_dim: int | None = None, class_names: Sequence[str] | None = None,
              extract: Callable[[Tensor], Tensor] | None = None, image_size: int = 64) -> Rows:
    """The rows of one site's file: features (n, d) float32 and labels (n,) int64 in 0..C−1.

    `feature_column` names the column holding each row's vector (a list); None: every column but
    the label's is one feature (tables), `features` (tensor files). `feature_dim`: the width every
    site must have (None: any). A folder of images: `extract` maps its uint8 images (n, S, S, 3),
    S = `image_size`, to features; its subfolders are the classes `class_names` names (None:
    subfolders named 0..C−1)."""
    path = Path(path).expanduser()
    if path.is_dir():
        if extract is None:
            raise SiteFileError(f"site folder {path} holds images, and the federation has no backbone to extract "
                                "their features: set data.image_backbone (e.g. efficientnet_lite0)")
        images, labels = _image_folder(path, num_classes, class_names, image_size)
        return _checked(path, extract(images).numpy(), labels, num_classes, feature_dim)
    kind = TABLES.get(path.suffix.lower()) or TENSORS.get(path.suffix.lower())
    if kind is None:
        raise SiteFileError(f"site file {path}: unknown kind {path.suffix!r}; a site's rows are a "
                            f"{', '.join(TABLES)} table, a {', '.join(TENSORS)} tensor file or a folder of images")
    if not path.is_file():
        raise SiteFileError(f"site file {path} does not exist: point it (a node's data-path, data.sites or "
                            "data.test_path) at the site's own file")
    try:
        if path.suffix.lower() in TENSORS:
            features, labels = _tensors(path, label_column, feature_column or "features")
        else:
            features, labels = _table(path, label_column, feature_column)
    except SiteFileError:
        raise
    except ImportError as error:
        raise SiteFileError(f"site file {path}: reading {kind} needs {error.name or 'a reader'}: "
                            "pip install pyarrow (or pip install -e '.[hf]')") from None
    except Exception as error:  # the reader's own: a damaged or foreign file
        raise SiteFileError(f"site file {path} cannot be read as {kind} ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}): replace it with a whole "
                            f"{kind} file") from None
    return _checked(path, features, labels, num_classes, feature_dim)


def _tensors(path: Path, label_column: str, feature_column: str) -> tuple[np.ndarray, np.ndarray]:
    if path.suffix.lower() == ".pt":
        held = torch.load(path, map_location="cpu", weights_only=True)
        held = {name: value.numpy() if isinstance(value, Tensor) else value for name, value in dict(held).items()}
    else:
        with np.load(path, allow_pickle=False) as arrays:
            held = {name: arrays[name] for name in arrays.files}
    missing = [name for name in (feature_column, label_column) if name not in held]
    if missing:
        raise SiteFileError(f"site file {path} holds {sorted(held)}, not {missing}: save the features (n, d) as "
                            f"{feature_column!r} and the labels (n,) as {label_column!r} (or name yours in "
                            "data.feature_column and data.label_column)")
    return np.asarray(held[feature_column]), np.asarray(held[label_column])


def _table(path: Path, label_column: str, feature_column: str | None) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif suffix == ".csv":
        frame = pd.read_csv(path)
    elif suffix == ".json" and path.read_bytes().lstrip()[:1] == b"[":  # one array of row objects
        frame = pd.read_json(path, orient="records")
    else:
        frame = pd.read_json(path, lines=True)
    columns = [str(name) for name in frame.columns]
    wanted = [label_column] + ([feature_column] if feature_column else [])
    if missing := [name for name in wanted if name not in columns]:
        raise SiteFileError(f"site file {path} has no column {missing[0]!r} (its columns: {', '.join(columns[:12])}"
                            f"{' ...' if len(columns) > 12 else ''}): name it in data."
                            f"{'label_column' if missing[0] == label_column else 'feature_column'}")
    labels = frame[label_column].to_numpy()
    if not len(frame):  # (its columns' types unknown: `_checked` says it is empty)
        return np.zeros((0, len(columns) - 1)), labels.astype(np.int64)
    if feature_column:
        vectors = frame[feature_column].tolist()
        if any(isinstance(vector, str) for vector in vectors):
            raise SiteFileError(f"site file {path}: column {feature_column!r} holds text, not lists of numbers (a "
                                f"{TABLES[suffix]} cell holds no list): save the site as parquet or JSON lines, or one "
                                "column per feature without data.feature_column")
        widths = {len(vector) if hasattr(vector, "__len__") else -1 for vector in vectors}
        if len(widths) > 1 or -1 in widths:
            raise SiteFileError(f"site file {path}: column {feature_column!r} must hold one list of numbers a row, "
                                f"all of one length; it holds lengths {sorted(widths)[:5]} (-1: not a list)")
        return np.asarray(vectors, dtype=np.float64).reshape(len(vectors), -1), labels
    features = frame.drop(columns=[label_column])
    if text := [str(name) for name, dtype in features.dtypes.items() if not pd.api.types.is_numeric_dtype(dtype)]:
        raise SiteFileError(f"site file {path}: every column but {label_column!r} is a feature and must hold "
                            f"numbers; {', '.join(text[:5])} do{'es' if len(text) == 1 else ''} not (or name the "
                            "column holding each row's vector in data.feature_column)")
    return features.to_numpy(dtype=np.float64), labels


def _image_folder(path: Path, num_classes: int, class_names: Sequence[str] | None,
                  size: int) -> tuple[Tensor, np.ndarray]:
    """A folder's images (n, size, size, 3) uint8, RGB and resized, and their classes: each
    subfolder's index in `class_names` (or its name, an integer)."""
    from PIL import Image, UnidentifiedImageError

    names = list(class_names) if class_names else [str(c) for c in range(num_classes)]
    folders = sorted(entry for entry in path.iterdir() if entry.is_dir())
    if stray := [folder.name for folder in folders if folder.name not in names]:
        raise SiteFileError(f"site folder {path}: subfolder {stray[0]!r} is not a class of the federation's "
                            f"({', '.join(names[:10])}{' ...' if len(names) > 10 else ''}): rename it, or declare "
                            "it in data.class_names")
    images, labels = [], []
    for folder in folders:
        for file in sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGES):
            try:
                with Image.open(file) as image:
                    pixels = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
                    images.append(np.asarray(pixels, dtype=np.uint8))
            except (OSError, UnidentifiedImageError) as error:
                raise SiteFileError(f"site folder {path}: image {file} cannot be read ({type(error).__name__}): "
                                    "replace or remove it") from None
            labels.append(names.index(folder.name))
    if not images:
        raise SiteFileError(f"site folder {path} holds no images ({', '.join(IMAGES)}) in class subfolders "
                            "(<folder>/<class>/<image>): a site serves at least one")
    return torch.from_numpy(np.stack(images)), np.asarray(labels, dtype=np.int64)


def _checked(path: Path, features: np.ndarray, labels: np.ndarray, num_classes: int,
             feature_dim: int | None) -> Rows:
    """The rows as tensors, after the checks every site's rows must pass."""
    if features.ndim != 2 or labels.ndim != 1 or len(features) != len(labels):
        raise SiteFileError(f"site file {path}: features {tuple(features.shape)} and labels {tuple(labels.shape)} "
                            "must be (n, d) and (n,)")
    if len(labels) == 0:
        raise SiteFileError(f"site file {path} holds no rows: a site serves at least one")
    if feature_dim is not None and features.shape[1] != feature_dim:
        raise SiteFileError(f"site file {path} holds {features.shape[1]} features a row, and the federation's "
                            f"rows have {feature_dim} (data.feature_dim): every site extracts the same features")
    if not np.issubdtype(labels.dtype, np.integer):
        whole = np.issubdtype(labels.dtype, np.floating) and np.all(np.mod(labels, 1) == 0)
        if not whole:
            raise SiteFileError(f"site file {path}: labels must be whole numbers 0..{num_classes - 1}, "
                                f"got {labels.dtype} values such as {labels[:3].tolist()}")
    labels = labels.astype(np.int64)
    if (bad := (labels < 0) | (labels >= num_classes)).any():
        raise SiteFileError(f"site file {path}: {int(bad.sum())} rows hold labels outside 0..{num_classes - 1} "
                            f"(e.g. {int(labels[bad][0])}), and the federation declares {num_classes} classes "
                            "(data.num_classes): relabel them or declare more classes")
    if not np.isfinite(features).all():
        rows = np.flatnonzero(~np.isfinite(features).all(axis=1))
        raise SiteFileError(f"site file {path}: {len(rows)} rows hold NaN/inf features (the first: row {rows[0]}): "
                            "repair or drop them")
    return Rows(torch.from_numpy(features.astype(np.float32)), torch.from_numpy(labels))


def _version(path: Path) -> tuple[int, int, int]:
    """What changes when a site's file does: a file's (modified ns, size, 0); a folder's newest
    modification among itself and its entries, their count and their names' hash (a renamed class
    subfolder is a change)."""
    if not path.exists():
        return (0, 0, 0)
    if not path.is_dir():
        stat = path.stat()
        return (stat.st_mtime_ns, stat.st_size, 0)
    entries = sorted(path.rglob("*"))
    newest = max([path.stat().st_mtime_ns, *(entry.stat().st_mtime_ns for entry in entries)])
    return (newest, len(entries), hash(tuple(str(entry.relative_to(path)) for entry in entries)))


def check_widths(widths: Mapping[str, int]) -> None:
    """Every site's rows the same width ({site and its file: features a row}): else one line
    naming each."""
    if len(set(widths.values())) > 1:
        shown = "; ".join(f"{site}: {width}" for site, width in widths.items())
        raise ValueError(f"the sites' rows differ in width (features a row — {shown}): every site must hold the "
                         "same features (data.feature_dim names the width each site is checked against)")


@dataclass(frozen=True)
class ImageBackbone:
    """The backbone sites holding folders of images extract their features with.

    name: an image backbone (`efficientnet_lite0`, the packaged ImageNet weights, or a timm name);
    pretrained: its pretrained weights (packaged, or `weights_path`; else a seeded random init);
    input_size: the images' size (default the backbone's own; images are resized to it as read);
    batch_size: images per forward; device: where it runs (`auto`: CUDA when present).
    """

    name: str = "efficientnet_lite0"
    pretrained: bool = True
    weights_path: str | None = None
    input_size: int | None = None
    batch_size: int = 256
    device: str = "auto"

    def check(self) -> None:
        """ValueError naming the setting: an image backbone, a batch of at least one image."""
        from workbench.backbones import backbone_modality, list_backbones

        try:
            is_image = backbone_modality(self.name) == "image"
        except ValueError:
            is_image = False
        if not is_image:
            choices = ", ".join(list_backbones(modality="image"))
            raise ValueError(f"data.image_backbone.name {self.name!r} is not an image backbone (the sites' folders "
                             f"hold images): choose one of {choices} or a timm model name")
        if self.batch_size < 1:
            raise ValueError(f"data.image_backbone.batch_size must be ≥ 1, got {self.batch_size}")

    def extractor(self) -> tuple[Callable[[Tensor], Tensor], int]:
        """(the features of uint8 images (n, S, S, 3), S): the backbone built once."""
        from workbench.backbones import build_backbone
        from workbench.data.features import extract_features

        backbone = build_backbone(self.name, pretrained=self.pretrained, weights_path=self.weights_path,
                                  input_size=self.input_size)
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        return (lambda images: extract_features(backbone, images, self.batch_size, device, desc="site features"),
                backbone.input_size)


class SiteData(FederatedData):
    """A cross-silo federation's data: site k (client k) holds its own rows in its own file.

    Deployed, each SuperNode's node config names its file (`data-path`) and the server learns the
    sites' row counts and width from them (`learn`); in one process `sites` lists the files. See
    the module's docstring for the files.

    Args:
        num_sites: K, the sites: the clients, one SuperNode each (partition-id 0..K−1).
        num_classes: C: every site's labels are integers in 0..C−1 (a site may lack classes).
        sites: the K files in client order, for a fit in one process; empty on a deployment, where
            each SuperNode names its own.
        feature_dim: the features a row every site must hold; None: the sites' own, all equal.
        label_column: the column (or a tensor file's key) holding each row's class.
        feature_column: the column holding each row's feature vector (a list); None: every other
            column is one feature (a tensor file's key: `features`).
        class_names: the classes by name, in label order: a folder of images names its class
            subfolders so (None: subfolders 0..C−1).
        image_backbone: for sites holding folders of images, the backbone each extracts their
            features with (`ImageBackbone`: name, pretrained, weights_path, input_size, batch_size,
            device); None: the sites' files hold features.
        test_path: the server's own evaluation rows (a file or folder of the sites' kind), the test
            split; None: no test split (the sites' rows never leave them).
        batch_size: rows per evaluation batch, and per chunk where a client computes in chunks.
    """

    def __init__(self, num_sites: int, num_classes: int, sites: list[str] | None = None,
                 feature_dim: int | None = None, label_column: str = "label", feature_column: str | None = None,
                 class_names: list[str] | None = None, image_backbone: ImageBackbone | None = None,
                 test_path: str | None = None, batch_size: int = 4096) -> None:
        super().__init__()
        if num_sites < 1:
            raise ValueError(f"data.num_sites must be ≥ 1, got {num_sites}")
        if num_classes < 2:
            raise ValueError(f"data.num_classes must be ≥ 2, got {num_classes}; a classifier needs two classes")
        if sites and len(sites) != num_sites:
            raise ValueError(f"data.sites lists {len(sites)} files for data.num_sites = {num_sites}: one file a "
                             "site, in client order (or none, on a deployment)")
        if feature_dim is not None and feature_dim < 1:
            raise ValueError(f"data.feature_dim must be ≥ 1 (or null: the sites' own), got {feature_dim}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be ≥ 1, got {batch_size}")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"data.class_names names {len(class_names)} classes for data.num_classes = "
                             f"{num_classes}: name every class, in label order")
        if image_backbone is not None:
            image_backbone.check()
        self.save_hyperparameters()
        self.num_sites, self.num_classes, self.feature_dim = num_sites, num_classes, feature_dim
        self.label_column, self.feature_column, self.class_names = label_column, feature_column, class_names
        self.image_backbone = image_backbone
        self.sites, self.test_path, self.batch_size = list(sites or []), test_path, batch_size
        self._extract: tuple[Callable[[Tensor], Tensor], int] | None = None  # the backbone, built once
        self._train: Rows | None = None  # the sites' rows (in one process) or their shapes (deployed)
        self._test: Rows | None = None
        self._shares: dict[tuple[int, str], tuple[tuple, Population]] = {}  # a node's rows and its file's version

    @property
    def num_clients(self) -> int:
        return self.num_sites

    @property
    def has_validation(self) -> bool:
        return False

    @property
    def learns_from_nodes(self) -> bool:
        """Whether the sites' files are on their SuperNodes (no `sites` listed here): the server
        learns their sizes from them."""
        return not self.sites

    def read(self, path: str | Path) -> Rows:
        """One site's rows from its file (`read_site` with this federation's settings)."""
        if Path(path).expanduser().is_dir() and self.image_backbone is not None and self._extract is None:
            self._extract = self.image_backbone.extractor()
        extract, size = self._extract or (None, 0)
        return read_site(path, self.num_classes, label_column=self.label_column, feature_column=self.feature_column,
                         feature_dim=self.feature_dim, class_names=self.class_names, extract=extract,
                         image_size=size)

    # ---- the server ---------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """In one process, every site's rows; the server's own test rows in either case."""
        if self.test_path is not None and self._test is None:
            self._test = self.read(self.test_path)
        if self.sites and self._train is None:
            rows = [self.read(path) for path in self.sites]
            check_widths({f"site {k} ({path})": part.features.shape[1]
                          for k, (part, path) in enumerate(zip(rows, self.sites, strict=True))})
            self._check_test_width(rows[0].features.shape[1])
            self._train = Rows(torch.cat([part.features for part in rows]), torch.cat([part.labels for part in rows]),
                               torch.cat([torch.full((len(part),), k) for k, part in enumerate(rows)]))

    def _check_test_width(self, width: int) -> None:
        if self._test is not None and self._test.features.shape[1] != width:
            raise ValueError(f"data.test_path {self.test_path} holds {self._test.features.shape[1]} features a row, "
                             f"and the sites' rows have {width}: the server's test rows must be the sites' features")

    def learn(self, sizes: Sequence[int], feature_dim: int) -> None:
        """What a deployed server knows of the sites, from their SuperNodes' introductions: each
        site's training rows and their width. The population then holds the rows' shapes only (on
        the `meta` device: reading their values is an error, not a silent zero)."""
        if len(sizes) != self.num_sites:
            raise ValueError(f"{len(sizes)} sites introduced for data.num_sites = {self.num_sites}")
        if self.feature_dim is not None and feature_dim != self.feature_dim:
            raise ValueError(f"the sites hold {feature_dim} features a row, and data.feature_dim = {self.feature_dim}")
        self.setup()
        self._check_test_width(feature_dim)
        client_ids = torch.repeat_interleave(torch.arange(self.num_sites), torch.as_tensor(list(sizes)))
        self._train = _shapes(len(client_ids), feature_dim, client_ids)

    def population(self, client: int | None = None, path: str | Path | None = None) -> Population:
        """The federation's data as this process holds it: every site's rows (in one process), or
        their shapes (a deployed server, once `learn`ed; before, with `test_path`, no training rows
        and the server's test rows: a fitted model tested here). With `client`, the node's own: the
        rows of `path` (its node config's data-path) or, in one process, of `sites[client]`."""
        if client is not None:
            return self._site(client, path)
        self.setup()
        train = self._train
        if train is None:
            if self._test is None:
                raise ValueError(NOT_HERE)
            nothing = torch.zeros(0, dtype=torch.long)  # (no rows: nothing to misread, and the engine may move them)
            train = Rows(torch.zeros(0, self._test.features.shape[1]), nothing, nothing)
        width = train.features.shape[1]
        test = self._test if self._test is not None else Rows(torch.zeros(0, width), torch.zeros(0, dtype=torch.long))
        return Population(train, test, self.num_sites, self.num_classes, self.batch_size,
                          identity=self.identity(), names=self.describe())

    def _site(self, client: int, path: str | Path | None) -> Population:
        if not 0 <= client < self.num_sites:
            raise ValueError(f"partition-id {client} is outside the sites' [0, {self.num_sites})")
        if path is None:
            if not self.sites:
                raise ValueError(f"site {client} has no file: start its SuperNode with data-path in its node "
                                 f"config (--node-config 'partition-id={client} num-partitions="
                                 f"{self.num_sites} data-path=\"/its/own/file.parquet\"')")
            path = self.sites[client]
        # read again when the file changed since (a long-lived node serving its site's next fit)
        version = _version(Path(path).expanduser())
        kept = self._shares.get((client, str(path)))
        if kept is None or kept[0] != version:
            rows = self.read(path)
            share = Rows(rows.features, rows.labels, torch.full((len(rows),), client))
            nothing = Rows(rows.features[:0], rows.labels[:0])
            kept = self._shares[(client, str(path))] = (version, Population(
                share, nothing, self.num_sites, self.num_classes, self.batch_size, identity=self.identity(),
                names=self.describe()))
        return kept[1]

    def describe(self) -> dict[str, str]:
        return {"dataset": "sites", "backbone": self.image_backbone.name if self.image_backbone else "none",
                "partition": "sites", "num_clients": str(self.num_sites)}

    def identity(self) -> dict[str, Any]:
        """The federation's settings and, once known, each site's training rows (`site_rows`: a
        checkpoint resumed on sites whose files changed is refused); where the files are is not
        among them (a deployed server never knows)."""
        identity = {"num_sites": self.num_sites, "num_classes": self.num_classes, "feature_dim": self.feature_dim,
                    "label_column": self.label_column, "feature_column": self.feature_column,
                    "class_names": self.class_names,
                    "image_backbone": None if self.image_backbone is None else plain(self.image_backbone)}
        if self._train is not None and self._train.client_ids is not None:
            identity["site_rows"] = torch.bincount(self._train.client_ids, minlength=self.num_sites).tolist()
        return identity

    # ---- loaders ------------------------------------------------------------------------------
    def val_dataloader(self) -> list:
        return []  # the sites hold no hold-outs the server could score

    def test_dataloader(self) -> DataLoader | list:
        """The server's own test rows (`test_path`); none without."""
        self.setup()
        if self._test is None:
            return []
        return DataLoader(FeatureBatches(self.batch_size, features=self._test.features, labels=self._test.labels),
                          batch_size=None)


NOT_HERE = ("the sites' rows are on their SuperNodes: the server learns their sizes when it introduces itself to "
            "them, so data SiteData without data.sites fits with --engine=flower on a deployment (docs/engines.md, "
            "cross-silo); list the files in data.sites to fit them in one process, or give the server its own "
            "rows (data.test_path) to test a fitted model here")


def _shapes(n: int, width: int, client_ids: Tensor) -> Rows:
    """n rows of `width` features whose values are elsewhere (`meta`), with their clients."""
    return Rows(torch.empty(n, width, device="meta"), torch.empty(n, dtype=torch.long, device="meta"), client_ids)
