"""Pretrained weights through timm's and transformers' own hub machinery, offline.

The tests write weights drawn from a random init into a Hugging Face cache under tmp_path, in
the layout huggingface_hub reads (`models--<org>--<name>/refs/main` naming a commit,
`snapshots/<commit>/<file>`), turn offline mode on (HF_HUB_OFFLINE=1), or leave it off with a
hub that refuses connections, and build the workbench backbone with `pretrained=True` and no
`weights_path`: timm (`load_pretrained` -> `load_state_dict_from_hf` -> `hf_hub_download`) or
transformers (`from_pretrained`) find the files themselves. The features must equal those of the
same weights loaded by hand into the same architecture; so must those of the same file passed as
`weights_path`. An empty cache must be one clear error naming the tag and the cache folder.

The MAE tag is `vit_base_patch16_224.mae` (timm registers no smaller `vit_*.mae`), built with a
smaller width and depth (`SMALL_VIT`: timm's ViT builders let keyword arguments override their
size) so the test writes a 0.65 MB file rather than 343 MB: the workbench gets the overrides
through a patched `timm_create_kwargs`, on top of its own; everything else - the tag, its
pretrained config and hub repo, its checkpoint filter, `global_pool='token'` - is the real one.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import timm
import torch

from tests.conftest import save_tiny_gpt2
from workbench.backbones import (
    Backbone,
    BackboneWeightsError,
    TextBackbone,
    build_backbone,
    timm_models,
)

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as refs/main holds one
SMALL_VIT = {"embed_dim": 64, "depth": 2, "num_heads": 2}
MAE = "vit_base_patch16_224.mae"
#: backbone name -> (its timm tag, its hub repo, size overrides, how the reference pools)
TIMM_MODELS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "resnet18": ("resnet18.a1_in1k", "timm/resnet18.a1_in1k", {}, {}),
    MAE: (MAE, "timm/vit_base_patch16_224.mae", SMALL_VIT, {"global_pool": "token"}),
}


# --------------------------------------------------------------------------- helpers


def features(backbone: Backbone, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return backbone.model(images)


def random_images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def forked_seed(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def snapshot_dir(cache: Path, repo_id: str) -> Path:
    """`<cache>/models--<org>--<name>/snapshots/<REVISION>/`, with refs/main pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    return snapshot


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)


def random_timm_state(name: str) -> dict[str, torch.Tensor]:
    """The state dict of the tag's full timm model (classifier head included, as published),
    random weights and BatchNorm statistics (seed 7: not the backbones' default seed 0)."""
    tag, _, overrides, _ = TIMM_MODELS[name]
    with forked_seed(7):
        state = timm.create_model(tag, pretrained=False, **overrides).state_dict()
        for key, value in state.items():
            if key.endswith("running_mean"):
                value.normal_(0, 0.1)
            elif key.endswith("running_var"):
                value.uniform_(0.5, 1.5)
    return state


def hand_loaded(name: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same weights loaded by hand: strict load into the tag's architecture, head dropped."""
    tag, _, overrides, pooling = TIMM_MODELS[name]
    net: Any = timm.create_model(tag, pretrained=False, **overrides, **pooling)
    net.load_state_dict(state, strict=True)
    net.reset_classifier(0)
    return net.eval()


def dead_endpoint() -> str:
    """An http endpoint on this machine where nothing listens (a refused connection)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hugging Face hub cache in tmp_path, in offline mode; torch's hub folder there.

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import (timm and the
    workbench import it long before a test runs), so its constants are patched as well as the
    environment (which subprocesses would read)."""
    import huggingface_hub
    import huggingface_hub.constants as hf_constants
    from timm.models import _hub

    if not getattr(_hub, "_has_hf_hub", True):  # timm 1.0.3's imports fail on huggingface_hub ≥ 1.0
        pytest.skip(f"timm {timm.__version__} cannot read hub files with huggingface_hub "
                    f"{huggingface_hub.__version__}: pip install -U timm")

    home = tmp_path / "huggingface"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> Path:
    """The hub cache of `hub_cache` without offline mode, and a hub endpoint that refuses
    connections: a machine without network access where nobody set HF_HUB_OFFLINE."""
    import huggingface_hub.constants as hf_constants

    endpoint = dead_endpoint()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    return hub_cache


@pytest.fixture(params=list(TIMM_MODELS), ids=["resnet18", "vit_mae"])
def timm_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A timm backbone name; for the MAE tag, the workbench builds it at SMALL_VIT's size."""
    name = request.param
    overrides = TIMM_MODELS[name][2]
    if overrides:
        workbench_kwargs = timm_models.timm_create_kwargs
        monkeypatch.setattr(timm_models, "timm_create_kwargs",
                            lambda model: {**workbench_kwargs(model), **overrides})
    return name


# --------------------------------------------------------------------------- timm, hub cache


@pytest.mark.parametrize("filename", ["model.safetensors", "pytorch_model.bin"])
def test_timm_hub_weights_load_from_a_local_cache_offline(
    timm_name: str, filename: str, hub_cache: Path
) -> None:
    """timm's repos hold model.safetensors (timm asks for it first), older ones pytorch_model.bin."""
    tag, repo_id, _, _ = TIMM_MODELS[timm_name]
    cfg = timm.models.get_pretrained_cfg(timm_name)
    assert cfg is not None and cfg.hf_hub_id == repo_id  # the repo timm asks the hub cache for
    state = random_timm_state(timm_name)
    save_weights(state, snapshot_dir(hub_cache, repo_id) / filename)

    backbone = build_backbone(timm_name, pretrained=True)
    images = random_images(2, backbone.input_size)
    expected = hand_loaded(timm_name, state)(images).detach()
    assert torch.equal(features(backbone, images), expected)
    assert backbone.weights_id == f"timm:{tag}"
    net: Any = backbone.model.net
    assert net.pretrained_cfg["hf_hub_id"] == repo_id
    # The weights are the file's: a seeded random init gives other features.
    assert not torch.allclose(features(build_backbone(timm_name, pretrained=False), images),
                              expected)


def test_a_copied_cache_loads_without_network_even_without_offline_mode(
    timm_name: str, unreachable_hub: Path
) -> None:
    """No HF_HUB_OFFLINE and no network: the hub is asked once, briefly, then the cache is used
    (huggingface_hub alone would retry each file for about 25 s first)."""
    state = random_timm_state(timm_name)
    save_weights(state, snapshot_dir(unreachable_hub, TIMM_MODELS[timm_name][1]) / "model.safetensors")
    start = time.monotonic()
    backbone = build_backbone(timm_name, pretrained=True)
    assert time.monotonic() - start < 10
    images = random_images(1, backbone.input_size)
    assert torch.equal(features(backbone, images), hand_loaded(timm_name, state)(images).detach())


# --------------------------------------------------------------------------- timm, weights_path


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_weights_path_gives_the_hand_loaded_features(
    timm_name: str, suffix: str, tmp_path: Path, hub_cache: Path
) -> None:
    """The published file (classifier head included) as data.weights_path: the hub is not used."""
    state = random_timm_state(timm_name)
    path = tmp_path / f"weights{suffix}"
    save_weights(state, path)

    backbone = build_backbone(timm_name, pretrained=True, weights_path=str(path))
    images = random_images(2, backbone.input_size)
    assert torch.equal(features(backbone, images), hand_loaded(timm_name, state)(images).detach())
    assert backbone.weights_id == f"file-sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    assert not any(hub_cache.iterdir())


# --------------------------------------------------------------------------- missing weights


def assert_names_the_tag_the_folder_and_the_fixes(message: str, cache: Path) -> None:
    assert "\n" not in message
    assert "resnet18.a1_in1k" in message and "'timm/resnet18.a1_in1k'" in message
    assert f"Hugging Face cache {cache.resolve()} " in message
    assert "models--timm--resnet18.a1_in1k/" in message
    assert "copy its Hugging Face cache folder" in message
    assert "weights_path: /path/to/weights (data.weights_path" in message
    assert "pretrained: false" in message


def test_missing_hub_weights_offline_are_one_clear_error(hub_cache: Path) -> None:
    start = time.monotonic()
    with pytest.raises(BackboneWeightsError) as raised:
        build_backbone("resnet18", pretrained=True)
    assert time.monotonic() - start < 5
    message = str(raised.value)
    assert message.startswith("pretrained weights for 'resnet18' (timm tag resnet18.a1_in1k, ")
    assert "nothing can be downloaded: HF_HUB_OFFLINE=1 is set" in message
    assert_names_the_tag_the_folder_and_the_fixes(message, hub_cache)
    assert isinstance(raised.value, OSError)  # the command line's kind of wrong input


def test_missing_hub_weights_without_network_fail_fast(unreachable_hub: Path) -> None:
    start = time.monotonic()
    with pytest.raises(BackboneWeightsError) as raised:
        build_backbone("resnet18", pretrained=True)
    assert time.monotonic() - start < 10  # not huggingface_hub's ~50 s of retries
    message = str(raised.value)
    assert "nothing can be downloaded: the hub (http://127.0.0.1:" in message
    assert_names_the_tag_the_folder_and_the_fixes(message, unreachable_hub)


def test_missing_hub_weights_on_the_command_line(
    hub_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workbench.__main__ import main

    root = Path(__file__).resolve().parents[2]
    runs = tmp_path / "runs"
    status = main(["fit", "--config", str(root / "configs/demo.yaml"), "--trainer.enable_progress_bar=false",
                   "--data.backbone=resnet18", f"--data.cache_dir={tmp_path / 'features'}",
                   f"--run_dir={runs}", "--wandb=disabled"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert err.startswith("error: pretrained weights for 'resnet18'")
    assert_names_the_tag_the_folder_and_the_fixes(err.strip().splitlines()[0], hub_cache)
    assert not runs.exists()


# --------------------------------------------------------------------------- GPT-2, hub cache

SENTENCES = ["the cat sat on the mat", "a dog ran in the park today", "hello"]


def tiny_gpt2(directory: Path) -> tuple[Any, Any]:
    """A 1-layer, 32-wide GPT-2 (random weights) and a byte-level BPE tokenizer trained on a few
    words, saved into `directory` with save_pretrained as the hub repo holds them."""
    with forked_seed(7):
        return save_tiny_gpt2(directory, SENTENCES, layers=1, vocab_size=300)


def test_gpt2_loads_from_a_local_hub_cache_offline(hub_cache: Path) -> None:
    pytest.importorskip("transformers", reason="the text backbones need the `text` extra: pip install -e '.[text]'")
    from transformers import GPT2Model

    snapshot = snapshot_dir(hub_cache, "openai-community/gpt2")
    _, tokenizer = tiny_gpt2(snapshot)
    reference = GPT2Model.from_pretrained(snapshot).eval()  # by hand, from the same files

    backbone = build_backbone("gpt2", pretrained=True)
    assert isinstance(backbone, TextBackbone)
    assert backbone.weights_id == f"hf:openai-community/gpt2@{REVISION}"
    assert (backbone.feature_dim, backbone.max_length) == (32, 64)
    batch = backbone.tokenize(SENTENCES)
    with torch.no_grad():
        got = backbone.model(**batch)
    for i, text in enumerate(SENTENCES):  # each text alone, unpadded: the reference
        ids = tokenizer([text], return_tensors="pt")["input_ids"]
        assert torch.equal(batch["input_ids"][i, : ids.shape[1]], ids[0])
        with torch.no_grad():
            hidden = reference(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(got[i], hidden.mean(0), rtol=0, atol=1e-6)
    # A random init takes the config and the tokenizer from the same cache.
    random = build_backbone("gpt2", pretrained=False)
    assert isinstance(random, TextBackbone)
    assert random.weights_id == "random-init:seed=0" and random.tokenizer_id == backbone.tokenizer_id


def test_gpt2_missing_from_the_cache_names_the_repo_and_the_folder(hub_cache: Path) -> None:
    pytest.importorskip("transformers", reason="the text backbones need the `text` extra: pip install -e '.[text]'")
    start = time.monotonic()
    with pytest.raises(BackboneWeightsError) as raised:
        build_backbone("gpt2", pretrained=True)
    assert time.monotonic() - start < 5
    message = str(raised.value)
    assert "\n" not in message
    assert "'openai-community/gpt2'" in message and "models--openai-community--gpt2/" in message
    assert f"Hugging Face cache {hub_cache.resolve()} " in message
    assert "HF_HUB_OFFLINE=1 is set" in message and "pass weights_path: DIR" in message
