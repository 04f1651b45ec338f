"""The data plane inside the running pipeline: recompute when a producer dies, recompute when NIXL is
down and the payload is too big for inline, and hostile descriptors rejected before any native call."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from pydantic import TypeAdapter

from stageferry.broker.control import tally
from stageferry.schemas import Envelope, JobRequest, NixlPayload, PayloadRef, RequestState, request_key
from tests.procs import Services, start_peer, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(240)

STAGES = [
    {"name": "encoder", "model": "tests.models:factory"},
    {"name": "diffusion", "model": "tests.models:factory"},
]
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}  # 204,800-byte payload


def make(tmp_path: Path, redis_url: str, prefix: str, **data_plane: Any) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        STAGES,
        timeouts={"visibility": 3.0, "claim_renew_every": 0.5, "resend": 2.0},
        limits={"max_recomputes": 2},
        data_plane={"connector": "nixl", "agent_ttl_s": 2.0, "agent_heartbeat_s": 0.5, **data_plane},
    )
    return Services(
        tmp_path,
        redis_url=redis_url,
        prefix=prefix,
        pipeline=path,
        extra_env={"STAGEFERRY_TEST_RECORD": str(tmp_path / "record.txt"), "STAGEFERRY_TEST_HIDDEN": "5120"},
    )


def runs(tmp_path: Path, stage: str, rid: str) -> int:
    path = tmp_path / "record.txt"
    return path.read_text().splitlines().count(f"{stage} {rid}") if path.exists() else 0


def test_producer_killed_after_publishing_is_recomputed(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix) as svc:
        producer = svc.start("encoder", "a")
        client = svc.client()
        rid = client.submit(JOB)
        wait_for(lambda: (s := client.status(rid)) and s.stage == "diffusion", 60, "payload published")
        producer.send_signal(signal.SIGKILL)  # its pool, and the payload in it, are gone
        producer.wait(10)
        svc.start("encoder", "b")
        svc.start("diffusion", "a")
        status = client.wait(rid, timeout=90)
        assert status.state is RequestState.DONE, svc.logs()
        assert status.attempt >= 1, "the request went back to the encoder"
        assert runs(tmp_path, "encoder", rid) == 2 and runs(tmp_path, "diffusion", rid) == 1
        hop = [t for t in status.timings if t.stage == "diffusion"][-1]
        assert hop.transport.value == "nixl" and hop.payload_bytes >= 204_800


def test_nixl_down_and_payload_above_the_cap_recomputes_then_fails(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, nixl_backends=["NO_SUCH_BACKEND"], inline_fallback_max_bytes=100_000) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(JOB)
        status = client.wait(rid, timeout=90)
        assert status.state is RequestState.FAILED
        assert status.error is not None and status.error.code == "payload_unavailable"
        assert runs(tmp_path, "encoder", rid) == 3  # the first run and max_recomputes=2 recomputes
        small = client.submit({**JOB, "width": 64})  # 40,960 bytes: inline needs no NIXL
        assert client.wait(small, timeout=60).state is RequestState.DONE


def corruptions() -> dict[str, Callable[[dict[str, Any]], None]]:
    """Each mutates a valid NIXL payload reference (as JSON) into a hostile one."""

    def region(p: dict[str, Any]) -> dict[str, Any]:
        return p["regions"][0]

    def tensor(p: dict[str, Any]) -> dict[str, Any]:
        return p["manifest"]["tensors"][0]

    def deep(p: dict[str, Any]) -> None:
        node: Any = {"v": 1}
        for _ in range(40):
            node = {"l": [node]}
        p["manifest"]["tree"] = {"d": [["x", node]] + p["manifest"]["tree"]["d"]}

    return {
        "length_differs_from_manifest": lambda p: region(p).update(length=region(p)["length"] + 64),
        "address_outside_arena": lambda p: region(p).update(address=region(p)["address"] + (1 << 40)),
        "address_before_arena": lambda p: region(p).update(address=4096),
        "negative_length": lambda p: region(p).update(length=-1),
        "huge_length": lambda p: region(p).update(length=1 << 41),
        "wrong_mem_kind": lambda p: region(p).update(mem_kind="VRAM"),
        "wrong_device_id": lambda p: region(p).update(device_id=7),
        "region_count_mismatch": lambda p: p.update(regions=[]),
        "unknown_dtype": lambda p: tensor(p).update(dtype="complex64"),
        "size_not_shape_times_dtype": lambda p: tensor(p).update(nbytes=tensor(p)["nbytes"] + 2),
        "offset_beyond_region": lambda p: tensor(p).update(offset=1 << 30),
        "negative_dim": lambda p: tensor(p).update(shape=[-1, 5120]),
        "overlapping_tensors": lambda p: p["manifest"]["tensors"][1].update(offset=tensor(p)["offset"]),
        "tree_missing_tensor": lambda p: p["manifest"].update(tree={"t": 999}),
        "tensor_not_in_tree": lambda p: p["manifest"].update(tree={"v": None}),
        "tree_too_deep": deep,
        "unknown_agent": lambda p: p.update(agent="encoder-ghost-00000000"),
        "agent_incarnation_mismatch": lambda p: p.update(incarnation="ffffffffffffffff"),
        "truncated_metadata": lambda p: p.update(agent_metadata_b64="bm90IG1ldGFkYXRh"),
        "not_base64_metadata": lambda p: p.update(agent_metadata_b64="%%%"),
        "token_with_bad_chars": lambda p: p.update(token="../../etc/passwd"),
    }


def test_hostile_descriptors_are_rejected_and_the_worker_survives(tmp_path: Path, redis_url: str, prefix: str) -> None:
    r = sync_redis.Redis.from_url(redis_url, socket_timeout=None)
    with make(tmp_path, redis_url, prefix) as svc:
        consumer = svc.start("diffusion", "a")
        peer = start_peer(  # a real producer agent, so that valid references exist to corrupt
            "tests.peer_producer",
            redis_url,
            prefix,
            "--payloads",
            "T2VA,T2VA",
            "--mode",
            "direct",
            log=tmp_path / "peer.log",
        )
        svc.procs.append(peer)
        refs = [json.loads(r.blpop([f"{prefix}:test:refs"], timeout=60)[1])["ref"] for _ in range(2)]
        job = JobRequest.model_validate(JOB)
        stream = svc.keys.stage_stream("diffusion")

        def send(rid: str, payload_json: str) -> None:
            env = Envelope(
                request_id=rid, key=request_key(rid, 0), from_stage="encoder", to_stage="diffusion", job=job
            ).model_dump(mode="json")
            env["payload"] = json.loads(payload_json)
            r.xadd(stream, {"request_id": rid, "envelope": json.dumps(env)})

        cases = corruptions()
        for name, corrupt in cases.items():
            payload = json.loads(refs[0])
            corrupt(payload)
            send(f"hostile-{name.replace('_', '-')}", json.dumps(payload))
        send("valid-after-hostile", refs[1])
        client = svc.client()
        for name in cases:
            status = client.wait(f"hostile-{name.replace('_', '-')}", timeout=60)
            assert status.state is RequestState.REJECTED, (name, status)
            assert status.error is not None and status.error.code in {"invalid_manifest", "invalid_envelope"}, name
        assert client.wait("valid-after-hostile", timeout=60).state is RequestState.DONE
        assert consumer.poll() is None, "the worker must survive hostile input"
        dead = r.xrange(svc.keys.dead_letter("diffusion"))
        assert {f[b"request_id"].decode() for _, f in dead} == {f"hostile-{n.replace('_', '-')}" for n in cases}
        ref = TypeAdapter(PayloadRef).validate_json(refs[1])
        assert isinstance(ref, NixlPayload)
        r.set(f"{prefix}:test:stop", 1)


def test_the_consumer_claims_each_lease_in_its_stream_read(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """The hop's claim rides in the diffusion stage's stream read (no claim round trip of its own), and
    the payloads still arrive over NIXL."""
    tally_dir = tmp_path / "tally"
    with make(tmp_path, redis_url, prefix) as svc:
        svc.extra_env["STAGEFERRY_REDIS_TALLY"] = str(tally_dir)
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rids = [client.submit({**JOB, "seed": seed}) for seed in range(3)]
        for rid in rids:
            status = client.wait(rid, timeout=90)
            assert status.state is RequestState.DONE, svc.logs()
            hop = [t for t in status.timings if t.stage == "diffusion"][-1]
            assert hop.transport.value == "nixl"

        def stored() -> dict[str, list[int]] | None:  # each process rewrites its file every few seconds
            counts = tally.read_dir(tally_dir)
            return counts if counts.get("broker.control.streams:finish FCALL", [0])[0] >= len(rids) else None

        counts = wait_for(stored, 30, "the diffusion stage's tally to show the stored results")
    assert not [site for site in counts if site.startswith("broker.data.nixl.leases:claim")], sorted(counts)
