"""Redis Functions: scripts loaded once as a library (``FUNCTION LOAD``) and called by name (``FCALL``).

Why: a script run with ``EVALSHA`` is one Lua chunk, so every call defines again each library function
it uses (a closure, its upvalues, the garbage of both); a function library defines them once, when it is
loaded, and each call runs only its own body.  The entry-life steps every request takes (two starts, a
hand-off, a finish: most of what Redis does for a request, ``benchmarks/script_instructions.py``) are
functions of one library for that reason.

The contract:

* **Names come from the code and the client's credentials.**  The library is ``<name>_<t>`` and its functions
  ``sf<t>_<step>``, where ``<t>`` is an HMAC-SHA256 of the library's code keyed by the client's user and
  password (:func:`credential_key`; a plain SHA-1 for a client without a password in its URL: one with the
  default user can do anything anyway; one whose credentials come from a credential provider gets the plain
  names too, and with them the exposure below).  Two versions of the code never share a name, so a rolling
  upgrade runs both side by side, each stage calling its own, and nothing is ever loaded with ``REPLACE``: a
  caller that finds the library there already has what it asked for.  The key is there because Redis's function
  names are global: any user allowed ``FUNCTION LOAD`` (another application's, on a Redis shared with it)
  could register the names a library will have, code and all, and a stage would run that code with its own
  rights.  Names keyed by the services' credential cannot be guessed without it.  A load refused for anything
  but the library being there already (a function of its name held by another library, OOM, READONLY, NOPERM)
  is raised, never skipped.
* **Loaded by the first caller that misses it.**  A call Redis answers with ``Function not found`` ran
  nothing; the caller loads the library and calls again (:meth:`BoundFunction.__call__`, and the lean
  link's callers through :func:`invocation` / :func:`loading` / :func:`unknown`, which treat a script's
  ``NOSCRIPT`` the same way).  Redis replicates ``FUNCTION LOAD`` and keeps the libraries with the data
  (RDB and AOF), so a failover's new master has it; an empty restart does not, and the next call loads it.
* **No flags.**  A function that declares none may write, and Redis refuses it whole on a replica
  (``READONLY``), without enough replicas (``NOREPLICAS``) and above ``maxmemory`` (``OOM``), where a
  script without flags was refused at its first write that needs memory.  Every function here writes with
  such a command first on the path that writes, so what is refused there is what was refused before.  A
  path that would only have read or deleted (a finish that finds the request cancelled, a hand-off that
  finds the entry taken, a status write that finds the entry not held) is refused too above ``maxmemory``,
  where it answered before: its caller gets the ``OOM`` error a writing path gets (READONLY and
  NOREPLICAS are waited out as transient; OOM is not: the worker settles the entry as for any refused
  write).
* **Killing.**  Sentinel answers a master stuck ``BUSY`` with ``SCRIPT KILL``, which Redis does not apply to
  a function (``FUNCTION KILL`` is its counterpart); neither kills one that has written already.  Every
  function here runs a bounded number of commands (no loop over anything a client sizes) and writes
  within its first few, so there is nothing for either to stop.
* **Rights.**  The stage ACL user has ``FCALL`` and ``FUNCTION LOAD`` (:data:`stageferry.acl.STAGE_COMMANDS`),
  clients neither.  Each release leaves its library behind (a few KB); ``FUNCTION DELETE`` removes one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.commands.core import AsyncScript

#: What Redis answers an ``FCALL`` of a function it does not have (nothing ran).
_NOT_FOUND = "Function not found"


@dataclass(frozen=True, slots=True)
class Library:
    """A named library: its name, its whole code (``#!lua name=...`` first) and its functions' names."""

    name: str
    code: str
    functions: Mapping[str, str]
    """Short name (``hand_off``) → the function's name in Redis."""

    def is_loaded_reply(self, reply: Any) -> bool:
        """Whether ``reply`` to ``FUNCTION LOAD`` of this library says Redis has it: its name back, or the
        refusal of a library of this name that is there already (loaded by another caller first).  Any
        other refusal — a function name another library holds, OOM, READONLY, NOPERM — is not."""
        if isinstance(reply, bytes | str):
            return (reply.decode() if isinstance(reply, bytes) else reply) == self.name
        return isinstance(reply, redis_errors.ResponseError) and str(reply) == f"Library '{self.name}' already exists"


@dataclass(frozen=True, slots=True)
class LibrarySource:
    """A library's code before it is named: each client names it with its own credentials (:meth:`named`)."""

    name: str
    shared: str
    callbacks: tuple[tuple[str, str], ...]

    @property
    def code(self) -> str:
        """The library as a client without credentials names it (tests, benchmarks, a Redis without ACL)."""
        return self.named().code

    def named(self, key: bytes = b"") -> Library:
        """The library named from its code and ``key`` (an HMAC of the code; a plain hash without one)."""
        return _named(self, key)

    def function(self, short: str) -> LibraryFunction:
        if short not in dict(self.callbacks):
            raise KeyError(short)
        return LibraryFunction(self, short)


@dataclass(frozen=True, slots=True)
class LibraryFunction:
    """One function of a :class:`LibrarySource`, by its short name."""

    source: LibrarySource
    short: str

    def bind(self, redis: aioredis.Redis) -> BoundFunction:
        """This function called through ``redis`` (as ``redis.register_script`` binds a script), under the
        names ``redis``'s credentials give the library (:func:`credential_key`)."""
        lib = self.source.named(credential_key(redis))
        return BoundFunction(redis, lib, lib.functions[self.short])


@dataclass(frozen=True, slots=True)
class BoundFunction:
    """A library function and the client it is called through: the ``FCALL`` counterpart of redis-py's
    registered script (called with ``keys`` and ``args``, loaded when Redis does not have it)."""

    redis: aioredis.Redis
    library: Library
    name: str

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        call = invocation(self, keys, args)
        try:
            return await self.redis.execute_command(*call)
        except redis_errors.ResponseError as exc:
            if not unknown(exc):
                raise
        await load(self.redis, self.library)
        return await self.redis.execute_command(*call)


def library(name: str, shared: str, callbacks: Mapping[str, str]) -> LibrarySource:
    """A library whose functions are ``callbacks`` (short name → a Lua function expression taking ``keys,
    args``), after ``shared`` (its locals, defined once at load); named ``<name>_<tag>`` when a client
    binds it (see the module docstring for the tag)."""
    return LibrarySource(name, shared, tuple(callbacks.items()))


@functools.cache
def _named(source: LibrarySource, key: bytes) -> Library:
    def build(tag: str) -> tuple[str, dict[str, str]]:
        names = {short: f"sf{tag}_{short}" for short, _ in source.callbacks}
        registrations = "".join(
            f"\nredis.register_function('{names[short]}', {body})\n" for short, body in source.callbacks
        )
        return f"#!lua name={source.name}_{tag}\n{source.shared}{registrations}", names

    draft = build("")[0].encode()
    digest = hmac.new(key, draft, hashlib.sha256).hexdigest() if key else hashlib.sha1(draft).hexdigest()
    code, names = build(digest[:16])
    return Library(f"{source.name}_{digest[:16]}", code, names)


def credential_key(redis: aioredis.Redis) -> bytes:
    """What names a client's libraries: its user and password (empty without a password)."""
    kwargs = redis.connection_pool.connection_kwargs
    password = kwargs.get("password")
    return f"{kwargs.get('username') or ''}\0{password}".encode() if password else b""


async def load(redis: aioredis.Redis, lib: Library) -> None:
    """``FUNCTION LOAD`` ``lib``, unless Redis has it already; any other refusal is raised."""
    try:
        reply: Any = await redis.execute_command("FUNCTION", "LOAD", lib.code)
    except redis_errors.ResponseError as exc:
        reply = exc
    check_loaded(lib, reply)


def check_loaded(lib: Library, reply: Any) -> None:
    """Raise what ``reply`` to ``FUNCTION LOAD`` of ``lib`` says unless it says Redis has the library
    (:meth:`Library.is_loaded_reply`)."""
    if not lib.is_loaded_reply(reply):
        raise reply if isinstance(reply, Exception) else redis_errors.ResponseError(f"FUNCTION LOAD: {reply!r}")


def invocation(script: AsyncScript | BoundFunction, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
    """The command that runs ``script`` (a redis-py registered script, or a library function)."""
    if isinstance(script, BoundFunction):
        return ("FCALL", script.name, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def loading(script: AsyncScript | BoundFunction) -> tuple[Any, ...]:
    """The command that makes Redis know ``script`` (a function's library: its reply is checked with
    :meth:`Library.is_loaded_reply`)."""
    if isinstance(script, BoundFunction):
        return ("FUNCTION", "LOAD", script.library.code)
    return ("SCRIPT", "LOAD", script.script)


def unknown(reply: Any) -> bool:
    """Whether ``reply`` says Redis does not know the script or function it was asked to run (it ran
    nothing): ``NOSCRIPT``, ``Function not found``."""
    return isinstance(reply, redis_errors.NoScriptError) or (
        isinstance(reply, redis_errors.ResponseError) and str(reply).startswith(_NOT_FOUND)
    )


__all__ = [
    "BoundFunction",
    "Library",
    "LibraryFunction",
    "LibrarySource",
    "check_loaded",
    "credential_key",
    "invocation",
    "library",
    "load",
    "loading",
    "unknown",
]
