"""rocdraft.distributed.shard_loader: slices through safetensors' memory map, counted; single
files and sharded index checkpoints; padding past the stored rows; .bin refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import write_tiny_llama
from distributed_helpers import make_sharded
from rocdraft.distributed.shard_loader import ShardReader, Slice
from rocdraft.errors import CheckpointError

Q_KEY = "model.layers.1.self_attn.q_proj.weight"  # [64, 64]
DOWN_KEY = "model.layers.0.mlp.down_proj.weight"  # [64, 128]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("single"), kind="qwen2", tokenizer=False)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_sharded(write_tiny_llama(tmp_path_factory.mktemp("sharded"), kind="qwen2",
                                         tokenizer=False), num_files=3)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_reads_only_the_slice_and_counts_it(layout, single, sharded, request):
    path = request.getfixturevalue(layout)
    full = load_file(str(single / "model.safetensors"))
    with ShardReader(path) as reader:
        assert set(reader.keys()) == set(full)
        assert reader.shape(Q_KEY) == [64, 64] and reader.elements_read == {}
        rows = reader.read(Q_KEY, Slice(0, 16, 48))
        cols = reader.read(DOWN_KEY, Slice(1, 32, 64))
        bias = reader.read("model.layers.0.self_attn.k_proj.bias", Slice(0, 16, 32))
        norm = reader.read("model.norm.weight")
        assert reader.elements_read == {Q_KEY: 32 * 64, DOWN_KEY: 64 * 32,
                                        "model.layers.0.self_attn.k_proj.bias": 16,
                                        "model.norm.weight": 64}
        assert reader.bytes_read[Q_KEY] == 32 * 64 * 4
    torch.testing.assert_close(rows, full[Q_KEY][16:48], rtol=0, atol=0)
    torch.testing.assert_close(cols, full[DOWN_KEY][:, 32:64], rtol=0, atol=0)
    torch.testing.assert_close(bias, full["model.layers.0.self_attn.k_proj.bias"][16:32])
    torch.testing.assert_close(norm, full["model.norm.weight"], rtol=0, atol=0)


def test_rows_past_the_stored_size_are_zero_padding(single):
    embed = load_file(str(single / "model.safetensors"))["model.embed_tokens.weight"]  # [160, 64]
    with ShardReader(single) as reader:
        part = reader.read("model.embed_tokens.weight", Slice(0, 150, 170))
        assert reader.elements_read["model.embed_tokens.weight"] == 10 * 64
    assert part.shape == (20, 64)
    torch.testing.assert_close(part[:10], embed[150:], rtol=0, atol=0)
    assert not part[10:].any()


def test_missing_weight_named(single):
    with ShardReader(single) as reader, pytest.raises(CheckpointError, match="missing weight x"):
        reader.read("x")


def test_bin_checkpoint_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "bin", kind="llama", tokenizer=False)
    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"reads safetensors checkpoints by slices; .*"
                                              r"pytorch_model\.bin"):
        ShardReader(path)


def test_corrupt_file_refused(tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    save_file({"a": torch.zeros(4)}, str(path / "model.safetensors"))
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match="cannot read"):
        ShardReader(path)
