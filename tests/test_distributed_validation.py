"""rocdraft.distributed.validation: each refusal names the values; the layout of heads, KV
replication (vLLM's rule) and vocabulary padding."""
from __future__ import annotations

import dataclasses

import pytest

from rocdraft.distributed.validation import check_tensor_parallel
from rocdraft.errors import RocdraftError
from rocdraft.models.config import ModelConfig

BASE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=160, hidden_size=128,
                   intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                   rope_scaling=None, max_position_embeddings=256)


def _config(**fields) -> ModelConfig:
    return dataclasses.replace(BASE, **fields)


@pytest.mark.parametrize("tp", [0, -2, True, 2.0])
def test_refuses_tp_below_one_or_not_an_int(tp):
    with pytest.raises(RocdraftError, match=r"tensor_parallel_size must be an integer >= 1"):
        check_tensor_parallel(BASE, tp, None)


def test_refuses_tp_not_dividing_attention_heads():
    with pytest.raises(RocdraftError, match=r"tensor_parallel_size 3 does not divide "
                                            r"num_attention_heads 8; valid: \[1, 2, 4, 8\]"):
        check_tensor_parallel(BASE, 3, None)


def test_refuses_tp_not_dividing_kv_heads_when_there_are_enough():
    config = _config(num_attention_heads=12, num_key_value_heads=6, intermediate_size=240)
    with pytest.raises(RocdraftError, match=r"tensor_parallel_size 4 does not divide "
                                            r"num_key_value_heads 6"):
        check_tensor_parallel(config, 4, None)


def test_refuses_tp_not_a_multiple_of_fewer_kv_heads():
    config = _config(num_attention_heads=12, num_key_value_heads=4, intermediate_size=240)
    with pytest.raises(RocdraftError, match=r"tensor_parallel_size 6 is larger than "
                                            r"num_key_value_heads 4 but not a multiple of it"):
        check_tensor_parallel(config, 6, None)


def test_refuses_tp_not_dividing_intermediate_size():
    with pytest.raises(RocdraftError, match=r"does not divide intermediate_size 250"):
        check_tensor_parallel(_config(intermediate_size=250), 4, None)


def test_refuses_more_ranks_than_visible_gpus():
    with pytest.raises(RocdraftError, match=r"tensor_parallel_size 4 is larger than the 2 "
                                            r"visible GPU\(s\)"):
        check_tensor_parallel(BASE, 4, 2)
    assert check_tensor_parallel(BASE, 4, None).tp_size == 4  # CPU: no GPU limit
    assert check_tensor_parallel(BASE, 2, 8).tp_size == 2


def test_kv_heads_replicated_like_vllm():
    """8 query heads, 2 KV heads, TP 4: ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1."""
    layout = check_tensor_parallel(BASE, 4, None)
    assert layout.replicates_kv and layout.num_heads == 2 and layout.num_kv_heads == 1
    assert [list(layout.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(layout.query_heads(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 8, 4),
                                               (32, 8, 8), (64, 8, 16), (12, 4, 12)])
def test_every_query_head_sits_with_its_kv_head(heads, kv_heads, tp):
    config = _config(num_attention_heads=heads, num_key_value_heads=kv_heads,
                     intermediate_size=16 * tp)
    layout = check_tensor_parallel(config, tp, None)
    group = heads // kv_heads
    for rank in range(tp):
        local_kv = list(layout.kv_heads(rank))
        assert len(local_kv) == layout.num_kv_heads
        for h in layout.query_heads(rank):
            assert h // group in local_kv  # the KV head query head h attends with is local


def test_vocabulary_is_padded_not_refused():
    layout = check_tensor_parallel(_config(vocab_size=161), 4, None)
    assert layout.vocab_per_rank == 41
    assert layout.vocab_rows(3) == range(123, 164)  # 3 padding rows past 161
