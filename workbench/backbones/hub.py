"""The Hugging Face hub as a weights source: its cache folder, offline mode, fail-fast loads.

timm (`resnet18`, `vit_base_patch16_224.mae`, ...) and transformers (`gpt2`, ...) fetch
pretrained weights through huggingface_hub, which keeps them in its cache folder
(`HF_HUB_CACHE`, default `$HF_HOME/hub` = `~/.cache/huggingface/hub`):
`models--<org>--<name>/snapshots/<commit>/<file>`, with `refs/main` naming the commit. A copied
cache works on a machine without network access. huggingface_hub reads `HF_HUB_CACHE` and
`HF_HUB_OFFLINE` once, when it is imported; the helpers here read its live settings.

Without `HF_HUB_OFFLINE`, a machine that cannot reach the hub would retry each file for about
25 s before falling back to the cache. `hub_access` asks the hub once, with a short timeout,
and runs the load in offline mode when it does not answer: cached weights load at once, and
missing ones are an error at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

#: seconds the hub has to answer before a load runs in offline mode
PROBE_TIMEOUT_S = 3.0


def hub_cache_dir() -> Path:
    """The folder huggingface_hub reads and writes hub files in (HF_HUB_CACHE, resolved)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser().resolve()


def repo_cache_dir(repo_id: str) -> Path:
    """Where the files of model repo `repo_id` ("org/name") sit in the hub cache."""
    return hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the hub endpoint (huggingface.co, or HF_ENDPOINT) answers within `timeout` s."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:  # any HTTP answer will do; proxies configured for huggingface_hub apply
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:
        return False
    return True


@contextlib.contextmanager
def hub_access() -> Iterator[str | None]:
    """Runs a hub load; yields why it runs offline ("HF_HUB_OFFLINE=1 is set", "... did not
    answer"), or None when the hub answered. An unreachable hub switches huggingface_hub to
    offline mode for the block, so that cached files load and missing ones fail at once."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        yield "HF_HUB_OFFLINE=1 is set"
        return
    if hub_reachable():
        yield None
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield f"the hub ({constants.ENDPOINT}) did not answer within {PROBE_TIMEOUT_S:g} s"
    finally:
        constants.HF_HUB_OFFLINE = False


def short_error(error: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, cut to about `limit` characters."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def not_cached_message(what: str, repo_id: str, offline: str, download: str, fix: str,
                       tag: str = "") -> str:
    """One line: `what` (timm `tag`, from hub repo `repo_id`) is not in the hub cache and why
    nothing was downloaded (`offline`); how to fill the cache (`download`, run where there is
    network access) and the alternative `fix`."""
    cache = hub_cache_dir()
    source = f"timm tag {tag}, hub repo '{repo_id}'" if tag else f"hub repo '{repo_id}'"
    return (
        f"{what} ({source}) not found in the Hugging Face cache {cache} (looked in "
        f"{repo_cache_dir(repo_id).name}/), and nothing can be downloaded: {offline}. On a "
        f"machine with network access run {download}, then copy its Hugging Face cache folder "
        f"(~/.cache/huggingface/hub) to {cache} (or point HF_HUB_CACHE at the copy); or {fix}"
    )
