"""The batch node budget of a dynamic-tree step from measured costs: how many tree nodes the
whole batch verifies next step (the N of ``select_tree_batch_budget``), by the rule the chain's
draft count follows (rocdraft/spec_decode/cost_model.py): the most expected tokens per second.

The model. A request that keeps only its n best nodes by EAGLE-2's score (the cumulative
log-probability under the head; the batch budget keeps nodes by the same score) emits in
expectation 1 + A(n) tokens per step, A(n) its expected accepted drafts. A(n) is measured,
not derived from the scores (heads are rarely calibrated, and their errors compound along a
path): every verified full-size tree tells, for each n at once, how many drafts it would have
accepted had it kept only its n best nodes: the accepted path's leading nodes whose score rank
is below n (``accepted_within``; a path's scores only fall, so the path is cut where its first
node drops out). ``TreeAcceptanceEstimate`` keeps the running mean of that count per n.
A step verifying n nodes per request costs (``StepCosts`` measured for tree steps,
rocdraft/spec_decode/step_costs.py)

    T(n) = StepCosts.time_for_drafts(B, B * n, levels(n) + 1)

where levels(n) is the number of level forwards of the tree drafted for n nodes
(``budget_shape``; ``draft_step`` is one level's cost). The budget is N = B * n* with
n* = argmax_n (1 + A(n)) / T(n) over n = 1 .. num_nodes (ties: the smaller n), kept only
when it beats the full tree by ``CUT_MARGIN`` (25%: the costs fitted on dummy inputs
overestimate a full tree's step against a cut one: on the built-in pair at batch 1 they put
T(15) / T(1) at 2.6 where the realized steps gave about 1.9, and a 5% margin cut the trees to
one node and lost a quarter of the speed; a cut the model expects to win by a quarter pays:
batch 8 keeps 3 nodes per request, 5-12% faster than the full tree);
``select_tree_batch_budget`` then spreads N over the batch by score, so requests on which
the head is confident get more than n* nodes and the others fewer.

Worked example (B = 1, A = 0.9, 1.4, 1.6, 1.7 for n = 1..4; target_fixed 5 ms, per token
1 ms, no head costs, draft_step 1 ms, and say levels(n) = n - 1): T(n) = 5 + (1 + n) +
(n - 1) = 5 + 2n ms, so (1 + A(n)) / T(n) for n = 1..4 is 1.9 / 7 = 0.271, 2.4 / 9 = 0.267,
2.6 / 11 = 0.236, 2.7 / 13 = 0.208 tokens/ms: n* = 1.

Exploration: A(n) past n* is only seen in full-size trees, so until the first ones are
verified, and then every ``EXPLORE_EVERY``-th step, the engine drafts the full tree (no
budget). Greedy outputs never depend on the budget (every emitted token is the target's own).
"""
from __future__ import annotations

from rocdraft.spec_decode.cost_model import RATE_DECAY, StepCosts
from rocdraft.drafter.tree_spec import DynamicTree, budget_shape

CUT_MARGIN = 1.25


def accepted_within(scores: list[float], accepted_nodes: list[int]) -> list[int]:
    """For n = 1 .. len(scores): the drafts a request would have accepted keeping only its n
    best nodes. scores: its nodes' scores (node order); accepted_nodes: the accepted path's
    node indices, depth 1 first. Ties in score rank by node index (BFS order).

    Example: scores [-0.1, -0.5, -0.3, -2.0] (ranks 0, 2, 1, 3), accepted path [0, 2]:
    n = 1 -> 1 (node 2 has rank 1), n = 2 -> 2, n = 3 -> 2, n = 4 -> 2.
    """
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    rank = {node: r for r, node in enumerate(order)}
    counts = [0] * len(scores)
    cut = len(scores)  # the path's prefix length is limited by its highest rank so far
    worst = -1
    for depth, node in enumerate(accepted_nodes, start=1):
        worst = max(worst, rank[node])
        for n in range(worst + 1, cut + 1):  # every n > worst keeps this node's whole prefix
            counts[n - 1] = depth
    return counts


class TreeAcceptanceEstimate:
    """A(n), n = 1 .. num_nodes: the running mean of ``accepted_within`` over verified
    full-size trees (decay ``RATE_DECAY`` per observed step)."""

    def __init__(self, num_nodes: int) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.num_nodes = num_nodes
        self.accepted: list[float] | None = None  # A(1) .. A(num_nodes); None until observed

    def observe(self, rows: list[tuple[list[float], list[int]]]) -> None:
        """One step's verified full-size trees: per request (its nodes' scores, its accepted
        path's node indices). Rows of another size are ignored."""
        counts = [accepted_within(scores, path) for scores, path in rows
                  if len(scores) == self.num_nodes]
        if not counts:
            return
        mean = [sum(col) / len(counts) for col in zip(*counts)]
        if self.accepted is None:
            self.accepted = mean
        else:
            keep = 1.0 - RATE_DECAY
            self.accepted = [keep * a + (1.0 - keep) * m for a, m in zip(self.accepted, mean)]


def choose_nodes_per_request(accepted: list[float], costs: StepCosts, batch_size: int,
                             tree: DynamicTree) -> int:
    """n* of the module docstring: the nodes per request that maximise expected tokens per
    second (num_nodes unless a smaller n beats it by CUT_MARGIN); accepted: A(1) ..
    A(num_nodes). A pure function of its inputs."""
    if len(accepted) != tree.num_nodes:
        raise ValueError(f"accepted has {len(accepted)} entries, the tree {tree.num_nodes} "
                         f"nodes")
    best_n, best_rate = 1, -1.0
    for n in range(1, tree.num_nodes + 1):
        levels = budget_shape(tree, n).depth - 1
        time = costs.time_for_drafts(batch_size, batch_size * n, levels + 1)
        rate = (1.0 + accepted[n - 1]) / time
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    return best_n if best_rate > rate * CUT_MARGIN else tree.num_nodes
