"""rocdraft.distributed.tp_model: the sharded target on 2 and 4 real gloo processes equals the
TP-1 target (models/llama.py): logits of a ragged prefill and decode steps within float32
tolerance, greedy tokens identical, aux hidden states full-width, KV caches per rank.

Checkpoints: Llama (GQA 4/2), Qwen2 (q/k/v biases, a vocabulary that does not divide: padding),
Mistral-style; at TP 4 the 2 KV heads are replicated (each rank holds KV head
rank * 2 // 4), one checkpoint is sharded with an index, one ties its embeddings.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from checkpoints import TINY, PagedBatch, write_tiny_llama
from distributed_helpers import make_mistral, make_sharded, run_ranks
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.distributed.group import ParallelGroup
from rocdraft.distributed.layers import CommCounter
from rocdraft.distributed.tp_model import load_tp_target
from rocdraft.models.llama import load_target

BACKEND = "TORCH_SDPA"
PROMPT_LENGTHS = (5, 9, 2)
NUM_DECODE_STEPS = 3
AUX_LAYER_IDS = (0, 2)
TOL = dict(rtol=1e-4, atol=1e-4)


@torch.no_grad()
def _greedy_run(model) -> dict:
    """Prefill three ragged prompts, then greedy decode steps; every step's logits."""
    backend = get_backend(BACKEND)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENGTHS]
    batch = PagedBatch(len(prompts))
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, torch.float32, "cpu")
    logits_per_step, tokens, aux = [], [], ()
    new_tokens = prompts
    for step in range(1 + NUM_DECODE_STEPS):
        input_ids, positions, metadata, last = batch.step(new_tokens, backend)
        out = model(input_ids, positions, caches, metadata, AUX_LAYER_IDS)
        logits = model.compute_logits(out.hidden_states)
        if step == 0:
            aux = out.aux_hidden_states
        logits_per_step.append(logits)
        next_tokens = logits[last].argmax(-1).tolist()
        tokens.append(next_tokens)
        new_tokens = [[t] for t in next_tokens]
    return dict(logits=logits_per_step, tokens=tokens, aux=aux, kv_cache_spec=model.kv_cache_spec())


def _tp_worker(group: ParallelGroup, cases: list[tuple[str, str]], out_dir: str) -> None:
    results = {}
    for name, path in cases:
        counter = CommCounter()
        model = load_tp_target(path, group, torch.float32, "cpu", get_backend(BACKEND), counter)
        results[name] = dict(_greedy_run(model), counter=counter)
    torch.save(results, f"{out_dir}/rank{group.rank}.pt")


def _checkpoints(root, world_size: int) -> dict[str, str]:
    if world_size == 2:
        return {"llama": write_tiny_llama(root / "llama", kind="llama", seed=0, tokenizer=False),
                "qwen2": write_tiny_llama(root / "qwen2", kind="qwen2", seed=1, tokenizer=False,
                                          vocab_size=161),
                "mistral": make_mistral(write_tiny_llama(root / "mistral", kind="llama", seed=2,
                                                         tokenizer=False))}
    return {"llama_replicated_kv": write_tiny_llama(root / "llama", kind="llama", seed=3,
                                                    tokenizer=False),
            "qwen2_sharded_index": make_sharded(write_tiny_llama(
                root / "qwen2", kind="qwen2", seed=4, tokenizer=False, vocab_size=162)),
            "llama3_tied": write_tiny_llama(root / "llama3", kind="llama3", seed=5,
                                            tokenizer=False)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_target_matches_tp1(world_size, tmp_path):
    paths = _checkpoints(tmp_path, world_size)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_ranks(_tp_worker, world_size, [(k, str(v)) for k, v in paths.items()], str(out_dir))
    assert multiprocessing.active_children() == []
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    for name, path in paths.items():
        reference = _greedy_run(load_target(path, torch.float32, "cpu", get_backend(BACKEND)))
        num_layers, kv_heads, head_dim = reference["kv_cache_spec"]
        for rank, results in enumerate(ranks):
            got = results[name]
            # Each rank's cache holds only its KV heads (TINY: 2 KV heads; 1 per rank at TP 2,
            # 1 replicated at TP 4).
            assert got["kv_cache_spec"] == (num_layers, max(kv_heads // world_size, 1), head_dim)
            assert got["tokens"] == reference["tokens"], (name, rank)
            for step, (a, b) in enumerate(zip(got["logits"], reference["logits"])):
                assert a.shape == b.shape, (name, step)
                torch.testing.assert_close(a, b, **TOL, msg=f"{name} rank {rank} step {step}")
                torch.testing.assert_close(a, ranks[0][name]["logits"][step], rtol=0, atol=0)
            for a, b in zip(got["aux"], reference["aux"]):  # EAGLE-3 features: full width
                torch.testing.assert_close(a, b, **TOL)
            # One all-reduce per o_proj and down_proj plus the embedding's, of
            # [num_tokens, hidden] float32; one logits gather per step.
            counter = got["counter"]
            num_tokens = sum(PROMPT_LENGTHS) + NUM_DECODE_STEPS * len(PROMPT_LENGTHS)
            hidden = TINY["hidden_size"]
            steps = 1 + NUM_DECODE_STEPS
            assert counter.all_reduce_calls == steps * (2 * num_layers + 1)
            assert counter.all_reduce_bytes == (2 * num_layers + 1) * num_tokens * hidden * 4
            assert counter.all_gather_calls == steps


@pytest.fixture(scope="module")
def qwen2_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_load")
    return {"single": write_tiny_llama(root / "single", kind="qwen2", seed=8, tokenizer=False,
                                       vocab_size=162),
            "sharded": make_sharded(write_tiny_llama(root / "sharded", kind="qwen2", seed=8,
                                                     tokenizer=False, vocab_size=162))}


def _fraction_read(key: str, tp: int) -> float:
    """The share of checkpoint tensor ``key`` one rank must read (TINY: 2 KV heads)."""
    if key.endswith(("norm.weight", "down_proj.bias")):
        return 1.0
    if ".k_proj." in key or ".v_proj." in key:
        return 1 / min(tp, 2)  # TP 4: each rank reads its one replicated KV head of 2
    return 1 / tp


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_only_its_slices(tp, layout, qwen2_checkpoints):
    """No process group is needed to load: ranks are simulated in turn, without collectives."""
    from safetensors import safe_open

    path = qwen2_checkpoints[layout]
    sizes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            sizes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    totals = {k: int(torch.Size(s).numel()) for k, s in sizes.items()}
    vocab_rows_read = 0
    for rank in range(tp):
        counts: dict[str, int] = {}
        model = load_tp_target(path, ParallelGroup(rank, tp), torch.float32, "cpu",
                               get_backend(BACKEND), elements_read=counts)
        assert set(counts) == set(totals)
        for key, total in totals.items():
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                continue
            assert counts[key] == total * _fraction_read(key, tp), (key, rank)
        # 162 rows: 81 per rank at TP 2; 41 per rank at TP 4, the last rank 39 (+2 padding)
        embed_rows = counts["model.embed_tokens.weight"] // 64
        assert embed_rows == min(-(-162 // tp), 162 - rank * -(-162 // tp))
        vocab_rows_read += embed_rows
        assert model.embed_tokens.weight.shape == (-(-162 // tp), 64)
        assert model.layers[0].self_attn.q_proj.weight.shape == (64 // tp, 64)
        assert model.layers[0].self_attn.k_proj.bias.shape == (32 // min(tp, 2),)
        assert model.layers[0].mlp.down_proj.weight.shape == (64, 128 // tp)
    assert vocab_rows_read == 162


def test_replicated_kv_slices_hold_the_right_head(qwen2_checkpoints):
    from safetensors.torch import load_file

    path = qwen2_checkpoints["single"]
    full = load_file(str(path / "model.safetensors"))["model.layers.2.self_attn.v_proj.weight"]
    for rank in range(4):  # KV head rank * 2 // 4 of 16 rows each
        model = load_tp_target(path, ParallelGroup(rank, 4), torch.float32, "cpu",
                               get_backend(BACKEND))
        head = rank * 2 // 4
        torch.testing.assert_close(model.layers[2].self_attn.v_proj.weight,
                                   full[head * 16:(head + 1) * 16], rtol=0, atol=0)


def test_refusals_name_the_problem(tmp_path):
    import json

    from rocdraft.errors import CheckpointError, RocdraftError

    path = write_tiny_llama(tmp_path / "t", kind="llama", tokenizer=False)
    backend = get_backend(BACKEND)
    with pytest.raises(RocdraftError, match="tensor_parallel_size 3 does not divide "
                                            "num_attention_heads 4"):
        load_tp_target(path, ParallelGroup(0, 3), torch.float32, "cpu", backend)
    with pytest.raises(RocdraftError, match="larger than the 1 visible GPU"):
        load_tp_target(path, ParallelGroup(0, 2), torch.float32, "cpu", backend,
                       num_visible_gpus=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match=r"weight model\.layers\.0\.mlp\.gate_proj\.weight "
                                              r"has shape \[128, 64\], expected \[64, 64\]"):
        load_tp_target(path, ParallelGroup(1, 2), torch.float32, "cpu", backend)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"unexpected weight\(s\) .*model\.layers\.2\."):
        load_tp_target(path, ParallelGroup(0, 2), torch.float32, "cpu", backend)


@torch.no_grad()
def _head_run(target, head_path: str) -> torch.Tensor:
    """One draft forward of an EAGLE head (replicated: the whole head on every rank) over a
    ragged prefill of ``target``: EAGLE-1 reads the final hidden states, EAGLE-3 the aux ones.
    -> draft logits [num_tokens, draft vocab]."""
    from rocdraft.models.draft_loader import load_draft

    backend = get_backend(BACKEND)
    head = load_draft(head_path, target, torch.float32, "cpu", backend)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENGTHS]
    batch = PagedBatch(len(prompts))
    layers, kv_heads, head_dim = target.kv_cache_spec()
    caches = allocate_kv_cache(layers, batch.num_blocks, batch.block_size, kv_heads, head_dim,
                               torch.float32, "cpu")
    input_ids, positions, metadata, _ = batch.step(prompts, backend)
    aux_ids = head.aux_layer_ids(layers) if hasattr(head, "aux_layer_ids") else ()
    out = target(input_ids, positions, caches, metadata, aux_ids)
    features = (head.combine_hidden_states(out.aux_hidden_states) if aux_ids
                else out.hidden_states)
    h_layers, h_kv_heads, h_dim = head.kv_cache_spec()
    head_caches = allocate_kv_cache(h_layers, batch.num_blocks, batch.block_size, h_kv_heads,
                                    h_dim, torch.float32, "cpu")
    next_ids = input_ids.roll(-1)  # stands in for the shifted ids of chain drafting
    return head.compute_draft_logits(head(next_ids, positions, features, head_caches, metadata))


def _head_worker(group: ParallelGroup, target_path: str, head_paths: list[str],
                 out_dir: str) -> None:
    target = load_tp_target(target_path, group, torch.float32, "cpu", get_backend(BACKEND))
    torch.save([_head_run(target, p) for p in head_paths], f"{out_dir}/rank{group.rank}.pt")


def test_replicated_eagle_heads_over_the_tp_target(tmp_path):
    """EAGLE-1 (its own embedding, the target's gathered lm_head) and EAGLE-3 (the target's
    vocabulary-parallel embedding, aux features) give the TP-1 draft logits on every rank."""
    from checkpoints import write_eagle1_head, write_eagle3_head

    target = write_tiny_llama(tmp_path / "deep", kind="deep", seed=9, tokenizer=False)
    heads = [str(write_eagle1_head(tmp_path / "e1", target)),
             str(write_eagle3_head(tmp_path / "e3", target))]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_ranks(_head_worker, 2, str(target), heads, str(out_dir))
    reference = load_target(target, torch.float32, "cpu", get_backend(BACKEND))
    expected = [_head_run(reference, p) for p in heads]
    for rank in range(2):
        got = torch.load(out_dir / f"rank{rank}.pt")
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, **TOL)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
