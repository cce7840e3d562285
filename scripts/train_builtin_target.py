"""Train rocdraft's built-in target: a byte-level BPE tokenizer and a small Llama
(GQA) model on the Python standard library (training split of builtin_corpus).

Writes a Hugging Face directory (config.json, generation_config.json,
model.safetensors in bfloat16, tokenizer.json + tokenizer_config.json) and
train_stats.json. Training is time-boxed by wall clock; the cosine schedule
runs over --steps steps, or (--steps 0, the default) over the wall-clock budget
(--minutes, which includes tokenizer training and saving).

  nice -n 5 python scripts/train_builtin_target.py --out models/builtin/target \
      --minutes 40 --threads 2 > /tmp/builtin_target.log 2>&1
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import builtin_common as bc
from builtin_common import builtin_corpus, log


def build_model(args):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5, rope_theta=args.rope_theta,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
        initializer_range=0.02, bos_token_id=0, eos_token_id=0, pad_token_id=1,
        dtype="bfloat16")
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    gen = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=1, do_sample=False,
                           max_new_tokens=256)
    return model, gen


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def eval_loss(model, windows, batch):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        tot += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(bc.DEFAULT_DIR / "target"))
    ap.add_argument("--minutes", type=float, default=40.0, help="total wall-clock budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=0, help="schedule length; 0 = the wall-clock budget")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=32)
    args = ap.parse_args()

    t0 = time.time()
    deadline = t0 + args.minutes * 60
    bc.setup(args.seed, args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"target training: {vars(args)} {bc.thread_note()}")

    train_texts = builtin_corpus.training_texts()
    held_texts = builtin_corpus.heldout_texts()
    log(f"corpus: {len(train_texts)} training files, {len(held_texts)} held-out files")
    tok = bc.train_tokenizer(train_texts, args.vocab)
    assert tok.get_vocab_size() == args.vocab, tok.get_vocab_size()
    assert tok.token_to_id(bc.EOT) == 0 and tok.token_to_id(bc.PAD) == 1
    bc.save_tokenizer(tok, out, args.max_pos)
    log(f"tokenizer trained ({time.time() - t0:.0f}s)")
    train_ids = bc.encode_stream(tok, train_texts)
    held_ids = bc.encode_stream(tok, held_texts)
    chars = sum(len(t) for t in train_texts)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, training {train_ids.numel()} tokens "
        f"({chars / train_ids.numel():.2f} chars/token), held-out {held_ids.numel()} tokens")

    model, gen_cfg = build_model(args)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.3f} M params (tied embeddings)")
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(args.seed)
    eval_g = torch.Generator().manual_seed(args.seed + 1)
    held_windows = bc.sample_windows(held_ids, args.eval_windows, args.seq_len + 1, eval_g)
    total_steps = args.steps if args.steps > 0 else 10 ** 9
    save_margin = 45.0  # seconds kept for saving + final eval
    step, tokens, ema, history = 0, 0, None, []
    loop_t0 = time.time()
    while step < total_steps:
        if time.time() > deadline - save_margin:
            log("wall-clock budget reached; stopping")
            break
        # --steps N: cosine over N steps. --steps 0: cosine over the wall-clock budget
        # (the shared CPU's speed varies too much to fix a step count in advance)
        if args.steps > 0:
            prog = step / total_steps
        else:
            prog = (time.time() - loop_t0) / (deadline - save_margin - loop_t0)
        lr = bc.progress_lr(step, prog, args.lr, args.warmup, 10 ** 9, args.min_lr_frac)
        for grp in opt.param_groups:
            grp["lr"] = lr
        x = bc.sample_windows(train_ids, args.batch, args.seq_len + 1, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            el = time.time() - loop_t0
            log(f"step {step} ({prog:.1%}) loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} "
                f"tok {tokens} {tokens / el:.0f} tok/s")
        if step % args.eval_every == 0:
            hl = eval_loss(model, held_windows, args.batch)
            history.append({"step": step, "train_ema": round(ema, 4), "heldout": round(hl, 4)})
            log(f"eval step {step}: held-out loss {hl:.4f} (ppl {math.exp(hl):.2f})")

    train_wall = time.time() - loop_t0
    hl = eval_loss(model, held_windows, args.batch)
    log(f"final: steps {step} tokens {tokens} train-ema {ema:.4f} held-out {hl:.4f} "
        f"loop {train_wall / 60:.1f} min")
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out), safe_serialization=True)
    gen_cfg.save_pretrained(str(out))
    portable_configs(out, args.rope_theta)
    stats = {"steps": step, "schedule": args.steps or "wall-clock", "tokens": tokens,
             "train_loss_ema": round(ema, 4), "heldout_loss": round(hl, 4),
             "heldout_loss_bf16_weights": round(eval_loss(model.float(), held_windows, args.batch), 4),
             "train_minutes": round(train_wall / 60, 2),
             "total_minutes": round((time.time() - t0) / 60, 2),
             "corpus_train_tokens": int(train_ids.numel()), "heldout_tokens": int(held_ids.numel()),
             "params": n_params, "args": vars(args), "eval_history": history,
             "torch": torch.__version__}
    bc.write_json(out / "train_stats.json", stats)
    log(f"saved to {out}: {stats['heldout_loss_bf16_weights']=}")
    bc.print_total_size(out.parent)
    sample(out, tok)


def portable_configs(out: Path, rope_theta: float) -> None:
    """Also write the pre-transformers-5 spellings (rope_theta, PreTrainedTokenizerFast)."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = rope_theta
    cfg["torch_dtype"] = "bfloat16"
    bc.write_json(out / "config.json", cfg)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg.pop("backend", None)
    bc.write_json(out / "tokenizer_config.json", tcfg)
    for f in out.iterdir():
        f.chmod(0o644)


@torch.no_grad()
def sample(out: Path, tok):
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = builtin_corpus.heldout_prompts(1, 96, seed=0, tokenizer=tok)[0]
    ids = torch.tensor([tok.encode(prompt).ids])
    gen = m.generate(ids, max_new_tokens=80, do_sample=False)
    log("sample (held-out prompt, greedy):\n" + prompt + "<<<GEN>>>" + tok.decode(gen[0, ids.shape[1]:].tolist()))


if __name__ == "__main__":
    main()
