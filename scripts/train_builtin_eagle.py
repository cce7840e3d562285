"""Train rocdraft's built-in EAGLE-1 and/or EAGLE-3 heads on the built-in target's
own features and greedy outputs.

Data: corpus windows (training split) of --prompt-len tokens, each extended by
the target's greedy continuation of --gen-len tokens; one teacher-forced target
pass gives every position's features (final-norm hidden state for EAGLE-1, the
residual-stream inputs of layers (2, L//2, L-3) for EAGLE-3) and the target's
argmax next token (the label greedy verification accepts). Training unrolls
--ttt-steps draft steps (EAGLE-3's training-time test; see builtin_common).
Evaluation simulates greedy chain drafting on held-out prompts' greedy
continuations and prints acceptance length (accepted drafts + 1) for k = 1..6.

  python scripts/train_builtin_eagle.py --data-only --threads 2     # shared cache, ~13 min
  python scripts/train_builtin_eagle.py --head eagle3 --minutes 30   # then both heads,
  python scripts/train_builtin_eagle.py --head eagle1 --minutes 30   # concurrently is fine
(see models/builtin/README.md for the exact commands used).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import builtin_common as bc
from builtin_common import builtin_corpus, log


def load_target(path):
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).float().eval()
    m.config._attn_implementation = "sdpa"
    return m


def aux_layers(n_layers):
    return (2, n_layers // 2, n_layers - 3)


@torch.no_grad()
def greedy_extend(model, ids, n_new):
    """ids [B,P] -> [B,P+n_new] with the target's greedy tokens (no EOS stop)."""
    out = model(input_ids=ids, use_cache=True)
    past, toks = out.past_key_values, [ids]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(n_new - 1):
        toks.append(nxt)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    toks.append(nxt)
    return torch.cat(toks, 1)


@torch.no_grad()
def features(model, seqs):
    """Teacher-forced pass -> dict(tokens, y (argmax next token), f (final-norm hidden), aux)."""
    out = model.model(input_ids=seqs, output_hidden_states=True)
    f = out.last_hidden_state
    y = model.lm_head(f).argmax(-1)
    L = model.config.num_hidden_layers
    aux = torch.cat([out.hidden_states[l] for l in aux_layers(L)], -1)
    return {"tokens": seqs.int(), "y": y.int(), "f": f.bfloat16(), "aux": aux.bfloat16()}


def cat_parts(parts):
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def build_train_data(model, tok, args):
    ids = bc.encode_stream(tok, builtin_corpus.training_texts())
    g = torch.Generator().manual_seed(args.seed + 7)
    parts, t0 = [], time.time()
    n_batches = (args.data_seqs + args.gen_batch - 1) // args.gen_batch
    for b in range(n_batches):
        prompts = bc.sample_windows(ids, args.gen_batch, args.prompt_len, g)
        seqs = greedy_extend(model, prompts, args.gen_len)
        parts.append(features(model, seqs))
        el = time.time() - t0
        log(f"data batch {b + 1}/{n_batches}: {seqs.shape} ({el:.0f}s)")
        if el > args.data_minutes * 60:
            log("data budget reached")
            break
    return cat_parts(parts)


def build_eval_data(model, tok, args):
    prompts = builtin_corpus.heldout_prompts(args.eval_prompts, args.prompt_len, seed=args.seed,
                                             tokenizer=tok)
    seqs, plens = [], []
    for p in prompts:
        ids = torch.tensor([tok.encode(p).ids])
        seqs.append(features(model, greedy_extend(model, ids, args.eval_gen)))
        plens.append(ids.shape[1])
    return seqs, plens


def make_config(kind, tcfg, args):
    H = tcfg.hidden_size
    c = {"hidden_size": H, "intermediate_size": tcfg.intermediate_size,
         "num_attention_heads": tcfg.num_attention_heads, "num_key_value_heads": tcfg.num_key_value_heads,
         "head_dim": getattr(tcfg, "head_dim", None) or H // tcfg.num_attention_heads,
         "rms_norm_eps": tcfg.rms_norm_eps, "rope_theta": 10000.0, "max_position_embeddings": 2048,
         "vocab_size": tcfg.vocab_size, "hidden_act": "silu", "num_hidden_layers": 1,
         "model_type": "llama", "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 0}
    if kind == "eagle1":
        c.update({"architectures": ["LlamaForCausalLM"], "bias": True, "tie_word_embeddings": False})
    else:
        L = tcfg.num_hidden_layers
        c.update({"architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": H,
                  "draft_vocab_size": args.draft_vocab,
                  "eagle_aux_hidden_state_layer_ids": list(aux_layers(L)),
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers(L))}})
    return c


def init_head(head, target):
    """Start near the target: EAGLE-1 fc passes the feature through; EAGLE-3's norm and
    lm_head start from the target's final norm and (draft-vocab rows of) lm_head."""
    with torch.no_grad():
        for n, p in head.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            if n.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.5)
        if head.kind == "eagle1":
            H = head.c["hidden_size"]
            head.fc.weight[:, H:] += torch.eye(H)
            head.fc.bias.zero_()
        else:
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[head.d2t_ids])


def select_draft_vocab(y, n):
    counts = torch.bincount(y.flatten().long(), minlength=int(y.max()) + 1)
    top = counts.topk(n).indices.sort().values
    cov = counts[top].sum().item() / counts.sum().item()
    return top, cov


def step_inputs(batch, kind):
    """Head entries i = 0..T-2: token x_{i+1}, feature at i, label y_{i+1}, next feature f_{i+1}."""
    feat = batch["f"] if kind == "eagle1" else batch["aux"]
    return (batch["tokens"][:, 1:].long(), feat[:, :-1].float(), batch["y"][:, 1:].long(),
            batch["f"][:, 1:].float())


def head_loss(head, target_lm, batch, args, t2d_index):
    toks, feat, y, fnext = step_inputs(batch, head.kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = head.unroll(toks, feat, args.ttt_steps)
    with torch.no_grad():
        tlog = fnext @ target_lm.t()
        if head.kind == "eagle3":
            tlog = tlog[..., head.d2t_ids]
            y = t2d_index[y]  # -100 where the label is outside the draft vocab
        tprob = torch.softmax(tlog, -1)
    T = toks.shape[1]
    total, wsum, stats = 0.0, 0.0, []
    for s, (h, logits) in enumerate(outs):
        lg = logits.float()[:, s:]
        ys, ps = y[:, s:], tprob[:, s:]
        hard = F.cross_entropy(lg.flatten(0, 1), ys.flatten(), ignore_index=-100)
        soft = -(ps * torch.log_softmax(lg, -1)).sum(-1).mean()
        loss = 0.5 * hard + 0.5 * soft
        if head.kind == "eagle1":
            loss = loss + args.reg_weight * F.smooth_l1_loss(h.float()[:, s:], fnext[:, s:])
        w = args.step_decay ** s
        total, wsum = total + w * loss, wsum + w
        acc = (lg.argmax(-1) == ys).float().mean().item()
        stats.append(acc)
    assert T > args.ttt_steps
    return total / wsum, stats


@torch.no_grad()
def evaluate(head, eval_data, kmax=6):
    """Simulated greedy chain drafting. Returns (mean tau per k over all anchors in the
    continuation, mean tau per k along the actual verification walk)."""
    head.eval()
    all_acc = [[] for _ in range(kmax)]
    walk = [[] for _ in range(kmax)]
    for batch, plen in zip(*eval_data):
        toks, feat, y, _ = step_inputs(batch, head.kind)
        outs = head.unroll(toks, feat, kmax)
        pred = torch.stack([lg.argmax(-1)[0] for _, lg in outs])  # [kmax, T]
        if head.kind == "eagle3":
            pred = head.d2t_ids[pred]
        T = pred.shape[1]
        yy = y[0]
        # match[s, a] = draft s from anchor a (entry a+s) equals the target's token
        last = T - kmax
        match = torch.stack([pred[s, s:s + last] == yy[s:s + last] for s in range(kmax)])
        run = torch.cumprod(match.int(), 0)  # leading matches
        for k in range(1, kmax + 1):
            n_acc = run[:k].sum(0)
            all_acc[k - 1].append(n_acc[plen - 1:].float() + 1)
            a, taus = plen - 1, []
            while a < last:
                m = int(n_acc[a])
                taus.append(m + 1)
                a += m + 1
            walk[k - 1].append(torch.tensor(taus, dtype=torch.float))
    head.train()
    return ([torch.cat(x).mean().item() for x in all_acc], [torch.cat(x).mean().item() for x in walk])


def save_head(head, cfg, out: Path):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()
          if k not in ("d2t_ids",)}
    if head.kind == "eagle3":
        # The config has target_hidden_size, so SafeAILab/EAGLE (eagle/model/cnets.py) takes
        # the embeddings from the head file, not the target: store the target's (frozen) copy.
        sd["embed_tokens.weight"] = head.embed.detach().to(torch.bfloat16).contiguous()
        ids = head.d2t_ids
        sd["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    bc.write_json(out / "config.json", cfg)
    (out / "model.safetensors").chmod(0o644)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", choices=["eagle1", "eagle3"], default=None)
    ap.add_argument("--data-only", action="store_true",
                    help="only build the shared data cache (--data-cache) and exit")
    ap.add_argument("--target", default=str(bc.DEFAULT_DIR / "target"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--minutes", type=float, default=25.0, help="total wall-clock budget")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default="/tmp/builtin_eagle_data.pt")
    ap.add_argument("--data-seqs", type=int, default=1152)
    ap.add_argument("--data-minutes", type=float, default=20.0)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-gen", type=int, default=192)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--reg-weight", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=50)
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    bc.setup(args.seed, args.threads)
    out = Path(args.out or bc.DEFAULT_DIR / (args.head or "eagle"))
    log(f"{args.head} training: {vars(args)} {bc.thread_note()}")

    target = load_target(args.target)
    tok = bc.load_tokenizer(args.target)
    cache = Path(args.data_cache)
    key = {k: getattr(args, k) for k in ("seed", "data_seqs", "prompt_len", "gen_len",
                                         "eval_prompts", "eval_gen", "gen_batch")}
    key["target_mtime"] = (Path(args.target) / "model.safetensors").stat().st_mtime
    data = torch.load(cache, weights_only=True) if cache.exists() else None
    if data is None or data["key"] != key:
        log("generating training data with the target (greedy continuations + features)")
        data = {"key": key, "train": build_train_data(target, tok, args),
                "eval": build_eval_data(target, tok, args)}
        torch.save(data, cache)
    train, eval_data = data["train"], data["eval"]
    if args.data_only or args.head is None:
        log(f"data cache ready: {cache} ({train['tokens'].shape[0]} sequences)")
        return
    N, T = train["tokens"].shape
    log(f"data: {N} sequences x {T} tokens, {len(eval_data[0])} held-out eval sequences")

    cfg = make_config(args.head, target.config, args)
    head = EagleHeadWithVocab(args.head, cfg, target)
    if args.head == "eagle3":
        ids, cov = select_draft_vocab(train["y"], args.draft_vocab)
        head.d2t_ids = ids
        log(f"draft vocab {args.draft_vocab}: covers {cov:.4f} of the target's greedy tokens")
    init_head(head, target)
    t2d_index = torch.full((cfg["vocab_size"],), -100, dtype=torch.long)
    if args.head == "eagle3":
        t2d_index[head.d2t_ids] = torch.arange(head.d2t_ids.numel())
    n_params = sum(p.numel() for p in head.parameters())
    log(f"head: {n_params / 1e6:.3f} M trainable params")
    target_lm = target.lm_head.weight.detach().float()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 11)
    tau0 = evaluate(head, eval_data)
    log(f"eval before training: tau(all anchors) k=1..6 {[round(x, 3) for x in tau0[0]]}")
    save_margin = 60.0
    loop_t0, step, ema, history = time.time(), 0, None, []
    budget = deadline - save_margin - loop_t0
    perm = torch.randperm(N, generator=g)
    pos = 0
    while time.time() < deadline - save_margin:
        prog = (time.time() - loop_t0) / budget
        lr = bc.progress_lr(step, prog, args.lr, args.warmup, 10 ** 9, 0.05)
        for grp in opt.param_groups:
            grp["lr"] = lr
        if pos + args.batch > N:
            perm, pos = torch.randperm(N, generator=g), 0
        idx = perm[pos:pos + args.batch]
        pos += args.batch
        loss, accs = head_loss(head, target_lm, {k: v[idx] for k, v in train.items()}, args, t2d_index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} "
                f"step-acc {[round(a, 3) for a in accs]} epoch {step * args.batch / N:.2f}")
        if step % args.eval_every == 0:
            tau = evaluate(head, eval_data)
            history.append({"step": step, "tau_all": [round(x, 3) for x in tau[0]],
                            "tau_walk": [round(x, 3) for x in tau[1]]})
            log(f"eval step {step}: tau k=1..6 all-anchors {history[-1]['tau_all']} "
                f"walk {history[-1]['tau_walk']}")
    train_wall = time.time() - loop_t0
    ema = float("nan") if ema is None else ema
    save_head(head, cfg, out)
    # re-evaluate with the saved (bf16-rounded) weights
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tau_all, tau_walk = evaluate(head, eval_data)
    log(f"final ({args.head}, bf16 weights): steps {step}, loss ema {ema:.4f}")
    for k in range(6):
        log(f"  k={k + 1}: acceptance length all-anchors {tau_all[k]:.3f}  walk {tau_walk[k]:.3f}")
    stats = {"steps": step, "loss_ema": round(ema, 4), "train_minutes": round(train_wall / 60, 2),
             "total_minutes": round((time.time() - t0) / 60, 2), "train_sequences": N,
             "train_tokens": N * T, "epochs": round(step * args.batch / N, 2),
             "tau_all_anchors_k1_6": [round(x, 3) for x in tau_all],
             "tau_walk_k1_6": [round(x, 3) for x in tau_walk], "params": n_params,
             "args": vars(args), "eval_history": history}
    bc.write_json(out / "train_stats.json", stats)
    bc.print_total_size(out.parent)


class EagleHeadWithVocab(bc.EagleHead):
    def __init__(self, kind, cfg, target):
        super().__init__(kind, cfg, target.model.embed_tokens.weight, target.lm_head.weight)
        self.d2t_ids = torch.arange(cfg["vocab_size"])


if __name__ == "__main__":
    main()
