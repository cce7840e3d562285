"""models/compiled_regions.py: ``LLM(compile=...)`` runs every block's dense halves through
torch.compile with the same greedy tokens as eager, speculation accepting drafts, a bounded
number of graphs over prefill, decode, verification and drafting at several batch sizes, and
clear refusals. CI traces with ``aot_eager`` (dynamo + AOTAutograd, no C++ toolchain needed);
the inductor test runs where a C++ compiler is on PATH. What only a GPU shows: whether
inductor's fused kernels win there, and compiled regions inside captured graphs."""
from __future__ import annotations

import shutil

import pytest
import torch

from checkpoints import write_cyclic_eagle1_head, write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError
from rocdraft.models.compiled_regions import compile_backend, compiled_regions
from rocdraft.models.layers import EAGER_REGIONS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3, 9, 4, 1, 7, 7, 2, 5], [8, 2], [5, 5, 6, 1, 9, 9, 4]]
# (n = 1, n >= 2) x (the target's, the head's input width) for qkv_rope, (n = 1, n >= 2) for
# block_tail: 6. Measured: 5 (the head's first layer never sees n = 1 here); 8 without the
# tail's copy of the attention output (a guard on its base's strides per batch shape).
MAX_GRAPHS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    target = write_cyclic_llama(root / "t")  # heads that predict it: drafts get accepted
    return {"target": str(target), "eagle3": str(write_cyclic_eagle3_head(root / "e3", target)),
            "eagle": str(write_cyclic_eagle1_head(root / "e1", target))}


def _llm(ckpt, method: str | None, **kwargs) -> LLM:
    spec = None if method is None else SpeculativeConfig(method=method,
                                                         num_speculative_tokens=3,
                                                         draft_policy="fixed")
    return LLM(ckpt["target"], ckpt[method] if method else None, speculative_config=spec,
               attention_backend="CPU_ATTN", max_model_len=128, max_num_seqs=4, **kwargs)


def _graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compile_values():
    assert compile_backend(False) is None and compile_backend(None) is None
    assert compile_backend(True) == "inductor" and compile_backend("eager") == "eager"
    for bad in ("cudagraphs", 1, "Inductor"):
        with pytest.raises(RocdraftError, match=f"got {bad!r}"):
            compile_backend(bad)
    with pytest.raises(RocdraftError, match="unknown compile backend 'tvm'"):
        compiled_regions("tvm")


def test_tensor_parallel_compile_is_refused_before_loading(ckpt):
    with pytest.raises(RocdraftError, match="compile='aot_eager' with tensor_parallel_size 2"):
        LLM(ckpt["target"], compile="aot_eager", tensor_parallel_size=2)
    with pytest.raises(RocdraftError, match="got 'fast'"):
        LLM(ckpt["target"], compile="fast")


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_compiled_equals_eager_with_bounded_graphs(ckpt, method):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _llm(ckpt, method)
    assert eager.model_runner.target.regions is EAGER_REGIONS
    compiled = _llm(ckpt, method, compile="aot_eager")
    assert compiled.model_runner.target.regions is compiled_regions("aot_eager")
    assert compiled.draft_runner.head.regions is compiled_regions("aot_eager")
    for batch in (PROMPTS[:1], PROMPTS, PROMPTS[1:]):  # bs 1, 3, 2: prefill, decode, verify
        want = eager.generate(batch, GREEDY)
        got = compiled.generate(batch, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert compiled.stats.acceptance_length > 1.5  # drafts were accepted (compiled head)
    graphs = _graphs()
    assert 0 < graphs <= MAX_GRAPHS, f"{graphs} graphs"
    compiled.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4]], GREEDY)
    assert _graphs() == graphs  # new lengths and batch sizes: no recompile


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_target_only_equals_eager(ckpt):
    want = _llm(ckpt, None).generate(PROMPTS, GREEDY)
    got = _llm(ckpt, None, compile=True).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
