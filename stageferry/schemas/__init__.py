"""Wire formats, defined once: every other module imports them from here.

The conditioning payload contract and its layout (``payload_contract``, ``payload_layout``) describe
tensors and need torch: import them from their modules, so that a client importing the schemas does not
load torch.
"""

from stageferry.schemas.envelope import ENVELOPE_VERSION, Envelope, TraceContext, request_key
from stageferry.schemas.job import JobRequest, MediaInputs, MediaRef, Task
from stageferry.schemas.payload import (
    MANIFEST_VERSION,
    DeviceKind,
    DType,
    InlinePayload,
    Manifest,
    MemKind,
    NixlPayload,
    NoPayload,
    PayloadRef,
    RegionSpec,
    RemoteRegion,
    TensorSpec,
)
from stageferry.schemas.status import (
    TERMINAL_STATES,
    ErrorInfo,
    OutputInfo,
    Progress,
    RequestState,
    RequestStatus,
    StageTiming,
    Transport,
)

__all__ = [
    "ENVELOPE_VERSION",
    "MANIFEST_VERSION",
    "TERMINAL_STATES",
    "DType",
    "DeviceKind",
    "Envelope",
    "ErrorInfo",
    "InlinePayload",
    "JobRequest",
    "Manifest",
    "MediaInputs",
    "MediaRef",
    "MemKind",
    "NixlPayload",
    "NoPayload",
    "OutputInfo",
    "PayloadRef",
    "Progress",
    "RegionSpec",
    "RemoteRegion",
    "RequestState",
    "RequestStatus",
    "StageTiming",
    "Task",
    "TensorSpec",
    "TraceContext",
    "Transport",
    "request_key",
]
