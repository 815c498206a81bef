"""What crosses the wire between clients and server, how many bytes it costs, and the protocol around it."""
from workbench.federation.messages import message_bytes, messages_bytes
from workbench.federation.protocol import Federation, ProtocolView

__all__ = ["Federation", "ProtocolView", "message_bytes", "messages_bytes"]
