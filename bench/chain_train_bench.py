"""Layer chain forward + backward (OPS.md §4), fused vs every baseline, side by side on the GPU.

The chain of bench/chain_bench.py (out-proj + residual + RMSNorm -> gate/up + SwiGLU -> down +
residual + RMSNorm -> QKV + RoPE) run forward and backward, given the upstream gradients of its two
outputs (the residual stream x2 and the post-RoPE qkv, as the next layer's attention backward would
deliver them). Ours: F1, A1, F2, F1, A1, F3 forward; B3 -> B1 (+ dW_qkv) -> B2 (+ dW_down) -> B1
(+ dW_gu) -> dW_o, d(y_attn) backward, with the folds (A3). Baselines: the GEMM-only floor (the 12
GEMMs alone), eager, torch.compile and Liger through autograd. Every gradient is checked against
an fp32 autograd evaluation (ours <= 2 x eager bf16's error + 1e-6) before any time is printed.

  python3 bench/chain_train_bench.py --lib .gpubin/libcoda_capi.so [--quick] [--json out.json]
      [--models llama3-1B,llama3-8B] [--sustained RUNS]

--sustained RUNS also times every variant in batches of RUNS back-to-back steps without clearing
L2, the variants alternating batch by batch (rows with "pass": "fwd+bwd sustained"): how a training
loop runs them, at the power limit.
"""

import argparse
import ctypes
import json

import torch
import torch.nn.functional as F

from types import SimpleNamespace

from chain_bench import (ALL_MODELS, EPS, MODELS, Coda, EnergyCounter, bench_interleaved,
                         bench_sustained, chain_inputs, make_chain, progress_printer,
                         results_file, write_json)



def layout(coda, fn, *args):
    """{extent, tiles} of a partial buffer, as ctypes long longs (the C ABI takes long long)."""
    ext = (ctypes.c_longlong * 2)()
    coda(fn, *args, ext)
    return ctypes.c_longlong(ext[0]), ctypes.c_longlong(ext[1])


def ours_chain(coda, t, m, dx2_up, dqkv_up):
    """Our fused chain on the inputs `t` of chain_inputs: every buffer, forward(), backward(), and
    `ops`: per op (name, ours, plain GEMM of ours, cuBLAS GEMM, fold or None) as closures."""
    hidden, hq, hkv, d, inter, qkv_w, dev = t.hidden, t.hq, t.hkv, t.d, t.inter, t.qkv_w, t.dev
    y, x0, wo, wd, g_ffn, g_attn = t.y, t.x0, t.wo, t.wd, t.g_ffn, t.g_attn
    pos, inv_freq, perm = t.pos, t.inv_freq, t.perm
    wgu_inter, wqkv_f = t.wgu_inter, t.wqkv_f
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    f1a, f1b = layout(coda, "coda_residual_rmsnorm_partials_layout", m, hidden, hq * d), \
        layout(coda, "coda_residual_rmsnorm_partials_layout", m, hidden, inter)
    s1 = e(f1a[0].value * f1a[1].value, dt=torch.float32)
    s2 = e(f1b[0].value * f1b[1].value, dt=torch.float32)
    x1, h1, x2, h2 = e(m, hidden), e(m, hidden), e(m, hidden), e(m, hidden)
    r1, r2 = e(m, dt=torch.float32), e(m, dt=torch.float32)
    z, act, qkv = e(m, 2 * inter), e(m, inter), e(m, qkv_w)
    hi, lo = (ctypes.c_uint * qkv_w)(), (ctypes.c_uint * qkv_w)()
    coda("coda_rope_column_table", hq, hkv, d, (ctypes.c_double * (d // 2))(*inv_freq), hi, lo)
    to_i32 = lambda v: torch.tensor([x - (1 << 32) if x >= (1 << 31) else x for x in v],  # noqa: E731
                                    dtype=torch.int32, device=dev)
    fhi, flo = to_i32(hi), to_i32(lo)
    # backward buffers
    b1q = layout(coda, "coda_rmsnorm_backward_partials_layout", m, hidden, qkv_w)
    b1g = layout(coda, "coda_rmsnorm_backward_partials_layout", m, hidden, 2 * inter)
    b2 = layout(coda, "coda_swiglu_backward_partials_layout", m, inter, hidden)
    pq, pg, p2 = (e(b[0].value * b[1].value, dt=torch.float32) for b in (b1q, b1g, b2))
    dqkv_f = dqkv_up[:, perm].contiguous()  # the upstream gradient in our column order
    dqkv_pre, zq, z1 = e(m, qkv_w), e(m, dt=torch.float32), e(m, dt=torch.float32)
    dx2, dx1, hout2, hout1 = e(m, hidden), e(m, hidden), e(m, hidden), e(m, hidden)
    dz, a_re, dy = e(m, 2 * inter), e(m, inter), e(m, hq * d)
    dg_attn, dg_ffn = e(hidden, dt=torch.float32), e(hidden, dt=torch.float32)
    dwqkv, dwd, dwgu, dwo = e(qkv_w, hidden), e(hidden, inter), e(2 * inter, hidden), e(hidden, hq * d)
    c = lambda name, *args: (lambda: coda(name, *args, stream))  # noqa: E731 - one launch, closed over

    f1_out = c("coda_gemm_residual_rmsnorm_partial", y, wo, x0, g_ffn, x1, h1, s1, m, hidden, hq * d)
    fold1 = c("coda_rmsnorm_fold", s1, m, f1a[0], f1a[1], hidden, EPS, r1)
    f2 = c("coda_gemm_rmsnorm_swiglu", h1, wgu_inter, r1, z, act, m, 2 * inter, hidden)
    f1_down = c("coda_gemm_residual_rmsnorm_partial", act, wd, x1, g_attn, x2, h2, s2, m, hidden, inter)
    fold2 = c("coda_rmsnorm_fold", s2, m, f1b[0], f1b[1], hidden, EPS, r2)
    f3 = c("coda_gemm_rmsnorm_rope", h2, wqkv_f, r2, pos, fhi, flo, qkv, m, qkv_w, hidden)
    b3 = c("coda_rope_backward", qkv, dqkv_f, pos, fhi, flo, m, qkv_w, hidden, dqkv_pre, zq)
    b1_qkv = c("coda_gemm_rmsnorm_backward", dqkv_pre, wqkv_f, x2, r2, g_attn, zq, dx2_up, dx2, hout2,
               pq, m, hidden, qkv_w)
    dgfold_attn = c("coda_dgamma_fold", pq, hidden, b1q[0], b1q[1], dg_attn)
    dw_qkv = c("coda_gemm_xty", dqkv_pre, hout2, dwqkv, qkv_w, hidden, m)
    b2_op = c("coda_gemm_swiglu_backward", dx2, wd, z, dz, a_re, p2, m, inter, hidden)
    zfold = c("coda_zdz_fold", p2, m, b2[0], b2[1], hidden, z1)
    dw_down = c("coda_gemm_xty", dx2, a_re, dwd, hidden, inter, m)
    b1_gu = c("coda_gemm_rmsnorm_backward", dz, wgu_inter, x1, r1, g_ffn, z1, dx2, dx1, hout1, pg, m,
              hidden, 2 * inter)
    dgfold_ffn = c("coda_dgamma_fold", pg, hidden, b1g[0], b1g[1], dg_ffn)
    dw_gu = c("coda_gemm_xty", dz, hout1, dwgu, 2 * inter, hidden, m)
    dw_o = c("coda_gemm_xty", dx1, y, dwo, hidden, hq * d, m)
    d_y = c("coda_gemm_xw", dx1, wo, dy, m, hq * d, hidden)
    # Every launch in chain order, named by the stage it belongs to (a fold counts with its GEMM;
    # bench/chain_stage_profile.py times them one by one inside the chain).
    fwd_named = [("F1 out-proj", f1_out), ("F1 out-proj", fold1), ("F2 gate/up", f2),
                 ("F1 down-proj", f1_down), ("F1 down-proj", fold2), ("F3 qkv+RoPE", f3)]
    bwd_named = [("B3 RoPE bwd", b3), ("B1 qkv", b1_qkv), ("B1 qkv", dgfold_attn), ("dW qkv", dw_qkv),
                 ("B2 SwiGLU bwd", b2_op), ("B2 SwiGLU bwd", zfold), ("dW down", dw_down),
                 ("B1 gate/up", b1_gu), ("B1 gate/up", dgfold_ffn), ("dW gate/up", dw_gu),
                 ("dW o", dw_o), ("d(y)", d_y)]
    fwd_calls = [f for _, f in fwd_named]
    bwd_calls = [f for _, f in bwd_named]

    def forward():
        for f in fwd_calls:
            f()

    def backward():
        for f in bwd_calls:
            f()

    plain_out = {}

    def plain(name, x, w, n, k, xw=False):
        """Our plain GEMM (empty epilogue) of the op's shape: X·Wᵀ, or X·W for data gradients."""
        def run():
            if name not in plain_out:
                plain_out[name] = e(m, n)
            coda("coda_gemm_xw" if xw else "coda_gemm", x, w, plain_out[name], m, n, k, stream)
        return run

    # (name, ours, our fold or None, our plain GEMM, cuBLAS GEMM, GEMM (M, N, K))
    ops = [
        ("F1 out-proj", f1_out, fold1, plain("F1o", y, wo, hidden, hq * d), lambda: F.linear(y, wo), (m, hidden, hq * d)),
        ("F2 gate/up", f2, None, plain("F2", h1, wgu_inter, 2 * inter, hidden), lambda: F.linear(h1, wgu_inter), (m, 2 * inter, hidden)),
        ("F1 down-proj", f1_down, fold2, plain("F1d", act, wd, hidden, inter), lambda: F.linear(act, wd), (m, hidden, inter)),
        ("F3 qkv+RoPE", f3, None, plain("F3", h2, wqkv_f, qkv_w, hidden), lambda: F.linear(h2, wqkv_f), (m, qkv_w, hidden)),
        ("B3 RoPE bwd", b3, None, None, None, None),
        ("B1 qkv", b1_qkv, dgfold_attn, plain("B1q", dqkv_pre, wqkv_f, hidden, qkv_w, xw=True),
         lambda: torch.matmul(dqkv_pre, wqkv_f), (m, hidden, qkv_w)),
        ("B2 SwiGLU bwd", b2_op, zfold, plain("B2", dx2, wd, inter, hidden, xw=True),
         lambda: torch.matmul(dx2, wd), (m, inter, hidden)),
        ("B1 gate/up", b1_gu, dgfold_ffn, plain("B1g", dz, wgu_inter, hidden, 2 * inter, xw=True),
         lambda: torch.matmul(dz, wgu_inter), (m, hidden, 2 * inter)),
        ("dW qkv", dw_qkv, None, None, lambda: torch.matmul(dqkv_pre.t(), hout2), (qkv_w, hidden, m)),
        ("dW down", dw_down, None, None, lambda: torch.matmul(dx2.t(), a_re), (hidden, inter, m)),
        ("dW gate/up", dw_gu, None, None, lambda: torch.matmul(dz.t(), hout1), (2 * inter, hidden, m)),
        ("dW o", dw_o, None, None, lambda: torch.matmul(dx1.t(), y), (hidden, hq * d, m)),
        ("d(y)", d_y, None, None, lambda: torch.matmul(dx1, wo), (m, hq * d, hidden)),
    ]
    return SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, torch.Tensor)},
                           forward=forward, backward=backward, ops=ops, stream=stream,
                           named_calls=fwd_named + bwd_named)


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


def ours_floor_gemms(t, o):
    """floor_gemms of the tensors of ours_chain's run `o` on chain_inputs `t`."""
    return floor_gemms([(t.y, t.wo, o.x1), (o.h1, t.wgu_split, o.z), (o.act, t.wd, o.x2),
                        (o.h2, t.wqkv_hf, o.qkv)])


def run_shape(coda, model, m, results, progress, profile=False, backward_only=False, sustained=0,
              pdl_ab=False):
    """One shape: checks every gradient, times fwd+bwd of every variant; `profile`: also every
    op of ours alone; `backward_only`: also the backward pass alone; `sustained`: also every
    variant in batches of that many back-to-back steps (bench_sustained); `pdl_ab`: also ours
    with programmatic dependent launch off (variant coda_no_pdl), after checking that every
    buffer of ours comes out bit for bit as with it."""
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
    eager = dict(zip(names, autograd_step(chain, torch.bfloat16)))

    # ---- ours ----
    o = ours_chain(coda, t, m, dx2_up, dqkv_up)
    forward, backward = o.forward, o.backward
    h1, z, act, h2, x1, x2, qkv = o.h1, o.z, o.act, o.h2, o.x1, o.x2, o.qkv

    def coda_step():
        forward()
        backward()

    coda_step()
    torch.cuda.synchronize()
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

    acc = {k: {"ours": err(ours[k], ref[k]), "eager": err(eager[k], ref[k])} for k in names}
    ok = all(v["ours"] <= 2 * v["eager"] + 1e-6 for v in acc.values())

    variants = {"coda": coda_step}
    if pdl_ab:
        pdl_was = ctypes.c_int()
        coda("coda_programmatic_launch", ctypes.byref(pdl_was))

        def coda_no_pdl_step():
            coda("coda_set_programmatic_launch", 0)
            try:
                coda_step()
            finally:
                coda("coda_set_programmatic_launch", pdl_was.value)

        # Without PDL every buffer of ours (outputs, gradients, partials) must come out bit for
        # bit as with it.
        buffers = {k: v for k, v in vars(o).items() if isinstance(v, torch.Tensor)}
        before = {k: v.clone() for k, v in buffers.items()}
        coda_no_pdl_step()
        torch.cuda.synchronize()
        bits = lambda v: v.reshape(-1).view(torch.uint8)  # noqa: E731 - NaN padding compares too
        differ = [k for k, v in buffers.items() if not torch.equal(bits(before[k]), bits(v))]
        results.setdefault("pdl_ab_identical", []).append(
            {"model": model, "m": m, "identical": not differ, "differ": differ,
             "programmatic_launch_before": pdl_was.value})
        if differ:
            print(f"{model:11s} M={m:5d} with programmatic dependent launch off, these buffers "
                  f"differ: {', '.join(differ)}", flush=True)
        ok = ok and not differ
        variants["coda_no_pdl"] = coda_no_pdl_step
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

        bwd_variants = {"coda": backward, "gemm_only": gemm_only_bwd}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--profile", action="store_true", help="also time every op of our chain alone")
    ap.add_argument("--sustained", type=int, default=0, metavar="RUNS",
                    help="also time every variant in batches of RUNS back-to-back steps (no L2 "
                         "clearing), the variants alternating batch by batch")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also time our chain with programmatic dependent launch off (coda_no_pdl)")
    a = ap.parse_args()
    coda = Coda(a.lib)
    results, progress = results_file("chain_fwd_bwd", a.commit), progress_printer()
    for model in a.models.split(","):
        for m in ((8192,) if a.quick else (8192, 16384)):
            run_shape(coda, model, m, results, progress, profile=a.profile, sustained=a.sustained,
                      pdl_ab=a.pdl_ab)
            write_json(a.json, results)


if __name__ == "__main__":
    main()
