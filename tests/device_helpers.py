"""What a compiled kernel may be asked to do on the GPU these tests run on.

Under the Triton interpreter (the CPU) every fp8 format is emulated, so the kernel tests run
them all. A compiled kernel only runs the formats its backend declares for this GPU (sm_90
has float8_e4m3fn but not the ROCm float8_e4m3fnuz; gfx942 the other way round): a test of an
undeclared format on a GPU is skipped, naming the format, exactly as the engine would refuse
it."""
from __future__ import annotations

import pytest
import torch

from rocdraft.backends import registry
from rocdraft.platform import detect_platform


def require_fp8_cache_here(dtype: torch.dtype, backend_name: str = "TRITON_ATTN") -> None:
    """Skip unless ``dtype`` is not fp8, or the tests run on the CPU, or ``backend_name``
    declares ``dtype`` as a KV-cache format of this GPU."""
    if dtype.itemsize != 1 or not torch.cuda.is_available():
        return
    platform = detect_platform()
    here = registry.get_backend(backend_name).capabilities.kv_cache_dtypes_for(
        platform.kind, platform.arch)
    if dtype not in here:
        pytest.skip(f"{backend_name} declares no {dtype} KV cache on {platform.kind} "
                    f"{platform.arch} (declared here: {[str(d) for d in here]})")
