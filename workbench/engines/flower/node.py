"""A long-lived ClientApp process for a SuperNode started with `--isolation process`.

Flower 1.42 runs a ClientApp as a new process for every message: with `--isolation subprocess`
(its default) the SuperNode's SuperExec starts `flwr-clientapp` per message, which imports the
app (for the workbench: torch and Lightning, about 13 s on 2 cores), reads the data and rebuilds
the method each time. With `--isolation process` the SuperNode runs no ClientApp itself: it
waits for a process of the operator's to take its tasks over its Runtime API. This module is
that process for workbench apps: it takes each task the SuperNode offers and runs it in itself,
so the imports, the node's rows and the built method and client half (`client_app`'s per-node
cache) stay loaded across messages and runs:

    flower-supernode --isolation process --superlink HOST:PORT --port 9094 \\
        --node-config "partition-id=k num-partitions=K" ...
    python -m workbench.engines.flower.node --runtime-api-address 127.0.0.1:9094 [--insecure]

A task whose app is not the workbench's ClientApp gets an error reply naming the app. The process
leaves with its SuperNode: when the Runtime API stops answering for `--gone_after_s` seconds, or
at once when the process named by `--supernode_pid` has ended. Each task's message, reply and
state travel as Flower's own ClientApp process moves them (`flwr.supernode.runtime.run_clientapp`).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from flwr.app import Error, Message
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from workbench.engines.flower.client_app import app as workbench_client_app

CLIENT_APP = "workbench.engines.flower.client_app:app"
HEARTBEAT_S = 10.0  # a task's heartbeat to its SuperNode (Flower's ClientApp: every 20-25 s)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: kill's answer


class Node:
    """Takes the ClientApp tasks of one SuperNode's Runtime API and runs them in this process."""

    def __init__(self, address: str, *, insecure: bool, root_certificates: str | None = None,
                 poll_s: float = 0.02, gone_after_s: float = 10.0, supernode_pid: int | None = None) -> None:
        self.address, self.insecure, self.root_certificates = address, insecure, root_certificates
        self.poll_s, self.gone_after_s, self.supernode_pid = poll_s, gone_after_s, supernode_pid
        self.tasks = 0

    def _client(self, *interceptors) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(self.address, insecure=self.insecure,
                                                     root_certificates=self.root_certificates,
                                                     interceptors=list(interceptors))

    def serve(self, max_tasks: int | None = None) -> str:
        """Takes tasks until the SuperNode is gone (or `max_tasks` were run); says why it stopped."""
        offers = self._client(RuntimeVersionHttpInterceptor(component_name="SuperExec"))
        request = AcquireTaskRequest(supported_task_types=[str(TaskType.CLIENT_APP)])
        unreachable_since: float | None = None
        try:
            while max_tasks is None or self.tasks < max_tasks:
                if self.supernode_pid is not None and not alive(self.supernode_pid):
                    return f"the SuperNode (process {self.supernode_pid}) has ended"
                try:
                    offer = offers.AcquireTask(request)
                except httpx.TransportError as error:
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > self.gone_after_s:
                        return f"the SuperNode's Runtime API at {self.address} has not answered for " \
                               f"{self.gone_after_s:g} s ({type(error).__name__})"
                    time.sleep(min(1.0, 10 * self.poll_s))
                    continue
                unreachable_since = None
                if offer.HasField("task") and offer.token:
                    try:
                        self.run_task(offer.token)
                    except Exception as error:  # one task's transport failed: the next may not
                        print(f"a task failed on its way: {type(error).__name__}: {error}", file=sys.stderr)
                    self.tasks += 1
                else:
                    time.sleep(self.poll_s)
        finally:
            offers.close()
        return f"{self.tasks} tasks done"

    def run_task(self, token: str) -> None:
        """One message: pulled with its node's context, answered by the workbench's ClientApp (or
        an error reply), the reply and the updated context pushed back."""
        client = self._client(RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                              RuntimeTokenHttpInterceptor(token))
        beating = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(client, beating), daemon=True)
        beat.start()
        try:
            message, context, run, fab = pull_task_input(client)
            status, details = SubStatus.COMPLETED, ""
            try:
                component = get_fab_config(fab.content)["tool"]["flwr"]["app"]["components"]["clientapp"]
                if component != CLIENT_APP:
                    raise ValueError(f"this process runs the workbench's ClientApp ({CLIENT_APP}), the run's app "
                                     f"names {component}: start its SuperNode with --isolation subprocess")
                reply = workbench_client_app(message=message, context=context)
            except Exception as error:  # the app's failure goes back to the server, as Flower's ClientApp does
                status, details = SubStatus.FAILED, f"{type(error)}:<'{error}'>"
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
                print(f"task of run {run.run_id} failed: {details}", file=sys.stderr)
            push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            beating.set()
            beat.join()
            client.close()


def _heartbeat(client: RuntimeHttpClient, stop: threading.Event) -> None:
    """Tells the SuperNode the task is alive while it runs (failures are the SuperNode's to judge)."""
    while not stop.wait(HEARTBEAT_S):
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.HTTPError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.engines.flower.node",
                                     description="A long-lived ClientApp process for a SuperNode started with "
                                                 "--isolation process: it runs the workbench's ClientApp for "
                                                 "every message the SuperNode gets, keeping its imports, data "
                                                 "and client loaded.")
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                        help="the SuperNode's Runtime API (flower-supernode's --host and --port)")
    security = parser.add_mutually_exclusive_group()
    security.add_argument("--insecure", action="store_true", help="the Runtime API without TLS")
    security.add_argument("--root-certificates", help="the CA certificate of the Runtime API's TLS")
    parser.add_argument("--supernode_pid", type=int, help="leave as soon as this process has ended")
    parser.add_argument("--gone_after_s", type=float, default=10.0,
                        help="leave when the Runtime API has not answered for this long")
    parser.add_argument("--poll_s", type=float, default=0.02, help="seconds between two asks for a task")
    args = parser.parse_args(argv)
    node = Node(args.runtime_api_address, insecure=args.insecure, root_certificates=args.root_certificates,
                poll_s=args.poll_s, gone_after_s=args.gone_after_s, supernode_pid=args.supernode_pid)
    print(f"serving the ClientApp tasks of the SuperNode at {args.runtime_api_address}", file=sys.stderr, flush=True)
    print(f"left: {node.serve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
