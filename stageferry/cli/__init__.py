"""The ``stageferry`` command: submit and follow jobs, read traces, run stage services or a whole pipeline.

Global options (``--redis-url``, ``--prefix``, ``--pipeline``) override the ``STAGEFERRY_*`` environment.
Expected errors (every :class:`StageferryError`) print one ``error [code]: message`` line on stderr and
exit 1; stdout carries only results (request ids, JSON, tables), so that scripts can use it.
"""

from stageferry.cli import ops as _ops  # noqa: F401 - registers the operator commands (after the client ones)
from stageferry.cli.app import app
from stageferry.cli.jobs import build_job, read_job_json, sample_media
from stageferry.cli.ops import job_schema


def main() -> None:
    """Console entry point (``stageferry`` and ``python -m stageferry``)."""
    app(prog_name="stageferry")


__all__ = ["app", "build_job", "job_schema", "main", "read_job_json", "sample_media"]
