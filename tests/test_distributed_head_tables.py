"""rocdraft.distributed.head_tables: whole vocabulary tables for the EAGLE head on rank 0 under
tensor parallelism, read from single-file and index-sharded safetensors, tied and untied,
equal to the TP-1 target's; a head built on them equals the head on the TP-1 target."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from checkpoints import write_eagle3_head, write_tiny_llama
from distributed_helpers import make_sharded
from rocdraft.backends.torch_sdpa import TorchSDPABackend
from rocdraft.distributed.head_tables import load_vocab_tables
from rocdraft.errors import CheckpointError
from rocdraft.models.config import load_model_config
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target


@pytest.mark.parametrize("kind", ["llama", "llama3"], ids=["untied", "tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_tables_equal_the_tp1_target(tmp_path, kind, sharded):
    path = write_tiny_llama(tmp_path / "t", kind=kind, seed=3)
    if sharded:
        make_sharded(path)
    config = load_model_config(path)
    tables = load_vocab_tables(path, config, torch.float32, "cpu")
    target = load_target(path, torch.float32, "cpu", TorchSDPABackend)
    assert type(tables.embed_tokens) is nn.Embedding and type(tables.lm_head) is nn.Linear
    assert list(tables.embed_tokens.weight.shape) == [config.vocab_size, config.hidden_size]
    assert torch.equal(tables.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(tables.lm_head.weight, target.lm_head.weight)
    assert (tables.lm_head.weight is tables.embed_tokens.weight) == config.tie_word_embeddings
    assert not tables.lm_head.weight.requires_grad


def test_a_head_on_the_tables_equals_the_head_on_the_target(tmp_path):
    path = write_tiny_llama(tmp_path / "t", kind="deep", seed=4)
    head_path = write_eagle3_head(tmp_path / "h", path)
    target = load_target(path, torch.float32, "cpu", TorchSDPABackend)
    tables = load_vocab_tables(path, target.config, torch.float32, "cpu")
    on_target = load_draft(head_path, target, torch.float32, "cpu", TorchSDPABackend)
    on_tables = load_draft(head_path, tables, torch.float32, "cpu", TorchSDPABackend)
    hidden = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(on_tables.compute_draft_logits(hidden),
                               on_target.compute_draft_logits(hidden))
    assert torch.equal(on_tables.embed_tokens.weight, on_target.embed_tokens.weight)


def test_a_table_of_the_wrong_shape_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "t", seed=5)
    config = load_model_config(path)
    wrong = dataclasses.replace(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight has shape "
                       r"\[\d+, \d+\], expected \[vocab_size, hidden_size\]"):
        load_vocab_tables(path, wrong, torch.float32, "cpu")
