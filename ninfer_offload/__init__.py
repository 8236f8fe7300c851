"""ninfer-offload: run Qwen3.6-35B-A3B `.ninfer` artifacts on GPUs too small to hold them.

Public API: `open_artifact`, `ArtifactError`, `Engine`, `LoadRequest` (imported lazily so that light
commands such as `ninfer plan` do not pay for torch).
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "open_artifact": "ninfer_offload.artifact.reader",
    "ArtifactError": "ninfer_offload.artifact.errors",
    "NinferError": "ninfer_offload.errors",
    "Engine": "ninfer_offload.runtime.engine",
    "LoadRequest": "ninfer_offload.planner.request",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ninfer_offload' has no attribute {name!r}")


__all__ = ["open_artifact", "ArtifactError", "NinferError", "Engine", "LoadRequest", "__version__"]
