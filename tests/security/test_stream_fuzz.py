"""Hostile entries pushed straight into the stage streams of a running pipeline (real processes, real
Redis, real NIXL agents): every request ends with a typed status, the workers stay up, nothing is left
pending, and nothing is unpickled.

Hypothesis draws the entries: junk jobs for the first stage; for the second, valid envelopes (inline
payloads and NIXL references from a real producer) with one or more fields replaced by hostile values,
blobs truncated or padded, raw junk bytes.  ``STAGEFERRY_FUZZ_EXAMPLES`` sets how many (default 100).
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stageferry.broker.data.payload_codec import encode_inline
from stageferry.schemas import Envelope, InlinePayload, JobRequest, RequestState, request_key
from tests.procs import Services, start_peer, wait_for, write_pipeline
from tests.security.tripwire import tripwire_env

pytestmark = pytest.mark.timeout(400)

EXAMPLES = int(os.environ.get("STAGEFERRY_FUZZ_EXAMPLES", "100"))
STAGES = [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}]
PEER_ARGS = ["--payloads", "T2VA", "--repeat", "3", "--lease", "600"]
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}
TYPED = {
    "invalid_job",
    "invalid_envelope",
    "invalid_manifest",
    "payload_unavailable",
    "deadline_exceeded",
    "stage_failed",
}


class Deployment:
    """Encoder and diffusion workers plus a producer peer whose NIXL references get corrupted."""

    def __init__(self, svc: Services, redis: sync_redis.Redis, refs: list[str], pickle_log: Path) -> None:
        self.svc = svc
        self.redis = redis
        self.refs = refs
        self.pickle_log = pickle_log
        self.ids = itertools.count()

    def rid(self) -> str:
        return f"fz-{next(self.ids)}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("fuzz")
    url = os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    log = tmp / "pickle.log"
    pipeline = write_pipeline(
        tmp / "pipeline.toml",
        STAGES,
        timeouts={"resend": 1.0, "handshake": 2.0, "visibility": 30.0},
        limits={"max_recomputes": 1, "max_entry_bytes": 1 << 20},
        data_plane={"connector": "nixl", "cpu_pool_bytes": 16 << 20},
    )
    env = tripwire_env(log)
    redis = sync_redis.Redis.from_url(url, socket_timeout=None)
    svc = Services(tmp, redis_url=url, prefix=prefix, pipeline=pipeline, extra_env=env)
    try:
        workers = [svc.start("encoder", "a"), svc.start("diffusion", "a")]
        # a real producer agent: its references are valid until corrupted (exec'd: the tripwire's PYTHONPATH)
        peer = start_peer("tests.peer_producer", url, prefix, *PEER_ARGS, log=tmp / "peer.log", env=env)
        svc.procs.append(peer)
        refs = [json.loads(redis.blpop([f"{prefix}:test:refs"], timeout=90)[1])["ref"] for _ in range(3)]
        svc.wait_live("encoder", "encoder-a")
        svc.wait_live("diffusion", "diffusion-a")
        yield Deployment(svc, redis, refs, log)
        assert all(w.poll() is None for w in workers), svc.logs()
    finally:
        redis.set(f"{prefix}:test:stop", 1)
        svc.stop_all()
        keys = list(redis.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            redis.delete(*keys[start : start + 500])
        redis.close()


# -- strategies ---------------------------------------------------------------------------------------------

hostile_ints = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([-(2**63), 2**31, 2**40, 2**63 - 1, 2**64, 2**64 + 4096, 10**40]),
)
junk = st.recursive(
    st.none()
    | st.booleans()
    | hostile_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "\x00", "é" * 300, "../../etc/passwd", "gASVAAAAAAAAAACMCGJ1aWx0aW5zlC4="]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
raw_junk = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"\xff\xfe\x00garbage",
            b"[" * 5000 + b"]" * 5000,  # deep nesting
            b'{"a":' * 3000 + b"1" + b"}" * 3000,
            b"1e99999",
            b"9" * 5000,
            b'{"schema_version": 1, "request_id": "x"',  # truncated
            b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00.",  # a pickle
            b'"\\ud800"',
        ]
    ),
)


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON document (dict keys and list indices), the root excluded."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*prefix, i))
            out += paths(v, (*prefix, i))
    return out


def mutate(doc: Any, data: st.DataObject, rounds: int) -> Any:
    """Replace, delete or add a few fields anywhere in ``doc`` (a deep copy), as a hostile writer would."""
    doc = json.loads(json.dumps(doc))
    for _ in range(rounds):
        where = paths(doc)
        if not where:
            break
        path = data.draw(st.sampled_from(where), label="path")
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        action = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]), label="action")
        if action == "replace":
            parent[path[-1]] = data.draw(junk, label="value")
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6), label="key")] = data.draw(junk, label="value")
        else:
            parent.append(data.draw(junk, label="value"))
    return doc


def envelope_json(rid: str, payload: dict[str, Any]) -> dict[str, Any]:
    job = JobRequest.model_validate(JOB)
    env = Envelope(request_id=rid, key=request_key(rid, 0), from_stage="encoder", to_stage="diffusion", job=job)
    doc = env.model_dump(mode="json")
    doc["payload"] = payload
    return doc


def inline_payload() -> tuple[dict[str, Any], bytes]:
    manifest, blob = encode_inline({"text_states": torch.ones(20, 64, dtype=torch.bfloat16), "layout": torch.arange(5)})
    return InlinePayload(manifest=manifest, blob_bytes=len(blob)).model_dump(mode="json"), blob


def draw_entry(dep: Deployment, data: st.DataObject) -> tuple[str, str, dict[str, bytes]]:
    """(stage, request id, entry fields) of one hostile entry."""
    rid = dep.rid()
    kind = data.draw(st.sampled_from(["job", "inline", "inline", "nixl", "nixl", "raw", "fields"]), label="kind")
    rounds = data.draw(st.integers(0 if kind == "nixl" else 1, 3), label="rounds")
    if kind == "job":
        job = data.draw(st.one_of(raw_junk, st.builds(lambda d: json.dumps(d).encode(), junk)), label="job")
        if data.draw(st.booleans(), label="mutated_job"):
            job = json.dumps(mutate(JOB, data, rounds)).encode()
        return "encoder", rid, {"request_id": rid.encode(), "job": job}
    if kind == "inline":
        payload, blob = inline_payload()
        doc = envelope_json(rid, payload)
        doc = mutate(doc, data, rounds) if data.draw(st.booleans(), label="mutate_envelope") else doc
        cut = data.draw(st.integers(-len(blob) - 1, 64), label="cut")
        blob = blob[:cut] if cut < 0 else blob + bytes(cut)
        return "diffusion", rid, {"request_id": rid.encode(), "envelope": json.dumps(doc).encode(), "blob": blob}
    if kind == "nixl":
        ref = json.loads(data.draw(st.sampled_from(dep.refs), label="ref"))
        region = ref["regions"][0]
        shift = data.draw(st.sampled_from([0, 64, -64, 4096, -4096, 1 << 30, -(1 << 20)]), label="shift")
        region["address"] = region["address"] + shift
        doc = mutate(envelope_json(rid, ref), data, rounds)
        return "diffusion", rid, {"request_id": rid.encode(), "envelope": json.dumps(doc).encode()}
    if kind == "raw":
        return "diffusion", rid, {"request_id": rid.encode(), "envelope": data.draw(raw_junk, label="raw")}
    # entry-level junk: a bad request id, unknown or missing fields
    fields = data.draw(st.dictionaries(st.text(min_size=1, max_size=8), raw_junk, max_size=3), label="fields")
    if data.draw(st.booleans(), label="bad_rid"):
        fields["request_id"] = data.draw(raw_junk | st.just("x" * 300).map(str.encode), label="rid")
        rid = ""
    else:
        fields["request_id"] = rid.encode()
    return data.draw(st.sampled_from(["encoder", "diffusion"]), label="stage"), rid, fields


# -- the test -----------------------------------------------------------------------------------------------


def test_hostile_entries_get_typed_outcomes_and_the_workers_survive(deployment: Deployment) -> None:
    dep = deployment
    keys = dep.svc.keys
    client = dep.svc.client()
    outcomes: dict[str, int] = {}
    dead_before = {s: dep.redis.xlen(keys.dead_letter(s)) for s in ("encoder", "diffusion")}
    untracked: dict[str, int] = {"encoder": 0, "diffusion": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_entry(data: st.DataObject) -> None:
        stage, rid, fields = draw_entry(dep, data)
        dep.redis.xadd(keys.stage_stream(stage), fields)  # type: ignore[arg-type]
        if not rid:
            untracked[stage] += 1
            return
        status = client.wait(rid, timeout=60)
        assert status.state.terminal, status
        if status.state is not RequestState.DONE:
            assert status.error is not None, status
            assert status.error.code in TYPED, status.error
            assert not status.error.message.startswith("internal error"), status.error
        key = f"{status.state.value}:{status.error.code if status.error else ''}"
        outcomes[key] = outcomes.get(key, 0) + 1

    one_entry()
    print("fuzz outcomes:", outcomes)  # noqa: T201 - shown with -s, handy when tuning the strategies
    assert sum(k.startswith("rejected") for k in outcomes) >= 1, outcomes
    # The workers are still up and still serve a good job, and nothing is left behind in the streams.
    good = client.submit(JOB)
    assert client.wait(good, timeout=60).state is RequestState.DONE
    for stage in ("encoder", "diffusion"):
        stream = keys.stage_stream(stage)
        assert dep.redis.xpending(stream, stage)["pending"] == 0
        assert dep.redis.xlen(stream) == 0
        assert dep.redis.xlen(keys.dead_letter(stage)) - dead_before[stage] >= untracked[stage]
    # Nothing unpickled anywhere: not in the workers, not in the producer peer.
    assert not dep.pickle_log.exists(), dep.pickle_log.read_text()[:4000]


def test_an_oversized_entry_is_rejected_without_being_pulled(deployment: Deployment) -> None:
    """Above ``limits.max_entry_bytes`` (1 MiB here): rejected on the size Redis measured, not parsed."""
    keys = deployment.svc.keys
    rid = deployment.rid()
    deployment.redis.xadd(keys.stage_stream("encoder"), {"request_id": rid, "job": b" " * (3 << 20)})
    status = deployment.svc.client().wait(rid, timeout=60)
    assert status.state is RequestState.REJECTED and status.error is not None
    assert status.error.code == "invalid_envelope" and status.error.message == "entry too large"
    assert status.error.details["bytes"] > 3 << 20
    # The terminal status is written first, then the entry is dead-lettered (nothing lost if the stage
    # dies in between): the row may land a moment after the client saw the status.
    dead = wait_for(
        lambda: [
            f for _, f in deployment.redis.xrange(keys.dead_letter("encoder")) if f[b"request_id"] == rid.encode()
        ],
        10,
        "the dead-letter row",
    )
    assert len(dead) == 1 and b"job" not in dead[0]


def test_a_payload_only_comes_from_the_previous_stage(deployment: Deployment) -> None:
    """Well-formed envelopes whose payload claims the wrong producer: rejected before any fetch."""
    keys = deployment.svc.keys
    payload, blob = inline_payload()
    peer_ref = json.loads(deployment.refs[0])
    cases = {  # stage stream -> (from_stage, payload, blob)
        "self": ("diffusion", "diffusion", payload, blob),
        "client_with_payload": ("diffusion", "client", payload, blob),
        "first_stage_with_payload": ("encoder", "client", payload, blob),
        "peer_ref_from_client": ("diffusion", "client", peer_ref, None),
    }
    rids = {}
    for name, (stage, from_stage, ref, data) in cases.items():
        rid = rids[name] = deployment.rid()
        doc = envelope_json(rid, ref)
        doc.update(from_stage=from_stage, to_stage=stage)
        fields: dict[str, Any] = {"request_id": rid, "envelope": json.dumps(doc)}
        if data is not None:
            fields["blob"] = data
        deployment.redis.xadd(keys.stage_stream(stage), fields)
    client = deployment.svc.client()
    for name, rid in rids.items():
        status = client.wait(rid, timeout=60)
        assert status.state is RequestState.REJECTED and status.error is not None, (name, status)
        assert status.error.code == "invalid_envelope", (name, status.error)
