"""Cross-silo sites (`workbench.data.sites`): a site's file read as its rows, whatever its kind;
every bad file one error naming the file; `SiteData` in one process is the sites' rows in client
order, and a deployed server holds their shapes only."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from workbench.data import SiteData
from workbench.data.sites import ImageBackbone, SiteFileError, read_site

ROWS = 7


def rows(seed: int = 0, n: int = ROWS, width: int = 4, classes=(0, 1, 2)) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    return gen.normal(size=(n, width)).astype(np.float32), gen.choice(classes, n)


def write(path, features: np.ndarray, labels: np.ndarray, layout: str = "columns"):
    """One site's file of any kind: a table with a column per feature (`columns`) or a column of
    vectors (`vectors`), or a tensor file."""
    suffix = path.suffix
    if suffix == ".pt":
        torch.save({"features": torch.from_numpy(features), "label": torch.from_numpy(labels)}, path)
    elif suffix == ".npz":
        np.savez(path, features=features, label=labels)
    else:
        if layout == "vectors":
            frame = pd.DataFrame({"features": list(features), "label": labels})
        else:
            frame = pd.DataFrame(features, columns=[f"f{i}" for i in range(features.shape[1])]).assign(label=labels)
        if suffix == ".parquet":
            frame.to_parquet(path)
        elif suffix == ".csv":
            frame.to_csv(path, index=False)
        else:
            frame.to_json(path, orient="records", lines=True)
    return path


@pytest.mark.parametrize("suffix, layout", [(".csv", "columns"), (".jsonl", "vectors"), (".jsonl", "columns"),
                                            (".parquet", "vectors"), (".parquet", "columns"), (".pt", None),
                                            (".npz", None)])
def test_every_kind_of_site_file_reads_as_the_same_rows(tmp_path, suffix, layout):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow: pip install -e '.[hf]'")
    features, labels = rows()
    path = write(tmp_path / f"site{suffix}", features, labels, layout or "")
    column = "features" if layout == "vectors" else None
    read = read_site(path, 3, feature_column=column)
    assert read.features.dtype == torch.float32 and read.labels.dtype == torch.int64
    torch.testing.assert_close(read.features, torch.from_numpy(features), rtol=1e-6, atol=1e-6)  # (CSV's text)
    assert torch.equal(read.labels, torch.from_numpy(labels))


@pytest.mark.parametrize("damage, says", [
    ("width", "holds 5 features a row, and the federation's rows have 4 (data.feature_dim)"),
    ("label", "rows hold labels outside 0..2 (e.g. 3), and the federation declares 3 classes"),
    ("garbage", "cannot be read as CSV"),
    ("missing", "does not exist: point it (a node's data-path, data.sites or data.test_path) at the site's own"),
    ("empty", "holds no rows"),
    ("no label", "has no column 'label'"),
    ("text", "every column but 'label' is a feature and must hold numbers; f1 does not"),
    ("nan", "1 rows hold NaN/inf features (the first: row 2)"),
    ("fractional", "labels must be whole numbers 0..2"),
    ("kind", "unknown kind '.xlsx'"),
])
def test_a_bad_site_file_is_one_line_naming_the_file_and_what_to_do(tmp_path, damage, says):
    features, labels = rows()
    path = tmp_path / ("site.xlsx" if damage == "kind" else "site.csv")
    frame = pd.DataFrame(features, columns=[f"f{i}" for i in range(4)]).assign(label=labels)
    if damage == "width":
        frame = frame.assign(f4=1.0)
    elif damage == "label":
        frame.loc[3, "label"] = 3
    elif damage == "empty":
        frame = frame.iloc[:0]
    elif damage == "no label":
        frame = frame.drop(columns="label")
    elif damage == "text":
        frame["f1"] = "x"
    elif damage == "nan":
        frame.loc[2, "f0"] = np.nan
    elif damage == "fractional":
        frame["label"] = frame["label"] + 0.5
    if damage == "garbage":
        path.write_bytes(b"\x00\xff\x00 not a table \xfe" * 10 + b"\n1,2\n1,2,3,4,5\n")
    elif damage != "missing":
        frame.to_csv(path, index=False)
    with pytest.raises(SiteFileError) as caught:
        read_site(path, 3, feature_dim=4)
    message = str(caught.value)
    assert says in message and str(path) in message and "\n" not in message


def test_site_data_in_one_process_is_the_sites_rows_in_client_order(tmp_path):
    shapes = ((0, 7, (0, 1, 2)), (1, 3, (0, 1, 2)), (2, 5, (0, 1)))  # site 2 lacks class 2
    parts = [rows(seed, n, classes=classes) for seed, n, classes in shapes]
    paths = [str(write(tmp_path / f"site{k}.csv", *part)) for k, part in enumerate(parts)]
    test = write(tmp_path / "server.csv", *rows(9, 4))
    data = SiteData(num_sites=3, num_classes=3, sites=paths, test_path=str(test))
    population = data.population()
    torch.testing.assert_close(population.train.features, torch.from_numpy(np.concatenate([f for f, _ in parts])))
    assert population.client_ids.tolist() == [0] * 7 + [1] * 3 + [2] * 5
    assert population.rows_per_client().tolist() == [7, 3, 5] and len(population.test) == 4
    assert population.input_shape == (4,) and population.num_classes == 3
    # a node's share is its own file's rows: client 2's, with no test rows
    share = data.population(2, path=paths[2])
    assert torch.equal(share.train.labels, torch.from_numpy(parts[2][1])) and len(share.test) == 0
    assert share.client_ids.tolist() == [2] * 5


def test_a_node_reads_its_file_again_once_it_changed(tmp_path):
    path = write(tmp_path / "site.csv", *rows(0, n=5))
    data = SiteData(num_sites=2, num_classes=3)
    first = data.population(1, path=path)
    assert data.population(1, path=path) is first  # (its introduction, then its first round: read once)
    write(path, *rows(1, n=8))  # the site's next fit, in the same long-lived node process
    assert len(data.population(1, path=path).train) == 8


def test_the_sites_must_agree_on_their_width(tmp_path):
    paths = [str(write(tmp_path / f"site{k}.csv", *rows(k, width=4 + (k == 1)))) for k in range(3)]
    with pytest.raises(ValueError, match=r"differ in width .*site 1 \(.*site1.csv\): 5"):
        SiteData(num_sites=3, num_classes=3, sites=paths).setup()


def test_a_deployed_server_holds_the_sites_shapes_only(tmp_path):
    data = SiteData(num_sites=3, num_classes=3)
    with pytest.raises(ValueError, match=r"on their SuperNodes.*--engine=flower on a deployment"):
        data.population()
    with pytest.raises(ValueError, match="site 1 has no file: start its SuperNode with data-path"):
        data.population(1)
    data.learn([4, 0, 2], feature_dim=6)
    population = data.population()
    assert population.rows_per_client().tolist() == [4, 0, 2] and population.input_shape == (6,)
    assert population.train.features.is_meta and population.train.labels.is_meta  # no values to read by mistake
    assert len(population.test) == 0
    with pytest.raises(ValueError, match=r"data\.feature_dim = 5"):
        SiteData(num_sites=3, num_classes=3, feature_dim=5).learn([1, 1, 1], feature_dim=6)


@pytest.mark.parametrize("settings, says", [
    ({"num_sites": 0}, "data.num_sites must be ≥ 1"),
    ({"num_classes": 1}, "data.num_classes must be ≥ 2"),
    ({"sites": ["a.csv"]}, "data.sites lists 1 files for data.num_sites = 3"),
    ({"image_backbone": ImageBackbone("all_minilm_l6_v2")}, "data.image_backbone.name 'all_minilm_l6_v2' is not"),
    ({"class_names": ["a", "b"]}, "data.class_names names 2 classes for data.num_classes = 3"),
    ({"feature_dim": 0}, "data.feature_dim must be ≥ 1"),
])
def test_site_data_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        SiteData(**{"num_sites": 3, "num_classes": 3, **settings})


def image_folder(root, classes: dict[str, int], seed: int = 0):
    """A site's folder of images: `classes[name]` small RGB PNGs in subfolder `name`."""
    from PIL import Image

    gen = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(gen.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def test_a_site_folder_of_images_is_its_backbone_features_labelled_by_the_class_names(tmp_path):
    from PIL import Image

    from workbench.backbones import build_backbone
    from workbench.data.features import extract_features

    names = ["cat", "dog", "owl"]
    folders = [image_folder(tmp_path / "a", {"owl": 2, "cat": 3}), image_folder(tmp_path / "b", {"dog": 2}, 1)]
    data = SiteData(num_sites=2, num_classes=3, class_names=names, sites=[str(f) for f in folders],
                    image_backbone=ImageBackbone("efficientnet_lite0", input_size=32, device="cpu"))
    population = data.population()
    # site a lacks dog, site b has only dog: the labels are the declared names' indices at every site
    assert population.train.labels.tolist() == [0, 0, 0, 2, 2, 1, 1]
    assert population.client_ids.tolist() == [0] * 5 + [1] * 2
    backbone = build_backbone("efficientnet_lite0", input_size=32)
    files = sorted((tmp_path / "a" / "cat").glob("*.png")) + sorted((tmp_path / "a" / "owl").glob("*.png"))
    images = torch.from_numpy(np.stack([np.asarray(Image.open(f).convert("RGB").resize((32, 32), Image.BILINEAR))
                                        for f in files]))
    torch.testing.assert_close(population.train.features[:5], extract_features(backbone, images))
    assert population.input_shape == (backbone.feature_dim,)


@pytest.mark.parametrize("damage, says", [
    ("stray class", r"subfolder 'bird' is not a class of the federation's \(cat, dog\): rename it, or declare it"),
    ("bad image", "image .*0.png cannot be read"),
    ("empty", "holds no images"),
    ("no backbone", "holds images, and the federation has no backbone"),
])
def test_a_bad_site_folder_is_one_line_naming_it(tmp_path, damage, says):
    folder = image_folder(tmp_path / "site", {"cat": 1, **({"bird": 1} if damage == "stray class" else {})})
    if damage == "bad image":
        (folder / "cat" / "0.png").write_bytes(b"not a png")
    elif damage == "empty":
        (folder / "cat" / "0.png").unlink()
    backbone = None if damage == "no backbone" else ImageBackbone(input_size=32, device="cpu")
    data = SiteData(num_sites=1, num_classes=2, class_names=["cat", "dog"], sites=[str(folder)],
                    image_backbone=backbone)
    with pytest.raises(SiteFileError, match=says) as caught:
        data.setup()
    assert str(folder) in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_line_fits_listed_sites_and_says_what_a_deployment_needs(tmp_path, capsys):
    from workbench.__main__ import main

    paths = [str(write(tmp_path / f"site{k}.csv", *rows(k, n=6 + k))) for k in range(3)]
    test = str(write(tmp_path / "server.csv", *rows(7, n=9)))
    common = ["--model=AFL", "--data=SiteData", "--wandb=disabled", "--trainer.enable_progress_bar=false",
              f"--run_dir={tmp_path / 'runs'}", "--data.num_sites=3", "--data.num_classes=3"]
    assert main(["fit", *common, f"--data.sites=[{','.join(paths)}]"]) == 0
    assert "test accuracy     —" in capsys.readouterr().out  # no test split
    # without the files, the sites' rows are on their SuperNodes: no fit in this process
    assert main(["fit", *common]) == 2
    assert "on their SuperNodes: the server learns their sizes" in capsys.readouterr().err
    # ... but the deployment's config with rows of the server's own tests a model fitted on them
    model = next((tmp_path / "runs").glob("*/version_0/model.ckpt"))
    assert main(["test", *common, f"--data.test_path={test}", f"--ckpt_path={model}"]) == 0
    assert "test/acc" in capsys.readouterr().out  # (Lightning's table of the server's 9 rows)
    assert main(["fit", "--model=AFL", "--data=SiteData", "--data.num_sites=3"]) == 2
    assert "error: SiteData needs data.num_classes: give --data.num_classes=..." in capsys.readouterr().err


def test_a_resumed_fit_is_refused_when_a_site_changed_and_the_test_rows_must_be_the_sites_kind(tmp_path):
    from workbench.engines.lightning import check_checkpoint_matches

    paths = [str(write(tmp_path / f"site{k}.csv", *rows(k, n=6 + k))) for k in range(3)]
    before = SiteData(num_sites=3, num_classes=3, sites=paths)
    before.setup()
    assert before.identity()["site_rows"] == [6, 7, 8]
    write(Path(paths[1]), *rows(1, n=5))
    after = SiteData(num_sites=3, num_classes=3, sites=paths)
    after.setup()
    saved = {"method": "AFL", "data": before.identity()}
    with pytest.raises(ValueError, match=r"data.site_rows: checkpoint \[6, 7, 8\], config \[6, 5, 8\]"):
        check_checkpoint_matches(saved, {**saved, "engine": "lightning", "settings": {}, "problem": None,
                                         "stages": [], "data": after.identity()}, resuming=True)
    # a deployed server knows no row counts before its nodes tell them: nothing to compare yet
    assert "site_rows" not in SiteData(num_sites=3, num_classes=3).identity()
    wide = write(tmp_path / "wide.csv", *rows(9, width=6))
    with pytest.raises(ValueError, match=r"data.test_path .*wide.csv holds 6 features a row, and the sites' rows "
                                         r"have 4"):
        SiteData(num_sites=3, num_classes=3, sites=paths, test_path=str(wide)).setup()


def test_a_json_site_is_json_lines_or_one_array_and_csv_holds_no_vectors(tmp_path):
    features, labels = rows()
    frame = pd.DataFrame({"features": list(features.tolist()), "label": labels})
    frame.to_json(tmp_path / "array.json", orient="records")
    frame.to_json(tmp_path / "lines.json", orient="records", lines=True)
    for name in ("array.json", "lines.json"):
        read = read_site(tmp_path / name, 3, feature_column="features")
        torch.testing.assert_close(read.features, torch.from_numpy(features))
    frame.to_csv(tmp_path / "vectors.csv", index=False)
    with pytest.raises(SiteFileError, match=r"column 'features' holds text, not lists of numbers .*save the site as "
                                            r"parquet or JSON lines"):
        read_site(tmp_path / "vectors.csv", 3, feature_column="features")
