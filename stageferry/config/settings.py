"""Per-process settings from ``STAGEFERRY_*`` environment variables (:class:`Settings`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from stageferry.broker.data.nixl.address import parse_address
from stageferry.config.pipeline import PipelineConfig
from stageferry.schemas.job import TENANT_PATTERN


class Settings(BaseSettings):
    """Per-process settings (``STAGEFERRY_*``)."""

    model_config = SettingsConfigDict(env_prefix="STAGEFERRY_", extra="ignore", use_attribute_docstrings=True)

    redis_url: str | None = None
    """`redis://` or `rediss://` URL (see docs/security.md for TLS and ACL users). Client commands fall back
    to redis://127.0.0.1:6379/0; `up` starts a private server; `serve` requires it."""
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.{}-]{1,64}$")] = "sf"
    """Key prefix: every key lives under `<prefix>:`."""
    pipeline: Path | None = None
    """Pipeline TOML file; unset means the built-in default (docs/configuration.md)."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """json lines, console, or auto (console on a TTY)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    replica: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = Field(
        default_factory=lambda: socket.gethostname()[:48] or "replica"
    )
    """This replica's consumer name, stable across restarts (un-acked entries are re-read first)."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Prometheus metrics port (0: off)."""
    tenant: Annotated[str | None, Field(pattern=TENANT_PATTERN)] = None
    """The tenant a client process submits as (``STAGEFERRY_TENANT``); None: single-tenant."""
    gateway_token: Annotated[str, Field(min_length=8, max_length=512)] | None = None
    """The HTTP gateway's bearer token (``STAGEFERRY_GATEWAY_TOKEN``); unset: no token needed."""
    advertise_address: Annotated[str, AfterValidator(parse_address)] | None = None
    """The IP address NIXL peers reach this stage at (Kubernetes: the pod IP, `status.podIP` from the downward
    API). UCX is held to the interface that has it (`UCX_NET_DEVICES`, unless set) and the agent record
    carries it, so a hop's trace names both ends. Unset: UCX advertises every interface it opens (`up` sets
    127.0.0.1 for its stages, all on one host: an interface that comes or goes meanwhile cannot strand them)."""

    def load_pipeline(self) -> PipelineConfig:
        return PipelineConfig.load(self.pipeline)
