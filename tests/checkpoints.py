"""Test utilities: tiny random checkpoints in the real on-disk formats, and a paged-batch helper.

Targets are written by transformers itself (config + model classes + ``save_pretrained``),
so they are exactly what the loaders meet in the wild; EAGLE heads are written by hand with
the key layouts of published heads (yuhuili/EAGLE-*, EAGLE3-*).

Weights are re-drawn at a sensible scale (linear ``std = 1/sqrt(fan_in)``, embeddings ``std 1``,
norm weights ``1 + 0.1 * noise``, biases ``0.1 * noise``) so activations stay O(1), logits
are peaked enough for stable greedy tokens, and a norm or bias that is loaded wrongly shows.

Usage::

    target = write_tiny_llama(tmp_path / "t", kind="llama3")        # tied, llama3 RoPE
    deep = write_tiny_llama(tmp_path / "d", kind="deep")            # 6 layers, for EAGLE-3
    head1 = write_eagle1_head(tmp_path / "e1", target, fmt="bin")
    head3 = write_eagle3_head(tmp_path / "e3", deep)                # draft vocab = vocab // 2
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=None)
KINDS = ("llama", "llama3", "qwen2", "deep")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-draw every parameter at the scale described in the module docstring."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def write_tiny_llama(directory: str | Path, kind: str = "llama", seed: int = 0,
                     tokenizer: bool = True, **overrides) -> Path:
    """A tiny float32 HF checkpoint (model.safetensors + config.json + generation_config.json,
    + tokenizer.json when ``tokenizer``). ``kind``: ``llama`` (GQA 4/2 heads, 3 layers),
    ``llama3`` (llama3 rope scaling, tied embeddings, eos [2, 3]), ``qwen2`` (q/k/v biases,
    theta 1e6), ``deep`` (llama with 8 layers: distinct EAGLE-3 aux ids (2, 4, 5)).
    ``overrides`` replace config fields (e.g. ``num_hidden_layers=6``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid: {KINDS}")
    directory = Path(directory)
    fields = dict(TINY)
    if kind == "llama":
        fields.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "llama3":
        fields.update(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True,
                      eos_token_id=[2, 3])
    elif kind == "deep":
        fields.update(num_hidden_layers=8, rope_parameters={"rope_type": "default",
                                                            "rope_theta": 10000.0})
    else:
        fields.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    fields.update(overrides)
    config_cls, model_cls, arch = ((Qwen2Config, Qwen2ForCausalLM, "Qwen2ForCausalLM")
                                   if kind == "qwen2" else
                                   (LlamaConfig, LlamaForCausalLM, "LlamaForCausalLM"))
    config = config_cls(architectures=[arch], **fields)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    _randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    if tokenizer:
        write_tiny_tokenizer(directory, config.vocab_size)
    return directory


_WORDS = ("the a an is are was be to of and in on at it that this with for as by from hello "
          "world quick brown fox jumps over lazy dog one two three four five six seven eight "
          "nine ten yes no what who when where why how I you we they he she").split()


def write_tiny_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """tokenizer.json: a word-level tokenizer, ``<unk>`` 0, ``<s>`` 1 (prepended), ``</s>`` 2,
    then lowercase words, letters, digits and ``w{id}`` fillers up to ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokens = ["<unk>", "<s>", "</s>"] + list(_WORDS) + list("abcdefghijklmnopqrstuvwxyz0123456789")
    tokens = list(dict.fromkeys(tokens))[:vocab_size]
    tokens += [f"w{i}" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"})
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _target_parts(target_dir: Path) -> tuple[dict, torch.Tensor]:
    from safetensors.torch import load_file

    config = json.loads((target_dir / "config.json").read_text())
    embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    return config, embed


def _linear(generator: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5


def _norm(generator: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=generator)


def _layer_weights(g: torch.Generator, prefix: str, in_size: int, hidden: int, inter: int,
                   heads: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.self_attn.q_proj.weight": _linear(g, heads * head_dim, in_size),
        f"{prefix}.self_attn.k_proj.weight": _linear(g, kv_heads * head_dim, in_size),
        f"{prefix}.self_attn.v_proj.weight": _linear(g, kv_heads * head_dim, in_size),
        f"{prefix}.self_attn.o_proj.weight": _linear(g, hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": _linear(g, inter, hidden),
        f"{prefix}.mlp.up_proj.weight": _linear(g, inter, hidden),
        f"{prefix}.mlp.down_proj.weight": _linear(g, hidden, inter),
        f"{prefix}.post_attention_layernorm.weight": _norm(g, hidden),
    }


def _save(directory: Path, state: dict[str, torch.Tensor], fmt: str) -> None:
    if fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    elif fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(directory / "model.safetensors"))
    else:
        raise ValueError(f"unknown fmt {fmt!r}; valid: 'bin', 'safetensors'")


def _head_config(target: dict, arch: str) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id")
    return {"architectures": [arch], "model_type": "llama", "hidden_act": "silu",
            "num_hidden_layers": 1, "max_position_embeddings": 2048,
            **{k: target[k] for k in keys if k in target}}


def write_eagle1_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                      bias: bool = True, fmt: str = "bin") -> Path:
    """An EAGLE-1 head for ``target_dir`` (config like LlamaForCausalLM, 1 layer, "bias",
    rope_theta 10000, embed_tokens copied from the target)."""
    directory, target_dir = Path(directory), Path(target_dir)
    target, embed = _target_parts(target_dir)
    g = torch.Generator().manual_seed(seed)
    hidden = target["hidden_size"]
    state = {"fc.weight": _linear(g, hidden, 2 * hidden), "embed_tokens.weight": embed.clone()}
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(hidden, generator=g)
    state.update(_layer_weights(g, "layers.0", hidden, hidden, target["intermediate_size"],
                                target["num_attention_heads"], target["num_key_value_heads"],
                                target["head_dim"]))
    directory.mkdir(parents=True, exist_ok=True)
    _save(directory, state, fmt)
    _write_json(directory / "config.json", {**_head_config(target, "LlamaForCausalLM"),
                                            "bias": bias, "rope_theta": 10000.0})
    return directory


def write_eagle3_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                      draft_vocab_size: int | None = None, fmt: str = "safetensors",
                      architecture: str = "LlamaForCausalLMEagle3") -> Path:
    """An EAGLE-3 head for ``target_dir`` (no rope_theta in the config: base 10000).
    ``draft_vocab_size`` None -> half the target vocab (a d2t map is written); equal to the
    target vocab -> d2t all zeros, t2d all true (no map)."""
    directory, target_dir = Path(directory), Path(target_dir)
    target, _ = _target_parts(target_dir)
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    draft_vocab = draft_vocab_size or vocab // 2
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    state = {"fc.weight": _linear(g, hidden, 3 * hidden)}
    state.update(_layer_weights(g, "midlayer", 2 * hidden, hidden, target["intermediate_size"],
                                heads, kv_heads, target["head_dim"]))
    state["midlayer.input_layernorm.weight"] = _norm(g, hidden)
    state["midlayer.hidden_norm.weight"] = _norm(g, hidden)
    state["norm.weight"] = _norm(g, hidden)
    state["lm_head.weight"] = _linear(g, draft_vocab, hidden)
    # Draft id i stands for target id kept[i]: d2t[i] = kept[i] - i; t2d marks kept ids.
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    state["d2t"] = kept - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)
    directory.mkdir(parents=True, exist_ok=True)
    _save(directory, state, fmt)
    _write_json(directory / "config.json", {**_head_config(target, architecture),
                                            "draft_vocab_size": draft_vocab,
                                            "target_hidden_size": hidden,
                                            "tie_word_embeddings": False})
    return directory


@dataclass
class PagedBatch:
    """Host-side bookkeeping for driving a model on a paged cache in tests.

    Each request owns ``blocks_per_seq`` consecutive blocks (request r: blocks
    ``r * blocks_per_seq ...``, reversed so block order differs from slot order).
    """

    num_reqs: int
    block_size: int = 4
    blocks_per_seq: int = 16

    def __post_init__(self) -> None:
        rows = [list(reversed(range(r * self.blocks_per_seq, (r + 1) * self.blocks_per_seq)))
                for r in range(self.num_reqs)]
        self.block_table = torch.tensor(rows, dtype=torch.int32)
        self.num_cached = [0] * self.num_reqs

    @property
    def num_blocks(self) -> int:
        return self.num_reqs * self.blocks_per_seq

    def step(self, new_tokens: list[list[int]], backend, device="cpu"):
        """Schedule ``new_tokens[r]`` (possibly empty) after request r's cached tokens.

        Returns (input_ids [num_tokens], positions [num_tokens], attn_metadata, last_index
        [num_reqs] index of each scheduled request's last token, -1 when none)."""
        from rocdraft.backends.kv_cache import compute_slot_mapping
        from rocdraft.backends.metadata import CommonAttentionMetadata

        reqs = [r for r in range(self.num_reqs) if new_tokens[r]]
        ids, pos, req_idx, qsl, seq_lens, last = [], [], [], [0], [], [-1] * self.num_reqs
        for row, r in enumerate(reqs):
            start = self.num_cached[r]
            ids += new_tokens[r]
            pos += list(range(start, start + len(new_tokens[r])))
            req_idx += [row] * len(new_tokens[r])
            qsl.append(len(ids))
            seq_lens.append(start + len(new_tokens[r]))
            last[r] = len(ids) - 1
            self.num_cached[r] += len(new_tokens[r])
        positions = torch.tensor(pos, dtype=torch.int64)
        table = self.block_table[reqs]
        slots = compute_slot_mapping(table, torch.tensor(req_idx), positions, self.block_size)
        common = CommonAttentionMetadata.from_cpu(qsl, seq_lens, table, slots, device)
        metadata = backend.builder_cls(device).build(common)
        return (torch.tensor(ids, dtype=torch.int64, device=device), positions.to(device),
                metadata, last)


# --- "cyclic" pairs: heads that are right often but not always ---------------------------
#
# Random heads never agree with a random target (acceptance length exactly 1), so a
# lossless test passes without exercising the accept path. A cyclic target mostly follows a
# fixed successor map: its residual stream is the current token's embedding plus scaled-down
# random layers (``noise``), and its lm_head row for token y is the embedding of the token
# whose successor y is, so greedy decoding follows ``successor`` except where the context
# (the noise) overrules it. Cyclic heads draft ``successor(next token)``: they are right
# whenever the target follows the map and wrong where it does not (and, for EAGLE-3, where the
# successor is outside the draft vocabulary).


def successor_map(target_dir: str | Path) -> torch.Tensor:
    """[vocab] int64: the token a cyclic target's lm_head prefers after each token."""
    from safetensors.torch import load_file

    state = load_file(str(Path(target_dir) / "model.safetensors"))
    embed, lm_head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    return (embed @ lm_head.T).argmax(dim=1)


def make_cyclic(state: dict[str, torch.Tensor], seed: int, noise: float,
                sharpness: float) -> None:
    """Turn a Llama-family trunk's ``state`` (keys under ``model.``, plus ``lm_head.weight``)
    into one whose greedy next token is mostly a fixed random permutation of the current
    token: the blocks' o_proj and down_proj scaled by ``noise``, the final norm 1, and
    logits[y] = sharpness * cos(embed[inverse[y]], final hidden) (|embed| ~ sqrt(hidden))."""
    g = torch.Generator().manual_seed(seed + 1)
    embed = state["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    perm = torch.randperm(vocab, generator=g)
    inverse = torch.empty_like(perm).index_copy_(0, perm, torch.arange(vocab))
    for key in state:
        if key.startswith("model.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            state[key] = state[key] * noise
    state["model.norm.weight"] = torch.ones(hidden)
    state["lm_head.weight"] = sharpness * embed[inverse] / hidden


def write_cyclic_llama(directory: str | Path, seed: int = 0, noise: float = 1.1,
                       sharpness: float = 16.0, kind: str = "llama", **overrides) -> Path:
    """A tiny untied llama (4 layers: few, so the Triton interpreter stays quick) whose greedy
    next token is mostly a fixed random permutation of the current token (see above). ``noise``
    scales every layer's o_proj and down_proj (0: always the permutation; 1.1 follows it about
    70% of the time); ``sharpness`` is the logit of the permutation's token before the noise.
    ``kind`` and ``overrides`` as for ``write_tiny_llama`` (``qwen2``: a MiMo trunk)."""
    from safetensors.torch import load_file, save_file

    directory = write_tiny_llama(directory, kind=kind, seed=seed,
                                 **{"num_hidden_layers": 4, **overrides})
    path = directory / "model.safetensors"
    state = load_file(str(path))
    make_cyclic(state, seed, noise, sharpness)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    return directory


def write_cyclic_eagle1_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                             noise: float = 0.2, fmt: str = "bin") -> Path:
    """An EAGLE-1 head (``write_eagle1_head``'s keys) for a cyclic target: ``fc`` passes the
    next token's embedding through (plus ``noise`` times the feature), the layer adds
    ``noise``-scaled random attention and MLP outputs, so the target's lm_head on the output
    mostly picks the successor of the next token."""
    directory = write_eagle1_head(directory, target_dir, seed=seed, bias=True, fmt=fmt)
    path = directory / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    state = _load_head(path)
    hidden = state["fc.weight"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    state["fc.weight"] = torch.cat([torch.eye(hidden),
                                    noise * _linear(g, hidden, hidden)], dim=1)
    state["fc.bias"] = torch.zeros(hidden)
    for key in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        state[key] = state[key] * noise
    _save(directory, state, fmt)
    return directory


def write_cyclic_eagle3_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                             draft_vocab_size: int | None = None, noise: float = 0.05,
                             fmt: str = "safetensors") -> Path:
    """An EAGLE-3 head (``write_eagle3_head``'s keys, d2t over ``draft_vocab_size``, default
    90% of the vocab) for a cyclic target. The attention is sharp self-attention on the next
    token's embedding, its value a 32-d code of that token; the value read from the fed-back
    hidden state cancels the residual (so later draft steps do not accumulate the earlier
    tokens' codes); lm_head row d is the code of the token whose successor is draft id d.
    Drafts: the successor of the next token when it is in the draft vocabulary."""
    target_dir = Path(target_dir)
    target = json.loads((target_dir / "config.json").read_text())
    vocab = target["vocab_size"]
    draft_vocab = draft_vocab_size or (9 * vocab) // 10
    directory = write_eagle3_head(directory, target_dir, seed=seed,
                                  draft_vocab_size=draft_vocab, fmt=fmt)
    path = directory / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    state = _load_head(path)
    _, embed = _target_parts(target_dir)
    hidden, head_dim = target["hidden_size"], target["head_dim"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    code = kv_heads * head_dim  # the value space, [code] per token
    g = torch.Generator().manual_seed(seed + 1)
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))[0]  # orthonormal
    out_basis = basis[:, :code]  # [H, code]: o_proj writes, v_proj reads this subspace
    value_rows = out_basis.T  # [code, H]
    keys = _linear(g, code, hidden)
    zeros = torch.zeros(code, hidden)
    state["midlayer.self_attn.k_proj.weight"] = torch.cat([keys, zeros], dim=1)
    group = heads // kv_heads
    query_rows = torch.cat([keys[(h // group) * head_dim:(h // group + 1) * head_dim]
                            for h in range(heads)])
    state["midlayer.self_attn.q_proj.weight"] = torch.cat(
        [8.0 * query_rows, torch.zeros(heads * head_dim, hidden)], dim=1)
    # o_proj reads each kv head's value once (the group's query heads share it).
    o_proj = torch.zeros(hidden, heads * head_dim)
    for h in range(heads):
        kv = h // group
        o_proj[:, h * head_dim:(h + 1) * head_dim] = \
            out_basis[:, kv * head_dim:(kv + 1) * head_dim] / group
    state["midlayer.self_attn.o_proj.weight"] = o_proj
    for name in ("input_layernorm", "hidden_norm"):
        state[f"midlayer.{name}.weight"] = torch.ones(hidden)
    state["norm.weight"] = torch.ones(hidden)
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + target["rms_norm_eps"])
    codes = normed @ value_rows.T @ out_basis.T  # [vocab, H]: the attention output per token
    # The hidden-state value maps norm(g) back to -g for |g| near the typical code norm.
    scale = codes.norm(dim=1).mean() / hidden ** 0.5
    state["midlayer.self_attn.v_proj.weight"] = torch.cat([value_rows, -scale * value_rows],
                                                          dim=1)
    state["fc.weight"] = torch.zeros(hidden, 3 * hidden)
    state["midlayer.mlp.down_proj.weight"] = noise * state["midlayer.mlp.down_proj.weight"]
    kept = torch.arange(draft_vocab) + state["d2t"]
    inverse = torch.empty(vocab, dtype=torch.int64).index_copy_(
        0, successor_map(target_dir), torch.arange(vocab))
    unit = codes / codes.pow(2).mean(-1, keepdim=True).sqrt()
    state["lm_head.weight"] = 12.0 * unit[inverse[kept]] / hidden
    _save(directory, state, fmt)
    # The cyclic target is shallow: (2, L//2, L-3) would repeat a layer, so declare the ids
    # (vLLM's key); ``fc`` is zero, so which layers they are does not change the drafts.
    layers = target["num_hidden_layers"]
    config = json.loads((directory / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [layers - 3, layers - 2, layers - 1]
    _write_json(directory / "config.json", config)
    return directory


def _load_head(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".bin":
        return torch.load(path, weights_only=True)
    from safetensors.torch import load_file
    return load_file(str(path))


def write_cyclic_pair(root: str | Path) -> tuple[str, str]:
    """(target, EAGLE-3 head) directories under ``root``: a cyclic target and a head that is
    right most of the time (drafts accepted often, not always)."""
    root = Path(root)
    target = write_cyclic_llama(root / "target")
    return str(target), str(write_cyclic_eagle3_head(root / "eagle3", target))
