"""The suite's LM head section: LM head + cross-entropy, forward + backward, on the GPU: time and
peak extra memory of

  coda_chunked      torch.ops.coda.lm_head_loss (mean): the three-GEMM path, in chunks of tokens
                    whose bf16 logits (and B1's h_out) fit --chunk-bytes: F4 storing the chunk's
                    logits + A2, dℓ formed in place, B1, dW += dℓᵀ·h; all in the forward (the
                    loss is the last op), the backward scales by d loss
  coda_one_chunk    the same with one chunk (the logits of every token at once)
  eager             RMSNorm, bf16 logits = h·Wᵀ, F.cross_entropy on fp32 logits (as HF does)
  compile           torch.compile of the eager function
  liger             RMSNorm (PyTorch) + Liger's fused linear cross-entropy (if importable)
  gemm_floor        the three GEMMs alone (cuBLAS): h·Wᵀ, dℓ·W, dℓᵀ·h

at the suite's hidden sizes and M (V = 128256; the CODA paper's shapes V = 32768). Every method's
loss and gradients are checked against the eager one before it is timed; times are medians of
interleaved rounds (CUDA events); peak extra memory is max_memory_allocated during one forward +
backward minus the memory held before it (inputs, weights), gradients included (outputs_MiB says
how much of it they are).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

import coda  # noqa: F401  (registers torch.ops.coda)

CODA = torch.ops.coda
V = 128256
EPS = 1e-5


def make_inputs(H, M, seed=0, vocab=V, dev="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, H, device=dev, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(dtype)
    w = (torch.randn(vocab, H, device=dev, generator=g) * H ** -0.5).to(dtype)
    t = torch.randint(0, vocab, (M,), device=dev, generator=g)
    t[::17] = -100
    return x, gamma, w, t


def methods(chunk_bytes):
    def coda_loss(x, gamma, w, t, chunk):
        h, r = CODA.rmsnorm_stats(x, gamma, EPS)  # the producing GEMM's epilogue, in a model
        return CODA.lm_head_loss(x, gamma, w, h, r, t, -100, "mean", 0.0, chunk)[0]

    def eager(x, gamma, w, t):
        logits = F.rms_norm(x, (x.shape[1],), gamma, EPS) @ w.t()
        return F.cross_entropy(logits.float(), t)

    out = {
        "coda_chunked": lambda x, g, w, t: coda_loss(x, g, w, t, chunk_bytes),
        "coda_one_chunk": lambda x, g, w, t: coda_loss(x, g, w, t, 1 << 62),
        "eager": eager,
        "compile": torch.compile(eager),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        lce = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, g, w, t: lce(w, F.rms_norm(x, (x.shape[1],), g, EPS), t)
    except Exception as e:  # reported in the JSON
        out["liger_unavailable"] = repr(e)
    return out


def gemm_floor(x, gamma, w, t):
    h = x * gamma
    dl = h @ w.t()  # stands in for dℓ (same shape and dtype)
    return h, dl @ w, dl.t() @ h


def fwd_bwd(fn, x, gamma, w, t):
    x, gamma, w = (v.detach().requires_grad_() for v in (x, gamma, w))
    loss = fn(x, gamma, w, t)
    gx, gg, gw = torch.autograd.grad(loss, (x, gamma, w))
    return loss.detach(), gx, gg, gw


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run_shape(ms, H, M, reps=8, vocab=V, progress=None):
    """One (H, M, V): every method's loss and gradients checked against eager, then peak extra
    memory and interleaved medians. Returns the row."""
    x, gamma, w, t = make_inputs(H, M, vocab=vocab)
    row = {"H": H, "M": M, "V": vocab, "ms": {}, "peak_extra_MiB": {}, "err_vs_eager": {}}
    ref = fwd_bwd(ms["eager"], x, gamma, w, t)
    for name, fn in ms.items():
        if progress:
            progress(f"LM head H={H} M={M} V={vocab} {name}: check and peak memory")
        got = fwd_bwd(fn, x, gamma, w, t)  # also the warm-up (and compile)
        row["err_vs_eager"][name] = [rel_err(a, b) for a, b in zip(got, ref)]
        del got
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fwd_bwd(fn, x, gamma, w, t)
        torch.cuda.synchronize()
        row["peak_extra_MiB"][name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        # What every method must hold at the end: the loss and the three gradients.
        row["outputs_MiB"] = sum(v.numel() * v.element_size() for v in out) / 2**20
        del out
    del ref
    fns = dict(ms, gemm_floor=None)
    times = {k: [] for k in fns}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = (gemm_floor(x, gamma, w, t) if name == "gemm_floor"
                   else fwd_bwd(fns[name], x, gamma, w, t))
            e.record()
            del out
            times[name].append((s, e))
    torch.cuda.synchronize()
    row["ms"] = {k: statistics.median(s.elapsed_time(e) for s, e in v) for k, v in times.items()}
    best = min(v for k, v in row["ms"].items() if k in ("eager", "compile", "liger"))
    row["coda_chunked_speedup_vs_compile"] = row["ms"]["compile"] / row["ms"]["coda_chunked"]
    row["coda_chunked_speedup_vs_best_baseline"] = best / row["ms"]["coda_chunked"]
    del x, gamma, w, t
    torch.cuda.empty_cache()
    return row

