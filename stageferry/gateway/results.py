"""Result files: the gateway serves a finished video from where the deployment stores it, and nowhere else.

A request's status names its output (``result.location``), but a status is data in Redis, and data in
Redis is not trusted: a forged or corrupted status may name ``/etc/passwd``.  So a location is only a
*hint*: the gateway serves bytes either from the request's own Redis result key, or from a regular file
inside the deployment's configured output directory (``output_dir`` of the pipeline, or the gateway's
``--output-dir``), opened so that nothing can lead it outside:

- the location must be absolute, already normal (no ``..``, no ``//``) and lexically under the output
  directory, whose real path is fixed when the gateway starts;
- the path is then walked one component at a time from an open descriptor of that directory, every
  component opened with ``O_NOFOLLOW`` (a symlink anywhere on the way, even one swapped in after a
  check, fails the open instead of being followed);
- the last component must be a regular file (``fstat`` on the opened descriptor, not on the name; opened
  ``O_NONBLOCK`` so a FIFO cannot hang a worker thread) whose size is the one the status records.

Anything else is refused (logged with the reason, answered as "not available" so a probe learns nothing
about the host's files).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog

log = structlog.get_logger(__name__)

#: Bytes per read while streaming a result file to a client.
CHUNK_BYTES = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ResultRefused(Exception):
    """A location the gateway will not serve; ``reason`` says why (for the log, never for the client)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class ResultFile:
    """An opened result file; the caller streams it with :meth:`chunks`, which closes it at the end."""

    file: BinaryIO
    size: int

    def chunks(self) -> Iterator[bytes]:
        """The file's bytes in :data:`CHUNK_BYTES` pieces (blocking reads: run it in a thread)."""
        try:
            while chunk := self.file.read(CHUNK_BYTES):
                yield chunk
        finally:
            self.file.close()

    def close(self) -> None:
        self.file.close()


class ResultFiles:
    """Opens result files under one output directory (see the module docstring for the rules)."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        #: Real path, fixed now: a symlink swapped in for the directory later changes nothing.
        self.root = Path(os.path.realpath(output_dir))

    def relative_parts(self, location: str) -> tuple[str, ...]:
        """The components of ``location`` below the output directory; :class:`ResultRefused` otherwise."""
        if not location.startswith("/") or "\x00" in location:
            raise ResultRefused("not an absolute path")
        if os.path.normpath(location) != location:
            raise ResultRefused("not a normal path")
        try:
            parts = Path(location).relative_to(self.root).parts
        except ValueError:
            raise ResultRefused("outside the output directory") from None
        if not parts:
            raise ResultRefused("the output directory itself")
        return parts

    def open(self, location: str, *, expected_bytes: int | None = None) -> ResultFile:
        """Open ``location`` for reading (blocking: call it in a thread); :class:`ResultRefused` when the
        rules forbid it, or it is missing, not a regular file, or not ``expected_bytes`` long."""
        parts = self.relative_parts(location)
        try:
            dir_fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            raise ResultRefused(f"output directory unavailable: {exc.strerror}") from None
        fd = -1
        try:
            for part in parts[:-1]:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dir_fd)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ResultRefused("not a regular file")
            if expected_bytes is not None and info.st_size != expected_bytes:
                raise ResultRefused(f"size {info.st_size} is not the recorded {expected_bytes}")
            os.set_blocking(fd, True)
            result = ResultFile(os.fdopen(fd, "rb"), info.st_size)
            fd = -1  # owned by the file object now
            return result
        except OSError as exc:  # ELOOP/ENOTDIR: a symlink on the way; ENOENT: gone
            raise ResultRefused(f"cannot open: {exc.strerror}") from None
        finally:
            os.close(dir_fd)
            if fd >= 0:
                os.close(fd)


def refuse_logged(request_id: str, location: str, exc: ResultRefused) -> None:
    """Log a refused location once, where operators see forged or stale statuses."""
    log.warning("gateway.result_refused", request_id=request_id, location=location[:300], reason=exc.reason)


__all__ = ["CHUNK_BYTES", "ResultFile", "ResultFiles", "ResultRefused", "refuse_logged"]
