"""HTTP gateway: vLLM-Omni's ``/v1/videos`` API in front of a stageferry pipeline.

``stageferry gateway --host 0.0.0.0 --port 8091`` serves :func:`create_app` with uvicorn.  Requests are
validated here with the project's own rules, enqueued through the control plane with
:class:`~stageferry.client.Client`, and answered from the request's status and stored result.

Modules: :mod:`.app` (app, lifespan, error handlers), :mod:`.routes`, :mod:`.form` (form → job),
:mod:`.uploads` (streaming multipart with size caps), :mod:`.service` (operations on the pipeline),
:mod:`.objects` (response models), :mod:`.health`, :mod:`.metrics`, :mod:`.errors` (errors → HTTP),
:mod:`.server` (uvicorn).
"""

from stageferry.gateway.app import GatewayConfig, create_app
from stageferry.gateway.server import serve

__all__ = ["GatewayConfig", "create_app", "serve"]
