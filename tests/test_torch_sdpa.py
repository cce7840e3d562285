"""TORCH_SDPA (the oracle of every other backend) against naive dense per-request attention:
GQA, ragged mixes of prefill / decode / multi-token queries, both KV layouts, fp8 caches,
query-query spec masks (chain and tree), and graph-padding tokens."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends.kv_cache import (FP8_DTYPES, NHD, PADDING_SLOT_ID, SPLIT_K,
                                        allocate_kv_cache, compute_slot_mapping,
                                        quantize_for_cache, read_kv_nhd, write_kv_reference)
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.torch_sdpa import (TorchSDPABackend, TorchSDPABuilder, TorchSDPAImpl,
                                          TorchSDPAMetadata)


def naive_attention(q, k, v, q_positions, scale, allowed=None):
    """One request, dense: q [ql, Hq, D], k/v [sl, Hk, D] float32, query i at q_positions[i]
    sees key j when j <= q_positions[i] (and allowed(i_pos, j) when given)."""
    ql, hq, _ = q.shape
    sl, hk, _ = k.shape
    group = hq // hk
    out = torch.zeros(ql, hq, q.shape[2])
    for i in range(ql):
        p = q_positions[i]
        keys = [j for j in range(sl) if j <= p and (allowed is None or allowed(p, j))]
        for h in range(hq):
            kh, vh = k[keys, h // group], v[keys, h // group]  # [n, D]
            w = torch.softmax((kh @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ vh
    return out


class Case:
    """A batch of requests, each ``(num_cached, query_len)``, with a paged cache already
    holding every request's cached K/V."""

    def __init__(self, specs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                 layout=NHD, cache_dtype=torch.float32, q_dtype=torch.float32, seed=0,
                 per_head_scale=False, consecutive_blocks=False):
        """consecutive_blocks: the requests' blocks are runs of ascending ids from block 1
        (a FIFO allocator's), not a random permutation."""
        g = torch.Generator().manual_seed(seed)
        self.specs, self.num_heads, self.num_kv_heads = specs, num_heads, num_kv_heads
        self.head_dim, self.block_size, self.q_dtype = head_dim, block_size, q_dtype
        self.seq_lens = [c + q for c, q in specs]
        blocks_per_req = [math.ceil(s / block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_req) + 2
        max_blocks = max(blocks_per_req) + 1
        perm = list(range(1, num_blocks)) if consecutive_blocks \
            else torch.randperm(num_blocks, generator=g).tolist()
        self.block_table = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
        for i, n in enumerate(blocks_per_req):
            self.block_table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim,
                                       cache_dtype, "cpu", layout=layout)[0]
        if cache_dtype in FP8_DTYPES:
            n = num_kv_heads if per_head_scale else 1
            self.cache.k_scale = torch.rand(n, generator=g) * 0.02 + 0.01
            self.cache.v_scale = torch.rand(n, generator=g) * 0.02 + 0.01
        # Full K/V per request (cached + new), and the queries of the new tokens.
        kv_dtype = torch.float32 if cache_dtype in FP8_DTYPES else q_dtype
        self.k = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(kv_dtype)
                  for s in self.seq_lens]
        self.v = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(kv_dtype)
                  for s in self.seq_lens]
        self.q = [torch.randn(q, num_heads, head_dim, generator=g).to(q_dtype) for _, q in specs]
        self.scale = head_dim ** -0.5
        # Write every cached token's K/V.
        ctx_rows = [(i, p) for i, (c, _) in enumerate(specs) for p in range(c)]
        if ctx_rows:
            req = torch.tensor([r for r, _ in ctx_rows])
            pos = torch.tensor([p for _, p in ctx_rows])
            slots = compute_slot_mapping(self.block_table, req, pos, block_size)
            write_kv_reference(torch.cat([self.k[i][:c] for i, (c, _) in enumerate(specs)]),
                               torch.cat([self.v[i][:c] for i, (c, _) in enumerate(specs)]),
                               self.cache, slots)

    def new_token_inputs(self, num_padding=0, g=None):
        """(query, key, value, slot_mapping) of the new tokens, plus graph padding rows."""
        req, pos = [], []
        for i, (c, q) in enumerate(self.specs):
            req += [i] * q
            pos += range(c, c + q)
        slots = compute_slot_mapping(self.block_table, torch.tensor(req, dtype=torch.long),
                                     torch.tensor(pos, dtype=torch.long), self.block_size)
        query = torch.cat(self.q)
        key = torch.cat([k[c:] for k, (c, _) in zip(self.k, self.specs)])
        value = torch.cat([v[c:] for v, (c, _) in zip(self.v, self.specs)])
        if num_padding:
            g = g or torch.Generator().manual_seed(123)
            junk = lambda t: torch.randn(num_padding, *t.shape[1:], generator=g).to(t.dtype) \
                * 100  # noqa: E731
            query, key, value = (torch.cat([t, junk(t)]) for t in (query, key, value))
            slots = torch.cat([slots, torch.full((num_padding,), PADDING_SLOT_ID)])
        return query, key, value, slots

    def metadata(self, slots, spec_mask=None) -> TorchSDPAMetadata:
        qsl = [0]
        for _, q in self.specs:
            qsl.append(qsl[-1] + q)
        common = CommonAttentionMetadata.from_cpu(qsl, self.seq_lens, self.block_table, slots,
                                                  "cpu")
        if spec_mask is not None:
            common = common.with_updates(spec_mask=spec_mask)
        return TorchSDPABuilder("cpu").build(common)

    def run(self, num_padding=0, spec_mask=None):
        query, key, value, slots = self.new_token_inputs(num_padding)
        impl = TorchSDPAImpl(self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        return impl.forward(query, key, value, self.cache, self.metadata(slots, spec_mask))

    def stored(self, t: torch.Tensor, which: str) -> torch.Tensor:
        """``t`` as the cache stores and reads it back (dequantised float32)."""
        dtype = self.cache.key.dtype
        if dtype in FP8_DTYPES:
            scale = self.cache.k_scale if which == "k" else self.cache.v_scale
            return quantize_for_cache(t, dtype, scale).float() * scale.view(1, -1, 1)
        return t.to(dtype).float()

    def expected(self, allowed_for=None, exact_kv=False):
        outs = []
        for i, (c, q) in enumerate(self.specs):
            k = self.k[i].float() if exact_kv else self.stored(self.k[i], "k")
            v = self.v[i].float() if exact_kv else self.stored(self.v[i], "v")
            allowed = allowed_for(i) if allowed_for else None
            outs.append(naive_attention(self.q[i].float(), k, v, list(range(c, c + q)),
                                        self.scale, allowed))
        return torch.cat(outs)


MIXED = [(5, 1), (0, 3), (6, 3), (0, 1), (9, 4), (3, 7)]  # decodes, prefills, verifies


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch_matches_naive(num_heads, num_kv_heads):
    case = Case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = case.run()
    assert out.shape == (sum(q for _, q in MIXED), num_heads, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, case.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 48, 112, 264])
def test_any_head_size(head_dim):
    """TORCH_SDPA declares no head-size rule and computes any head size."""
    caps = TorchSDPABackend.capabilities
    assert caps.head_sizes is None and caps.head_size_rule() == "any"
    assert caps.config_problem(head_dim=head_dim) is None
    case = Case(MIXED[:3], head_dim=head_dim, seed=head_dim)
    torch.testing.assert_close(case.run(), case.expected(), atol=1e-5, rtol=1e-5)


def test_new_kv_is_written_to_the_cache():
    case = Case(MIXED, seed=5)
    case.run()
    k_nhd, v_nhd = read_kv_nhd(case.cache)
    for i, s in enumerate(case.seq_lens):
        pos = torch.arange(s)
        blocks = case.block_table[i, pos // case.block_size].long()
        assert torch.equal(k_nhd[blocks, pos % case.block_size], case.k[i])
        assert torch.equal(v_nhd[blocks, pos % case.block_size], case.v[i])


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 5)), min_size=1, max_size=4),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 1000))
def test_ragged_batches_match_naive(specs, heads, block_size, seed):
    case = Case(specs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=8,
                block_size=block_size, seed=seed)
    torch.testing.assert_close(case.run(), case.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_half_precision_matches_naive(dtype):
    case = Case(MIXED, cache_dtype=dtype, q_dtype=dtype, seed=1)
    out = case.run()
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), case.expected(), atol=1e-2, rtol=1e-2)


def test_split_k_layout_equals_nhd():
    outs = []
    for layout in (NHD, SPLIT_K):
        case = Case(MIXED, layout=layout, block_size=8, cache_dtype=torch.float16,
                    q_dtype=torch.float16, seed=2)
        outs.append(case.run())
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1].float(), case.expected(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("per_head", (False, True))
def test_fp8_cache(layout, dtype, per_head):
    case = Case(MIXED, layout=layout, block_size=16, cache_dtype=dtype, seed=3,
                per_head_scale=per_head)
    out = case.run()
    # Exactly the attention over the dequantised cache ...
    torch.testing.assert_close(out, case.expected(), atol=1e-5, rtol=1e-5)
    # ... and within fp8 tolerance of the attention over the unquantised K/V.
    torch.testing.assert_close(out, case.expected(exact_kv=True), atol=0.1, rtol=0.1)


def test_graph_padding_tokens_do_not_disturb_real_outputs():
    real = Case(MIXED, seed=4)
    want = real.run()
    padded = Case(MIXED, seed=4)
    before_k = padded.cache.key.clone()
    out = padded.run(num_padding=5)
    n = sum(q for _, q in MIXED)
    assert out.shape[0] == n + 5
    assert torch.equal(out[:n], want)
    assert torch.isfinite(out).all()
    # Padding rows write nothing: the caches end identical.
    assert torch.equal(padded.cache.key, real.cache.key)
    assert torch.equal(padded.cache.value, real.cache.value)
    assert not torch.equal(before_k, padded.cache.key)


def test_decode_only_batch_with_padding():
    case = Case([(3, 1), (8, 1), (1, 1)], seed=6)
    out = case.run(num_padding=3)
    torch.testing.assert_close(out[:3], case.expected(), atol=1e-5, rtol=1e-5)


def test_padding_only_batch():
    cache = allocate_kv_cache(1, 2, 4, 1, 8, torch.float32, "cpu")[0]
    common = CommonAttentionMetadata.from_cpu([0], [], torch.zeros(0, 2), torch.full((3,), -1),
                                              "cpu")
    out = TorchSDPAImpl(2, 1, 8, 0.3).forward(torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                                              torch.randn(3, 1, 8), cache,
                                              TorchSDPABuilder("cpu").build(common))
    assert out.shape == (3, 2, 8) and torch.isfinite(out).all()
    assert not cache.key.any() and not cache.value.any()


def test_chain_spec_mask_equals_plain_causal():
    specs = [(4, 4), (0, 5), (9, 4)]
    plain = Case(specs, seed=7).run()
    chain = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    masked = Case(specs, seed=7).run(spec_mask=chain)
    assert torch.equal(plain, masked)


def tree_mask(parents):
    """mask[i, j]: node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
def test_tree_spec_mask_matches_naive_masked_attention(layout):
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = [-1, 0, 0, 1, 1, 2]
    mask = tree_mask(parents)
    num_spec = len(parents)
    specs = [(5, 6), (0, 6), (3, 8)]  # the last request has 2 ordinary tokens before its tree
    case = Case(specs, layout=layout, block_size=8, cache_dtype=torch.float16,
                q_dtype=torch.float16, seed=8)
    out = case.run(spec_mask=mask)

    def allowed_for(i):
        first_spec = case.seq_lens[i] - num_spec

        def allowed(qp, kp):
            if qp < first_spec or kp < first_spec:
                return True
            return bool(mask[qp - first_spec, kp - first_spec])
        return allowed

    want = case.expected(allowed_for)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    # The mask matters: siblings do not see each other, so plain causal differs.
    plain = Case(specs, layout=layout, block_size=8, cache_dtype=torch.float16,
                 q_dtype=torch.float16, seed=8).run()
    assert not torch.allclose(plain.float(), out.float(), atol=1e-2)


def random_tree_masks(num_reqs, num_spec, seed):
    """[num_reqs, S, S]: a different random tree (parents[i] < i) for every request."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for _ in range(num_reqs):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_spec)]
        masks.append(tree_mask(parents))
    return torch.stack(masks)


def naive_tree_visibility(mask_b, query_len, seq_len):
    """One request, by hand: dense [query_len, seq_len] bool. Query token j sits at position
    seq_len - query_len + j; the mask covers the last S keys and query token j uses mask row
    S - query_len + j (the rule of backends/metadata.py); causal everywhere."""
    num_spec = mask_b.shape[0]
    first = seq_len - num_spec
    vis = torch.zeros(query_len, seq_len, dtype=torch.bool)
    for j in range(query_len):
        p = seq_len - query_len + j
        for k in range(p + 1):
            if p >= first and k >= first:
                vis[j, k] = bool(mask_b[num_spec - query_len + j, k - first])
            else:
                vis[j, k] = True
    return vis


def dense_allowed_for(case, masks):
    """``Case.expected``'s allowed_for from per-request masks [B, S, S] (or one [S, S])."""
    def allowed_for(i):
        cached, query_len = case.specs[i]
        mask_b = masks if masks.dim() == 2 else masks[i]
        vis = naive_tree_visibility(mask_b, query_len, case.seq_lens[i])
        return lambda p, k: bool(vis[p - cached, k])
    return allowed_for


# Ragged tree batch for S = 6: q < S (a tree level), q == S (a verify), q > S (ordinary tokens
# before the tree), a decode (q = 1, the last mask row) and q == seq_len == S (no context).
TREE_SPECS = [(7, 2), (4, 6), (3, 8), (10, 1), (0, 6), (5, 4)]


def test_naive_tree_visibility_worked_example():
    # seq_len 10, S 4, q 2: the mask covers positions 6..9; the query tokens sit at 8 and 9
    # and use mask rows 2 and 3.
    mask = tree_mask([-1, 0, 0, 1])
    vis = naive_tree_visibility(mask, 2, 10)
    assert vis[0].tolist() == [True] * 6 + [True, False, True, False]  # node 2: root, itself
    assert vis[1].tolist() == [True] * 6 + [True, True, False, True]  # node 3: 0, 1, itself


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=["gqa2", "gqa6"])
def test_per_request_tree_masks_match_naive_dense_reference(layout, heads):
    masks = random_tree_masks(len(TREE_SPECS), 6, seed=1)
    case = Case(TREE_SPECS, num_heads=heads[0], num_kv_heads=heads[1], layout=layout, seed=5)
    out = case.run(num_padding=3, spec_mask=masks)
    n = sum(q for _, q in TREE_SPECS)
    torch.testing.assert_close(out[:n], case.expected(dense_allowed_for(case, masks)),
                               atol=1e-5, rtol=1e-5)
    assert not out[n:].any()  # graph padding rows: 0
    # Request b used masks[b]: the same step with request 1's tree for everyone differs.
    shared = Case(TREE_SPECS, num_heads=heads[0], num_kv_heads=heads[1], layout=layout,
                  seed=5).run(num_padding=3, spec_mask=masks[1])
    assert not torch.allclose(shared[:n], out[:n], atol=1e-3)


def test_shared_mask_equals_the_same_mask_per_request():
    mask = tree_mask([-1, 0, 0, 1, 1, 2])
    shared = Case(TREE_SPECS, seed=6).run(num_padding=2, spec_mask=mask)
    per_request = Case(TREE_SPECS, seed=6).run(
        num_padding=2, spec_mask=mask.expand(len(TREE_SPECS), 6, 6).clone())
    assert torch.equal(shared, per_request)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), num_spec=st.integers(1, 5), seed=st.integers(0, 1000))
def test_ragged_per_request_masks_match_naive(data, num_spec, seed):
    specs = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 7)), min_size=1,
                               max_size=4))
    # Every request's seq_len must cover the S masked keys.
    specs = [(max(c, num_spec - q), q) for c, q in specs]
    masks = random_tree_masks(len(specs), num_spec, seed)
    case = Case(specs, head_dim=8, seed=seed)
    out = case.run(num_padding=1, spec_mask=masks)
    torch.testing.assert_close(out[:-1], case.expected(dense_allowed_for(case, masks)),
                               atol=1e-5, rtol=1e-5)


def test_impl_rejects_bad_head_ratio():
    with pytest.raises(ValueError, match="3"):
        TorchSDPAImpl(4, 3, 16, 0.25)
