"""DraftRunner (rocdraft/spec_decode/draft_runner.py): the runners its proposer builds per
graph mode (none on the CPU by default; the GPU's runners replayed eagerly with
"replay-eagerly"), typed chain and tree results, and the drafts' host rows
(``draft_parts`` read at once, ``drafts_from_rows``) cut to each tree's node count. The
drafts themselves are tested through the engine (tests/test_speculative.py,
tests/test_tree_step.py) and the proposer (tests/test_eagle_proposer.py)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_cyclic_pair
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.drafter.graphs import capture_buckets
from rocdraft.drafter.tree_draft import TreeDrafts
from rocdraft.engine import LLM
from rocdraft.engine.request_updates import read_together
from rocdraft.spec_decode.draft_runner import ChainDrafts, draft_parts, drafts_from_rows

STATIC = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_cyclic_pair(tmp_path_factory.mktemp("draft_runner"))


def drafts_to_host(drafts, keep_scores: bool):
    """What the engine's step read does with the drafts (request_updates.read_step)."""
    parts = draft_parts(drafts)
    return drafts_from_rows(drafts, read_together(parts) if parts else [], keep_scores)


def test_drafts_to_host_reads_chains_and_trees_cut_to_their_node_counts():
    assert drafts_to_host(None, keep_scores=True) is None
    assert drafts_to_host(ChainDrafts(torch.tensor([[5, 6], [7, 8]])), True) == [[5, 6], [7, 8]]
    trees = TreeDrafts(tokens=torch.tensor([[4, 5, 6], [7, 0, 0]]),
                       parents=torch.tensor([[-1, 0, 0], [-1, -1, -1]]),
                       num_nodes=torch.tensor([3, 1]),
                       scores=torch.tensor([[-0.1, -0.2, -0.9], [-0.5, float("-inf"),
                                                                 float("-inf")]]))
    host = drafts_to_host(trees, keep_scores=True)
    assert host[0][:2] == ([4, 5, 6], [-1, 0, 0]) and host[1][:2] == ([7], [-1])
    assert host[0][2] == pytest.approx([-0.1, -0.2, -0.9]) and host[1][2] == [-0.5]
    assert [row[2] for row in drafts_to_host(trees, keep_scores=False)] == [[], []]


@pytest.mark.parametrize("spec, chain, tree", [
    (dict(), True, False),
    (dict(speculative_token_tree=STATIC, draft_policy="fixed"), False, True),
    (dict(speculative_token_tree=STATIC, num_speculative_tokens=3), True, True),  # chooser
    (dict(speculative_token_tree=STATIC, num_speculative_tokens=4), False, True),  # too deep
])
def test_runners_are_built_by_the_proposer_per_graph_mode(pair, spec, chain, tree):
    config = SpeculativeConfig("eagle3", **{"num_speculative_tokens": 3, **spec})
    eager = LLM(pair[0], draft=pair[1], speculative_config=config, max_num_seqs=4)
    if not torch.cuda.is_available():
        assert "no GPU" in eager.draft_runner.graph_refusal
        assert eager.draft_runner.proposer.graph_runner is None
        assert eager.draft_runner.proposer.tree_runner is None
    replaying = LLM(pair[0], draft=pair[1], speculative_config=config, max_num_seqs=4,
                    graph_mode="replay-eagerly")
    proposer = replaying.draft_runner.proposer
    assert (proposer.graph_runner is not None, proposer.tree_runner is not None) == (chain, tree)
    for runner in (proposer.graph_runner, proposer.tree_runner):
        if runner is not None:
            assert runner.buckets == capture_buckets(4)
            assert runner.use_graphs == (replaying.draft_runner.graph_refusal is None)
            assert runner.kv_caches is replaying.draft_runner.kv_caches


def test_the_runner_holds_the_head_its_cache_and_its_backend(pair):
    llm = LLM(pair[0], draft=pair[1], max_num_seqs=2,
              speculative_config=SpeculativeConfig("eagle3", 2, draft_policy="fixed"))
    runner = llm.draft_runner
    layers = runner.head.kv_cache_spec()[0]
    assert len(runner.kv_caches) == layers and runner.proposer.head is runner.head
    assert runner.backend is llm.draft_backend and runner.backend_reason
    assert runner.aux_layer_ids == runner.head.aux_layer_ids(
        llm.model_runner.target.config.num_hidden_layers)
    outs = llm.generate([[1, 5, 7, 9], list(range(1, 30))],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [24, 24]
    assert llm.last_stats.acceptance_length > 1.5  # drafts were accepted
