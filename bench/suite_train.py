"""The suite's train section: fused (coda.nn) vs unfused (Hugging Face LlamaForCausalLM, eager
PyTorch) training of one small LLaMA-3-style model from the same initialization on the same
synthetic token stream: AdamW, bf16 weights, N steps (with compile also torch.compile'd twins of
both). Gives the loss curves (in the results file, and a PNG beside it), their max relative
difference, and tokens/s of each (median step time after warm-up, CUDA events; the models trained
in one process, steps interleaved so drift hits them alike).

The token stream is a fixed random bigram chain with 4 likely successors per token, so the loss
falls from ln V towards ~ln 4 and the curves have something to agree on. bench/fsdp_check.py
trains on the same stream.
"""

from __future__ import annotations

import math
import statistics
import time
from types import SimpleNamespace

import torch

import coda

# The model and run of the section (the keys of the results file's "config").
DEFAULTS = dict(steps=200, layers=4, hidden=1024, heads=16, kv_heads=4, intermediate=2816,
                vocab=32000, batch=8, seq=1024, lr=5e-4, compile=False)


def token_stream(vocab, batch, seq, steps, seed=0):
    """(steps, batch, seq) tokens of a random bigram chain (4 successors per token, skewed)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    out = torch.empty(steps, batch, seq, dtype=torch.long)
    cur = torch.randint(0, vocab, (steps, batch), generator=g)
    for s in range(seq):
        out[:, :, s] = cur
        pick = torch.multinomial(probs, steps * batch, replacement=True, generator=g)
        cur = succ[cur.reshape(-1), pick].view(steps, batch)
    return out


def run(out, progress=print, dev="cuda", dtype=torch.bfloat16, **config):
    """Trains the models of `config` (DEFAULTS, overridden by keyword) and returns the section's
    results; `out` is the prefix of the loss-curve plot (out + ".png"). The suite trains in bf16
    on the GPU; the CPU ops take float32 / float64."""
    args = SimpleNamespace(**{**DEFAULTS, **config, "out": out})
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, rms_norm_eps=1e-5,
                      max_position_embeddings=args.seq, tie_word_embeddings=False,
                      attn_implementation="sdpa",
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    models = {"hf_eager": ref, "coda": coda.convert.from_hf(ref)}  # same weights, our layouts
    if args.compile:
        twin = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype)
        twin.load_state_dict(init)
        models["hf_compile"] = twin
        models["coda_compile"] = coda.convert.from_hf(twin)
    forwards = {
        "hf_eager": lambda ids: models["hf_eager"](input_ids=ids, labels=ids).loss,
        "coda": lambda ids: models["coda"](ids, ids),
    }
    if args.compile:
        hf_c = torch.compile(models["hf_compile"])
        coda_c = torch.compile(models["coda_compile"], fullgraph=True)
        forwards["hf_compile"] = lambda ids: hf_c(input_ids=ids, labels=ids).loss
        forwards["coda_compile"] = lambda ids: coda_c(ids, ids)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                 weight_decay=0.1, foreach=True) for k, m in models.items()}
    warm = max(1, args.steps // 10)
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / warm)  # noqa: E731

    data = token_stream(args.vocab, args.batch, args.seq, args.steps).to(dev)
    names = list(models)
    losses = {k: [] for k in names}
    times = {k: [] for k in names}
    t0 = time.time()
    for step in range(args.steps):
        ids = data[step]
        order = names if step % 2 == 0 else names[::-1]  # alternate so drift hits all alike
        for name in order:
            opt = opts[name]
            for gr in opt.param_groups:
                gr["lr"] = lr_at(step)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = forwards[name](ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end.record()
            losses[name].append(loss.detach())
            times[name].append((start, end))
        if step % 20 == 0 or step == args.steps - 1:
            torch.cuda.synchronize()
            progress(f"train step {step + 1}/{args.steps}: " +
                     " ".join(f"{k} {v[-1].item():.4f}" for k, v in losses.items()) +
                     f" ({time.time() - t0:.0f} s)")
    torch.cuda.synchronize()
    curves = {k: [float(v) for v in torch.stack(vs).float().cpu()] for k, vs in losses.items()}
    ms = {k: [s.elapsed_time(e) for s, e in v[warm:]] for k, v in times.items()}
    tokens = args.batch * args.seq
    rel = [abs(a - b) / abs(b) for a, b in zip(curves["coda"], curves["hf_eager"])]
    result = {
        "config": vars(args), "tokens_per_step": tokens,
        "loss": curves,
        "max_rel_diff": max(rel), "max_rel_diff_step": rel.index(max(rel)) + 1,
        "mean_rel_diff_last_50": statistics.fmean(rel[-50:]),
        "median_step_ms": {k: statistics.median(v) for k, v in ms.items()},
        "tokens_per_s": {k: tokens / (statistics.median(v) / 1e3) for k, v in ms.items()},
        "finite": all(math.isfinite(x) for c in curves.values() for x in c),
    }
    result["speedup_vs"] = {k: result["tokens_per_s"]["coda"] / v
                            for k, v in result["tokens_per_s"].items() if k != "coda"}
    if args.compile:
        result["coda_compile_speedup_vs_hf_compile"] = (
            result["tokens_per_s"]["coda_compile"] / result["tokens_per_s"]["hf_compile"])
    plot_loss_curves(args, curves, rel)
    return result


def plot_loss_curves(args, curves, rel):
    try:
        import matplotlib
    except ImportError:  # the results file has the curves; the plot is for the report
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, args.steps + 1)
    a1.plot(steps, curves["hf_eager"], label="HF LlamaForCausalLM (eager bf16)", lw=1.5)
    a1.plot(steps, curves["coda"], label="coda.nn (fused)", lw=1.0, ls="--")
    for k in ("hf_compile", "coda_compile"):
        if k in curves:
            a1.plot(steps, curves[k], label=k.replace("_", " + torch."), lw=0.8, ls=":")
    a1.set_xlabel("AdamW step")
    a1.set_ylabel("training loss")
    a1.set_title(f"{args.layers}L H={args.hidden} GQA {args.heads}/{args.kv_heads} V={args.vocab}")
    a1.legend()
    a2.plot(steps, rel, color="C2")
    a2.set_yscale("log")
    a2.set_xlabel("AdamW step")
    a2.set_ylabel("|coda − HF| / HF")
    a2.set_title(f"relative loss difference (max {max(rel):.2e})")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    plt.close(fig)
