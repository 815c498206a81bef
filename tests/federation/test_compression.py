"""Compressors: what the server reconstructs, exact bytes, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.federation import Federation
from workbench.federation.compression import (
    Compression,
    Dense,
    ErrorFeedback,
    Quantize,
    Residuals,
    ScaledSign,
    TopK,
    index_bytes,
)

SIZES = [300, 20, 50, 5]  # numel of each parameter tensor, P = 375


def updates(m: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, sum(SIZES), generator=torch.Generator().manual_seed(seed))


def test_index_width_is_the_smallest_that_holds_every_position():
    assert [index_bytes(n) for n in (1, 256, 257, 65536, 65537, 2**32, 2**32 + 1)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        8,
    ]


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 1.0])
def test_topk_keeps_the_k_largest_magnitudes_and_counts_values_plus_indices(fraction):
    x = updates()
    compressor = TopK(SIZES, fraction)
    k = math.ceil(fraction * 375)
    sent = compressor(x)
    assert ((sent != 0).sum(1) == k).all()
    kept = sent != 0
    assert torch.equal(sent[kept], x[kept])
    smallest_kept = torch.where(kept, x.abs(), torch.inf).min(1).values
    largest_dropped = torch.where(kept, -torch.inf, x.abs()).max(1).values
    assert (smallest_kept >= largest_dropped).all()
    assert compressor.bytes_per_client() == k * (4 + 2)  # float32 values, uint16 indices (P = 375)


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_quantization_error_is_at_most_half_a_step_per_tensor(bits):
    x = updates()
    sent = Quantize(SIZES, bits)(x)
    for block, approx in zip(x.split(SIZES, 1), sent.split(SIZES, 1), strict=True):
        lo, hi = block.min(1, keepdim=True).values, block.max(1, keepdim=True).values
        step = (hi - lo) / (2**bits - 1)
        assert ((block - approx).abs() <= step / 2 + 1e-6).all()
        codes = torch.round((approx - lo) / step)
        assert torch.allclose(approx, lo + codes * step, atol=1e-6)  # on the grid of 2^b levels
        assert all(len(row.unique()) <= 2**bits for row in codes)


def test_quantization_is_exact_on_values_already_on_the_grid():
    levels = torch.arange(16.0)  # 4 bits: 16 equally spaced values
    x = torch.cat([levels[torch.randperm(16)] * 0.25 - 1, torch.full((4,), 3.0)])[None]
    torch.testing.assert_close(Quantize([16, 4], 4)(x), x)  # a constant tensor is exact too


@pytest.mark.parametrize("bits", [1, 3, 4, 8, 16])
def test_quantization_bytes_are_packed_codes_plus_two_float32_scales_per_tensor(bits):
    expected = sum(math.ceil(n * bits / 8) + 8 for n in SIZES)
    assert Quantize(SIZES, bits).bytes_per_client() == expected
    assert Compression("quantize", quantize_bits=bits).build(SIZES).bytes_per_client() == expected


def test_dense_sends_float32_updates():
    x = updates().double()
    assert Dense(SIZES).bytes_per_client() == 4 * 375
    torch.testing.assert_close(Dense(SIZES)(x), x.float().double(), rtol=0, atol=0)


def test_error_feedback_carries_exactly_what_was_lost_and_loses_nothing_over_rounds():
    feedback = Residuals(numel=375)
    everyone = torch.arange(6)
    compressor = TopK(SIZES, 0.05)
    clients = [torch.tensor([0, 2, 5]), torch.tensor([2, 3]), torch.tensor([0, 2, 5])]
    total_update, total_sent = torch.zeros(6, 375), torch.zeros(6, 375)
    for round_index, chosen in enumerate(clients):
        before = feedback.residual(everyone)
        x = updates(len(chosen), seed=round_index)
        target = feedback.target(chosen, x)
        torch.testing.assert_close(target, x + before[chosen])
        sent = compressor(target)
        feedback.keep(chosen, target, sent)
        assert torch.equal(feedback.residual(chosen), target - sent)
        others = torch.ones(6, dtype=torch.bool)
        others[chosen] = False
        assert torch.equal(feedback.residual(everyone)[others], before[others])  # clients not sampled keep theirs
        total_update[chosen] += x
        total_sent[chosen] += sent
    # Telescoping: everything a client produced is either sent or still in its residual.
    torch.testing.assert_close(total_sent + feedback.residual(everyone), total_update, rtol=1e-5, atol=1e-5)
    assert feedback.residuals.ids.tolist() == [0, 2, 3, 5]  # client 1 and 4 never uploaded: no row


def test_bad_compressor_settings_are_rejected():
    with pytest.raises(ValueError, match="fraction"):
        TopK(SIZES, 0.0)
    with pytest.raises(ValueError, match="bits"):
        Quantize(SIZES, 0)
    with pytest.raises(ValueError, match="compression"):
        Compression("zip").build(SIZES)


def draws(seed: int = 0) -> torch.Tensor:
    """Random updates of several kinds: Gaussian, heavy-tailed, sparse, one large entry: (40, P)."""
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(10, sum(SIZES), generator=gen, dtype=torch.float64)
    heavy = torch.distributions.StudentT(1.5).sample((10, sum(SIZES))).double()
    sparse = gaussian * (torch.rand(10, sum(SIZES), generator=gen, dtype=torch.float64) < 0.05)
    spike = 1e-3 * torch.randn(10, sum(SIZES), generator=gen, dtype=torch.float64)
    spike[:, 7] = 5.0
    return torch.cat([gaussian, heavy, sparse, spike])


@pytest.mark.parametrize("name, compressor, delta", [
    ("top-k 5%", TopK(SIZES, 0.05), math.ceil(0.05 * 375) / 375),  # δ = k/P
    ("scaled sign", ScaledSign(SIZES), 1 / max(SIZES)),  # δ = 1/n of the largest tensor
    ("2-bit symmetric", Quantize(SIZES, 2, symmetric=True), 1 / max(SIZES)),  # δ ≥ 1/n
    ("3-bit symmetric", Quantize(SIZES, 3, symmetric=True), 1 / max(SIZES)),
    ("4-bit", Quantize(SIZES, 4), 1 / 375),  # min-max: holds on these draws, not for every x
    ("8-bit", Quantize(SIZES, 8), 1 / 375),
])
def test_compressors_offered_with_error_feedback_are_contractive(name, compressor, delta):
    """‖C(x) − x‖² ≤ (1 − δ)‖x‖² on random draws (what keeps the error-feedback residual bounded)."""
    torch.manual_seed(0)  # the heavy-tailed draw
    x = draws()
    error = ((compressor(x) - x) ** 2).sum(1)
    assert (error <= (1 - delta) * (x**2).sum(1) * (1 + 1e-6)).all(), name


def test_scaled_sign_removes_exactly_l1_squared_over_n_per_tensor():
    x = draws()
    sent = ScaledSign(SIZES)(x)
    expected = sum((block**2).sum(1) - block.abs().sum(1) ** 2 / block.shape[1]
                   for block in x.split(SIZES, dim=1))
    torch.testing.assert_close(((sent - x) ** 2).sum(1), expected, rtol=1e-6, atol=1e-9)
    assert ScaledSign(SIZES).bytes_per_client() == sum(math.ceil(n / 8) + 4 for n in SIZES)


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_symmetric_quantization_keeps_zero_and_the_largest_entry_exactly(bits):
    x = draws()
    sent = Quantize(SIZES, bits, symmetric=True)(x)
    assert torch.equal(sent[x == 0], x[x == 0])
    for block, ours in zip(x.split(SIZES, dim=1), sent.split(SIZES, dim=1), strict=True):
        largest = block.abs().argmax(1, keepdim=True)
        torch.testing.assert_close(ours.gather(1, largest), block.gather(1, largest))
        levels = 2 ** (bits - 1) - 1
        assert (ours - block).abs().max() <= 0.5 * block.abs().max() / levels * (1 + 1e-6)
    assert Quantize(SIZES, bits, symmetric=True).bytes_per_client() == sum(math.ceil(n * bits / 8) + 4 for n in SIZES)


def test_few_bit_min_max_is_not_contractive_and_four_bit_is_not_for_every_x():
    """The documented failures: 1-bit min-max sends every entry as lo or hi, 2 and 3 bits expand
    sparse or heavy-tailed draws; b-bit min-max has no level at 0, so a tensor of zeros between two
    extremes moves by a/(2^b − 1) per entry. The protocol refuses them with error feedback."""
    torch.manual_seed(0)
    x = draws()
    for bits in (1, 2, 3):
        assert (((Quantize(SIZES, bits)(x) - x) ** 2).sum(1) > (x**2).sum(1)).any()
        with pytest.raises(ValueError, match="quantize_symmetric"):
            Federation(compression=Compression(kind="quantize", quantize_bits=bits))
    Federation(compression=Compression(kind="quantize", quantize_bits=2),
               error_feedback=ErrorFeedback(enabled=False))  # without EF: allowed
    Federation(compression=Compression(kind="quantize", quantize_bits=2, quantize_symmetric=True))
    worst = torch.zeros(1, 2000, dtype=torch.float64)
    worst[0, :2] = torch.tensor([1.0, -1.0])
    assert ((Quantize([2000], 4)(worst) - worst) ** 2).sum() > (worst**2).sum()


def test_error_feedback_of_a_contractive_compressor_stays_within_its_bound_and_a_guard_bounds_any():
    """Scaled sign: ‖e‖ ≤ √(1−δ)/(1 − √(1−δ)) · max ‖x‖. 1-bit min-max: the plain residual grows,
    the bounded one stays ≤ c‖x‖, the decayed one stays within a few ‖x‖."""
    sizes = [64]
    plain = {"sign": Residuals(64), "1-bit": Residuals(64),
             "1-bit bounded": Residuals(64, bound=0.5), "1-bit decayed": Residuals(64, decay=0.5)}
    plain = {name: feedback.double() for name, feedback in plain.items()}
    compress = {"sign": ScaledSign(sizes), "1-bit": Quantize(sizes, 1), "1-bit bounded": Quantize(sizes, 1),
                "1-bit decayed": Quantize(sizes, 1)}
    client, gen, largest = torch.tensor([0]), torch.Generator().manual_seed(3), 0.0
    norms = {name: [] for name in plain}
    for _ in range(200):
        x = torch.randn(1, 64, generator=gen, dtype=torch.float64) + 0.5  # a drift: positive mean
        largest = max(largest, float(x.norm()))
        for name, feedback in plain.items():
            target = feedback.target(client, x)
            feedback.keep(client, target, compress[name](target), x)
            norms[name].append(float(feedback.residual(client).norm()))
            if name == "1-bit bounded":
                assert feedback.residual(client).norm() <= 0.5 * x.norm() * (1 + 1e-12)
    root = math.sqrt(1 - 1 / 64)
    assert max(norms["sign"]) <= root / (1 - root) * largest
    assert norms["1-bit"][-1] > 10 * largest  # runs away
    assert max(norms["1-bit decayed"]) < 10 * largest


def test_a_bound_needs_the_fresh_update_and_bad_guards_are_rejected():
    feedback = Residuals(375, bound=1.0)
    x = updates(1)
    with pytest.raises(ValueError, match="fresh updates"):
        feedback.keep(torch.tensor([0]), x, torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"error_feedback.bound"):
        Residuals(375, bound=-1.0)
    with pytest.raises(ValueError, match=r"error_feedback.decay"):
        Residuals(375, decay=1.5)
