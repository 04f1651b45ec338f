"""The same-GPU handle: how a producer lets a consumer on its own GPU map its CUDA pool arena.

When producer and consumer run on one GPU (what the planner does on a one-GPU host), a payload need not
go through the transport at all: the consumer maps the producer's CUDA pool arena once (CUDA IPC) and
copies a payload's regions device to device (:mod:`stageferry.broker.data.nixl.same_gpu`).  The producer
exports the arena once, at start-up, with torch's own CUDA IPC export (what
``torch.multiprocessing.reductions`` sends for a CUDA tensor: the memory handle, the storage's size and
offset in its allocation, torch's reference-counter file and offset, the event handle), and publishes it
in its agent record (field ``cuda_ipc``, JSON of :class:`CudaIpcArena`) beside ``gpu_uuid``.  Nothing is
pickled: every part is plain bytes (hex) or ints, validated here.

A consumer uses it only when the record's ``gpu_uuid`` is the UUID of its own GPU, and only for
regions inside the arena (checked again per payload, after the lease seal).  torch maps the reference-counter
file the record names and, when the mapping is dropped, counts down the int64 at its offset: so the name
must be one torch makes for such a file (``/torch_<pid>_<random>_<n>``, a shared-memory object) and the
offset inside it (:data:`REF_COUNTER_SLOTS`), or a record could have a consumer map any shared-memory
object and write into it.

Version history:
  1 — first version.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, ValidationError, field_validator

from stageferry.errors import HandshakeError
from stageferry.schemas import json_text
from stageferry.schemas.job import Frozen

CUDA_IPC_VERSION = 1
GPU_UUID = r"^GPU-[0-9a-fA-F-]{8,64}$"
_HEX = r"^([0-9a-f]{2}){1,512}$"
MAX_FIELD_BYTES = 4096
#: torch's reference-counter files: their names (``at::NewProcessWideShmHandle``) and their int64 slots
#: (``CUDA_IPC_REF_COUNTER_FILE_SIZE``).
REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}(_[0-9]{1,20}){1,2}")
REF_COUNTER_SLOTS = 10000


class CudaIpcArena(Frozen):
    """A producer's CUDA pool arena, exported for consumers on the same GPU."""

    version: Annotated[int, Field(ge=0)] = CUDA_IPC_VERSION
    gpu_uuid: Annotated[str, Field(pattern=GPU_UUID)]
    """The GPU the arena lives on (``GPU-…``, as ``nvidia-smi -L`` prints it)."""
    address: Annotated[int, Field(ge=0, lt=2**64)]
    """The arena's address in the producer (its agent record's VRAM arena): regions are relative to it."""
    length: Annotated[int, Field(gt=0, le=2**40)]
    tensor_offset: Annotated[int, Field(ge=0, le=2**40)]
    """Where the arena starts inside the exported storage, in bytes."""
    handle: Annotated[str, Field(pattern=_HEX)]
    storage_size: Annotated[int, Field(gt=0, le=2**41)]
    storage_offset: Annotated[int, Field(ge=0, le=2**41)]
    ref_counter_handle: Annotated[str, Field(pattern=_HEX)]
    ref_counter_offset: Annotated[int, Field(ge=0, lt=REF_COUNTER_SLOTS)]
    event_handle: Annotated[str, Field(pattern=r"^([0-9a-f]{2}){0,512}$")] = ""
    event_sync_required: bool = False

    @field_validator("ref_counter_handle")
    @classmethod
    def _torch_ref_counter(cls, value: str) -> str:
        if not REF_COUNTER_NAME.fullmatch(bytes.fromhex(value)):
            raise ValueError("not the name of a torch reference-counter file")
        return value

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: bytes | str) -> CudaIpcArena:
        """Parse a record's ``cuda_ipc`` field: the version first; anything malformed or of another version
        is a :class:`HandshakeError` (the consumer then uses the transport)."""
        if len(raw) > MAX_FIELD_BYTES:
            raise HandshakeError("cuda_ipc field is too large", bytes=len(raw))
        try:
            data = json_text.loads(raw)
        except ValueError as exc:
            raise HandshakeError(f"cuda_ipc field is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("version") != CUDA_IPC_VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise HandshakeError(f"cuda_ipc field of version {version!r}, this process reads {CUDA_IPC_VERSION}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise HandshakeError(f"cuda_ipc field is malformed: {exc.error_count()} error(s)") from exc
