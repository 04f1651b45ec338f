"""Redis Functions (:mod:`stageferry.broker.control.functions`): names taken from the code and the client's
credentials, a library loaded by the first call that misses it (over the lean link, through redis-py, and
in a replicated batch), a load that finds the library there already is no error and any other refusal is
raised, and a library squatting the names another credential would not give cannot be run in its place.
Servers whose functions a test deletes are private (``EmbeddedRedis``): the shared test Redis keeps every
library it is given."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest
from redis import exceptions as redis_errors

from stageferry.broker.control import functions
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.redis_url import Durability
from stageferry.broker.control.replication import replicated_script
from stageferry.broker.control.resp_link import open_link, run_script
from stageferry.embedded_redis import EmbeddedRedis
from tests.security.servers import PrivateRedis

pytestmark = pytest.mark.anyio


def echo_library(marker: str) -> functions.LibrarySource:
    """A small library: ``echo`` answers its marker, its key's value and its argument."""
    callback = f"function(keys, args) return {{'{marker}', redis.call('GET', keys[1]) or '', args[1]}} end"
    return functions.library("sftest", "local unused = 1\n", {"echo": callback})


def test_a_library_and_its_functions_are_named_by_its_code_and_the_credential() -> None:
    a, other = echo_library("a").named(), echo_library("b").named()
    assert a == echo_library("a").named(), "the same code: the same names"
    assert a.name != other.name and a.functions["echo"] != other.functions["echo"], "other code: other names"
    tag = a.name.removeprefix("sftest_")
    assert len(tag) == 16 and a.functions == {"echo": f"sf{tag}_echo"}
    assert a.code.startswith(f"#!lua name={a.name}\n")
    keyed, keyed_again = echo_library("a").named(b"u\0pw"), echo_library("a").named(b"u\0pw")
    assert keyed == keyed_again and keyed.name not in (a.name, echo_library("a").named(b"u\0other").name)


async def test_a_call_that_misses_the_library_loads_it_over_the_link_or_through_redis_py(prefix: str) -> None:
    """After ``FUNCTION FLUSH`` (what an empty restart leaves), the lean link's call falls back once and
    loads it; a call through redis-py alone does the same."""
    marker = uuid.uuid4().hex
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        link = open_link(redis)
        assert link is not None
        echo = echo_library(marker).function("echo").bind(redis)
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


async def test_a_replicated_call_loads_a_missing_library_in_its_own_batch_or_says_why_it_could_not(
    prefix: str,
) -> None:
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        echo = echo_library(uuid.uuid4().hex).function("echo").bind(redis)
        await redis.set(f"{prefix}:k", "v")
        for arg in ("1", "2"):  # missing, then known
            got = await replicated_script(None, redis, echo, [f"{prefix}:k"], [arg], Durability(), what="test")
            assert got[1:] == [b"v", arg.encode()]
        assert len(await redis.function_list(library=echo.library.name)) == 1
        missing = echo_library(uuid.uuid4().hex).function("echo").bind(redis)
        await redis.config_set("maxmemory", 1)  # above it: FUNCTION LOAD (a write) is refused
        try:
            with pytest.raises(redis_errors.OutOfMemoryError):  # the load's refusal, not "Function not found"
                await replicated_script(None, redis, missing, [f"{prefix}:k"], ["3"], Durability(), what="test")
            with pytest.raises(redis_errors.OutOfMemoryError):
                await missing([f"{prefix}:k"], ["3"])
        finally:
            await redis.config_set("maxmemory", 0)


async def test_loading_a_library_that_is_there_already_is_no_error_and_any_other_refusal_is_raised() -> None:
    lib = echo_library(uuid.uuid4().hex).named()
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        async with anyio.create_task_group() as tg:  # several callers that all missed it load at once
            for _ in range(4):
                tg.start_soon(functions.load, redis, lib)
        await functions.load(redis, lib)
        with pytest.raises(redis_errors.ResponseError, match="Error compiling"):
            await functions.load(redis, functions.library("sftest", "this is not lua\n", {}).named())
        squat = f"#!lua name=squat\nredis.register_function('{lib.functions['echo']}', function() return 'x' end)"
        other = echo_library(uuid.uuid4().hex).named()
        await redis.execute_command("FUNCTION", "LOAD", squat.replace(lib.functions["echo"], other.functions["echo"]))
        with pytest.raises(redis_errors.ResponseError, match="already exists"):
            await functions.load(redis, other)  # a function of its name is another library's: refused, raised


async def test_a_client_with_a_password_calls_names_nobody_without_it_can_take(tmp_path: Path, prefix: str) -> None:
    """Function names are global in Redis: a user allowed to load functions could register the names a
    library will have, and a stage would run that code with its own rights.  A client with a password names
    its library with an HMAC keyed by its credentials, so names squatted from the code alone are not its."""
    config = tmp_path / "redis.conf"
    config.write_text("user default on nopass ~* &* +@all\nuser svc on >svc-pw ~* &* +@all\n")
    work = tmp_path / "redis"
    work.mkdir()
    source = echo_library(uuid.uuid4().hex)
    public = source.named()  # what anyone with the code computes
    with PrivateRedis(work, ["--aclfile", str(config)]) as server:
        server.start(f"redis://127.0.0.1:{server.port}/0")
        squat = f"#!lua name=squat\nredis.register_function('{public.functions['echo']}', function() return 'x' end)"
        async with open_client(f"redis://127.0.0.1:{server.port}/0") as anyone:
            await anyone.execute_command("FUNCTION", "LOAD", squat)
            assert await source.function("echo").bind(anyone)([f"{prefix}:k"], ["1"]) == b"x", "without a key: taken"
        async with open_client(f"redis://svc:svc-pw@127.0.0.1:{server.port}/0") as svc:
            echo = source.function("echo").bind(svc)
            assert echo.name != public.functions["echo"]
            assert (await echo([f"{prefix}:k"], ["1"]))[2] == b"1", "its own code ran"
