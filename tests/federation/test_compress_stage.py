"""The compress stage: the protocol compresses the clients' model updates, with each client's error
feedback held by its client half; clipping comes after it."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.methods.conftest import data, small
from workbench.federation import Federation
from workbench.federation.compression import Compression, ErrorFeedback, TopK
from workbench.federation.stages import Outgoing, Pipeline
from workbench.methods import AFL, OSFED, FedAvg
from workbench.methods.gradient import UPDATE

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (12, 3, 9)  # the update's parameter tensors
SPEC = {"update": replace(UPDATE, sizes=SIZES)}
TOPK = Compression("topk", topk_fraction=0.25)


def client_side(federation: Federation) -> tuple[Pipeline, SimpleNamespace]:
    """The pipeline and a client half's protocol state under it."""
    pipeline, half = Pipeline.of(federation), SimpleNamespace()
    pipeline.keep_state(half, SPEC)
    half.protocol_state.double()  # as a float64 fit's engine converts its client half
    return pipeline, half


def send(pipeline: Pipeline, half, updates: torch.Tensor, clients: torch.Tensor, clip_norm: float | None = None):
    return pipeline.client_message(Outgoing({"update": updates}, SPEC, 0, clients, clip_norm=clip_norm,
                                            state=half.protocol_state))


def test_compression_runs_before_clipping_and_the_pipeline_says_so():
    federation = Federation(compression=TOPK, dp_clip=1.0)
    assert Pipeline.of(federation).names() == ["compress", "clip", "noise"]
    assert Pipeline.of(federation).line().startswith("compress to top-0.25 of each update, error feedback → clip")
    assert Pipeline.of(Federation(compression=Compression("quantize", quantize_bits=8),
                                  error_feedback=ErrorFeedback(enabled=False))).line() == \
        "compress to 8-bit min-max quantization"
    assert Pipeline.of(Federation()).names() == []  # kind none: no stage


def test_each_client_sends_its_compressed_target_and_keeps_exactly_what_was_lost():
    torch.manual_seed(0)
    pipeline, half = client_side(Federation(compression=TOPK))
    clients, compress = torch.tensor([1, 4, 6]), TopK(SIZES, 0.25)
    kept = half.protocol_state.compress.update_residuals
    carried = torch.zeros(3, sum(SIZES), dtype=torch.float64)
    for _ in range(3):
        updates = torch.randn(3, sum(SIZES), dtype=torch.float64)
        target = updates + carried
        sent = send(pipeline, half, updates, clients).uploads["update"]
        torch.testing.assert_close(sent, compress(target).sum(0), rtol=0, atol=0)  # summed over the clients
        torch.testing.assert_close(kept.residual(clients), target - compress(target), rtol=0, atol=0)
        carried = target - compress(target)
    assert kept.residuals.ids.tolist() == [1, 4, 6]  # a row for each client that sent, by its id


def test_the_clipped_message_is_what_is_sent_and_the_residual_the_compressors_error_only():
    torch.manual_seed(1)
    pipeline, half = client_side(Federation(compression=TOPK, dp_clip=0.5))
    clients, compress = torch.tensor([0, 2]), TopK(SIZES, 0.25)
    updates = 3 * torch.randn(2, sum(SIZES), dtype=torch.float64)
    outgoing = send(pipeline, half, updates, clients, clip_norm=0.5)
    compressed = compress(updates)
    norms = compressed.norm(dim=1, keepdim=True)
    clipped = compressed * torch.clamp(0.5 / norms, max=1)
    torch.testing.assert_close(outgoing.uploads["update"], clipped.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(half.protocol_state.compress.update_residuals.residual(clients),
                               updates - compressed, rtol=0, atol=0)  # clipping's loss is not carried
    assert "time/compress_s" in outgoing.metrics


def test_without_error_feedback_nothing_is_kept():
    pipeline, half = client_side(Federation(compression=TOPK, error_feedback=ErrorFeedback(enabled=False)))
    assert len(half.protocol_state) == 0
    updates = torch.randn(2, sum(SIZES), dtype=torch.float64)
    sent = send(pipeline, half, updates, torch.tensor([0, 1])).uploads["update"]
    torch.testing.assert_close(sent, TopK(SIZES, 0.25)(updates).sum(0), rtol=0, atol=0)


def test_what_cannot_be_compressed_is_refused_in_one_line_before_any_work(fit_method):
    dm = data(num_clients=3)
    with pytest.raises(ValueError, match=r"AFL does not send .*compression.kind=none"):
        fit_method(AFL(), dm, Federation(compression=TOPK))
    with pytest.raises(ValueError, match=r"OSFED does not send \(it sends a message of its own per client"):
        fit_method(OSFED(num_rounds=1, **small()), dm, Federation(compression=TOPK))
    with pytest.raises(ValueError, match=r"secure aggregation's masks .*compression.kind=none"):
        Federation(compression=TOPK, secure_aggregation=True)


def test_a_fit_logs_the_compressors_bytes_and_time(fit_method):
    engine = fit_method(FedAvg(num_rounds=2, **small()), data(num_clients=3), Federation(compression=TOPK))
    per_client = engine.pipeline.wire(engine.method.uploads)["update"].encoding.bytes_per_client()
    dense = 4 * sum(engine.method.uploads["update"].sizes)  # float32
    assert engine.fit_metrics["comm/bytes_up"] == 2 * 3 * per_client < 2 * 3 * dense
    assert engine.fit_metrics["time/compress_s"] > 0


def test_a_half_built_without_the_stages_state_is_refused_rather_than_run_without_error_feedback():
    pipeline = Pipeline.of(Federation(compression=TOPK))
    with pytest.raises(RuntimeError, match="holds no error feedback for the compress stage"):
        send(pipeline, SimpleNamespace(protocol_state=torch.nn.ModuleDict()), torch.randn(2, sum(SIZES)),
             torch.tensor([0, 1]))
