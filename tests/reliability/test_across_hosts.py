"""Producer and consumer on two "hosts" (network namespaces joined by a veth pair), NIXL over UCX TCP:
payloads cross bit for bit, cutting the link in the middle of a transfer ends in an inline fallback or a
recompute — the request still completes — instead of a hang, and once the link is back NIXL is used
again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from stageferry.chaos.model import RECORD_ENV, STAGE_SECONDS_ENV
from stageferry.client import SyncClient
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.schemas import RequestState, RequestStatus
from tests.procs import ROOT, wait_for, write_pipeline
from tests.reliability.netns import Host, Topology, netns_unavailable

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(os.geteuid() != 0, reason="needs root for netns")]

T2VA_BYTES, FL2VA_BYTES = 359_024, 11_158_136
SAMPLES = ROOT / "stageferry" / "samples"
FL2VA = {
    "task": "fl2va",
    "prompt": "from one frame to the next",
    "width": 320,
    "height": 192,
    "num_inference_steps": 1,
    "media": {
        "first_frame": {"path": str(SAMPLES / "first_frame.png")},
        "last_frame": {"path": str(SAMPLES / "last_frame.png")},
    },
}
T2VA = {"prompt": "a paper boat", "width": 320, "height": 192, "num_inference_steps": 1}


@pytest.fixture
def topology() -> Iterator[Topology]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    with Topology() as topo:
        yield topo


def start(host: Host, stage: str, *, redis_url: str, prefix: str, pipeline: Path, log: Path) -> subprocess.Popen[bytes]:
    """``stageferry serve <stage>`` inside ``host``'s namespace, NIXL pinned to its data link over TCP."""
    env = dict(
        os.environ,
        STAGEFERRY_REDIS_URL=redis_url,
        STAGEFERRY_PREFIX=prefix,
        STAGEFERRY_PIPELINE=str(pipeline),
        STAGEFERRY_REPLICA=host.netns,
        STAGEFERRY_LOG_FORMAT="json",
        PYTHONPATH=str(ROOT),
        UCX_TLS="tcp",
        UCX_NET_DEVICES=host.data_dev,
        UCX_PROTO_INFO="y",
        **{STAGE_SECONDS_ENV: "0.01", RECORD_ENV: str(log.parent / "final_runs.txt")},
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            host.argv(sys.executable, "-m", "stageferry", "serve", stage),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
        )


def json_events(path: Path, name: str) -> list[dict[str, object]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


def last_hop(status: RequestStatus) -> tuple[str, int]:
    hop = [t for t in status.timings if t.stage == "diffusion"][-1]
    return hop.transport.value, hop.payload_bytes


@pytest.mark.slow
def test_payloads_cross_between_namespaces_and_a_cut_link_falls_back(
    topology: Topology, tmp_path: Path, prefix: str
) -> None:
    p, c = topology.producer, topology.consumer
    redis = EmbeddedRedis(extra_args=("--bind", "127.0.0.1", p.gateway_ip, c.gateway_ip, "--protected-mode", "no"))
    anyio.run(redis.start)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pipeline = write_pipeline(
            tmp_path / "pipeline.toml",
            [
                {"name": "encoder", "model": "stageferry.chaos.model:factory", "device": "cpu"},
                {"name": "diffusion", "model": "stageferry.chaos.model:factory", "device": "cpu"},
            ],
            data_plane={"connector": "nixl", "cpu_pool_bytes": 64 << 20, "gpu_pool_bytes": 0},
            timeouts={"transfer": 15.0, "resend": 10.0, "handshake": 10.0},
            limits={"media_roots": [str(SAMPLES)]},  # the job names the bundled samples by path
        )
        # Each host reaches Redis over its own control link, never over the data link.
        for host, stage in ((p, "encoder"), (c, "diffusion")):
            url = f"redis://{host.gateway_ip}:{redis.port}/0"
            log = tmp_path / f"{stage}.log"
            procs.append(start(host, stage, redis_url=url, prefix=prefix, pipeline=pipeline, log=log))
        client = SyncClient(redis.url, prefix=prefix, pipeline=PipelineConfig.load(pipeline))
        try:
            # 1. Payloads cross the data link over NIXL (UCX TCP); the consumer checks every bit.
            for job, nbytes in ((T2VA, T2VA_BYTES), (FL2VA, FL2VA_BYTES)):
                rid = client.submit(job)
                status = client.wait(rid, timeout=120)
                assert status.state is RequestState.DONE, (status, logs(tmp_path))
                transport, moved = last_hop(status)
                assert transport == "nixl" and moved >= nbytes, status.timings
                assert client.result_bytes(rid) == f"ok {rid} {job.get('task', 't2va')}".encode()
            used = [str(e.get("transport")) for e in json_events(tmp_path / "diffusion.log", "nixl.transport")]
            assert used and all("tcp" in u.lower() for u in used), used

            # 2. A slow link, cut while the consumer READs an 11 MB payload: no hang, the request completes.
            topology.slow_data_link("8mbit")  # ~11 s for FL2VA
            rid = client.submit(FL2VA)
            wait_for(lambda: (s := client.status(rid)) and s.stage == "diffusion" and s.state is RequestState.RUNNING,
                     120, "the consumer fetching")  # fmt: skip
            time.sleep(2.0)
            assert client.status(rid).state is RequestState.RUNNING, "still mid-transfer when the link goes"  # type: ignore[union-attr]
            cut_at = time.monotonic()
            topology.cut_data_link()
            status = client.wait(rid, timeout=90)
            took = time.monotonic() - cut_at
            assert status.state is RequestState.DONE, (status, logs(tmp_path))
            transport, moved = last_hop(status)
            assert transport == "inline" or status.attempt >= 1, status.timings  # fallback or recompute
            assert moved >= FL2VA_BYTES
            assert took < 60, f"took {took:.1f}s after the cut"
            failed = json_events(tmp_path / "diffusion.log", "nixl.read_failed")
            assert failed, "the READ across the cut link failed visibly"
            assert all(proc.poll() is None for proc in procs), "no service died"

            # 3. The link comes back: the consumer dropped the broken peer, re-adds it, and NIXL works again.
            topology.restore_data_link()
            rid = client.submit(T2VA)
            status = client.wait(rid, timeout=120)
            assert status.state is RequestState.DONE and last_hop(status)[0] == "nixl", status
        finally:
            client.close()
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
        anyio.run(redis.stop)


def logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("*.log")))
