"""User-facing configuration: frozen dataclasses validated at construction."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

from rocdraft.errors import RocdraftError

METHODS = ("eagle", "eagle3", "mtp")  # mtp: the target's own draft layers (models/mtp.py)
MAX_SPECULATIVE_TOKENS = 16
DRAFT_POLICIES = ("cost", "fixed")
DTYPES = ("float32", "bfloat16", "float16")
DRAFT_COST_FIELDS = ("target_fixed", "target_per_token", "head_fixed", "head_per_token",
                     "draft_step")


def _kind(value) -> str:
    return type(value).__name__


def check_int(name: str, value, minimum: int | None = None, optional: bool = False) -> int | None:
    """``value`` as an int (an integral number, not a bool) of at least ``minimum``; None
    passes when ``optional``. A RocdraftError naming ``name`` and the value otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "an integer or None" if optional else "an integer"
        raise RocdraftError(f"{name} must be {what}, got {value!r} ({_kind(value)})")
    if minimum is not None and value < minimum:
        raise RocdraftError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(name: str, value) -> float:
    """``value`` as a finite float (a real number, not a bool); NaN and infinities refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RocdraftError(f"{name} must be a real number, got {value!r} ({_kind(value)})")
    if not math.isfinite(value):
        raise RocdraftError(f"{name} must be finite, got {value}")
    return float(value)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise RocdraftError(f"{name} must be True or False, got {value!r} ({_kind(value)})")


def _check_str(name: str, value, optional: bool = False, path: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, str) or (path and isinstance(value, os.PathLike)):
        return
    what = "a string" + (" or path" if path else "") + (" or None" if optional else "")
    raise RocdraftError(f"{name} must be {what}, got {value!r} ({_kind(value)})")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1.0 disable those filters; seed makes
    the request's random stream reproducible regardless of its batch neighbours.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        temperature = _check_real("temperature", self.temperature)
        if not temperature >= 0.0:
            raise RocdraftError(f"temperature must be >= 0, got {self.temperature}")
        top_p = _check_real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise RocdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = check_int("top_k", self.top_k)
        if top_k < -1:
            raise RocdraftError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        max_tokens = check_int("max_tokens", self.max_tokens, minimum=1)
        seed = check_int("seed", self.seed, optional=True)
        _check_bool("ignore_eos", self.ignore_eos)
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            raise RocdraftError(f"stop_token_ids must be a sequence of token ids, got {stop!r} "
                                f"({_kind(stop)})")
        stop = tuple(check_int(f"stop_token_ids[{i}]", t, minimum=0) for i, t in enumerate(stop))
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                            ("max_tokens", max_tokens), ("seed", seed),
                            ("stop_token_ids", stop)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE speculative decoding: ``method`` picks the head format the drafter expects."""

    method: str = "eagle3"
    num_speculative_tokens: int = 4
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS
    enforce_eager: bool = False  # True: never capture the draft loop in a CUDA/HIP graph
    padded_drafting: bool = True  # False: drop rejected tokens on the host (unpadded path)
    # Cap on the draft tokens verified per step over the whole batch: each request verifies
    # min(k, cap // num_requests) drafts, so extra verification compute stays bounded as the
    # batch grows (speculation pays less at large batches). None: always k.
    max_draft_tokens_per_step: int | None = None
    # How many of those drafts each request verifies per step (rocdraft/spec_decode/cost_model.py):
    # "cost" picks the count maximising expected tokens per second from the target's and the
    # head's measured costs and running acceptance rates; "fixed" always verifies the maximum.
    draft_policy: str = "cost"
    # Given step costs in seconds instead of measuring them (deterministic choices):
    # (target_fixed, target_per_token, head_fixed, head_per_token, draft_step), used at every
    # batch size. None: measured once per batch bucket on dummy inputs.
    draft_costs: tuple[float, ...] | None = None
    acceptance_prior: float = 0.7  # conditional acceptance rate assumed before any is seen
    # The dtype the EAGLE head computes in (its weights, activations and KV cache): None, the
    # engine's dtype. Drafts only propose and the target verifies every one, so the output
    # is the target's whatever the head's dtype: "bfloat16" beside a float32 target halves
    # the bytes the head reads per draft (docs/performance.md). Not for MTP layers, which
    # share the target's embedding and lm_head.
    draft_dtype: str | None = None
    # Tree drafting (issue 13), at most one of the two; num_speculative_tokens keeps meaning
    # the chain length. Static: the seed's string format, "[(0,), (1,), (0, 0)]" (or the
    # parsed nodes), validated by drafter.tree_spec. Dynamic (EAGLE-2): all three of depth,
    # top_k (children per frontier node, and frontier width) and total_tokens (the root plus
    # the nodes kept). Validated here; with max_draft_tokens_per_step, the batch budget.
    speculative_token_tree: str | tuple | None = None
    tree_depth: int | None = None
    tree_top_k: int | None = None
    tree_total_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.draft_policy, str) or self.draft_policy not in DRAFT_POLICIES:
            raise RocdraftError(f"unknown draft_policy {self.draft_policy!r}; valid: "
                                f"{DRAFT_POLICIES}")
        prior = _check_real("acceptance_prior", self.acceptance_prior)
        if not 0.0 <= prior <= 1.0:
            raise RocdraftError(f"acceptance_prior must be in [0, 1], got {prior}")
        object.__setattr__(self, "acceptance_prior", prior)
        if self.draft_costs is not None:
            costs = self.draft_costs
            if isinstance(costs, (str, bytes)) or not hasattr(costs, "__iter__") \
                    or len(costs) != len(DRAFT_COST_FIELDS):
                raise RocdraftError(f"draft_costs must be None or {len(DRAFT_COST_FIELDS)} "
                                    f"seconds {DRAFT_COST_FIELDS}, got {costs!r}")
            costs = tuple(_check_real(f"draft_costs[{i}] ({name})", c)
                          for i, (name, c) in enumerate(zip(DRAFT_COST_FIELDS, costs)))
            if min(costs) < 0 or costs[0] + costs[1] <= 0:
                raise RocdraftError(f"draft_costs must be >= 0 with a positive target cost, "
                                    f"got {costs}")
            object.__setattr__(self, "draft_costs", costs)
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise RocdraftError(f"unknown speculative method {self.method!r}; valid: {METHODS}")
        if self.draft_dtype is not None:
            if not isinstance(self.draft_dtype, str) or self.draft_dtype not in DTYPES:
                raise RocdraftError(f"unknown draft_dtype {self.draft_dtype!r}; valid: None "
                                    f"(the engine's dtype) or one of {DTYPES}")
            if self.method == "mtp":
                raise RocdraftError(f"draft_dtype {self.draft_dtype!r} was given with method "
                                    f"'mtp', whose layers share the target's embedding and "
                                    f"lm_head and run in the engine's dtype; drop draft_dtype")
        for name, minimum, optional in (("max_speculative_tokens", 1, False),
                                        ("max_draft_tokens_per_step", 1, True),
                                        ("num_speculative_tokens", None, False)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum,
                                                     optional))
        _check_bool("enforce_eager", self.enforce_eager)
        _check_bool("padded_drafting", self.padded_drafting)
        if not 1 <= self.num_speculative_tokens <= self.max_speculative_tokens:
            raise RocdraftError(f"num_speculative_tokens must be in "
                                f"[1, {self.max_speculative_tokens}], "
                                f"got {self.num_speculative_tokens}")
        self._check_tree()

    def _check_tree(self) -> None:
        """Validate the tree fields; a static tree is stored as its BFS-ordered nodes."""
        dynamic = {name: getattr(self, name)
                   for name in ("tree_depth", "tree_top_k", "tree_total_tokens")}
        given = [name for name, value in dynamic.items() if value is not None]
        if self.speculative_token_tree is not None and given:
            raise RocdraftError(f"speculative_token_tree (a static tree) and {', '.join(given)} "
                                f"(a dynamic tree) were both given; choose one")
        if self.speculative_token_tree is not None:
            from rocdraft.drafter.tree_spec import parse_token_tree

            nodes = parse_token_tree(self.speculative_token_tree, self.max_speculative_tokens)
            object.__setattr__(self, "speculative_token_tree", nodes)
            return
        if not given:
            return
        missing = [name for name in dynamic if name not in given]
        if missing:
            raise RocdraftError(f"a dynamic tree needs tree_depth, tree_top_k and "
                                f"tree_total_tokens; missing {', '.join(missing)}")
        depth = check_int("tree_depth", self.tree_depth, minimum=1)
        top_k = check_int("tree_top_k", self.tree_top_k, minimum=1)
        total = check_int("tree_total_tokens", self.tree_total_tokens, minimum=2)
        if depth > self.max_speculative_tokens:
            raise RocdraftError(f"tree_depth {depth} > max_speculative_tokens "
                                f"{self.max_speculative_tokens}")
        from rocdraft.drafter.tree_math import dynamic_tree_num_candidates

        candidates = dynamic_tree_num_candidates(depth, top_k)
        if total - 1 > candidates:
            raise RocdraftError(f"tree_total_tokens {total} keeps {total - 1} nodes but depth "
                                f"{depth} x top_k {top_k} creates only {candidates} candidates")
        for name, value in (("tree_depth", depth), ("tree_top_k", top_k),
                            ("tree_total_tokens", total)):
            object.__setattr__(self, name, value)

    @property
    def tree_kind(self) -> str | None:
        """"static", "dynamic", or None for chain drafting."""
        if self.speculative_token_tree is not None:
            return "static"
        return "dynamic" if self.tree_depth is not None else None

    def draft_tree(self):
        """The tree shape (drafter.tree_spec.StaticTree or DynamicTree), None for a chain."""
        from rocdraft.drafter.tree_spec import DynamicTree, StaticTree

        if self.speculative_token_tree is not None:
            return StaticTree(self.speculative_token_tree)
        if self.tree_depth is not None:
            return DynamicTree(self.tree_depth, self.tree_top_k, self.tree_total_tokens)
        return None


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 512
    num_lookahead_tokens: int = 0  # extra slots per request for draft steps past the batch

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "num_blocks", "num_lookahead_tokens"):
            minimum = 0 if name == "num_lookahead_tokens" else 1
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class EngineConfig:
    target: str
    draft: str | None = None
    speculative: SpeculativeConfig | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str | None = None
    draft_attention_backend: str | None = None

    def __post_init__(self) -> None:
        _check_str("target", self.target, path=True)
        _check_str("draft", self.draft, optional=True, path=True)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise RocdraftError(f"speculative must be a SpeculativeConfig or None, got "
                                f"{self.speculative!r} ({_kind(self.speculative)})")
        _check_str("device", self.device)
        _check_str("attention_backend", self.attention_backend, optional=True)
        _check_str("draft_attention_backend", self.draft_attention_backend, optional=True)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise RocdraftError(f"unknown dtype {self.dtype!r}; valid: {DTYPES}")
        method = self.speculative.method if self.speculative is not None else None
        if method == "mtp" and self.draft:
            raise RocdraftError(f"draft={str(self.draft)!r} was given with method 'mtp', whose "
                                f"draft layers come from the target's own checkpoint; drop "
                                f"draft")
        if method not in (None, "mtp") and not self.draft:
            raise RocdraftError(f"speculative method {method!r} needs a draft head directory "
                                f"(draft=...)")
