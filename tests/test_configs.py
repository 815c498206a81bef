"""Every config in the repository parses and builds: the one-file configs alone (`configs/*.yaml`
and the papers' rows, `configs/paper/<table>/*.yaml`), and the composed ones (`configs/method/*.yaml`
with `configs/data/*.yaml`, as repeated --config) in every pairing. Building runs the method's and
the data module's constructors, which check their settings; nothing is loaded or fitted. Each
paper row is its method's and its dataset's files composed with its own keys, in one file. (Every
sweep is checked in test_sweep.py; the papers' tables in test_paper_tables.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench.sweep import construction_error, parse_config

PAPER = sorted((ROOT / "configs/paper").glob("*/*.yaml"))
WHOLE = sorted((ROOT / "configs").glob("*.yaml")) + PAPER
METHODS = sorted((ROOT / "configs/method").glob("*.yaml"))
DATA = sorted((ROOT / "configs/data").glob("*.yaml"))
COMPOSED = [(method, data) for method in METHODS for data in DATA]


def parsed_and_built(*configs: Path) -> dict:
    arguments = ["fit", *(token for config in configs for token in ("--config", str(config)))]
    config, error = parse_config(arguments)
    assert error is None, f"{' + '.join(c.name for c in configs)}: {error}"
    for part in ("model", "data"):
        refused = construction_error(part, config[part], [])
        assert refused is None, f"{' + '.join(c.name for c in configs)}: {part}: {refused}"
    return config


@pytest.mark.parametrize("config", WHOLE, ids=[str(p.relative_to(ROOT / "configs").with_suffix("")) for p in WHOLE])
def test_every_one_file_config_parses_and_builds(config):
    parsed_and_built(config)  # `fit --config <file> --print_config`, in process, then the constructors


@pytest.mark.parametrize("paper", PAPER, ids=[f"{p.parent.name}/{p.stem}" for p in PAPER])
def test_a_paper_config_is_its_method_and_data_files_composed_with_its_own_keys(paper):
    alone, error = parse_config(["fit", "--config", str(paper)])
    assert error is None, f"{paper.name}: {error}"
    method = alone["model"]["class_path"].rsplit(".", 1)[-1].lower()  # SAFLe: configs/method/safle.yaml
    dataset = alone["data"]["init_args"]["dataset"]  # cifar10: configs/data/cifar10.yaml
    composed = parsed_and_built(ROOT / f"configs/method/{method}.yaml", ROOT / f"configs/data/{dataset}.yaml", paper)
    # nothing the method's or the data's file sets is lost or silently different in the one file
    assert composed == alone


@pytest.mark.parametrize("method, data", COMPOSED,
                         ids=[f"{m.stem}+{d.stem}" for m, d in COMPOSED])
def test_every_method_composes_with_every_data_config(method, data):
    config = parsed_and_built(method, data)
    assert config["model"]["class_path"].rsplit(".", 1)[-1].lower() == method.stem  # afl.yaml: AFL
    assert config["data"]["init_args"]["dataset"] == data.stem  # the data file named the dataset


def test_the_demo_config_is_afl_composed_with_mnist5k():
    demo = parsed_and_built(ROOT / "configs/method/afl.yaml", ROOT / "configs/data/mnist5k.yaml")
    one_file = parsed_and_built(ROOT / "configs/demo.yaml")
    assert demo["model"] == one_file["model"] and demo["data"] == one_file["data"]


def test_a_later_config_overrides_an_earlier_one_key_by_key():
    config = parsed_and_built(ROOT / "configs/method/afl.yaml", ROOT / "configs/data/mnist5k.yaml",
                              ROOT / "configs/data/synthetic.yaml")
    data = config["data"]["init_args"]
    assert data["dataset"] == "synthetic" and data["synthetic"]["dim"] == 32  # the later file's
    assert data["input_size"] == 64  # the earlier file's, which the later one does not set
