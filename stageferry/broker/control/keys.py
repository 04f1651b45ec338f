"""Every Redis key stageferry uses, in one place, all under one prefix (so an ACL user can be held to it).

A request's keys live in *distinct namespaces* (``req:``, ``req-events:``, ``req-result:``, ...), each
followed by the bare request id.  Request ids cannot contain ``:`` nor glob characters
(:data:`~stageferry.schemas.job.REQUEST_ID_PATTERN`), so no id can name another request's key — the old
``<victim>:cancel`` id that cancelled its victim is impossible — and an ACL key pattern such as
``~sf:req-cancel:acme.*`` reaches exactly one tenant's cancel flags and nothing else.

Written by stages only: ``<p>:req:<id>`` (hash: ``state``, ``status`` JSON, and the stages' own fields:
the entry that owns each run, the crash marks of entries the stage died with; ``entry_records``),
``<p>:req-events:<id>`` (the trace stream), ``<p>:req-result:<id>`` (result bytes, TTL),
``<p>:req-chunks:<id>:<stage index>:<attempt>`` and ``<p>:req-chunk-state:…`` (a streamed payload's chunks),
``<p>:refused:<ticket>`` and ``<p>:refused:<tenant>.<ticket>`` (why the first stage refused a submission),
``<p>:client-keys:sweep`` (whose turn it is to sweep the client-written keys),
the dead-letter streams ``<p>:stage:<stage>:dlq``, heartbeats ``<p>:stage:<stage>:workers`` and the NIXL keys
``<p>:nixl:agent:<name>``, ``<p>:nixl:agents:<stage>``, ``<p>:nixl:claim:<token>``, ``<p>:nixl:resend:<agent>``,
``<p>:nixl:reply:<token>``; by the gateway: ``<p>:req-video:<id>``, ``<p>:gateway:recent`` (a capped stream
of the job ids it accepted, for the web console), ``<p>:gateway:videos`` (the index ``GET /v1/videos``
pages through), ``<p>:req-preview:<id>:<variant>`` and ``<p>:idem:<digest>`` (which request an
``Idempotency-Key`` created, TTL).

Written by clients: ``<p>:req-cancel:<id>`` (cancel flag), ``<p>:req-submitted:<id>`` ("submitted, not yet
picked up" marker, TTL), ``<p>:upload:<id>:<name>`` (media bytes, TTL), and submissions pushed onto the
first stage's intake list ``<p>:stage:<first>:submit`` (a tenant's: ``<p>:stage:<first>:submit:<tenant>``),
which the first stage moves into its stream (:mod:`~stageferry.broker.control.intake`).  Clients write no
stream and not the wake list ``<p>:stage:<stage>:wake`` that idle readers block on.

``stageferry.acl`` turns this table into Redis ACL users; ``docs/security.md`` explains the model.

:data:`KEY_DOCS` says what each key holds; ``scripts/gen_docs.py`` turns it, with each method's name
pattern, into the key table of ``docs/protocol.md`` (a test fails when the committed table drifts).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under ``prefix``."""

    prefix: str

    def stage_stream(self, stage: str) -> str:
        return f"{self.prefix}:stage:{stage}:in"

    def intake(self, stage: str, tenant: str | None = None) -> str:
        """The list clients ``RPUSH`` submissions to (a tenant's own: only that tenant's ACL user may push
        there, so the first stage knows who sent an item from the list it came from)."""
        return f"{self.prefix}:stage:{stage}:submit" + ("" if tenant is None else f":{tenant}")

    def dead_letter(self, stage: str) -> str:
        return f"{self.prefix}:stage:{stage}:dlq"

    def wake(self, stage: str) -> str:
        """A short list our writers push to after each XADD to ``stage``'s stream: idle readers block on it."""
        return f"{self.prefix}:stage:{stage}:wake"

    def workers(self, stage: str) -> str:
        return f"{self.prefix}:stage:{stage}:workers"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:req-events:{request_id}"

    def chunks(self, request_id: str, stage_index: int, attempt: int) -> str:
        """The chunk announcements of a streamed payload from stage ``stage_index`` (:mod:`.chunks`)."""
        return f"{self.prefix}:req-chunks:{request_id}:{stage_index}:{attempt}"

    def chunk_state(self, request_id: str, stage_index: int, attempt: int) -> str:
        return f"{self.prefix}:req-chunk-state:{request_id}:{stage_index}:{attempt}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:req-cancel:{request_id}"

    def submitted(self, request_id: str) -> str:
        """Set by a client right after its push (one pipeline): the request exists before a stage picks it up."""
        return f"{self.prefix}:req-submitted:{request_id}"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:req-result:{request_id}"

    def video_meta(self, request_id: str) -> str:
        """The HTTP gateway's record of a video job (model, prompt, size, seconds), as its API reports it."""
        return f"{self.prefix}:req-video:{request_id}"

    def recent_videos(self) -> str:
        """The gateways' capped list of the jobs they accepted, newest last, for the web console."""
        return f"{self.prefix}:gateway:recent"

    def video_index(self, tenant: str | None = None) -> str:
        """The gateways' index of the video jobs they accepted (``GET /v1/videos``), oldest first."""
        return f"{self.prefix}:gateway:videos" if tenant is None else f"{self.prefix}:gateway:videos:{tenant}"

    def video_preview(self, request_id: str, variant: str) -> str:
        """A finished video's ``thumbnail`` or ``spritesheet`` image, made once by a gateway."""
        return f"{self.prefix}:req-preview:{request_id}:{variant}"

    def upload(self, request_id: str, name: str) -> str:
        return f"{self.prefix}:upload:{request_id}:{name}"

    def client_sweep(self) -> str:
        """Which first-stage replica sweeps the client-written keys now (see ``client_keys``)."""
        return f"{self.prefix}:client-keys:sweep"

    def upload_prefix(self) -> str:
        return f"{self.prefix}:upload:"

    def refused(self, ticket: str, tenant: str | None = None) -> str:
        """Why the first stage refused the submission with ``ticket`` (its submitter's random handle)."""
        tag = ticket if tenant is None else f"{tenant}.{ticket}"
        return f"{self.prefix}:refused:{tag}"

    def idempotency(self, digest: str) -> str:
        """The gateway's record of which request an ``Idempotency-Key`` made (``digest``: of scope and key)."""
        return f"{self.prefix}:idem:{digest}"

    def agent(self, name: str) -> str:
        return f"{self.prefix}:nixl:agent:{name}"

    def agents(self, stage: str) -> str:
        """Which agent each replica of ``stage`` runs now (its consumers connect to them ahead of payloads)."""
        return f"{self.prefix}:nixl:agents:{stage}"

    def claim(self, token: str) -> str:
        return f"{self.prefix}:nixl:claim:{token}"

    def resend(self, agent: str) -> str:
        return f"{self.prefix}:nixl:resend:{agent}"

    def resend_reply(self, token: str) -> str:
        return f"{self.prefix}:nixl:reply:{token}"


#: What each key of :class:`Keys` holds, by method name: the source of the key table in the docs.
KEY_DOCS: dict[str, str | None] = {  # None: a helper choosing among the keys, not a key
    "stage_stream": "stream: the stage's input entries (consumer group `<stage>`)",
    "intake": "list: clients' submissions to the first stage (JSON, `RPUSH` only; `:<tenant>`: a tenant's own), "
    "moved into its stream by the stage",
    "wake": "list: pushed after each XADD by the stages (never by clients); idle workers BLPOP it (at most 16 items)",
    "dead_letter": "stream: entries given up on, with the reason",
    "workers": "hash: replica → last heartbeat (unix seconds)",
    "client_sweep": "string: the first-stage replica whose turn it is to sweep the client-written keys (`SET NX`, "
    "TTL: the sweep interval)",
    "request": "hash: `state` and `status` (JSON RequestStatus); for the stages, the job's digest `job_sha`, "
    "the status's `order`, `ttl_at` (when the record and its events expire, as of their last TTL refresh) "
    "`run:<stage>:<attempt>` (the entry id "
    "that owns that run: dedup of resubmits) and `crash:<stage>:<entry>` (deliveries of that entry its stage "
    "died with: set before the work, cleared after; `<count>` or `<count>:<delivery that counted it>`)",
    "events": (
        "stream: the request's trace (log events `kind=log`, `event`; status changes `kind=status`, `state`, "
        "`status`, and on a terminal one the record's `job_sha`; a first stage's `queued` and `running`, "
        "written together for a job without media, are one row, the `running` one, with the `queued` status "
        "in its field `folded`)"
    ),
    "chunks": "stream: a streamed payload's chunk announcements (JSON `chunk`, inline `blob`), in order, TTL",
    "chunk_state": "hash: a streamed payload's progress: `applied` (highest chunk index the consumer applied), "
    "`taken` (a consumer began), `opened` (handed on), `abandoned`/`stopped` (restarted / given up), TTL",
    "cancel": "string: set when the client cancels",
    "submitted": "string: set by a client right after its push (the request exists before a stage picks it up), TTL",
    "result": "string: the result bytes (e.g. the MP4), with a TTL",
    "video_meta": "string (JSON): the HTTP gateway's record of a video job (model, prompt, size, seconds), "
    "with the request's TTL",
    "recent_videos": "list: the gateways' capped list of the jobs they accepted, newest last (web console)",
    "video_index": "stream: `id` of each video job the gateways accepted, oldest first, trimmed to the request "
    "TTL (`GET /v1/videos`; `<p>:gateway:videos:<tenant>` for a tenant's gateway)",
    "video_preview": "string: a finished video's `thumbnail` (WebP) or `spritesheet` (JPEG), made once, with the "
    "request's TTL",
    "idempotency": "string: the request id an `Idempotency-Key` created at the gateway (versioned JSON), TTL",
    "upload": "string: media bytes uploaded by a client, with a TTL",
    "upload_prefix": "the prefix of every upload key (what a job's `upload_key` must start with)",
    "refused": "hash: why the first stage refused a client's submission, by its ticket "
    "(`<p>:refused:<tenant>.<ticket>` for a tenant)",
    "agent": "hash: NIXL agent record (metadata, incarnation, arenas), TTL heartbeat",
    "agents": "hash: replica id → its current NIXL agent name (consumers connect to those ahead of payloads)",
    "claim": "string: who claimed a payload (or `expired` / `released`), with a TTL",
    "resend": "stream: consumers asking a producer to resend a payload inline",
    "resend_reply": "list: the inline bytes of a resend",
}
