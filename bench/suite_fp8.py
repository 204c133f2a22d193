"""The suite's blockwise FP8 section (docs/math.md §6): every projection GEMM of a LLaMA layer in
its three passes, and the cast passes that feed them.

GEMM rows, per projection (qkv, out, gate_up, down) and pass:
  fprop  y (M, N) = x · wᵀ         x 1x128, w 128x128 blocks (K = the projection's input width)
  dgrad  dx (M, K) = dy · w        dy 1x128, wᵀ's codes in 128x128 blocks
  wgrad  dw (N, K) = dyᵀ · x       both transposed copies, 1x128 along the tokens (K = M)
Variants (each row checked before timing: ours against cuBLASLt on the same codes and scales):
  coda           our FP8 GEMM (CODA.fp8_gemm / fp8_gemm_xyt, bf16 out), the heuristic's kernel
  coda_acc       wgrad only: ours accumulating into an fp32 dw (CODA.fp8_gemm_xyt_accumulate_)
  cublaslt       torch._scaled_mm with blockwise scales (cuBLASLt's VEC128 / BLK128x128 modes)
  coda_bf16      our bf16 plain GEMM of the same shape (CODA.gemm / gemm_xw / gemm_xty)
  cublas_bf16    torch.mm in bf16
Fused rows: F1 with h quantized in its epilogue (CODA.fp8_gemm_residual_rmsnorm) at the out- and
down-projection shapes, against our plain FP8 GEMM of the same shape (the issue's bar: fused
<= 1.05x plain):
  coda_f1        x = a · wᵀ + residual, h in 1x128 blocks and its transposed copy, Σx² partials
  coda_f1_rows   the same without the transposed copy
  coda           our plain FP8 GEMM (bf16 out)
  gemm_then_cast the plain GEMM, then the rows+t cast of an (M, H) bf16 tensor: a lower bound for
                 the unfused path (its residual add, ⊙ γ and Σx² pass left out)
  cublaslt       cuBLASLt's blockwise GEMM
Cast rows: the standalone casts at this shape, against a device-to-device copy of the
same input (bytes read + written), interleaved:
  rows       x (M, H) -> codes + 1x128 scales
  rows+t     x (M, H) -> codes, and the transposed 128x1 copy (what a weight gradient reads)
  weight     w (I, H) -> 128x128 codes and the transposed codes (once per optimizer step)
"""

from __future__ import annotations

import torch

import suite_chain as cb
from suite_chain import MODELS

CODA = torch.ops.coda
BF16 = torch.bfloat16


def rand_bf16(rows, cols, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, cols, device="cuda", generator=g, dtype=torch.float32).to(BF16)


def projections(model):
    hidden, hq, hkv, d, inter = MODELS[model]
    return {
        "qkv": ((hq + 2 * hkv) * d, hidden),
        "out": (hidden, hq * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def scaled_mm(a, a_scales, b, b_scales):
    """cuBLASLt's blockwise FP8 GEMM through PyTorch: a (M, K) · b (N, K)ᵀ, bf16 out. The 1x128
    scales go in as (M, K/128) views, outer-dimension-major, as cuBLASLt reads them."""
    return torch._scaled_mm(a, b.t(), scale_a=a_scales, scale_b=b_scales, out_dtype=BF16)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def gemm_rows(model, m, sec, progress):
    for proj, (n, k) in projections(model).items():
        x, w, dy = rand_bf16(m, k, 1), rand_bf16(n, k, 2), rand_bf16(m, n, 3)
        xc, xs, xtc, xts = CODA.fp8_quantize_rows(x, True, True)
        wc, ws, wtc, wts = CODA.fp8_quantize_blocks(w, True, True)
        dyc, dys, dytc, dyts = CODA.fp8_quantize_rows(dy, True, True)
        dw32 = torch.zeros(n, k, device="cuda")
        passes = {
            # (M, N, K), ours, cuBLASLt's, our bf16 and cuBLAS bf16 of the same shape
            "fprop": (
                (m, n, k),
                lambda: CODA.fp8_gemm(xc, xs, wc, ws),
                lambda: scaled_mm(xc, xs.t(), wc, ws.t()),
                lambda: CODA.gemm(x, w),
                lambda: torch.mm(x, w.t()),
            ),
            "dgrad": (
                (m, k, n),
                lambda: CODA.fp8_gemm(dyc, dys, wtc, wts),
                lambda: scaled_mm(dyc, dys.t(), wtc, wts.t()),
                lambda: CODA.gemm_xw(dy, w),
                lambda: torch.mm(dy, w),
            ),
            "wgrad": (
                (n, k, dytc.shape[1]),
                lambda: CODA.fp8_gemm_xyt(dytc, dyts, xtc, xts),
                lambda: scaled_mm(dytc, dyts.t(), xtc, xts),
                lambda: CODA.gemm_xty(dy, x),
                lambda: torch.mm(dy.t(), x),
            ),
        }
        for name, ((gm, gn, gk), ours, lt, ours16, cublas16) in passes.items():
            row = {"model": model, "M": m, "proj": proj, "pass": name, "gemm": [gm, gn, gk]}
            out = ours()
            try:
                ref = lt()
                row["rel_err_vs_cublaslt"] = rel_err(out, ref)
                have_lt = True
            except RuntimeError as e:
                sec.setdefault("absent", {})["cublaslt"] = str(e).splitlines()[0]
                have_lt = False
            row["rel_err_vs_bf16"] = rel_err(out, ours16())
            ok = (not have_lt or row["rel_err_vs_cublaslt"] < 1e-2) and row["rel_err_vs_bf16"] < 0.1
            row["ok"] = ok
            if not ok:
                print(f"FAIL fp8 {model} M={m} {proj} {name}: {row}", flush=True)
                sec["rows"].append(row)
                continue
            variants = {"coda": ours, "coda_bf16": ours16, "cublas_bf16": cublas16}
            if have_lt:
                variants["cublaslt"] = lt
            if name == "wgrad":
                variants["coda_acc"] = lambda: CODA.fp8_gemm_xyt_accumulate_(
                    dw32, dytc, dyts, xtc, xts
                )
            ms = cb.bench_interleaved(
                variants, progress, f"fp8 {model} M={m} {proj} {name}", target_ms=600.0
            )
            flops = 2.0 * gm * gn * gk
            row["ms"] = ms
            row["tflops"] = {v: flops / t / 1e9 for v, t in ms.items()}
            if have_lt:
                row["speedup_vs_cublaslt"] = ms["cublaslt"] / ms["coda"]
            row["speedup_vs_coda_bf16"] = ms["coda_bf16"] / ms["coda"]
            sec["rows"].append(row)
            print(
                f"fp8 {model:10s} M={m:5d} {proj:7s} {name:5s} "
                + " ".join(f"{v}={t:.3f}ms({row['tflops'][v]:.0f})" for v, t in ms.items()),
                flush=True,
            )


def fused_rows(model, m, sec, progress):
    hidden, hq, _, d, inter = MODELS[model]
    for proj, k in (("out", hq * d), ("down", inter)):
        a, w = rand_bf16(m, k, 6), rand_bf16(hidden, k, 7)
        residual, h = rand_bf16(m, hidden, 8), rand_bf16(m, hidden, 9)
        gamma = rand_bf16(1, hidden, 10).view(-1)
        ac, acs, _, _ = CODA.fp8_quantize_rows(a)
        wc, wcs, _, _ = CODA.fp8_quantize_blocks(w)
        row = {"model": model, "M": m, "proj": proj, "gemm": [m, hidden, k]}
        x = CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, residual, gamma, True, True)[0]
        plain = CODA.fp8_gemm(ac, acs, wc, wcs)
        row["rel_err_x_vs_gemm_plus_residual"] = rel_err(x, plain.float() + residual.float())
        row["ok"] = row["rel_err_x_vs_gemm_plus_residual"] < 1e-2
        if not row["ok"]:
            print(f"FAIL fp8 fused {model} M={m} {proj}: {row}", flush=True)
            sec["fused_rows"].append(row)
            continue

        def gemm_then_cast():
            CODA.fp8_gemm(ac, acs, wc, wcs)
            CODA.fp8_quantize_rows(h, True, True)

        variants = {
            "coda_f1": lambda: CODA.fp8_gemm_residual_rmsnorm(
                ac, acs, wc, wcs, residual, gamma, True, True
            ),
            "coda_f1_rows": lambda: CODA.fp8_gemm_residual_rmsnorm(
                ac, acs, wc, wcs, residual, gamma, True, False
            ),
            "coda": lambda: CODA.fp8_gemm(ac, acs, wc, wcs),
            "gemm_then_cast": gemm_then_cast,
        }
        try:
            scaled_mm(ac, acs.t(), wc, wcs.t())
            variants["cublaslt"] = lambda: scaled_mm(ac, acs.t(), wc, wcs.t())
        except RuntimeError:
            pass
        ms = cb.bench_interleaved(
            variants, progress, f"fp8 fused {model} M={m} {proj}", target_ms=600.0
        )
        row["ms"] = ms
        row["f1_over_plain"] = ms["coda_f1"] / ms["coda"]
        row["f1_rows_over_plain"] = ms["coda_f1_rows"] / ms["coda"]
        row["gemm_then_cast_over_f1"] = ms["gemm_then_cast"] / ms["coda_f1"]
        sec["fused_rows"].append(row)
        print(
            f"fp8 fused {model:10s} M={m:5d} {proj:5s} "
            + " ".join(f"{v}={t:.3f}ms" for v, t in ms.items())
            + f" f1/plain={row['f1_over_plain']:.3f}",
            flush=True,
        )


def cast_rows(model, m, sec, progress):
    hidden, _, _, _, inter = MODELS[model]
    x, w = rand_bf16(m, hidden, 4), rand_bf16(2 * inter, hidden, 5)
    dst_x, dst_w = torch.empty_like(x), torch.empty_like(w)
    m16 = -(-m // 16) * 16
    casts = {
        # name: (run, copy of the same input, bytes moved by the cast)
        "rows": (
            lambda: CODA.fp8_quantize_rows(x, True, False),
            lambda: dst_x.copy_(x),
            x.numel() * 3 + (hidden // 128) * m * 4,
        ),
        "rows+t": (
            lambda: CODA.fp8_quantize_rows(x, True, True),
            lambda: dst_x.copy_(x),
            x.numel() * 3 + hidden * m16 + 2 * (hidden // 128) * m * 4,
        ),
        "weight": (
            lambda: CODA.fp8_quantize_blocks(w, True, True),
            lambda: dst_w.copy_(w),
            w.numel() * 4,
        ),
    }
    for name, (run, copy, nbytes) in casts.items():
        ms = cb.bench_interleaved(
            {"cast": run, "copy": copy}, progress, f"cast {model} M={m} {name}", target_ms=400.0
        )
        copy_bytes = 2 * (x if name != "weight" else w).numel() * 2
        row = {
            "model": model,
            "M": m,
            "cast": name,
            "ms": ms,
            "cast_GBps": nbytes / ms["cast"] / 1e6,
            "copy_GBps": copy_bytes / ms["copy"] / 1e6,
        }
        row["fraction_of_copy"] = row["cast_GBps"] / row["copy_GBps"]
        sec["cast_rows"].append(row)
        print(
            f"cast {model:10s} M={m:5d} {name:7s} {row['cast_GBps']:.0f} GB/s, copy "
            f"{row['copy_GBps']:.0f} GB/s: {row['fraction_of_copy']:.2f}",
            flush=True,
        )


def run_shape(model, m, sec, progress, fused_only=False):
    if model not in MODELS:  # the paper's shapes have no FP8 rows
        return
    sec.setdefault("cast_rows", [])
    sec.setdefault("fused_rows", [])
    if not fused_only:
        gemm_rows(model, m, sec, progress)
    fused_rows(model, m, sec, progress)
    if not fused_only:
        cast_rows(model, m, sec, progress)
