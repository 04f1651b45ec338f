"""The soak's hostile client: what a holder of the client ACL user can still do to everyone's queue.

Since clients push submissions onto the first stage's intake list instead of ``XADD``ing its stream
(:mod:`stageferry.broker.control.intake`), the max-id ``XADD`` and ``XADD … MAXLEN 0`` of issue 34 are
refused by Redis itself (``tests/security/test_raw_protocol.py``).  Their equivalents against the intake
are what this fault pushes, in one burst: an item larger than ``limits.max_entry_bytes`` (never copied
into the stream), a flood of junk items, a submission with a stage's fields (``attempt``, ``deadline``),
and a different job under the id of a soak request already admitted (``request_id_taken``).  Each must be
refused under its ticket while the soak's own requests still end exactly once (the audit checks that).
"""

from __future__ import annotations

import json
import time
import uuid

import anyio
import redis as sync_redis

from stageferry.chaos.cluster import Cluster

#: Junk items in the flood, and how long the fault waits for every ticket's refusal (the intake is one
#: queue: the burst waits behind the soak's submissions pushed before it, each a job of the encoder's).
FLOOD = 200
REFUSED_WITHIN_S = 240.0


def _item(ticket: str, rid: str, job: dict[str, object], **extra: object) -> str:
    return json.dumps({"v": 1, "ticket": ticket, "request_id": rid, "job": job, **extra})


def _push(cluster: Cluster, max_entry_bytes: int) -> tuple[bool, str]:
    client: sync_redis.Redis = cluster.client()
    keys, intake = cluster.keys, cluster.keys.intake("encoder")
    try:
        owned = next(
            (rid for rid in sorted(k.decode().rsplit(":", 1)[1] for k in client.keys(keys.request("soak-*")))
             if client.hget(keys.request(rid), "job_sha")),
            None,
        )  # fmt: skip
        job = {"prompt": "hostile", "width": 320, "height": 192}
        tickets = {uuid.uuid4().hex: "oversized", uuid.uuid4().hex: "stage fields"}
        big, forged = list(tickets)
        items = [
            _item(big, "hostile-big", {**job, "pad": "x" * (max_entry_bytes + 1)}),
            _item(forged, "hostile-forged", job, attempt=7, deadline=1e12, from_stage="encoder"),
        ]
        if owned is not None:
            taken = uuid.uuid4().hex
            tickets[taken] = f"taken id {owned}"
            items.append(_item(taken, owned, {**job, "prompt": "not the owner's job"}))
        flood = [uuid.uuid4().hex for _ in range(FLOOD)]
        items += [f'{{"v":1,"ticket":"{t}", junk' for t in flood]
        with client.pipeline(transaction=False) as pipe:
            for it in items:
                pipe.rpush(intake, it)
            pipe.execute()
        deadline = time.monotonic() + REFUSED_WITHIN_S
        waiting = [*tickets, *flood]
        while waiting and time.monotonic() < deadline:
            with client.pipeline(transaction=False) as pipe:
                for ticket in waiting:
                    pipe.exists(keys.refused(ticket))
                found = pipe.execute()
            waiting = [t for t, there in zip(waiting, found, strict=True) if not there]
            time.sleep(0.5)
        if waiting:
            return False, f"{len(waiting)} of {len(items)} hostile items not refused within {REFUSED_WITHIN_S:.0f}s"
        return True, f"{len(items)} hostile items ({', '.join(tickets.values())}, {FLOOD} junk) refused by ticket"
    except (sync_redis.ConnectionError, sync_redis.TimeoutError) as exc:
        return False, f"redis: {exc}"
    except sync_redis.RedisError as exc:
        return False, f"redis error: {exc}"
    finally:
        client.close()


#: How long the fault waits for a Redis that another fault took down, before it counts as missed.
REDIS_BACK_WITHIN_S = 60.0


def _push_when_redis_answers(cluster: Cluster, max_entry_bytes: int) -> tuple[bool, str]:
    """A Redis down for another fault (a restart, an empty restart) delays the burst instead of missing it:
    the whole burst is pushed again, with fresh tickets, once Redis answers."""
    deadline = time.monotonic() + REDIS_BACK_WITHIN_S
    while True:
        ok, detail = _push(cluster, max_entry_bytes)
        if ok or not detail.startswith("redis:") or time.monotonic() > deadline:
            return ok, detail
        time.sleep(0.5)


async def hostile_client(cluster: Cluster, *, max_entry_bytes: int) -> tuple[bool, str]:
    """Push the burst and wait for every item's refusal (see the module docstring)."""
    return await anyio.to_thread.run_sync(_push_when_redis_answers, cluster, max_entry_bytes)


__all__ = ["hostile_client"]
