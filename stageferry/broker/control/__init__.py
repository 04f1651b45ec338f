"""Control plane: Redis keys, connections, stage streams and request records (small envelopes only)."""

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect, is_connection_error, translated
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream

__all__ = ["Entry", "Keys", "RequestStore", "StageStream", "connect", "is_connection_error", "translated"]
