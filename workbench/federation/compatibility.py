"""What a federation's settings can run with a method: refused in one line naming the fix, before
any work, wherever a round is run from (`FitProtocol.start` in `workbench.engines.round`, which
the engines call): the settings against each other are `Federation`'s own checks; here, against
the method's upload spec and where its clients run."""
from __future__ import annotations

from workbench.federation import codec
from workbench.federation.protocol import Federation


def check_compatible(federation: Federation, spec: codec.Spec, name: str, remote: bool = False) -> None:
    """Refuses `federation` for the method `name` sending `spec`, its clients on remote nodes
    (`remote`: a Flower transport, whose clients run their own code) or in process."""
    stacked, updates = sorted(codec.stacked_names(spec)), codec.model_update_names(spec)
    if federation.secure_aggregation and stacked:
        raise ValueError(f"secure aggregation reveals only a sum, but {name} sends per-client uploads "
                         f"{stacked}: set federation.secure_aggregation=false for it")
    if federation.dp_sigma > 0 and stacked:
        raise ValueError(f"federation.dp_sigma adds noise to summed statistics; {name} sends per-client "
                         f"uploads {stacked}: set federation.dp_sigma=0 for it")
    if federation.client_level_dp and not updates:
        raise ValueError(f"federation.dp_clip clips clients' model updates, which {name} does not send: "
                         "set federation.dp_clip=0 (analytic methods: dp_sigma with feature_clip)")
    if federation.client_level_dp and federation.dp_sigma > 0:
        raise ValueError("federation.dp_clip (client-level DP) and dp_sigma (noise on statistics) both noise "
                         "the sum: set one of them to 0")
    _check_aggregation(federation, spec, name)
    if federation.adversary_fraction > 0 and federation.attack == "noise" and not updates:
        raise ValueError(f"federation.attack=noise noises model updates, which {name} does not send: use "
                         "sign_flip or scale (on its statistics) or label_flip")
    if remote:
        _check_remote(federation)


def _check_aggregation(federation: Federation, spec: codec.Spec, name: str) -> None:
    updates = codec.model_update_names(spec)
    if federation.robust and not updates:
        raise ValueError(f"federation.aggregation={federation.aggregation} combines clients' model updates; {name} "
                         "sends statistics, which are summed: set federation.aggregation=mean for it")
    if federation.screens and updates:
        raise ValueError(f"federation.aggregation=screen checks the Grams of an analytic method's statistics; "
                         f"{name} sends model updates: use median, trimmed_mean, krum, multi_krum or norm_bound "
                         "for them")
    if federation.screens and not codec.gram_names(spec):
        raise ValueError(f"federation.aggregation=screen checks the Grams of an analytic method's statistics; "
                         f"{name} sends no Gram to check: set federation.aggregation=mean for it")


def _check_remote(federation: Federation) -> None:
    """What runs only with the clients in process."""
    if federation.aggregation != "mean":
        raise ValueError(f"federation.aggregation={federation.aggregation} runs in process (its clients' uploads "
                         "stay one row each); a remote transport's nodes sum theirs: set aggregation=mean there")
    if federation.adversary_fraction > 0:
        raise ValueError("federation.adversary_fraction makes in-process clients lie; a remote transport's "
                         "clients run their own code: set it to 0 there (or fit in process)")
    if federation.feature_clip > 0:
        raise ValueError("federation.feature_clip clips the rows of in-process clients; with a remote "
                         "transport, clip the features where the clients load them and set it to 0")
