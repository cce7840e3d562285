"""KV-cache sizing (rocdraft/core/kv_budget.py): memory sizes parsed and refused, blocks from one
budget for the target's and the head's caches, the worked examples of the module docstring,
and the engine sized by it: a tiny budget preempts and still gives the large budget's greedy
tokens; a budget below one request names both numbers."""
from __future__ import annotations

import pytest

from checkpoints import write_eagle3_head, write_tiny_llama
from rocdraft.errors import RocdraftError
from rocdraft.core.kv_budget import (DEFAULT_CPU_KV_CACHE_BYTES, blocks_per_request, format_bytes,
                                head_cache_spec, kv_bytes_per_block, parse_memory_size,
                                plan_kv_cache)

BUILTIN_BLOCK = 147456  # float32, block 16, target 8 x 2 x 64 + EAGLE-3 head 1 x 2 x 64


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6),
    ("1.5G", int(1.5 * 2**30)), ("1e9", 10**9), ("4096", 4096), (" 64 kib ", 64 * 1024),
    ("2gb", 2 * 10**9), ("1T", 2**40), ("3B", 3), ("1.5", 1), (4096, 4096), (1e9, 10**9),
])
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("value, fragment", [
    ("", "must be a number of bytes"), ("lots", "must be a number of bytes"),
    ("2 apples", "unknown unit 'apples'"), ("1GiB2", "must be a number of bytes"),
    ("-1GiB", "must be > 0"), ("-5", "must be > 0"), (-5, "must be > 0 bytes"),
    ("0", "must be > 0 bytes"), (0, "must be > 0 bytes"), ("0.5", "must be > 0 bytes"),
    (float("nan"), "must be finite"), (float("inf"), "must be finite"), ("1e999", "finite"),
    (True, "got True (bool)"), (None, "got None"), ([1], "got [1] (list)"),
])
def test_bad_memory_sizes_are_refused_by_name(value, fragment):
    with pytest.raises(RocdraftError, match="kv_cache_memory") as info:
        parse_memory_size(value)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_format_bytes():
    assert [format_bytes(n) for n in (100, 1536, 256 * 2**20, 3 * 2**30)] == \
        ["100 B", "1.5 KiB", "256.0 MiB", "3.0 GiB"]


def test_docstring_worked_examples():
    per_block = kv_bytes_per_block(16, 4, [(8, 2, 64), (1, 2, 64)])
    assert per_block == BUILTIN_BLOCK
    assert blocks_per_request(2048, 4, 16) == 129
    plan = dict(block_size=16, bytes_per_block=per_block, max_num_seqs=64, max_model_len=2048,
                num_lookahead_tokens=4)
    default = plan_kv_cache(**plan)
    assert (default.num_blocks, default.source) == (1820, "default")
    assert default.num_tokens == 29120 and default.num_bytes <= DEFAULT_CPU_KV_CACHE_BYTES
    assert plan_kv_cache(**plan, kv_cache_memory="1GiB").num_blocks == 7281
    assert plan_kv_cache(**plan, kv_cache_memory="64GiB").num_blocks == 64 * 129  # never more
    assert plan_kv_cache(**plan, num_kv_blocks=500).num_blocks == 500
    with pytest.raises(RocdraftError, match="cannot hold one request") as info:
        plan_kv_cache(**plan, kv_cache_memory="8MiB")
    message = str(info.value)
    # Both numbers: the bytes given and the bytes one request needs.
    assert "8388608 bytes" in message and "19021824 bytes" in message
    assert "max_model_len 2048" in message and "129 blocks" in message


def test_a_head_in_another_dtype_is_counted_at_its_own_element_size():
    """draft_dtype: the caches after the target's at the head's element size (a bfloat16
    head beside a float32 target: the docstring's 139264 bytes, not 147456)."""
    specs = [(8, 2, 64), (1, 2, 64)]
    assert kv_bytes_per_block(16, 4, specs, 2) == 2 * 16 * (4 * 8 * 128 + 2 * 128) == 139264
    assert kv_bytes_per_block(16, 4, specs, None) == kv_bytes_per_block(16, 4, specs) == \
        BUILTIN_BLOCK
    assert kv_bytes_per_block(16, 2, specs[:1], 4) == 2 * 16 * 2 * 1024  # no head: unused


def test_default_fits_small_needs_and_never_refuses_on_the_cpu():
    small = plan_kv_cache(block_size=16, bytes_per_block=1024, max_num_seqs=4,
                          max_model_len=64)
    assert small.num_blocks == 4 * 4  # what 4 requests of 64 tokens need, far below the cap
    huge = plan_kv_cache(block_size=16, bytes_per_block=2**30, max_num_seqs=64,
                         max_model_len=64)
    assert huge.num_blocks == 4  # above the cap: one request's worth, not a refusal


def test_gpu_memory_utilization():
    plan = dict(block_size=16, bytes_per_block=2**20, max_num_seqs=64, max_model_len=2048)
    gpu = plan_kv_cache(**plan, gpu_memory_utilization=0.5, free_device_memory=400 * 2**20)
    assert (gpu.num_blocks, gpu.source) == (200, "gpu_memory_utilization")
    default = plan_kv_cache(**plan, free_device_memory=100 * 2**30)
    assert default.num_blocks == 64 * 128  # the need, below 0.9 of the free memory
    with pytest.raises(RocdraftError, match="--gpu-memory-utilization.*needs a GPU"):
        plan_kv_cache(**plan, gpu_memory_utilization=0.5)  # the CPU: no free device memory
    with pytest.raises(RocdraftError, match="cannot hold one request"):
        plan_kv_cache(**plan, gpu_memory_utilization=0.1, free_device_memory=100 * 2**20)
    for bad in (0, 1.5, -0.1, float("nan"), "0.5", True):
        with pytest.raises(RocdraftError, match="gpu_memory_utilization must be"):
            plan_kv_cache(**plan, gpu_memory_utilization=bad, free_device_memory=2**30)


def test_one_sizing_setting_at_most():
    with pytest.raises(RocdraftError, match="num_kv_blocks and kv_cache_memory were given"):
        plan_kv_cache(block_size=16, bytes_per_block=1024, max_num_seqs=1, max_model_len=64,
                      num_kv_blocks=10, kv_cache_memory="1MiB")


def test_num_kv_blocks_below_one_request_names_both():
    with pytest.raises(RocdraftError, match="num_kv_blocks 3 x block_size 16 cannot hold one "
                                            "request of max_model_len 64: .* needs 4 blocks"):
        plan_kv_cache(block_size=16, bytes_per_block=1024, max_num_seqs=1, max_model_len=64,
                      num_kv_blocks=3)


# --- the engine, sized by one budget ---------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_budget")
    target = write_tiny_llama(root / "t", kind="deep")
    return str(target), str(write_eagle3_head(root / "e3", target))


def _spec_llm(pair, **sizing):
    from rocdraft.config import SpeculativeConfig
    from rocdraft.engine import LLM

    target, head = pair
    return LLM(target, draft=head, block_size=4, max_model_len=64,
               speculative_config=SpeculativeConfig("eagle3", 2), **sizing)


def test_one_budget_sizes_both_caches(pair):
    target, head = pair
    assert head_cache_spec(head, "eagle3") == (1, 2, 16)
    llm = _spec_llm(pair, kv_cache_memory="200KiB")
    plan = llm.kv_cache_plan
    # block 4 x float32 x (target 8 layers + head 1) x 2 KV heads x 16 x (K and V)
    assert plan.bytes_per_block == 2 * 4 * 4 * (8 + 1) * 2 * 16 == 9216
    assert plan.num_blocks == 200 * 1024 // 9216 == 22 and plan.source == "kv_cache_memory"
    allocated = sum(c.key.nbytes + c.value.nbytes for c in llm.model_runner.kv_caches + llm.draft_runner.kv_caches)
    assert allocated == plan.num_bytes <= 200 * 1024
    assert llm.model_runner.kv_caches[0].key.shape[0] == llm.draft_runner.kv_caches[0].key.shape[0] == 22


def test_tiny_budget_preempts_with_the_same_greedy_tokens(pair):
    from rocdraft.config import SamplingParams

    prompts = [[1, 5 + i, 6, 7, 8 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    large = _spec_llm(pair, kv_cache_memory="64MiB")
    expected = [o.token_ids for o in large.generate(prompts, params)]
    assert large.last_stats.num_preemptions == 0
    tiny = _spec_llm(pair, kv_cache_memory=17 * 9216)  # one 64-token request + 1 block
    assert tiny.kv_cache_plan.num_blocks == 17
    assert [o.token_ids for o in tiny.generate(prompts, params)] == expected
    assert tiny.last_stats.num_preemptions > 0


def test_engine_refuses_a_budget_below_one_request(pair):
    with pytest.raises(RocdraftError, match="cannot hold one request") as info:
        _spec_llm(pair, kv_cache_memory="64KiB")
    message = str(info.value)
    assert "65536 bytes" in message and "17 blocks x 9216 bytes = 156672 bytes" in message


@pytest.mark.parametrize("sizing, fragment", [
    (dict(kv_cache_memory="2 apples"), "unknown unit 'apples'"),
    (dict(gpu_memory_utilization=0.9), "needs a GPU"),
    (dict(num_kv_blocks=20, kv_cache_memory="1GiB"), "were given together"),
])
def test_engine_refuses_bad_sizing_before_loading(pair, monkeypatch, sizing, fragment):
    import rocdraft.engine.args
    import rocdraft.engine.model_runner

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the sizing settings were checked")

    monkeypatch.setattr(rocdraft.engine.model_runner, "load_target_model", no_loading)
    for module in (rocdraft.engine.args, rocdraft.engine.model_runner):
        monkeypatch.setattr(module, "detect_platform", _cpu_platform)
    with pytest.raises(RocdraftError, match=fragment):
        _spec_llm(pair, **sizing)


def _cpu_platform():
    from rocdraft.platform import detect_platform

    platform = detect_platform()
    if platform.is_gpu:
        pytest.skip("the CPU refusal of gpu_memory_utilization needs a CPU-only machine")
    return platform
