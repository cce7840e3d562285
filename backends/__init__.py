"""Attention backends. Importing this package registers every backend; vendor packages
(aiter, flash_attn) are imported lazily inside their backend only."""
from rocdraft.backends import torch_sdpa  # noqa: F401  (registers TORCH_SDPA)
from rocdraft.backends import cpu_attn  # noqa: F401
from rocdraft.backends import triton_attn  # noqa: F401
from rocdraft.backends import aiter_fa, flash_attn  # noqa: F401
from rocdraft.backends.registry import (get_backend, registered_names,  # noqa: F401
                                        select_backend, select_draft_backend)
