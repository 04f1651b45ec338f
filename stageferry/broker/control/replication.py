"""Durable writes: a write counts once it is on ``N`` replicas (``WAIT``), asked on the connection that wrote.

Why the same connection: ``WAIT`` waits for the replication offset of *that client's* last write, so a
``WAIT`` sent over any other pooled connection proves nothing (it answers at once).  So the write and
its ``WAIT`` go out in one batch on one connection — the lean link when there is one, else a connection
held from the client's pool for the batch (redis-py's retries around it, as for its own pipelines).

Which writes wait (a URL's ``wait_replicas``, see :mod:`.redis_url`): a client's submission, and a
stage's hand-off, final result and terminal status — the writes after which nobody repeats the work.
What a short count does differs:

* a **submission** on fewer replicas than asked is not acknowledged: :class:`NotReplicatedError`
  (transient: the client rides it out, resubmitting under the same id, which is idempotent;
  :meth:`~stageferry.broker.control.requests.RequestStore.submit` then re-proves the earlier write);
* a **stage's write** stands (it is on the master; the stage cannot take it back) and is logged as
  ``redis.not_replicated``.  If a failover then loses it, the entry it settled is still pending on the
  new master and is redelivered: the work is repeated, idempotently (``docs/high-availability.md``).

Without ``wait_replicas`` nothing here runs: the callers take their usual paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis import exceptions as redis_errors
from redis.commands.core import AsyncScript

from stageferry.broker.control.functions import BoundFunction, check_loaded, invocation, loading, unknown
from stageferry.broker.control.redis_url import Durability
from stageferry.broker.control.resp_link import Command, RespLink, fall_back
from stageferry.errors import NotReplicatedError

log = structlog.get_logger(__name__)


def wait_command(durability: Durability) -> Command:
    return ("WAIT", durability.replicas, durability.timeout_ms)


async def exchange(
    link: RespLink | None, redis: aioredis.Redis, commands: Sequence[Command], *, block_s: float
) -> list[Any]:
    """``commands`` in one write on one connection, their raw replies (errors as values): over ``link``
    when there is one and it holds, else on a connection held from ``redis``'s pool for the batch, with
    redis-py's retries on connection trouble (a Sentinel pool's ``READONLY`` is one: the master moved)."""
    if link is not None:
        try:
            return await link.send(commands, block_s=block_s)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            fall_back(link, exc)
    pool = redis.connection_pool
    conn = await pool.get_connection()
    try:

        async def batch() -> list[Any]:
            await conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response(timeout=None if block_s <= 0 else block_s + 10))
                except redis_errors.ResponseError as error:  # read whole: the connection stays in step
                    replies.append(error)
            return replies

        async def failed(_error: Exception) -> None:
            await conn.disconnect()

        return await conn.retry.call_with_retry(batch, failed)
    finally:
        await pool.release(conn)


def _raise_first(replies: Sequence[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


async def replicated_transaction(
    link: RespLink | None,
    redis: aioredis.Redis,
    commands: Sequence[Command],
    durability: Durability,
    *,
    what: str,
    raise_errors: bool = True,
) -> list[Any]:
    """``commands`` as one ``MULTI``/``EXEC`` followed by ``WAIT`` on the same connection; the EXEC's
    replies, the first error raised — or with ``raise_errors=False`` the errors of commands that ran as
    values, for a caller that undoes the rest (then the count is not checked) — as
    :func:`~.resp_link.run_transaction` does.  Fewer replicas than asked: :class:`NotReplicatedError`
    (the commands did run, on the master)."""
    replies = await exchange(
        link, redis, [("MULTI",), *commands, ("EXEC",), wait_command(durability)], block_s=durability.timeout_ms / 1000
    )
    *queued, executed, acked = replies
    _raise_first([*queued, executed])  # nothing ran (a refused MULTI, EXECABORT)
    if raise_errors:
        _raise_first(executed)
    elif any(isinstance(reply, Exception) for reply in executed):
        return list(executed)
    check_submission(int(acked), durability, what=what)
    return list(executed)


async def replicated_script(
    link: RespLink | None,
    redis: aioredis.Redis,
    script: AsyncScript | BoundFunction,
    keys: Sequence[Any],
    args: Sequence[Any],
    durability: Durability,
    *,
    what: str,
) -> Any:
    """A registered redis-py ``script`` or a library function, then ``WAIT`` on the same connection; its
    reply (its error raised).  Over the link first (``EVALSHA``, ``FCALL``); when Redis does not know it,
    it is loaded in the same batch (a library's load refused for anything but being there already, say
    above ``maxmemory``, is what is raised: the call's own "not found" would hide why).  Fewer replicas
    than asked is logged (``redis.not_replicated``), not raised: the write stands (see the module docstring)."""
    call = invocation(script, keys, args)
    wait = wait_command(durability)
    block_s = durability.timeout_ms / 1000
    replies = await exchange(link, redis, [call, wait], block_s=block_s)
    if unknown(replies[0]):  # nothing ran: load it, run it, on one connection
        loaded, *replies = await exchange(None, redis, [loading(script), call, wait], block_s=block_s)
        if isinstance(script, BoundFunction):
            check_loaded(script.library, loaded)
    reply, acked = replies
    if isinstance(reply, Exception):
        raise reply
    if int(acked) < durability.replicas:
        log.warning("redis.not_replicated", what=what, replicas=int(acked), wanted=durability.replicas)
    return reply


def check_submission(acked: int, durability: Durability, *, what: str) -> None:
    """:class:`NotReplicatedError` when a submission reached fewer replicas than asked."""
    if acked < durability.replicas:
        raise NotReplicatedError(
            f"{what} reached {acked} of {durability.replicas} replicas within {durability.timeout_ms} ms: "
            "not acknowledged (a failover could lose it); submit it again under the same id",
            replicas=acked,
            wanted=durability.replicas,
        )


__all__ = ["check_submission", "exchange", "replicated_script", "replicated_transaction", "wait_command"]
