"""KV compaction after tree verification (backends/kv_compact.py, and where it runs:
backends/kv_compact_dispatch.py): the torch reference, the
Triton kernel (TRITON_INTERPRET=1, set by conftest) and the HIP kernel (through the CPU shim).

What these tests prove: on random BFS trees and accepted paths, both layouts and every cache
dtype (fp8 with per-head scales), the cache after "write every tree node, then compact" equals,
byte for byte, the cache of a run that only ever wrote the accepted tokens at their final
positions, everywhere except the request's garbage slots past the path, and every other
request's blocks and the free blocks are untouched (canary); on arbitrary, partly invalid inputs
(-1 nodes, sources before destinations, negative block ids, columns past the table, negative
context lengths, num_accepted past D) the three forms give identical bytes. What only a GPU run
proves: wavefronts running the in-order walk concurrently, 16-byte vector instructions, speed.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocdraft.backends import kv_compact_dispatch
from rocdraft.backends.kv_cache import (FP8_DTYPES, NHD, SPLIT_K, LayerKVCache, _element_index,
                                        compute_slot_mapping, kv_cache_shapes, split_k_x,
                                        write_kv_reference)
from rocdraft.backends.kv_compact import bits_view, compact_kv_moves, compact_kv_reference
from rocdraft.backends.kv_compact_dispatch import compact_kv, compact_kv_layers
from rocdraft.backends.triton_kernels.kv_compact import compact_kv_triton
from rocdraft.hip_kernels import build, ops
from rocdraft.hip_kernels.ops import LAYOUT_CODES

FN, FNUZ = FP8_DTYPES
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FN, FNUZ)
FAST = settings(max_examples=30, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def shim():
    """The CPU shim extension's ops, or None where it cannot be built (its checks skip)."""
    try:
        return build.load_cpu_shim()
    except (RuntimeError, OSError):  # no C++ compiler on this machine
        return None


def test_the_hip_kernel_runs_through_the_cpu_shim(shim):
    """The other tests check the HIP kernel only where the shim builds; say so when it does
    not, instead of passing silently."""
    if shim is None:
        pytest.skip("CPU shim extension cannot be built here: HIP compaction unchecked")
    assert hasattr(shim, "compact_kv") and hasattr(shim, "compact_kv_vector_ok")


def cache_geometry(data, layout: str, dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim): tiny, multiples of x in the split-K layout."""
    if layout == SPLIT_K:
        x = split_k_x(dtype)
        block_size = x * data.draw(st.sampled_from([1, 2]), label="block_size / x")
        head_dim = x * data.draw(st.sampled_from([1, 2]), label="head_dim / x")
    else:
        block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
        head_dim = data.draw(st.sampled_from([1, 3, 8, 16]), label="head_dim")
    return block_size, data.draw(st.integers(1, 3), label="num_kv_heads"), head_dim


def random_cache(layout: str, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> LayerKVCache:
    """Random bytes everywhere (NaN payloads included), per-head scales for fp8."""
    tensors = []
    for shape in kv_cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
                       .view(dtype).view(shape))
    scales = [None, None]
    if dtype in FP8_DTYPES:
        scales = [torch.rand(num_kv_heads, generator=gen) * 2 + 0.05 for _ in range(2)]
    return LayerKVCache(*tensors, layout, *scales)


def clone(cache: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(cache.key.clone(), cache.value.clone(), cache.layout, cache.k_scale,
                        cache.v_scale)


def slot_bits(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value bytes of every slot: [num_slots, num_kv_heads, head_dim] each."""
    num_slots = cache.num_blocks * cache.block_size
    slots = torch.arange(num_slots)
    out = []
    for store, is_value in ((cache.key, False), (cache.value, True)):
        heads = store.shape[2] if cache.layout == NHD else store.shape[1]
        head_dim = store.shape[3] if cache.layout == NHD else cache.value.shape[3]
        bits = bits_view(store)
        out.append(bits[_element_index(cache.layout, bits, slots // cache.block_size,
                                       slots % cache.block_size, heads, head_dim, is_value)])
    return out[0], out[1]


def same_bytes(a: LayerKVCache, b: LayerKVCache) -> bool:
    return (torch.equal(bits_view(a.key), bits_view(b.key))
            and torch.equal(bits_view(a.value), bits_view(b.value)))


def bfs_tree(rng: random.Random, num_nodes: int) -> list[int]:
    """parents of a random BFS-ordered tree: levels in order, nodes grouped by parent."""
    parents: list[int] = []
    frontier = [-1]
    while len(parents) < num_nodes:
        count = min(rng.randint(1, 4), num_nodes - len(parents))
        level = sorted(rng.choice(frontier) for _ in range(count))
        frontier = list(range(len(parents), len(parents) + count))
        parents += level
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class TreeStep:
    """A batch after a tree verification forward: ``num_compacted`` requests with a tree each
    (context, root and every node written), then canary requests with context only."""

    def __init__(self, data, layout: str, dtype: torch.dtype):
        block_size, heads, head_dim = cache_geometry(data, layout, dtype)
        num_compacted = data.draw(st.integers(1, 3), label="requests")
        num_canary = data.draw(st.integers(0, 2), label="canary requests")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        self.block_size, self.input_dtype = block_size, torch.float32
        if dtype not in FP8_DTYPES:
            self.input_dtype = dtype
        self.trees, self.paths, self.context_lens, lengths = [], [], [], []
        for _ in range(num_compacted):
            num_nodes = rng.randint(1, 10)
            parents = bfs_tree(rng, num_nodes)
            target = rng.randint(-1, num_nodes - 1)  # -1: no draft accepted
            self.trees.append(parents)
            self.paths.append([] if target < 0 else path_to(parents, target))
            self.context_lens.append(rng.randint(0, 20))
            lengths.append(self.context_lens[-1] + 1 + num_nodes)
        lengths += [rng.randint(1, 20) for _ in range(num_canary)]
        blocks_per_req = [-(-n // block_size) for n in lengths]
        max_blocks = max(blocks_per_req) + rng.randint(0, 1)
        num_blocks = sum(blocks_per_req) + rng.randint(0, 2)  # free blocks: canaries too
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_table = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
        for row, count in enumerate(blocks_per_req):
            self.block_table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
            ids = ids[count:]
        self.compacted_blocks = {int(b) for b in self.block_table[:num_compacted].flatten()
                                 if b >= 0}
        self.initial = random_cache(layout, num_blocks, block_size, heads, head_dim, dtype, gen)
        # K/V of every token of every request, in sequence order (context, root, nodes)
        self.rows = [[(torch.randn(n, heads, head_dim, generator=gen) * 3).to(self.input_dtype)
                      for _ in range(2)] for n in lengths]
        depth = max([len(p) for p in self.paths] + [data.draw(st.integers(0, 3), label="D pad")])
        self.accepted_nodes = torch.full((num_compacted, depth), -1, dtype=torch.int64)
        for row, path in enumerate(self.paths):
            self.accepted_nodes[row, :len(path)] = torch.tensor(path, dtype=torch.int64)
        self.num_accepted = torch.tensor([len(p) for p in self.paths], dtype=torch.int64)
        self.num_compacted = num_compacted

    def write(self, cache: LayerKVCache, positions_of) -> None:
        """Write each request's rows ``positions_of(req)`` -> list of (row, position)."""
        for req, (key, value) in enumerate(self.rows):
            pairs = positions_of(req, key.shape[0])
            if not pairs:
                continue
            rows = torch.tensor([r for r, _ in pairs])
            positions = torch.tensor([p for _, p in pairs])
            slots = compute_slot_mapping(self.block_table, torch.full_like(positions, req),
                                         positions, self.block_size)
            write_kv_reference(key[rows], value[rows], cache, slots)

    def after_verification(self) -> LayerKVCache:
        """Every token of every request at its sequence index (node i at L + 1 + i)."""
        cache = clone(self.initial)
        self.write(cache, lambda req, n: [(i, i) for i in range(n)])
        return cache

    def accepted_only(self) -> LayerKVCache:
        """Context, root and the accepted nodes at L + d: what compaction must produce."""
        cache = clone(self.initial)

        def positions(req, n):
            if req >= self.num_compacted:
                return [(i, i) for i in range(n)]
            context = self.context_lens[req]
            kept = [(i, i) for i in range(context + 1)]
            return kept + [(context + 1 + node, context + 1 + d)
                           for d, node in enumerate(self.paths[req])]

        self.write(cache, positions)
        return cache

    def garbage_slots(self) -> torch.Tensor:
        """Slots past L + num_accepted of the compacted requests' trees (stale afterwards)."""
        garbage = []
        for req in range(self.num_compacted):
            start = self.context_lens[req] + 1 + len(self.paths[req])
            end = self.context_lens[req] + 1 + len(self.trees[req])
            for pos in range(start, end):
                block = int(self.block_table[req, pos // self.block_size])
                garbage.append(block * self.block_size + pos % self.block_size)
        return torch.tensor(garbage, dtype=torch.int64)

    def args(self):
        return (self.block_table, torch.tensor(self.context_lens, dtype=torch.int32),
                self.accepted_nodes, self.num_accepted, self.block_size)


def run_all_forms(cache: LayerKVCache, args, shim, allow_vector: bool) -> list[LayerKVCache]:
    """``cache`` compacted by each available form except the reference (fresh copies)."""
    results = []
    triton_cache = clone(cache)
    compact_kv_triton(triton_cache, *args)
    results.append(triton_cache)
    if shim is not None:
        hip_cache = clone(cache)
        block_table, context_lens, nodes, num_accepted, _ = args
        shim.compact_kv(hip_cache.key, hip_cache.value, block_table, context_lens, nodes,
                        num_accepted, LAYOUT_CODES[cache.layout], allow_vector, 0)
        results.append(hip_cache)
    return results


LAYOUT_DTYPES = [(layout, dtype) for layout in (NHD, SPLIT_K) for dtype in CACHE_DTYPES]
IDS = [f"{layout}-{str(dtype).split('.')[-1]}" for layout, dtype in LAYOUT_DTYPES]


@pytest.mark.parametrize("layout,dtype", LAYOUT_DTYPES, ids=IDS)
@FAST
@given(data=st.data())
def test_compaction_equals_writing_only_the_accepted_tokens(shim, layout, dtype, data):
    """Write every tree node, compact -> the bytes of a run that wrote only the accepted
    tokens at L + d, except the garbage slots past the path; canary requests' and free blocks
    byte-identical; Triton and HIP (vector and scalar paths) bit-exact with the reference."""
    step = TreeStep(data, layout, dtype)
    verified = step.after_verification()
    compacted = clone(verified)
    compact_kv_reference(compacted, *step.args())

    expected_key, expected_value = slot_bits(step.accepted_only())
    key, value = slot_bits(compacted)
    keep = torch.ones(key.shape[0], dtype=torch.bool)
    keep[step.garbage_slots()] = False
    assert torch.equal(key[keep], expected_key[keep])
    assert torch.equal(value[keep], expected_value[keep])

    before_key, before_value = slot_bits(verified)
    for block in set(range(verified.num_blocks)) - step.compacted_blocks:  # canary
        rows = slice(block * step.block_size, (block + 1) * step.block_size)
        assert torch.equal(key[rows], before_key[rows])
        assert torch.equal(value[rows], before_value[rows])

    allow_vector = data.draw(st.booleans(), label="allow_vector")
    for other in run_all_forms(verified, step.args(), shim, allow_vector):
        assert same_bytes(other, compacted)


@pytest.mark.parametrize("layout,dtype", [(NHD, torch.bfloat16), (SPLIT_K, FN),
                                          (NHD, torch.float32), (SPLIT_K, torch.float16)],
                         ids=["NHD-bf16", "SPLIT_K-fp8", "NHD-fp32", "SPLIT_K-fp16"])
@FAST
@given(data=st.data())
def test_forms_agree_on_arbitrary_and_invalid_inputs(shim, layout, dtype, data):
    """Random, partly invalid moves (nodes in [-2, N + 3), num_accepted in [-1, D + 2),
    negative context lengths, -1 and out-of-range block ids, strided block-table and
    accepted_nodes rows): Triton and HIP give the reference's bytes."""
    block_size, heads, head_dim = cache_geometry(data, layout, dtype)
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    batch_size = data.draw(st.integers(0, 4), label="batch_size")
    depth = data.draw(st.integers(0, 5), label="D")
    max_blocks = data.draw(st.integers(1, 4), label="max_blocks")
    num_blocks = batch_size * max_blocks + 1
    cache = random_cache(layout, num_blocks, block_size, heads, head_dim, dtype, gen)
    # distinct ids; some past the cache (>= num_blocks) and some -1
    ids = torch.randperm(num_blocks + 3, generator=gen)[:batch_size * max_blocks]
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, -1, ids)
    wide = torch.full((batch_size + 1, max_blocks + 2), 5, dtype=torch.int32)
    wide[:batch_size, :max_blocks] = ids.view(batch_size, max_blocks).to(torch.int32)
    block_table = wide[:, :max_blocks]
    max_len = max_blocks * block_size
    context_lens = torch.randint(-2, max_len, (batch_size,), generator=gen, dtype=torch.int32)
    nodes = torch.randint(-2, max_len + 3, (batch_size, depth + 1), generator=gen)[:, :depth]
    num_accepted = torch.randint(-1, depth + 3, (batch_size,), generator=gen)
    args = (block_table, context_lens, nodes, num_accepted, block_size)
    expected = clone(cache)
    compact_kv_reference(expected, *args)
    for other in run_all_forms(cache, args, shim, data.draw(st.booleans(), label="vector")):
        assert same_bytes(other, expected)
    layers = [clone(cache), clone(cache)]  # moves planned once, applied to every layer
    compact_kv_layers(layers, *args)
    assert all(same_bytes(layer, expected) for layer in layers)


def test_moves_docstring_example():
    valid, src, dst = compact_kv_moves(torch.tensor([[7, 2]], dtype=torch.int32),
                                       torch.tensor([1], dtype=torch.int32),
                                       torch.tensor([[1, 4, -1]]), torch.tensor([2]), 4, 8)
    assert valid.tolist() == [True, True, False]
    assert src.tolist() == [31, 10, 0] and dst.tolist() == [30, 31, 0]


def test_a_source_overwritten_later_is_read_first():
    """Path [1, 2]: move 1 reads seq L + 2, which move 2 overwrites (L + 2 <- L + 3); the
    result holds the old L + 2 at L + 1, as "read every source first" says."""
    cache = LayerKVCache(torch.arange(8, dtype=torch.float32).view(1, 8, 1, 1),
                         -torch.arange(8, dtype=torch.float32).view(1, 8, 1, 1))
    args = (torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([[1, 2]]), torch.tensor([2]), 8)
    compact_kv_reference(cache, *args)
    assert cache.key.flatten().tolist() == [0, 1, 2, 4, 5, 5, 6, 7]
    assert cache.value.flatten().tolist() == [0, -1, -2, -4, -5, -5, -6, -7]


def test_block_table_entry_below_zero_or_no_accepted_touches_nothing(shim):
    cache = random_cache(NHD, 3, 4, 2, 8, torch.float16, torch.Generator().manual_seed(3))
    args = (torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
            torch.tensor([2, 1], dtype=torch.int32), torch.tensor([[3, 4], [5, 6]]),
            torch.tensor([2, 0]), 4)
    for form in [compact_kv_reference, compact_kv_triton] + (
            [] if shim is None else [lambda c, *a: shim.compact_kv(
                c.key, c.value, *a[:4], LAYOUT_CODES[NHD], True, 0)]):
        compacted = clone(cache)
        form(compacted, *args)
        assert same_bytes(compacted, cache)


def test_dispatch_picks_the_reference_on_cpu_and_forces_forms(monkeypatch, shim):
    calls = []
    monkeypatch.setattr(kv_compact_dispatch, "compact_kv_reference", lambda *a: calls.append("ref"))
    cache = random_cache(NHD, 2, 4, 1, 8, torch.float16, torch.Generator().manual_seed(0))
    args = (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([[1]]), torch.tensor([1]), 4)
    compact_kv(cache, *args)
    assert calls == ["ref"]
    monkeypatch.undo()
    expected = clone(cache)
    compact_kv_reference(expected, *args)
    for form in ("triton", "hip"):  # "hip" on CPU: the shim once loaded, else the reference
        got = clone(cache)
        compact_kv(got, *args, implementation=form)
        assert same_bytes(got, expected), form
    assert ops.kernels_for(torch.device("cpu")) is shim
    with pytest.raises(ValueError, match="unknown compact_kv implementation 'cuda'"):
        compact_kv(cache, *args, implementation="cuda")


def bad_cases():
    cache = LayerKVCache(torch.zeros(2, 4, 1, 8, dtype=torch.float16),
                         torch.zeros(2, 4, 1, 8, dtype=torch.float16))
    bt, ctx = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    nodes, count = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    base = (cache, bt, ctx, nodes, count, 4)
    yield "block size", (cache, bt, ctx, nodes, count, 8), "block_size 8 does not match"
    yield "table dtype", (cache, bt.long(), ctx, nodes, count, 4), "block_table must be a 2-D"
    yield "table rows", (cache, bt[:0], ctx, nodes, count, 4), r"block_table must be \[>= batch"
    yield "context dtype", (cache, bt, ctx.long(), nodes, count, 4), "context_lens must be"
    yield "nodes dtype", (cache, bt, ctx, nodes.int(), count, 4), "accepted_nodes must be"
    yield "count size", (cache, bt, ctx, nodes, count.repeat(2), 4), "num_accepted has 2"
    strided = torch.zeros(1, 4, dtype=torch.int64)[:, ::2]
    yield "strided nodes", (cache, bt, ctx, strided, count, 4), \
        "accepted_nodes must be contiguous in its last dim"
    split = LayerKVCache(cache.key, cache.value, SPLIT_K)
    yield "layout rank", (split,) + base[1:], "not a SPLIT_K cache"
    odd = LayerKVCache(cache.key, cache.value, "HND")
    yield "layout", (odd,) + base[1:], "unknown KV layout 'HND'"
    mixed = LayerKVCache(cache.key, cache.value.float())
    yield "dtypes", (mixed,) + base[1:], "cache dtypes"


@pytest.mark.parametrize("case", list(bad_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("form", ["reference", "triton", "op"])
def test_bad_arguments_raise_one_line_value_errors(case, form):
    _, args, message = case
    cache, rest = args[0], args[1:]
    with pytest.raises(ValueError, match=message):
        if form == "reference":
            compact_kv_reference(cache, *rest)
        elif form == "triton":
            compact_kv_triton(cache, *rest)
        else:
            ops.compact_kv(cache.key, cache.value, *rest[:4], cache.layout, rest[4])


def test_vector_path_is_taken_when_head_dim_fills_whole_16_byte_chunks(shim):
    if shim is None:
        pytest.skip("CPU shim extension cannot be built here")
    gen = torch.Generator().manual_seed(0)
    for layout, dtype, head_dim, expected in ((NHD, torch.float16, 16, True),
                                              (NHD, torch.float16, 12, False),
                                              (NHD, FN, 16, True), (SPLIT_K, torch.float32, 4,
                                                                    True)):
        block_size = 16 if layout == NHD else 4
        cache = random_cache(layout, 2, block_size, 2, head_dim, dtype, gen)
        assert shim.compact_kv_vector_ok(cache.key, cache.value,
                                         LAYOUT_CODES[layout]) is expected, (layout, dtype)
