"""MTP heads (models/mtp.py): the layer's forward against a plain-torch implementation of each
layout's formula, and speculative generation with the target's own MTP layers: lossless
(greedy and seeded sampling) with drafts really accepted, for 1 and 2 MTP layers, k up to 4,
padded and unpadded drafting, on every backend of the matrix; the draft loop's padded
static-buffer replay (the CPU path of the captured graphs), the cost policy and trees.

The lossless tests run cyclic targets (tests/mtp_checkpoints.py): MTP layer 0 drafts the
successor of the next token, right wherever the target follows its successor map (~70%), so
acceptance lies well above 1 and below k + 1 (the accept and the reject paths both run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from checkpoints import PagedBatch
from mtp_checkpoints import mtp_tensors, write_deepseek_layout_target, write_mimo_target
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.engine import LLM
from rocdraft.models.llama import load_target
from rocdraft.models.mtp import DeepSeekMtpHead, MimoMtpHead
from rocdraft.models.mtp_loader import load_mtp_head

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_k=50, max_tokens=10, seed=s, ignore_eos=True)
          for s in (11, 12, 13, 14)]
LAYOUTS = ("mimo", "deepseek")
WRITERS = {"mimo": write_mimo_target, "deepseek": write_deepseek_layout_target}


# --- the formula -------------------------------------------------------------------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, d] rotated by position (rotate-half convention, plain RoPE)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]  # [n, d/2]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None].float()
    sin = torch.cat([angles.sin()] * 2, -1)[:, None].float()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _block(t: dict, x: torch.Tensor, positions: torch.Tensor, cfg: dict) -> torch.Tensor:
    """A pre-norm Llama / Qwen2 decoder layer over one causal sequence x [n, H]."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = x.shape[0]
    h = _rms(x, t["input_layernorm.weight"], eps)
    q, k, v = (F.linear(h, t[f"self_attn.{p}_proj.weight"], t.get(f"self_attn.{p}_proj.bias"))
               for p in "qkv")
    q = _rope(q.view(n, heads, d), positions, theta)
    k = _rope(k.view(n, kv_heads, d), positions, theta).repeat_interleave(heads // kv_heads, 1)
    v = v.view(n, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + attn @ t["self_attn.o_proj.weight"].T
    h = _rms(x, t["post_attention_layernorm.weight"], eps)
    gate, up = h @ t["mlp.gate_proj.weight"].T, h @ t["mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ t["mlp.down_proj.weight"].T


def reference_mtp(layout: str, t: dict, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                  ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(returned hidden [n, H], logits [n, vocab]) of MTP layer tensors ``t`` over one
    sequence, straight from the published formulas (REFERENCE.md "MTP heads")."""
    eps = cfg["rms_norm_eps"]
    e = embed[ids].clone()
    e[positions == 0] = 0
    if layout == "mimo":  # hidden first
        x = torch.cat([_rms(hidden, t["hidden_layernorm.weight"], eps),
                       _rms(e, t["token_layernorm.weight"], eps)], -1) @ t["input_proj.weight"].T
        out = _rms(_block(t, x, positions, cfg), t["final_layernorm.weight"], eps)
        return out, out @ lm_head.T
    # DeepSeek: embedding first; returned before any norm; its own shared_head
    x = torch.cat([_rms(e, t["enorm.weight"], eps), _rms(hidden, t["hnorm.weight"], eps)],
                  -1) @ t["eh_proj.weight"].T
    out = _block(t, x, positions, cfg)
    return out, _rms(out, t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T


@pytest.fixture(scope="module")
def formula_targets(tmp_path_factory):
    """Random (not cyclic) MTP weights: MiMo, DeepSeek over Llama whose embed/head copies
    equal the trunk's, DeepSeek whose copies differ (its own modules are used), DeepSeek over
    a Qwen2 block (q/k/v biases)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("mtp_formula")
    own = write_deepseek_layout_target(root / "deepseek_own", cyclic=False, seed=3)
    path = own / "model.safetensors"
    state = load_file(str(path))
    for key in ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"):
        state[key] = state[key] + 0.5 * torch.randn(state[key].shape)
    save_file(state, str(path), metadata={"format": "pt"})
    return {"mimo": write_mimo_target(root / "mimo", cyclic=False, seed=1),
            "deepseek": write_deepseek_layout_target(root / "deepseek", cyclic=False, seed=2),
            "deepseek_own": own,
            "deepseek_qwen2": write_deepseek_layout_target(root / "deepseek_qwen2", cyclic=False,
                                                           seed=6, kind="qwen2")}


@pytest.mark.parametrize("case", ["mimo", "deepseek", "deepseek_own", "deepseek_qwen2"])
def test_forward_equals_the_layout_formula(formula_targets, case, attention_backend):
    """Two ragged sequences from position 0 (so the position-0 embedding is zeroed) through
    the paged cache, then one more token each: every row's returned hidden and logits equal
    the plain-torch formula of the layout (hidden first for MiMo, embedding first and the
    pre-norm hidden for DeepSeek)."""
    import json

    layout = "mimo" if case == "mimo" else "deepseek"
    directory = formula_targets[case]
    cfg = json.loads((directory / "config.json").read_text())
    backend = get_backend(attention_backend)
    target = load_target(directory, torch.float32, "cpu", backend)
    head = load_mtp_head(directory, target, torch.float32, "cpu", backend)
    assert isinstance(head, MimoMtpHead if layout == "mimo" else DeepSeekMtpHead)
    if case == "deepseek_qwen2":
        assert head.self_attn.q_proj.bias is not None
    if case == "deepseek":  # equal copies: the target's modules are shared
        assert head.embed_tokens is target.embed_tokens
        assert head.shared_head.head is target.lm_head
    if case == "deepseek_own":
        assert head.embed_tokens is not target.embed_tokens
        assert head.shared_head.head is not target.lm_head
    trunk = load_file(str(directory / "model.safetensors"))
    prefix = "model.mtp_layers.0." if layout == "mimo" else \
        f"model.layers.{cfg['num_hidden_layers']}."
    t = mtp_tensors(directory, prefix)
    embed = t.get("embed_tokens.weight", trunk["model.embed_tokens.weight"])
    lm_head = trunk["lm_head.weight"]

    g = torch.Generator().manual_seed(0)
    lengths = (7, 4)
    ids = [torch.randint(0, cfg["vocab_size"], (n + 1,), generator=g) for n in lengths]
    hidden = [torch.randn(n + 1, cfg["hidden_size"], generator=g) for n in lengths]
    batch = PagedBatch(num_reqs=2)
    num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
    assert num_layers == 1
    caches = allocate_kv_cache(1, batch.num_blocks, batch.block_size, num_kv_heads, head_dim,
                               torch.float32, "cpu")
    got_hidden = [[], []]
    for prefill in (True, False):  # the prompts, then one more token each
        new = [(x[:-1] if prefill else x[-1:]).tolist() for x in ids]
        rows = [h[:-1] if prefill else h[-1:] for h in hidden]
        input_ids, positions, metadata, _ = batch.step(new, backend)
        with torch.no_grad():
            out = head(input_ids, positions, torch.cat(rows), caches, metadata)
        got_hidden[0].append(out[:len(new[0])])
        got_hidden[1].append(out[len(new[0]):])
    for r in range(2):
        got = torch.cat(got_hidden[r])
        want_hidden, want_logits = reference_mtp(layout, t, cfg, embed, lm_head, ids[r],
                                                 torch.arange(len(ids[r])), hidden[r])
        torch.testing.assert_close(got, want_hidden, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            logits = head.compute_draft_logits(got)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_position_zero_embedding_is_zeroed_for_every_position_layout():
    from rocdraft.models.mtp import zero_first_position

    embeds = torch.ones(4, 3)
    flat = zero_first_position(embeds, torch.tensor([0, 1, 0, 5]))
    assert flat[:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]
    mrope = zero_first_position(embeds, torch.tensor([[0, 1, 2, 0]] * 3))
    assert mrope[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]


# --- speculative generation --------------------------------------------------------------

@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Cyclic targets with 1 and 2 MTP layers in each layout (layer 0 identical)."""
    root = tmp_path_factory.mktemp("mtp_spec")
    return {(layout, n): str(WRITERS[layout](root / f"{layout}{n}", num_mtp_layers=n))
            for layout in LAYOUTS for n in (1, 2)}


@pytest.fixture(scope="module")
def references(targets):
    """Target-only greedy and seeded outputs of each trunk (1- and 2-layer checkpoints share
    their trunk)."""
    refs = {}
    for layout in LAYOUTS:
        llm = LLM(targets[(layout, 1)], attention_backend="TORCH_SDPA")
        refs[layout] = ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
                        [o.token_ids for o in llm.generate(PROMPTS, SEEDED)])
    return refs


def mtp_llm(target: str, k: int, attention_backend: str = "TORCH_SDPA", **spec) -> LLM:
    spec = {"padded_drafting": True, "draft_policy": "fixed", **spec}
    return LLM(target, attention_backend=attention_backend, max_num_batched_tokens=16,
               speculative_config=SpeculativeConfig("mtp", k, **spec))


def assert_accepted_and_rejected(stats, k: int) -> None:
    """Acceptance well above 1 (drafts accepted, bonus tokens) and below k + 1."""
    assert stats.num_verify_steps > 0
    lower = 1.4 if k == 1 else 1.8
    assert lower < stats.acceptance_length < k + 1, stats.accepted_at_position
    assert len(stats.per_position_acceptance) == k


CHAINS = [("mimo", 1, 1), ("mimo", 1, 4), ("mimo", 2, 2), ("deepseek", 1, 4),
          ("deepseek", 2, 1), ("deepseek", 2, 4)]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("layout, num_layers, k", CHAINS)
def test_greedy_mtp_equals_target_only(targets, references, layout, num_layers, k, padded,
                                       attention_backend):
    llm = mtp_llm(targets[(layout, num_layers)], k, attention_backend, padded_drafting=padded)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == references[layout][0]
    assert_accepted_and_rejected(llm.last_stats, k)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("layout, num_layers, k", [("mimo", 2, 4), ("deepseek", 1, 2)])
def test_seeded_mtp_equals_seeded_target_only(targets, references, layout, num_layers, k,
                                              padded, attention_backend):
    llm = mtp_llm(targets[(layout, num_layers)], k, attention_backend, padded_drafting=padded)
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == references[layout][1]
    assert_accepted_and_rejected(llm.last_stats, k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_zero_drafts_every_step(targets, layout):
    """The 2-layer checkpoint's layer 1 is random: drafting with layer 0 only, it proposes
    exactly what the 1-layer checkpoint (same layer 0) proposes, step for step; the head
    holds one layer and one cache layer."""
    runs = []
    for n in (1, 2):
        llm = mtp_llm(targets[(layout, n)], 4)
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        runs.append((outs, llm.last_stats.accepted_at_position, llm.last_stats.num_verify_steps))
        assert llm.draft_runner.head.kv_cache_spec()[0] == 1 and len(llm.draft_runner.kv_caches) == 1
    assert runs[0] == runs[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_and_unpadded_drafting_propose_the_same(targets, layout):
    runs = []
    for padded in (True, False):
        llm = mtp_llm(targets[(layout, 1)], 3, padded_drafting=padded)
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        runs.append((outs, llm.last_stats.accepted_at_position, llm.last_stats.num_verify_steps))
    assert runs[0] == runs[1]
    assert runs[0][1][0] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_loop_replay_on_static_buffers_is_lossless(targets, references, layout):
    """The draft loop run by DraftLoopRunner (bucket padding, static buffers: what a GPU
    captures and replays; eager on the CPU) gives the eager loop's drafts and tokens."""
    llm = mtp_llm(targets[(layout, 2)], 4)
    eager = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    eager_stats = llm.last_stats.accepted_at_position
    replaying = LLM(targets[(layout, 2)], attention_backend="TORCH_SDPA",
                    max_num_batched_tokens=16, graph_mode="replay-eagerly",
                    speculative_config=SpeculativeConfig("mtp", 4, draft_policy="fixed"))
    assert replaying.draft_runner.proposer.graph_runner is not None
    replayed = [o.token_ids for o in replaying.generate(PROMPTS, GREEDY)]
    assert eager == replayed == references[layout][0]
    assert replaying.last_stats.accepted_at_position == eager_stats


def test_cost_policy_drafts_with_mtp_and_stays_lossless(targets, references):
    """The default draft policy measures step costs with the MTP head and chooses counts."""
    llm = LLM(targets[("mimo", 1)], attention_backend="TORCH_SDPA",
              speculative_config=SpeculativeConfig("mtp", 3))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == references["mimo"][0]
    assert llm.policy.step_costs  # measured with the MTP head's forwards


@pytest.mark.parametrize("tree", [{"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"},
                                  {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6}],
                         ids=["static", "dynamic"])
def test_tree_drafting_with_mtp_is_lossless(targets, references, tree):
    """Trees come with the head interface: each level runs layer 0 on its parent's hidden."""
    llm = mtp_llm(targets[("deepseek", 1)], 3, **tree)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == references["deepseek"][0]
    assert llm.last_stats.num_tree_verify_steps > 0
    assert llm.last_stats.acceptance_length > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (none visible)")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_captured_mtp_draft_loop_on_gpu_is_lossless(targets, layout):
    """On a GPU the engine captures the MTP draft loop per bucket (CUDA/HIP graphs); the
    output equals target-only and the eager loop's, with drafts accepted."""
    kwargs = dict(device="cuda", max_num_seqs=4, attention_backend="TORCH_SDPA")
    target = targets[(layout, 2)]
    reference = [o.token_ids for o in LLM(target, **kwargs).generate(PROMPTS, GREEDY)]
    captured = LLM(target, **kwargs,
                   speculative_config=SpeculativeConfig("mtp", 3, draft_policy="fixed"))
    runner = captured.draft_runner
    assert runner.graph_refusal is None and runner.proposer.graph_runner is not None
    assert runner.proposer.graph_runner.graphs
    eager = LLM(target, **kwargs, speculative_config=SpeculativeConfig(
        "mtp", 3, enforce_eager=True, draft_policy="fixed"))
    assert [o.token_ids for o in captured.generate(PROMPTS, GREEDY)] == reference
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == reference
    assert captured.last_stats.accepted_at_position == eager.last_stats.accepted_at_position
    assert captured.last_stats.acceptance_length > 1.5
