"""Every Redis key stageferry uses, in one place, all under one prefix (so an ACL user can be held to it).

========================================  =====================================================
key                                       what it holds
========================================  =====================================================
``<p>:stage:<stage>:in``                  stream: the stage's input entries (consumer group ``<stage>``)
``<p>:stage:<stage>:dlq``                 stream: entries given up on, with the reason
``<p>:stage:<stage>:workers``             hash: replica → last heartbeat (unix seconds)
``<p>:req:<id>``                          hash: ``state`` and ``status`` (JSON RequestStatus)
``<p>:req:<id>:events``                   stream: the request's trace (log events, status changes)
``<p>:req:<id>:run:<stage>:<attempt>``    string: the entry id that owns this run (dedup of resubmits)
``<p>:req:<id>:cancel``                   string: set when the client cancels
``<p>:req:<id>:result``                   string: the result bytes (e.g. the MP4), with a TTL
``<p>:upload:<id>:<name>``                string: media bytes uploaded by a client, with a TTL
``<p>:nixl:agent:<name>``                 hash: NIXL agent record (metadata, incarnation, arenas), TTL heartbeat
``<p>:nixl:claim:<token>``                string: who claimed a payload (or ``expired``), with a TTL
``<p>:nixl:resend:<agent>``               stream: consumers asking a producer to resend a payload inline
``<p>:nixl:reply:<token>``                list: the inline bytes of a resend
========================================  =====================================================
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under ``prefix``."""

    prefix: str

    def stage_stream(self, stage: str) -> str:
        return f"{self.prefix}:stage:{stage}:in"

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
        return f"{self.prefix}:req:{request_id}:events"

    def run_owner(self, request_id: str, stage: str, attempt: int) -> str:
        return f"{self.prefix}:req:{request_id}:run:{stage}:{attempt}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:cancel"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:result"

    def video_meta(self, request_id: str) -> str:
        """The HTTP gateway's record of a video job (model, prompt, size, seconds), as its API reports it."""
        return f"{self.prefix}:req:{request_id}:video"

    def upload(self, request_id: str, name: str) -> str:
        return f"{self.prefix}:upload:{request_id}:{name}"

    def upload_prefix(self) -> str:
        return f"{self.prefix}:upload:"

    def agent(self, name: str) -> str:
        return f"{self.prefix}:nixl:agent:{name}"

    def claim(self, token: str) -> str:
        return f"{self.prefix}:nixl:claim:{token}"

    def resend(self, agent: str) -> str:
        return f"{self.prefix}:nixl:resend:{agent}"

    def resend_reply(self, token: str) -> str:
        return f"{self.prefix}:nixl:reply:{token}"
