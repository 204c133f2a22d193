"""The suite's layer chain forward + backward (sections chain, sustained, chain-profile; docs/math.md §4),
fused vs every baseline, side by side on the GPU.

The chain of bench/suite_chain.py (out-proj + residual + RMSNorm -> gate/up + SwiGLU -> down +
residual + RMSNorm -> QKV + RoPE) run forward and backward, given the upstream gradients of its two
outputs (the residual stream x2 and the post-RoPE qkv, as the next layer's attention backward would
deliver them). Ours ("coda") is what a model runs: the block ops (out_proj_residual_norm, mlp,
norm_qkv) forward and autograd through their backward ops. "coda_programs" is the same programs
composed directly through the program ops (torch/program_ops.cpp), without autograd's
bookkeeping: F1, A1, F2, F1, A1, F3 forward; B3 -> B1 (+ dW_qkv) -> B2 (+ dW_down) -> B1
(+ dW_gu) -> dW_o, d(y_attn) backward, with the folds (A3); the per-op rows time its programs. Baselines: the GEMM-only floor (the 12 GEMMs alone), eager, torch.compile and Liger
through autograd. Every gradient is checked against an fp32 autograd evaluation (ours <= 2 x eager
bf16's error + 1e-6) before any time is taken.

Section sustained also times every variant in batches of back-to-back steps without clearing L2,
the variants alternating batch by batch (rows with "pass": "fwd+bwd sustained"): how a training
loop runs them, at the power limit.
"""

import json
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from suite_chain import (ALL_MODELS, CODA, EnergyCounter, EPS, bench_interleaved, bench_sustained,
                         chain_inputs, forward_programs, make_chain)


def ours_chain(t, m, dx2_up, dqkv_up):
    """Our fused chain on the inputs `t` of chain_inputs (any device the ops run on): forward(),
    backward(), and `ops`: per op (name, ours, our fold or None, our plain GEMM, cuBLAS GEMM,
    GEMM (M, N, K)) as closures. Every op allocates its outputs; forward() and backward() store
    them as attributes of the returned namespace, which the closures read when called (run
    forward() and backward() once before calling them)."""
    hidden, hq, d, inter, qkv_w = t.hidden, t.hq, t.d, t.inter, t.qkv_w
    y, wo, wd, g_ffn, g_attn = t.y, t.wo, t.wd, t.g_ffn, t.g_attn
    pos, table, wgu_inter, wqkv_f = t.pos, t.rope_table, t.wgu_inter, t.wqkv_f
    dqkv_f = dqkv_up[:, t.perm].contiguous()  # the upstream gradient in our column order
    o = SimpleNamespace(dqkv_f=dqkv_f)

    def forward():
        forward_programs(t, o)

    def backward():
        o.dqkv_pre, o.zq = CODA.rope_backward(o.qkv, dqkv_f, pos, table, hidden)  # B3
        # B1 returns dx = dres + the norm's backward: dres is the residual stream's own gradient.
        o.dx2, o.hout2, o.pq = CODA.gemm_rmsnorm_backward(o.dqkv_pre, wqkv_f, o.x2, o.r2, g_attn,
                                                          o.zq, dx2_up)
        o.dg_attn = CODA.dgamma_fold(o.pq, hidden)
        o.dwqkv = CODA.gemm_xty(o.dqkv_pre, o.hout2)
        o.dz, o.a_re, o.p2 = CODA.gemm_swiglu_backward(o.dx2, wd, o.z)  # B2
        o.z1 = CODA.zdz_fold(o.p2, m, hidden)
        o.dwd = CODA.gemm_xty(o.dx2, o.a_re)
        o.dx1, o.hout1, o.pg = CODA.gemm_rmsnorm_backward(o.dz, wgu_inter, o.x1, o.r1, g_ffn, o.z1,
                                                          o.dx2)
        o.dg_ffn = CODA.dgamma_fold(o.pg, hidden)
        o.dwgu = CODA.gemm_xty(o.dz, o.hout1)
        o.dwo = CODA.gemm_xty(o.dx1, y)
        o.dy = CODA.gemm_xw(o.dx1, wo)

    # Each op alone on the chain's own inputs (read from `o` at call time).
    f1_out = lambda: CODA.gemm_residual_rmsnorm_partial(y, wo, t.x0, g_ffn)  # noqa: E731
    fold1 = lambda: CODA.rmsnorm_fold(o.s1, m, hidden, EPS)  # noqa: E731
    f2 = lambda: CODA.gemm_rmsnorm_swiglu(o.h1, wgu_inter, o.r1)  # noqa: E731
    f1_down = lambda: CODA.gemm_residual_rmsnorm_partial(o.act, wd, o.x1, g_attn)  # noqa: E731
    fold2 = lambda: CODA.rmsnorm_fold(o.s2, m, hidden, EPS)  # noqa: E731
    f3 = lambda: CODA.gemm_rmsnorm_rope(o.h2, wqkv_f, o.r2, pos, table)  # noqa: E731
    b3 = lambda: CODA.rope_backward(o.qkv, dqkv_f, pos, table, hidden)  # noqa: E731
    b1_qkv = lambda: CODA.gemm_rmsnorm_backward(  # noqa: E731
        o.dqkv_pre, wqkv_f, o.x2, o.r2, g_attn, o.zq, dx2_up)
    dgfold_attn = lambda: CODA.dgamma_fold(o.pq, hidden)  # noqa: E731
    dw_qkv = lambda: CODA.gemm_xty(o.dqkv_pre, o.hout2)  # noqa: E731
    b2_op = lambda: CODA.gemm_swiglu_backward(o.dx2, wd, o.z)  # noqa: E731
    zfold = lambda: CODA.zdz_fold(o.p2, m, hidden)  # noqa: E731
    dw_down = lambda: CODA.gemm_xty(o.dx2, o.a_re)  # noqa: E731
    b1_gu = lambda: CODA.gemm_rmsnorm_backward(  # noqa: E731
        o.dz, wgu_inter, o.x1, o.r1, g_ffn, o.z1, o.dx2)
    dgfold_ffn = lambda: CODA.dgamma_fold(o.pg, hidden)  # noqa: E731
    dw_gu = lambda: CODA.gemm_xty(o.dz, o.hout1)  # noqa: E731
    dw_o = lambda: CODA.gemm_xty(o.dx1, y)  # noqa: E731
    d_y = lambda: CODA.gemm_xw(o.dx1, wo)  # noqa: E731

    # (name, ours, our fold or None, our plain GEMM (empty epilogue: X·Wᵀ, or X·W for data
    # gradients), cuBLAS GEMM, GEMM (M, N, K))
    ops = [
        ("F1 out-proj", f1_out, fold1, lambda: CODA.gemm(y, wo), lambda: F.linear(y, wo),
         (m, hidden, hq * d)),
        ("F2 gate/up", f2, None, lambda: CODA.gemm(o.h1, wgu_inter),
         lambda: F.linear(o.h1, wgu_inter), (m, 2 * inter, hidden)),
        ("F1 down-proj", f1_down, fold2, lambda: CODA.gemm(o.act, wd), lambda: F.linear(o.act, wd),
         (m, hidden, inter)),
        ("F3 qkv+RoPE", f3, None, lambda: CODA.gemm(o.h2, wqkv_f), lambda: F.linear(o.h2, wqkv_f),
         (m, qkv_w, hidden)),
        ("B3 RoPE bwd", b3, None, None, None, None),
        ("B1 qkv", b1_qkv, dgfold_attn, lambda: CODA.gemm_xw(o.dqkv_pre, wqkv_f),
         lambda: torch.matmul(o.dqkv_pre, wqkv_f), (m, hidden, qkv_w)),
        ("B2 SwiGLU bwd", b2_op, zfold, lambda: CODA.gemm_xw(o.dx2, wd),
         lambda: torch.matmul(o.dx2, wd), (m, inter, hidden)),
        ("B1 gate/up", b1_gu, dgfold_ffn, lambda: CODA.gemm_xw(o.dz, wgu_inter),
         lambda: torch.matmul(o.dz, wgu_inter), (m, hidden, 2 * inter)),
        ("dW qkv", dw_qkv, None, None, lambda: torch.matmul(o.dqkv_pre.t(), o.hout2), (qkv_w, hidden, m)),
        ("dW down", dw_down, None, None, lambda: torch.matmul(o.dx2.t(), o.a_re), (hidden, inter, m)),
        ("dW gate/up", dw_gu, None, None, lambda: torch.matmul(o.dz.t(), o.hout1), (2 * inter, hidden, m)),
        ("dW o", dw_o, None, None, lambda: torch.matmul(o.dx1.t(), y), (hidden, hq * d, m)),
        ("d(y)", d_y, None, None, lambda: torch.matmul(o.dx1, wo), (m, hq * d, hidden)),
    ]
    o.forward, o.backward, o.ops = forward, backward, ops
    return o


PROJECTIONS = ("out-proj", "gate/up", "down-proj", "qkv")


def floor_gemms(gemms):
    """The GEMM-only floor's 12 cuBLAS GEMMs, {name: call} in the suite's order: the 4 forward
    GEMMs ("fwd out-proj", ...), then per projection its data and weight gradient ("dX ...",
    "dW ..."). gemms: (input, weight, output) per projection, in PROJECTIONS' order; the output
    stands in for its gradient (same shape)."""
    calls = {f"fwd {n}": (lambda a=a, w=w: F.linear(a, w)) for n, (a, w, _) in zip(PROJECTIONS, gemms)}
    for n, (a, w, out) in zip(PROJECTIONS, gemms):
        calls[f"dX {n}"] = lambda w=w, out=out: torch.matmul(out, w)
        calls[f"dW {n}"] = lambda a=a, out=out: torch.matmul(out.t(), a)
    return calls


def run_shape(model, m, results, progress, profile=False, backward_only=False, sustained=0):
    """One shape: checks every gradient, times fwd+bwd of every variant; `profile`: also every
    op of ours alone; `backward_only`: also the backward pass alone; `sustained`: also every
    variant in batches of that many back-to-back steps (bench_sustained)."""
    t = chain_inputs(model, m, 7 * m + ALL_MODELS[model][0])
    hidden, hq, hkv, d, inter, qkv_w = t.hidden, t.hq, t.hkv, t.d, t.inter, t.qkv_w
    y, x0, wo, wd, wqkv_hf, g_ffn, g_attn = t.y, t.x0, t.wo, t.wd, t.wqkv_hf, t.g_ffn, t.g_attn
    cos, sin, inv = t.cos, t.sin, t.inv
    wgu_split = t.wgu_split
    dx2_up, dqkv_up = t.rnd(m, hidden, scale=0.1), t.rnd(m, qkv_w, scale=0.1)

    # ---- autograd baselines and the fp32 reference ----
    chain = make_chain(hq, hkv, d, inter)
    names = ["y", "x0", "wo", "g_ffn", "wgu", "wd", "g_attn", "wqkv"]
    leaves = [y, x0, wo, g_ffn, wgu_split, wd, g_attn, wqkv_hf]

    def autograd_step(fn, dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in leaves]
        x2, qkv = fn(*ins, cos.to(dtype), sin.to(dtype))
        return torch.autograd.grad([x2, qkv], ins, [dx2_up.to(dtype), dqkv_up.to(dtype)])

    ref = dict(zip(names, autograd_step(chain, torch.float32)))
    eager = dict(zip(names, autograd_step(chain, t.dtype)))

    # ---- ours ----
    o = ours_chain(t, m, dx2_up, dqkv_up)
    forward, backward = o.forward, o.backward

    def coda_step():
        forward()
        backward()

    coda_step()
    torch.cuda.synchronize()
    h1, z, act, h2, x1, x2, qkv = o.h1, o.z, o.act, o.h2, o.x1, o.x2, o.qkv
    if profile:
        # Per-op time of our chain next to the cuBLAS GEMM of the same shape (events, median of 10).
        def t_(fn):
            evs = []
            for _ in range(12):
                a_, b_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a_.record(); fn(); b_.record(); evs.append((a_, b_))
            torch.cuda.synchronize()
            return sorted(a_.elapsed_time(b_) for a_, b_ in evs[2:])[5]
        prof = {name: {"ours_ms": t_(fn), "cublas_gemm_ms": t_(ref_fn) if ref_fn else 0.0}
                for name, fn, _, _, ref_fn, _ in o.ops}
        results.setdefault("profile", []).append({"model": model, "m": m, "ops": prof})
        for name, v in prof.items():
            print(f"  {model} M={m} {name:12s} ours {v['ours_ms']:.3f} ms   cuBLAS GEMM {v['cublas_gemm_ms']:.3f} ms", flush=True)
    dy, dx1, dwo, dg_ffn, dg_attn, dwd, dwgu, dwqkv = o.dy, o.dx1, o.dwo, o.dg_ffn, o.dg_attn, o.dwd, o.dwgu, o.dwqkv
    ours = {"y": dy, "x0": dx1, "wo": dwo, "g_ffn": dg_ffn, "g_attn": dg_attn, "wd": dwd,
            "wgu": torch.cat([dwgu[0::2], dwgu[1::2]], 0), "wqkv": dwqkv[inv]}

    def err(a, b):
        return (a.float() - b.float()).abs().max().item()

    # The block ops through autograd, on the fused layouts (gate/up interleaved, Q/K rows
    # permuted; the upstream qkv gradient in our column order).
    fused = [t.y, t.x0, t.wo, t.g_ffn, t.wgu_inter, t.wd, t.g_attn, t.wqkv_f]
    block_in = [a.detach().requires_grad_() for a in fused]

    def blocks_forward():
        y_, x0_, wo_, gffn_, wgu_, wd_, gattn_, wqkv_ = block_in
        x1_, h1_, r1_ = CODA.out_proj_residual_norm(y_, wo_, x0_, gffn_, EPS)
        x2_, h2_, r2_, _ = CODA.mlp(x1_, gffn_, wgu_, wd_, h1_, r1_, gattn_, EPS)
        return x2_, CODA.norm_qkv(x2_, gattn_, wqkv_, h2_, r2_, t.pos, t.rope_table)

    def blocks_backward(outs):
        return torch.autograd.grad(list(outs), block_in, [dx2_up, o.dqkv_f])

    def coda_blocks():
        return blocks_backward(blocks_forward())

    gb = dict(zip(names, coda_blocks()))
    gb["wgu"] = torch.cat([gb["wgu"][0::2], gb["wgu"][1::2]], 0)
    gb["wqkv"] = gb["wqkv"][inv]
    acc = {k: {"ours": err(ours[k], ref[k]), "ours_blocks": err(gb[k], ref[k]),
               "eager": err(eager[k], ref[k])} for k in names}
    ok = all(max(v["ours"], v["ours_blocks"]) <= 2 * v["eager"] + 1e-6 for v in acc.values())

    variants = {"coda": coda_blocks, "coda_programs": coda_step}
    fwd_in = [a.detach().requires_grad_() for a in leaves]

    def autograd_variant(fn):
        def step():
            x2o, qkvo = fn(*fwd_in, cos, sin)
            torch.autograd.grad([x2o, qkvo], fwd_in, [dx2_up, dqkv_up])
        return step

    # GEMM-only floor: the same 12 GEMMs (4 forward, 4 data gradients, 4 weight gradients).
    floor = floor_gemms([(y, wo, x1), (h1, wgu_split, z), (act, wd, x2), (h2, wqkv_hf, qkv)])

    def gemm_only():
        for fn in floor.values():
            fn()

    variants["gemm_only"] = gemm_only
    variants["eager"] = autograd_variant(chain)
    compiled = torch.compile(chain, dynamic=False)
    variants["compile"] = autograd_variant(compiled)
    try:
        from liger_kernel.transformers.functional import (
            liger_fused_add_rms_norm, liger_rope, liger_swiglu)

        def liger_chain(y_, x0_, wo_, gffn_, wgu_, wd_, gattn_, wqkv_, cos_, sin_):
            h1l, x1l = liger_fused_add_rms_norm(F.linear(y_, wo_), x0_, gffn_, EPS, in_place=False)
            gate, up = F.linear(h1l, wgu_).chunk(2, dim=-1)
            h2l, x2l = liger_fused_add_rms_norm(F.linear(liger_swiglu(gate, up), wd_), x1l, gattn_,
                                                EPS, in_place=False)
            q_ = F.linear(h2l, wqkv_)
            q = q_[:, : hq * d].view(1, m, hq, d).transpose(1, 2)
            k = q_[:, hq * d: (hq + hkv) * d].view(1, m, hkv, d).transpose(1, 2)
            q, k = liger_rope(q, k, cos_[None], sin_[None])
            qkv_l = torch.cat([q.transpose(1, 2).reshape(m, -1), k.transpose(1, 2).reshape(m, -1),
                               q_[:, (hq + hkv) * d:]], -1)
            return x2l, qkv_l

        variants["liger"] = autograd_variant(liger_chain)
    except Exception as ex:  # noqa: BLE001 - report why the baseline is absent
        results.setdefault("absent", {})["liger"] = repr(ex)[:300]

    times = bench_interleaved(variants, progress, f"chain fwd+bwd {model} M={m}") if ok else {}
    base = [times[k] for k in ("eager", "compile", "liger") if k in times]
    speedup = min(base) / times["coda"] if ok and base else float("nan")
    results["rows"].append({"model": model, "m": m, "pass": "fwd+bwd", "check": "PASS" if ok else "FAIL",
                            **{f"ms_{k}": v for k, v in times.items()},
                            "speedup_vs_best_baseline": speedup,
                            "grad_errors": acc})
    msg = " ".join(f"{k}={v:.3f}" for k, v in times.items()) + f" | speedup {speedup:.3f}x" if ok else \
        "FAIL " + json.dumps(acc)
    print(f"{model:11s} M={m:5d} {msg}", flush=True)
    if ok and sustained:
        progress(f"chain fwd+bwd {model} M={m}: sustained, batches of {sustained}")
        counter = EnergyCounter()
        st = bench_sustained(variants, sustained, counter=counter if counter.nvml else None)
        if counter.nvml is None:  # no NVML: times only
            st = {k: {"ms": v} for k, v in st.items()}
        ms = {k: v["ms"] for k, v in st.items()}
        base = [ms[k] for k in ("eager", "compile", "liger") if k in ms]
        results["rows"].append({"model": model, "m": m, "pass": "fwd+bwd sustained",
                                "batch": sustained, "check": "PASS",
                                **{f"ms_{k}": v for k, v in ms.items()},
                                **{f"{q}_{k}": v[q] for k, v in st.items()
                                   for q in ("joules", "sm_clock_mhz", "power_w") if q in v},
                                "speedup_vs_best_baseline": min(base) / ms["coda"] if base else float("nan")})
        print(f"{model:11s} M={m:5d} sustained: "
              + " ".join(f"{k}={v['ms']:.3f}" + (f" ({v['sm_clock_mhz']} MHz, {v['power_w']} W)"
                                                   if "sm_clock_mhz" in v else "")
                         for k, v in st.items())
              + (f" | speedup {min(base) / ms['coda']:.3f}x" if base else ""), flush=True)
    if ok and backward_only:
        # Backward alone: ours re-runs backward() on the saved forward tensors; each autograd
        # baseline runs its forward untimed before every timed autograd.grad (no retain_graph:
        # torch.compile's donated buffers forbid it).
        def gemm_only_bwd():
            for name, fn in floor.items():
                if not name.startswith("fwd "):
                    fn()

        bwd_variants = {"coda": (blocks_forward, blocks_backward), "coda_programs": backward,
                        "gemm_only": gemm_only_bwd}
        for name, fn in (("eager", chain), ("compile", compiled),
                         ("liger", liger_chain if "liger" in variants else None)):
            if fn is not None:
                bwd_variants[name] = (lambda fn=fn: fn(*fwd_in, cos, sin),
                                      lambda outs: torch.autograd.grad(outs, fwd_in, [dx2_up, dqkv_up]))
        bwd = bench_interleaved(bwd_variants, progress, f"chain bwd {model} M={m}")
        base = [bwd[k] for k in ("eager", "compile", "liger") if k in bwd]
        results["rows"].append({"model": model, "m": m, "pass": "bwd", "check": "PASS",
                                **{f"ms_{k}": v for k, v in bwd.items()},
                                "speedup_vs_best_baseline": min(base) / bwd["coda"] if base else float("nan")})
        print(f"{model:11s} M={m:5d} backward only: " + " ".join(f"{k}={v:.3f}" for k, v in bwd.items()), flush=True)
    torch.cuda.empty_cache()

