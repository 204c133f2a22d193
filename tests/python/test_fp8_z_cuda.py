"""z saved in FP8 (fp8_z) on a Hopper GPU: F2's z codes are the cast of the bf16 z that F2 writes
without it; B2, the recomputed aᵀ and fp8_mlp's backward given z's codes are, bit for bit, the
same ops given the decoded z in bf16 (exact there). Skipped without an sm_90 GPU (CI has none;
scripts/gpu-check runs these)."""

from __future__ import annotations

import pytest
import torch

import coda  # noqa: F401  (loads the extension: torch.ops.coda)
from test_fp8_block_cuda import SHAPES, caches, inputs, norm_caches
from test_fp8_ops_cuda import B2_FP8_SHAPES, F2_FP8_SHAPES, same_bits, wide_bf16

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU",
)
CODA = torch.ops.coda
BF16 = torch.bfloat16
EPS = 1e-5


def decoded_bf16(codes, scales):
    """An FP8 z (codes (M, 2I), 1x128 scales (ceil(2I/128), M)) as the bf16 values it stands for."""
    m, n = codes.shape
    full = scales.t().repeat_interleave(128, 1)[:, :n]
    z = codes.float() * full
    assert torch.equal(z.to(BF16).float(), z), "decoded z not exact in bf16"
    return z.to(BF16)


def same_all(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype == torch.float32:
            assert torch.equal(a, b), f"{what}[{i}]"
        else:
            same_bits(a, b.cpu(), f"{what}[{i}]")


@pytest.fixture
def fused():
    """Every epilogue fused. F2 with a bf16 z always is; F2 with z in FP8 runs split under auto
    up to K = 4096, where its z is r·y of the plain GEMM's bf16 y (one more rounding: the split
    pass is tests/gpu/fp8_programs_test.cpp's Fp8RmsnormSwigluSplitPassMatchesTheRecipe)."""
    old = CODA.set_fp8_epilogue("fused")
    yield
    CODA.set_fp8_epilogue(old)


@pytest.mark.parametrize("m,two_i,k", F2_FP8_SHAPES)
def test_f2_z_codes_are_the_cast_of_f2s_z(m, two_i, k, fused):
    gen = torch.Generator().manual_seed(m + 7 * two_i)
    h, w = wide_bf16(m, k, gen).cuda(), wide_bf16(two_i, k, gen).cuda()
    r = (torch.rand(m, generator=gen) + 0.5).cuda()
    hc, hs, _, _ = CODA.fp8_quantize_rows(h)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w)
    z, *a = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, True, True)
    zc, zs, *a_z = CODA.fp8_gemm_rmsnorm_swiglu_fp8_z(hc, hs, wc, ws, r, True, True)
    want_c, want_s, _, _ = CODA.fp8_quantize_rows(z, True, False)
    same_bits(zc, want_c.cpu(), "z codes")
    assert torch.equal(zs, want_s) and zs.stride() == want_s.stride(), "z scales"
    same_all(a_z, a, "a")


@pytest.mark.parametrize("placement", ["fused", "split"])
@pytest.mark.parametrize("m,inter,hidden", B2_FP8_SHAPES)
def test_b2_from_fp8_z_is_b2_of_the_decoded_z(m, inter, hidden, placement):
    gen = torch.Generator().manual_seed(m + 17 * inter)
    dx_out, w_t = wide_bf16(m, hidden, gen).cuda(), wide_bf16(inter, hidden, gen).cuda()
    z = wide_bf16(m, 2 * inter, gen).cuda()  # many binades: the blocks' scales differ
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(dx_out)
    wtc, wts, _, _ = CODA.fp8_quantize_blocks(w_t)
    zc, zs, _, _ = CODA.fp8_quantize_rows(z, True, False)
    old = CODA.set_fp8_epilogue(placement)  # B2 fused, or split after the plain GEMM
    try:
        got = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, zc, True, True, zs)
        want = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, decoded_bf16(zc, zs), True,
                                             True)
    finally:
        CODA.set_fp8_epilogue(old)
    same_all(got[:4], want[:4], "dz")
    assert torch.equal(got[4][:, :m], want[4][:, :m]), "ZdZ partials"
    if inter % 16 == 0:  # the aᵀ cast takes I a multiple of 16 (B2 takes any I)
        a_t = CODA.fp8_swiglu_quantize_t(zc, zs)
        same_all(a_t, CODA.fp8_swiglu_quantize_t(decoded_bf16(zc, zs)), "aᵀ from z")


@pytest.mark.parametrize("recompute_a", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_mlp_with_fp8_z_differentiates_at_the_decoded_z(shape, recompute_a, fused):
    """fp8_mlp(fp8_z=True) on CUDA: the forward's outputs but z are those without it; the
    gradients through autograd equal fp8_mlp_backward's given the decoded z in bf16."""
    p, up, _, _ = inputs(shape, False, seed=5)
    q = caches(p)
    x, gamma, g_next = p["x0"].cuda(), p["gamma_ffn"].cuda(), p["gamma_attn"].cuda()
    v = {n: p[n].cuda().requires_grad_() for n in ("w_gu", "w_down")}
    xg, gg = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    h, hs, r = norm_caches(x, gamma, "cuda")
    args = (xg, gg, v["w_gu"], *q["w_gu"]["cuda"], v["w_down"], *q["w_down"]["cuda"], h, hs, r,
            g_next, EPS, False, True, recompute_a, False)
    plain = CODA.fp8_mlp(*args, False)
    out = CODA.fp8_mlp(*args, True)
    for i in (0, 1, 2, 3, 5, 6):
        same_all((out[i],), (plain[i],), f"output {i}")
    dx_out = up["dx2"].cuda()
    grads = torch.autograd.grad(out[0], [xg, gg, v["w_gu"], v["w_down"]], dx_out)
    gu, dn = q["w_gu"]["cuda"], q["w_down"]["cuda"]
    a_copy = (None, None) if recompute_a else (out[5], out[6])
    want = CODA.fp8_mlp_backward(dx_out, x, gamma, p["w_gu"].cuda(), gu[2], gu[3],
                                 p["w_down"].cuda(), dn[2], dn[3], r,
                                 decoded_bf16(out[4], out[7]), *a_copy)
    for name, a, b in zip(("dx", "dgamma", "dw_gu", "dw_down"), grads, want):
        assert torch.equal(a, b), name
