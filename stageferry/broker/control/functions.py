"""Redis Functions: scripts loaded once as a library (``FUNCTION LOAD``) and called by name (``FCALL``).

Why: a script run with ``EVALSHA`` is one Lua chunk, so every call defines again each library function
it uses (a closure, its upvalues, the garbage of both); a function library defines them once, when it is
loaded, and each call runs only its own body.  The entry-life steps every request takes (two starts, a
hand-off, a finish: most of what Redis does for a request, ``benchmarks/script_instructions.py``) are
functions of one library for that reason.

The contract:

* **Names are content-addressed.**  The library is ``stageferry_<h>`` and its functions ``sf<h>_<name>``,
  where ``<h>`` is taken from the SHA-1 of the library's code.  Two versions of the code never share a
  name (Redis's function names are global across libraries), so a rolling upgrade runs both side by side,
  each stage calling its own; and a name always means the same code, so nothing is ever loaded with
  ``REPLACE``: a caller that finds the library there already has what it asked for.
* **Loaded by the first caller that misses it.**  A call Redis answers with ``Function not found`` ran
  nothing; the caller loads the library and calls again (:meth:`BoundFunction.__call__`, and the lean
  link's callers through :func:`invocation` / :func:`loading` / :func:`unknown`, which treat a script's
  ``NOSCRIPT`` the same way).  Redis replicates ``FUNCTION LOAD`` and keeps the libraries with the data
  (RDB and AOF), so a failover's new master has it; an empty restart does not, and the next call loads it.
* **No flags.**  A function that declares none may write, and Redis refuses it whole on a replica
  (``READONLY``), without enough replicas (``NOREPLICAS``) and above ``maxmemory`` (``OOM``), where a
  script without flags is refused at its first write that needs memory.  Every function here writes with
  such a command first on the path that writes, so what is refused is what was refused before; a path
  that would only have read or deleted (a finish that finds the request cancelled, a hand-off that finds
  the entry taken) is refused too, and its caller retries it like any refused write.
* **Killing.**  Sentinel answers a master stuck ``BUSY`` with ``SCRIPT KILL``, which Redis does not apply to
  a function (``FUNCTION KILL`` is its counterpart); neither kills one that has written already.  Every
  function here runs a bounded number of commands (no loop over anything a client sizes) and writes
  within its first few, so there is nothing for either to stop.
* **Rights.**  The stage ACL user has ``FCALL`` and ``FUNCTION LOAD`` (:data:`stageferry.acl.STAGE_COMMANDS`),
  clients neither.  Each release leaves its library behind (a few KB); ``FUNCTION DELETE`` removes one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.commands.core import AsyncScript

#: What Redis answers an ``FCALL`` of a function it does not have (nothing ran).
_NOT_FOUND = "Function not found"
#: What it answers a ``FUNCTION LOAD`` of a library it has (another caller loaded it first).
_EXISTS = "already exists"


@dataclass(frozen=True, slots=True)
class Library:
    """A function library: its name, its whole code (``#!lua name=...`` first) and its functions' names."""

    name: str
    code: str
    functions: Mapping[str, str]
    """Short name (``hand_off``) → the function's name in Redis."""

    def function(self, short: str) -> LibraryFunction:
        return LibraryFunction(self, self.functions[short])


@dataclass(frozen=True, slots=True)
class LibraryFunction:
    """One function of a :class:`Library`."""

    library: Library
    name: str

    def bind(self, redis: aioredis.Redis) -> BoundFunction:
        """This function called through ``redis`` (as ``redis.register_script`` binds a script)."""
        return BoundFunction(redis, self)


@dataclass(frozen=True, slots=True)
class BoundFunction:
    """A library function and the client it is called through: the ``FCALL`` counterpart of redis-py's
    registered script (called with ``keys`` and ``args``, loaded when Redis does not have it)."""

    redis: aioredis.Redis
    function: LibraryFunction

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        call = invocation(self, keys, args)
        try:
            return await self.redis.execute_command(*call)
        except redis_errors.ResponseError as exc:
            if not unknown(exc):
                raise
        await load(self.redis, self.function.library)
        return await self.redis.execute_command(*call)


def library(name: str, shared: str, callbacks: Mapping[str, str]) -> Library:
    """A library named ``name`` (made unique by its code's hash) whose functions are ``callbacks``
    (short name → a Lua function expression taking ``keys, args``), after ``shared`` (its locals, defined
    once at load).  The callbacks' names in Redis carry the same hash."""

    def build(tag: str) -> tuple[str, dict[str, str]]:
        names = {short: f"sf{tag}_{short}" for short in callbacks}
        registrations = "".join(
            f"\nredis.register_function('{names[short]}', {body})\n" for short, body in callbacks.items()
        )
        return f"#!lua name={name}_{tag}\n{shared}{registrations}", names

    draft, _ = build("")
    tag = hashlib.sha1(draft.encode()).hexdigest()[:12]
    code, names = build(tag)
    return Library(f"{name}_{tag}", code, names)


async def load(redis: aioredis.Redis, lib: Library) -> None:
    """``FUNCTION LOAD`` ``lib``, unless Redis has it already."""
    try:
        await redis.execute_command("FUNCTION", "LOAD", lib.code)
    except redis_errors.ResponseError as exc:
        if _EXISTS not in str(exc):
            raise


def invocation(script: AsyncScript | BoundFunction, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
    """The command that runs ``script`` (a redis-py registered script, or a library function)."""
    if isinstance(script, BoundFunction):
        return ("FCALL", script.function.name, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def loading(script: AsyncScript | BoundFunction) -> tuple[Any, ...]:
    """The command that makes Redis know ``script`` (its reply, an error when the library is loaded
    already, can be ignored: see :func:`load`)."""
    if isinstance(script, BoundFunction):
        return ("FUNCTION", "LOAD", script.function.library.code)
    return ("SCRIPT", "LOAD", script.script)


def unknown(reply: Any) -> bool:
    """Whether ``reply`` says Redis does not know the script or function it was asked to run (it ran
    nothing): ``NOSCRIPT``, ``Function not found``."""
    return isinstance(reply, redis_errors.NoScriptError) or (
        isinstance(reply, redis_errors.ResponseError) and str(reply).startswith(_NOT_FOUND)
    )


__all__ = ["BoundFunction", "Library", "LibraryFunction", "invocation", "library", "load", "loading", "unknown"]
