"""Every environment variable rocdraft reads, in one place.

| variable | meaning | default |
|---|---|---|
| ``ROCDRAFT_ATTENTION_BACKEND`` | attention backend of the target model | platform priority list |
| ``ROCDRAFT_DRAFT_ATTENTION_BACKEND`` | attention backend of the EAGLE head | the target's backend |
| ``ROCDRAFT_AITER_ASM_LAYOUT`` | ``1``: ROCM_AITER_FA keeps K/V in aiter's split-K layout | ``0`` |
| ``ROCDRAFT_HIP_KERNELS`` | ``0``: never build or load the HIP extension | ``1`` |

Functions read the environment when called (not at import), so tests may set variables freely.
"""
from __future__ import annotations

import os


def attention_backend() -> str | None:
    return os.environ.get("ROCDRAFT_ATTENTION_BACKEND") or None


def draft_attention_backend() -> str | None:
    return os.environ.get("ROCDRAFT_DRAFT_ATTENTION_BACKEND") or None


def aiter_asm_layout() -> bool:
    return os.environ.get("ROCDRAFT_AITER_ASM_LAYOUT", "0") == "1"


def hip_kernels_enabled() -> bool:
    return os.environ.get("ROCDRAFT_HIP_KERNELS", "1") != "0"
