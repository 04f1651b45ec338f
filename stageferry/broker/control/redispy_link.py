"""The hot path's link made of redis-py alone: one dedicated redis-py connection, no pool (issue 33).

:class:`RedisPyLink` has :class:`~stageferry.broker.control.resp_link.RespLink`'s interface (``send``,
``call``, ``keep_hot``, ``aclose``, ``fallbacks``) over one redis-py ``Connection`` of the client's own
connection class, held for the link's life: commands are packed and written in one
``send_packed_command``, replies read in order with ``read_response``, error replies returned as values.
It skips the pool checkout, the pipeline object and the response callbacks that the pooled client pays per
round trip; what is left is redis-py's own reader and parser.

It exists to measure the lean link against redis-py used without its pool, side by side on the same
benchmarks (``STAGEFERRY_REDIS_LINK=redis-py``, :func:`~stageferry.broker.control.resp_link.open_link`;
``benchmarks/link_vs_redispy.py``).  It follows a fixed address only (no Sentinel master, no demotion
check) and polls nothing while hot: a comparison switch, not a production path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from stageferry.broker.control.resp_link import RespLink

Command = Sequence[Any]


class RedisPyLink:
    """One dedicated redis-py connection with the link's interface; callers take turns on it."""

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._conn: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.fallbacks = 0
        self.hot_until = 0.0

    def keep_hot(self, seconds: float) -> None:
        """Kept for the interface: this link does not poll while it waits."""
        self.hot_until = asyncio.get_running_loop().time() + seconds

    #: One command's reply, an error reply raised: the link's own, over this ``send``.
    call = RespLink.call

    async def send(self, commands: Sequence[Command], *, block_s: float = 0.0) -> list[Any]:
        """``commands`` in one write, their replies in order (error replies as exception values).  A broken
        connection, a timeout or a cancelled caller drops the connection (the next call connects afresh)."""
        if not commands:
            raise ValueError("nothing to send")
        async with self._lock:
            if self._closed:
                raise redis_errors.ConnectionError("redis-py link closed")
            conn = self._conn
            if conn is None:
                conn = self._pool.connection_class(**self._pool.connection_kwargs)
                self._conn = conn
            replies: list[Any] = []
            try:
                await conn.send_packed_command(conn.pack_commands([tuple(c) for c in commands]), check_health=False)
                timeout = block_s + (conn.socket_timeout or 10.0)
                for _ in commands:
                    try:
                        replies.append(await conn.read_response(disable_decoding=True, timeout=timeout))
                    except redis_errors.ResponseError as exc:
                        replies.append(exc)
            except BaseException:
                self._conn = None
                await conn.disconnect(nowait=True)
                raise
            return replies

    async def aclose(self) -> None:
        """Close the connection for good (later calls fail, and fall back to redis-py)."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect()
