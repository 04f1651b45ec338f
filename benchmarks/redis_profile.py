"""Where a Redis server's time goes, script by script: every command's duration from ``SLOWLOG``.

``INFO commandstats`` sums every script under ``evalsha`` and every library function under ``fcall``;
this names each one (a function by its step's name, ``function hand_off``).  For a measured window,
:func:`start` makes the server log every command (``slowlog-log-slower-than 0``) in a log long enough for
the window, :func:`collect` reads it back, puts back the settings it found, and sums the durations by
command, an ``EVALSHA`` by the name of the script constant whose SHA1 it carries (any string constant of
``stageferry``'s broker modules; an unknown one by its SHA's first 10 hex digits).  A script's duration
includes the commands it runs; Redis logs those too (from its script client, address ``?:0``), and they
are summed apart, as ``(in scripts) <name>``, outside the total.

The log keeps each command's first 32 arguments of up to 128 bytes: size ``max_len`` for the window
(some 40 entries a request for a two-stage pipeline), on a private server.  Durations are wall time on the
server's main thread: on a box with fewer cores than busy processes they include preemption.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import pkgutil
import re
from collections import defaultdict
from typing import Any

import stageferry.broker as broker_pkg

_SETTINGS = ("slowlog-log-slower-than", "slowlog-max-len")
#: The prefix of a command run by a script (its time is inside the script's).
NESTED = "(in scripts) "


def script_names() -> dict[str, str]:
    """SHA1 → ``module.CONSTANT`` for every string constant of the broker's modules that may be a script,
    named after the module that defines it (not one that imports it, as chunks imports WAKE_LUA)."""
    names: dict[str, str] = {}
    for info in pkgutil.walk_packages(broker_pkg.__path__, broker_pkg.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (nixl) missing: its scripts stay unnamed
            continue
        source = inspect.getsource(module)
        for attr, value in vars(module).items():
            defined = re.search(rf"^{re.escape(attr)}(: [^=\n]+)? = ", source, re.MULTILINE) is not None
            if isinstance(value, str) and "redis.call" in value and defined:
                sha = hashlib.sha1(value.encode()).hexdigest()
                names.setdefault(sha, f"{info.name.rsplit('.', 1)[-1]}.{attr}")
    return names


async def start(redis: Any, max_len: int) -> dict[str, str]:
    """Log every command from now on, in a fresh log of ``max_len`` entries; returns the settings to put
    back (:func:`collect` does)."""
    found = {name: (await redis.config_get(name))[name] for name in _SETTINGS}
    await redis.config_set("slowlog-max-len", max_len)
    await redis.config_set("slowlog-log-slower-than", 0)
    await redis.slowlog_reset()
    return found


async def collect(redis: Any, settings: dict[str, str], max_len: int) -> dict[str, tuple[int, int]]:
    """The log since :func:`start`: name → (calls, µs), the settings put back and the log emptied."""
    entries = await redis.slowlog_get(max_len)
    for name, value in settings.items():
        await redis.config_set(name, value)
    await redis.slowlog_reset()
    names = script_names()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for entry in entries:
        command = entry["command"]
        parts = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split(" ")
        name = parts[0].lower()
        if name in ("slowlog", "config"):  # this module's own
            continue
        if entry.get("client_address") in (b"?:0", "?:0"):
            name = f"{NESTED}{name}"
        elif name in ("evalsha", "evalsha_ro") and len(parts) > 1:
            name = f"script {names.get(parts[1].lower(), parts[1][:10])}"
        elif name in ("fcall", "fcall_ro") and len(parts) > 1:  # a library function: sf<tag>_<step>
            name = f"function {parts[1].partition('_')[2] or parts[1]}"
        totals[name][0] += 1
        totals[name][1] += int(entry["duration"])
    return {name: (calls, usec) for name, (calls, usec) in totals.items()}


def print_table(title: str, profile: dict[str, tuple[int, int]], requests: int, *, rows: int = 20) -> None:
    """The profile's heaviest ``rows`` names: µs per request, µs per call, calls per request, and the share
    of the total (the commands clients sent; a script's own commands have a share of their script's)."""
    total = sum(usec for name, (_, usec) in profile.items() if not name.startswith(NESTED)) or 1
    print(f"### {title}: {total / requests:.1f} µs per request in commands (scripts whole)\n")
    print("| command or script | µs per request | µs per call | calls per request | share |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (calls, usec) in sorted(profile.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"| {name} | {usec / requests:.1f} | {usec / calls:.1f} | {calls / requests:.2f} | {usec / total:.2f} |")
    print()
