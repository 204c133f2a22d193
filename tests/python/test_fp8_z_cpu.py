"""z, the MLP's pre-activation, saved for the backward in FP8 (fp8_z) on the CPU: F2's z codes are
the recipe's cast of the z it would have written; B2 and the recomputed aᵀ read the decoded z,
bit for bit what they compute from that z in the activation dtype; fp8_mlp and the model keep
exactly the bytes they should, with the same forward and the gradients of the decoded z."""

from __future__ import annotations

import pytest
import torch

import coda  # noqa: F401  (loads the extension: torch.ops.coda)
from test_fp8_block_cpu import mlp_args, small_case, tiny_batch, tiny_models
from test_fp8_cpu import g  # noqa: F401  (the generator fixture)
from test_fp8_cpu import (B2_SHAPES, E4M3, F2_SHAPES, b2_inputs, dequantize, raises, same_cast,
                          same_codes, wide)
from test_fp8_memory_cpu import train_step

CODA = torch.ops.coda
BF16, F64 = torch.bfloat16, torch.float64


def decoded(codes, scales):
    """An FP8 z's values (fp64, exact): codes (M, 2I) times their 1x128 blocks' scales."""
    return dequantize(codes, scales.t(), 1)


def fp8_z_of(z):
    """z (M, 2I) as F2 saves it with fp8_z: its 1x128 codes and scales."""
    codes, scales, _, _ = CODA.fp8_quantize_rows(z, True, False)
    return codes, scales


@pytest.mark.parametrize("dtype", [BF16, F64])
@pytest.mark.parametrize("m,two_i,k", F2_SHAPES)
def test_f2_with_fp8_z_is_f2_then_the_cast_of_z(m, two_i, k, dtype, g):
    """fp8_gemm_rmsnorm_swiglu_fp8_z: z's codes and scales are fp8_quantize_rows of the z that
    fp8_gemm_rmsnorm_swiglu returns (rounded to the dtype first), bit for bit, scales' strides
    included; a's outputs are that op's."""
    hc, hs, _, _ = CODA.fp8_quantize_rows(wide(m, k, g))
    wc, ws, _, _ = CODA.fp8_quantize_blocks(wide(two_i, k, g))
    r = torch.rand(m, generator=g, dtype=F64) + 0.5
    z, *a = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, True, True, dtype=dtype)
    zc, zs, *a_z = CODA.fp8_gemm_rmsnorm_swiglu_fp8_z(hc, hs, wc, ws, r, True, True, dtype=dtype)
    want = CODA.fp8_quantize_rows(z, True, False)
    same_codes(zc, want[0], "z codes")
    assert torch.equal(zs, want[1]) and zs.stride() == want[1].stride(), "z scales"
    same_cast(a_z, a, "a")
    # Without a's rows: z's outputs still come; a's copy alone.
    zc2, _, codes, scales, codes_t, _ = CODA.fp8_gemm_rmsnorm_swiglu_fp8_z(hc, hs, wc, ws, r,
                                                                          False, True,
                                                                          dtype=dtype)
    same_codes(zc2, zc, "z codes without a's rows")
    assert codes.numel() == 0 and scales.numel() == 0
    same_codes(codes_t, a[2], "a_t alone")


@pytest.mark.parametrize("m,inter,hidden", B2_SHAPES)
def test_b2_with_fp8_z_is_b2_of_the_decoded_z(m, inter, hidden, g):
    """fp8_gemm_swiglu_backward given z's codes and scales: every output (dz's codes and scales,
    both copies, and the ZdZ partials) equals the op's given the decoded z in bf16 (exact there),
    and, with dtype=float64, given the decoded z in fp64."""
    dxc, dxs, wtc, wts, _ = b2_inputs(m, inter, hidden, g, BF16)
    zc, zs = fp8_z_of(wide(m, 2 * inter, g))  # many binades: the blocks' scales differ
    z_dec = decoded(zc, zs)
    assert torch.equal(z_dec.to(BF16).double(), z_dec), "decoded z not exact in bf16"
    for dtype, z_plain in ((BF16, z_dec.to(BF16)), (F64, z_dec)):
        got = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, zc, True, True, zs, dtype)
        want = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, z_plain, True, True)
        same_cast(got[:4], want[:4], f"dz ({dtype})")
        assert torch.equal(got[4], want[4]), f"ZdZ partials ({dtype})"


@pytest.mark.parametrize("m,inter", [(1, 16), (37, 272), (130, 128)])
def test_recomputed_a_copy_from_fp8_z_is_that_of_the_decoded_z(m, inter, g):
    """fp8_swiglu_quantize_t(z codes, z_scales): a's copy equals the op's from the decoded z in
    bf16; its Meta kernel gives the same shapes, strides and dtypes."""
    zc, zs = fp8_z_of(wide(m, 2 * inter, g))  # many binades: the blocks' scales differ
    got = CODA.fp8_swiglu_quantize_t(zc, zs)
    want = CODA.fp8_swiglu_quantize_t(decoded(zc, zs).to(BF16))
    same_codes(got[0], want[0], "a_t codes")
    assert torch.equal(got[1], want[1]), "a_t scales"
    fn = CODA.fp8_swiglu_quantize_t.default
    torch.library.opcheck(fn, (zc, zs), test_utils=("test_faketensor",))
    for meta, real in zip(fn(zc.to("meta"), zs.to("meta")), got):
        assert (meta.shape, meta.stride(), meta.dtype) == (real.shape, real.stride(), real.dtype)


def test_fp8_z_bad_arguments_name_what_is_wrong(g):
    dxc, dxs, wtc, wts, z = b2_inputs(19, 16, 32, g, BF16)
    zc, zs = fp8_z_of(z)
    b2 = CODA.fp8_gemm_swiglu_backward
    with raises(r"swiglu_backward: pass z_scales exactly when z is float8_e4m3fn .* without"):
        b2(dxc, dxs, wtc, wts, zc)
    with raises(r"swiglu_backward: pass z_scales exactly when z is float8_e4m3fn .* with"):
        b2(dxc, dxs, wtc, wts, z, True, True, zs)
    with raises(r"swiglu_backward: z_scales must have shape \(1, 19\), got \(1, 18\)"):
        b2(dxc, dxs, wtc, wts, zc, True, True, zs[:, :18])
    with raises(r"swiglu_backward: z must be \(19, 32\), got \(18, 32\)"):
        b2(dxc, dxs, wtc, wts, zc[:18], True, True, zs[:, :18])
    with raises(r"swiglu_backward: z_scales must be float32, got Double"):
        b2(dxc, dxs, wtc, wts, zc, True, True, zs.double())
    with raises(r"dtype must be bfloat16 \(or float32 / float64 on the CPU\), got Half"):
        b2(dxc, dxs, wtc, wts, zc, True, True, zs, torch.float16)
    with raises(r"dtype \(Float\) applies to an FP8 z; the outputs round to z's dtype BFloat16"):
        b2(dxc, dxs, wtc, wts, z, True, True, None, torch.float32)
    with raises(r"swiglu_quantize_t: pass z_scales exactly when z is float8_e4m3fn"):
        CODA.fp8_swiglu_quantize_t(zc)
    with raises(r"swiglu_quantize_t: pass z_scales exactly when z is float8_e4m3fn"):
        CODA.fp8_swiglu_quantize_t(zc.to("meta"))
    case = small_case()
    p, _, _, cache, (x1, _, _, r1) = case
    out = CODA.fp8_mlp(*mlp_args(case), False, True, False, False, True)
    zc, zs = out[4], out[7]
    common = (torch.randn_like(x1), x1, p["gamma_ffn"], p["w_gu"], *cache["w_gu"][2:],
              p["w_down"], *cache["w_down"][2:], r1)
    with raises(r"fp8_mlp_backward: z must be Double, got Float8_e4m3fn"):
        CODA.fp8_mlp_backward(*common, zc, out[5], out[6])
    with raises(r"fp8_mlp_backward: z_scales must have shape \(1, 19\), got \(1, 18\)"):
        CODA.fp8_mlp_backward(*common, zc, out[5], out[6], zs[:, :18])


def test_fp8_mlp_with_fp8_z_saves_z_codes_and_differentiates_at_the_decoded_z():
    """fp8_mlp(fp8_z=True): every output but z as without it; z is the cast of that z (fp64
    here) with z_scales. fp8_mlp_backward given the codes equals it given the decoded z, bit for
    bit, with a's kept copy and with a's copy made from z."""
    case = small_case()
    args = mlp_args(case)
    kept = CODA.fp8_mlp(*args)
    out = CODA.fp8_mlp(*args, False, True, False, False, True)
    assert kept[7].numel() == 0, "z_scales without fp8_z"
    for i in (0, 1, 2, 3, 5, 6):
        a, b = out[i], kept[i]
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b), i
    zc, zs = out[4], out[7]
    want_c, want_s = fp8_z_of(kept[4])
    same_codes(zc, want_c, "z codes")
    assert torch.equal(zs, want_s), "z scales"
    p, _, _, cache, (x1, _, _, r1) = case
    common = (torch.randn_like(x1), x1, p["gamma_ffn"], p["w_gu"], *cache["w_gu"][2:],
              p["w_down"], *cache["w_down"][2:], r1)
    for a_copy in ((out[5], out[6]), (None, None)):
        got = CODA.fp8_mlp_backward(*common, zc, *a_copy, zs)
        want = CODA.fp8_mlp_backward(*common, decoded(zc, zs), *a_copy)
        for name, a, b in zip(("dx", "dgamma", "dw_gu", "dw_down"), got, want):
            assert torch.equal(a, b), name


def test_model_with_fp8_z_trains_on_the_decoded_z_and_keeps_less():
    """CodaLlamaForCausalLM.fp8_z: the same loss (z's codes feed only the backward), gradients
    within the e4m3 rounding of z of the unquantized z's (normwise), and exactly z's bytes less
    kept per layer: 2I values of 8 bytes (fp64 here) for 2I codes and ceil(2I/128) fp32 scales
    a token. With fp8_recompute_a as well, a's copy less again."""
    _, fp8, _ = tiny_models()
    ids, labels = tiny_batch()
    kept = train_step(fp8, ids, labels)
    fp8.fp8_z = True
    assert all(layer.fp8_z for layer in fp8.layers)
    got = train_step(fp8, ids, labels)
    assert torch.equal(got[0], kept[0]), "the forward changed"
    errs = {n: ((got[1][n] - g).norm() / g.norm()).item() for n, g in kept[1].items()}
    # e4m3 keeps 3 mantissa bits (z within 2^-4 relative): 5% here, 0.1 is the bound.
    assert max(errs.values()) < 0.1, errs
    assert errs["layers.0.w_gu"] > 0, "the backward did not read the FP8 z"
    m, two_i = ids.numel(), 2 * fp8.config.intermediate_size
    z_bytes = m * two_i * 8 - (m * two_i + 4 * m * (-(-two_i // 128)))
    assert kept[2] - got[2] == len(fp8.layers) * z_bytes, (kept[2], got[2])
    fp8.fp8_recompute_a = True
    both = train_step(fp8, ids, labels)
    assert torch.equal(both[0], kept[0])
    inter = two_i // 2
    a_copy = inter * ((m + 15) // 16 * 16) + 4 * inter * ((m + 127) // 128)
    assert got[2] - both[2] == len(fp8.layers) * a_copy, (got[2], both[2])
