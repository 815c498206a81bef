"""Two gloo processes end the way a two-process fit ends: does tearing down the group hang?

Each trial spawns two CPU processes that run a few `broadcast_object_list` calls (as Lightning
does when it reads `trainer.log_dir` at a fit's end) and then tear the process group down, either
with a plain `torch.distributed.destroy_process_group()` or with the engine's `end_processes`.
Before torch 2.8 the plain teardown can deadlock (pytorch#56297); a trial that has not finished
within `--timeout` seconds counts as a hang and is killed.

    python benchmarks/gloo_teardown.py --trials 10     # prints the counts; no file written
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average, machine_line
from workbench.engines.ddp import end_processes


def process(rank: int, port: int, teardown: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for _ in range(3):
        dist.broadcast_object_list(["/a/log/dir"], src=0)
    if teardown == "plain":
        dist.destroy_process_group()
    else:
        end_processes()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trial(teardown: str, timeout: float) -> bool:
    """True when both processes finished within `timeout` seconds."""
    command = [sys.executable, __file__, "--one", teardown, "--port", str(free_port())]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group: a hang is killed whole
    try:
        return launcher.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        return False


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a trial counts as hung")
    parser.add_argument("--one", choices=("plain", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # one trial's launcher
        mp.spawn(process, args=(args.port, args.one), nprocs=2)
        return []
    load_at_start, lines = load_average(), [f"torch {torch.__version__}, {args.trials} trials each:"]
    for teardown in ("plain", "engine"):
        start = time.perf_counter()
        hung = sum(not trial(teardown, args.timeout) for _ in range(args.trials))
        name = "destroy_process_group()" if teardown == "plain" else "engines.ddp.end_processes()"
        lines.append(f"- {name}: {hung} of {args.trials} hung ({time.perf_counter() - start:.0f} s)")
        print(lines[-1], flush=True)
    lines.append(machine_line(f"timeout {args.timeout:.0f} s a trial", load_at_start))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
