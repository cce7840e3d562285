"""rocdraft.distributed.layers on 2 real gloo processes: row-parallel linear (one all-reduce,
bias once), vocabulary-parallel embedding (masked lookup + all-reduce) and lm_head (gathered,
padding cut) equal their one-device versions; CommCounter counts the payload bytes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from distributed_helpers import run_ranks
from rocdraft.distributed.group import ParallelGroup
from rocdraft.distributed.layers import (CommCounter, ParallelLMHead, RowParallelLinear,
                                         VocabParallelEmbedding)

VOCAB, HIDDEN, IN_FEATURES, NUM_TOKENS = 7, 8, 12, 5  # 7 ids over 2 ranks: 4 + 3 (+1 padding)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(HIDDEN, IN_FEATURES, generator=g),
            "bias": torch.randn(HIDDEN, generator=g),
            "x": torch.randn(NUM_TOKENS, IN_FEATURES, generator=g),
            "embed": torch.randn(VOCAB, HIDDEN, generator=g),
            "ids": torch.tensor([0, 6, 3, 4, 4, 1]),
            "hidden": torch.randn(NUM_TOKENS, HIDDEN, generator=g)}


@torch.no_grad()
def _layers_worker(group: ParallelGroup, out_dir: str) -> None:
    t, rank, half = _tensors(), group.rank, IN_FEATURES // 2
    results = {}
    counter = CommCounter()
    row = RowParallelLinear(half, HIDDEN, True, group, counter)
    row.weight.copy_(t["weight"][:, rank * half:(rank + 1) * half])
    row.bias.copy_(t["bias"])
    results["row"] = row(t["x"][:, rank * half:(rank + 1) * half])
    results["row_counter"] = dict(vars(counter))

    per_rank = -(-VOCAB // 2)
    padded = torch.cat([t["embed"], torch.zeros(2 * per_rank - VOCAB, HIDDEN)])
    shard = padded[rank * per_rank:(rank + 1) * per_rank]
    counter.reset()
    embed = VocabParallelEmbedding(per_rank, HIDDEN, group, counter)
    embed.weight.copy_(shard)
    results["embed"] = embed(t["ids"])
    results["embed_counter"] = dict(vars(counter))

    counter.reset()
    head = ParallelLMHead(VOCAB, per_rank, HIDDEN, group, counter)
    head.weight.copy_(shard)
    results["logits"] = head(t["hidden"])
    results["head_counter"] = dict(vars(counter))
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_parallel_layers_equal_one_device(tmp_path):
    run_ranks(_layers_worker, 2, str(tmp_path))
    t = _tensors()
    expected_logits = t["hidden"] @ t["embed"].T
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["row"], F.linear(t["x"], t["weight"], t["bias"]))
        assert got["row_counter"] == dict(all_reduce_calls=1,
                                          all_reduce_bytes=NUM_TOKENS * HIDDEN * 4,
                                          all_gather_calls=0, all_gather_bytes=0)
        torch.testing.assert_close(got["embed"], t["embed"][t["ids"]], rtol=0, atol=0)
        assert got["embed_counter"]["all_reduce_bytes"] == len(t["ids"]) * HIDDEN * 4
        assert got["logits"].shape == (NUM_TOKENS, VOCAB)  # the padding row is cut off
        torch.testing.assert_close(got["logits"], expected_logits)
        assert got["head_counter"] == dict(all_reduce_calls=0, all_reduce_bytes=0,
                                           all_gather_calls=1,
                                           all_gather_bytes=NUM_TOKENS * 8 * 4)


@torch.no_grad()
def test_world_size_one_needs_no_process_group():
    t, counter, group = _tensors(), CommCounter(), ParallelGroup.single()
    row = RowParallelLinear(IN_FEATURES, HIDDEN, False, group, counter)
    row.weight.copy_(t["weight"])
    torch.testing.assert_close(row(t["x"]), t["x"] @ t["weight"].T)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, group, counter)
    embed.weight.copy_(t["embed"])
    torch.testing.assert_close(embed(t["ids"]), t["embed"][t["ids"]])
    assert embed.embedding_dim == HIDDEN
    head = ParallelLMHead(VOCAB, VOCAB, HIDDEN, group, counter)
    head.weight.copy_(t["embed"])
    torch.testing.assert_close(head(t["hidden"]), t["hidden"] @ t["embed"].T)
    assert counter == CommCounter()
