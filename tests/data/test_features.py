"""The feature cache: extracted once, reused with zero backbone forwards, rebuilt when damaged."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import CountingNet, FakeBackbone
from workbench.data.features import cached_features, preprocess


@pytest.fixture
def images():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (50, 12, 12), dtype=torch.uint8, generator=gen), torch.arange(50) % 5


def run(backbone, images, cache_dir, **kw):
    x, y = images
    args = dict(cache_dir=cache_dir, dataset="toy", split="train", source="unit-test", batch_size=16)
    return cached_features(backbone, x, y, **{**args, **kw})


def test_second_run_does_no_forward_pass(images, tmp_path):
    backbone = FakeBackbone(CountingNet())
    first = run(backbone, images, tmp_path)
    assert backbone.model.calls == 4  # 50 images in batches of 16
    second = run(backbone, images, tmp_path)
    assert backbone.model.calls == 4
    assert torch.equal(first, second) and first.dtype == torch.float32 and first.shape == (50, 8)


def test_truncated_cache_is_rebuilt_with_a_warning(images, tmp_path):
    backbone = FakeBackbone(CountingNet())
    expected = run(backbone, images, tmp_path)
    (path,) = tmp_path.rglob("*.pt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.warns(UserWarning, match="corrupt or mismatched"):
        rebuilt = run(backbone, images, tmp_path)
    assert backbone.model.calls == 8 and torch.equal(rebuilt, expected)
    assert run(backbone, images, tmp_path) is not None and backbone.model.calls == 8  # healthy again


def test_a_file_with_other_contents_is_rebuilt(images, tmp_path):
    backbone = FakeBackbone(CountingNet())
    run(backbone, images, tmp_path)
    (path,) = tmp_path.rglob("*.pt")
    blob = torch.load(path, weights_only=True)
    blob["labels"] = blob["labels"].flip(0)  # e.g. written for a different ordering of the data
    torch.save(blob, path)
    with pytest.warns(UserWarning, match="labels differ"):
        run(backbone, images, tmp_path)
    assert backbone.model.calls == 8


@pytest.mark.parametrize("change", [{"input_size": 20}, {"mean": (0.4, 0.5, 0.5)},
                                    {"weights_id": "file-sha256:0123"}, {"name": "other-net"}])
def test_every_part_of_the_key_separates_cache_entries(images, tmp_path, change):
    backbone = FakeBackbone(CountingNet())
    run(backbone, images, tmp_path)
    run(replace(backbone, **change), images, tmp_path)
    assert backbone.model.calls == 8
    assert len(list(tmp_path.rglob("*.pt"))) == 2


def test_no_temporary_file_is_left_behind(images, tmp_path):
    run(FakeBackbone(CountingNet()), images, tmp_path)
    assert [p.suffix for p in tmp_path.rglob("*") if p.is_file()] == [".pt"]


def test_preprocess_expands_gray_and_normalizes():
    gray = torch.full((2, 10, 10), 255, dtype=torch.uint8)
    out = preprocess(gray, 16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert out.shape == (2, 3, 16, 16) and torch.allclose(out, torch.ones_like(out))
    rgb = torch.zeros((1, 10, 10, 3), dtype=torch.uint8)
    rgb[..., 1] = 255
    out = preprocess(rgb, 10, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert torch.equal(out[0, :, 0, 0], torch.tensor([0.0, 1.0, 0.0]))
