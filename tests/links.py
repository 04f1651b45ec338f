"""Watching what a lean Redis link (``resp_link.RespLink``) sends, for tests that check which connection a
call takes and in how many round trips."""

from __future__ import annotations

from typing import Any

from stageferry.broker.control.resp_link import RespLink


def record_sends(link: RespLink) -> list[list[str]]:
    """From now on, each ``link.send`` (one round trip) appends its commands' names to the list returned;
    the commands still go to Redis as before."""
    trips: list[list[str]] = []
    send = link.send

    async def recorded(commands: Any, **kw: Any) -> list[Any]:
        trips.append([str(c[0]) for c in commands])
        return await send(commands, **kw)

    link.send = recorded  # type: ignore[method-assign]
    return trips
