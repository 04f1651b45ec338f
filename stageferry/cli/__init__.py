"""The ``stageferry`` command: submit and follow jobs, read traces, run stage services or a whole pipeline.

Global options (``--redis-url``, ``--prefix``, ``--pipeline``) override the ``STAGEFERRY_*`` environment.
Expected errors (every :class:`StageferryError`) print one ``error [code]: message`` line on stderr and
exit 1; a command line that does not parse (``--task foo``) prints one ``error [usage]: ...`` line and
exits 2.  stdout carries only results (request ids, JSON, tables), so that scripts can use it.
"""

import sys

import typer

try:  # typer >= 0.2x carries its own click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import UsageError  # type: ignore[assignment]

from stageferry.cli import ops as _ops  # noqa: F401 - registers the operator commands (after the client ones)
from stageferry.cli.app import app
from stageferry.cli.jobs import build_job, read_job_json, sample_media
from stageferry.cli.ops import job_schema


def main() -> None:
    """Console entry point (``stageferry`` and ``python -m stageferry``)."""
    try:
        code = app(prog_name="stageferry", standalone_mode=False)
    except UsageError as exc:  # click would print a usage block and "Error: ..." on three lines
        where = exc.ctx.command_path if exc.ctx is not None else "stageferry"
        message = exc.format_message().replace("Value error, ", "")
        print(f"error [usage]: {message} (see `{where} --help`)", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("error [interrupted]: aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "build_job", "job_schema", "main", "read_job_json", "sample_media"]
