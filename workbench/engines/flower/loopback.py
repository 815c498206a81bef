"""`LoopbackGrid`: a Flower grid whose SuperNodes live in this process, for tests and benchmarks.

Each message goes straight to the ClientApp's handler (`client_app.HANDLERS`) with its node's own
`Context` (its `state` kept between messages, as a SuperNode keeps it), and its reply waits to be
pulled, as on a SuperLink. What a real federation does to a server can be staged:

- `processes` copies of the nodes' clients, as a Ray simulation's actors hold them: each message
  is handled by the copy `process_of(node, exchange)` names (default: one process);
- `silence(node)`: the node stops answering (killed), so its replies never come;
- `stall(node)`: the node is slow once: its next reply comes only with the exchange after;
- `expire(node)`: the node's next reply is lost on the way (Flower's "message unavailable");
- `lose(node)`: Flower reports the node gone (its heartbeats stopped): an error reply;
- `join(partition)`: a new SuperNode (a restarted one) connects and holds that partition.

`node_config` adds entries to partition k's node config (a site's `data-path`, say).

A handler that raises is answered by an error reply naming the exception, as Flower's ClientApp is.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from workbench.engines.flower import client_app

FIRST_NODE = 100


class LoopbackGrid:
    """K SuperNodes in this process, node ids 100 + k holding partition k."""

    def __init__(self, num_clients: int, *, processes: int = 1,
                 process_of: Callable[[int, int], int] | None = None,
                 node_config: Mapping[int, Mapping[str, str]] | None = None) -> None:
        self.num_clients = num_clients
        self.node_config = {k: dict(entries) for k, entries in (node_config or {}).items()}
        self.contexts: dict[int, Context] = {}
        for partition in range(num_clients):
            self.join(partition, FIRST_NODE + partition)
        self.copies: list[dict] = [{} for _ in range(processes)]  # each process's `client_app._nodes`
        self.process_of = process_of or (lambda node, exchange: 0)
        self.exchanges = 0  # the push_messages calls so far
        self.silent: set[int] = set()
        self.stalled: set[int] = set()
        self.expiring: set[int] = set()
        self.gone: set[int] = set()
        self._replies: dict[str, Message] = {}
        self._held: dict[str, Message] = {}  # stalled nodes' replies, released by the next exchange

    def join(self, partition: int, node: int | None = None) -> int:
        """A SuperNode holding `partition` connects (a fresh one: empty state); its node id."""
        node = node if node is not None else max(self.contexts, default=FIRST_NODE - 1) + 1
        self.contexts[node] = Context(run_id=1, node_id=node, state=RecordDict(), run_config={},
                                      node_config={"partition-id": partition, "num-partitions": self.num_clients,
                                                   **self.node_config.get(partition, {})})
        return node

    def silence(self, node: int) -> None:
        """The node stops answering: messages to it get no reply."""
        self.silent.add(node)

    def stall(self, node: int) -> None:
        """The node's next reply comes late: only once the next exchange's messages went out."""
        self.stalled.add(node)

    def expire(self, node: int) -> None:
        """The node's next reply is lost on the way: an error reply instead (the node stays)."""
        self.expiring.add(node)

    def lose(self, node: int) -> None:
        """Flower reports the node gone (no heartbeat): messages to it get an error reply, and it
        leaves the connected nodes."""
        self.gone.add(node)

    def get_node_ids(self) -> list[int]:
        return [node for node in self.contexts if node not in self.gone]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        self._replies.update(self._held)
        self._held = {}
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            if node in self.gone or node in self.expiring:
                code = ErrorCode.NODE_UNAVAILABLE if node in self.gone else ErrorCode.MESSAGE_UNAVAILABLE
                self.expiring.discard(node)
                self._replies[ids[-1]] = Message(Error(code, "Error: unavailable"), reply_to=message)
            elif node not in self.silent:
                client_app._nodes = self.copies[self.process_of(node, self.exchanges)]
                handler = client_app.HANDLERS[message.metadata.message_type]
                try:
                    reply = handler(message, self.contexts[node])
                except Exception as error:  # as Flower's ClientApp process answers
                    reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(error)}:<'{error}'>"),
                                    reply_to=message)
                if node in self.stalled:
                    self.stalled.discard(node)
                    self._held[ids[-1]] = reply
                else:
                    self._replies[ids[-1]] = reply
        self.exchanges += 1
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))
