"""The suite's train section: fused (coda.nn) vs unfused (Hugging Face LlamaForCausalLM, eager
PyTorch) training of one small LLaMA-3-style model from the same initialization on the same
synthetic token stream: AdamW, bf16 weights, N steps (with compile also torch.compile'd twins of
both). Gives the loss curves (in the results file, and a PNG beside it), their max relative
difference, and tokens/s of each (median step time after warm-up, CUDA events; the models trained
in one process, steps interleaved so drift hits them alike).

The token stream is a fixed random bigram chain with 4 likely successors per token, so the loss
falls from ln V towards ~ln 4 and the curves have something to agree on. bench/fsdp_check.py
trains on the same stream.

The train-parity section (run_parity; PARITY_DOC below) trains coda bf16, coda FP8 and torchao
float8 at the LLaMA-3.2-1B layer shape on real text (.corpus, from scripts/fetch-corpus).
"""

from __future__ import annotations

import math
import os
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


# ---------------------------------------------------------------------------------------------
# train-parity (issue "FP8 training parity"): the same model trained on real text in FP8 and in
# bf16 from the same initialization. See PARITY_DOC.

PARITY_DOC = """\
Section train-parity: FP8 training parity on real text.

One LLaMA model, built once (Hugging Face LlamaForCausalLM, seed 0, fp32 init rounded to bf16),
then trained from those same weights by every run, on the same batches in the same order:
  coda_bf16    coda.convert.from_hf(hf): the fused bf16 block ops (the reference)
  coda_fp8     coda.convert.from_hf(hf, precision="fp8"): the blockwise FP8 block ops; absent, with
               the reason, while this checkout's coda has no precision= argument or its library no
               torch.ops.coda.fp8_mlp
  coda_fp8_z   (optional) coda_fp8 with model.fp8_z = True: the MLP's pre-activation z saved for
               the backward in FP8 (1x128 blocks), B2 differentiating SwiGLU at the decoded z
  torchao_fp8  the Hugging Face model with every decoder-layer nn.Linear turned into torchao's
               Float8Linear (convert_to_float8_training, Float8LinearConfig.from_recipe_name
               (torchao_recipe: rowwise by default; tensorwise is TorchTitan's default), LM head
               left in bf16 as TorchTitan leaves its output layer), each decoder layer
               torch.compile'd as TorchTitan compiles its blocks; absent when torchao cannot load
  hf_bf16      (optional) the Hugging Face model, eager bf16: a sanity reference
Steps of the runs alternate in order (ABC, CBA, ...) so clock drift hits every run alike.

Data: .corpus from scripts/fetch-corpus (Linux kernel, Python and Perl documentation from Debian's
documentation packages, ~9.7 M training tokens of a 32000-token byte-level BPE). The token stream
is cut into non-overlapping windows of seq tokens; a seeded permutation of the windows gives each
step's batch (another permutation after every pass over the data, recorded as "epochs").

Shape: the LLaMA-3.2-1B layer (hidden 2048, 32 heads / 8 KV heads, head_dim 64, intermediate 8192,
RoPE theta 500000) with 8 layers and the BPE's vocabulary: 0.62 B parameters (0.49 B in the
layers). Batch 8 x 1024 tokens = 8192 tokens a step, 1000 steps = 8.2 M tokens, 0.85 of one pass
over the corpus, so no window repeats. Time on the H200 (bench/results/2026-12-04-train-parity.json):
~0.18 s per step for the three runs (coda bf16 143 k tokens/s, coda FP8 159 k, torchao 122 k) after
~75 s for the first 50 steps (setup and compilation): ~4 min for 1000 steps. A longer sequence would spend more of the step in attention, which FP8
does not touch; a smaller batch would make the loss too noisy to compare means to 1%.

Optimizer: AdamW (betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 on matrices only) over fp32 master
copies of the bf16 weights (master="fp32"; "bf16" steps the bf16 weights in place as the train
section does), gradients clipped to global norm 1.0, lr 3e-4 with 100 linear warm-up steps and a
cosine decay to 10% at the last step: a usual LLM schedule.

Recorded per run: every step's loss and gradient norm (before clipping), the mean loss over the
last 100 steps and its relative difference to coda_bf16's (target: within 1%), loss spikes (a
step whose loss exceeds the median of the 20 steps before it by more than spike_threshold = 0.5
nats, from step 21 on: on real text mostly jumps in the data, which every run shares) and the
spikes coda_bf16 lacks (a step where the run's loss minus coda_bf16's exceeds that gap's median
over the 20 steps before by more than spike_diff_threshold = 0.1 nats), the
mean loss on held-out documents after training, tokens/s (median step time after 10 steps; CUDA
events around forward + backward + optimizer), persistent memory (weights, master copies,
optimizer state) and the peak during a step. The PNG beside the results file plots the raw and
smoothed loss of every run, the loss difference relative to coda_bf16, and the gradient norms.
"""

PARITY_DEFAULTS = dict(
    steps=1000, layers=8, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
    rope_theta=500000.0, batch=8, seq=1024, lr=3e-4, min_lr_ratio=0.1, warmup=100,
    weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8, clip=1.0, master="fp32",
    runs="coda_bf16,coda_fp8,torchao_fp8", reference="coda_bf16", torchao_recipe="rowwise",
    spike_window=20, spike_threshold=0.5, spike_diff_threshold=0.1, last=100,
    tolerance=0.01, timing_skip=10, holdout_windows=64, seed=0, budget_s=0.0,
    corpus=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".corpus"),
)
PARITY_RUNS = ("coda_bf16", "coda_fp8", "coda_fp8_z", "torchao_fp8", "hf_bf16")


class Absent(Exception):
    """A run that cannot be built here; its message goes into the results' "absent"."""


def load_corpus(path):
    """(train ids, holdout ids, meta) of a scripts/fetch-corpus folder; ids as int64 tensors."""
    import json

    import numpy as np

    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"no corpus in {path}: run scripts/fetch-corpus (and carry "
                                f".corpus)")
    with open(meta_path) as f:
        meta = json.load(f)
    ids = [torch.from_numpy(np.load(os.path.join(path, f"{s}.npy")).astype(np.int64))
           for s in ("train", "holdout")]
    return ids[0], ids[1], meta


def window_order(n_windows, steps, batch, seed):
    """(steps, batch) window indices: seeded permutations of all windows, one after another."""
    g = torch.Generator().manual_seed(seed)
    need = steps * batch
    perms = [torch.randperm(n_windows, generator=g) for _ in range(-(-need // n_windows))]
    return torch.cat(perms)[:need].view(steps, batch)


def lr_at(step, a):
    """Linear warm-up over a.warmup steps, then cosine decay to a.min_lr_ratio * a.lr at the last
    step (0-based step)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - 1 - a.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * cos)


class MasterAdamW:
    """AdamW over master copies (fp32, or the weights themselves when they already have the
    master dtype) with global-norm clipping: step(lr) moves the gradients to the masters, clips,
    steps and writes the masters back into the weights. Weight decay on matrices only."""

    def __init__(self, model, a, master_dtype):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.copy = any(p.dtype != master_dtype for p in self.params)
        self.master = ([p.detach().to(master_dtype).requires_grad_() for p in self.params]
                       if self.copy else self.params)
        groups = [{"params": [m for m, p in zip(self.master, self.params) if p.dim() >= 2],
                   "weight_decay": a.weight_decay},
                  {"params": [m for m, p in zip(self.master, self.params) if p.dim() < 2],
                   "weight_decay": 0.0}]
        fused = self.params[0].is_cuda
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=a.lr,
                                     betas=(a.beta1, a.beta2), eps=a.adam_eps,
                                     fused=fused, foreach=None if fused else True)
        self.clip = a.clip

    def step(self, lr):
        if self.copy:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.clip, foreach=True)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.copy:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        return norm.detach()

    def tensors(self):
        """Every tensor the optimizer keeps (master copies and state)."""
        out = list(self.master) if self.copy else []
        for st in self.opt.state.values():
            out += [v for v in st.values() if torch.is_tensor(v)]
        return out


def tensor_mib(tensors):
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.device.type != "meta" and key not in seen:
            seen.add(key)
            total += key[1]
    return total / 2**20


def model_tensors(model):
    """The tensors a model keeps between steps: parameters, buffers and coda's FP8 weight caches
    (remade once per optimizer step, not module state)."""
    out = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        cache = m.__dict__.get("_fp8_cache")
        for entry in getattr(cache, "_entries", {}).values():
            out += [t for t in entry[1] if torch.is_tensor(t)]
    return out


def coda_fp8_missing():
    """Why coda's FP8 model cannot be built in this checkout, or None."""
    import inspect

    if "precision" not in inspect.signature(coda.convert.from_hf).parameters:
        return "coda.convert.from_hf has no precision= argument (no FP8 model in this checkout)"
    if not hasattr(torch.ops.coda, "fp8_mlp"):
        return "torch.ops.coda.fp8_mlp is missing (library built without the FP8 block ops)"
    return None


def hf_config(a, vocab):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads, head_dim=a.head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=a.seq, tie_word_embeddings=False,
                       attn_implementation="sdpa", initializer_range=0.02,
                       rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})


def build_run(name, a, init, dev, absent):
    """(model, forward(ids) -> loss) of one run, from the initial HF model `init` (copied), or
    None with the reason in `absent`."""
    import copy

    try:
        if name == "coda_bf16":
            model = coda.convert.from_hf(init)
            return model, lambda ids: model(ids, ids)
        if name in ("coda_fp8", "coda_fp8_z"):
            why = coda_fp8_missing()
            if why:
                raise Absent(why)
            model = coda.convert.from_hf(init, precision="fp8")
            model.fp8_z = name == "coda_fp8_z"
            return model, lambda ids: model(ids, ids)
        if name == "hf_bf16":
            model = copy.deepcopy(init)
            return model, lambda ids: model(input_ids=ids, labels=ids).loss
        if name == "torchao_fp8":
            try:
                import torchao
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            except Exception as ex:  # noqa: BLE001 - the reason goes into the results
                raise Absent(f"import torchao.float8 failed: {ex!r}"[:300]) from None
            model = copy.deepcopy(init)
            cfg = Float8LinearConfig.from_recipe_name(a.torchao_recipe)
            if dev == "cpu":  # no FP8 GEMM on the CPU: torchao's emulation
                import dataclasses

                cfg = dataclasses.replace(cfg, emulate=True)
            convert_to_float8_training(
                model, config=cfg,
                module_filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)
                and fqn.startswith("model.layers."))
            for layer in model.model.layers:  # torchao's float8 needs compile to be fast
                layer.compile()
            a.torchao_version = torchao.__version__
            return model, lambda ids: model(input_ids=ids, labels=ids).loss
        raise Absent(f"unknown run {name!r} (known: {', '.join(PARITY_RUNS)})")
    except Absent as ex:
        absent[name] = str(ex)
    return None


def find_spikes(curve, window, threshold):
    """1-based steps whose loss exceeds the median of the `window` steps before by > threshold."""
    return [i + 1 for i in range(window, len(curve))
            if curve[i] - statistics.median(curve[i - window:i]) > threshold]


def smooth(curve, w=20):
    out, acc = [], 0.0
    for i, x in enumerate(curve):
        acc += x - (curve[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def parity_summary(a, runs, ref):
    """The per-run numbers of the section (fills runs[name] in place); returns the pass verdicts."""
    rc = runs.get(ref, {}).get("loss", [])
    for r in runs.values():
        c = r["loss"]
        r["steps_done"] = len(c)
        r["finite"] = all(math.isfinite(x) for x in c)
        r["spikes"] = find_spikes(c, a.spike_window, a.spike_threshold)
        ms = r["step_ms"][a.timing_skip:] or r["step_ms"]
        if ms:
            r["median_step_ms"] = statistics.median(ms)
            r["tokens_per_s"] = a.batch * a.seq / (r["median_step_ms"] / 1e3)
        if c:
            r["mean_last"] = statistics.fmean(c[-a.last:])
    verdicts = {}
    for name, r in runs.items():
        c = r["loss"]
        if name == ref or not c or not rc:
            continue
        n = min(len(c), len(rc))
        ref_mean = statistics.fmean(rc[:n][-a.last:])
        r["mean_last_ref"] = ref_mean
        r["rel_diff_last"] = (statistics.fmean(c[:n][-a.last:]) - ref_mean) / ref_mean
        rel = [(x - y) / y for x, y in zip(c[:n], rc[:n])]
        after = rel[a.warmup:] or rel
        r["max_abs_rel_step_diff_after_warmup"] = max(abs(x) for x in after)
        gr = runs[ref].get("grad_norm", [])
        if r.get("grad_norm") and gr:  # same weights, same batch: only the FP8 rounding differs
            r["first_grad_norm_rel_diff"] = r["grad_norm"][0] / gr[0] - 1
        # A spike the reference lacks: a step where the run's loss rises above the reference's
        # by more than spike_diff_threshold over the median gap of the window before. Every run
        # sees the same batches, so a jump in the data (a new kind of document) hits them all at
        # once and cancels here; find_spikes' own list marks those.
        gap = [x - y for x, y in zip(c[:n], rc[:n])]
        r["spikes_not_in_ref"] = find_spikes(gap, a.spike_window, a.spike_diff_threshold)
        if r.get("holdout_loss") and runs[ref].get("holdout_loss"):
            r["holdout_rel_diff"] = r["holdout_loss"] / runs[ref]["holdout_loss"] - 1
        verdicts[name] = bool(r["finite"] and n == a.steps and not r.get("error")
                              and abs(r["rel_diff_last"]) <= a.tolerance
                              and not r["spikes_not_in_ref"])
        r["pass"] = verdicts[name]
    return verdicts


def run_parity(out, progress=print, dev="cuda", dtype=torch.bfloat16, save=None, **config):
    """The train-parity section (PARITY_DOC): trains the runs of `config` (PARITY_DEFAULTS,
    overridden by keyword) and returns the section's results; `out` is the plot's prefix
    (out + ".png"); `save(section)` is called with the partial results every 250 steps. The GPU
    trains in bf16; the CPU ops take float32 (dtype) and skip the memory numbers."""
    unknown = set(config) - set(PARITY_DEFAULTS)
    if unknown:
        raise ValueError(f"train-parity: unknown settings {sorted(unknown)}")
    a = SimpleNamespace(**{**PARITY_DEFAULTS, **config})
    t_start = time.time()
    cuda = dev != "cpu" and torch.device(dev).type == "cuda"
    train_ids, hold_ids, meta = load_corpus(a.corpus)
    vocab = -(-meta["vocab_size"] // 128) * 128  # padded as LLaMA pads: widths stay aligned
    n_windows = train_ids.numel() // a.seq
    order = window_order(n_windows, a.steps, a.batch, a.seed).to(dev)  # no copy per step
    train_dev = train_ids[: n_windows * a.seq].view(n_windows, a.seq).to(dev)
    sec = {
        "config": {k: v for k, v in vars(a).items()}, "doc": PARITY_DOC.splitlines()[0],
        "dtype": str(dtype).replace("torch.", ""), "train_device": str(dev),
        "corpus": {k: meta.get(k) for k in ("sources", "tokens", "documents", "vocab_size",
                                           "chars_per_token", "sha256", "recipe")},
        "model_vocab": vocab, "tokens_per_step": a.batch * a.seq,
        "windows": n_windows, "epochs": a.steps * a.batch / n_windows,
        "reference": a.reference, "absent": {}, "runs": {},
    }
    names = [n.strip() for n in a.runs.split(",") if n.strip()]
    if a.reference not in names:
        names.insert(0, a.reference)

    from transformers import LlamaForCausalLM

    with torch.device(dev):
        torch.manual_seed(a.seed)
        init = LlamaForCausalLM(hf_config(a, vocab)).to(dtype)
    sec["parameters"] = sum(p.numel() for p in init.parameters())
    master_dtype = torch.float32 if a.master == "fp32" else dtype
    runs = {}
    for name in names:
        built = build_run(name, a, init, dev, sec["absent"])
        if built is None:
            progress(f"train-parity: {name} absent: {sec['absent'][name]}")
            continue
        model, fwd = built
        model.train()
        runs[name] = SimpleNamespace(model=model, fwd=fwd, opt=MasterAdamW(model, a, master_dtype),
                                     loss=[], gnorm=[], step_ms=[], events=[], step_extra=0.0,
                                     error=None)
    del init
    if hasattr(a, "torchao_version"):
        sec["torchao_version"] = a.torchao_version
    sec["setup_s"] = round(time.time() - t_start, 1)
    progress(f"train-parity: {', '.join(runs)}; {sec['parameters'] / 1e9:.2f} B parameters, "
             f"{a.steps} steps of {a.batch}x{a.seq} tokens ({sec['epochs']:.2f} passes over "
             f"{n_windows * a.seq / 1e6:.2f} M tokens); setup {sec['setup_s']} s")

    def finish(steps_done, plot=True):
        if cuda:
            torch.cuda.synchronize()
        res = {}
        for name, r in runs.items():
            d = res[name] = {
                "loss": [float(x) for x in (torch.stack(r.loss).float().cpu() if r.loss else [])],
                "grad_norm": [float(x) for x in (torch.stack(r.gnorm).float().cpu()
                                                 if r.gnorm else [])],
                "step_ms": list(r.step_ms) + [s.elapsed_time(e) for s, e in r.events],
            }
            if r.error:
                d["error"] = r.error
            if cuda:
                d["persistent_mib"] = tensor_mib(model_tensors(r.model) + r.opt.tensors())
                d["step_peak_extra_mib"] = r.step_extra / 2**20
                d["peak_mib"] = d["persistent_mib"] + d["step_peak_extra_mib"]
            if hasattr(r, "holdout_loss"):
                d["holdout_loss"] = r.holdout_loss
        sec["runs"] = res
        sec["steps_done"] = steps_done
        sec["epochs_read"] = steps_done * a.batch / n_windows  # "epochs" is the plan's
        sec["pass"] = parity_summary(a, res, a.reference)
        sec["elapsed_s"] = round(time.time() - t_start, 1)
        sec["plot"] = os.path.basename(out) + ".png"
        if plot:
            plot_parity(a, sec, out + ".png")
        return sec

    steps_done = 0
    for step in range(a.steps):
        ids = train_dev[order[step]]
        lr = lr_at(step, a)
        live = [n for n in runs if runs[n].error is None]
        for name in (live if step % 2 == 0 else live[::-1]):
            r = runs[name]
            try:
                if cuda:
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
                    ev[0].record()
                else:
                    t0 = time.perf_counter()
                loss = r.fwd(ids)
                loss.backward()
                gn = r.opt.step(lr)
                if cuda:
                    ev[1].record()
                    r.events.append(ev)
                    if r.loss:  # the first step also allocates the optimizer state
                        r.step_extra = max(r.step_extra,
                                           torch.cuda.max_memory_allocated() - base)
                else:
                    r.step_ms.append((time.perf_counter() - t0) * 1e3)
                r.loss.append(loss.detach())
                r.gnorm.append(gn)
            except Exception as ex:  # noqa: BLE001 - recorded; the other runs go on
                r.error = f"step {step + 1}: {ex!r}"[:500]
                progress(f"train-parity: {name} failed at step {step + 1}: {ex!r}"[:300])
        steps_done = step + 1
        if steps_done % 50 == 0 or steps_done == a.steps:
            for name, r in runs.items():
                if r.error is None and r.loss and not math.isfinite(r.loss[-1].item()):
                    r.error = f"step {steps_done}: non-finite loss"
            progress(f"train-parity step {steps_done}/{a.steps} lr {lr:.2e}: " + " ".join(
                f"{n} {r.loss[-1].item():.4f}" for n, r in runs.items() if r.loss) +
                f" ({time.time() - t_start:.0f} s)")
        if save is not None and steps_done % 250 == 0 and steps_done < a.steps:
            save(finish(steps_done, plot=False))
        if a.budget_s and time.time() - t_start > a.budget_s and steps_done < a.steps:
            progress(f"train-parity: time budget of {a.budget_s:.0f} s spent after "
                     f"{steps_done} steps; stopping")
            sec["truncated"] = f"time budget {a.budget_s:.0f} s spent after {steps_done} steps"
            break

    # Held-out loss after training (grad mode as in training, so no compiled layer recompiles).
    n_hold = min(hold_ids.numel() // a.seq, a.holdout_windows)
    if n_hold:
        hold = hold_ids[: n_hold * a.seq].view(n_hold, a.seq).to(dev)
        for name, r in runs.items():
            if r.error is not None:
                continue
            try:
                vals = []
                for i in range(0, n_hold, a.batch):
                    vals.append(r.fwd(hold[i:i + a.batch]).detach().float())
                r.holdout_loss = torch.stack(vals).mean().item()
            except Exception as ex:  # noqa: BLE001
                sec["absent"][f"{name} holdout"] = repr(ex)[:300]
        sec["holdout_tokens"] = n_hold * a.seq
    return finish(steps_done)


def plot_parity(a, sec, path):
    try:
        import matplotlib
    except ImportError:  # the results file has the curves; the plot is for the report
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, ref = sec["runs"], sec["reference"]
    labels = {"coda_bf16": "coda bf16", "coda_fp8": "coda FP8 (blockwise)",
              "coda_fp8_z": "coda FP8, z saved in FP8",
              "torchao_fp8": f"torchao float8 {a.torchao_recipe} + compile",
              "hf_bf16": "HF eager bf16"}
    colors = {"coda_bf16": "C0", "coda_fp8": "C3", "coda_fp8_z": "C1", "torchao_fp8": "C2",
              "hf_bf16": "C7"}
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    (a1, a2), (a3, a4) = ax
    for name, r in runs.items():
        c = r["loss"]
        if not c:
            continue
        steps = range(1, len(c) + 1)
        col, lab = colors.get(name, None), labels.get(name, name)
        a1.plot(steps, c, color=col, lw=0.5, alpha=0.35)
        ls = "--" if name == "hf_bf16" else "-"
        a1.plot(steps, smooth(c), color=col, lw=1.4, ls=ls, label=lab)
        z = max(0, len(c) // 4)
        a2.plot(range(z + 1, len(c) + 1), c[z:], color=col, lw=0.4, alpha=0.3)
        a2.plot(range(z + 1, len(c) + 1), smooth(c)[z:], color=col, lw=1.4, ls=ls,
                label=f"{lab}: last {a.last} mean {r.get('mean_last', float('nan')):.4f}")
        for s in r.get("spikes_not_in_ref", []):
            a2.axvline(s, color=col, lw=0.6, ls=":")
        if r.get("grad_norm"):
            a4.plot(steps, smooth(r["grad_norm"], 10), color=col, lw=1.0, label=lab)
        rc = runs.get(ref, {}).get("loss", [])
        if name != ref and rc:
            n = min(len(c), len(rc))
            rel = [(x - y) / y for x, y in zip(c[:n], rc[:n])]
            a3.plot(range(1, n + 1), [100 * x for x in rel], color=col, lw=0.4, alpha=0.3)
            a3.plot(range(1, n + 1), [100 * x for x in smooth(rel, 50)], color=col, lw=1.4,
                    label=f"{lab}: last {a.last} "
                          f"{100 * r.get('rel_diff_last', float('nan')):+.2f}%")
    a1.set_yscale("log")
    a1.set_title(f"{a.layers}L H={a.hidden} GQA {a.heads}/{a.kv_heads} I={a.intermediate} "
                 f"V={sec['model_vocab']}, {a.batch}x{a.seq} tokens/step")
    a1.set_ylabel("training loss (raw, and mean of 20 steps)")
    a2.set_title(f"from step {len(next(iter(runs.values()))['loss']) // 4 + 1} on (dotted: "
                 f"spikes the reference lacks)" if runs else "")
    a3.axhline(0, color="k", lw=0.6)
    for y in (-100 * a.tolerance, 100 * a.tolerance):
        a3.axhline(y, color="k", lw=0.6, ls="--")
    a3.set_ylabel(f"loss relative to {labels.get(ref, ref)}, % (mean of 50)")
    a3.set_ylim(-5 * 100 * a.tolerance, 5 * 100 * a.tolerance)
    a4.set_yscale("log")
    a4.set_ylabel("gradient norm before clipping (mean of 10)")
    for x in (a1, a2, a3, a4):
        x.set_xlabel("AdamW step")
        x.legend(fontsize=8)
        x.grid(alpha=0.3)
    fig.suptitle("FP8 training parity on real text (bench/suite_train.py, train-parity)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_settings(text, **given):
    """PARITY_DEFAULTS overrides from "k=v,k=v" (runs joined by '+': runs=coda_bf16+coda_fp8),
    each value converted to its default's type; `given` first, the text wins."""
    out = dict(given)
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k not in PARITY_DEFAULTS:
            raise ValueError(f"train-parity: bad setting {item!r}; known: "
                             f"{', '.join(PARITY_DEFAULTS)}")
        kind = type(PARITY_DEFAULTS[k])
        out[k] = v.replace("+", ",") if kind is str else kind(v)
    return out


def parity_line(sec):
    """One line for the log: each run's last-steps mean, its difference to the reference, its
    spikes and tokens/s, and the verdicts."""
    c = sec["config"]
    parts = []
    for name, r in sec["runs"].items():
        rel = r.get("rel_diff_last")
        parts.append(f"{name} {r.get('mean_last', float('nan')):.4f}"
                     + ("" if rel is None else f" ({100 * rel:+.2f}%)")
                     + f" spikes {len(r.get('spikes', []))}"
                     + (f" (not in ref {len(r['spikes_not_in_ref'])})" if "spikes_not_in_ref" in r
                        else "")
                     + f" {r.get('tokens_per_s', float('nan')):.0f} tok/s")
    return (f"train-parity ({sec.get('steps_done')}/{c['steps']} steps, mean of the last "
            f"{c['last']}): " + "; ".join(parts) + f"; within {100 * c['tolerance']:g}% and no "
            f"spike the reference lacks: {sec.get('pass')}"
            + "".join(f"; absent {k}: {v}" for k, v in sec.get("absent", {}).items()))
