"""The gateway's record of a video job it accepted, stored at ``<p>:req-video:<id>`` (JSON, the request's TTL).

Written by :mod:`stageferry.broker.control.video_records` for the gateway, read back to describe, list and
delete the video.  Records written before the version field existed (no ``v``) read as version 1; unknown
fields are ignored, so that a gateway of the previous release reads a newer one's records during a
rolling upgrade.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Version of :class:`VideoMeta`; history: 1 — first (records without ``v`` are version 1).
VIDEO_RECORD_VERSION: Literal[1] = 1


class VideoMeta(BaseModel):
    """What the gateway remembers about a job it accepted (the job itself lives in the stage streams)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = VIDEO_RECORD_VERSION
    model: str
    prompt: str
    size: str | None = None
    seconds: str | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    #: Job field → the form field it came from, so that later errors name what the client sent.
    origin: dict[str, str] = Field(default_factory=dict)
    #: The task that ran (named by the client, or inferred from its upload).
    task: str | None = None
    #: The job's entry in the gateways' video index (:meth:`Keys.video_index`): where ``GET /v1/videos``
    #: resumes after this video.
    index_entry: str | None = None
    #: Set by ``DELETE``: the video is gone (404), the record stays as the list's cursor until it expires.
    deleted_at: int | None = None


__all__ = ["VIDEO_RECORD_VERSION", "VideoMeta"]
