"""Tree verification: greedy worked examples and a naive reference, equivalence with the chain
sampler on chain-shaped trees, top-k/top-p rows, seeded reproducibility, and losslessness of
random verification (the emitted tokens follow the target's joint distribution)."""
from __future__ import annotations

import pytest
import torch

import stats
from rocdraft.config import SamplingParams
from rocdraft.errors import RocdraftError
from rocdraft.sample.rejection_sampler import rejection_sample
from rocdraft.sample.sampler import SamplingTensors, target_probs
from rocdraft.sample.tree_sampler import tree_verify

# Nodes (0,), (1,), (2,), (0, 0), (0, 1), (1, 0): three root children, two under node 0, one
# under node 1 (BFS order, siblings by rank).
PARENTS = [-1, -1, -1, 0, 0, 1]


def argmax_logits(argmax_rows, vocab, seed=0):
    """Target logits [B, width, vocab] whose argmax at (b, r) is argmax_rows[b][r]."""
    logits = torch.randn(len(argmax_rows), len(argmax_rows[0]), vocab,
                         generator=torch.Generator().manual_seed(seed))
    for b, row in enumerate(argmax_rows):
        for r, t in enumerate(row):
            logits[b, r, t] = 10.0
    return logits


def tensors(params, gens=None, position_seeds=None):
    gens = [None] * len(params) if gens is None else gens
    return SamplingTensors.build(params, gens, "cpu", position_seeds=position_seeds)


def greedy(n):
    return tensors([SamplingParams(temperature=0.0)] * n)


def verify(logits, drafts, parents, num_nodes, sampling, max_depth):
    b = logits.shape[0]
    expand = lambda x: torch.tensor(x).expand(b, -1) if not torch.is_tensor(x) else x  # noqa: E731
    return tree_verify(logits, expand(drafts), expand(parents), torch.as_tensor(num_nodes),
                       sampling, max_depth)


def naive_greedy(argmax_rows, drafts, parents, num_nodes, max_depth):
    """Per-node loop of the greedy rule -> (accepted node per depth, emitted tokens)."""
    current, path, out = -1, [], []
    for depth in range(max_depth + 1):
        token = argmax_rows[current + 1]
        out.append(token)
        if depth == max_depth:
            break
        kids = [i for i in range(num_nodes) if parents[i] == current and drafts[i] == token]
        if not kids:
            break
        current = kids[0]
        path.append(current)
    return path + [-1] * (max_depth - len(path)), out + [-1] * (max_depth + 1 - len(out))


# --- greedy ---------------------------------------------------------------------------------

def test_greedy_worked_examples():
    vocab = 10
    drafts = [5, 6, 7, 1, 2, 3]  # node tokens; rows: 0 root, i + 1 node i
    argmax_rows = [
        [6, 9, 3, 9, 9, 9, 9],  # root -> 6 = node 1 (rank 1); node 1 -> 3 = node 5; bonus 9
        [8, 9, 9, 9, 9, 9, 9],  # 8 is no root child: nothing accepted, 8 is the correction
        [5, 2, 9, 9, 9, 4, 9],  # root -> node 0; node 0 -> 2 = node 4 (rank 1); bonus 4
        [5, 8, 9, 9, 9, 9, 9],  # node 0 accepted, 8 is none of its children
        [7, 9, 9, 1, 9, 9, 9],  # node 2 (rank 2, a leaf): bonus at node 2
    ]
    out = verify(argmax_logits(argmax_rows, vocab), drafts, PARENTS, [6] * 5, greedy(5), 2)
    assert out.accepted_nodes.tolist() == [[1, 5], [-1, -1], [0, 4], [0, -1], [2, -1]]
    assert out.num_accepted.tolist() == [2, 0, 2, 1, 1]
    assert out.sampled.tolist() == [[6, 3, 9], [8, -1, -1], [5, 2, 4], [5, 8, -1], [7, 1, -1]]
    for t in (out.accepted_nodes, out.num_accepted, out.sampled):
        assert t.dtype == torch.int64


def test_greedy_ignores_padding_nodes_and_handles_ragged_num_nodes():
    vocab = 10
    drafts = [5, 6, 7, 1, 2, 3]
    argmax_rows = [[5, 2, 3, 9, 9, 8, 9]] * 4  # root -> node 0 -> node 4 -> bonus 8
    num_nodes = [6, 4, 1, 0]
    out = verify(argmax_logits(argmax_rows, vocab), drafts, PARENTS, num_nodes, greedy(4), 2)
    assert out.accepted_nodes.tolist() == [[0, 4], [0, -1], [0, -1], [-1, -1]]
    assert out.sampled.tolist() == [[5, 2, 8], [5, 2, -1], [5, 2, -1], [5, -1, -1]]
    # Padding entries are junk: padding nodes claiming to be matching children of the root
    # are never accepted.
    junk_drafts = torch.tensor([[5, 6, 7, 1, 2, 3], [9, 5, 5, 5, 5, 5]])
    junk_parents = torch.tensor([PARENTS, [-1, -1, -1, -1, -1, -1]])
    out = verify(argmax_logits([[5, 2, 3, 9, 9, 8, 9]] * 2, vocab), junk_drafts, junk_parents,
                 [6, 1], greedy(2), 2)
    assert out.sampled.tolist() == [[5, 2, 8], [5, -1, -1]]


def test_greedy_full_depth_and_depth_limit():
    # A chain of three nodes all matching: max_depth 3 accepts all and emits the bonus;
    # max_depth 2 stops at depth 2 (deeper nodes are never accepted) with node 1's argmax.
    vocab = 10
    argmax_rows = [[4, 5, 6, 7]]
    logits = argmax_logits(argmax_rows, vocab)
    out = verify(logits, [4, 5, 6], [-1, 0, 1], [3], greedy(1), 3)
    assert out.accepted_nodes.tolist() == [[0, 1, 2]] and out.sampled.tolist() == [[4, 5, 6, 7]]
    out = verify(logits, [4, 5, 6], [-1, 0, 1], [3], greedy(1), 2)
    assert out.accepted_nodes.tolist() == [[0, 1]] and out.sampled.tolist() == [[4, 5, 6]]
    out = verify(logits, [4, 5, 6], [-1, 0, 1], [3], greedy(1), 0)
    assert out.accepted_nodes.shape == (1, 0) and out.sampled.tolist() == [[4]]
    # No nodes at all (N = 0): one sampled token.
    out = verify(logits[:, :1], torch.zeros(1, 0, dtype=torch.long),
                 torch.zeros(1, 0, dtype=torch.long), [0], greedy(1), 2)
    assert out.sampled.tolist() == [[4, -1, -1]] and out.num_accepted.tolist() == [0]


def test_duplicate_sibling_tokens_accept_the_first():
    vocab = 6
    out = verify(argmax_logits([[3, 1, 0, 0]], vocab), [3, 3, 0], [-1, -1, 1], [3], greedy(1), 2)
    assert out.accepted_nodes.tolist() == [[0, -1]]  # node 0, not node 1 (whose child matches)
    assert out.sampled.tolist() == [[3, 1, -1]]


def random_trees(g, batch, max_nodes, vocab):
    """Random trees (parents[i] < i, any shape), ragged node counts, drafts often matching."""
    num_nodes = torch.randint(0, max_nodes + 1, (batch,), generator=g)
    parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g))
                                         for i in range(max_nodes)]) for _ in range(batch)])
    drafts = torch.randint(0, vocab, (batch, max_nodes), generator=g)
    return drafts, parents, num_nodes


def test_greedy_matches_naive_on_random_trees():
    g = torch.Generator().manual_seed(1)
    vocab, max_nodes = 3, 8  # a tiny vocab so that many drafts match
    for trial in range(30):
        batch = int(torch.randint(1, 6, (1,), generator=g))
        max_depth = int(torch.randint(0, 5, (1,), generator=g))
        drafts, parents, num_nodes = random_trees(g, batch, max_nodes, vocab)
        logits = torch.randn(batch, max_nodes + 1, vocab, generator=g)
        out = tree_verify(logits, drafts, parents, num_nodes, greedy(batch), max_depth)
        argmax = logits.argmax(-1)
        for b in range(batch):
            path, emitted = naive_greedy(argmax[b].tolist(), drafts[b].tolist(),
                                         parents[b].tolist(), int(num_nodes[b]), max_depth)
            assert out.accepted_nodes[b].tolist() == path, (trial, b)
            assert out.sampled[b].tolist() == emitted, (trial, b)
            assert int(out.num_accepted[b]) == sum(n >= 0 for n in path)


def test_greedy_row_inside_a_random_batch():
    vocab = 10
    argmax_rows = [[5, 2, 3, 9, 9, 8, 9]] * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=3)]
    st_ = tensors(params, position_seeds=[None, None, (3, 0)])
    out = verify(argmax_logits(argmax_rows, vocab), [5, 6, 7, 1, 2, 3], PARENTS, [6] * 3, st_, 2)
    assert out.sampled[1].tolist() == [5, 2, 8]
    assert out.accepted_nodes[1].tolist() == [0, 4]


# --- the chain sampler is the special case of a chain-shaped tree ---------------------------

def chain_parents(batch, k):
    return torch.arange(-1, k - 1).expand(batch, k)


def test_chain_tree_matches_the_chain_sampler_greedy():
    g = torch.Generator().manual_seed(2)
    vocab, k = 4, 5
    for _ in range(10):
        batch = int(torch.randint(1, 6, (1,), generator=g))
        logits = torch.randn(batch, k + 1, vocab, generator=g)
        targets = logits.argmax(-1)
        drafts = torch.where(torch.rand(batch, k, generator=g) < 0.7, targets[:, :k],
                             torch.randint(0, vocab, (batch, k), generator=g))
        num = torch.randint(0, k + 1, (batch,), generator=g)
        want = rejection_sample(logits, drafts, num, num.tolist(), greedy(batch))
        out = tree_verify(logits, drafts, chain_parents(batch, k), num, greedy(batch), k)
        assert out.sampled.tolist() == want.tolist()
        assert out.num_accepted.tolist() == ((want >= 0).sum(1) - 1).tolist()


def test_chain_tree_matches_the_chain_sampler_random():
    """Same noise as the chain sampler: identical outputs for generator rows (every row
    verifying max_depth drafts, so both consume the same) and for seeded rows at any count."""
    g = torch.Generator().manual_seed(3)
    vocab, k, batch = 5, 3, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 0.5
    drafts = torch.where(torch.rand(batch, k, generator=g) < 0.6, logits[:, :k].argmax(-1),
                         torch.randint(0, vocab, (batch, k), generator=g))
    params = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0.0),
              SamplingParams(seed=4, top_p=0.8), SamplingParams(seed=5), SamplingParams()]
    seeds = [None, None, None, (4, 7), (5, 0), None]

    def sampling():
        gens = [torch.Generator().manual_seed(10 + i) for i in range(batch)]
        return tensors(params, gens, seeds)

    full = torch.full((batch,), k)
    want = rejection_sample(logits, drafts, full, full.tolist(), sampling())
    out = tree_verify(logits, drafts, chain_parents(batch, k), full, sampling(), k)
    assert out.sampled.tolist() == want.tolist()
    ragged = torch.tensor([k, k, k, 1, 0, k])  # seeded rows 3 and 4 with fewer drafts
    want = rejection_sample(logits, drafts, ragged, ragged.tolist(), sampling())
    out = tree_verify(logits, drafts, chain_parents(batch, k), ragged, sampling(), k)
    assert out.sampled[3:5].tolist() == want[3:5].tolist()


# --- random: structure, top-k/top-p, seeds --------------------------------------------------

def row_probs(logits, params):
    """target_probs of every tree row of every request -> [B, N + 1, V]."""
    b, width, vocab = logits.shape
    rep = lambda vals, dt: torch.tensor(vals, dtype=dt).repeat_interleave(width)  # noqa: E731
    return target_probs(logits.reshape(-1, vocab),
                        rep([p.temperature for p in params], torch.float32),
                        rep([max(p.top_k, 0) for p in params], torch.long),
                        rep([p.top_p for p in params], torch.float32)).view(b, width, vocab)


def test_random_output_structure_with_top_k_and_top_p():
    """Every row: an accepted path (each node a child of the previous one, token = draft),
    then one emitted token, then -1; every emitted token is inside its row's top-k/top-p
    support; after a rejection the emitted token is none of the current node's children."""
    g = torch.Generator().manual_seed(4)
    batch, max_nodes, vocab, max_depth = 96, 7, 6, 3
    drafts, parents, num_nodes = random_trees(g, batch, max_nodes, vocab)
    logits = torch.randn(batch, max_nodes + 1, vocab, generator=g)
    params = [[SamplingParams(top_k=3), SamplingParams(top_p=0.7, temperature=0.8),
               SamplingParams(top_k=2, top_p=0.9), SamplingParams()][i % 4] for i in range(batch)]
    torch.manual_seed(5)
    out = tree_verify(logits, drafts, parents, num_nodes, tensors(params), max_depth)
    probs = row_probs(logits, params)
    for b in range(batch):
        n, path = int(out.num_accepted[b]), out.accepted_nodes[b].tolist()
        row = out.sampled[b].tolist()
        assert path[n:] == [-1] * (max_depth - n) and row[n + 1:] == [-1] * (max_depth - n)
        current = -1
        for d in range(n + 1):
            assert probs[b, current + 1, row[d]] > 0, "emitted a token outside top-k/top-p"
            if d < n:
                node = path[d]
                assert node < int(num_nodes[b]) and int(parents[b, node]) == current
                assert int(drafts[b, node]) == row[d]
                current = node
        if n < max_depth:  # stopped by a rejection: the emitted token is no real child's
            kids = [i for i in range(int(num_nodes[b])) if int(parents[b, i]) == current]
            assert row[n] not in [int(drafts[b, i]) for i in kids]


def test_child_outside_top_k_is_never_accepted():
    batch, vocab = 2000, 5
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]).expand(batch, 3, vocab).contiguous()
    torch.manual_seed(6)
    out = verify(logits, [0, 1], [-1, -1], [2] * batch,
                 tensors([SamplingParams(top_k=2)] * batch), 1)
    assert bool((out.num_accepted == 0).all())
    assert set(out.sampled[:, 0].tolist()) == {3, 4}


def test_seeded_rows_reproduce_target_only_and_ignore_batch_neighbours():
    """A seeded row's emitted token at depth d is what target-only sampling draws at output
    index + d after the same prefix, whatever its batch neighbours."""
    vocab, index = 4, 4
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, len(PARENTS) + 1, vocab, generator=g) * 0.4  # flat-ish
    drafts = torch.tensor([[0, 1, 2, 0, 1, 0]]).expand(3, -1)  # many drafts accepted
    params = [SamplingParams(seed=0, top_k=3), SamplingParams(), SamplingParams(temperature=0.0)]

    def run(rows, seed):
        seeds = {0: (seed, index), 1: None, 2: None}
        st_ = tensors([params[i] for i in rows], position_seeds=[seeds[i] for i in rows])
        return tree_verify(logits[rows], drafts[rows], torch.tensor(PARENTS).expand(len(rows), -1),
                           torch.full((len(rows),), len(PARENTS)), st_, 2)

    outcomes, depths = set(), []
    for seed in range(40):
        full = run([0, 1, 2], seed)
        emitted = full.sampled[0].tolist()
        assert run([0], seed).sampled[0].tolist() == emitted
        assert run([2, 1, 0], seed).sampled[2].tolist() == emitted
        # Target-only at index + d, on the row of the accepted prefix.
        rows = [0] + [node + 1 for node in full.accepted_nodes[0].tolist() if node >= 0]
        for d, r in enumerate(rows):
            alone = tensors([params[0]], position_seeds=[(seed, index + d)])
            one = rejection_sample(logits[:1, r:r + 1], torch.zeros(1, 0, dtype=torch.long),
                                   torch.tensor([0]), [0], alone)
            assert int(one[0, 0]) == emitted[d], (seed, d)
        outcomes.add(tuple(emitted))
        depths.append(len(rows) - 1)
    assert depths.count(1) > 5 and depths.count(2) > 5, depths  # deep paths were checked
    assert len(outcomes) > 5  # and the seed matters


def test_generator_rows_consume_the_same_regardless_of_the_batch():
    vocab = 5
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, len(PARENTS) + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (3, len(PARENTS)), generator=g)

    def two_steps(rows):
        gen = torch.Generator().manual_seed(99)
        st_ = tensors([SamplingParams()] * len(rows), [gen if i == 0 else None for i in rows])
        args = (logits[rows], drafts[rows], torch.tensor(PARENTS).expand(len(rows), -1),
                torch.tensor([6, 3, 0])[rows], st_, 2)
        tree_verify(*args)
        return tree_verify(*args).sampled[rows.index(0)].tolist()

    assert two_steps([0]) == two_steps([1, 0]) == two_steps([2, 1, 0])


def test_bad_shapes_are_refused():
    logits = torch.zeros(2, 4, 5)
    ok = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(RocdraftError, match="draft_tokens"):
        tree_verify(logits, torch.zeros(2, 2, dtype=torch.long), ok, torch.tensor([3, 3]),
                    greedy(2), 2)
    with pytest.raises(RocdraftError, match="parents"):
        tree_verify(logits, ok, torch.zeros(2, 4, dtype=torch.long), torch.tensor([3, 3]),
                    greedy(2), 2)
    with pytest.raises(RocdraftError, match="max_depth"):
        tree_verify(logits, ok, ok, torch.tensor([3, 3]), greedy(2), -1)


# --- random: losslessness -------------------------------------------------------------------

# A toy target over 5 tokens: logits after the root, after one token a, after tokens (a, b).
VOCAB = 5
L0 = torch.tensor([0.2, 1.5, -0.5, 1.0, -1.0])
L1 = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(11))
L2 = torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(12))
# The tree: root children tokens 1, 3, 0; node 0 (token 1) has children 2, 4; node 1 (token 3)
# has child 1. Drafts are the likely tokens, so paths are often accepted.
TREE_TOKENS = [1, 3, 0, int(L1[1].argmax()), int(L1[1].argsort()[-2]), 1]


def tree_logits():
    """The target's logits [N + 1, V] at the root and at every node of the tree."""
    rows = [L0]
    for i, (tok, par) in enumerate(zip(TREE_TOKENS, PARENTS)):
        rows.append(L1[tok] if par < 0 else L2[TREE_TOKENS[par], tok])
    return torch.stack(rows)


def sequential_rejection(probs, drafts, parents, max_depth, gen, zero_rejected=True):
    """The rule written out (a uniform per child trial, an explicit residual), vectorized over
    rows that share one tree: probs [B, N + 1, V] -> sampled [B, max_depth + 1]."""
    batch, width, vocab = probs.shape
    kids = [[i for i in range(width - 1) if parents[i] == u] for u in range(-1, width - 1)]
    most = max(len(k) for k in kids)
    table = torch.tensor([k + [-1] * (most - len(k)) for k in kids])  # [N + 1, most]
    tokens = torch.tensor(drafts + [0])  # index -1 -> a dummy
    current = torch.full((batch,), -1)
    walking = torch.ones(batch, dtype=torch.bool)
    out = torch.full((batch, max_depth + 1), -1)
    for depth in range(max_depth + 1):
        residual = probs[torch.arange(batch), current + 1].clone()
        decided = ~walking
        moved = torch.zeros(batch, dtype=torch.bool)
        for slot in range(most if depth < max_depth else 0):
            child = table[current + 1, slot]  # [B]
            tried = (child >= 0) & ~decided
            x = tokens[child]
            px = residual.gather(1, x.unsqueeze(1)).squeeze(1)
            accept = tried & (torch.rand(batch, generator=gen) * residual.sum(1) < px)
            out[accept, depth] = x[accept]
            current = torch.where(accept, child, current)
            moved |= accept
            decided |= accept
            reject = tried & ~accept
            if zero_rejected:
                residual[reject, x[reject]] = 0.0
        draw = torch.multinomial(residual / residual.sum(1, keepdim=True).clamp(min=1e-30) + 1e-30,
                                 1, generator=gen).squeeze(1)
        out[~decided, depth] = draw[~decided]
        walking = moved
    return out


def chi_square_p_value(counts, probs):
    """The shared fit, after checking that no token of zero target probability was emitted
    (the residual's rounding leaves probabilities below 1e-12 that count as zero)."""
    support = probs > 1e-12
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    return stats.chi_square_p_value(counts, probs, min_prob=1e-12)


def check_lossless(sampled, params, gen):
    """The first emitted token follows p_root and the (first, second) pair follows
    p_root(a) * p_a(b); where a step emitted one token, the second is drawn target-only."""
    def probs(logits):  # [..., V] -> [n, V] under params
        rows = logits.numel() // VOCAB
        return row_probs(logits.reshape(1, rows, VOCAB), [params])[0]

    p0, p1 = probs(L0)[0], probs(L1)  # [V], [V (after a), V]
    first = sampled[:, 0]
    second = torch.where(sampled[:, 1] >= 0, sampled[:, 1],
                         torch.multinomial(p1[first], 1, generator=gen).squeeze(1))
    p_first = chi_square_p_value(torch.bincount(first, minlength=VOCAB).double(), p0)
    pairs = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double()
    p_pair = chi_square_p_value(pairs, (p0.unsqueeze(1) * p1).flatten())
    assert p_first > 1e-3 and p_pair > 1e-3, f"chi-square p: first {p_first:.2e}, pair {p_pair:.2e}"


STAT_PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=3),
               SamplingParams(temperature=1.2, top_p=0.8)]


@pytest.mark.parametrize("params", STAT_PARAMS, ids=["t1", "top_k", "top_p"])
def test_random_tree_verification_is_lossless(params):
    n = 20_000
    logits = tree_logits().expand(n, -1, -1).contiguous()
    torch.manual_seed(13)
    out = verify(logits, TREE_TOKENS, PARENTS, [len(PARENTS)] * n, tensors([params] * n), 2)
    assert float(out.num_accepted.float().mean()) > 0.5, "the test must exercise acceptance"
    assert int((out.num_accepted == 2).sum()) > 1000
    check_lossless(out.sampled, params, torch.Generator().manual_seed(14))
    # The bonus after a fully accepted path follows the target at the last node.
    for leaf in (3, 4, 5):
        hit = out.accepted_nodes[:, 1] == leaf
        if int(hit.sum()) > 500:
            want = row_probs(logits[:1], [params])[0, leaf + 1]
            counts = torch.bincount(out.sampled[hit, 2], minlength=VOCAB).double()
            assert chi_square_p_value(counts, want) > 1e-3


@pytest.mark.parametrize("params", STAT_PARAMS, ids=["t1", "top_k", "top_p"])
def test_the_written_out_rule_is_lossless_and_the_check_catches_a_broken_residual(params):
    """The explicit sequential rule passes the same check, and forgetting to zero a rejected
    child (the classic bug) fails it: the statistical test is not vacuous."""
    n = 20_000
    probs = row_probs(tree_logits().expand(n, -1, -1), [params] * n)
    gen = torch.Generator().manual_seed(15)
    good = sequential_rejection(probs, TREE_TOKENS, PARENTS, 2, gen)
    check_lossless(good, params, gen)
    bad = sequential_rejection(probs, TREE_TOKENS, PARENTS, 2, gen, zero_rejected=False)
    with pytest.raises(AssertionError, match="chi-square"):
        check_lossless(bad, params, gen)
