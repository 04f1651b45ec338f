"""The ``stageferry`` Typer app, its global options, and the one boundary where an expected error
becomes one ``error [code]: message`` line and exit 1."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import anyio
import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console

from stageferry.cli.display import error_line
from stageferry.client import DEFAULT_REDIS_URL, Client
from stageferry.config import Settings
from stageferry.errors import (
    ConfigError,
    expected_error,
    leaf_errors,
)
from stageferry.logs import configure_logging
from stageferry.schemas import RequestStatus


class _Command(typer.core.TyperCommand):
    """Usage lines name arguments plainly (``REQUEST_ID``), not in typer's braces (``{REQUEST_ID}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class _App(typer.Typer):
    """Every command, whoever adds it, gets :class:`_Command`."""

    def command(self, *args: Any, cls: type[typer.core.TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    name="stageferry",
    help="Disaggregated multimodal generation: Redis Streams control plane, NIXL data plane.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: flags show no `<bool>` value, defaults and ranges in brackets
)
#: soft_wrap: lines are never broken by rich (the terminal wraps them), so a long path or an error stays one
#: line that can be copied, and a log scraper reads it whole.
stderr = Console(stderr=True, soft_wrap=True)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Overrides:
    redis_url: str | None
    prefix: str | None
    pipeline: Path | None


@app.callback()
def _global_options(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url",
            metavar="URL",
            help=f"Redis URL, redis://, rediss:// or redis+sentinel:// (env STAGEFERRY_REDIS_URL). Default:"
            f" {DEFAULT_REDIS_URL} for client commands and `gateway`; `up` starts a private server; `serve` needs one.",
        ),
    ] = None,
    prefix: Annotated[
        str | None,
        typer.Option(
            "--prefix",
            metavar="P",
            help="Key prefix (env STAGEFERRY_PREFIX). Default: sf. Allowed: 1-64 of A-Z a-z 0-9 _ . { } -.",
        ),
    ] = None,
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline",
            metavar="FILE",
            help="Pipeline TOML file (env STAGEFERRY_PIPELINE). Default: the built-in encoder TP2 ->"
            " diffusion TP4, fitted to this host's GPUs by up/serve/plan (docs/placement.md).",
        ),
    ] = None,
) -> None:
    ctx.obj = _Overrides(redis_url, prefix, pipeline)


def _settings(ctx: typer.Context) -> Settings:
    """Environment settings with the command line's overrides applied."""
    given = ctx.obj if isinstance(ctx.obj, _Overrides) else _Overrides(None, None, None)
    overrides = {k: v for k, v in dataclasses.asdict(given).items() if v is not None}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        prefix = str(Settings.model_config.get("env_prefix", ""))
        # the setting named as its user set it: a flag given on this command line, else its variable
        where = f"--{field.replace('_', '-')}" if field in overrides else f"{prefix}{field.upper()}"
        raise ConfigError(f"bad settings: {where}: {error['msg']}") from exc


def _expected_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn expected errors into one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BaseException as exc:
            leaves = leaf_errors(exc)  # a task group wraps what its tasks raised
            if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
                typer.echo("interrupted", err=True)
                raise typer.Exit(130) from None
            if (error := expected_error(exc)) is not None:
                typer.echo(error_line(error), err=True)
                raise typer.Exit(1) from None
            if (missing := _missing_extra(leaves)) is not None:
                typer.echo(missing, err=True)
                raise typer.Exit(1) from None
            raise

    return wrapper


#: Top-level modules of the optional extras, and the extra that brings each.
_EXTRA_OF = {
    "torch": "stage", "nixl": "stage", "av": "stage", "numpy": "stage", "PIL": "stage",
    "prometheus_client": "stage", "fastapi": "gateway", "uvicorn": "gateway", "multipart": "gateway",
    "python_multipart": "gateway", "starlette": "gateway",
}  # fmt: skip


def _missing_extra(leaves: list[BaseException]) -> str | None:
    """One line naming the extra to install, when a command needs a module that is not installed."""
    for leaf in leaves:
        if isinstance(leaf, ModuleNotFoundError) and (root := (leaf.name or "").split(".")[0]) in _EXTRA_OF:
            extra = _EXTRA_OF[root]
            return f"error [missing_extra]: this command needs {root}: pip install 'stageferry[{extra}]'"
    return None


def _with_client(ctx: typer.Context, action: Callable[[Client], Awaitable[R]]) -> R:
    """Run ``action`` with a client for the configured deployment, in a fresh event loop."""
    settings = _settings(ctx)
    configure_logging(fmt=settings.log_format, level=settings.log_level, service="cli")

    async def run() -> R:
        async with Client.from_settings(settings) as client:
            return await action(client)

    return anyio.run(run)


def _print_status(status: RequestStatus) -> None:
    typer.echo(status.model_dump_json(indent=2))


# -- job options, shared by `submit` and `up` -------------------------------------------------------------
