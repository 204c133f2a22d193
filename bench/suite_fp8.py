"""The suite's blockwise FP8 section (docs/math.md §6): every projection GEMM of a LLaMA layer in
its three passes, and the cast passes that feed them.

GEMM rows, per projection (qkv, out, gate_up, down) and pass:
  fprop  y (M, N) = x · wᵀ         x 1x128, w 128x128 blocks (K = the projection's input width)
  dgrad  dx (M, K) = dy · w        dy 1x128, wᵀ's codes in 128x128 blocks
  wgrad  dw (N, K) = dyᵀ · x       both transposed copies, 1x128 along the tokens (K = M)
Variants (each row checked before timing: ours against cuBLASLt on the same codes and scales):
  coda           our FP8 GEMM (CODA.fp8_gemm / fp8_gemm_xyt, bf16 out), the heuristic's kernel
                 (wgrad: pinned to our CUTLASS kernel, coda::set_fp8_wgrad_backend "cutlass";
                 the op's default backend is cuBLASLt's, timed as coda_cublaslt)
  coda_acc       wgrad only: ours accumulating into an fp32 dw (CODA.fp8_gemm_xyt_accumulate_),
                 on our kernel too
  coda_cublaslt  wgrad only: our op on its cuBLASLt backend (coda::set_fp8_wgrad_backend
                 "cublaslt-only"), checked against torch's cuBLASLt call first; absent (with the
                 reason) where the build or cuBLASLt cannot run it
  cublaslt       torch._scaled_mm with blockwise scales (cuBLASLt's VEC128 / BLK128x128 modes)
  coda_bf16      our bf16 plain GEMM of the same shape (CODA.gemm / gemm_xw / gemm_xty)
  cublas_bf16    torch.mm in bf16
Fused rows: each program whose epilogue quantizes its output, at its projection's shape,
against our plain FP8 GEMM of the same shape (the issue's bar: fused <= 1.05x plain):
  F1  out, down        x = a · wᵀ + residual, h = x ⊙ γ quantized, Σx² partials
  F2  gate_up          z = r ⊙ (h · w_guᵀ), a = silu(z_g) · z_u quantized
  B1  qkv_bwd, gate_up_bwd   dx = dres + r·(g·γ − x·r·ZdZ) from g = dz · W; h_out = x·r·γ's
                       transposed copy quantized (the weight gradient's operand); dγ partials
  B2  down_bwd         dz = dSwiGLU(z, dx_out · W_down) quantized; ZdZ partials
  F2z, B2z             F2 and B2 with z saved in FP8 (fp8_z): F2 quantizes z as well, in 1x128
                       blocks, instead of writing it in bf16; B2 reads z's codes and decodes them
Before timing, every output is finite and one (F1's x, F2's z, B1's dx, B2's dz dequantized; the
FP8 z's rows dequantized, within e4m3's error) is
within a normwise bound of the program's formula applied to the plain FP8 GEMM's result.
Variants:
  fused          the program, its output in 1x128 blocks and as the transposed copy (B1: the
                 copy alone)
  fused_rows     the same without the transposed copy (not for B1, which writes only the copy)
  coda           our plain FP8 GEMM (bf16 out)
  gemm_then_cast the plain GEMM, then the rows+t cast of a bf16 tensor of the quantized output's
                 shape: a lower bound for the unfused path (its elementwise pass left out)
  split          F2z, B1, B2, B2z: the op split (coda.set_fp8_epilogue("split")): the plain GEMM's
                 bf16 output, then the elementwise half and the casts in one pass
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
# The fused programs fused_cases times (suite.py --fp8-programs names a subset).
FUSED_PROGRAMS = ("F1", "F2", "F2z", "B1", "B2", "B2z")
# The programs that also run split (the plain GEMM, then their elementwise half as a pass of its
# own: coda.set_fp8_epilogue("split")), timed as the `split` variant.
SPLIT_PROGRAMS = ("F2z", "B1", "B2", "B2z")
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
    """Relative Frobenius error ||a - b|| / ||b|| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gemm_rows(model, m, sec, progress):
    for proj, (n, k) in projections(model).items():
        x, w, dy = rand_bf16(m, k, 1), rand_bf16(n, k, 2), rand_bf16(m, n, 3)
        xc, xs, xtc, xts = CODA.fp8_quantize_rows(x, True, True)
        wc, ws, wtc, wts = CODA.fp8_quantize_blocks(w, True, True)
        dyc, dys, dytc, dyts = CODA.fp8_quantize_rows(dy, True, True)
        dw32 = torch.zeros(n, k, device="cuda")

        def wgrad_op():  # on the op's backend of the moment
            return CODA.fp8_gemm_xyt(dytc, dyts, xtc, xts)

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
                on_wgrad_backend("cutlass", wgrad_op),
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
            except (RuntimeError, ValueError) as e:  # newer torch raises ValueError
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
                variants["coda_acc"] = on_wgrad_backend(
                    "cutlass", lambda: CODA.fp8_gemm_xyt_accumulate_(dw32, dytc, dyts, xtc, xts))
                lt_backend = on_wgrad_backend("cublaslt-only", wgrad_op)
                try:  # our op on its cuBLASLt backend: checked against torch's cuBLASLt call
                    err = rel_err(lt_backend(), ref) if have_lt else 0.0
                except RuntimeError as e:
                    sec.setdefault("absent", {})["coda_cublaslt"] = str(e).splitlines()[0][:300]
                else:
                    row["rel_err_cublaslt_backend"] = err
                    if err < 1e-2:
                        variants["coda_cublaslt"] = lt_backend
            ms = cb.bench_interleaved(
                variants, progress, f"fp8 {model} M={m} {proj} {name}", target_ms=600.0
            )
            flops = 2.0 * gm * gn * gk
            row["ms"] = ms
            row["tflops"] = {v: flops / t / 1e9 for v, t in ms.items()}
            if have_lt:
                row["speedup_vs_cublaslt"] = ms["cublaslt"] / ms["coda"]
                if "coda_cublaslt" in ms:
                    row["cublaslt_backend_vs_cublaslt"] = ms["cublaslt"] / ms["coda_cublaslt"]
            row["speedup_vs_coda_bf16"] = ms["coda_bf16"] / ms["coda"]
            sec["rows"].append(row)
            print(
                f"fp8 {model:10s} M={m:5d} {proj:7s} {name:5s} "
                + " ".join(f"{v}={t:.3f}ms({row['tflops'][v]:.0f})" for v, t in ms.items()),
                flush=True,
            )


def on_wgrad_backend(backend, fn):
    """fn run with our FP8 weight gradient on `backend` (coda::set_fp8_wgrad_backend), the
    previous backend restored after."""
    def run():
        old = CODA.set_fp8_wgrad_backend(backend)
        try:
            return fn()
        finally:
            CODA.set_fp8_wgrad_backend(old)
    return run


def dequantize_rows(codes, scales, cols):
    """1x128 codes (M, cols) with their (blocks, M) scales, in fp32."""
    return codes[:, :cols].float() * scales.t().float().repeat_interleave(128, 1)[:, :cols]


def fused_cases(model, m):
    """(program, projection, (M, N, K) of the GEMM, operands, the quantized output's shape, the
    program's call (its argument: whether the rows are wanted beside the transposed copy, None
    where the program writes only the copy) and its spot check: (outputs, the plain GEMM's
    bf16 result) -> (one output, the same from the plain GEMM by the program's formula in fp32,
    the normwise tolerance))."""
    hidden, hq, hkv, d, inter = MODELS[model]
    qkv = (hq + 2 * hkv) * d
    r = (torch.rand(m, device="cuda") + 0.5).float()
    gamma = (torch.rand(hidden, device="cuda") + 0.5).to(BF16)
    cases = []
    for proj, k in (("out", hq * d), ("down", inter)):  # F1: a (M, K) · w (H, K)ᵀ
        ac, acs, _, _ = CODA.fp8_quantize_rows(rand_bf16(m, k, 6))
        wc, wcs, _, _ = CODA.fp8_quantize_blocks(rand_bf16(hidden, k, 7))
        residual = rand_bf16(m, hidden, 8)
        cases.append(("F1", proj, (m, hidden, k), (ac, acs, wc, wcs), (m, hidden),
                      lambda t, o=(ac, acs, wc, wcs, residual): CODA.fp8_gemm_residual_rmsnorm(
                          *o, gamma, True, t),
                      lambda outs, g, res=residual: (outs[0], g.float() + res.float(), 1e-2)))
    hc, hcs, _, _ = CODA.fp8_quantize_rows(rand_bf16(m, hidden, 11))  # F2: h · w_guᵀ
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(rand_bf16(2 * inter, hidden, 12))
    cases.append(("F2", "gate_up", (m, 2 * inter, hidden), (hc, hcs, wc, wcs), (m, inter),
                  lambda t, o=(hc, hcs, wc, wcs): CODA.fp8_gemm_rmsnorm_swiglu(*o, r, True, t),
                  lambda outs, g: (outs[0], r[:, None] * g.float(), 1e-2)))
    # F2 with z saved in FP8 (fp8_z): z's codes instead of the bf16 z, e4m3's error
    cases.append(("F2z", "gate_up", (m, 2 * inter, hidden), (hc, hcs, wc, wcs), (m, inter),
                  lambda t, o=(hc, hcs, wc, wcs): CODA.fp8_gemm_rmsnorm_swiglu_fp8_z(
                      *o, r, True, t),
                  lambda outs, g: (dequantize_rows(outs[0], outs[1], 2 * inter),
                                   r[:, None] * g.float(), 0.1)))
    x, dres = rand_bf16(m, hidden, 13), rand_bf16(m, hidden, 14)
    zdz = torch.randn(m, device="cuda") * 0.1
    for proj, k in (("qkv_bwd", qkv), ("gate_up_bwd", 2 * inter)):  # B1: dz · W, W (K, H)
        dzc, dzs, _, _ = CODA.fp8_quantize_rows(rand_bf16(m, k, 15))
        _, _, wtc, wts = CODA.fp8_quantize_blocks(rand_bf16(k, hidden, 16), False, True)
        cases.append(("B1", proj, (m, hidden, k), (dzc, dzs, wtc, wts), (m, hidden),
                      lambda t, o=(dzc, dzs, wtc, wts): CODA.fp8_gemm_rmsnorm_backward(
                          *o, x, r, gamma, zdz, dres),
                      lambda outs, g: (outs[0], dres.float() + r[:, None] * (
                          g.float() * gamma.float() - x.float() * (r * zdz)[:, None]), 1e-2)))
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(rand_bf16(m, hidden, 17))  # B2: dx_out · W_down
    _, _, wtc, wts = CODA.fp8_quantize_blocks(rand_bf16(hidden, inter, 18), False, True)
    z = rand_bf16(m, 2 * inter, 19)
    cases.append(("B2", "down_bwd", (m, inter, hidden), (dxc, dxs, wtc, wts), (m, 2 * inter),
                  lambda t, o=(dxc, dxs, wtc, wts): CODA.fp8_gemm_swiglu_backward(
                      *o, z, True, t),
                  lambda outs, da: (dequantize_rows(outs[0], outs[1], 2 * inter),
                                    dswiglu(da.float(), z.float()), 0.1)))
    # B2 reading z saved in FP8 (fp8_z): the codes as (g, u) pairs, decoded in the epilogue
    zc, zs, _, _ = CODA.fp8_quantize_rows(z, True, False)
    z_dec = dequantize_rows(zc, zs, 2 * inter)
    cases.append(("B2z", "down_bwd", (m, inter, hidden), (dxc, dxs, wtc, wts), (m, 2 * inter),
                  lambda t, o=(dxc, dxs, wtc, wts): CODA.fp8_gemm_swiglu_backward(
                      *o, zc, True, t, zs),
                  lambda outs, da: (dequantize_rows(outs[0], outs[1], 2 * inter),
                                    dswiglu(da.float(), z_dec), 0.1)))
    return cases


def dswiglu(da, z):
    """B2's dz from da (M, I) and the interleaved (gate, up) pairs of z (M, 2I), interleaved."""
    gate, up = z[:, 0::2], z[:, 1::2]
    sig = torch.sigmoid(gate)
    return torch.stack([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], 2).flatten(1)


def split(run):
    """run() with the programs' elementwise half as a pass of its own (coda.set_fp8_epilogue)."""
    old = CODA.set_fp8_epilogue("split")
    try:
        return run()
    finally:
        CODA.set_fp8_epilogue(old)


def fused_rows(model, m, sec, progress, programs=None):
    old = CODA.set_fp8_epilogue("fused")  # `fused` is the epilogue; `split` is timed beside it
    try:
        fused_rows_placed(model, m, sec, progress, programs)
    finally:
        CODA.set_fp8_epilogue(old)


def fused_rows_placed(model, m, sec, progress, programs):
    for program, proj, (gm, gn, gk), operands, out_shape, fused, check in fused_cases(model, m):
        assert program in FUSED_PROGRAMS, program
        if programs is not None and program not in programs:
            continue
        row = {"model": model, "M": m, "program": program, "proj": proj, "gemm": [gm, gn, gk]}
        # The spot check (the programs' values are tested against their oracles in tests/): every
        # output finite, and one output against the program's formula applied to the plain FP8
        # GEMM's result.
        outs = fused(True)
        got, want, tol = check(outs, CODA.fp8_gemm(*operands))
        finite = all(torch.isfinite(t.float()).all().item() for t in outs if t.numel() > 0)
        row["rel_err"] = rel_err(got, want)
        row["ok"] = finite and row["rel_err"] <= tol
        if not row["ok"]:
            print(f"FAIL fp8 fused {model} M={m} {program} {proj}: finite {finite}, relative "
                  f"error {row['rel_err']:.3g} (bound {tol})", flush=True)
            sec["fused_rows"].append(row)
            continue
        out = rand_bf16(*out_shape, 20)

        def gemm_then_cast(o=operands, out=out):
            CODA.fp8_gemm(*o)
            CODA.fp8_quantize_rows(out, True, True)

        variants = {"fused": lambda: fused(True)}
        if program != "B1":  # B1 writes only the transposed copy: no rows-only variant
            variants["fused_rows"] = lambda: fused(False)
        if program in SPLIT_PROGRAMS:
            got_s, want_s, tol_s = check(split(lambda: fused(True)), CODA.fp8_gemm(*operands))
            row["split_rel_err"] = rel_err(got_s, want_s)
            if row["split_rel_err"] <= tol_s:
                variants["split"] = lambda: split(lambda: fused(True))
            else:
                print(f"FAIL fp8 split {model} M={m} {program} {proj}: relative error "
                      f"{row['split_rel_err']:.3g} (bound {tol_s})", flush=True)
        variants.update({"coda": lambda o=operands: CODA.fp8_gemm(*o),
                         "gemm_then_cast": gemm_then_cast})
        ac, acs, wc, wcs = operands
        try:
            scaled_mm(ac, acs.t(), wc, wcs.t())
            variants["cublaslt"] = lambda: scaled_mm(ac, acs.t(), wc, wcs.t())
        except (RuntimeError, ValueError):  # newer torch raises ValueError
            pass
        ms = cb.bench_interleaved(
            variants, progress, f"fp8 fused {model} M={m} {program} {proj}", target_ms=600.0
        )
        row["ms"] = ms
        row["fused_over_plain"] = ms["fused"] / ms["coda"]
        if "fused_rows" in ms:
            row["fused_rows_over_plain"] = ms["fused_rows"] / ms["coda"]
        row["gemm_then_cast_over_fused"] = ms["gemm_then_cast"] / ms["fused"]
        if "split" in ms:
            row["split_over_plain"] = ms["split"] / ms["coda"]
        sec["fused_rows"].append(row)
        print(
            f"fp8 fused {model:10s} M={m:5d} {program} {proj:11s} "
            + " ".join(f"{v}={t:.3f}ms" for v, t in ms.items())
            + f" fused/plain={row['fused_over_plain']:.3f}",
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


def run_shape(model, m, sec, progress, fused_only=False, programs=None):
    if model not in MODELS:  # the paper's shapes have no FP8 rows
        return
    sec.setdefault("cast_rows", [])
    sec.setdefault("fused_rows", [])
    if not fused_only:
        gemm_rows(model, m, sec, progress)
    fused_rows(model, m, sec, progress, programs)
    if not fused_only:
        cast_rows(model, m, sec, progress)
