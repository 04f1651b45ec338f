"""Clients always learn their job's id: a wait that fails after the job was accepted still names it (503,
``Retry-After``, the id, how to cancel), and an ``Idempotency-Key`` makes a retry attach to the same job.

Real gateway, real Redis (a private server for the outage), no stage processes: jobs stay queued, which
is all these answers depend on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import anyio
import httpx
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.gateway import GatewayConfig
from tests.conftest import delete_prefix
from tests.gateway.conftest import running_gateway

FORM = {"prompt": "a lighthouse at dusk", "size": "256x144", "seconds": "1"}


@pytest.fixture
def gateway(redis_url: str) -> Iterator[tuple[str, str]]:
    prefix = f"t-acc-{uuid.uuid4().hex[:10]}"
    config = GatewayConfig(redis_url=redis_url, prefix=prefix, pipeline=PipelineConfig(), trace_events=False)
    try:
        with running_gateway(config) as base:
            yield base, prefix
    finally:
        delete_prefix(redis_url, prefix)


def queued_entries(redis_url: str, prefix: str) -> int:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(Keys(prefix).intake("encoder")))  # the submissions on the intake
    finally:
        client.close()


def test_a_retry_with_the_same_key_attaches_to_the_same_job(gateway: tuple[str, str], redis_url: str) -> None:
    base, prefix = gateway
    with httpx.Client(base_url=base, timeout=30) as http:
        key = {"Idempotency-Key": f"order-{uuid.uuid4()}"}
        first = http.post("/v1/videos", data=FORM, headers=key)
        assert first.status_code == 200, first.text
        again = http.post("/v1/videos", data=FORM, headers=key)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert queued_entries(redis_url, prefix) == 1, "the retry must not run the job twice"

        other = http.post("/v1/videos", data={**FORM, "prompt": "a different video"}, headers=key)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        assert other.headers["x-request-id"] == first.json()["id"]

        # Another caller (another Authorization) using the same key gets a job of its own.
        theirs = http.post("/v1/videos", data=FORM, headers={**key, "Authorization": "Bearer someone-else"})
        assert theirs.status_code == 200 and theirs.json()["id"] != first.json()["id"]
        assert queued_entries(redis_url, prefix) == 2

        # A sync retry of the same request attaches too: it waits on the queued job, then gives up on it.
        sync = http.post("/v1/videos/sync", data=FORM, headers={**key, "X-Stageferry-Timeout": "1"})
        assert sync.status_code == 504 and sync.headers["x-request-id"] == first.json()["id"]
        assert sync.json()["request_id"] == first.json()["id"]
        assert queued_entries(redis_url, prefix) == 2

        bad = http.post("/v1/videos", data=FORM, headers={"Idempotency-Key": "has spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"


def test_a_wait_that_fails_after_acceptance_still_names_the_job() -> None:
    """Redis goes away while a sync request waits: the answer is 503 with Retry-After, the id and the
    way to cancel; once Redis is back the job is there, and the cancel works."""

    async def scenario() -> None:
        async with EmbeddedRedis(appendonly=True, extra_args=("--appendfsync", "always")) as server:
            prefix = "t-outage"
            config = GatewayConfig(redis_url=server.url, prefix=prefix, pipeline=PipelineConfig(), trace_events=False)
            with running_gateway(config) as base:
                async with httpx.AsyncClient(base_url=base, timeout=120) as http, anyio.create_task_group() as tg:
                    answers: list[httpx.Response] = []

                    async def sync_request() -> None:
                        answers.append(
                            await http.post("/v1/videos/sync", data=FORM, headers={"X-Stageferry-Timeout": "3"})
                        )

                    tg.start_soon(sync_request)
                    deadline = time.monotonic() + 30
                    while queued_entries(server.url, prefix) < 1:
                        assert time.monotonic() < deadline, "the job was never enqueued"
                        await anyio.sleep(0.05)
                    await server.kill()  # the job is in; its wait, and then its cancel, fail
                    while not answers:
                        await anyio.sleep(0.1)
                    await server.start()
                answer = answers[0]
                assert answer.status_code == 503, answer.text
                rid = answer.headers["x-request-id"]
                assert answer.headers["retry-after"] and answer.headers["location"] == f"/v1/videos/{rid}"
                body = answer.json()
                assert body["request_id"] == rid and body["cancel"] == {"method": "DELETE", "url": f"/v1/videos/{rid}"}
                async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                    video = (await http.get(body["status_url"])).json()
                    assert video["id"] == rid and video["status"] == "queued", video
                    assert (await http.delete(body["cancel"]["url"])).json()["deleted"] is False  # cancelled

    anyio.run(scenario)
