"""TreeDrafter (drafter/tree_draft.py, via EagleProposer.propose_tree) against a naive per-node
reference: for each node separately, the head runs over [context..., ancestors..., node] as an
ordinary causal chain on a fresh cache (positions P + 1 .. P + depth, no tree mask), and tokens
are picked by the documented rule (static: rank r of the parent's top-k; dynamic EAGLE-2:
cumulative log-prob expansion, frontier selection and final reranking, re-done with Python
loops and sorting). Tokens, parents and node counts must match exactly.

Also: a request near max_model_len (dead levels write nothing: the rest of the draft cache is
byte-identical), and the batch budget (counts sum to the budget, every kept prefix a tree)."""
from __future__ import annotations

import math

import pytest
import torch

from checkpoints import write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.config import SpeculativeConfig
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.drafter.tree_spec import (EAGLE_DEFAULT_TREE, UNIFORM_TREE_2X2, DynamicTree,
                                        StaticTree, budget_shape)
from rocdraft.engine import LLM

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
SMALL_NON_UNIFORM = ((0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 0), (0, 1, 1))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_draft")
    target = write_tiny_llama(root / "target", kind="deep")
    return {"target": str(target), "eagle": str(write_eagle1_head(root / "eagle1", target)),
            "eagle3": str(write_eagle3_head(root / "eagle3", target))}


@pytest.fixture(scope="module")
def heads(checkpoints):
    """(method, backend) -> an engine whose head and draft backend the tests borrow (loaded
    once per module)."""
    loaded: dict[tuple[str, str], LLM] = {}

    def get(method: str, backend: str) -> LLM:
        if (method, backend) not in loaded:
            loaded[method, backend] = LLM(
                checkpoints["target"], draft=checkpoints[method], attention_backend=backend,
                draft_attention_backend=backend,
                speculative_config=SpeculativeConfig(method, num_speculative_tokens=1,
                                                     draft_policy="fixed"))
        return loaded[method, backend]

    return get


class Setup:
    """A proposer with a tree over the borrowed head, a draft cache (each request owns
    ``width`` shuffled blocks, plus free blocks nobody owns), and a batch of contexts."""

    def __init__(self, llm: LLM, tree, context_lens: list[int], seed: int = 0,
                 max_model_len: int = MAX_MODEL_LEN, free_blocks: int = 3):
        self.llm, self.head, self.tree = llm, llm.draft_runner.head, tree
        self.max_model_len = max_model_len
        self.context_lens = context_lens
        batch = len(context_lens)
        self.proposer = EagleProposer(self.head, llm.draft_backend, 1, 256, 8, max_model_len,
                                      BLOCK_SIZE, llm.model_runner.target.config.vocab_size, "cpu", tree=tree)
        g = torch.Generator().manual_seed(seed)
        self.width = -(-max_model_len // BLOCK_SIZE)
        self.num_blocks = batch * self.width + free_blocks
        order = torch.randperm(self.num_blocks, generator=g)
        self.block_table = order[:batch * self.width].view(batch, self.width).to(torch.int32)
        hidden_size = llm.model_runner.target.config.hidden_size
        num_features = 3 if llm.config.speculative.method == "eagle3" else 1
        vocab = llm.model_runner.target.config.vocab_size
        self.ids = [torch.randint(3, vocab, (n,), generator=g) for n in context_lens]
        self.features = [tuple(torch.randn(n, hidden_size, generator=g)
                               for _ in range(num_features)) for n in context_lens]
        self.next_ids = torch.randint(3, vocab, (batch,), generator=g)

    def caches(self, fill: float | None = None):
        layers, kv_heads, head_dim = self.head.kv_cache_spec()
        caches = allocate_kv_cache(layers, self.num_blocks, BLOCK_SIZE, kv_heads, head_dim,
                                   torch.float32, "cpu")
        if fill is not None:
            for cache in caches:
                cache.key.fill_(fill)
                cache.value.fill_(fill)
        return caches

    def slot(self, b: int, index: int) -> int:
        return int(self.block_table[b, index // BLOCK_SIZE]) * BLOCK_SIZE + index % BLOCK_SIZE

    def _features(self, rows):
        joined = tuple(torch.cat(parts) for parts in zip(*rows))
        return joined if len(joined) > 1 else joined[0]

    def inputs(self):
        """propose_tree's arguments (without the caches): a prefill of every context."""
        qsl = [0]
        for n in self.context_lens:
            qsl.append(qsl[-1] + n)
        slots = torch.tensor([self.slot(b, j) for b, n in enumerate(self.context_lens)
                              for j in range(n)])
        common = CommonAttentionMetadata.from_cpu(qsl, list(self.context_lens),
                                                  self.block_table, slots, "cpu")
        positions = torch.cat([torch.arange(n) for n in self.context_lens])
        last = torch.tensor(qsl[1:]) - 1
        return (torch.cat(self.ids), positions, self._features(self.features), self.next_ids,
                last, common)

    def propose(self, caches, budget_nodes=None):
        return self.proposer.propose_tree(*self.inputs(), caches, budget_nodes=budget_nodes)


# --- the naive per-node reference ---------------------------------------------------------------

class NaiveRequest:
    """One request: the head's output at any node, each computed from scratch as a causal
    chain [context..., ancestors..., node] on a fresh single-request cache."""

    def __init__(self, setup: Setup, b: int):
        self.setup, self.head = setup, setup.head
        self.tokens = torch.cat([setup.ids[b][1:], setup.next_ids[b:b + 1]])  # shifted ids
        self.inputs = self.head.combine_hidden_states(
            setup._features([setup.features[b]]))  # [n, H]
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def _chain(self, tokens: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        m, setup = tokens.shape[0], self.setup
        width = -(-m // BLOCK_SIZE)
        table = torch.arange(width, dtype=torch.int32).flip(0).view(1, -1)
        slots = torch.tensor([int(table[0, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE
                              for j in range(m)])
        common = CommonAttentionMetadata.from_cpu([0, m], [m], table, slots, "cpu")
        layers, kv_heads, head_dim = self.head.kv_cache_spec()
        caches = allocate_kv_cache(layers, width, BLOCK_SIZE, kv_heads, head_dim, torch.float32,
                                   "cpu")
        return self.head(tokens, torch.arange(m), inputs, caches,
                         setup.proposer.builder.build(common))

    def hidden(self, path: tuple[int, ...]) -> torch.Tensor:
        """path: target token ids root -> node (() = the root) -> the head's output [H]."""
        if path not in self.memo:
            parents = [self.hidden(path[:d]) for d in range(len(path))]  # root .. parent
            tokens = torch.cat([self.tokens, torch.tensor(path, dtype=torch.int64)])
            inputs = torch.cat([self.inputs] + [h.view(1, -1) for h in parents])
            self.memo[path] = self._chain(tokens, inputs)[-1]
        return self.memo[path]

    def ranked(self, path: tuple[int, ...]) -> list[tuple[float, int]]:
        """The node's children, best first: (log-prob, target token id)."""
        logits = self.head.compute_draft_logits(self.hidden(path).view(1, -1))[0]
        logprobs = torch.log_softmax(logits, dim=-1).tolist()
        order = sorted(range(len(logprobs)), key=lambda v: (-logprobs[v], v))
        targets = self.head.draft_to_target(torch.tensor(order)).tolist()
        return [(logprobs[v], t) for v, t in zip(order, targets)]


def naive_static(naive: NaiveRequest, nodes) -> tuple[list[int], list[int]]:
    """Static tree: node (r1, .., rd)'s token is rank rd among its parent's children."""
    index = {node: i for i, node in enumerate(nodes)}
    token_path: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
    tokens, parents = [], []
    for node in nodes:
        parent_path = token_path[node[:-1]]
        token = naive.ranked(parent_path)[node[-1]][1]
        token_path[node] = parent_path + (token,)
        tokens.append(token)
        parents.append(index[node[:-1]] if len(node) > 1 else -1)
    return tokens, parents


def naive_dynamic(naive: NaiveRequest, tree: DynamicTree, keep: int) -> tuple[list[int],
                                                                              list[int]]:
    """EAGLE-2 with Python loops: candidates carry (id, score, token path, parent id);
    frontiers and the final selection sort by (score desc, id asc); the kept nodes are laid
    out in BFS order (depth, then the parent's BFS place, siblings best first)."""
    top_k = tree.top_k
    cands = []  # dicts: id, score, path (target tokens), parent

    def expand(parent):
        base, path = (0.0, ()) if parent is None else (parent["score"], parent["path"])
        for logprob, token in naive.ranked(path)[:top_k]:
            cands.append(dict(id=len(cands), score=base + logprob, path=path + (token,),
                              parent=-1 if parent is None else parent["id"]))

    expand(None)
    level = cands[:]
    naive.frontiers = []  # the token paths fed at each level, in frontier order
    for _ in range(1, tree.depth):
        frontier = sorted(level, key=lambda c: (-c["score"], c["id"]))[:top_k]
        naive.frontiers.append([c["path"] for c in frontier])
        first = len(cands)
        for node in frontier:
            expand(node)
        level = cands[first:]
    kept = sorted(cands, key=lambda c: (-c["score"], c["id"]))[:keep]
    kept_ids = [c["id"] for c in kept]
    by_id = {c["id"]: c for c in cands}
    assert all(c["parent"] < 0 or c["parent"] in kept_ids for c in kept)  # connected

    def sibling_rank(c):
        return kept_ids.index(c["id"])

    def key(c):  # (depth, then the ranks of the path's siblings, root first)
        chain = []
        while True:
            chain.append(sibling_rank(c))
            if c["parent"] < 0:
                break
            c = by_id[c["parent"]]
        return (len(chain), chain[::-1])

    bfs = sorted(kept, key=key)
    new = {c["id"]: i for i, c in enumerate(bfs)}
    return ([c["path"][-1] for c in bfs],
            [new[c["parent"]] if c["parent"] >= 0 else -1 for c in bfs])


class RecordingHead(torch.nn.Module):
    """Wraps the drafter's head: records each level forward's output (the fed nodes' hidden
    states) and delegates everything else."""

    def __init__(self, head):
        super().__init__()
        self.inner, self.outputs = head, []

    def forward(self, *args):
        out = self.inner(*args)
        self.outputs.append(out.detach().clone())
        return out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def assert_dynamic_level_hidden_match(setup: Setup):
    """Every fed frontier node's head output equals the naive chain's (float tolerance): this
    sees a wrong mask or parent hidden even where the top-k tokens happen not to change."""
    recorder = RecordingHead(setup.head)
    setup.proposer.tree_drafter.head = recorder
    try:
        setup.propose(setup.caches())
    finally:
        setup.proposer.tree_drafter.head = setup.head
    batch, top_k = len(setup.context_lens), setup.tree.top_k
    assert len(recorder.outputs) == setup.tree.depth - 1
    for b in range(batch):
        naive = NaiveRequest(setup, b)
        naive_dynamic(naive, setup.tree, setup.tree.num_nodes)
        for level, paths in enumerate(naive.frontiers):
            got = recorder.outputs[level].view(batch, top_k, -1)[b]
            want = torch.stack([naive.hidden(path) for path in paths])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def expected_trees(setup: Setup, keep: list[int] | None = None):
    """The naive tokens and parents of every request (dynamic: the best keep[b] nodes)."""
    out = []
    for b in range(len(setup.context_lens)):
        naive = NaiveRequest(setup, b)
        if isinstance(setup.tree, StaticTree):
            out.append(naive_static(naive, setup.tree.nodes))
        else:
            out.append(naive_dynamic(naive, setup.tree, setup.tree.num_nodes if keep is None
                                     else keep[b]))
    return out


def assert_matches(drafts, expected, first: list[int] | None = None):
    """Request b's first ``first[b]`` nodes (default: all) equal the reference."""
    for b, (tokens, parents) in enumerate(expected):
        n = len(tokens) if first is None else first[b]
        assert drafts.tokens[b, :n].tolist() == tokens[:n], f"request {b} tokens"
        assert drafts.parents[b, :n].tolist() == parents[:n], f"request {b} parents"


# --- static and dynamic trees against the reference ---------------------------------------------

STATIC_TREES = {"uniform_2x2": UNIFORM_TREE_2X2, "small_non_uniform": SMALL_NON_UNIFORM}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree_name", list(STATIC_TREES))
def test_static_tree_matches_the_naive_per_node_loop(heads, method, tree_name):
    tree = StaticTree.from_nodes(STATIC_TREES[tree_name])
    setup = Setup(heads(method, "TORCH_SDPA"), tree, [9, 3, 14], seed=1)
    drafts = setup.propose(setup.caches())
    assert drafts.tokens.shape == drafts.parents.shape == (3, tree.num_nodes)
    assert drafts.num_nodes.tolist() == [tree.num_nodes] * 3
    assert drafts.parents.tolist() == [list(tree.parents)] * 3
    assert_matches(drafts, expected_trees(setup))


def test_eagle_default_tree_matches_the_naive_per_node_loop(heads):
    tree = StaticTree.from_nodes(EAGLE_DEFAULT_TREE)
    assert tree.num_nodes == 25 and tree.depth == 5
    setup = Setup(heads("eagle3", "TORCH_SDPA"), tree, [6, 11], seed=2)
    assert_matches(setup.propose(setup.caches()), expected_trees(setup))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_dynamic_tree_matches_the_naive_eagle2_loop(heads, method):
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)
    setup = Setup(heads(method, "TORCH_SDPA"), tree, [9, 3, 14], seed=3)
    drafts = setup.propose(setup.caches())
    assert drafts.tokens.shape == (3, 5) and drafts.num_nodes.tolist() == [5, 5, 5]
    assert_matches(drafts, expected_trees(setup))
    assert_dynamic_level_hidden_match(setup)


def test_deeper_dynamic_tree_matches_the_naive_eagle2_loop(heads):
    """depth 4, top_k 3: frontier selection across parents and reranking over 3 levels."""
    tree = DynamicTree(depth=4, top_k=3, total_tokens=12)
    setup = Setup(heads("eagle", "TORCH_SDPA"), tree, [5, 12], seed=4)
    assert_matches(setup.propose(setup.caches()), expected_trees(setup))
    assert_dynamic_level_hidden_match(setup)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_every_tree_backend_matches_the_reference(heads, attention_backend, kind):
    tree = StaticTree.from_nodes(SMALL_NON_UNIFORM) if kind == "static" \
        else DynamicTree(depth=3, top_k=2, total_tokens=6)
    setup = Setup(heads("eagle", attention_backend), tree, [7, 2], seed=5)
    assert_matches(setup.propose(setup.caches()), expected_trees(setup))


# --- near max_model_len -------------------------------------------------------------------------

def fed_levels(tree) -> list[tuple[int, int]]:
    """(start, end) of the fed indices of every drafting level."""
    if isinstance(tree, StaticTree):
        return [(tree.level_starts[d - 1], tree.level_starts[d]) for d in range(1, tree.depth)]
    return [((d - 1) * tree.top_k, d * tree.top_k) for d in range(1, tree.depth)]


def written_slots(setup: Setup) -> set[int]:
    """Slots the drafting levels may write: live levels' fed nodes (P + 1 + end <= max)."""
    allowed = set()
    for b, n in enumerate(setup.context_lens):
        p = n - 1
        for start, end in fed_levels(setup.tree):
            if p + 1 + end <= setup.max_model_len:
                allowed |= {setup.slot(b, p + 1 + f) for f in range(start, end)}
    return allowed


def assert_only_live_levels_wrote(setup: Setup, after_first, after_tree):
    """Every slot outside the live levels' fed nodes is byte-identical to its state after the
    head's first forward (other requests, free blocks, the near-end request's dead levels)."""
    allowed = written_slots(setup)
    for first, tree in zip(after_first, after_tree):
        assert first.layout == tree.layout == "NHD"  # [num_blocks, block_size, heads, dim]
        for name in ("key", "value"):
            a, b = getattr(first, name), getattr(tree, name)
            rows = a.shape[0] * a.shape[1]
            changed = (a.reshape(rows, -1).view(torch.int32)
                       != b.reshape(rows, -1).view(torch.int32)).any(dim=1)
            changed_slots = set(torch.arange(rows)[changed].tolist())
            assert changed_slots <= allowed, f"{name} slots {sorted(changed_slots - allowed)}"
            assert changed_slots == allowed, f"live slots {sorted(allowed - changed_slots)}"


def run_with_canary(setup: Setup, budget_nodes=None):
    """-> (drafts, caches after the first forward only, caches after the tree)."""
    after_first = setup.caches(fill=7.0)
    setup.proposer.first_forward(*setup.inputs(), after_first)
    after_tree = setup.caches(fill=7.0)
    drafts = setup.propose(after_tree, budget_nodes)
    return drafts, after_first, after_tree


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_static_tree_near_max_model_len_writes_only_live_levels(heads, method):
    """EAGLE's tree (level ends 4, 12, 20, 23): request 1 (P = 27, max 48) has levels 1-3
    live (the last exactly: 28 + 20 = 48) and level 4 dead (28 + 23 > 48); request 2 (P 44) has every level dead. The nodes
    a request keeps (its first max_model_len - P - 1) equal the reference; nothing outside
    the live levels' slots changes."""
    tree = StaticTree.from_nodes(EAGLE_DEFAULT_TREE)
    setup = Setup(heads(method, "TORCH_SDPA"), tree, [9, 28, 45], seed=6)
    drafts, after_first, after_tree = run_with_canary(setup)
    keep = [min(tree.num_nodes, MAX_MODEL_LEN - n) for n in setup.context_lens]
    assert keep == [25, 20, 3]
    assert_matches(drafts, expected_trees(setup), first=keep)
    assert_only_live_levels_wrote(setup, after_first, after_tree)


def test_dynamic_tree_near_max_model_len_writes_only_live_levels(heads):
    """Request 1 (P 42): level 1 (fed 0..2) live, level 2 (fed 3..5) dead (43 + 6 > 48);
    request 2 (P 46): every level dead. The far request is unaffected."""
    tree = DynamicTree(depth=3, top_k=3, total_tokens=8)
    setup = Setup(heads("eagle", "TORCH_SDPA"), tree, [10, 43, 47], seed=7)
    drafts, after_first, after_tree = run_with_canary(setup)
    # The nodes each request keeps (its first max_model_len - P - 1) equal the reference.
    assert_matches(drafts, expected_trees(setup), first=[7, 5, 1])
    assert_only_live_levels_wrote(setup, after_first, after_tree)


# --- batch budget -------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [2, 3, 7, 15, 40])
def test_dynamic_batch_budget_counts_sum_to_the_budget_and_keep_trees(heads, budget):
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)
    setup = Setup(heads("eagle", "TORCH_SDPA"), tree, [9, 3, 14], seed=8)
    drafts = setup.propose(setup.caches(), budget_nodes=budget)
    counts = drafts.num_nodes.tolist()
    assert sum(counts) == min(budget, 3 * tree.num_nodes)
    assert all(0 <= c <= tree.num_nodes for c in counts)
    if budget >= 3:
        assert min(counts) >= 1  # the floor: every request keeps its best node
    assert_matches(drafts, expected_trees(setup, counts), first=counts)
    for b, n in enumerate(counts):
        parents = drafts.parents[b].tolist()
        assert all(-1 <= parents[i] < i for i in range(n))
        assert parents[n:] == [-1] * (tree.num_nodes - n)


def test_dynamic_batch_budget_follows_the_global_score_order(heads):
    """The counts are select_tree_batch_budget's rule re-done naively: each request's best
    node, then the best remaining candidates of the whole batch by cumulative log-prob.
    (Budget 12 over 3 requests: 4 nodes each on average, whose budget shape is the tree.)"""
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)
    assert budget_shape(tree, 4) == tree
    setup = Setup(heads("eagle3", "TORCH_SDPA"), tree, [9, 3, 14], seed=9)
    budget = 12
    drafts = setup.propose(setup.caches(), budget_nodes=budget)
    pool = []
    for b in range(3):
        naive = NaiveRequest(setup, b)
        scores = sorted(naive_scores(naive, tree), reverse=True)[:tree.num_nodes]
        pool += [(-s, b, j) for j, s in enumerate(scores[1:])]
    counts = [1, 1, 1]
    for _, b, _ in sorted(pool)[:budget - 3]:
        counts[b] += 1
    assert drafts.num_nodes.tolist() == counts


def naive_scores(naive: NaiveRequest, tree: DynamicTree) -> list[float]:
    """Every candidate's cumulative log-prob (the naive EAGLE-2 growth)."""
    top_k, scores = tree.top_k, []
    level = [(lp, (t,)) for lp, t in naive.ranked(())[:top_k]]
    scores += [s for s, _ in level]
    for _ in range(1, tree.depth):
        frontier = sorted(enumerate(level), key=lambda x: (-x[1][0], x[0]))[:top_k]
        level = [(s + lp, path + (t,)) for _, (s, path) in frontier
                 for lp, t in naive.ranked(path)[:top_k]]
        scores += [s for s, _ in level]
    assert all(not math.isnan(s) for s in scores)
    return scores


def test_static_budget_cuts_every_request_to_the_same_bfs_prefix(heads):
    tree = StaticTree.from_nodes(SMALL_NON_UNIFORM)
    setup = Setup(heads("eagle", "TORCH_SDPA"), tree, [9, 3], seed=10)
    full = setup.propose(setup.caches())
    cut = setup.propose(setup.caches(), budget_nodes=9)
    assert cut.num_nodes.tolist() == [4, 4]
    assert torch.equal(cut.tokens, full.tokens) and torch.equal(cut.parents, full.parents)
    assert all(-1 <= q < i for i, q in enumerate(tree.parents[:4]))
