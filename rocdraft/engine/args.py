"""``EngineArgs``: every argument of ``LLMEngine`` / ``LLM``, validated once before anything
loads (the engine's constructor and the CLI's option parsing build the same object, so a bad
value gets the same message from both).

Checked here, in this order: the integer sizes, the environment switches, ``compile`` (and
its refusal under tensor parallelism), a draft head without a speculative config, the device
(``cuda`` without a visible GPU), the KV-cache sizing settings, and a tree config (a named
target or draft backend without TREE_DRAFTING, a tree larger than the verification
buffers). The model directories and the backends' availability are checked when they load
(rocdraft/engine/model_runner.py, rocdraft/engine/loading.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rocdraft import envs
from rocdraft.backends import registry
from rocdraft.backends.base import Feature
from rocdraft.config import EngineConfig, SpeculativeConfig, check_int
from rocdraft.core.kv_budget import check_sizing
from rocdraft.distributed.group import DEFAULT_TIMEOUT_S
from rocdraft.errors import RocdraftError
from rocdraft.models.compiled_regions import compile_backend
from rocdraft.models.mtp_loader import check_mtp_target
from rocdraft.platform import detect_platform

GRAPH_MODES = ("auto", "replay-eagerly")


@dataclass(frozen=True)
class EngineArgs:
    """The arguments of ``LLMEngine`` (positional order as there).

    KV-cache size (rocdraft/core/kv_budget.py): ``num_kv_blocks``, or ``kv_cache_memory``
    bytes ("2GiB"), or ``gpu_memory_utilization`` (a fraction of the free GPU memory), or by
    default what ``max_num_seqs`` x ``max_model_len`` needs, capped (256 MiB on the CPU); the
    draft head's cache shares the same budget (per rank under tensor parallelism).

    ``tensor_parallel_size`` N > 1 runs the target sharded over N processes (this one is
    rank 0; rocdraft/distributed/executor.py starts the others, or torchrun did);
    ``distributed_backend`` gloo | nccl (default nccl on GPUs, gloo on the CPU);
    ``distributed_timeout_s`` bounds every collective.

    ``compile`` True (inductor) or a backend name ("inductor", "aot_eager", "eager") runs the
    dense halves of every target and head block through ``torch.compile``
    (models/compiled_regions.py: off by default, it lost on the CPU).

    ``graph_mode`` "auto": the draft loop is captured in CUDA/HIP graphs where the backend
    and device allow (never on the CPU); "replay-eagerly": the graph runners are built
    wherever drafting runs and replay their static buffers eagerly when capture is refused
    (the CPU path that proves padded, bucketed execution equals unpadded).

    ``enforce_eager``: capture nothing, neither the target forward
    (rocdraft/engine/target_graphs.py) nor the draft loop (as
    ``SpeculativeConfig.enforce_eager`` does for the draft loop alone).

    ``sync_timing``: synchronise a GPU at each phase boundary so the stats' time split is
    exact (benchmarks), at the cost of host syncs.

    ``async_scheduling``: launch each step before the previous one's tokens reach the host
    (rocdraft/engine/overlap.py): target-only decode steps, and the steps of a chain
    config. None (default): on a GPU for those engines at tensor-parallel size 1, off on the
    CPU (where nothing overlaps); True requires one of them at tensor-parallel size 1 (a
    tree config's next tree follows the accepted path on the host; unpadded drafting reads
    host seq lens that a step launched ahead only bounds; the workers' inputs are sent from
    the host)."""

    target: str
    draft: str | None = None
    speculative_config: SpeculativeConfig | None = None
    dtype: str = "float32"
    device: str | None = None  # resolved here: the platform's device when None
    attention_backend: str | None = None
    draft_attention_backend: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | float | str | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    distributed_backend: str | None = None
    distributed_timeout_s: float = DEFAULT_TIMEOUT_S
    compile: bool | str = False
    graph_mode: str = "auto"
    enforce_eager: bool = False
    sync_timing: bool = False
    async_scheduling: bool | None = None
    config: EngineConfig = field(init=False, repr=False)  # the model-facing subset

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "num_kv_blocks",
                     "max_model_len"):
            check_int(name, getattr(self, name), minimum=1,
                      optional=name in ("num_kv_blocks", "max_model_len"))
        envs.check_switches()
        if compile_backend(self.compile) is not None and self.tensor_parallel_size != 1:
            raise RocdraftError(f"compile={self.compile!r} with tensor_parallel_size "
                                f"{self.tensor_parallel_size} is not supported (the compiled "
                                f"block tail would hold the row-parallel all-reduce); drop one")
        if self.draft and self.speculative_config is None:
            raise RocdraftError("a draft head was given without speculative_config; pass "
                                "SpeculativeConfig(method='eagle' or 'eagle3', ...)")
        if self.graph_mode not in GRAPH_MODES:
            raise RocdraftError(f"unknown graph_mode {self.graph_mode!r}; valid: {GRAPH_MODES}")
        for name in ("sync_timing", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise RocdraftError(f"{name} must be True or False, got "
                                    f"{getattr(self, name)!r}")
        check_async_scheduling(self.async_scheduling, self.speculative_config,
                               self.tensor_parallel_size)
        platform = detect_platform()
        device = self.device or platform.device
        if isinstance(device, str) and device.startswith("cuda") and not platform.is_gpu:
            raise RocdraftError(f"device {device!r} requested but no GPU is visible; use cpu")
        object.__setattr__(self, "device", device)
        check_sizing(self.num_kv_blocks, self.kv_cache_memory, self.gpu_memory_utilization,
                     on_gpu=device != "cpu")
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method == "mtp":
            check_mtp_target(self.target, self.tensor_parallel_size)
        tree = spec.draft_tree() if isinstance(spec, SpeculativeConfig) else None
        if tree is not None:
            check_tree(spec, tree, self.attention_backend, self.draft_attention_backend,
                       self.max_num_batched_tokens, self.max_model_len)
        object.__setattr__(self, "config", EngineConfig(
            target=self.target, draft=self.draft, speculative=spec, dtype=self.dtype,
            device=device, attention_backend=self.attention_backend,
            draft_attention_backend=self.draft_attention_backend))

    @property
    def head_dir(self) -> str | None:
        """Where the draft head's weights are: the head directory, or for method "mtp" the
        target's own (its MTP layers, models/mtp_loader.py)."""
        spec = self.speculative_config
        return self.target if spec is not None and spec.method == "mtp" else self.draft

    @property
    def eager(self) -> bool:
        """Nothing is captured: ``enforce_eager`` here or in the speculative config."""
        spec = self.speculative_config
        return self.enforce_eager or (spec is not None and spec.enforce_eager)

    @property
    def compile_backend(self) -> str | None:
        """The torch.compile backend of ``compile`` (None: eager)."""
        return compile_backend(self.compile)


def async_speculation_error(speculative_config) -> str | None:
    """Why steps of this speculative config cannot be launched ahead of the host, or None
    (no speculation, or a chain config with padded drafting)."""
    if speculative_config is None:
        return None
    if speculative_config.draft_tree() is not None:
        return ("a tree config's steps run synchronously (the next step's tree follows "
                "the accepted path), so drop the tree or async_scheduling")
    if not speculative_config.padded_drafting:
        return ("padded_drafting=False drops rejected tokens on the host (a read of the step "
                "just launched) and sizes the head's step from host seq lens, which a step "
                "launched ahead only bounds; keep padded_drafting or drop async_scheduling")
    return None


def check_async_scheduling(value, speculative_config, tensor_parallel_size: int) -> None:
    """Refuse ``async_scheduling`` that is not None/True/False, or True where it cannot run:
    with a speculative config whose steps cannot run ahead, or tensor parallelism (the
    error says why)."""
    if value is not None and not isinstance(value, bool):
        raise RocdraftError(f"async_scheduling must be None (auto), True or False, got "
                            f"{value!r}")
    reason = async_speculation_error(speculative_config)
    if value and reason is not None:
        raise RocdraftError(f"async_scheduling=True: {reason}")
    if value and tensor_parallel_size != 1:
        raise RocdraftError(f"async_scheduling=True with tensor_parallel_size "
                            f"{tensor_parallel_size} is not supported (the workers' inputs "
                            f"are sent from the host before the step's tokens are known)")


def check_tree(spec: SpeculativeConfig, tree, attention_backend: str | None,
               draft_attention_backend: str | None, max_num_batched_tokens: int,
               max_model_len: int | None) -> None:
    """Refuse a tree config before any weight loads: a named target or draft backend without
    TREE_DRAFTING (verification and per-level drafting need the tree mask; the error names
    the backends that have it), or a tree larger than the verification buffers."""
    for role, name in (("target", attention_backend or envs.attention_backend()),
                       ("draft", draft_attention_backend or envs.draft_attention_backend())):
        if name:
            registry.require(name, Feature.TREE_DRAFTING, f"{spec.tree_kind} tree drafting "
                             f"needs a tree mask in the {role} backend")
    verified = tree.num_nodes + 1
    for name, limit in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if limit is not None and verified > limit:
            raise RocdraftError(f"the {spec.tree_kind} tree verifies {verified} tokens per "
                                f"request (root + {tree.num_nodes} nodes), more than {name} "
                                f"{limit}; use a smaller tree or raise {name}")
