"""TreeLoopRunner on the CPU: the tree levels replayed eagerly through the static, bucketed
buffers give the same trees as unbucketed drafting and write the same draft KV cache bytes
(padding rows are dead at every level: nothing written); budgets and long sequences fall
back to eager drafting; the engine keeps greedy output lossless through the runner.

What this proves: the padding, the static buffers and the copies are right, and the loop is
free of host reads on the CPU path. Only a GPU run proves the captured graph itself.

The bucketed replay runs the head on more rows than eager drafting (3 requests in bucket 4),
and a BLAS kernel may round a row differently by how many rows share the call (MKL does for
1 vs 2 and 3 vs 4 rows, in both CPU matmul forms, models/linear_form.py): the byte-equality
test runs every linear one row at a time (``row_invariant_linears``) so that it compares the
padding machinery, not the library's blocking."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.drafter.graphs import capture_buckets
from rocdraft.drafter.tree_graphs import TreeLoopRunner
from rocdraft.engine import LLM
from rocdraft.models import layers

TREES = {"static": dict(speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"),
         "dynamic": dict(tree_depth=3, tree_top_k=2, tree_total_tokens=6)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_graphs")
    target = write_cyclic_llama(root / "target")
    return str(target), str(write_cyclic_eagle3_head(root / "eagle3", target))


def engine(pair, tree: str, **kwargs) -> LLM:
    target, head = pair
    return LLM(target, draft=head, attention_backend="TORCH_SDPA", max_model_len=64,
               speculative_config=SpeculativeConfig("eagle3", **TREES[tree]), **kwargs)


@pytest.fixture
def row_invariant_linears(monkeypatch):
    """Every linear of the models as one 1-row F.linear per row: a row's value no longer
    depends on how many rows the call has."""
    def per_row(x, weight, bias=None, contiguous_rows=False):
        return torch.cat([F.linear(row, weight, bias) for row in x.split(1)]) if x.shape[0] \
            else F.linear(x, weight, bias)

    monkeypatch.setattr(layers, "run_linear", per_row)


def snapshot(caches) -> list[torch.Tensor]:
    return [t.clone() for c in caches for t in (c.key, c.value)]


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_bucketed_replay_equals_unbucketed_drafting(pair, tree, batch_size,
                                                    row_invariant_linears):
    llm = engine(pair, tree, max_num_seqs=8)
    proposer, drafter = llm.draft_runner.proposer, llm.draft_runner.proposer.tree_drafter
    max_blocks = llm.scheduler_config.max_blocks_per_seq
    runner = TreeLoopRunner(drafter, llm.draft_runner.kv_caches, llm.draft_runner.head.config.hidden_size,
                            max_blocks, capture_buckets(8), use_graphs=False)
    gen = torch.Generator().manual_seed(batch_size)
    hidden = torch.randn(batch_size, llm.draft_runner.head.config.hidden_size, generator=gen)
    positions = torch.randint(5, 40, (batch_size,), generator=gen)
    positions[0] = 62  # near max_model_len 64: its deeper levels are dead
    table = torch.arange(batch_size * max_blocks, dtype=torch.int32).view(batch_size, -1)
    # A full bucket first leaves stale rows in the static buffers (real blocks, positions).
    runner.run(torch.randn(8, hidden.shape[1], generator=gen), torch.randint(5, 40, (8,)),
               torch.arange(8 * max_blocks, dtype=torch.int32).view(8, -1), seq_len_bound=64)
    for cache in llm.draft_runner.kv_caches:  # a context to attend over
        cache.key.normal_(generator=gen)
        cache.value.normal_(generator=gen)
    before = snapshot(llm.draft_runner.kv_caches)
    eager = drafter.draft(hidden, positions, table, llm.draft_runner.kv_caches, seq_len_bound=64)
    after_eager = snapshot(llm.draft_runner.kv_caches)
    for cache, saved in zip(llm.draft_runner.kv_caches, zip(before[::2], before[1::2])):
        cache.key.copy_(saved[0])
        cache.value.copy_(saved[1])
    assert runner.accepts(batch_size, 64, None)
    assert runner.bucket_for(batch_size) == {1: 1, 3: 4, 5: 8}[batch_size]
    replayed = runner.run(hidden, positions, table, seq_len_bound=64)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert torch.equal(replayed.parents, eager.parents)
    assert torch.equal(replayed.num_nodes, eager.num_nodes)
    for got, expected in zip(snapshot(llm.draft_runner.kv_caches), after_eager):
        assert torch.equal(got, expected)  # padding rows wrote nothing
    assert proposer.tree_runner is None  # the engine builds runners on GPUs only


def test_budget_and_long_sequences_are_not_replayed(pair):
    llm = engine(pair, "dynamic", max_num_seqs=4)
    runner = TreeLoopRunner(llm.draft_runner.proposer.tree_drafter, llm.draft_runner.kv_caches,
                            llm.draft_runner.head.config.hidden_size, llm.scheduler_config.max_blocks_per_seq,
                            (1, 2, 4), use_graphs=False, max_seq_len=32)
    assert not runner.accepts(2, 16, budget_nodes=4)  # the budget is over real rows
    assert not runner.accepts(8, 16, None)  # larger than the largest bucket
    assert not runner.accepts(2, 30, None)  # levels may pass max_seq_len 32
    assert runner.accepts(2, 16, None)
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        TreeLoopRunner(llm.draft_runner.proposer.tree_drafter, llm.draft_runner.kv_caches, 8, 4, (1,),
                       use_graphs=False, max_seq_len=2)


@pytest.mark.parametrize("tree", list(TREES))
def test_engine_through_the_runner_stays_lossless(pair, tree, monkeypatch):
    """The engine with the runner a GPU engine builds (graph_mode "replay-eagerly": its
    static buffers replayed eagerly) gives target-only's greedy tokens while accepting tree
    nodes."""
    prompts = [[1, 5, 7, 9], [1, 2], list(range(1, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(pair[0], attention_backend="TORCH_SDPA",
                                          max_model_len=64).generate(prompts, params)]
    llm = engine(pair, tree, max_num_seqs=4, graph_mode="replay-eagerly")
    runner = llm.draft_runner.proposer.tree_runner
    assert runner is not None and not runner.use_graphs and runner.buckets == (1, 2, 4)
    calls = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert calls and llm.last_stats.acceptance_length > 1.5
