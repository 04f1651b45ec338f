"""``benchmarks/redis_profile.py``: a window's SLOWLOG summed by script name, a script's own commands kept
apart, and the server's settings put back, on a private ``redis-server`` (it changes server settings)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from benchmarks import redis_profile
from stageferry.broker.control.entry_records.scripts import MARK
from stageferry.embedded_redis import EmbeddedRedis


@pytest.mark.anyio
async def test_a_window_is_summed_by_script_with_its_commands_apart() -> None:
    async with EmbeddedRedis() as server:
        client = aioredis.from_url(server.url)
        try:
            found = {name: (await client.config_get(name))[name] for name in redis_profile._SETTINGS}
            mark = client.register_script(MARK)
            await client.script_load(MARK)  # (an EVALSHA refused with NOSCRIPT would be logged too)
            await client.hset("p:rec", "other", "1")
            settings = await redis_profile.start(client, 1000)
            await mark(keys=["p:rec"], args=["crash:a"])
            await mark(keys=["p:rec"], args=["crash:a"])
            await client.hget("p:rec", "crash:a")
            profile = await redis_profile.collect(client, settings, 1000)
            assert {name: (await client.config_get(name))[name] for name in redis_profile._SETTINGS} == found
        finally:
            await client.aclose()
    assert profile["script entry_records.MARK"][0] == 2
    # The script's EXISTS, HGET and HSET, twice each, apart from the HGET sent alone.
    assert {n: c for n, (c, _) in profile.items() if n.startswith(redis_profile.NESTED)} == {
        "(in scripts) exists": 2, "(in scripts) hget": 2, "(in scripts) hset": 2,
    }  # fmt: skip
    assert profile["hget"][0] == 1
    assert not any(name.startswith(("slowlog", "config")) for name in profile)
