"""The Python client: submit jobs, wait for results, read status and traces.

:class:`Client` is async (anyio, redis-py asyncio); :class:`SyncClient` runs one in a background
event loop for synchronous callers.  Everything goes through :class:`RequestStore`, so a job submitted
here and one enqueued with a raw ``XADD`` are the same to the stages.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal
from pydantic import ValidationError

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import BLOCK_MS, connect, durability_of, with_reconnects
from stageferry.broker.control.refusals import Refusal, Refusals
from stageferry.broker.control.requests import RequestStore, taken
from stageferry.broker.control.resp_link import open_link
from stageferry.config import Limits, PipelineConfig, Settings
from stageferry.errors import ConfigError, JobValidationError, RequestLostError, RequestNotFoundError, field_error
from stageferry.schemas import JobRequest, MediaInputs, RequestState, RequestStatus
from stageferry.schemas.job import (
    REQUEST_ID_PATTERN,
    TENANT_PATTERN,
    TENANT_SEPARATOR,
    is_request_id,
    is_tenant,
    tenant_of,
)
from stageferry.schemas.submission import new_ticket
from stageferry.schemas.validation import check_job_limits, field_errors
from stageferry.trace.events import TraceEvent, parse_events, parse_row

#: Where clients connect when no ``STAGEFERRY_REDIS_URL`` is configured.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

T = TypeVar("T")
#: XREAD's reply, as redis-py returns it with ``decode_responses=False``.


def new_request_id(tenant: str | None = None, *, kind: str = "video_sync") -> str:
    """A fresh request id, e.g. ``video_sync-9e35132f9fa268e8`` (``acme.video_sync-…`` for tenant acme;
    ``kind`` ``video`` for the gateway's async jobs)."""
    rid = f"{kind}-{uuid.uuid4().hex[:16]}"
    return rid if tenant is None else f"{tenant}{TENANT_SEPARATOR}{rid}"


def check_request_id(rid: str, tenant: str | None = None) -> None:
    """:class:`JobValidationError` unless ``rid`` satisfies the id rule (and is ``tenant``'s, if given)."""
    if not is_request_id(rid):
        raise JobValidationError(
            f"invalid request id {rid[:160]!r}",
            [field_error("request_id", f"must match {REQUEST_ID_PATTERN}", "pattern")],
        )
    if tenant is not None and tenant_of(rid) != tenant:
        raise JobValidationError(
            f"request id {rid!r} is not tenant {tenant!r}'s",
            [field_error("request_id", f"must start with {tenant}{TENANT_SEPARATOR}", "tenant")],
        )


def validate_job(data: Mapping[str, Any], limits: Limits | None = None) -> JobRequest:
    """A job from plain data, or :class:`JobValidationError` naming each bad field.

    Only the schema is checked here; deployment limits (step cap, LoRA adapters, ...) are checked by
    the first stage, which rejects the request with the same kind of field errors.  Given the
    deployment's ``limits``, a schema bound they make tighter is quoted as the deployment's.
    """
    try:
        return JobRequest.model_validate(data)
    except ValidationError as exc:
        errors = field_errors(exc, limits)
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        raise JobValidationError(f"invalid job: {summary}", errors) from exc


async def _read_at_most(path: Path, n: int) -> bytes:
    """Up to ``n`` bytes of ``path``: a file that grows after its size was checked still stays bounded."""
    async with await anyio.open_file(path, "rb") as fh:
        return await fh.read(n)


def with_upload_refs(data: Mapping[str, Any], upload_keys: Mapping[str, str]) -> dict[str, Any]:
    """A copy of job ``data`` whose ``media.<name>`` points at each uploaded key."""
    out = dict(data)
    if upload_keys:
        media = dict(out.get("media") or {})
        media.update({name: {"upload_key": key} for name, key in upload_keys.items()})
        out["media"] = media
    return out


class Client:
    """Async client for one deployment (Redis URL, key prefix, pipeline)."""

    def __init__(
        self, url: str, *, prefix: str = "sf", pipeline: PipelineConfig | None = None, tenant: str | None = None
    ) -> None:
        if tenant is not None and not is_tenant(tenant):
            raise ConfigError(f"invalid tenant name {tenant!r}: must match {TENANT_PATTERN}")
        self.url = url
        self.keys = Keys(prefix)
        self.pipeline = pipeline or PipelineConfig()
        self.tenant = tenant
        self.redis = connect(url)
        retention = self.pipeline.retention
        self.store = RequestStore(
            self.redis, self.keys, ttl_s=retention.request_ttl_s, events_maxlen=retention.events_maxlen
        )
        self.refusals = Refusals(self.redis, self.keys, ttl_s=retention.request_ttl_s)
        #: Submissions' lean connection (``resp_link``; connects on first use; None: redis-py alone).
        self._link = open_link(self.redis)
        #: request id → (the ticket, the job digest) of the submission this client made for it
        self._tickets: dict[str, tuple[str, str]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> Client:
        """A client for the configured deployment (``STAGEFERRY_REDIS_URL``/``PREFIX``/``PIPELINE``/``TENANT``)."""
        return cls(
            settings.redis_url or DEFAULT_REDIS_URL,
            prefix=settings.prefix,
            pipeline=settings.load_pipeline(),
            tenant=settings.tenant,
        )

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._link is not None:
                await self._link.aclose()
            await self.redis.aclose()

    async def submit(
        self,
        job: JobRequest | Mapping[str, Any],
        *,
        request_id: str | None = None,
        uploads: Mapping[str, bytes | Path] | None = None,
        upload_ttl_s: int = 3600,
    ) -> str:
        """Validate, upload media, enqueue on the first stage (this client's tenant's intake); the request id.

        The job is held to the deployment's limits (its cost budget, media paths) before anything is sent.
        Submitting an id that is already known enqueues nothing (and uploads nothing) and returns it; an id
        that a stage has admitted for a *different* job raises :class:`RequestIdTakenError` (one still
        waiting to be picked up is settled by the first stage: a different job under it is dead-lettered).
        A tenant's ids start with ``<tenant>.``; a fresh id gets that prefix, a given one must have it.

        Behind Sentinel the call rides through a failover (for the URL's ``failover_wait_s``): the
        submission is repeated under the same id until the new master has it on ``wait_replicas``
        replicas, and it returns only then (:mod:`~stageferry.broker.control.replication`).
        """
        rid = request_id or new_request_id(self.tenant)
        check_request_id(rid, self.tenant)
        data = job.model_dump(mode="json") if isinstance(job, JobRequest) else dict(job)
        blobs = await self._read_uploads(uploads or {})
        # Upload keys carry the submission's ticket (128 random bits): another holder of the client user,
        # who may SET any id's uploads, cannot name them to overwrite them before the stage reads them.
        ticket = new_ticket()
        keys = {name: self.keys.upload(rid, f"{name}.{ticket}") for name in blobs}
        checked = validate_job(with_upload_refs(data, keys), self.pipeline.limits)
        check_job_limits(checked, self.pipeline.limits, upload_prefix=self.keys.upload(rid, ""))
        first = self.pipeline.stages[0].name

        async def enqueue() -> str | None:
            return await self.store.submit(
                rid,
                checked,
                first,
                stream_maxlen=self.pipeline.retention.stream_maxlen,
                tenant=self.tenant,
                uploads={keys[name]: blob for name, blob in blobs.items()},
                upload_ttl_s=upload_ttl_s,
                link=self._link,
                ticket=ticket,
            )

        ride_s = durability_of(self.redis).failover_s
        if ride_s > 0:
            queued = await with_reconnects(enqueue, within=ride_s, event="client.submit_retry", cap=0.5)
        else:
            queued = await enqueue()
        if queued is not None:
            self._tickets[rid] = (queued, checked.digest())
        return rid

    async def _read_uploads(self, uploads: Mapping[str, bytes | Path]) -> dict[str, bytes]:
        limit = self.pipeline.limits.max_upload_bytes
        blobs: dict[str, bytes] = {}
        for name, source in uploads.items():
            field = f"media.{name}"
            if name not in MediaInputs.model_fields:
                raise JobValidationError(
                    f"unknown media input {name!r}",
                    [field_error(field, "no such media input", "unknown_media")],
                )
            try:
                if isinstance(source, bytes):
                    blob, size = source, len(source)
                else:  # refused on its size, before it is read whole
                    size = (await anyio.Path(source).stat()).st_size
                    blob = b"" if size > limit else await _read_at_most(Path(source), limit + 1)
                    size = max(size, len(blob))
            except OSError as exc:
                raise JobValidationError(
                    f"cannot read upload {source!s}: {exc.strerror}",
                    [field_error(field, str(exc), "unreadable_upload")],
                ) from exc
            if size > limit:
                raise JobValidationError(
                    f"upload {name} is {size} bytes, above the limit of {limit}",
                    [field_error(field, f"larger than {limit} bytes", "upload_too_large")],
                )
            blobs[name] = blob
        return blobs

    async def wait(
        self, request_id: str, *, timeout: float | None = None, exists_within: float | None = None
    ) -> RequestStatus:
        """Block until the request is terminal (:class:`DeadlineExceededError` after ``timeout``;
        :class:`RequestLostError` if Redis lost it, or the refusal's error if the first stage refused the
        submission this client made; :class:`RequestIdTakenError` when the id's record belongs to a
        different job than the one this client submitted under it — its ``job_sha`` is another's).

        All waits of this client share one blocking Redis read, however many run at once, and a Redis
        outage is ridden through within ``timeout``.  With ``exists_within`` (``0``: at once) an id that
        is not known by then is :class:`RequestNotFoundError`; without it an unknown id is given
        :data:`~stageferry.broker.control.request_waits.UNKNOWN_GRACE_S` (a raw-protocol entry is known only
        once the first stage reads it).  ``request_lost`` is final: a request it was said of never ends
        otherwise."""

        async def raise_if_refused() -> None:
            refusal = await self.refusal_of(request_id)
            if refusal is not None:
                raise refusal.error()

        mine = self._tickets.get(request_id)
        check = raise_if_refused if mine is not None else None
        try:
            status, ended_as = await self.store.wait_ended(
                request_id,
                timeout=timeout,
                on_quiet=check,
                exists_within=exists_within,
                seen=mine is not None,  # this client's own submission: it existed
            )
        except (RequestLostError, RequestNotFoundError):
            await raise_if_refused()
            raise
        if mine is not None:  # a status under this id, but is it this client's job's? (``job_sha``: its
            # terminal event names it; else the record's, one HGET)
            owner = ended_as or await self.store.owner(request_id)
            if owner is not None and owner != mine[1]:
                raise taken(request_id)
        return status

    async def status(self, request_id: str) -> RequestStatus | None:
        """The request's status; ``queued`` at the first stage while only its "submitted" marker exists."""
        status = await self.store.get(request_id)
        if status is None and await self.store.known(request_id):
            return RequestStatus(request_id=request_id, state=RequestState.QUEUED, stage=self.pipeline.stages[0].name)
        return status

    async def refusal_of(self, request_id: str) -> Refusal | None:
        """Why the first stage refused the submission this client made for ``request_id``, if it did (read
        by the submission's ticket)."""
        mine = self._tickets.get(request_id)
        return None if mine is None else await self.refusals.get(mine[0], self.tenant)

    async def cancel(self, request_id: str) -> bool:
        """Ask the stages to stop the request at their next boundary; False if unknown or finished."""
        return await self.store.request_cancel(request_id)

    async def trace(self, request_id: str) -> list[TraceEvent]:
        """The request's events across all services, in time order."""
        return parse_events(await self.store.events(request_id))

    async def result_bytes(self, request_id: str) -> bytes | None:
        """The stored result (e.g. the MP4), if the last stage stored it in Redis."""
        return await self.store.result(request_id)

    async def watch(
        self, request_id: str, *, timeout: float | None = None, exists_within: float | None = None
    ) -> AsyncIterator[TraceEvent]:
        """Yield the request's events as they arrive (blocking reads), ending after a terminal status.

        :class:`DeadlineExceededError` if it is not terminal within ``timeout`` seconds;
        :class:`RequestNotFoundError` as for :meth:`wait`.
        """
        async for entry_id, fields in self.store.follow(request_id, timeout=timeout, exists_within=exists_within):
            event = parse_row(entry_id, fields)
            if event is not None:
                yield event

    async def wait_with_events(
        self,
        request_id: str,
        on_event: Callable[[TraceEvent], None],
        *,
        timeout: float | None = None,
    ) -> RequestStatus:
        """Like :meth:`wait`, calling ``on_event`` for each event on the way (progress displays)."""
        async for event in self.watch(request_id, timeout=timeout):
            on_event(event)
        return await self.wait(request_id, timeout=BLOCK_MS / 1000)


class SyncClient:
    """Blocking facade over :class:`Client`: one event loop in a background thread, one call at a time."""

    def __init__(
        self, url: str, *, prefix: str = "sf", pipeline: PipelineConfig | None = None, tenant: str | None = None
    ) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._client: Client = self._portal.call(
                lambda: Client(url, prefix=prefix, pipeline=pipeline, tenant=tenant)
            )
        except BaseException:
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)
            raise

    @classmethod
    def from_settings(cls, settings: Settings) -> SyncClient:
        return cls(
            settings.redis_url or DEFAULT_REDIS_URL,
            prefix=settings.prefix,
            pipeline=settings.load_pipeline(),
            tenant=settings.tenant,
        )

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return self._portal.call(fn)

    def submit(
        self,
        job: JobRequest | Mapping[str, Any],
        *,
        request_id: str | None = None,
        uploads: Mapping[str, bytes | Path] | None = None,
        upload_ttl_s: int = 3600,
    ) -> str:
        client = self._client
        return self._call(lambda: client.submit(job, request_id=request_id, uploads=uploads, upload_ttl_s=upload_ttl_s))

    def wait(
        self, request_id: str, *, timeout: float | None = None, exists_within: float | None = None
    ) -> RequestStatus:
        return self._call(lambda: self._client.wait(request_id, timeout=timeout, exists_within=exists_within))

    def status(self, request_id: str) -> RequestStatus | None:
        return self._call(lambda: self._client.status(request_id))

    def cancel(self, request_id: str) -> bool:
        return self._call(lambda: self._client.cancel(request_id))

    def trace(self, request_id: str) -> list[TraceEvent]:
        return self._call(lambda: self._client.trace(request_id))

    def result_bytes(self, request_id: str) -> bytes | None:
        return self._call(lambda: self._client.result_bytes(request_id))

    def close(self) -> None:
        """Close the connection and stop the background loop; idempotent."""
        if self._portal_cm is None:
            return
        try:
            self._call(self._client.aclose)
        finally:
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


__all__ = [
    "DEFAULT_REDIS_URL",
    "Client",
    "SyncClient",
    "check_request_id",
    "new_request_id",
    "validate_job",
    "with_upload_refs",
]
