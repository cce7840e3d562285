"""Shared fixtures. ``attention_backend`` is the backend matrix: every registered backend that
can run on this machine, or only ``ROCDRAFT_ATTENTION_BACKEND`` when that is set (one CI job
per backend runs the same suite)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels can only run in the interpreter here; it must be on before any kernel
    # module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The test models are tiny: one intra-op thread avoids thread oversubscription on small CI
# machines (two threads on two busy cores made a tiny linear 30x slower).
torch.set_num_threads(1)

import rocdraft.backends  # noqa: E402,F401  (registers every backend)
from rocdraft.backends import registry  # noqa: E402
from rocdraft.platform import detect_platform  # noqa: E402


def matrix_backends() -> list[str]:
    chosen = os.environ.get("ROCDRAFT_ATTENTION_BACKEND")
    if chosen:
        return [chosen]
    kind = detect_platform().kind
    return [name for name in registry.registered_names()
            if registry.refusal_reason(registry.get_backend(name), kind) is None]


@pytest.fixture(params=matrix_backends())
def attention_backend(request) -> str:
    """Name of one attention backend of the matrix."""
    return request.param
