"""A client's submission: one item a client ``RPUSH``es onto the first stage's intake list.

Clients do not write stage streams (their ACL user may not ``XADD``: a client choosing stream ids or
``MAXLEN`` could stop or trim everyone's queue).  A submission is a JSON object pushed onto
``<p>:stage:<first>:submit`` (a tenant's: ``<p>:stage:<first>:submit:<tenant>``); the first stage's leader
moves items from there into its stream with ids Redis chooses
(:mod:`stageferry.broker.control.intake`)::

    {"v": 1, "ticket": "<32 lowercase hex>", "request_id": "my-1", "job": {"prompt": "...", ...}}

* ``v`` — this schema's version (:data:`SUBMISSION_VERSION`);
* ``ticket`` — 128 random bits the submitter chose (e.g. ``uuid4().hex``): the handle under which the
  first stage records why it refused the submission (``<p>:refused:<ticket>``; a tenant's:
  ``<p>:refused:<tenant>.<ticket>``).  Only its submitter knows it.  The mover reads it from the item's
  first :data:`TICKET_WINDOW` bytes (write it before the job), so that even an item too large to be
  moved gets its refusal;
* ``request_id`` — the request's id (:data:`~stageferry.schemas.job.REQUEST_ID_PATTERN`);
* ``job`` — the job (:class:`~stageferry.schemas.job.JobRequest`'s fields).

Nothing else: no attempt, deadline or stage (the first stage sets those), no other field.

Version history: 1 — first.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from stageferry.schemas.job import Frozen

#: Version of :class:`Submission`.
SUBMISSION_VERSION: Literal[1] = 1
#: A ticket: 32 lowercase hex digits (128 bits, e.g. ``uuid.uuid4().hex``).
TICKET_PATTERN = r"^[0-9a-f]{32}$"
#: How many leading bytes of an item the mover searches for its ticket (``"ticket":"<hex>"``).
TICKET_WINDOW = 512
_TICKET = re.compile(TICKET_PATTERN)


class Submission(Frozen):
    """One intake item (see the module docstring)."""

    v: Literal[1] = SUBMISSION_VERSION
    ticket: Annotated[str, Field(pattern=TICKET_PATTERN)]
    """128 random bits in hex, chosen by the submitter: where its refusal, if any, is recorded."""
    request_id: str
    """The request id (checked against the id rule by the first stage, which refuses a bad one under the
    ticket: the id may be someone else's)."""
    job: dict[str, Any]
    """The job's fields (validated by the first stage as :class:`~stageferry.schemas.job.JobRequest`)."""


def new_ticket() -> str:
    """A fresh ticket (128 random bits)."""
    return uuid.uuid4().hex


def is_ticket(text: str) -> bool:
    return _TICKET.fullmatch(text) is not None


def submission_item(ticket: str, request_id: str, job_json: str) -> bytes:
    """The intake item for a job already serialised as JSON (the ticket first, inside the mover's window)."""
    head = json.dumps({"v": SUBMISSION_VERSION, "ticket": ticket, "request_id": request_id}, separators=(",", ":"))
    return f'{head[:-1]},"job":{job_json}}}'.encode()


__all__ = [
    "SUBMISSION_VERSION",
    "TICKET_PATTERN",
    "TICKET_WINDOW",
    "Submission",
    "is_ticket",
    "new_ticket",
    "submission_item",
]
