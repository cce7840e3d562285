"""Host bookkeeping of the drafter outside the model forwards.

For batch sizes 1, 8, 64 and k = 4, runs ``EagleProposer.propose`` on the padded path
(rejected tokens kept as padding) with a stub head whose forward and logits are free, and
reports per draft step:

- ops dispatched outside the head (counted with a TorchDispatchMode; machine-independent).
  Ops inside the head's methods (the model) are counted apart. A fused kernel registered as
  one op counts once;
- microseconds of that bookkeeping (wall time of propose with the stub head);
- device-to-host syncs (``_local_scalar_dense`` / ``nonzero``...): must be 0.

"Per draft step" divides a propose call by k (its first forward plus k-1 single-token steps);
the single-token loop alone is reported too. Goal: <= 15 ops per draft step.

Tree steps (``--trees``, default on): the same counts for one ``propose_tree`` call, the
engine's tree drafting per step (``prepare_padded``, the head's first forward, then one head
forward per level), for EAGLE's default static tree and a dynamic tree (``--tree-depth``,
``--tree-top-k``, ``--tree-total-tokens``; default 5/4/16), whole-batch node budget off.
"Per level" divides by the tree's depth (the first forward plus depth - 1 level forwards).
The previous step's tokens are the accepted chain's (depth + 1 per request): op counts depend
on the tree and the batch size, not on token counts. The target-side tree verification and KV
compaction (rocdraft/sample/tree_step.py) are not part of the drafter and not counted here.

Usage: python scripts/bench_drafter.py [--batch-size B ...] [-k K] [--repeat R] [--json]
       [--no-trees] [--tree-depth D --tree-top-k K --tree-total-tokens N]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rocdraft.backends.kv_cache import compute_slot_mapping
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.torch_sdpa import TorchSDPABackend
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.drafter.tree_spec import EAGLE_DEFAULT_TREE, DynamicTree, StaticTree

SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "item"}
HIDDEN, VOCAB, BLOCK_SIZE, MAX_MODEL_LEN = 64, 256, 16, 1024


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by scope: the head (model), the attention backend's metadata
    builder, and everything else (the drafter's own bookkeeping)."""

    def __init__(self):
        super().__init__()
        self.in_model = self.in_builder = 0
        self.model_ops = self.builder_ops = self.bookkeeping_ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_model:
            self.model_ops += 1
        elif self.in_builder:
            self.builder_ops += 1
        else:
            self.bookkeeping_ops += 1
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


class StubHead(torch.nn.Module):
    """Free model: returns its input hidden state and a fixed logits table."""

    def __init__(self, counter_ref: list):
        super().__init__()
        self.counter_ref = counter_ref
        self.logits = torch.randn(4096, VOCAB)

    def _model(fn):  # noqa: N805  (decorator over the head's model methods)
        def wrapped(self, *args):
            counter = self.counter_ref[0]
            if counter is not None:
                counter.in_model += 1
            try:
                return fn(self, *args)
            finally:
                if counter is not None:
                    counter.in_model -= 1
        return wrapped

    @_model
    def combine_hidden_states(self, hidden):
        return hidden

    @_model
    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        return hidden

    @_model
    def compute_draft_logits(self, hidden):
        return self.logits[:hidden.shape[0]]

    @_model
    def draft_to_target(self, ids):
        return ids


def count_builder(builder, counter_ref: list) -> None:
    """Attribute the backend builder's ops to their own scope."""
    for name in ("build", "build_for_drafting"):
        method = getattr(builder, name)

        def wrapped(*args, _method=method):
            counter = counter_ref[0]
            if counter is not None:
                counter.in_builder += 1
            try:
                return _method(*args)
            finally:
                if counter is not None:
                    counter.in_builder -= 1
        setattr(builder, name, wrapped)


def make_step(batch_size: int, k: int, seed: int = 0):
    """A verification step's outputs: every request verified k drafts, some rejected."""
    g = torch.Generator().manual_seed(seed)
    query_lens = [k + 1] * batch_size
    context = torch.randint(20, 200, (batch_size,), generator=g).tolist()
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(context, query_lens)]
    width = MAX_MODEL_LEN // BLOCK_SIZE
    block_table = torch.arange(batch_size * width, dtype=torch.int32).view(batch_size, width)
    req = torch.repeat_interleave(torch.arange(batch_size), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context, query_lens)])
    slots = compute_slot_mapping(block_table, req, positions, BLOCK_SIZE)
    common = CommonAttentionMetadata.from_cpu(qsl, seq_lens, block_table, slots, "cpu")
    sampled = torch.randint(0, VOCAB, (batch_size, k + 1), generator=g)
    accepted = torch.randint(0, k + 1, (batch_size,), generator=g)
    sampled[torch.arange(k + 1).unsqueeze(0) > accepted.unsqueeze(1)] = -1
    token_ids = torch.randint(0, VOCAB, (int(qsl[-1]),), generator=g)
    hidden = torch.randn(int(qsl[-1]), HIDDEN, generator=g)
    return common, positions, token_ids, hidden, sampled


def measure(batch_size: int, k: int, repeat: int) -> dict:
    counter_ref = [None]
    head = StubHead(counter_ref)
    proposer = EagleProposer(head, TorchSDPABackend, k, max_num_tokens=batch_size * (k + 1),
                             max_num_seqs=batch_size, max_model_len=MAX_MODEL_LEN,
                             block_size=BLOCK_SIZE, vocab_size=VOCAB, device="cpu")
    count_builder(proposer.builder, counter_ref)
    common, positions, token_ids, hidden, sampled = make_step(batch_size, k)
    discard = torch.zeros(batch_size, dtype=torch.bool)
    backup = torch.zeros(batch_size, dtype=torch.long)
    num_drafts = torch.full((batch_size,), k)

    def one_step():
        next_ids, valid = proposer.prepare_next_token_ids_padded(sampled, discard, backup)
        indices, rejected = proposer.prepare_inputs_padded(common, num_drafts, valid)
        return proposer.propose(token_ids, positions, hidden, next_ids, indices, common, [],
                                num_rejected=rejected)

    one_step()  # warm-up
    counter = OpCounter()
    counter_ref[0] = counter
    with counter:
        one_step()
    counter_ref[0] = None
    loop_counter = OpCounter()
    counter_ref[0] = loop_counter
    indexes = torch.arange(batch_size)
    with loop_counter:
        proposer.draft_steps(indexes, positions[indexes], common.seq_lens, hidden[:batch_size],
                             common.block_table, [], seq_len_bound=common.max_seq_len)
    counter_ref[0] = None
    start = time.perf_counter()
    for _ in range(repeat):
        one_step()
    elapsed_us = (time.perf_counter() - start) / repeat * 1e6
    return {"batch_size": batch_size, "k": k,
            "ops_per_propose": counter.bookkeeping_ops,
            "ops_per_draft_step": round(counter.bookkeeping_ops / k, 2),
            "ops_per_single_token_step": round(loop_counter.bookkeeping_ops / (k - 1), 2)
            if k > 1 else None,
            "metadata_builder_ops_per_propose": counter.builder_ops,
            "metadata_builder_ops_per_draft_step": round(counter.builder_ops / k, 2),
            "model_ops_per_propose_stub": counter.model_ops,
            "host_syncs_per_propose": counter.syncs,
            "us_per_propose": round(elapsed_us, 1),
            "us_per_draft_step": round(elapsed_us / k, 1)}


def measure_tree(batch_size: int, tree: StaticTree | DynamicTree, repeat: int) -> dict:
    """Ops, host syncs and microseconds of one ``propose_tree`` call (the padded path)."""
    counter_ref = [None]
    head = StubHead(counter_ref)
    depth = tree.depth
    proposer = EagleProposer(head, TorchSDPABackend, depth,
                             max_num_tokens=batch_size * (tree.num_nodes + 1),
                             max_num_seqs=batch_size, max_model_len=MAX_MODEL_LEN,
                             block_size=BLOCK_SIZE, vocab_size=VOCAB, device="cpu", tree=tree)
    count_builder(proposer.builder, counter_ref)
    common, positions, token_ids, hidden, sampled = make_step(batch_size, depth)
    discard = torch.zeros(batch_size, dtype=torch.bool)
    backup = torch.zeros(batch_size, dtype=torch.long)
    num_drafts = torch.full((batch_size,), depth)

    def one_step():
        next_ids, _, indices, _ = proposer.prepare_padded(sampled, discard, backup, common,
                                                          num_drafts)
        return proposer.propose_tree(token_ids, positions, hidden, next_ids, indices, common,
                                     [], None)

    one_step()  # warm-up
    counter = OpCounter()
    counter_ref[0] = counter
    with counter:
        drafts = one_step()
    counter_ref[0] = None
    start = time.perf_counter()
    for _ in range(repeat):
        one_step()
    elapsed_us = (time.perf_counter() - start) / repeat * 1e6
    kind = "static" if isinstance(tree, StaticTree) else "dynamic"
    shape = (f"{tree.num_nodes} nodes, depth {depth}" if kind == "static" else
             f"d{tree.depth}/k{tree.top_k}/n{tree.total_tokens}")
    return {"batch_size": batch_size, "tree": kind, "shape": shape,
            "nodes": int(drafts.num_nodes[0]), "depth": depth,
            "ops_per_tree_step": counter.bookkeeping_ops,
            "ops_per_level": round(counter.bookkeeping_ops / depth, 2),
            "metadata_builder_ops_per_tree_step": counter.builder_ops,
            "model_ops_per_tree_step_stub": counter.model_ops,
            "host_syncs_per_tree_step": counter.syncs,
            "us_per_tree_step": round(elapsed_us, 1),
            "us_per_level": round(elapsed_us / depth, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, action="append", default=None)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-trees", dest="trees", action="store_false",
                        help="chain figures only")
    parser.add_argument("--tree-depth", type=int, default=5)
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--tree-total-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch_sizes = args.batch_size or [1, 8, 64]
    rows = [measure(b, args.k, args.repeat) for b in batch_sizes]
    trees = []
    if args.trees:
        from rocdraft.config import SpeculativeConfig

        dynamic = SpeculativeConfig(tree_depth=args.tree_depth, tree_top_k=args.tree_top_k,
                                    tree_total_tokens=args.tree_total_tokens).draft_tree()
        for shape in (StaticTree(EAGLE_DEFAULT_TREE), dynamic):
            trees += [measure_tree(b, shape, args.repeat) for b in batch_sizes]
    if args.json:
        print(json.dumps(rows + trees if args.trees else rows))
        return 0
    print(f"drafter bookkeeping outside the model, padded path, k={args.k}, torch path on "
          f"{'a GPU' if torch.cuda.is_available() else 'the CPU'} (goal <= 15 ops per draft "
          f"step); the TORCH_SDPA metadata builder's ops are counted apart")
    print(f"{'batch':>5} {'ops/propose':>11} {'ops/step':>8} {'ops/1-tok step':>14} "
          f"{'builder ops/step':>16} {'syncs':>5} {'us/propose':>10} {'us/step':>8}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['ops_per_propose']:>11} {r['ops_per_draft_step']:>8} "
              f"{r['ops_per_single_token_step']!s:>14} "
              f"{r['metadata_builder_ops_per_draft_step']:>16} {r['host_syncs_per_propose']:>5} "
              f"{r['us_per_propose']:>10} {r['us_per_draft_step']:>8}")
    if trees:
        print("\ntree steps (one propose_tree: prepare_padded, first forward, a forward per "
              "level)")
        print(f"{'tree':<24} {'batch':>5} {'ops/step':>8} {'ops/level':>9} "
              f"{'builder ops/step':>16} {'syncs':>5} {'us/step':>8} {'us/level':>8}")
        for r in trees:
            print(f"{r['tree'] + ' ' + r['shape']:<24} {r['batch_size']:>5} "
                  f"{r['ops_per_tree_step']:>8} {r['ops_per_level']:>9} "
                  f"{r['metadata_builder_ops_per_tree_step']:>16} "
                  f"{r['host_syncs_per_tree_step']:>5} {r['us_per_tree_step']:>8} "
                  f"{r['us_per_level']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
