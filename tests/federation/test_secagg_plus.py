"""SecAgg+: sparse-graph masks, self-masks and Shamir recovery give the exact sum, and fail loudly."""
from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tests.conftest import relative_error
from workbench.data import FederatedDataModule, SyntheticBlobs
from workbench.federation import Federation, shamir
from workbench.federation.local_training import LocalTraining
from workbench.federation.secure_aggregation import (
    RING_MASK,
    MaskStreams,
    SecureAggregator,
    binomial_tail,
    harary_neighbours,
    ring_sum,
    secagg_plus_parameters,
    secure_aggregator,
)
from workbench.methods import AFL, FedAvg, Problem

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDING = 2.0 ** -33  # fixed point with 32 fractional bits: at most 2^-33 per number and client


def uploads(num_clients: int, length: int = 30, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": 100 * torch.randn(length, dtype=torch.float64, generator=g),
             "count": torch.randint(0, 50, (3,), generator=g)} for _ in range(num_clients)]


def sparse(num_clients: int, degree: int = 4, threshold: int = 3, round_index: int = 0) -> SecureAggregator:
    return SecureAggregator(range(num_clients), seed=7, round_index=round_index, graph="sparse",
                            degree=degree, threshold=threshold)


# ---- Shamir ---------------------------------------------------------------------------------------
def test_any_t_shares_reconstruct_the_secret_and_fewer_are_refused():
    secret, coefficients = 123456789 ** 3, [987654321, 5 ** 40, 2 ** 120 + 3]  # t = 4
    shares = shamir.split(secret, coefficients, range(9))
    for holders in ([0, 1, 2, 3], [5, 6, 7, 8], [8, 2, 4, 0]):
        assert shamir.reconstruct({h: shares[h] for h in holders}, 4) == secret
    assert shamir.reconstruct(shares, 4) == secret  # more than t: the first t are used
    with pytest.raises(ValueError, match="needs 4 shares to be reconstructed, only 3 arrived"):
        shamir.reconstruct({h: shares[h] for h in (1, 3, 5)}, 4)
    # t − 1 shares fit every secret: for any s there is a polynomial through (0, s) and them
    three = {h: shares[h] for h in (1, 3, 5)}
    for candidate in (0, 42, shamir.PRIME - 1):
        assert shamir.reconstruct({**three, -1: candidate}, 4) == candidate  # x = 0 holds f(0)


def test_split_deals_what_share_gives_each_holder():
    coefficients = [7 ** 50 % shamir.PRIME, 3, shamir.PRIME - 1]
    assert shamir.split(99, coefficients, [0, 4, 17]) == {h: shamir.share(99, coefficients, h) for h in (0, 4, 17)}


def test_a_wrong_share_gives_a_wrong_secret():
    shares = shamir.split(31337, [11, 22], range(5))
    shares[1] = (shares[1] + 1) % shamir.PRIME
    assert shamir.reconstruct({h: shares[h] for h in (0, 1, 2)}, 3) != 31337
    assert shamir.reconstruct({h: shares[h] for h in (2, 3, 4)}, 3) == 31337


# ---- the PRG ----------------------------------------------------------------------------------------
def test_the_prg_is_aes_128_ctr_under_the_seeds_hashed_key():
    seed = (1, 2 ** 127 - 5)
    key = hashlib.blake2b((1).to_bytes(16, "little") + (2 ** 127 - 5).to_bytes(16, "little"), digest_size=16).digest()
    counters = b"".join(c.to_bytes(16, "big") for c in range(3))  # AES of the counter blocks 0, 1, 2
    blocks = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(counters)
    streams = MaskStreams()
    assert np.array_equal(streams.draw(seed, 5), np.frombuffer(blocks, dtype="<u8")[:5])
    assert np.array_equal(streams.draw(seed, 3), streams.draw(seed, 7)[:3])  # counter-based: a prefix
    assert not np.array_equal(streams.draw((1, 2 ** 127 - 4), 5), streams.draw(seed, 5))
    words = streams.draw(seed, 20000) & np.uint64(RING_MASK)  # ring elements: uniform on [0, 2^62)
    assert abs(float(words.mean()) / 2 ** 62 - 0.5) < 5 * (12 * len(words)) ** -0.5
    total = streams.signed_sum([(seed, 1), ((3,), -1), (seed, 1)], 5).numpy().astype(np.uint64)
    expected = (2 * streams.draw(seed, 5) - streams.draw((3,), 5)) & np.uint64(RING_MASK)  # mod 2^64, then 2^62
    assert np.array_equal(total, expected)
    assert streams.drawn == 11


@pytest.mark.parametrize("graph", ["sparse", "complete"])
def test_added_clients_masks_are_drawn_at_once_and_sum_to_their_messages(graph):
    n, data = 20, uploads(20)
    survivors = [c for c in range(n) if c not in (3, 14)]

    def build() -> SecureAggregator:
        return SecureAggregator(range(n), seed=7, round_index=1, graph=graph, degree=6, threshold=3)

    batched, single = build(), build()
    for c in survivors:
        batched.add(c, data[c])
    assert batched.streams.drawn == 0  # nothing drawn until the total is read
    total = batched.total
    per_client = (6 + 1) if graph == "sparse" else n - 1
    assert batched.streams.drawn == per_client * len(survivors) == batched.costs(survivors)["mask_streams"]
    assert torch.equal(total, ring_sum(single.masked_upload(c, data[c]) for c in survivors))  # bit for bit
    again = build()
    for c in reversed(survivors):
        again.add(c, data[c])
    assert torch.equal(again.total, total)  # a rerun, in any order, gives the same bits
    plain = sum(data[c]["x"] for c in survivors)
    assert float((batched.unmask(total, survivors)["x"] - plain).abs().max()) <= len(survivors) * ROUNDING
    with pytest.raises(ValueError, match="not a participant"):
        batched.add(n + 1, data[0])


# ---- the graph and its parameters ----------------------------------------------------------------
def test_the_harary_graph_is_k_regular_symmetric_and_seeded_per_round():
    clients = list(range(3, 53))
    graph = harary_neighbours(clients, 6, seed=1, round_index=0)
    assert sorted(graph) == clients
    assert all(len(set(linked)) == 6 and u not in linked for u, linked in graph.items())
    assert all(u in graph[v] for u, linked in graph.items() for v in linked)
    assert graph == harary_neighbours(clients, 6, seed=1, round_index=0)
    assert graph != harary_neighbours(clients, 6, seed=1, round_index=1)
    assert harary_neighbours([0, 1, 2, 3], 4, seed=1, round_index=0)[2] == [0, 1, 3]  # k ≥ n − 1: all others


def test_the_degree_rule_is_the_smallest_k_meeting_the_stated_bounds():
    n, gamma, delta = 1000, 0.05, 0.05
    k, t = secagg_plus_parameters(n, delta, gamma)
    assert (k, t) == (36, 19)

    def meets(k: int, t: int) -> bool:
        return (n * binomial_tail(k, gamma, t) <= 2 ** -40 and n * (gamma + delta) ** (k // 2) <= 2 ** -40
                and n * binomial_tail(k, delta, k - t + 1) <= 2 ** -30 and t > k // 2)

    assert meets(k, t)
    assert not any(meets(k - 2, s) for s in range(k - 1))  # nothing smaller would do
    assert secagg_plus_parameters(100_000, delta, gamma)[0] == 40  # O(log n): 36 -> 40 over 100×
    assert secagg_plus_parameters(8, 0.25, gamma) == (7, 4)  # too small for the bounds: all pairs, a majority
    assert binomial_tail(3, 0.5, 2) == pytest.approx(0.5)


# ---- the protocol --------------------------------------------------------------------------------
def test_a_sparse_round_sums_exactly_with_dropouts_and_each_client_draws_k_plus_one_streams():
    n, data = 30, uploads(30)
    aggregator = sparse(n, degree=6, threshold=4)
    survivors = [c for c in range(n) if c not in (4, 11, 17)]
    messages = {c: aggregator.masked_upload(c, data[c]) for c in survivors}
    assert aggregator.streams.drawn == 7 * len(survivors)  # k pair masks + the self-mask
    assert aggregator.costs(survivors)["mask_streams"] == aggregator.streams.drawn
    assert aggregator.costs(survivors)["share_bytes"] == 16 * (2 * 6 * n + 6 * len(survivors))

    drawn = aggregator.streams.drawn
    total = aggregator.unmask(ring_sum(messages.values()), uploaded=survivors)
    dropped_links = sum(1 for j in (4, 11, 17) for i in aggregator.neighbours[j] if i in survivors)
    assert aggregator.streams.drawn - drawn == len(survivors) + dropped_links  # the server's streams
    assert aggregator.costs(survivors)["server_mask_streams"] == len(survivors) + dropped_links
    plain = sum(data[c]["x"] for c in survivors)
    assert float((total["x"] - plain).abs().max()) <= len(survivors) * ROUNDING
    assert torch.equal(total["count"], sum(data[c]["count"] for c in survivors))  # integers exactly

    seen = aggregator.layout.unflatten(messages[0], 32)["x"]  # one message alone looks like noise
    assert float((seen - data[0]["x"]).abs().min()) > 1e3


def test_all_pairs_draw_n_minus_one_streams_per_client_and_no_shares():
    n, data = 9, uploads(9)
    aggregator = SecureAggregator(range(n), seed=7, round_index=0)
    survivors = [c for c in range(n) if c != 4]
    total = ring_sum(aggregator.masked_upload(c, data[c]) for c in survivors)
    assert aggregator.streams.drawn == (n - 1) * len(survivors)
    assert aggregator.costs(survivors) == {"mask_streams": (n - 1) * len(survivors), "share_bytes": 0,
                                           "server_mask_streams": len(survivors)}
    plain = sum(data[c]["x"] for c in survivors)
    assert float((aggregator.unmask(total, survivors)["x"] - plain).abs().max()) <= n * ROUNDING


def test_without_the_self_masks_removed_the_sum_is_noise():
    """The self-masks are there: the pairwise masks alone do not explain the survivors' sum."""
    n, data = 12, uploads(12)
    aggregator = sparse(n)
    total = ring_sum(aggregator.masked_upload(c, data[c]) for c in range(n))
    revealed = aggregator.reveal(range(n))
    assert all(kind == "self" for kind, _ in revealed)  # nobody dropped: only self-mask shares
    wrong = dict(revealed)
    holder = min(revealed[("self", 5)])
    wrong[("self", 5)] = {**revealed[("self", 5)], holder: (revealed[("self", 5)][holder] + 1) % shamir.PRIME}
    plain = sum(d["x"] for d in data)
    assert float((aggregator.unmask(total, range(n), revealed)["x"] - plain).abs().max()) <= n * ROUNDING
    assert float((aggregator.unmask(total, range(n), wrong)["x"] - plain).abs().max()) > 1e3


def test_a_wrong_key_share_of_a_dropped_client_spoils_the_sum():
    n, data = 12, uploads(12)
    aggregator = sparse(n)
    survivors = [c for c in range(n) if c != 3]
    total = ring_sum(aggregator.masked_upload(c, data[c]) for c in survivors)
    revealed = aggregator.reveal(survivors)
    shares = revealed[("key", 3)]
    assert len(shares) == 4 and set(shares) == set(aggregator.neighbours[3])
    first = min(shares)  # used by the reconstruction (the first t holders)
    revealed[("key", 3)] = {**shares, first: (shares[first] + 1) % shamir.PRIME}
    plain = sum(data[c]["x"] for c in survivors)
    assert float((aggregator.unmask(total, survivors, revealed)["x"] - plain).abs().max()) > 1e3


def test_a_survivor_never_reveals_both_secrets_of_one_peer():
    aggregator = sparse(16)
    survivors = [c for c in range(16) if c not in (2, 9)]
    revealed = aggregator.reveal(survivors)
    for holder in survivors:
        kinds = {}
        for (kind, dealer), shares in revealed.items():
            if holder in shares:
                assert dealer not in kinds, f"client {holder} revealed both secrets of {dealer}"
                kinds[dealer] = kind
        assert sorted(kinds) == aggregator.neighbours[holder]
        assert all((kind == "key") == (dealer in (2, 9)) for dealer, kind in kinds.items())
    # what was revealed is what the dealers dealt
    held = aggregator.shares_held(survivors[0])
    for dealer, (key_share, self_share) in held.items():
        kind = "key" if dealer in (2, 9) else "self"
        assert revealed[(kind, dealer)][survivors[0]] == (key_share if kind == "key" else self_share)


def test_fewer_than_t_surviving_shares_is_an_error_naming_the_fix():
    n, data = 12, uploads(12)
    aggregator = sparse(n, degree=4, threshold=4)  # every neighbour's share is needed
    victim = 0
    survivors = [c for c in range(n) if c != aggregator.neighbours[victim][0]]
    total = ring_sum(aggregator.masked_upload(c, data[c]) for c in survivors)
    with pytest.raises(RuntimeError, match=r"client \d+'s .* needs 4 shares .* only 3 arrived.*secagg_threshold"):
        aggregator.unmask(total, survivors)


def test_remote_clients_build_the_same_aggregator_from_its_settings():
    federation = Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4, seed=2)
    here = secure_aggregator(federation, range(10), 3, symmetric=())
    there = SecureAggregator.from_settings(here.settings(), 3)
    data = uploads(10)
    assert (there.degree, there.threshold, there.neighbours) == (here.degree, here.threshold, here.neighbours)
    assert here.threshold == 3  # k = 4 set, t the majority the rule gives it
    assert torch.equal(there.masked_upload(5, data[5]), here.masked_upload(5, data[5]))
    old = {"participants": [0, 1, 2], "seed": 5, "bits": 32, "symmetric": []}  # settings without a graph
    assert SecureAggregator.from_settings(old, 0).graph == "complete"


def test_federation_settings_of_secagg_plus_are_checked():
    with pytest.raises(ValueError, match="secure_aggregation=true"):
        Federation(secure_aggregation_graph="sparse")
    with pytest.raises(ValueError, match=r"even number ≥ 2.*use 6"):
        Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=5)
    with pytest.raises(ValueError, match="secure_aggregation_graph=sparse"):
        Federation(secure_aggregation=True, secagg_threshold=3)
    with pytest.raises(ValueError, match="lower the threshold or raise the degree"):
        Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4, secagg_threshold=5)
    with pytest.raises(ValueError, match="complete or sparse"):
        Federation(secure_aggregation=True, secure_aggregation_graph="ring")
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_corrupt_fraction=0.6)
    small = Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4, secagg_threshold=4)
    with pytest.raises(ValueError, match="secagg_threshold to at most 3"):  # 4 clients: 3 neighbours each
        secure_aggregator(small, range(4), 0)


# ---- in the engine -------------------------------------------------------------------------------
def data(num_clients: int = 14) -> FederatedDataModule:
    blobs = SyntheticBlobs(num_classes=4, dim=8, train_size=700, test_size=100, seed=2)
    dm = FederatedDataModule(dataset="synthetic", synthetic=blobs, num_clients=num_clients, partition="iid",
                             batch_size=64)
    dm.setup()
    return dm


def test_afl_under_secagg_plus_with_dropouts_gives_the_plain_model_and_logs_its_costs(fit_method):
    dm, protocol = data(), {"dropout": 0.2, "seed": 4}
    plain, masked, pairs = AFL(gamma=1.0, gamma_out=0.1), AFL(gamma=1.0, gamma_out=0.1), AFL(gamma=1.0, gamma_out=0.1)
    sparse = Federation(**protocol, secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4,
                        secagg_threshold=2)
    fit_method(plain, dm, Federation(**protocol))
    metrics = fit_method(masked, dm, sparse).fit_metrics
    complete = fit_method(pairs, dm, Federation(**protocol, secure_aggregation=True)).fit_metrics
    assert relative_error(masked.weight, plain.weight) <= 1e-8
    survivors, k = metrics["comm/clients_in_round"], 4
    assert survivors == 11 and metrics["comm/secagg_degree"] == k and metrics["comm/secagg_threshold"] == 2
    assert metrics["comm/secagg_mask_streams_per_client"] == pytest.approx(survivors * (k + 1) / 14)
    assert metrics["comm/secagg_share_bytes_per_client"] == pytest.approx(16 * (14 * 2 * k + survivors * k) / 14)
    assert complete["comm/secagg_mask_streams_per_client"] == pytest.approx(survivors * 13 / 14)
    assert complete["comm/secagg_share_bytes_per_client"] == 0
    assert metrics["comm/bytes_up"] == complete["comm/bytes_up"]


def test_fedavg_rounds_under_secagg_plus_give_the_plain_model(fit_method):
    weights = []
    for graph in (None, "sparse"):
        method = FedAvg(num_rounds=2, architecture="linear", sample_fraction=0.75, seed=1, local=LocalTraining(lr=0.1))
        fit_method(method, data(), Federation(dropout=0.2, seed=4) if graph is None else Federation(
            dropout=0.2, seed=4, secure_aggregation=True, secure_aggregation_graph=graph, secagg_degree=6,
            secagg_threshold=3))
        weights.append(method.flat_parameters())
    assert relative_error(weights[1], weights[0]) <= 1e-6


def test_secagg_plus_that_no_round_can_unmask_is_refused_before_any_work_and_its_fixes_work(tmp_path):
    """K = 3, dropout 0.34: every client neighbours both others (k = 2, t = 2) and one drops out
    of every round, so each survivor's self-mask seed has one surviving holder of the two shares
    needed. Refused in one line before any run folder, naming fixes that work (a larger degree
    cannot: there are no more clients to hold shares); each named fix then fits."""
    from workbench.cli import main
    from workbench.engines.round import FitProtocol

    args = ["fit", "--model=AFL", "--data=FederatedDataModule", "--data.dataset=synthetic", "--data.num_clients=3",
            "--data.partition=iid", "--federation.secure_aggregation=true", "--wandb=disabled",
            "--federation.secure_aggregation_graph=sparse", "--trainer.enable_progress_bar=false",
            f"--run_dir={tmp_path}"]
    refusal = (r"^SecAgg\+ cannot unmask a round here: among 3 clients each one neighbours all 2 others, 1 drop out "
               r"of every round \(federation.dropout=0.34\), .* has 1 surviving holder of the 2 shares it needs: set "
               r"federation.secure_aggregation_graph=complete \(all-pairs masks recover any dropout\) or "
               r"federation.dropout below 0.167 \(at most 0 of 3 dropping out\)$")
    with pytest.raises(ValueError, match=refusal):
        main([*args, "--federation.dropout=0.34"])
    assert not any(tmp_path.iterdir())
    federation = Federation(secure_aggregation=True, secure_aggregation_graph="sparse", dropout=0.34)
    with pytest.raises(ValueError, match=r"^SecAgg\+ cannot unmask"):  # anyone running rounds meets it too
        FitProtocol.start(set_up(AFL(), 3), federation, 3)
    for fix in ("--federation.secure_aggregation_graph=complete", "--federation.dropout=0.16"):
        dropout = [] if "dropout" in fix else ["--federation.dropout=0.34"]
        main([*args, *dropout, fix, f"--run_name={fix.split('.')[-1]}"])
    # with k < n − 1 (14 clients, k = 4) a round's dropouts hit one client's neighbours by chance: not refused
    FitProtocol.start(set_up(AFL(), 14), Federation(
        secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4, dropout=0.3), 14)


def set_up(method, num_clients: int):
    method.setup(Problem((8,), 4, num_clients))
    return method


def test_a_threshold_of_one_share_is_warned_about():
    from workbench.federation.secure_aggregation import check_secure_aggregation

    chosen = Federation(secure_aggregation=True, secure_aggregation_graph="sparse", secagg_degree=4, secagg_threshold=1)
    with pytest.warns(UserWarning, match=r"threshold of one share \(federation.secagg_threshold=1\): any one "
                                         r"neighbour's share reveals a client's secrets.*leave federation.secagg_thr"):
        check_secure_aggregation(chosen, 10, 10)
    two = Federation(secure_aggregation=True, secure_aggregation_graph="sparse")  # n = 2: k = 1, so t = 1
    with pytest.warns(UserWarning, match=r"threshold of one share \(2 clients\).*upload; use federation.secure_aggr"):
        check_secure_aggregation(two, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_secure_aggregation(Federation(secure_aggregation=True, secure_aggregation_graph="sparse"), 10, 10)
