"""The feature cache: extracted once, reused with zero backbone forwards, rebuilt when damaged."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import CountingNet, FakeBackbone
from workbench.data.features import all_finite, cached_features, payload_digest, preprocess


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
    blob["digests"]["labels"] = payload_digest(blob["labels"])  # a whole file, not a damaged one
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


def test_one_flipped_bit_in_the_payload_is_caught_and_rebuilt(images, tmp_path):
    backbone = FakeBackbone(CountingNet())
    expected = run(backbone, images, tmp_path)
    (path,) = tmp_path.rglob("*.pt")
    raw = bytearray(path.read_bytes())
    start = raw.find(expected.numpy().tobytes())  # the features' bytes, stored uncompressed
    assert start > 0
    raw[start + 4 * 123] ^= 1  # the lowest mantissa bit of one value: still finite, same shape
    path.write_bytes(bytes(raw))
    damaged = torch.load(path, weights_only=True)["features"]
    assert int((damaged != expected).sum()) == 1  # torch.load reads it without a word
    with pytest.warns(UserWarning, match="do not match the digest") as caught:
        rebuilt = run(backbone, images, tmp_path)
    assert str(path) in str(caught[0].message)
    assert backbone.model.calls == 8 and torch.equal(rebuilt, expected)
    assert torch.equal(run(backbone, images, tmp_path), expected) and backbone.model.calls == 8  # healthy again


def test_a_cache_written_before_digests_is_kept_and_gets_them(images, tmp_path, capsys):
    backbone = FakeBackbone(CountingNet())
    expected = run(backbone, images, tmp_path)
    (path,) = tmp_path.rglob("*.pt")
    blob = torch.load(path, weights_only=True)
    del blob["digests"]  # the layout of the files written before digests
    torch.save(blob, path)
    assert torch.equal(run(backbone, images, tmp_path), expected) and backbone.model.calls == 4  # no rebuild
    assert f"feature cache {path} predates digests" in capsys.readouterr().out
    assert set(torch.load(path, weights_only=True)["digests"]) == {"features", "labels"}
    raw = bytearray(path.read_bytes())  # and from now on damage is caught
    raw[raw.find(expected.numpy().tobytes())] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="do not match the digest"):
        run(backbone, images, tmp_path)
    assert backbone.model.calls == 8


def test_a_cache_before_digests_that_cannot_be_rewritten_is_used_as_before(images, tmp_path, capsys, monkeypatch):
    import workbench.data.features as features

    backbone = FakeBackbone(CountingNet())
    expected = run(backbone, images, tmp_path)
    (path,) = tmp_path.rglob("*.pt")
    blob = torch.load(path, weights_only=True)
    del blob["digests"]
    torch.save(blob, path)

    def read_only(blob, temporary):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(features, "_save", read_only)  # as in a read-only cache folder
    assert torch.equal(run(backbone, images, tmp_path), expected) and backbone.model.calls == 4
    assert "cannot be rewritten with them (Permission denied); using it unchecked" in capsys.readouterr().out
    assert "digests" not in torch.load(path, weights_only=True)


def test_all_finite_sees_one_nan_or_infinity_anywhere():
    x = torch.randn(30, 7)
    assert all_finite(x) and all_finite(torch.empty(0, 7))
    for value in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[17, 3] = value
        assert not all_finite(y)
