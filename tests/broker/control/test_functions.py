"""Redis Functions (:mod:`stageferry.broker.control.functions`): content-addressed names, a library loaded
by the first call that misses it (over the lean link, through redis-py, and in a replicated batch), and
a load that finds the library there already is no error.  Servers whose functions a test deletes are
private (``EmbeddedRedis``): the shared test Redis keeps every library it is given."""

from __future__ import annotations

import uuid

import anyio
import pytest
from redis import exceptions as redis_errors

from stageferry.broker.control import functions
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.redis_url import Durability
from stageferry.broker.control.replication import replicated_script
from stageferry.broker.control.resp_link import open_link, run_script
from stageferry.embedded_redis import EmbeddedRedis

pytestmark = pytest.mark.anyio


def echo_library(marker: str) -> functions.Library:
    """A small library: ``echo`` answers its marker, its key's value and its argument."""
    callback = f"function(keys, args) return {{'{marker}', redis.call('GET', keys[1]) or '', args[1]}} end"
    return functions.library("sftest", "local unused = 1\n", {"echo": callback})


def test_a_library_and_its_functions_are_named_by_its_code() -> None:
    a, same, other = echo_library("a"), echo_library("a"), echo_library("b")
    assert a == same, "the same code: the same names"
    assert a.name != other.name and a.functions["echo"] != other.functions["echo"], "other code: other names"
    tag = a.name.removeprefix("sftest_")
    assert len(tag) == 12 and a.functions == {"echo": f"sf{tag}_echo"}
    assert a.code.startswith(f"#!lua name={a.name}\n")


async def test_a_call_that_misses_the_library_loads_it_over_the_link_or_through_redis_py(prefix: str) -> None:
    """After ``FUNCTION FLUSH`` (what an empty restart leaves), the lean link's call falls back once and
    loads it; a call through redis-py alone does the same."""
    marker = uuid.uuid4().hex
    lib = echo_library(marker)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        link = open_link(redis)
        assert link is not None
        echo = lib.function("echo").bind(redis)
        await redis.set(f"{prefix}:k", "v")
        assert await run_script(link, echo, [f"{prefix}:k"], ["1"]) == [marker.encode(), b"v", b"1"]
        assert link.fallbacks == 1, "the library was missing: the call went through redis-py, which loaded it"
        assert (await run_script(link, echo, [f"{prefix}:k"], ["2"]))[1:] == [b"v", b"2"]
        assert link.fallbacks == 1, "then it runs over the link"
        await redis.execute_command("FUNCTION", "FLUSH")
        assert (await echo([f"{prefix}:k"], ["3"]))[1:] == [b"v", b"3"], "redis-py's call loads it too"
        await redis.execute_command("FUNCTION", "FLUSH")
        with pytest.raises(redis_errors.ResponseError, match="Function not found"):
            await link.call(*functions.invocation(echo, [f"{prefix}:k"], ["4"]))
        assert (await run_script(link, echo, [f"{prefix}:k"], ["5"]))[1:] == [b"v", b"5"]
        assert link.fallbacks == 2
        await link.aclose()


async def test_a_replicated_call_loads_a_missing_library_in_its_own_batch(prefix: str) -> None:
    lib = echo_library(uuid.uuid4().hex)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        echo = lib.function("echo").bind(redis)
        await redis.set(f"{prefix}:k", "v")
        for arg in ("1", "2"):  # missing, then known
            got = await replicated_script(None, redis, echo, [f"{prefix}:k"], [arg], Durability(), what="test")
            assert got[1:] == [b"v", arg.encode()]
        assert len(await redis.function_list(library=lib.name)) == 1


async def test_loading_a_library_that_is_there_already_is_no_error() -> None:
    lib = echo_library(uuid.uuid4().hex)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        async with anyio.create_task_group() as tg:  # several callers that all missed it load at once
            for _ in range(4):
                tg.start_soon(functions.load, redis, lib)
        await functions.load(redis, lib)
        with pytest.raises(redis_errors.ResponseError, match="Error compiling"):
            await functions.load(redis, functions.library("sftest", "this is not lua\n", {}))
