"""A stage leader's wiring, built once: what every part of the leader's loop works with.

:class:`Leader` holds the stage's place in the pipeline and the control-plane objects built on its
Redis client — its liveness :class:`~stageferry.broker.control.liveness.Heartbeat`, its
:class:`~stageferry.broker.control.streams.StageStream`, the
:class:`~stageferry.broker.control.requests.RequestStore` and the entry-life scripts
(:class:`~stageferry.broker.control.entry_records.EntryRecords`) — and its payload connectors.
:func:`build_leader` builds it; the worker (:mod:`.worker`) hands it to the parts of an entry's path
(:mod:`.admission`, :mod:`.entry_guard`, :mod:`.handoff`, :mod:`.outcomes`), which keep policy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from stageferry.broker.control.dead_letter import DeadLetterPolicy
from stageferry.broker.control.entry_records import EntryRecords
from stageferry.broker.control.intake import Intake
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import Heartbeat
from stageferry.broker.control.refusals import Refusals
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import StageStream
from stageferry.broker.data.connector_contract import Connector
from stageferry.config import PipelineConfig, StageConfig


@dataclass(frozen=True, slots=True)
class Leader:
    """One stage leader's wiring (see the module docstring)."""

    redis: aioredis.Redis
    keys: Keys
    pipeline: PipelineConfig
    stage: StageConfig
    heartbeat: Heartbeat
    stream: StageStream
    store: RequestStore
    records: EntryRecords  #: the entry-life scripts, over the stream's script link
    input_connector: Connector | None
    output_connector: Connector | None
    refusals: Refusals | None  #: the first stage's: where clients learn why a submission was refused

    @property
    def index(self) -> int:
        """Where the stage sits in the pipeline (0: the first, which takes clients' entries)."""
        return self.pipeline.index_of(self.stage.name)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def previous_stage(self) -> StageConfig | None:
        return self.pipeline.previous_stage(self.stage.name)

    @property
    def next_stage(self) -> StageConfig | None:
        return self.pipeline.next_stage(self.stage.name)

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The pipeline's stage names in order (statuses are ordered by stage index)."""
        return tuple(s.name for s in self.pipeline.stages)


def build_leader(
    *,
    redis: aioredis.Redis,
    keys: Keys,
    pipeline: PipelineConfig,
    stage: StageConfig,
    replica: str,
    input_connector: Connector | None = None,
    output_connector: Connector | None = None,
) -> Leader:
    """The leader of ``stage``'s replica ``replica``: its heartbeat, stream (with the first stage's intake,
    and the input payload's lease claimed by the read), request store and entry-life scripts."""
    timeouts, retention, limits = pipeline.timeouts, pipeline.retention, pipeline.limits
    first = pipeline.index_of(stage.name) == 0  # only the first stage takes clients' entries
    heartbeat = Heartbeat(redis, keys, stage.name, replica)
    intake = (
        Intake(redis, keys, stage.name, tenants=pipeline.security.tenants, max_item_bytes=limits.submission_cap[1])
        if first
        else None
    )
    stream = StageStream(
        redis,
        keys,
        stage.name,
        heartbeat.id,
        visibility_ms=int(timeouts.visibility * 1000),
        dead_letters=DeadLetterPolicy.from_retention(retention),
        max_entry_bytes=limits.max_entry_bytes,
        intake=intake,
        # the input payload's lease is claimed by the read itself (one round trip fewer per hop)
        lease_claim=input_connector.lease_claim() if input_connector is not None else None,
        hot_wait_s=timeouts.hot_wait_s(),
    )
    return Leader(
        redis=redis,
        keys=keys,
        pipeline=pipeline,
        stage=stage,
        heartbeat=heartbeat,
        stream=stream,
        store=RequestStore(redis, keys, ttl_s=retention.request_ttl_s, events_maxlen=retention.events_maxlen),
        records=EntryRecords(redis, keys, ttl_s=retention.request_ttl_s, link=stream.script_link),
        input_connector=input_connector,
        output_connector=output_connector,
        refusals=Refusals(redis, keys, ttl_s=retention.request_ttl_s) if first else None,
    )


__all__ = ["Leader", "build_leader"]
