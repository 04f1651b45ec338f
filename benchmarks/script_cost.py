"""What an entry's scripts cost Redis, and how much of it is Lua rather than the commands they run.

    python benchmarks/script_cost.py --redis-url redis://127.0.0.1:6399/0 [--calls 3000]

For each script of a request's hot path (a first delivery's start, the hand-off, the finish: the scripts
of :mod:`stageferry.broker.control.entry_records`, as the stages call them, with a T2VA-sized status), one
fresh entry per call, read into a consumer group first, the calls pipelined from one client so that the
server is the only thing timed.  Printed per script: its µs per call (``INFO commandstats``' ``fcall``:
the steps are functions of one library, :mod:`stageferry.broker.control.functions`; ``evalsha`` for a script),
the µs of the commands it ran (the other rows, which Redis counts inside scripts too) and what is left,
Lua's share: the script's own work (tables, closures, strings) and the call's set-up.  Beside them, the
same commands sent plainly in one pipeline (the floor a script cannot go under), an empty function and
an empty script (each call's set-up), an empty script given one large argument
(Lua makes a string of every argument: what the bytes cost) and seven ``redis.call`` of ``EXISTS``
(a call's cost from Lua, against ``exists``'s own row).

Use a private server (``redis-server --port 6399 --save ''``): the keys it writes are its own prefix,
deleted at the end, but ``CONFIG RESETSTAT`` clears the server's command statistics.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable
from typing import Any

import redis

from stageferry.broker.control.entry_records import StatusOrder
from stageferry.broker.control.entry_records.scripts import ADMIT_MARK_AND_LOOK, ENTRY_LIBRARY, FINISH, HAND_OFF
from stageferry.broker.control.functions import LibraryFunction, library

STATUS = json.dumps({"request_id": "t2va-" + "0" * 26, "state": "running", "stage": "encoder", "detail": "y" * 200})
TTL = 3600


def status_args(state: str, rank: int) -> list[Any]:
    """``StatusWrite.args``: the six of the scripts' ``set_status``."""
    return [state, STATUS, TTL, 64, "any", StatusOrder(0, 0, rank, 0).key()]


class Bench:
    def __init__(self, r: redis.Redis, calls: int) -> None:
        self.r, self.calls = r, calls
        self.prefix = f"sc-{uuid.uuid4().hex[:8]}:"

    def fresh_entries(self, stream: str) -> list[str]:
        """``calls`` entries read by consumer ``c`` of group ``g`` (held: the scripts' ownership checks pass)."""
        self.r.xgroup_create(stream, "g", id="0", mkstream=True)
        pipe = self.r.pipeline(transaction=False)
        for _ in range(self.calls):
            pipe.xadd(stream, {"envelope": "x" * 300})
        pipe.execute()
        read = self.r.xreadgroup("g", "c", {stream: ">"}, count=self.calls)
        return [entry_id.decode() for _, entries in read for entry_id, _ in entries]

    def timed(self, send: Callable[[Any, str, str], None], stream: str) -> dict[str, tuple[int, float]]:
        """Send ``send(pipe, key_prefix, entry_id)`` for every fresh entry in one pipeline (each call's keys
        its own: the stream's name and the call's number); the server's command statistics after."""
        ids = self.fresh_entries(stream)
        self.r.config_resetstat()
        pipe = self.r.pipeline(transaction=False)
        for i, entry_id in enumerate(ids):
            send(pipe, f"{stream}:{i}:", entry_id)
        pipe.execute()
        stats = self.r.info("commandstats")
        return {k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for k, v in stats.items()}

    def cleanup(self) -> None:
        for key in self.r.scan_iter(match=self.prefix + "*", count=1000):
            self.r.delete(key)


def report(name: str, stats: dict[str, tuple[int, float]], calls: int) -> None:
    script = (stats.get("evalsha", (0, 0.0))[1] + stats.get("fcall", (0, 0.0))[1]) / calls
    inner = {k: v for k, v in stats.items() if k not in ("evalsha", "fcall", "config|resetstat")}
    commands = sum(usec for _, usec in inner.values()) / calls
    rows = ", ".join(f"{k} {usec / calls:.2f}" for k, (_, usec) in sorted(inner.items(), key=lambda kv: -kv[1][1]))
    print(f"| {name} | {script:.1f} | {commands:.1f} | {script - commands:.1f} | {rows} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6399/0")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    r = redis.Redis.from_url(args.redis_url)
    b = Bench(r, args.calls)
    p = b.prefix
    empty_library = library("script_cost", "", {"empty": "function(keys, args) return 1 end"})
    for lib in (ENTRY_LIBRARY.named(), empty_library.named()):
        if not r.function_list(library=lib.name):
            r.function_load(lib.code)

    def bound(function: LibraryFunction) -> Callable[..., None]:
        def call(
            keys: tuple[Any, ...] | list[Any] = (), args: tuple[Any, ...] | list[Any] = (), client: Any = None
        ) -> None:
            client.fcall(function.source.named().functions[function.short], len(keys), *keys, *args)

        return call

    admit, hand_off, finish = bound(ADMIT_MARK_AND_LOOK), bound(HAND_OFF), bound(FINISH)
    empty = bound(empty_library.function("empty"))
    bare = r.register_script("return 1\n")
    print(f"$ python benchmarks/script_cost.py --calls {args.calls}; redis {r.info('server')['redis_version']}\n")
    print("| script | µs per call | its commands µs | Lua and call set-up µs | commands inside, µs per call |")
    print("| --- | ---: | ---: | ---: | --- |")
    try:

        def start(pipe: Any, k: str, eid: str) -> None:
            keys = [f"{k}rec", f"{k}cancel", f"{k}ev", f"{p}s1"]
            argv = ["d" * 64, TTL, "g", "c", eid, "run:encoder:0", f"crash:encoder:{eid}", 2]
            admit(keys=keys, args=[*argv, *status_args("queued", 0), *status_args("running", 1)], client=pipe)

        report("ADMIT_MARK_AND_LOOK (first stage's start)", b.timed(start, f"{p}s1"), args.calls)

        def plain_start(pipe: Any, k: str, eid: str) -> None:
            rec = f"{k}rec"
            pipe.xpending_range(f"{p}s2", "g", eid, eid, 1)
            pipe.hmget(rec, "job_sha", "state", "status", "order", "ttl_at", "run:encoder:0", "ttl_at")
            pipe.exists(f"{k}cancel")
            pipe.xadd(f"{k}ev", {"kind": "status", "state": "running", "status": STATUS, "folded": STATUS})
            pipe.hset(rec, mapping={"job_sha": "d" * 64, "crash:x": "1", "run:encoder:0": eid, "state": "running",
                                    "status": STATUS, "order": "0 0 1 0", "ttl_at": "1"})  # fmt: skip
            pipe.pexpire(rec, TTL * 1000)
            pipe.pexpire(f"{k}ev", TTL * 1000)

        stats = b.timed(plain_start, f"{p}s2")
        plain = sum(usec for k, (_, usec) in stats.items() if k != "config|resetstat") / args.calls
        print(f"| the same commands, plainly pipelined | | {plain:.1f} | | |")

        def hand(pipe: Any, k: str, eid: str) -> None:
            keys = [f"{p}s3", f"{p}dst", f"{k}rec", f"{k}ev", f"{p}wake"]
            argv = ["g", "c", eid, f"crash:encoder:{eid}", *status_args("queued", 0), "envelope", "e" * 400]
            hand_off(keys=keys, args=argv, client=pipe)

        report("HAND_OFF", b.timed(hand, f"{p}s3"), args.calls)

        def end(pipe: Any, k: str, eid: str) -> None:
            keys = [f"{p}s4", f"{k}rec", f"{k}ev", f"{k}cancel", f"{k}res"]
            argv = ["g", "c", eid, f"crash:diffusion:{eid}", *status_args("done", 2), "1", TTL, "r" * 300]
            finish(keys=keys, args=argv, client=pipe)

        report("FINISH", b.timed(end, f"{p}s4"), args.calls)
        report("an empty function (FCALL)", b.timed(lambda pipe, k, e: empty(client=pipe), f"{p}s5"), args.calls)
        report("return 1", b.timed(lambda pipe, k, e: bare(client=pipe), f"{p}s6"), args.calls)
        big = "y" * 9000  # Lua makes a string of every argument: the cost of a large one (an envelope's size)
        report("return 1, one 9,000-byte argument", b.timed(lambda pipe, k, e: bare(args=[k + big], client=pipe),
               f"{p}s7"), args.calls)  # fmt: skip
        calls = r.register_script("for i = 1, 7 do redis.call('EXISTS', KEYS[1]) end\nreturn 1\n")
        report("7 × redis.call EXISTS", b.timed(lambda pipe, k, e: calls(keys=[k], client=pipe), f"{p}s8"), args.calls)
    finally:
        b.cleanup()


if __name__ == "__main__":
    main()
