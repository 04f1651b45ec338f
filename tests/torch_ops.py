"""What a step asks of torch: the aten ops it runs, recorded by name (a dispatch mode, nothing replaced)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class TorchOps(TorchDispatchMode):
    """The aten ops run while it is entered, by name (``aten.as_strided.default``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
