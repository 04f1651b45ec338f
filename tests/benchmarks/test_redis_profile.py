"""``benchmarks/redis_profile.py``: a window's SLOWLOG summed by script name, a script's own commands kept
apart, and the server's settings put back, on a private ``redis-server`` (it changes server settings)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from benchmarks import redis_profile
from stageferry.broker.control import functions
from stageferry.broker.control.entry_records.scripts import ENTRY_LIBRARY, MARK
from stageferry.broker.control.stream_scripts import WAKE_LUA
from stageferry.embedded_redis import EmbeddedRedis


@pytest.mark.anyio
async def test_a_window_is_summed_by_script_and_function_with_their_commands_apart() -> None:
    async with EmbeddedRedis() as server:
        client = aioredis.from_url(server.url)
        try:
            found = {name: (await client.config_get(name))[name] for name in redis_profile._SETTINGS}
            await functions.load(client, ENTRY_LIBRARY.named())  # (an FCALL refused as unknown would be logged too)
            mark = MARK.bind(client)
            wake = client.register_script(WAKE_LUA)
            await client.script_load(WAKE_LUA)
            await client.hset("p:rec", "other", "1")
            settings = await redis_profile.start(client, 1000)
            await mark(keys=["p:rec"], args=["crash:a", 2])  # two deliveries: each counted (an HSET each)
            await mark(keys=["p:rec"], args=["crash:a", 3])
            await wake(keys=["p:wake"])
            await client.hget("p:rec", "crash:a")
            profile = await redis_profile.collect(client, settings, 1000)
            assert {name: (await client.config_get(name))[name] for name in redis_profile._SETTINGS} == found
        finally:
            await client.aclose()
    assert profile["function mark"][0] == 2 and profile["script stream_scripts.WAKE_LUA"][0] == 1
    # The function's EXISTS, HGET and HSET, twice each, and the script's LPUSH, apart from the HGET sent alone.
    assert {n: c for n, (c, _) in profile.items() if n.startswith(redis_profile.NESTED)} == {
        "(in scripts) exists": 2, "(in scripts) hget": 2, "(in scripts) hset": 2, "(in scripts) lpush": 1,
    }  # fmt: skip
    assert profile["hget"][0] == 1
    assert not any(name.startswith(("slowlog", "config")) for name in profile)
