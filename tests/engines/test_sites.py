"""Cross-silo sites over Flower (`SiteData`): each SuperNode reads its own file, named in its node
config, and nothing else; the server learns the sites' sizes and width from their introductions
and reads no rows. The fit equals the fit in one process on the union of the files; a bad file
stops the fit before any round, in one line naming its node and its file.

The nodes live in this process (`LoopbackGrid`); tests/engines/test_sites_deployment.py runs
sites on a real deployment."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")
pytest.importorskip("pyarrow", reason="parquet needs pyarrow: pip install -e '.[hf]'")

from tests.engines.conftest import assert_same_state
from workbench.data import SiteData
from workbench.engines.flower import client_app
from workbench.engines.flower.loopback import FIRST_NODE, LoopbackGrid
from workbench.engines.flower.simulation import fit_over_grid, quiet_trainer
from workbench.engines.flower_settings import FlowerSettings
from workbench.engines.lightning import LightningEngine
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, FedAvg

pytestmark = pytest.mark.usefixtures("one_thread", "as_server")
SIZES, CLASSES, WIDTH = (31, 12, 47), ((0, 1, 2), (0, 1, 2), (0, 2)), 6  # site 2 lacks class 1


def site_files(folder, widths=(WIDTH,) * 3) -> list[str]:
    """Three sites' parquet files: different sizes and class mixes, classes apart in feature space."""
    paths = []
    for k, (n, classes, width) in enumerate(zip(SIZES, CLASSES, widths, strict=True)):
        gen = np.random.default_rng(k)
        labels = gen.choice(classes, n)
        features = gen.normal(size=(n, width)) + 2.0 * np.eye(3, width)[labels]
        path = folder / f"site{k}.parquet"
        pd.DataFrame({"features": list(features), "label": labels}).to_parquet(path)
        paths.append(str(path))
    return paths


def fit_in_process(method, paths):
    data = SiteData(num_sites=3, num_classes=3, sites=paths, feature_column="features")
    engine = LightningEngine(method)
    data.setup()
    engine.check_data(data, fitting=True)
    quiet_trainer().fit(engine, datamodule=data)
    return method


def fit_on_sites(method, paths, **settings):
    """The fit with each loopback SuperNode holding site k's file, the server none."""
    grid = LoopbackGrid(3, node_config={k: {"data-path": path} for k, path in enumerate(paths)})
    data = SiteData(num_sites=3, num_classes=3, feature_column="features", **settings)
    engine = LightningEngine(method)
    fit_over_grid(grid, quiet_trainer(), engine, data, test=False, settings=FlowerSettings(deadline_s=30))
    return method, grid


def fedavg():
    return FedAvg(num_rounds=3, architecture="mlp", hidden_dim=8, seed=2, local=LocalTraining(lr=0.1, batch_size=8))


@pytest.mark.parametrize("make, tolerance", [(lambda: AFL(gamma=1.0, gamma_out=0.1), 1e-10), (fedavg, 1e-6)],
                         ids=["AFL", "FedAvg"])  # (float32 updates summed in another order)
def test_sites_on_their_own_nodes_fit_the_model_of_their_union_in_one_process(tmp_path, monkeypatch, make, tolerance):
    paths = site_files(tmp_path)
    reads: dict[object, list[str]] = defaultdict(list)  # who read which file: a node (by its id) or the server
    reading = {"node": "server"}
    read = SiteData.read

    def recorded(self, path):
        reads[reading["node"]].append(str(path))
        return read(self, path)

    def as_node(handler):
        def handle(message, context):
            reading["node"] = context.node_id
            try:
                return handler(message, context)
            finally:
                reading["node"] = "server"
        return handle

    monkeypatch.setattr(SiteData, "read", recorded)
    monkeypatch.setattr(client_app, "HANDLERS", {kind: as_node(h) for kind, h in client_app.HANDLERS.items()})
    method, grid = fit_on_sites(make(), paths)
    # every node read its own file and no other; the server read none, and sent no file's name
    own = {FIRST_NODE + k: {path} for k, path in enumerate(paths)}
    assert {node: set(files) for node, files in reads.items()} == own
    spec = json.dumps(dict(grid.contexts[FIRST_NODE].state.config_records[client_app.NODE_KEY]))
    assert str(tmp_path) not in spec
    monkeypatch.setattr(SiteData, "read", read)
    assert_same_state(method, fit_in_process(make(), paths), tolerance)


@pytest.mark.parametrize("damage, says", [
    ("width", r"differ in width \(features a row — SuperNode 100, .*site0.parquet: 6; SuperNode 101, "
              r".*site1.parquet: 7; SuperNode 102, .*site2.parquet: 6\)"),
    ("declared width", r"SuperNode 101 failed \(query\).*site file .*site1.parquet holds 7 features a row, and the "
                       r"federation's rows have 6"),
    ("label", r"SuperNode 101 failed \(query\).*site file .*site1.parquet: 1 rows hold labels outside 0..2"),
    ("unreadable", r"SuperNode 101 failed \(query\).*site file .*site1.parquet cannot be read as parquet"),
])
def test_a_bad_site_file_stops_the_fit_before_any_round_naming_its_node_and_file(tmp_path, damage, says):
    paths = site_files(tmp_path, widths=(WIDTH, WIDTH + (damage.endswith("width")), WIDTH))
    if damage == "label":
        frame = pd.read_parquet(paths[1])
        frame.loc[0, "label"] = 3
        frame.to_parquet(paths[1])
    elif damage == "unreadable":
        with open(paths[1], "r+b") as file:
            file.write(b"\x00" * 64)
    grid = LoopbackGrid(3, node_config={k: {"data-path": path} for k, path in enumerate(paths)})
    data = SiteData(num_sites=3, num_classes=3, feature_column="features",
                    feature_dim=WIDTH if damage == "declared width" else None)
    with pytest.raises((ValueError, RuntimeError), match=says) as caught:
        fit_over_grid(grid, quiet_trainer(), LightningEngine(fedavg()), data, test=False)
    assert "\n" not in str(caught.value)
    assert grid.exchanges == 1  # the introductions only: no round went out


def test_a_site_without_a_file_and_a_file_for_partitioned_data_are_refused(tmp_path):
    from tests.engines.conftest import three_clients

    paths = site_files(tmp_path)
    grid = LoopbackGrid(3, node_config={0: {"data-path": paths[0]}, 1: {"data-path": paths[1]}})
    with pytest.raises(RuntimeError, match=r"SuperNode 102 failed.*site 2 has no file: start its SuperNode with "
                                           r"data-path in its node config"):
        fit_over_grid(grid, quiet_trainer(), LightningEngine(fedavg()),
                      SiteData(num_sites=3, num_classes=3, feature_column="features"))
    grid = LoopbackGrid(3, node_config={1: {"data-path": str(tmp_path / "b.parquet")}})
    with pytest.raises(RuntimeError, match=r"SuperNode 101 failed \(query\): ValueError: the node config names "
                                           r"data-path .*b.parquet, and this data is one dataset"):
        fit_over_grid(grid, quiet_trainer(), LightningEngine(fedavg()), three_clients())
