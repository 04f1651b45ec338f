"""Entry admission: what a stage checks before it spends anything on an entry.

In order, for every entry the worker reads:

0. a client's submission, moved from an intake list by the first stage (:mod:`~stageferry.broker.control.intake`),
   is opened (:meth:`Admission.open`): an item too large to be moved (``limits.max_submission_bytes``), one
   delivered past ``limits.max_deliveries`` + 1 (a stage died opening it each time: not opened again),
   or one that is not a :class:`~stageferry.schemas.submission.Submission`, is refused; then whether its
   request id may be trusted at all: an id that breaks the id rule, or — at the first stage of a deployment
   with tenants — a job that does not come through its tenant's intake, is refused *without a request id*, so that
   nothing is written under an id that may be someone else's (the outcome settles it with a refusal
   record keyed by the submission's ticket);
1. the entry as an envelope (:meth:`Admission.parse`): clients send a bare ``job`` to the first stage,
   stages send envelopes; anything else, or anything too large, is a typed rejection; after the entry is
   admitted (its id is its job's, :mod:`.entry_guard`) the job is held to the deployment's limits
   (:meth:`Admission.check_limits`: cost budget, step cap, prompt length, LoRA adapters, upload prefix,
   media paths);
2. whether it must run at all (:meth:`Admission.settled`): a request already terminal or a duplicate
   run is acknowledged and skipped; a cancelled one or one past its deadline raises
   :class:`CancelledRequestError` / :class:`DeadlineExceededError` (the outcome table decides the rest);
   the record's run-owner field binds one stream entry to each request, stage and attempt;
3. the first stage's media (:meth:`Admission.load_media`): bad media is a rejection, not a failure.

Every refusal is raised as a typed error; none is written here.
"""

from __future__ import annotations

import dataclasses
import json
import time

import structlog
from pydantic import ValidationError

from stageferry.broker.control.entry_records import EntryKeys, Look
from stageferry.broker.control.streams import Entry
from stageferry.broker.data import metrics
from stageferry.errors import (
    CancelledRequestError,
    DeadLetteredError,
    DeadlineExceededError,
    EnvelopeError,
    InvalidRequestIdError,
    RejectedError,
    SubmissionRefusedError,
    TenantMismatchError,
)
from stageferry.schemas import Envelope, json_text, request_key
from stageferry.schemas.job import REQUEST_ID_PATTERN, is_request_id, tenant_of
from stageferry.schemas.submission import TICKET_WINDOW, Submission
from stageferry.schemas.validation import (
    check_entry_fields,
    check_job_limits,
    check_payload_fields,
    field_errors,
    parse_envelope,
    parse_job,
    parse_status,
)
from stageferry.stages.entry.leader import Leader
from stageferry.stages.entry.media import has_media, load_media

log = structlog.get_logger(__name__)


def _with_shown_id(entry: Entry) -> Entry:
    """A submission that does not validate, with the ``request_id`` it names (if any) as a field of its
    own, for its refusal record to show (bounded there); the entry is read no further."""
    try:
        rid = json_text.loads(entry.fields["submission"]).get("request_id")
    except (ValueError, AttributeError):
        return entry
    return (
        dataclasses.replace(entry, fields={**entry.fields, "request_id": rid.encode()})
        if isinstance(rid, str)
        else entry
    )


class Admission:
    """One stage's entry checks (the leader's; see the module docstring)."""

    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.redis = leader.redis
        self.keys = leader.keys
        self.pipeline = leader.pipeline
        self.stage = leader.stage
        self.stream = leader.stream
        self.store = leader.store
        self.records = leader.records
        self.input_connector = leader.input_connector
        self.index = leader.index
        self.previous_stage = leader.previous_stage

    def open(self, entry: Entry) -> tuple[Entry, SubmissionRefusedError | None]:
        """The entry as the stage reads it — a moved submission's item unpacked into ``request_id``, ``job``
        and ``ticket`` fields (beside the mover's ``tenant``) — and why it must be refused before anything
        is written under its request id, or None (:meth:`refusal`)."""
        if "oversized" in entry.fields:
            size = entry.text("oversized")
            setting, limit = self.pipeline.limits.submission_cap
            return entry, SubmissionRefusedError(f"the submission is {size} bytes, above limits.{setting} = {limit}")
        if "submission" not in entry.fields:
            return entry, self.refusal(entry)
        limit = self.pipeline.limits.max_deliveries
        # Admitted on its delivery limit + 1, it would have been dead-lettered then, with its status
        # (check_deliveries); one delivered more never got that far: its stage died opening or admitting
        # it each time.  Not opened again.
        if entry.deliveries > limit + 1:
            message = f"delivered {entry.deliveries} times (limit {limit}), never admitted: the stage keeps dying on it"
            return entry, SubmissionRefusedError(message, deliveries=entry.deliveries)
        try:
            submission = Submission.model_validate_json(entry.fields["submission"])
        except ValidationError as exc:
            errors = field_errors(exc)
            where = f"{errors[0]['field']}: {errors[0]['message']}" if errors else "not JSON"
            return _with_shown_id(entry), SubmissionRefusedError(f"invalid submission: {where}"[:500])
        if submission.ticket != entry.text("ticket"):
            return entry, SubmissionRefusedError(
                f"the submission's ticket must come first, within its first {TICKET_WINDOW} bytes"
            )
        fields = {
            "request_id": submission.request_id.encode(),
            "job": json.dumps(submission.job, separators=(",", ":")).encode(),
            "ticket": submission.ticket.encode(),
            **({"tenant": entry.fields["tenant"]} if "tenant" in entry.fields else {}),
        }
        opened = dataclasses.replace(entry, fields=fields)
        return opened, self.refusal(opened)

    def refusal(self, entry: Entry) -> SubmissionRefusedError | None:
        """Why ``entry`` must be refused before anything is written under its request id, or None.

        The id must satisfy the id rule (so that its keys cannot alias another request's).  At the first
        stage with tenants, a client job must come through a tenant's intake stream — only that tenant's
        ACL user can write it — and name one of that tenant's ids; an intake carries jobs only, and the
        stage's own stream (stages only, then) takes no jobs."""
        raw = entry.fields.get("request_id")
        try:
            rid = None if raw is None else raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            rid = None
        if rid is None or not is_request_id(rid):
            return InvalidRequestIdError(f"missing or invalid request_id: must match {REQUEST_ID_PATTERN}")
        if self.index != 0:
            return None
        if entry.tenant is not None:
            if "job" not in entry.fields or "envelope" in entry.fields:
                return SubmissionRefusedError("a tenant's intake takes client jobs only (a job field)")
            if tenant_of(rid) != entry.tenant:
                return TenantMismatchError(f"request ids from tenant {entry.tenant!r} must start with {entry.tenant}.")
        elif self.pipeline.security.tenants and "envelope" not in entry.fields:
            return TenantMismatchError("this deployment has tenants: submit through your tenant's intake stream")
        return None

    def check_deliveries(self, entry: Entry) -> None:
        """:class:`DeadLetteredError` for an entry delivered more often than ``limits.max_deliveries``."""
        limit = self.pipeline.limits.max_deliveries
        if entry.deliveries > limit:
            raise DeadLetteredError(
                f"delivered {entry.deliveries} times (limit {limit}); the stage keeps dying on it",
                deliveries=entry.deliveries,
            )

    def parse(self, entry: Entry, rid: str) -> Envelope:
        """The entry as an envelope: clients send a bare ``job`` to the first stage, stages send envelopes."""
        limit = self.pipeline.limits.max_entry_bytes
        if entry.too_large is not None:  # measured inside Redis; its bytes were never read
            raise EnvelopeError("entry too large", bytes=entry.too_large, limit=limit)
        if sum(len(v) for v in entry.fields.values()) > limit:
            raise EnvelopeError("entry too large", limit=limit)
        check_entry_fields(entry.fields)
        if "envelope" in entry.fields:
            envelope = parse_envelope(entry.fields["envelope"])
            if envelope.request_id != rid or envelope.to_stage != self.stage.name:
                raise EnvelopeError("envelope does not match its entry", request_id=rid, to_stage=envelope.to_stage)
            if envelope.payload.kind != "none" and envelope.from_stage != getattr(self.previous_stage, "name", None):
                raise EnvelopeError("a payload may only come from the previous stage", from_stage=envelope.from_stage)
            check_payload_fields(entry.fields, envelope.payload)
        elif "job" in entry.fields and self.index == 0:
            job = parse_job(entry.fields["job"])
            envelope = Envelope(
                request_id=rid,
                key=request_key(rid, -1),
                from_stage="client",
                to_stage=self.stage.name,
                job=job,
                deadline=time.time() + self.pipeline.timeouts.request,
            )
        elif self.index == 0:
            raise EnvelopeError(
                "missing field 'job': a client's entry carries its job as JSON in 'job' (see `stageferry schema`)",
                fields=sorted(entry.fields)[:10],
            )
        else:
            raise EnvelopeError("missing field 'envelope'", fields=sorted(entry.fields)[:10])
        return envelope

    def check_limits(self, envelope: Envelope) -> None:
        """The deployment's limits and cost budget (checked again by every stage, after admission, so that
        an owner's over-budget job ends ``rejected``); a request reads only its own uploads (tenants!)."""
        upload_prefix = self.keys.upload(envelope.request_id, "")
        check_job_limits(envelope.job, self.pipeline.limits, upload_prefix=upload_prefix)

    def may_start(self, envelope: Envelope) -> bool:
        """Whether the admission's script may write the entry's start statuses (``Outcomes.start_writes``)
        when it finds that the entry will run: as :meth:`settled` decides it, except for what is known here
        already — a job over the limits (:meth:`check_limits` rejects it next) or past its deadline writes
        no start."""
        if envelope.deadline is not None and time.time() > envelope.deadline:
            return False
        try:
            self.check_limits(envelope)
        except RejectedError:
            return False
        return True

    def media_free(self, envelope: Envelope) -> bool:
        """Whether :meth:`load_media` has nothing to load (or refuse) for this entry: then a first stage's
        ``running`` may come with its ``queued``, in the admission's script."""
        return self.index != 0 or not has_media(envelope.job)

    async def settled(self, entry: Entry, envelope: Envelope, looked: Look | None = None) -> bool:
        """True (entry acknowledged) for a request that is finished or a duplicate run; raises for a
        cancelled or expired one.  The input payload of an entry that will not run is released.
        ``looked``: what the admission's script read for this entry already (a first delivery's); else one
        script reads it (the record, the cancel flag and the run's owner).  Taking the owner key of a
        request that turns out settled is harmless: it names this entry and only expires."""
        rid = envelope.request_id
        if looked is None:
            run = EntryKeys.of(self.keys, rid, self.stage.name, envelope.attempt, entry.id)
            looked = await self.records.look(run, entry.id)
        status = None if looked.status is None else parse_status(looked.status, rid)  # corrupt: dead-lettered
        if status is not None and status.state.terminal:
            log.info("worker.skip_terminal", entry=entry.id, state=status.state.value)
            await self.release_input(envelope)
            await self.stream.ack(entry.id)
            return True
        if looked.cancelled:
            await self.release_input(envelope)
            raise CancelledRequestError("cancelled by the client")
        if envelope.deadline is not None and time.time() > envelope.deadline:
            await self.release_input(envelope)
            raise DeadlineExceededError("the request's deadline passed")
        if not looked.claimed and looked.owner is not None and looked.owner != entry.id:
            log.info("worker.skip_duplicate", entry=entry.id, owner=looked.owner)
            metrics.ENTRIES.labels(self.stage.name, "duplicate").inc()
            await self.stream.ack(entry.id)
            return True
        return False

    async def release_input(self, envelope: Envelope) -> None:
        """A skipped envelope's payload is not needed: let the producer free it now."""
        if self.input_connector is not None:
            await self.input_connector.discard(envelope.payload)

    async def load_media(self, envelope: Envelope) -> dict[str, bytes]:
        """The first stage reads and checks the job's media (bad media is a rejection, not a failure)."""
        if self.index != 0:
            return {}
        limits = self.pipeline.limits
        loaded = await load_media(
            envelope.job,
            redis=self.redis,
            upload_prefix=self.keys.upload(envelope.request_id, ""),
            max_bytes=limits.max_upload_bytes,
            min_audio_s=limits.min_reference_audio_s,
            media_roots=limits.media_roots,
            max_pixels=limits.max_media_pixels,
            max_frames=limits.max_reference_frames,
        )
        return loaded.items
