"""A Flower deployment on this machine's loopback: a SuperLink and one SuperNode per client, for
trials, the deployment tests and benchmarks (a real one spans machines: docs/engines.md).

    with LocalDeployment(home, clients=3, isolation="process") as federation:
        federation.submit(["--config", "/abs/configs/afl_flower.yaml"]).wait()

`isolation="process"` starts each SuperNode with `--isolation process` beside the workbench's
long-lived ClientApp (`python -m workbench.engines.flower.node`), which leaves with its SuperNode;
`"subprocess"` is Flower's default, a ClientApp process per message. `node_config` adds string
entries to partition k's node config (a cross-silo site's `data-path`). Insecure (no TLS: loopback
only). Flower's files and `config.toml` (connection `local`) go to `home`, each process's output
to `home/logs/<name>.log`; the processes run in sessions of their own and `stop` ends them.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from workbench.engines.flower.server_app import write_app

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode: this environment's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDeployment:
    """SuperLink and SuperNodes on 127.0.0.1 (free ports), their Flower files under `home`."""

    def __init__(self, home: str | Path, clients: int, isolation: Literal["process", "subprocess"] = "process",
                 env: dict[str, str] | None = None, node_config: Mapping[int, Mapping[str, str]] | None = None) -> None:
        if isolation not in ("process", "subprocess"):
            raise ValueError(f"isolation must be 'process' or 'subprocess', got {isolation!r}")
        self.home, self.clients, self.isolation = Path(home), clients, isolation
        self.node_config = {k: dict(entries) for k, entries in (node_config or {}).items()}  # partition k's own entries
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    **(env or {})}
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.app = write_app(self.home / "app").parent
        self.superlink = self._start("superlink", [BIN / "flower-superlink", "--insecure", "--port", str(self.port)])
        self.nodes: dict[int, tuple[subprocess.Popen, subprocess.Popen | None]] = {}
        self._wait_for_port(self.port, self.superlink, "the SuperLink")
        for partition in range(clients):
            self.start_node(partition)

    def _wait_for_port(self, port: int, process: subprocess.Popen, what: str, limit_s: float = 120.0) -> None:
        """Until something listens on `port` (`process` serving it must not have ended)."""
        deadline = time.monotonic() + limit_s
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not come up on port {port}: see {self.logs}")
            time.sleep(0.2)

    def _start(self, name: str, command: Sequence) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("a") as log:
            return subprocess.Popen([str(c) for c in command], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def start_node(self, partition: int) -> None:
        """A SuperNode holding `partition` (and, isolated by process, its ClientApp process)."""
        runtime = free_port()
        supernode = self._start(f"supernode{partition}", [
            BIN / "flower-supernode", "--insecure", "--isolation", self.isolation,
            "--superlink", f"127.0.0.1:{self.port}", "--port", str(runtime),
            "--node-config", " ".join([f"partition-id={partition} num-partitions={self.clients}", *(
                f'{key}="{value}"' for key, value in self.node_config.get(partition, {}).items())])])  # (TOML strings)
        client_app = None
        if self.isolation == "process":
            client_app = self._start(f"clientapp{partition}", [
                sys.executable, "-m", "workbench.engines.flower.node", "--insecure",
                "--runtime-api-address", f"127.0.0.1:{runtime}", "--supernode_pid", supernode.pid])
        self.nodes[partition] = (supernode, client_app)

    def kill_node(self, partition: int) -> subprocess.Popen | None:
        """SIGKILL to the SuperNode, by its process id (reaped); returns its ClientApp process,
        left to notice alone."""
        supernode, client_app = self.nodes.pop(partition)
        os.kill(supernode.pid, signal.SIGKILL)
        supernode.wait()
        return client_app

    def submit(self, fit_args: Sequence[str], app: str | Path | None = None, **popen) -> subprocess.Popen:
        """`server_app submit` of a fit (its exit code is the run's)."""
        return subprocess.Popen([sys.executable, "-m", "workbench.engines.flower.server_app", "submit",
                                 str(app or self.app), "local", "--", *fit_args], env=self.env, **popen)

    def stop(self, wait_s: float = 20.0) -> list[str]:
        """SIGTERM to the SuperNodes and the SuperLink; the ClientApp processes must leave by
        themselves with their SuperNodes. Returns those processes that did not end within
        `wait_s` (then killed)."""
        supernodes = [supernode for supernode, _ in self.nodes.values()] + [self.superlink]
        for process in supernodes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        stayed = []
        watched = [(f"SuperNode of partition {k}", s) for k, (s, _) in self.nodes.items()]
        watched += [("SuperLink", self.superlink)]
        watched += [(f"ClientApp of partition {k}", c) for k, (_, c) in self.nodes.items() if c is not None]
        deadline = time.monotonic() + wait_s
        for name, process in watched:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stayed.append(f"{name} (process {process.pid})")
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return stayed

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
