"""Reads an offline W&B run's `run-<id>.wandb` file: W&B writes it in LevelDB's log format
(32 KiB blocks of checksummed chunks after a 7-byte `:W&B` header), one protobuf Record each."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, LAST = 1, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        pending += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wait_until_written(path: Path, timeout_s: float = 60.0) -> None:
    """W&B's writer is a process of its own: `wandb.finish()` may return before it has written
    the run's last records; the exit record comes last."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(record.WhichOneof("record_type") == "exit" for record in records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def read_run(path: Path) -> tuple[dict, dict, object]:
    """(config, summary, the run record) of an offline run's `.wandb` file. Config and summary
    updates come as records of their own or, made before the run record was written, inside it."""
    config, summary, run = {}, {}, None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        updates = {"config": run.config if kind == "run" else record.config,
                   "summary": run.summary if kind == "run" else record.summary}
        if kind in ("run", "config"):
            config.update({item.key: json.loads(item.value_json) for item in updates["config"].update})
        if kind in ("run", "summary"):
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in updates["summary"].update})
    return config, summary, run
