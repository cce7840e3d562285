"""Shared helpers for the built-in model pair scripts (tokenizer, data, sizes)."""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rocdraft.bench import corpus as builtin_corpus  # noqa: E402,F401  (shared with rocdraft bench)

EOT = "<|endoftext|>"
PAD = "<|pad|>"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / "models" / "builtin"


def setup(seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   pad_token=PAD, unk_token=None,
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(out))


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def encode_stream(tok, texts: Sequence[str]) -> torch.Tensor:
    """Documents joined as ``<|endoftext|> doc <|endoftext|> doc ...`` (int64 ids)."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    ids: List[int] = []
    for e in encs:
        ids.append(eot)
        ids.extend(e.ids)
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def progress_lr(step: int, progress: float, peak: float, warmup: int, total: int,
                floor: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine from ``peak`` to ``floor * peak``
    as ``progress`` (0..1, fraction of the run done) goes from warmup/total to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    w = warmup / max(total, 1)
    frac = min(1.0, max(0.0, (progress - w) / max(1e-9, 1 - w)))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------- sizes
def safetensors_stats(path: Path) -> Dict[str, float]:
    """Parameter count and file size (MB) of every *.safetensors file in a directory."""
    from safetensors import safe_open
    n, nbytes = 0, 0
    for f in sorted(Path(path).glob("*.safetensors")):
        nbytes += f.stat().st_size
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                n += fh.get_slice(k).get_shape() and int(np.prod(fh.get_slice(k).get_shape()))
    return {"params": n, "mb": nbytes / 1e6}


def print_total_size(root: Path = DEFAULT_DIR, limit_mb: float = 40.0) -> float:
    total = 0.0
    for sub in ("target", "eagle1", "eagle3"):
        d = Path(root) / sub
        if d.is_dir():
            st = safetensors_stats(d)
            total += st["mb"]
            log(f"size {sub}: {st['params'] / 1e6:.3f} M params, {st['mb']:.2f} MB")
    log(f"size total (safetensors): {total:.2f} MB (limit {limit_mb} MB)"
        + ("" if total <= limit_mb else "  ** OVER LIMIT **"))
    return total


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def thread_note() -> str:
    return f"threads={torch.get_num_threads()} pid={os.getpid()}"


# ----------------------------------------------------------------------------- EAGLE heads
# Dense reference implementation of the two head formats, with EAGLE-3's
# "training-time test" unroll. Entry i of a head's sequence holds the NEXT token
# x_{i+1} and a feature for position i, and uses RoPE position i. Unroll step s
# at entry i drafts position i from anchor a = i - s: its feature is step s-1's
# output at entry i-1, and it attends to the step-0 (true-feature) entries j <= a
# plus the entries of steps 1..s at positions a+1..a+s (one key per step).
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions, head_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)  # HF Llama "rotate_half" layout
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def shift_right(x, n):
    """x[:, i] <- x[:, i - n] along dim 1 (zeros enter at the front)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], 1)


class Attention(nn.Module):
    def __init__(self, in_dim, hidden, n_heads, n_kv, head_dim):
        super().__init__()
        self.nh, self.nkv, self.hd = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(in_dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def qkv(self, z, cos, sin):
        B, T, _ = z.shape
        q = self.q_proj(z).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(z).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(z).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def ttt(self, q, ks, vs):
        """q [B,nh,T,d]; ks/vs: per unroll step [B,nkv,T,d]; the last entry is this step."""
        s = len(ks) - 1
        rep = self.nh // self.nkv
        qf = q.float() / math.sqrt(self.hd)
        k0 = ks[0].float().repeat_interleave(rep, 1)
        T = q.shape[2]
        sc = [qf @ k0.transpose(-1, -2)]
        allowed = torch.ones(T, T, dtype=torch.bool).tril(-s)
        sc[0] = sc[0].masked_fill(~allowed, float("-inf"))
        vals = [vs[0].float().repeat_interleave(rep, 1)]
        idx = torch.arange(T)
        for sp in range(1, s + 1):
            kk = shift_right(ks[sp].float().repeat_interleave(rep, 1).transpose(1, 2), s - sp).transpose(1, 2)
            d = (qf * kk).sum(-1, keepdim=True).masked_fill((idx < s - sp)[:, None], float("-inf"))
            sc.append(d)
            vals.append(shift_right(vs[sp].float().repeat_interleave(rep, 1).transpose(1, 2),
                                    s - sp).transpose(1, 2))
        p = torch.softmax(torch.cat(sc, -1), -1)
        out = p[..., :T] @ vals[0]
        for j, v in enumerate(vals[1:]):
            out = out + p[..., T + j:T + j + 1] * v
        B = q.shape[0]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1).to(q.dtype))


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c, attn_in, eagle3):
        super().__init__()
        H = c["hidden_size"]
        self.self_attn = Attention(attn_in, H, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        self.mlp = MLP(H, c["intermediate_size"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])
        if eagle3:
            self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
            self.hidden_norm = RMSNorm(H, c["rms_norm_eps"])


class EagleHead(nn.Module):
    """kind 'eagle1': h = fc(cat(embed(x), feat)); h += attn(h); h += mlp(ln(h)); logits = target lm_head(h).
    kind 'eagle3': g = fc(aux) at step 0 else fed-back h; z = cat(in_ln(embed(x)), hid_norm(g));
    h = g + attn(z); h += mlp(ln(h)); logits = lm_head(norm(h)) over the draft vocab."""

    def __init__(self, kind, c, embed, target_lm_head):
        super().__init__()
        self.kind, self.c = kind, c
        H = c["hidden_size"]
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        if kind == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=c.get("bias", True))
            self.layers = nn.ModuleList([DecoderLayer(c, H, False)])
            self.register_buffer("lm_head_w", target_lm_head.detach().clone(), persistent=False)
        else:
            self.fc = nn.Linear(3 * c["target_hidden_size"], H, bias=False)
            self.midlayer = DecoderLayer(c, 2 * H, True)
            self.norm = RMSNorm(H, c["rms_norm_eps"])
            self.lm_head = nn.Linear(H, c["draft_vocab_size"], bias=False)

    @property
    def layer(self):
        return self.layers[0] if self.kind == "eagle1" else self.midlayer

    def logits(self, h):
        if self.kind == "eagle1":
            return h @ self.lm_head_w.to(h.dtype).t()
        return self.lm_head(self.norm(h))

    def unroll(self, tokens, feat0, n_steps):
        """tokens [B,T] (x_{i+1} at entry i), feat0 [B,T,F] -> list of (h, logits) per step."""
        B, T = tokens.shape
        cos, sin = rope_cos_sin(torch.arange(T), self.c["head_dim"], self.c["rope_theta"])
        emb = F.embedding(tokens, self.embed)
        L = self.layer
        g = feat0 if self.kind == "eagle1" else self.fc(feat0)
        ks, vs, outs = [], [], []
        for s in range(n_steps):
            if s > 0:
                g = shift_right(outs[-1][0], 1)
            if self.kind == "eagle1":
                res = self.fc(torch.cat([emb.to(g.dtype), g], -1))
                z = res
            else:
                res = g
                z = torch.cat([L.input_layernorm(emb.to(g.dtype)), L.hidden_norm(g)], -1)
            q, k, v = L.self_attn.qkv(z, cos, sin)
            ks.append(k)
            vs.append(v)
            h = res + L.self_attn.ttt(q, ks, vs)
            h = h + L.mlp(L.post_attention_layernorm(h))
            outs.append((h, self.logits(h)))
        return outs
