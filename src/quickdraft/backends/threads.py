"""The cores a runtime beside torch (OpenVINO, OpenVINO GenAI, llama.cpp) computes on.

Each runtime keeps a pool of worker threads, and so does torch: its OpenMP workers spin for a while
after every parallel region, so on a CPU with few cores they take cycles from the runtime's forward
that follows. A pipeline on such a runtime therefore sets torch to one thread
(:func:`yield_torch_threads`) — the engine's own torch work per step (sampling, verification over
``[B, K+1, V]``) is small next to a forward — and gives the runtime the thread count torch had
before (:func:`runtime_threads`), however many pipelines the process loads and in whatever order.
"""

from __future__ import annotations

import torch

#: torch's thread count before :func:`yield_torch_threads` first set it to one
_TORCH_THREADS: int | None = None


def yield_torch_threads() -> int:
    """Set torch to one thread and return :func:`runtime_threads` (the count torch had before the
    first call, on every call)."""
    global _TORCH_THREADS
    if _TORCH_THREADS is None:
        _TORCH_THREADS = max(1, torch.get_num_threads())
    torch.set_num_threads(1)
    return _TORCH_THREADS


def runtime_threads() -> int:
    """Inference threads for a runtime: torch's thread count, as it was before
    :func:`yield_torch_threads` set it to one (torch's current count where nothing has yielded)."""
    return _TORCH_THREADS if _TORCH_THREADS is not None else max(1, torch.get_num_threads())
