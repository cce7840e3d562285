"""Which platform this process runs on: ``rocm`` (torch.version.hip set), ``cuda`` or ``cpu``."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    kind: str  # "rocm" | "cuda" | "cpu"
    arch: str | None  # "gfx942" on MI300, "sm_90" on H100/H200, None on the CPU
    device: str  # torch device string: "cuda" on ROCm and CUDA, "cpu" otherwise

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("rocm", "cuda")


def detect_platform() -> Platform:
    """Detect the platform of this process (torch's build and whether a GPU is visible)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if getattr(torch.version, "hip", None):
            # gcnArchName looks like "gfx942:sramecc+:xnack-"; the arch is the part before ':'.
            return Platform("rocm", props.gcnArchName.split(":")[0], "cuda")
        return Platform("cuda", f"sm_{props.major}{props.minor}", "cuda")
    return Platform("cpu", None, "cpu")


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host: through pinned memory with
    ``non_blocking=True`` on GPUs (a pageable copy would wait for queued kernels)."""
    if torch.device(device).type != "cuda":  # CPU: no copy; meta (tests): a plain move
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# The dtype names rocdraft accepts (rocdraft.config.DTYPES) and their torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the name ``TORCH_DTYPES`` maps to ``dtype``."""
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]
