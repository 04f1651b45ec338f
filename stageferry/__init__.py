"""stageferry: a Redis Streams control plane and a NIXL data plane for disaggregated generation pipelines.

The public surface is exactly ``__all__`` (pinned by ``tests/test_public_api.py``); everything else is
reached through its module (``stageferry.broker``, ``stageferry.schemas``, ...).
"""

from stageferry.client import Client, SyncClient
from stageferry.config import PipelineConfig, Settings
from stageferry.errors import JobValidationError, StageferryError
from stageferry.schemas import JobRequest, RequestState, RequestStatus, Task

__version__ = "0.1.0"

__all__ = [
    "Client",
    "JobRequest",
    "JobValidationError",
    "PipelineConfig",
    "RequestState",
    "RequestStatus",
    "Settings",
    "StageferryError",
    "SyncClient",
    "Task",
    "__version__",
]
