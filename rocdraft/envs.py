"""Every environment variable rocdraft reads, in one place.

| variable | meaning | default |
|---|---|---|
| ``ROCDRAFT_ATTENTION_BACKEND`` | attention backend of the target model | platform priority list |
| ``ROCDRAFT_DRAFT_ATTENTION_BACKEND`` | attention backend of the EAGLE head | the target's if it
  can run the draft loop (FULL capture on a GPU), else the first in the priority list that can |
| ``ROCDRAFT_AITER_ASM_LAYOUT`` | on: ROCM_AITER_FA uses aiter's split-K K/V layout | off |
| ``ROCDRAFT_HIP_KERNELS`` | off: never build or load the HIP extension | on |
| ``ROCDRAFT_FUSED_KERNELS`` | off: GPU forwards of the target run the unfused ops instead of
  the fused Triton kernels (models/fused_layers.py; for A/B runs) | on |
| ``ROCDRAFT_CPU_ONEDNN`` | off: CPU float32 linears run torch's BLAS forms instead of oneDNN
  on a packed copy of each weight (models/linear_form.py; read at the first such linear of
  the process) | on |

Switches accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); unset or empty means the
default, anything else is a ``RocdraftError`` naming the variable. A backend variable is a
backend name; ``checked_backend`` refuses an unregistered one, naming the variable.

Functions read the environment when called (not at import), so tests may set variables freely.
"""
from __future__ import annotations

import os
from collections.abc import Collection

from rocdraft.errors import RocdraftError

ATTENTION_BACKEND = "ROCDRAFT_ATTENTION_BACKEND"
DRAFT_ATTENTION_BACKEND = "ROCDRAFT_DRAFT_ATTENTION_BACKEND"
AITER_ASM_LAYOUT = "ROCDRAFT_AITER_ASM_LAYOUT"
HIP_KERNELS = "ROCDRAFT_HIP_KERNELS"
FUSED_KERNELS = "ROCDRAFT_FUSED_KERNELS"
CPU_ONEDNN = "ROCDRAFT_CPU_ONEDNN"
TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")
_SWITCH_DEFAULTS = {AITER_ASM_LAYOUT: False, HIP_KERNELS: True, FUSED_KERNELS: True,
                    CPU_ONEDNN: True}


def attention_backend() -> str | None:
    return os.environ.get(ATTENTION_BACKEND) or None


def draft_attention_backend() -> str | None:
    return os.environ.get(DRAFT_ATTENTION_BACKEND) or None


def describe_source(var: str) -> str:
    """How a message names where a value came from, e.g. ``ROCDRAFT_ATTENTION_BACKEND='X'``."""
    return f"{var}={os.environ.get(var, '')!r}"


def checked_backend(var: str, registered: Collection[str]) -> str | None:
    """The backend name in variable ``var`` (None when unset or empty); a RocdraftError naming
    the variable when it is not one of ``registered``."""
    name = os.environ.get(var) or None
    if name is not None and name not in registered:
        raise RocdraftError(f"{describe_source(var)} is not a registered attention backend; "
                            f"registered: {', '.join(sorted(registered))}")
    return name


def _switch(var: str) -> bool:
    value = os.environ.get(var, "").strip().lower()
    if not value:
        return _SWITCH_DEFAULTS[var]
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise RocdraftError(f"{describe_source(var)} is not a switch; valid: "
                        f"{'/'.join(TRUE_VALUES)} or {'/'.join(FALSE_VALUES)} (any case), "
                        f"or unset for the default ({'on' if _SWITCH_DEFAULTS[var] else 'off'})")


def aiter_asm_layout() -> bool:
    return _switch(AITER_ASM_LAYOUT)


def hip_kernels_enabled() -> bool:
    return _switch(HIP_KERNELS)


def fused_kernels_enabled() -> bool:
    return _switch(FUSED_KERNELS)


def cpu_onednn_enabled() -> bool:
    return _switch(CPU_ONEDNN)


def check_switches() -> None:
    """Read every switch now, so a bad value fails at start-up rather than mid-generation."""
    for var in _SWITCH_DEFAULTS:
        _switch(var)
