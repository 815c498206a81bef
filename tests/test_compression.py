"""Compressors: what the server reconstructs, exact bytes, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.federation.compression import (
    Dense,
    ErrorFeedback,
    Quantize,
    TopK,
    build_compressor,
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
    for block, approx in zip(x.split(SIZES, 1), sent.split(SIZES, 1)):
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
    assert build_compressor("quantize", SIZES, quantize_bits=bits).bytes_per_client() == expected


def test_dense_sends_float32_updates():
    x = updates().double()
    assert Dense(SIZES).bytes_per_client() == 4 * 375
    torch.testing.assert_close(Dense(SIZES)(x), x.float().double(), rtol=0, atol=0)


def test_error_feedback_carries_exactly_what_was_lost_and_loses_nothing_over_rounds():
    feedback = ErrorFeedback(num_clients=6, numel=375)
    compressor = TopK(SIZES, 0.05)
    clients = [torch.tensor([0, 2, 5]), torch.tensor([2, 3]), torch.tensor([0, 2, 5])]
    total_update, total_sent = torch.zeros(6, 375), torch.zeros(6, 375)
    for round_index, chosen in enumerate(clients):
        before = feedback.residual.clone()
        x = updates(len(chosen), seed=round_index)
        target = feedback.target(chosen, x)
        torch.testing.assert_close(target, x + before[chosen])
        sent = compressor(target)
        feedback.keep(chosen, target, sent)
        assert torch.equal(feedback.residual[chosen], target - sent)
        others = torch.ones(6, dtype=torch.bool)
        others[chosen] = False
        assert torch.equal(
            feedback.residual[others], before[others]
        )  # clients not sampled keep theirs
        total_update[chosen] += x
        total_sent[chosen] += sent
    # Telescoping: everything a client produced is either sent or still in its residual.
    torch.testing.assert_close(total_sent + feedback.residual, total_update, rtol=1e-5, atol=1e-5)


def test_bad_compressor_settings_are_rejected():
    with pytest.raises(ValueError, match="fraction"):
        TopK(SIZES, 0.0)
    with pytest.raises(ValueError, match="bits"):
        Quantize(SIZES, 0)
    with pytest.raises(ValueError, match="compression"):
        build_compressor("zip", SIZES)
