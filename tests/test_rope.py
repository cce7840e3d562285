"""models/rope.py against transformers' RoPE, including llama3 scaling and M-RoPE."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2_vl.modeling_qwen2_vl import (Qwen2VLRotaryEmbedding,
                                                            Qwen2VLTextConfig)

from checkpoints import LLAMA3_ROPE, PagedBatch
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.models.config import ModelConfig
from rocdraft.models.llama import LlamaForCausalLM
from rocdraft.models.rope import (RotaryEmbedding, apply_rotary, apply_rotary_tables,
                                  compute_inv_freq, reserve_positions)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": LLAMA3_ROPE,
}


def _hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                       max_position_embeddings=256, rope_parameters=dict(rope))


def _ours(rope: dict) -> RotaryEmbedding:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return RotaryEmbedding(16, rope["rope_theta"],
                           None if scaling["rope_type"] == "default" else scaling)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_cos_sin_match_transformers(name):
    ref = LlamaRotaryEmbedding(_hf_config(ROPES[name]))
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    x = torch.zeros(1, len(positions), 16)
    ref_cos, ref_sin = ref(x, positions[None])
    cos, sin = _ours(ROPES[name])(positions)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


def test_llama3_scaling_changes_low_frequencies_only():
    plain = compute_inv_freq(16, 500000.0, None)
    scaled = compute_inv_freq(16, 500000.0, {k: v for k, v in LLAMA3_ROPE.items()
                                             if k != "rope_theta"})
    assert scaled[0] == plain[0]  # shortest wavelength untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # longest slowed by factor


def test_dynamic_equals_default_within_max_positions():
    torch.testing.assert_close(compute_inv_freq(16, 1e4, {"rope_type": "dynamic", "factor": 2.0}),
                               compute_inv_freq(16, 1e4, None))


def test_apply_rotary_matches_transformers():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, 16, generator=g), torch.randn(7, 2, 16, generator=g)
    cos, sin = _ours(ROPES["llama3"])(torch.arange(7) * 11)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_step_tables_rotate_q_and_k_together_bit_for_bit(dtype):
    """The tables prepared once per step give apply_rotary's values exactly, for q and k
    rotated in one call on a strided view of a fused qkv."""
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(16, 1e4, ROPES["llama3"])
    positions = torch.arange(7) * 5
    qkv = torch.randn(7, 4 + 2 + 2, 16, generator=g).to(dtype)
    tables = rope.tables(positions, dtype)
    assert tables.cos.shape == (7, 1, 16) and tables.cos.dtype == dtype
    rotated = apply_rotary_tables(qkv[:, :6], tables)
    cos, sin = rope(positions)
    assert torch.equal(rotated[:, :4], apply_rotary(qkv[:, :4], cos, sin))
    assert torch.equal(rotated[:, 4:], apply_rotary(qkv[:, 4:6], cos, sin))


MROPE = {"rope_type": "mrope", "mrope_section": [2, 3, 3]}


def test_mrope_matches_qwen2_vl():
    hf_config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    ref = Qwen2VLRotaryEmbedding(hf_config)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 50, (3, 9), generator=g)  # temporal, height, width
    ref_cos, ref_sin = ref(torch.zeros(1, 9, 16), positions[:, None, :])
    cos, sin = RotaryEmbedding(16, 10000.0, MROPE)(positions)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


def test_mrope_sections_take_their_own_row():
    rope = RotaryEmbedding(16, 10000.0, MROPE)
    positions = torch.tensor([[3], [5], [7]])
    cos, _ = rope(positions)
    inv = rope.inv_freq
    expected = torch.cat([3 * inv[:2], 5 * inv[2:5], 7 * inv[5:]])  # [head_dim // 2]
    torch.testing.assert_close(cos[0], torch.cat([expected, expected]).cos())
    # Equal rows reduce M-RoPE to plain RoPE; 1-D positions are broadcast.
    same = torch.tensor([4, 9, 2])
    torch.testing.assert_close(rope(same.expand(3, -1)), RotaryEmbedding(16, 1e4, None)(same))
    torch.testing.assert_close(rope(same), RotaryEmbedding(16, 1e4, None)(same))


def test_draft_heads_take_row_zero_of_mrope_positions():
    rows = torch.stack([torch.tensor([4, 9, 2]), torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1])])
    head_rope = RotaryEmbedding(16, 1e4, None, first_row_of_mrope=True)
    torch.testing.assert_close(head_rope(rows), RotaryEmbedding(16, 1e4, None)(rows[0]))


def test_bad_positions_and_sections():
    with pytest.raises(ValueError, match="M-RoPE"):
        RotaryEmbedding(16, 1e4, None)(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(16, 1e4, {"rope_type": "mrope", "mrope_section": [1, 1, 1]})


def test_mrope_target_toy(attention_backend):
    """A target with an M-RoPE config: [3, n] positions with equal rows equal 1-D positions,
    and distinct rows change the output (the sections are really used)."""
    backend = get_backend(attention_backend)
    config = ModelConfig.from_dict(dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=50, hidden_size=64, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend)
    ids = torch.randint(0, 50, (6,))

    def run(positions):
        batch = PagedBatch(1)
        caches = allocate_kv_cache(1, batch.num_blocks, batch.block_size, 2, 16, torch.float32,
                                   "cpu")
        input_ids, pos_1d, metadata, _ = batch.step([ids.tolist()], backend)
        return model(input_ids, pos_1d if positions is None else positions, caches,
                     metadata).hidden_states

    with torch.no_grad():
        plain = run(None)
        torch.testing.assert_close(run(torch.arange(6).expand(3, -1)), plain)
        grid = torch.stack([torch.arange(6), torch.arange(6) // 2, torch.arange(6) % 2])
        assert not torch.allclose(run(grid), plain)


def _assert_tables_equal(got, want):
    assert got.cos.shape == want.cos.shape and got.cos.dtype == want.cos.dtype
    assert torch.equal(got.cos, want.cos) and torch.equal(got.sin_signed, want.sin_signed)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rope", [ROPES["llama3"], ROPES["linear"]], ids=["llama3", "linear"])
def test_step_tables_are_lookups_that_grow_bit_for_bit(dtype, rope):
    """Step tables are rows of a precomputed table, equal to a fresh computation bit for bit,
    also past the table's first length (it grows) and for any head_dim."""
    for head_dim in (8, 12, 64):
        ours = RotaryEmbedding(head_dim, rope["rope_theta"],
                               {k: v for k, v in rope.items() if k != "rope_theta"})
        for positions in (torch.tensor([0]), torch.tensor([3, 200, 255]), torch.tensor([256]),
                          torch.tensor([7, 4999, 12]), torch.arange(33) * 97):
            _assert_tables_equal(ours.tables(positions, dtype),
                                 ours._fresh_tables(positions, dtype))
        assert ours._tables[dtype].cos.shape[0] == 8192  # grown to a power of two


def test_step_tables_follow_inv_freq_and_odd_positions():
    rope = RotaryEmbedding(16, 1e4, None, max_positions=1000)
    positions = torch.tensor([5, 999])
    rope.tables(positions, torch.float32)
    assert rope._tables[torch.float32].cos.shape[0] == 1000  # max_positions reserved
    rope.to(torch.float64)  # a new inv_freq buffer: the tables are rebuilt from it
    _assert_tables_equal(rope.tables(positions, torch.float32),
                         rope._fresh_tables(positions, torch.float32))
    assert rope._tables_of is rope.inv_freq
    rope.inv_freq.mul_(2)  # in place (as reset_inv_freq after a meta load): reset drops them
    rope.reset_inv_freq()
    assert not rope._tables
    negative = torch.tensor([-1, 3])  # no table row: computed fresh, as before
    _assert_tables_equal(rope.tables(negative, torch.float32),
                         rope._fresh_tables(negative, torch.float32))
    empty = rope.tables(torch.zeros(0, dtype=torch.long), torch.float32)
    assert empty.cos.shape == (0, 1, 16)


def test_reserve_positions_sets_every_rotary_embedding_and_refuses_bad_counts():
    model = torch.nn.ModuleList([RotaryEmbedding(16, 1e4, None), torch.nn.Linear(2, 2),
                                 torch.nn.Sequential(RotaryEmbedding(8, 1e4, None))])
    reserve_positions(model, 129)
    assert [m.max_positions for m in model.modules() if isinstance(m, RotaryEmbedding)] \
        == [129, 129]
    with pytest.raises(ValueError, match="max_positions must be >= 1, got 0"):
        reserve_positions(model, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (none visible)")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_accelerator_lookups_equal_fresh_rows_and_clamp_padding_positions(dtype):
    rope = RotaryEmbedding(64, 1e4, None, device="cuda", max_positions=1025)
    positions = torch.tensor([0, 7, 513, 1024], device="cuda")
    _assert_tables_equal(rope.tables(positions, dtype), rope._fresh_tables(positions, dtype))
    assert rope._tables[dtype].cos.shape[0] >= 1025  # looked up, not computed fresh
    past = rope.tables(torch.tensor([1024, 5000], device="cuda"), dtype)  # padding past it
    _assert_tables_equal(past, rope._fresh_tables(torch.tensor([1024, 1024], device="cuda"),
                                                  dtype))


@pytest.mark.parametrize("head_dim, section", [(16, [2, 3, 3]), (128, [16, 24, 24])])
def test_mrope_step_tables_are_lookups_bit_for_bit(head_dim, section):
    rope = RotaryEmbedding(head_dim, 1e6, {"rope_type": "mrope", "mrope_section": section})
    g = torch.Generator().manual_seed(3)
    for positions in (torch.randint(0, 300, (3, 9), generator=g), torch.tensor([[4], [9], [600]]),
                      torch.arange(5).expand(3, -1), torch.arange(5)):
        _assert_tables_equal(rope.tables(positions, torch.bfloat16),
                             rope._fresh_tables(positions, torch.bfloat16))
    head = RotaryEmbedding(head_dim, 1e6, None, first_row_of_mrope=True)
    rows = torch.randint(0, 300, (3, 4), generator=g)
    _assert_tables_equal(head.tables(rows, torch.float32),
                         head._fresh_tables(rows[0], torch.float32))
