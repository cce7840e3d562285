"""The few engine-facing steps of tensor parallelism, kept out of the model runner
(rocdraft/engine/model_runner.py).

``start_tensor_parallel`` refuses a size the target cannot split (``check_tensor_parallel``:
tp < 1, not dividing the heads / KV heads / MLP rows, more than the visible GPUs) before any
weight loads, then starts the executor (the workers, or torchrun's group). ``worker_spec``
is what the workers need from the constructed engine: the chosen attention backend and the
KV-cache blocks per rank (planned on rank 0 from the per-rank ``kv_cache_spec``).
"""
from __future__ import annotations

import torch

from rocdraft.distributed.executor import TensorParallelExecutor, start_executor
from rocdraft.distributed.validation import check_tensor_parallel
from rocdraft.distributed.worker import WorkerSpec
from rocdraft.models.config import load_model_config
from rocdraft.platform import dtype_name


def start_tensor_parallel(target: str, tp_size: int, backend: str | None, device: str,
                          timeout_s: float) -> TensorParallelExecutor:
    num_visible_gpus = None if device == "cpu" else torch.cuda.device_count()
    check_tensor_parallel(load_model_config(target), tp_size, num_visible_gpus)
    return start_executor(tp_size, backend, device, timeout_s)


def worker_spec(target: str, tp_size: int, torch_dtype: torch.dtype, device: str,
                attention_backend: str, block_size: int, num_blocks: int) -> WorkerSpec:
    """What the workers need from rank 0 once its target and head are loaded: the target
    directory, dtype and device kind, the chosen attention backend and the KV blocks per rank."""
    return WorkerSpec(
        target=target, dtype=dtype_name(torch_dtype),
        device="cpu" if device == "cpu" else "cuda", attention_backend=attention_backend,
        block_size=block_size, num_blocks=num_blocks,
        num_threads=max(1, torch.get_num_threads() // tp_size))
