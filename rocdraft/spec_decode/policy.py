"""``DraftPolicy``: the one owner of every speculative decision the engine asks for, and of
the estimates those decisions read.

The engine asks, before it drafts:
- ``num_drafts(batch_size, outlook)``: drafts per request a chain config makes now (the
  cap ``drafts_per_request``, or under ``draft_policy="cost"`` the count maximising expected
  tokens per second on the step times the engine realized, start-up costs only their prior,
  with probes of the other counts priced by what they cost, rocdraft/spec_decode/
  realized_times.py; with given ``draft_costs`` on those costs alone; with a
  ``BatchOutlook`` (the batch is all the work left, its ends known) the count that finishes
  the batch soonest, rocdraft/spec_decode/batch_finish.py); a tree config answers its node
  count (the tree's own shape decides);
- ``shape(batch_size)``: "tree" or "chain" for a tree config (rocdraft/spec_decode/
  draft_shape.py), and ``chain_drafts_in_tree_mode(batch_size, outlook)`` when it is
  "chain" (decided as a chain config decides, on the realized times of the tree config's
  own chain steps and the batch's outlook, repeated between fresh decisions);
- ``tree_budget(batch_size)``: the batch node budget of the trees drafted now (the
  configured one, or the cost-based one of rocdraft/spec_decode/tree_budget.py);
- ``costs_to_measure(largest_bucket)``: which step-cost tables it still lacks (the engine
  measures them, rocdraft/spec_decode/step_costs.py, and hands them back with ``add_costs``).

After every step the engine tells it what happened in one ``observe(StepRecord)``
(rocdraft/spec_decode/step_record.py): the chains' verified and accepted drafts, the
verified dynamic trees' scores and paths, the step's time and tokens. The policy never
calls a runner; it holds numbers, not models.

State: acceptance (AcceptanceTracker, per chain position), step costs per batch bucket for
the chain config or the dynamic tree (``step_costs``) and for a tree config's chains
(``chain_step_costs``), the realized step times of a chain config and of a tree config's
chains (``chain_times``), the tree acceptance
estimate, the shape chooser and the shape drafted last step. Which of them exist follows
from the config alone (the constructor's comments say when).
"""
from __future__ import annotations

from rocdraft.config import SpeculativeConfig
from rocdraft.drafter.tree_spec import DynamicTree, StaticTree
from rocdraft.spec_decode.batch_finish import (BatchOutlook, RequestAcceptance,
                                               outlook_step_times, useful_drafts)
from rocdraft.spec_decode.cost_model import (EXPLORE_EVERY, AcceptanceTracker, StepCosts,
                                             batch_bucket)
from rocdraft.spec_decode.draft_shape import DraftShapeChooser, chain_on_tree_step
from rocdraft.spec_decode.realized_times import (RealizedStepTimes, best_num_drafts,
                                                 prior_times, rescale)
from rocdraft.spec_decode.step_record import StepRecord, verified_per_request
from rocdraft.spec_decode.tree_budget import TreeAcceptanceEstimate, choose_nodes_per_request


SURE_SCALE = 2.0  # standard errors off 1 a lone request's scale must read to be used
# A chain config's cost policy decides afresh every DECIDE_EVERY-th step of one batch size
# and cap, and repeats its last decision in between (``num_drafts``). Near a batch's end it
# decides afresh as often as the batch size or the cap (``useful_drafts``) changes, and no
# more: deciding every step once a request was within 4 full steps of its end moved the
# batch simulations' times by -0.6% to +1.1% (1.0372x the best fixed count's on average
# with it, 1.0364x without) and cost 0.4-0.8% of a bs 8 run on the built-in pair
# (docs/draft-policy.md, twelfth session).
DECIDE_EVERY = 4


class DraftPolicy:
    def __init__(self, spec: SpeculativeConfig, tree: StaticTree | DynamicTree | None) -> None:
        self.spec, self.tree = spec, tree
        cost_policy = spec.draft_policy == "cost"
        self.acceptance = AcceptanceTracker(spec.num_speculative_tokens, spec.acceptance_prior)
        self.step_costs: dict[int, StepCosts] = {}  # bucket -> chain (or dynamic tree) costs
        self.chain_step_costs: dict[int, StepCosts] = {}  # a tree config's chains, per bucket
        self.given_step_costs = StepCosts(*spec.draft_costs) if spec.draft_costs else None
        self.policy_steps = 0  # steps the cost policy chose for (drives its exploration)
        # Chains under the cost policy with measured costs: the step times the engine
        # realized per draft count (the measured costs their prior).
        self.realized_times = RealizedStepTimes(spec.num_speculative_tokens) \
            if cost_policy and spec.draft_costs is None and tree is None else None
        # Chains under the cost policy with given costs: the same decision on those costs.
        self.given_times = RealizedStepTimes(spec.num_speculative_tokens, sweep=False) \
            if cost_policy and spec.draft_costs is not None and tree is None else None
        # A tree config under the cost policy drafts per batch bucket the tree or a chain of
        # at most min(k, depth) drafts, whichever measured faster (``shape_chooser``).
        chooses_shape = tree is not None and cost_policy and spec.draft_costs is None
        # Either of them, or a tree config's chains: each request's own acceptance, for the
        # batch's finish time.
        self.request_acceptance = RequestAcceptance() \
            if cost_policy and (tree is None or chooses_shape) else None
        # A dynamic tree under the cost policy without a fixed budget: the batch budget of
        # each step comes from the step costs and measured acceptance.
        self.tree_acceptance = TreeAcceptanceEstimate(tree.num_nodes) \
            if isinstance(tree, DynamicTree) and cost_policy \
            and spec.max_draft_tokens_per_step is None else None
        self.shape_chooser = DraftShapeChooser() if chooses_shape else None
        # Its chains: the chain config's rule (realized step times of those chains, at least
        # one draft: the drafter always runs), so a chain step costs a chain config's step.
        self.chain_times = RealizedStepTimes(self._chain_cap(), min_drafts=1) \
            if self.shape_chooser is not None else None
        self.drafted_shape: str | None = None  # what the last step drafted
        self.drafted_last = 0  # a chain config's cost policy: its last decision's drafts
        # ... what it was decided for, and the steps it has been repeated since
        self.decided_for: tuple | None = None  # (batch size, cap, with an outlook?)
        self.repeats = 0
        # Steps observed and not yet folded in (``defer_observations``, ``flush``)
        self.defer_observations = False
        self.pending: list[StepRecord] = []
        self.chain_drafts = 0  # drafts per request of the chain drafted last in tree mode

    # --- what the engine asks before drafting ----------------------------------------------

    def drafts_per_request(self, batch_size: int) -> int:
        """The most drafts each request may verify next step: k, or fewer when
        ``max_draft_tokens_per_step`` caps the batch's total (0: plain decoding)."""
        spec = self.spec
        if spec.max_draft_tokens_per_step is None:
            return spec.num_speculative_tokens
        return min(spec.num_speculative_tokens, spec.max_draft_tokens_per_step // batch_size)

    def num_drafts(self, batch_size: int, outlook: BatchOutlook | None = None,
                   prefill: bool = False) -> int:
        """Drafts per request to make now (verified next step): the cap, or with
        ``draft_policy="cost"`` the count maximising expected tokens per second, or with an
        ``outlook`` (the batch is all the work left) and 2 or more requests the count finishing
        the batch soonest.
        0: the drafter is skipped unless a prompt is in the step. A tree config: its node
        count. ``prefill``: a request computes prompt tokens this step; such a step is no
        time sample (RealizedStepTimes), so it drafts the best count and never a probe (on
        the built-in pair at bs 8 a batch's first step probed d = 2-4 in most batches,
        3.7 ms more than d = 1 on a 110 ms step, and its draft time was thrown away)."""
        if self.tree is not None:  # the tree's own shape (and batch budget) decide
            return self.tree.num_nodes
        cap = self.drafts_per_request(batch_size)
        if self.spec.draft_policy == "fixed" or cap == 0:
            return cap
        if outlook is not None:
            cap = min(cap, useful_drafts(outlook))
            if cap == 0:
                self.drafted_last, self.decided_for = 0, None
                return 0
        costs = self._costs_for(batch_size)
        if costs is None:  # nothing measured yet (a step run outside generate): the cap
            return cap
        self.policy_steps += 1
        timer = self.realized_times if self.realized_times is not None else self.given_times
        if self._repeat_last(timer, batch_size, cap, outlook, self.drafted_last):
            return self.drafted_last
        self.flush()
        times, fewest, unseen = self._finish_times(
            batch_size, costs, cap, self._step_times(batch_size, costs, cap), outlook,
            self.drafted_last)
        self.drafted_last = timer.decide(batch_size, times, self.acceptance.rates, fewest,
                                         probe=not prefill)
        self._decided(timer, unseen)
        return self.drafted_last

    def _repeat_last(self, timer: RealizedStepTimes, batch_size: int, cap: int,
                 outlook: BatchOutlook | None, last: int, may_repeat: bool = True) -> bool:
        """Whether this step repeats ``last``, the last fresh decision (counted as a policy
        step of ``timer``), or else decides afresh (and is what the next steps repeat).
        Repeated: DECIDE_EVERY - 1 steps after a fresh decision of the same batch size, cap
        and outlook-or-not, outside the sweep, where ``may_repeat``.

        Why: a decision reads means of 8 step times and running rates that move a few per
        cent a step, and deciding runs after the target's forward, with the host's caches
        cold: 0.13 ms a step at bs 1 and 8 on the built-in pair (0.06 warm), 1.5-2% of a 7-8
        ms step with the observing (docs/draft-policy.md)."""
        decision = (batch_size, cap, outlook is not None)
        if may_repeat and self.decided_for == decision \
                and self.repeats < DECIDE_EVERY - 1 and not timer.in_sweep(batch_size, cap):
            self.repeats += 1
            timer.repeat(batch_size, last)
            return True
        self.decided_for, self.repeats = decision, 0
        return False

    def _decided(self, timer: RealizedStepTimes, unseen: bool) -> None:
        """After a fresh decision: a probe (or the sweep) drafts its count once, and so does
        a decision on an outlook with a request that has not verified a draft yet (``unseen``:
        its acceptance is the pooled rates' until then; on the built-in pair at bs 8 a
        batch's first two steps chose d = 3-4 and held it for 3 more steps, where the next
        fresh decision, on the requests' own acceptance, chose d = 1)."""
        if timer.probed or unseen:
            self.decided_for = None

    def _finish_times(self, batch_size: int, costs: StepCosts, cap: int, times: list[float],
                      outlook: BatchOutlook | None, verified: int
                      ) -> tuple[list[float], int, bool]:
        """(the step times T(0..cap) to decide on, the fewest drafts the decision may make,
        whether a request of the outlook has verified no draft yet): with an ``outlook``
        (the batch is all the work left; a batch of one only where its scale is sure), the
        times that make the best count the one finishing the batch soonest
        (``outlook_step_times``; this step verifies ``verified`` drafts per request), else
        ``times`` as they are, 0 and False."""
        if outlook is None or min(outlook.remaining) <= 0 \
                or not (batch_size > 1 or self._scale_is_sure(outlook.keys[0])):
            return times, 0, False
        # T(1, d): these times moved to one request by the prior's shape (bucket 1's own
        # estimates have few samples where a batch of 8 only passes through)
        at_size, at_one = (prior_times(costs, b, cap) for b in (batch_size, 1))
        one = [rescale(t, v1 + d1, vb + db) for t, vb, db, v1, d1
               in zip(times, *at_size, *at_one)]
        unseen = not self.request_acceptance.seen_all(outlook.keys)
        times, fewest = outlook_step_times(times, one, batch_size, self.acceptance.rates,
                                           outlook, self.request_acceptance,
                                           self.acceptance.pooled_rate, verified)
        return times, fewest, unseen

    def _scale_is_sure(self, key) -> bool:
        """Whether a request alone in its batch reads an acceptance scale SURE_SCALE standard
        errors off 1. A batch of one decides per step on the running rates where it does
        not: they are mostly that request's own (it alone feeds them now), and a scale near
        1 on top only adds noise, compounded per position (in-process A/Bs at bs 1 against
        fixed 3, three runs: with the scale always 0.958-0.988x and d = 1 on 16% of steps,
        without it 0.970-1.007x and 6%; docs/draft-policy.md, seventh session). A request
        the rates do not describe (one the head cannot draft for, left alone at the end of
        a batch of good ones) reads far off 1 and keeps the outlook."""
        pooled = self.acceptance.pooled_rate
        scale = self.request_acceptance.scale
        return not scale(key, pooled, -SURE_SCALE) <= 1.0 <= scale(key, pooled, SURE_SCALE)

    def _step_times(self, batch_size: int, costs: StepCosts, cap: int) -> list[float]:
        """T(0..cap) at ``batch_size``: realized (rocdraft/spec_decode/realized_times.py), or
        with given costs those costs' times."""
        if self.realized_times is not None:
            return self.realized_times.step_times(batch_size, costs, cap)
        verify, draft = prior_times(costs, batch_size, cap)
        return [v + d for v, d in zip(verify, draft)]

    def shape(self, batch_size: int) -> str:
        """A tree config's shape to draft now: "tree", or "chain" where the chooser measured
        the chain faster (or probes it)."""
        if self.shape_chooser is None:
            return "tree"
        return self.shape_chooser.decide(batch_size)

    def chain_drafts_in_tree_mode(self, batch_size: int,
                                  outlook: BatchOutlook | None = None) -> int:
        """Drafts of the chain a tree config drafts now: 1 .. min(k, depth), decided as a
        chain config's cost policy decides (the sweep, then the best count on the realized
        times of this config's chain steps, and its priced probes; with an ``outlook``, no
        more drafts than the tokens left can use and the count finishing the batch soonest),
        so a chain step here costs and yields what the chain config's step does. The cap
        until costs are measured."""
        costs = self._costs_for(batch_size, self.chain_step_costs)
        if costs is None:
            self.chain_drafts = self._chain_cap()
            return self.chain_drafts
        cap = self._chain_cap()
        if outlook is not None:  # at least 1: a chain step runs the drafter
            cap = max(min(cap, useful_drafts(outlook)), 1)
        timer, after_chain = self.chain_times, self.drafted_shape == "chain"
        # repeated between fresh decisions as a chain config's, and decided afresh after a
        # tree step
        if self._repeat_last(timer, batch_size, cap, outlook, self.chain_drafts, after_chain):
            return self.chain_drafts
        # this step verifies the last chain, or a tree (priced as the longest chain)
        verified = self.chain_drafts if after_chain else self._chain_cap()
        self.flush()
        times, fewest, unseen = self._finish_times(
            batch_size, costs, cap, timer.step_times(batch_size, costs, cap), outlook,
            verified)
        self.chain_drafts = timer.decide(batch_size, times, self.acceptance.rates, fewest)
        self._decided(timer, unseen)
        return self.chain_drafts

    def tree_budget(self, batch_size: int) -> int | None:
        """The batch node budget of the trees drafted now: the configured one, or under the
        cost policy B * n* (rocdraft/spec_decode/tree_budget.py), or None (the full tree)
        when it would not cut, before the first full trees were seen, without measured
        costs, and every EXPLORE_EVERY-th step (exploration)."""
        if self.tree_acceptance is None:
            return self.spec.max_draft_tokens_per_step
        self.policy_steps += 1
        costs, accepted = self._costs_for(batch_size), self.tree_acceptance.accepted
        if costs is None or accepted is None or self.policy_steps % EXPLORE_EVERY == 0:
            return None
        n = choose_nodes_per_request(accepted, costs, batch_size, self.tree)
        return None if n >= self.tree.num_nodes else batch_size * n

    @property
    def wants_outlook(self) -> bool:
        """Whether ``num_drafts`` (a chain config's cost policy) or
        ``chain_drafts_in_tree_mode`` (a tree config's) reads a ``BatchOutlook``."""
        return self.request_acceptance is not None

    @property
    def wants_tree_paths(self) -> bool:
        """Whether ``observe`` needs the verified trees' accepted paths (a host read)."""
        return self.tree_acceptance is not None or self.shape_chooser is not None

    @property
    def wants_tree_scores(self) -> bool:
        """Whether the drafted trees' node scores must be kept (the tree budget reads them)."""
        return self.tree_acceptance is not None

    # --- step costs ------------------------------------------------------------------------

    def costs_to_measure(self, largest_bucket: int) -> list[tuple[bool, int]]:
        """The (chain?, bucket) step-cost tables still missing up to ``largest_bucket``:
        a chain config's or a dynamic tree's costs (chain? False for the tree), and the
        chains a tree config may draft. Empty without the cost policy or with given costs."""
        if self.spec.draft_policy != "cost" or self.given_step_costs is not None:
            return []
        tables = []
        if self.tree is None or self.tree_acceptance is not None:
            tables.append((self.step_costs, self.tree is None))
        if self.shape_chooser is not None:
            tables.append((self.chain_step_costs, True))
        buckets = [1 << i for i in range(largest_bucket.bit_length())]
        return [(chain, bucket) for table, chain in tables for bucket in buckets
                if bucket not in table]

    def add_costs(self, chain: bool, bucket: int, costs: StepCosts) -> None:
        """Measured costs of one (chain?, bucket) table from ``costs_to_measure``. Steps
        kept are folded first, on the costs they ran with (an abort can leave some)."""
        self.flush()
        table = self.chain_step_costs if chain and self.tree is not None else self.step_costs
        table[bucket] = costs

    def _costs_for(self, batch_size: int, measured: dict | None = None) -> StepCosts | None:
        """The given costs, else those of the batch's bucket in ``measured`` (default
        ``step_costs``), else the nearest measured."""
        if self.given_step_costs is not None:
            return self.given_step_costs
        measured = self.step_costs if measured is None else measured
        if not measured:
            return None
        bucket = batch_bucket(batch_size)
        if bucket in measured:
            return measured[bucket]
        below = [b for b in measured if b <= bucket]
        return measured[max(below) if below else min(measured)]

    def _chain_cap(self) -> int:
        """The longest chain a tree config drafts: min(k, tree depth)."""
        return min(self.spec.num_speculative_tokens, self.tree.depth)

    def _chain_policy_drafts(self, batch_size: int) -> int:
        """Drafts of the chain a tree config would draft for this batch now (no probe, no
        step counted): the best count on its chains' realized times, the cap before costs
        are measured."""
        costs = self._costs_for(batch_size, self.chain_step_costs)
        if costs is None:
            return self._chain_cap()
        times = self.chain_times.step_times(batch_size, costs, self._chain_cap())
        return best_num_drafts(times, self.acceptance.rates, min_drafts=1)

    # --- what the engine tells after a step ------------------------------------------------

    def observe(self, step: StepRecord) -> None:
        """Fold one step into the estimates (``_fold``); with ``defer_observations`` (the
        engine's) under the cost policy, kept until the next fresh decision or ``flush``:
        folded several at a time, the host's caches stay warm (folding after the target's
        forward took 0.06-0.09 ms a step on the built-in pair, about 3x the same work warm).
        A tree config's shape chooser learns each step at once (it decides every step), and
        a step that verified a tree is folded at once, after the steps kept (what the chain
        would have done on it reads the chain's estimates). Kept steps are folded before
        ``chain_drafts`` changes (a fresh decision flushes first), so each is folded with
        the chain drafted that step."""
        if self.defer_observations and not step.verified_tree \
                and (self.realized_times is not None or self.chain_times is not None):
            self._fold_shape(step, 0.0)
            self.pending.append(step)
            if len(self.pending) >= 4 * DECIDE_EVERY:  # no decision for a while: fold now
                self.flush()
            return
        self.flush()
        self._fold_shape(step, self._fold(step))

    def flush(self) -> None:
        """Fold the steps observed and not yet folded (``observe``), in order."""
        pending, self.pending = self.pending, []
        for step in pending:
            self._fold(step)

    def _fold(self, step: StepRecord) -> float:
        """Fold one step into the estimates: the chain a tree config would have drafted on
        its verified trees (its tokens and acceptance), the chains' acceptance, the dynamic
        trees' acceptance, then the step's times for the realized step times -> what the
        chain would have produced on its verified trees (0.0 without), for the shape
        chooser (``_fold_shape``)."""
        chain_tokens = 0.0
        if self.shape_chooser is not None and step.tree_paths is not None:
            chain = chain_on_tree_step(
                step.tree_parents, step.tree_paths, step.samples,
                self.tree.ranks if isinstance(self.tree, StaticTree) else None,
                self._chain_policy_drafts(step.batch_size), self._chain_cap(),
                self.acceptance.rates)
            chain_tokens = chain.tokens
            if chain.verified:
                self.acceptance.update(chain.verified, chain.accepted)
        if step.chain_verified:
            if self.request_acceptance is not None and step.chain_keys:
                self.request_acceptance.observe(step.chain_keys, step.chain_verified,
                                                step.chain_accepted)
            self.acceptance.update(step.chain_verified, step.chain_accepted)
        if self.request_acceptance is not None:
            self.request_acceptance.forget(step.finished_keys)
        if step.tree_rows:
            self.tree_acceptance.observe(step.tree_rows)
        costs = None if self.realized_times is None or step.has_prefill \
            else self._costs_for(step.batch_size)  # samples are kept by this prior's shape
        if costs is not None:
            self.realized_times.record(step.batch_size, verified_per_request(step),
                                       step.num_drafts, step.seconds - step.draft_seconds,
                                       step.draft_seconds, costs)
        chain_costs = None if self.chain_times is None or step.has_prefill \
            or step.verified_tree else self._costs_for(step.batch_size, self.chain_step_costs)
        if chain_costs is not None:
            # A step that verified only chains (a verify sample) and, when it drafted a
            # chain, a draft sample of the count drafted (a tree's drafting is none).
            self.chain_times.record(step.batch_size, verified_per_request(step),
                                    self.chain_drafts, step.seconds - step.draft_seconds,
                                    step.draft_seconds if step.shape == "chain" else 0.0,
                                    chain_costs)
        return chain_tokens

    def _fold_shape(self, step: StepRecord, chain_tokens: float) -> None:
        """The shape chooser's part of a step (a tree config under the cost policy): a pure
        step of one shape (a tree step's sample needs a verified tree: a batch of only the
        chains another step drafted verifies none), ``chain_tokens`` what the chain would
        have produced on a tree step; then the shape drafted last."""
        if self.shape_chooser is None:
            return
        if not step.has_prefill and step.shape is not None \
                and step.shape == self.drafted_shape and step.any_verified \
                and (step.shape == "chain" or step.verified_tree):
            self.shape_chooser.record(step.batch_size, step.shape, step.seconds,
                                      step.produced, chain_tokens)
        self.drafted_shape = step.shape
