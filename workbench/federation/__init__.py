"""What crosses the wire between clients and server, and how many bytes it costs."""
from workbench.federation.messages import message_bytes, messages_bytes

__all__ = ["message_bytes", "messages_bytes"]
