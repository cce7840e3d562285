"""Shared fixtures. ``attention_backend`` is the backend matrix: every registered backend that
can run on this machine, or only ``ROCDRAFT_ATTENTION_BACKEND`` when that is set (one CI job
per backend runs the same suite)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1") if not __import__("torch").cuda.is_available() \
    else None

import rocdraft.backends  # noqa: E402  (registers every backend)
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
