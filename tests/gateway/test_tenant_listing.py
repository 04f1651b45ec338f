"""``GET /v1/videos`` is tenant-scoped: a tenant's gateway (``STAGEFERRY_TENANT``) lists its tenant's jobs
only, through the official SDK.  Real gateways and Redis; no stage runs (a job the first stage has not
picked up yet is listed as queued)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
import pytest

from stageferry.config import PipelineConfig
from stageferry.gateway import GatewayConfig
from tests.gateway.conftest import running_gateway

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def sdk_for(redis_url: str, prefix: str, pipeline: PipelineConfig, tenant: str | None) -> Iterator[openai.OpenAI]:
    config = GatewayConfig(redis_url=redis_url, prefix=prefix, pipeline=pipeline, tenant=tenant, trace_events=False)
    with running_gateway(config) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as sdk:
        yield sdk


def test_each_tenants_gateway_lists_its_own_jobs(redis_url: str, prefix: str) -> None:
    pipeline = PipelineConfig.model_validate({"security": {"tenants": ["acme", "globex"]}})
    with (
        sdk_for(redis_url, prefix, pipeline, "acme") as acme,
        sdk_for(redis_url, prefix, pipeline, "globex") as globex,
    ):
        mine = [acme.videos.create(prompt=f"acme {i}", size="256x144", seconds="1").id for i in range(2)]  # type: ignore[arg-type]
        theirs = globex.videos.create(prompt="globex", size="256x144", seconds="1").id  # type: ignore[arg-type]
        assert all(v.startswith("acme.video-") for v in mine) and theirs.startswith("globex.video-")
        listed = acme.videos.list()
        assert [v.id for v in listed] == mine[::-1] and all(v.status == "queued" for v in listed.data)
        assert [v.id for v in globex.videos.list()] == [theirs]
        with pytest.raises(openai.BadRequestError):  # another tenant's id is no cursor here
            acme.videos.list(after=theirs)
