"""`python -m workbench list [methods|datasets|backbones|partitions|engines]`: what this install
offers, one line each, read from the registries themselves (a method, dataset or backbone added
to them appears here)."""
from __future__ import annotations

import argparse
import inspect

SECTIONS = ("methods", "datasets", "backbones", "partitions", "engines")


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _exported(module, base: type) -> list[type]:
    """The subclasses of `base` that `module` exports (its `__all__`), by name, `base` left out."""
    found = [getattr(module, name) for name in sorted(module.__all__, key=str.lower)]
    return [cls for cls in found if isinstance(cls, type) and issubclass(cls, base) and cls is not base]


def method_classes() -> list[type]:
    """Every method `workbench.methods` exports, by name (the names `--model` accepts)."""
    import workbench.methods as module
    from workbench.methods import FederatedMethod

    return _exported(module, FederatedMethod)


def data_classes() -> list[type]:
    """Every data module `workbench.data` exports, by name (the names `--data` accepts)."""
    import workbench.data as module
    from workbench.data import FederatedData

    return _exported(module, FederatedData)


def methods() -> list[tuple[str, str]]:
    return [(cls.__name__, _first_line(cls)) for cls in method_classes()]


def datasets() -> list[tuple[str, str]]:
    import workbench.data  # noqa: F401  (registers every loader)
    from workbench.data.registry import DATASETS

    rows = [(name, f"[{DATASETS.modality(name)}] {_first_line(DATASETS[name])}") for name in DATASETS.names()]
    return [*rows, ("synthetic", "[features] Gaussian class blobs drawn in feature space (data.synthetic.*)"),
            ("hf", "[image|text|features] your own data: a folder, CSV/JSON/parquet file or Hugging "
                   "Face dataset (data.hf.*; pip install -e '.[hf]')")]


def backbones() -> list[tuple[str, str]]:
    from workbench.backbones.registry import BACKBONES

    rows = [(name, f"[{BACKBONES.modality(name)}] {_first_line(BACKBONES[name])}") for name in BACKBONES.names()]
    return [*rows, ("<timm name>", "[image] any timm model name, e.g. resnet18, vit_base_patch16_224.mae "
                                   "(timm.list_models())")]


def partitions() -> list[tuple[str, str]]:
    from workbench.data.datamodule import PARTITION_PARAMS

    what = {"iid": "every client an equal random share",
            "dirichlet": "label skew: each class split over clients by Dirichlet(alpha)",
            "shard": "each client a few shards of label-sorted samples",
            "pathological": "each client only a few classes",
            "natural": "the data's own clients (dataset hf with hf.client_column)",
            "flower": "any Flower Datasets partitioner by name (pip install -e '.[hf]')"}
    return [(name, what.get(name, "") + (f" (data.{', data.'.join(params)})" if params else ""))
            for name, params in PARTITION_PARAMS.items()]


def engines() -> list[tuple[str, str]]:
    return [("lightning", "in this process, clients vectorized (--engine lightning, the default)"),
            ("ddp", "clients split over processes (--trainer.strategy=ddp --trainer.devices=N)"),
            ("flower", "a Flower ServerApp and ClientApps, simulated on Ray (--engine flower; "
                       "pip install -e '.[flower]')")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench list", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    chosen = parser.parse_args(argv).what or SECTIONS
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    listers = {"methods": methods, "datasets": datasets, "backbones": backbones,
               "partitions": partitions, "engines": engines}
    for section in chosen:
        rows = listers[section]()
        width = max(len(name) for name, _ in rows)
        print(f"{section}:")
        for name, line in rows:
            print(f"  {name:<{width}}  {line}")
        print()
    return 0
