"""Requests per second through a two-stage pipeline of null models: only the control and data planes work.

    python benchmarks/throughput.py                # T2VA and Ref2VA payloads, 1 and 2 replicas, NIXL vs inline
    python benchmarks/throughput.py --tasks T2VA --replicas 1 --requests 50
    python benchmarks/throughput.py --tasks Ref2VA --replicas 4,8 --edges nixl --output in-place
    python benchmarks/throughput.py --tasks T2VA --replicas 8 --edges nixl --requests 2000 --clients 4
    python benchmarks/throughput.py --tasks T2VA --replicas 8 --edges nixl --entries-in-flight 1,4 --requests 4000

Real services, as deployed: per configuration a private key prefix, ``stageferry serve`` processes for an
``encoder`` and a ``diffusion`` stage (``--replicas`` of each, TP1, ``benchmarks/null_model.py``), and
``--clients`` client processes (``benchmarks/throughput_client.py``, each with its own ``Client``) that
share the ``--requests`` jobs: each submits its share at once (one by one, as fast as it can) and waits
for all of them.  The clients connect and warm up first, then start submitting together on this process's
word (a barrier, after the "before" figures are taken), and report their times back as JSON.  A single
client process submits about 1,350 jobs/s (a 16-core host), so one client caps the figure there; the
default, a quarter of the usable CPUs between 1 and 4, keeps the clients out of the way of the 3,000 req/s
being chased without crowding a small box (1 on 2-7 CPUs: one client, as before ``--clients`` existed;
``--clients 1`` asks for that anywhere).  The edge between the stages is NIXL or inline (the
``connector`` of the pipeline config; inline carries every payload in the stream entry), side by side in
the same run.  Printed: requests/s (first submit → last done, over every client), per-request latency
p50/p99 (submit → done), and the payload hop (the diffusion leader's get) p50/p99; then, per
request, the Redis commands the server ran (``INFO commandstats``, commands inside scripts included — use a
private server) and the round trips every process sent, by call site (``STAGEFERRY_REDIS_TALLY``, see
``stageferry/broker/control/tally.py``; set here for every process of a configuration).

Where the time goes, per configuration (the "CPU" table): the CPU seconds each party used over the measured
requests divided by their wall time, i.e. how many cores it kept busy — Redis's main thread (``INFO cpu``,
``used_cpu_*_main_thread``: ≈ 1.0 means Redis, single-threaded, is saturated), the client processes and
the stage processes by stage (each: their sum, and the busiest one — a Python process near 1.0 is bound by
its event loop).  Whichever is near 1.0 is what limits the configuration.  Under it, per configuration, the
slowest client's "submit s" (from its go to its last submission): near the wall time, submitting is still
what the run measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import redis_profile  # noqa: E402
from anyio.abc import Process  # noqa: E402
from anyio.streams.buffered import BufferedByteReceiveStream  # noqa: E402
from bench_stats import TASK_BYTES, cell, machine_facts, median  # noqa: E402
from step_timer import STEPS_ENV  # noqa: E402
from throughput_client import JOB, flush_tally  # noqa: E402

from stageferry.broker.control import tally  # noqa: E402
from stageferry.cli.launcher import ServiceGroup, wait_for_workers  # noqa: E402
from stageferry.client import Client  # noqa: E402
from stageferry.config import Timeouts  # noqa: E402
from stageferry.cpus import usable_cpus  # noqa: E402

STAGES = ("encoder", "diffusion")
CLIENT_SCRIPT = Path(__file__).resolve().with_name("throughput_client.py")
#: The seed of the first measured request (warm-ups: 0-2 this process's, 3 + n client n's).
FIRST_SEED = 1000


def pipeline_toml(
    connector: str,
    payload_bytes: int,
    ready_slots: bool = True,
    hot_wait: float | None = None,
    entries_in_flight: int = 1,
) -> str:
    # entries_in_flight is written only when it is not the default, so a base tree from before it still loads
    held = "" if entries_in_flight == 1 else f"entries_in_flight = {entries_in_flight}\n"
    stages = "".join(
        f'[[stages]]\nname = "{name}"\nmodel = "benchmarks.null_model:factory"\ntp = 1\ndevice = "cpu"\n{held}\n'
        for name in STAGES
    )
    pool = max(256 << 20, 8 * payload_bytes)
    timeouts = "" if hot_wait is None else f"[timeouts]\nhot_wait = {hot_wait}\n\n"
    return (
        f'[data_plane]\nconnector = "{connector}"\ninline_max_bytes = 65536\n'
        f"inline_fallback_max_bytes = {128 << 20}\ncpu_pool_bytes = {pool}\n"
        f"ready_slots = {'true' if ready_slots else 'false'}\n\n"
        f"[limits]\nmax_entry_bytes = {256 << 20}\n\n{timeouts}{stages}"
    )


def hot_wait_text(hot_wait: float | None) -> str:
    """The hot wait the stages run with: the one asked for, or the default this box gives them (its usable
    CPUs, which the stage processes inherit from this one)."""
    if hot_wait is not None:
        return f"{hot_wait} s"
    return f"the default ({Timeouts().hot_wait_s()} s on {usable_cpus()} usable CPUs)"


def default_clients() -> int:
    """Client processes when ``--clients`` is not given: a quarter of the usable CPUs, at least 1 and at most
    4 (one client submits ~1,350 jobs/s on a 16-core host: four leave room above 3,000 req/s)."""
    return max(1, min(4, usable_cpus() // 4))


def client_shares(requests: int, clients: int) -> list[int]:
    """The requests each client process submits: as even as they go, the first ones one more."""
    return [requests // clients + (k < requests % clients) for k in range(clients)]


class ClientProcess:
    """One ``throughput_client.py`` process and its JSON-lines pipe (that module describes the protocol)."""

    def __init__(self, process: Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)

    @classmethod
    async def start(
        cls, env: Mapping[str, str], index: int, requests: int, first_seed: int, in_flight: int = 1
    ) -> ClientProcess:
        """Client ``client<index>`` (its ``STAGEFERRY_REPLICA``: how :func:`service_cpu_seconds` names it),
        submitting ``requests`` jobs from seed ``first_seed``, ``in_flight`` at a time; its stderr is this
        process's."""
        argv = [sys.executable, str(CLIENT_SCRIPT), "--requests", str(requests), "--first-seed", str(first_seed),
                "--warm-up-seed", str(3 + index), "--in-flight", str(in_flight)]  # fmt: skip
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env={**env, "STAGEFERRY_REPLICA": f"client{index}"},
        )
        return cls(process)

    async def receive(self) -> dict[str, Any]:
        """Its next JSON line; SystemExit, with its exit status, if it ended without writing one."""
        try:
            line = await self._stdout.receive_until(b"\n", 1 << 30)
        except (anyio.IncompleteRead, anyio.EndOfStream):
            code = await self.process.wait()
            raise SystemExit(f"client process {self.process.pid} exited {code} (its stderr is above)") from None
        return json.loads(line)

    async def go(self) -> None:
        """Tell it to start submitting."""
        await self._stdin.send(b"go\n")

    async def close(self) -> None:
        """Let it go (its stdin closed: it closes its client and exits), killed if it has not within 30 s."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._stdin.aclose()
        with anyio.move_on_after(30) as waited:
            await self.process.wait()
        if waited.cancelled_caught:
            self.process.kill()
        await self.process.aclose()


@contextlib.asynccontextmanager
async def client_processes(
    env: Mapping[str, str], shares: list[int], in_flight: int = 1, first_index: int = 0, first_seed: int = FIRST_SEED
) -> AsyncIterator[list[ClientProcess]]:
    """One client process per share (numbered from ``first_index``), the measured requests' seeds numbered
    across them from ``first_seed``; all of them let go (or killed) on the way out."""
    procs: list[ClientProcess] = []
    try:
        for index, requests in enumerate(shares):
            first = first_seed + sum(shares[:index])
            procs.append(await ClientProcess.start(env, first_index + index, requests, first, in_flight))
        yield procs
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                await proc.close()


def client_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its clients' reports (``time.monotonic()`` seconds, one clock for all): the
    wall time (first submit → last done over every client), latencies (ms), hops (ms), failures, and the
    slowest client's submission time (its go → its last submission) and how far apart the clients began."""
    started = [r["started"] for r in reports]
    return {
        "wall": max(max(r["done"]) for r in reports) - min(started),
        "latency": [(d - s) * 1e3 for r in reports for s, d in zip(r["submitted"], r["done"], strict=True)],
        "hop": [h for r in reports for h in r["hops"]] or [0.0],
        "failed": sum(r["failed"] for r in reports),
        "submit_s": max(max(r["submitted"]) - r["started"] for r in reports),
        "start_spread_ms": (max(started) - min(started)) * 1e3,
    }


def lane_shares(total: int, lanes: int) -> list[int]:
    """``total`` (replicas, clients or requests) split over ``lanes`` control planes, the first ones one more."""
    return [total // lanes + (k < total % lanes) for k in range(lanes)]


async def run_config(
    urls: list[str],
    task: str,
    connector: str,
    replicas: int,
    requests: int,
    workdir: Path,
    output: str = "copy",
    ready_slots: bool = True,
    hot_wait: float | None = None,
    clients: int = 1,
    in_flight: int = 1,
    entries_in_flight: int = 1,
    steps: bool = False,
    script_times: bool = False,
    *,
    tally_on: bool = False,
) -> dict[str, Any]:
    prefix = f"tput-{uuid.uuid4().hex[:8]}"
    tally_dir = workdir / f"{prefix}-tally"  # every process's round trips per call site (tally.py), with --tally
    if tally_on:  # its bookkeeping costs the stages CPU on every send: off unless asked for
        os.environ[tally.ENV] = str(tally_dir)
    else:
        os.environ.pop(tally.ENV, None)
    steps_dir = workdir / f"{prefix}-steps"  # every leader's entry steps (step_timer.entry_steps), with --steps
    steps_dir.mkdir()
    pipeline = workdir / f"{prefix}.toml"
    pipeline.write_text(pipeline_toml(connector, TASK_BYTES[task], ready_slots, hot_wait, entries_in_flight))
    base_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "STAGEFERRY_PREFIX": prefix,
        "STAGEFERRY_PIPELINE": str(pipeline),
        "STAGEFERRY_LOG_FORMAT": "json",
        "STAGEFERRY_LOG_LEVEL": "warning",
        "STAGEFERRY_BENCH_TASK": task,
        "STAGEFERRY_BENCH_OUTPUT": output,
        "OMP_NUM_THREADS": "1",
        **({STEPS_ENV: str(steps_dir)} if steps else {}),
    }
    # One control plane a URL ("lanes"): each its own Redis, its share of the replicas, clients and requests;
    # nothing shared but the host.  Replica and client numbers run on across lanes (the CPU table's names).
    lanes = len(urls)
    envs = [{**base_env, "STAGEFERRY_REDIS_URL": url} for url in urls]
    replica_shares, client_counts = lane_shares(replicas, lanes), lane_shares(clients, lanes)
    request_shares = lane_shares(requests, lanes)
    services = [ServiceGroup(env, workdir / f"{prefix}-lane{i}") for i, env in enumerate(envs)]
    from stageferry.config import PipelineConfig

    config = PipelineConfig.load(pipeline)
    try:
        for lane, group in enumerate(services):
            for stage in STAGES:
                for r in range(sum(replica_shares[:lane]), sum(replica_shares[: lane + 1])):
                    await group.start(
                        f"{stage}-{r}",
                        ["env", f"STAGEFERRY_REPLICA={stage}{r}", sys.executable, "-m", "stageferry", "serve", stage],
                    )
        async with contextlib.AsyncExitStack() as stack:
            lane_clients = [
                await stack.enter_async_context(Client(url, prefix=prefix, pipeline=config)) for url in urls
            ]
            client = lane_clients[0]
            for lane_client in lane_clients:
                await wait_for_workers(lane_client.redis, lane_client.keys, list(STAGES), timeout=120)
            await anyio.sleep(1.0 * max(replica_shares))  # let every replica join its consumer group
            for lane_client in lane_clients:
                for i in range(3):  # warm-up: NIXL handshakes, code paths
                    await lane_client.wait(await lane_client.submit({**JOB, "seed": i}), timeout=120)
            procs = []
            for lane, env in enumerate(envs):
                shares = client_shares(request_shares[lane], client_counts[lane])
                first = sum(client_counts[:lane])
                procs += await stack.enter_async_context(
                    client_processes(
                        env, shares, in_flight, first_index=first, first_seed=FIRST_SEED + sum(request_shares[:lane])
                    )
                )
            for proc in procs:
                await proc.receive()  # ready: connected, warmed up, its tally file written
            await anyio.sleep(tally.FLUSH_EVERY_S + 1.2)  # idle readers poll within BLOCK_MS: files flushed
            flush_tally()
            trips_before = tally.read_dir(tally_dir)
            steps_before = read_steps(steps_dir)
            before = [await command_counts(c.redis) for c in lane_clients]
            usec_before = [await command_usec(c.redis) for c in lane_clients]
            log_len = requests * 60
            logged = await redis_profile.start(client.redis, log_len) if script_times else None
            cpu_before = await lanes_cpu_seconds([c.redis for c in lane_clients], prefix)
            for proc in procs:
                await proc.go()
            figures = client_figures([await proc.receive() for proc in procs])
            wall = figures["wall"]
            servers = [c.redis for c in lane_clients]
            cpu_after = await lanes_cpu_seconds(servers, prefix)  # the clients idle, still there
            cpu = {k: (v - cpu_before.get(k, 0.0)) / wall for k, v in cpu_after.items()}
            after = [await command_counts(c.redis) for c in lane_clients]
            usec_after = [await command_usec(c.redis) for c in lane_clients]
            profile = {} if logged is None else await redis_profile.collect(client.redis, logged, log_len)
            commands = summed_deltas(before, after, requests)
            usec = summed_deltas(usec_before, usec_after, requests)
            trips_after = trips_before
            if tally_on:  # the services' files follow within a flush interval of their last send
                await anyio.sleep(tally.FLUSH_EVERY_S + 1.2)
                flush_tally()
                trips_after = tally.read_dir(tally_dir)
            steps_after = read_steps(steps_dir)
            trips = {
                key: [(n - trips_before.get(key, [0, 0])[i]) / requests for i, n in enumerate(row)]
                for key, row in trips_after.items()
            }
    finally:
        for group in services:
            await group.stop()
    return {
        **figures,
        "rps": requests / wall,
        "commands": {k: v for k, v in commands.items() if v > 0},
        "usec": {k: v for k, v in usec.items() if v > 0},
        "profile": profile,
        "trips": {k: v for k, v in trips.items() if v[0] > 0},
        "cpu": cpu,
        "clients": clients,
        "lanes": lanes,
        "steps": steps_between(steps_before, steps_after),
    }


def summed_deltas(before: list[dict[str, int]], after: list[dict[str, int]], requests: int) -> dict[str, float]:
    """Per request, each name's growth between two readings of every lane's Redis, summed over the lanes."""
    out: dict[str, float] = {}
    for lane_before, lane_after in zip(before, after, strict=True):
        for name, value in lane_after.items():
            out[name] = out.get(name, 0.0) + (value - lane_before.get(name, 0)) / requests
    return out


def read_steps(directory: Path) -> dict[str, dict[str, list[float]]]:
    """Every leader's entry steps so far (``step_timer.FileTimer``'s files): file stem → step → ms."""
    out = {}
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            out[path.stem] = json.loads(path.read_text())
    return out


def steps_between(
    before: dict[str, dict[str, list[float]]], after: dict[str, dict[str, list[float]]]
) -> dict[str, dict[str, list[float]]]:
    """The steps recorded between two :func:`read_steps`, merged per stage (the files' stems start with it)."""
    merged: dict[str, dict[str, list[float]]] = {}
    for process, steps in after.items():
        stage = process.rsplit("-", 1)[0]
        for name, values in steps.items():
            skip = len(before.get(process, {}).get(name, []))
            merged.setdefault(stage, {}).setdefault(name, []).extend(values[skip:])
    return merged


async def lanes_cpu_seconds(servers: list[Any], prefix: str) -> dict[str, float]:
    """:func:`cpu_seconds` over one or several lanes' servers: ``redis`` their main threads' sum, and with
    several lanes ``redis<i>`` each (the busiest of them is each lane's limit)."""
    out = await cpu_seconds(servers[0], prefix)
    if len(servers) > 1:
        out["redis0"] = out["redis"]
        for i, server in enumerate(servers[1:], 1):
            out[f"redis{i}"] = await redis_main_thread_seconds(server)
            out["redis"] += out[f"redis{i}"]
    return out


async def redis_main_thread_seconds(redis: Any) -> float:
    """CPU seconds of the server's main thread (the one that runs commands), or of the whole server when its
    ``INFO`` does not tell them apart."""
    info = await redis.info("cpu")
    suffix = "_main_thread" if "used_cpu_user_main_thread" in info else ""
    return float(info[f"used_cpu_user{suffix}"]) + float(info[f"used_cpu_sys{suffix}"])


async def cpu_seconds(redis: Any, prefix: str) -> dict[str, float]:
    """CPU seconds used so far: ``redis`` (its main thread, the one that runs commands) and, per process of
    ``prefix`` (found by its environment: services and client processes), ``<stage><replica>`` and
    ``client<n>``."""
    out = {"redis": await redis_main_thread_seconds(redis)}
    out.update(service_cpu_seconds(prefix))
    return out


def service_cpu_seconds(prefix: str) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of every live process started for ``prefix``, keyed by its
    ``STAGEFERRY_REPLICA`` (``encoder0``, ``client0``); TP followers, if any, add to their replica's figure."""
    tick = os.sysconf("SC_CLK_TCK")
    want = f"STAGEFERRY_PREFIX={prefix}".encode()
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            if want not in env:
                continue
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        replica = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"STAGEFERRY_REPLICA=")), proc.name)
        out[replica] = out.get(replica, 0.0) + (int(stat[11]) + int(stat[12])) / tick  # utime, stime
    return out


async def command_counts(redis: Any) -> dict[str, int]:
    """Redis commands served so far, by name (``INFO commandstats``).  The deltas over a run, divided by
    its requests, are the control plane's commands per request — every client of *this* Redis counted,
    so use a private server (``--redis-url``) for a clean figure."""
    info = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}


async def command_usec(redis: Any) -> dict[str, int]:
    """Microseconds Redis spent in each command so far (``INFO commandstats``'s ``usec``): a script's
    (``evalsha``, a library function's ``fcall``) is the whole script, its own commands included (they are
    also counted under their names).
    What is left of the main thread's CPU is reading, parsing and answering: the network's share."""
    info = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in info.items()}


def submission_line(task: str, replicas: str, connector: str, r: dict[str, Any]) -> str:
    """Whether submitting is still the limit: the slowest client's submit s against the wall time."""
    line = (
        f"{task} x{replicas} {connector}: submit s {r['submit_s']:.2f} (the slowest of {r['clients']} client "
        f"process(es), go → its last submission) of wall s {r['wall']:.2f}"
    )
    if r["clients"] > 1:
        line += f"; the clients began within {r['start_spread_ms']:.2f} ms of each other"
    return line


def print_entry_steps(rows: list[tuple[str, str, str, dict[str, Any]]]) -> None:
    """``--steps``: per configuration, each stage's entry steps over every replica, median and p90 in ms."""
    print("## A leader's steps of an entry, ms (`--steps`: `step_timer.entry_steps`, every replica's entries)\n")
    print("Async steps include their awaits; the model's outer step includes its wait behind other entries in")
    print("hand; `entry: all of it` runs from the admission to the hand-off (the read is apart).\n")
    for task, replicas, connector, r in rows:
        steps = r["steps"]
        stages = [s for s in STAGES if s in steps]
        names = list(dict.fromkeys(name for s in stages for name in steps[s]))
        print(f"### {task}, {replicas} replica(s), {connector}\n")
        print("| step | " + " | ".join(f"{s} p50 | {s} p90 | {s} n" for s in stages) + " |")
        print("| --- |" + " ---: | ---: | ---: |" * len(stages))
        for name in names:
            cells = []
            for s in stages:
                values = sorted(steps[s].get(name, []))
                if not values:
                    cells += ["", "", "0"]
                    continue
                cells += [f"{median(values):.3f}", f"{values[int(0.9 * (len(values) - 1))]:.3f}", str(len(values))]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()


def replicas_label(replicas: int, entries_in_flight: int) -> str:
    """The replicas column: ``8``, or ``8 (4 held)`` for leaders holding 4 entries at once."""
    return str(replicas) if entries_in_flight == 1 else f"{replicas} ({entries_in_flight} held)"


def redis_cell(cpu: dict[str, float], lanes: int) -> str:
    """The Redis column: its main thread, or with several lanes their sum and each lane's (``1.62 (0.81 / 0.81)``)."""
    if lanes == 1:
        return f"{cpu['redis']:.2f}"
    return f"{cpu['redis']:.2f} (" + " / ".join(f"{cpu[f'redis{i}']:.2f}" for i in range(lanes)) + ")"


def busy_cell(cpu: dict[str, float], party: str) -> str:
    """``sum / busiest`` of the cores kept busy by the processes whose names start with ``party``."""
    mine = [v for k, v in cpu.items() if k.startswith(party)]
    return f"{sum(mine):.2f} / {max(mine, default=0):.2f}"


def print_redis_time(rows: list[tuple[str, str, str, dict[str, Any]]]) -> None:
    """Where Redis's main thread spent its time per request: its CPU, the scripts' share (``INFO
    commandstats``' usec of ``evalsha`` and ``fcall``: whole scripts, their commands included), and each command's."""
    print("\n## Redis main-thread µs per request (INFO commandstats usec; a script's time includes its commands)\n")
    for task, replicas, connector, r in rows:
        cpu_us = r["cpu"]["redis"] / r["rps"] * 1e6
        usec = r["usec"]
        scripts = usec.get("evalsha", 0.0) + usec.get("eval", 0.0) + usec.get("fcall", 0.0)
        print(
            f"### {task}, {replicas} replica(s), {connector}: main thread {cpu_us:.1f} µs per request, scripts "
            f"{scripts:.1f}\n"
        )
        print("| command | µs per request | µs per call | calls per request |")
        print("| --- | ---: | ---: | ---: |")
        for name, v in sorted(usec.items(), key=lambda kv: -kv[1]):
            calls = r["commands"].get(name, 0.0)
            print(f"| {name} | {v:.1f} | {v / calls if calls else 0.0:.2f} | {calls:.2f} |")
        print()


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="sf-tput-") as tmp:
        rows = []
        for task in args.tasks:
            for replicas, held in [(n, k) for n in args.replicas for k in args.entries_in_flight]:
                for connector in args.edges:
                    r = await run_config(
                        args.redis_url,
                        task,
                        connector,
                        replicas,
                        args.requests,
                        Path(tmp),
                        args.output,
                        args.ready_slots == "on",
                        args.hot_wait,
                        args.clients,
                        args.in_flight,
                        held,
                        args.steps,
                        args.script_times,
                        tally_on=args.tally,
                    )
                    label = replicas_label(replicas, held)
                    rows.append((task, label, connector, r))
                    print(f"# {task} x{label} {connector}: {r['rps']:.1f} req/s", file=sys.stderr, flush=True)
    print(f"machine: {machine_facts()}")
    print(
        f"{args.requests} requests submitted at once per configuration, shared by {args.clients} client "
        f"process(es), {args.in_flight} submission(s) in flight in each; times in ms, median / p99"
    )
    print(
        f"first stage's output: {args.output} (benchmarks/null_model.py); ready slots {args.ready_slots}; "
        f"hot wait {hot_wait_text(args.hot_wait)}\n"
    )
    print("## Throughput: encoder → diffusion, null models (payload only), TP1 services\n")
    print("| payload | replicas per stage | edge | requests/s | latency submit → done | payload hop (get) | failed |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for task, replicas, connector, r in rows:
        print(
            f"| {task} ({TASK_BYTES[task]:,} B) | {replicas} | {connector} | {r['rps']:.1f} | {cell(r['latency'], 1)} "
            f"| {cell(r['hop'], 2)} | {r['failed']} |"
        )
    print("\n## CPU: cores kept busy over the measured requests (CPU seconds / wall seconds)\n")
    lanes = len(args.redis_url)
    if lanes > 1:
        print(f"{lanes} lanes: {lanes} independent control planes (one Redis each, --redis-url), each with its share")
        print("of the replicas, clients and requests; requests/s and wall over all of them, from one go.")
    print(f"Redis: its main thread (≈ 1.0 = saturated); clients: the {args.clients} client process(es) that submit")
    print("and wait; stages: all replicas' processes; each the sum, and the busiest process (≈ 1.0 = its event")
    print("loop is the limit).  submit s: the slowest client's, from its go to its last submission.\n")
    print(
        "| payload | replicas | edge | wall s | submit s | Redis | clients (sum / busiest) | "
        + " | ".join(f"{stage} (sum / busiest)" for stage in STAGES)
        + " |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(STAGES))
    for task, replicas, connector, r in rows:
        cpu = r["cpu"]
        cells = " | ".join(busy_cell(cpu, party) for party in ("client", *STAGES))
        print(
            f"| {task} | {replicas} | {connector} | {r['wall']:.2f} | {r['submit_s']:.2f} "
            f"| {redis_cell(cpu, r['lanes'])} | {cells} |"
        )
    print()
    for task, replicas, connector, r in rows:
        print(submission_line(task, replicas, connector, r))
    print("\n## Redis commands per request (INFO commandstats deltas over the measured requests)\n")
    names = sorted(
        {n for *_, r in rows for n in r["commands"]}, key=lambda n: -max(r["commands"].get(n, 0) for *_, r in rows)
    )
    print("| payload | replicas | edge | total | " + " | ".join(names) + " |")
    print("| --- | ---: | --- | ---: |" + " ---: |" * len(names))
    for task, replicas, connector, r in rows:
        cells = " | ".join(f"{r['commands'].get(n, 0):.1f}" for n in names)
        print(f"| {task} | {replicas} | {connector} | {sum(r['commands'].values()):.1f} | {cells} |")
    print_redis_time(rows)
    if args.script_times:
        print("## Redis time by script (`--script-times`: SLOWLOG of every command over the measured requests)\n")
        for task, replicas, connector, r in rows:
            redis_profile.print_table(f"{task}, {replicas} replica(s), {connector}", r["profile"], args.requests)
    if args.tally:
        print_trips(rows)
    else:
        print("\n(Round trips by call site: not counted; `--tally` counts them, at some CPU cost to every process.)")
    if args.steps:
        print_entry_steps(rows)
    print()
    for task in args.tasks:
        for replicas in dict.fromkeys(n for t, n, _, _ in rows if t == task):
            by = {c: r for t, n, c, r in rows if t == task and n == replicas}
            if len(by) < 2:
                continue
            rps = by["nixl"]["rps"] / by["inline"]["rps"]
            latency = median(by["inline"]["latency"]) / median(by["nixl"]["latency"])
            print(
                f"{task}, {replicas} replica(s): requests/s NIXL/inline {rps:.2f}×, latency inline/NIXL {latency:.2f}×"
            )


def print_trips(rows: list[tuple[str, str, str, dict[str, Any]]]) -> None:
    """The round trips each call site sent per request (``--tally``)."""
    print("\n## Redis round trips per request, by call site (client tally, `STAGEFERRY_REDIS_TALLY`)\n")
    print("Each process counts what it sends (one command, pipeline or script call = one round trip); the")
    print("differences over the measured requests (idle polling — blocking reads, heartbeats — included).\n")
    for task, replicas, connector, r in rows:
        trips = r["trips"]
        total = [sum(v[0] for v in trips.values()), sum(v[1] for v in trips.values())]
        print(f"### {task}, {replicas} replica(s), {connector}: {total[0]:.1f} round trips, {total[1]:.1f} commands\n")
        by_component: dict[str, list[float]] = {}
        for key, (n, c) in trips.items():
            row = by_component.setdefault(key.split(" ")[0], [0.0, 0.0])
            row[0] += n
            row[1] += c
        print("| component | round trips | commands | what |")
        print("| --- | ---: | ---: | --- |")
        for comp, (n, c) in sorted(by_component.items(), key=lambda kv: -kv[1][0]):
            what = ", ".join(
                f"{k.split(' ', 1)[1]} {v[0]:.2f}"
                for k, v in sorted(trips.items(), key=lambda kv: -kv[1][0])
                if k.split(" ")[0] == comp
            )
            print(f"| {comp} | {n:.2f} | {c:.2f} | {what} |")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=["T2VA", "Ref2VA"])
    parser.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--edges", type=lambda s: s.split(","), default=["nixl", "inline"])
    parser.add_argument(
        "--redis-url",
        type=lambda s: s.split(","),
        default=["redis://127.0.0.1:6379/0"],
        help="the control plane's Redis; several, comma-separated, are lanes: independent control planes on one "
        "host, each with its share of the replicas, clients and requests (what sharding requests by id over "
        "several servers could give), measured as one run",
    )
    parser.add_argument(
        "--output",
        choices=["copy", "in-place"],
        default="copy",
        help="how the null encoder hands its payload over: the put copies it (default), or it asks for "
        "ctx.output_tensors and returns them (the zero-copy put of a model that writes its output in place)",
    )
    parser.add_argument(
        "--ready-slots",
        choices=["on", "off"],
        default="on",
        help="data_plane.ready_slots of both stages (the consumer's next payload made ready while idle)",
    )
    parser.add_argument(
        "--hot-wait", type=float, help="timeouts.hot_wait of both stages, seconds (default: the config's default)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=default_clients(),
        help="client processes sharing the requests, each submitting its share at once and waiting for it "
        f"(default: a quarter of the usable CPUs, 1 to 4: {default_clients()} here; 1 = one client, as before)",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=16,
        help="submissions each client process has outstanding at once (default 16; 1 = one after another, "
        "as before: a client then submits at one submission per two round trips)",
    )
    parser.add_argument(
        "--entries-in-flight",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1],
        help="the stages' entries_in_flight (entries a leader holds at once, its model one at a time), a list "
        "run side by side like --replicas (default 1; the replicas column reads '8 (4 held)')",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="time every leader's steps of each entry (read, admission, model, hand-off: step_timer.entry_steps) "
        "and print their medians and p90 per stage",
    )
    parser.add_argument(
        "--script-times",
        action="store_true",
        help="log every Redis command over the measured requests (SLOWLOG, benchmarks/redis_profile.py) and print "
        "the time of each script by name (a private Redis: the log holds some 60 entries a request)",
    )
    parser.add_argument(
        "--tally",
        action="store_true",
        help="count every process's Redis round trips by call site (STAGEFERRY_REDIS_TALLY) and print them; off by "
        "default, since the bookkeeping on every send costs the stages CPU (requests/s then measures it too)",
    )
    args = parser.parse_args()
    if min(args.entries_in_flight) < 1:
        parser.error("--entries-in-flight must be at least 1")
    if args.in_flight < 1:
        parser.error("--in-flight must be at least 1")
    if not 1 <= args.clients <= args.requests:
        parser.error(f"--clients must be between 1 and --requests ({args.requests})")
    lanes = len(args.redis_url)
    if lanes > 1 and (args.clients < lanes or min(args.replicas) < lanes):
        parser.error(f"{lanes} lanes (--redis-url) need at least {lanes} --clients and --replicas")
    if lanes > 1 and (args.script_times or args.tally):
        parser.error("--script-times and --tally read one server and one set of processes: one --redis-url")
    print(f"$ python {' '.join(sys.argv)}\n")
    anyio.run(main_async, args)


if __name__ == "__main__":
    main()
