"""The blockwise FP8 ops of torch/fp8_ops.cpp on a Hopper GPU: the casts bit for bit against the
CPU reference recipe, the FP8 GEMMs and the programs whose epilogue quantizes their output (F1,
F2, B1, B2) against the recipe in fp64, their error against the unfused PyTorch recipe's, and bad
arguments. Skipped without an sm_90 GPU (CI has none; scripts/gpu-check runs these on the H200)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda  # noqa: F401  (loads the extension: torch.ops.coda)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU",
)
CODA = torch.ops.coda
EPS = 1e-5
BF16 = torch.bfloat16


# ---- Blockwise FP8 (torch/fp8_ops.cpp): the CUDA kernels against the CPU reference recipe ----
FP8_SHAPES = [(77, 272, 400), (300, 1040, 2048), (4097, 256, 144)]


def wide_bf16(rows, cols, gen):
    """Values over many binades (each 8x8 patch its own power of two), bf16 on the CPU."""
    e = torch.randint(-24, 9, ((rows + 7) // 8, (cols + 7) // 8), generator=gen)
    e = e.repeat_interleave(8, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
    v = torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1
    return (v * torch.exp2(e.double())).to(BF16)


def same_bits(a, b, what):
    assert a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
    bits = torch.uint8 if a.dtype == torch.float8_e4m3fn else torch.int32
    diff = (a.cpu().contiguous().view(bits) != b.contiguous().view(bits)).sum().item()
    assert diff == 0, f"{what}: {diff} entries differ"


@pytest.mark.parametrize("m,n,k", FP8_SHAPES)
def test_fp8_casts_match_the_cpu_recipe_bit_for_bit(m, n, k):
    gen = torch.Generator().manual_seed(m + k)
    x, w = wide_bf16(m, k, gen), wide_bf16(n, k, gen)
    for name, got, want in zip(
        ["codes", "scales", "codes_t", "scales_t"],
        CODA.fp8_quantize_rows(x.cuda(), True, True),
        CODA.fp8_quantize_rows(x, True, True),
    ):
        same_bits(got, want, f"rows {name}")
    for name, got, want in zip(
        ["codes", "scales", "codes_t", "scales_t"],
        CODA.fp8_quantize_blocks(w.cuda(), True, True),
        CODA.fp8_quantize_blocks(w, True, True),
    ):
        same_bits(got, want, f"blocks {name}")


@pytest.mark.parametrize("n,k", [(16, 16), (272, 400), (80, 1040), (4096, 14336)])
def test_fp8_transpose_blocks_is_the_cast_of_the_transpose(n, k):
    """The CUDA transpose of a weight's codes: byte for byte the CUDA cast's own wᵀ operand
    (ragged N, K; a LLaMA-3-8B down-projection's size), and the CPU op's on the same codes."""
    w = wide_bf16(n, k, torch.Generator().manual_seed(n + k)).cuda()
    codes, scales, want, want_s = CODA.fp8_quantize_blocks(w, True, True)
    codes_t, scales_t = CODA.fp8_transpose_blocks(codes, scales)
    same_bits(codes_t, want.cpu(), "codes_t")
    same_bits(scales_t, want_s.cpu(), "scales_t")
    if n * k <= 1 << 20:
        for got, cpu in zip((codes_t, scales_t), CODA.fp8_transpose_blocks(codes.cpu(),
                                                                           scales.cpu())):
            same_bits(got, cpu, "against the CPU op")


@pytest.mark.parametrize("m,n,k", FP8_SHAPES)
def test_fp8_gemms_match_the_cpu_recipe(m, n, k):
    """Forward, data and weight gradient on the codes the CUDA casts wrote, against the CPU
    recipe's fp64 blockwise sum on the same codes: bf16 rounding plus the tensor cores' fp32
    partial sums per 128 of K."""
    gen = torch.Generator().manual_seed(m * 3 + n)
    x, w, dy = wide_bf16(m, k, gen).cuda(), wide_bf16(n, k, gen).cuda(), wide_bf16(m, n, gen).cuda()
    xc, xs, xtc, xts = CODA.fp8_quantize_rows(x, True, True)
    wc, ws, wtc, wts = CODA.fp8_quantize_blocks(w, True, True)
    dyc, dys, dytc, dyts = CODA.fp8_quantize_rows(dy, True, True)
    dw = torch.zeros(n, k, device="cuda")
    CODA.fp8_gemm_xyt_accumulate_(dw, dytc, dyts, xtc, xts)
    runs = {
        "y": (CODA.fp8_gemm(xc, xs, wc, ws), CODA.fp8_gemm, (xc, xs, wc, ws)),
        "dx": (CODA.fp8_gemm(dyc, dys, wtc, wts), CODA.fp8_gemm, (dyc, dys, wtc, wts)),
        "dw bf16": (
            CODA.fp8_gemm_xyt(dytc, dyts, xtc, xts),
            CODA.fp8_gemm_xyt,
            (dytc, dyts, xtc, xts),
        ),
        "dw fp32 +=": (dw, CODA.fp8_gemm_xyt, (dytc, dyts, xtc, xts)),
    }
    for what, (got, op, args) in runs.items():
        ref = op(*[a.cpu() for a in args])
        err = (got.double().cpu() - ref).abs()
        bound = 2.0**-8 * ref.abs() + 2.0**-10 * ref.abs().max()
        assert torch.isfinite(got).all(), what
        assert (err <= bound).all(), f"{what}: worst {(err / ref.abs().max()).max().item():.3g}"


def test_fp8_gemm_error_against_fp64_within_the_unfused_recipe():
    """docs/math.md §6: the FP8 GEMM's max error against the fp64 product of the unquantized inputs is
    at most 1.5x that of the same recipe unfused in PyTorch (quantize, dequantize, fp32 matmul,
    output rounded to bf16 like ours)."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 1000, 1024, 2048
    x = torch.randn(m, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(BF16)
    exact = x.double() @ w.double().t()
    xc, xs, _, _ = CODA.fp8_quantize_rows(x.cuda())
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w.cuda())
    ours = CODA.fp8_gemm(xc, xs, wc, ws).double().cpu()
    xd = xc.float() * xs.t().repeat_interleave(128, 1)[:, :k]
    wd = wc.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    unfused = (xd @ wd.t()).to(BF16).double().cpu()
    e_ours, e_unfused = (ours - exact).abs().max().item(), (unfused - exact).abs().max().item()
    assert e_ours <= 1.5 * e_unfused, f"ours {e_ours:.4g} vs unfused {e_unfused:.4g}"


@pytest.mark.parametrize("m,n,k", FP8_SHAPES)
def test_fp8_residual_rmsnorm_matches_the_cpu_recipe(m, n, k):
    """F1 over FP8 operands with h quantized in the epilogue, against the CPU op on the same
    codes: x (bf16 rounding, fp32 partial sums), the Σx² partials, and h's codes and scales
    dequantized against x ⊙ γ (e4m3's half step, 2^-4 relative, or the subnormal step). The
    bit-for-bit match with the cast kernel is tests/gpu/fp8_gemm_test.cu's."""
    gen = torch.Generator().manual_seed(m + 7 * n)
    a, w = wide_bf16(m, k, gen).cuda(), wide_bf16(n, k, gen).cuda()
    residual = torch.randn(m, n, generator=gen).to(BF16).cuda()
    gamma = (torch.rand(n, generator=gen) + 0.5).to(BF16).cuda()
    ac, acs, _, _ = CODA.fp8_quantize_rows(a)
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(w)
    x, h, hs, h_t, h_ts, s = CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, residual, gamma,
                                                            True, True)
    # The CPU op in fp64 (residual and γ upcast): x unrounded, as the epilogue holds it.
    args = [t.cpu() for t in (ac, acs, wc, wcs)] + [residual.cpu().double(), gamma.cpu().double()]
    x_ref, _, _, _, _, s_ref = CODA.fp8_gemm_residual_rmsnorm(*args)
    err = (x.double().cpu() - x_ref).abs()
    assert (err <= 2.0**-8 * x_ref.abs() + 2.0**-10 * x_ref.abs().max()).all(), "x"
    torch.testing.assert_close(s.cpu().double(), s_ref, rtol=2e-2, atol=0)
    want = x.double().cpu() * gamma.double().cpu()
    blocks = hs.t().cpu().double().repeat_interleave(128, 1)[:, :n]
    got = h.cpu().double() * blocks
    rel = 2.0**-4 + 2.0**-7  # e4m3's half step, plus x's and h's bf16 roundings
    assert ((got - want).abs() <= rel * want.abs() + 2.0**-9 * blocks).all(), "h"
    blocks_t = h_ts.t().cpu().double().repeat_interleave(128, 1)[:, :m]
    got_t = h_t[:, :m].cpu().double() * blocks_t
    assert ((got_t - want.t()).abs() <= rel * want.t().abs() + 2.0**-9 * blocks_t).all(), "hᵀ"
    assert (h_t[:, m:].cpu().view(torch.uint8) == 0).all()


def fp8_codes_near(codes, scales, want, what):
    """1x128 codes of (rows, cols) dequantized against want (fp64, CPU), within e4m3's half step
    (2^-4 relative, or the subnormal step 2^-9 of the block's scale) of a value that is itself
    within 2^-7 relative + 2^-9 of want's largest entry: twice the FP8 GEMM tolerance of
    tests/gpu (2^-8 + 2^-10), for the epilogue's math after the GEMM (γ up to 1.5, SwiGLU's
    slope) and the output's bf16 rounding before the cast."""
    cols = want.shape[1]
    blocks = scales.t().cpu().double().repeat_interleave(128, 1)[:, :cols]
    got = codes[:, :cols].cpu().double() * blocks
    rel = 2.0**-4 + 2.0**-7
    bound = rel * want.abs() + 2.0**-9 * blocks + 2.0**-9 * want.abs().max()
    assert torch.isfinite(got).all(), what
    assert ((got - want).abs() <= bound).all(), what


def fp8_row_cast_near(outs, want, what):
    """Both copies of a 1x128 cast (codes, scales, codes_t, scales_t) against want (rows, cols);
    the transposed copy's padded tokens hold code 0."""
    codes, scales, codes_t, scales_t = outs
    m = want.shape[0]
    fp8_codes_near(codes, scales, want, what)
    fp8_codes_near(codes_t[:, :m], scales_t, want.t(), f"{what}ᵀ")
    assert (codes_t[:, m:].cpu().view(torch.uint8) == 0).all(), f"{what}ᵀ padding"


@pytest.mark.parametrize("m,inter", [(1, 16), (130, 272), (4097, 144)])
def test_swiglu_quantize_t_matches_the_cpu_op(m, inter):
    """a = silu(g)·u of z recomputed and cast into its transposed copy (fp8_mlp's backward with
    recompute_a): against a in fp64 within fp8_codes_near (the kernel's a is fp32 math rounded to
    bf16, then cast); the padded tokens hold code 0; the scales equal the CPU op's except where
    a block's amax straddles a power of two between the two roundings."""
    gen = torch.Generator().manual_seed(m + inter)
    z = (torch.randn(m, 2 * inter, generator=gen) * 3).to(BF16)
    codes_t, scales_t = CODA.fp8_swiglu_quantize_t(z.cuda())
    gate, up = z.double()[:, 0::2], z.double()[:, 1::2]
    a = gate * torch.sigmoid(gate) * up
    fp8_codes_near(codes_t[:, :m], scales_t, a.t(), "aᵀ")
    assert (codes_t[:, m:].cpu().view(torch.uint8) == 0).all(), "aᵀ padding"
    _, want_s = CODA.fp8_swiglu_quantize_t(z)
    assert (scales_t.cpu() != want_s).float().mean() <= 0.01, "scales"


def fp8_gemm_close(got, ref, what):
    """The FP8 GEMM tolerance of tests/gpu/fp8_programs_test.cpp: bf16 rounding and the tensor
    cores' fp32 partial sums, 2^-8 relative + 2^-10 of the largest entry."""
    err = (got.double().cpu() - ref).abs()
    assert torch.isfinite(got).all(), what
    assert (err <= 2.0**-8 * ref.abs() + 2.0**-10 * ref.abs().max()).all(), what


F2_FP8_SHAPES = [(77, 288, 400), (300, 1056, 2048), (4097, 256, 144)]  # (M, 2I, K), 2I % 32 == 0


@pytest.fixture(params=["fused", "split"])
def placement(request):
    """Each FP8 program with an elementwise half run both ways: in the GEMM's epilogue and as a
    pass of its own after the plain GEMM (coda.set_fp8_epilogue)."""
    old = CODA.set_fp8_epilogue(request.param)
    yield request.param
    CODA.set_fp8_epilogue(old)


@pytest.mark.parametrize("m,two_i,k", F2_FP8_SHAPES)
def test_fp8_rmsnorm_swiglu_with_fp8_z_matches_the_cpu_recipe(m, two_i, k, placement):
    """F2 with z saved in FP8, fused or split, against the CPU op in fp64 on the same codes: z's
    codes (rows) and a's (both copies) dequantized against the CPU's z and silu(z_g) · z_u. The
    bit-for-bit match with the recipe's cast of the kernel's own bf16 values is
    tests/gpu/fp8_programs_test.cpp's."""
    gen = torch.Generator().manual_seed(m + 9 * two_i)
    h, w = wide_bf16(m, k, gen).cuda(), wide_bf16(two_i, k, gen).cuda()
    r = (torch.rand(m, generator=gen) + 0.5).cuda()
    hc, hs, _, _ = CODA.fp8_quantize_rows(h)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w)
    zc, zs, *a = CODA.fp8_gemm_rmsnorm_swiglu_fp8_z(hc, hs, wc, ws, r, True, True)
    args = [t.cpu() for t in (hc, hs, wc, ws)] + [r.cpu().double()]
    z_ref = CODA.fp8_gemm_rmsnorm_swiglu(*args, dtype=torch.float64)[0]
    fp8_codes_near(zc, zs, z_ref, "z")
    fp8_row_cast_near(a, F.silu(z_ref[:, 0::2]) * z_ref[:, 1::2], "a")


@pytest.mark.parametrize("m,two_i,k", F2_FP8_SHAPES)
def test_fp8_rmsnorm_swiglu_matches_the_cpu_recipe(m, two_i, k):
    """F2 over FP8 operands with a quantized in the epilogue, against the CPU op in fp64 on the
    same codes: z by the FP8 GEMM tolerance, a's codes (both copies) dequantized against
    silu(z_g) · z_u from the CPU's z. The bit-for-bit match of the codes with the recipe's cast of
    the kernel's bf16 a is tests/gpu/fp8_programs_test.cpp's."""
    gen = torch.Generator().manual_seed(m + 5 * two_i)
    h, w = wide_bf16(m, k, gen).cuda(), wide_bf16(two_i, k, gen).cuda()
    r = (torch.rand(m, generator=gen) + 0.5).cuda()
    hc, hs, _, _ = CODA.fp8_quantize_rows(h)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w)
    z, *a = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, True, True)
    assert z.dtype == BF16 and z.shape == (m, two_i)
    args = [t.cpu() for t in (hc, hs, wc, ws)] + [r.cpu().double()]
    z_ref = CODA.fp8_gemm_rmsnorm_swiglu(*args, dtype=torch.float64)[0]
    fp8_gemm_close(z, z_ref, "z")
    a_ref = F.silu(z_ref[:, 0::2]) * z_ref[:, 1::2]
    fp8_row_cast_near(a, a_ref, "a")


B1_FP8_SHAPES = [(77, 272, 400), (300, 1040, 2048), (4097, 256, 144)]  # (M, H, K)


@pytest.mark.parametrize("m,hidden,k", B1_FP8_SHAPES)
def test_fp8_rmsnorm_backward_matches_the_cpu_recipe(m, hidden, k, placement):
    """B1 over FP8 operands with h_out's transposed copy quantized, fused or split, against the
    recipe on the same codes (w_t: the transposed copy of W's blocks): dx and the dγ partials (the
    columns < H the kernel defines) against their formulas in fp64 on the CPU's g = dz · W
    (fp8_gemm; split: the device's plain GEMM's bf16 g, itself checked against the CPU's) by the
    FP8 GEMM tolerance, the fused ones also against the CPU op; h_out = x·r·γ's copy dequantized
    against the CPU's (e4m3's half step). The bit-for-bit match with the cast of the kernel's own bf16 h_out is
    tests/gpu/fp8_programs_test.cpp's."""
    gen = torch.Generator().manual_seed(m + 11 * hidden)
    dz, w = wide_bf16(m, k, gen).cuda(), wide_bf16(k, hidden, gen).cuda()
    x = torch.randn(m, hidden, generator=gen).to(BF16).cuda()
    r = (torch.rand(m, generator=gen) + 0.5).cuda()
    gamma = (torch.rand(hidden, generator=gen) + 0.5).to(BF16).cuda()
    zdz = (torch.randn(m, generator=gen) * 0.1).cuda()
    dres = torch.randn(m, hidden, generator=gen).to(BF16).cuda()
    dzc, dzs, _, _ = CODA.fp8_quantize_rows(dz)
    _, _, wtc, wts = CODA.fp8_quantize_blocks(w, False, True)
    dx, ht, hts, s = CODA.fp8_gemm_rmsnorm_backward(dzc, dzs, wtc, wts, x, r, gamma, zdz, dres)
    assert dx.dtype == BF16 and s.dtype == torch.float32
    args = [t.cpu() for t in (dzc, dzs, wtc, wts)] + [
        t.cpu().double() for t in (x, r, gamma, zdz, dres)
    ]
    dx_cpu, _, _, s_cpu = CODA.fp8_gemm_rmsnorm_backward(*args)
    assert s.shape == s_cpu.shape
    g = CODA.fp8_gemm(*args[:4])  # fp64 on the CPU
    if placement == "split":
        # The pass reads the plain GEMM's bf16 g: the device's own (its fp32 sums can round to
        # the bf16 neighbour of the fp64 value's rounding, which dx's cancellation amplifies).
        g_dev = CODA.fp8_gemm(dzc, dzs, wtc, wts).cpu().double()
        fp8_gemm_close(g_dev, g, "g (the plain GEMM)")
        g = g_dev
    else:
        fp8_gemm_close(dx, dx_cpu, "dx (the CPU op's)")
        fp8_gemm_close(s[:, :hidden], s_cpu[:, :hidden], "dγ partials (the CPU op's)")
    x64, r64, gamma64, zdz64, dres64 = args[4:]
    n = x64 * r64[:, None]
    fp8_gemm_close(dx, dres64 + r64[:, None] * (g * gamma64 - n * zdz64[:, None]), "dx")
    h_ref = n * gamma64
    fp8_codes_near(ht[:, :m], hts, h_ref.t(), "h_outᵀ")
    assert (ht[:, m:].cpu().view(torch.uint8) == 0).all(), "h_outᵀ padding"
    tiles = s.shape[0]
    per_row = torch.nn.functional.pad(g * n, (0, 0, 0, tiles * 128 - m))
    fp8_gemm_close(s[:, :hidden], per_row.view(tiles, 128, hidden).sum(1), "dγ partials")
    # Without dres (None): the norm's gradient alone.
    dx0, _, _, _ = CODA.fp8_gemm_rmsnorm_backward(dzc, dzs, wtc, wts, x, r, gamma, zdz, None)
    fp8_gemm_close(dx0, r64[:, None] * (g * gamma64 - n * zdz64[:, None]), "dx without dres")


B2_FP8_SHAPES = [(77, 272, 400), (300, 1040, 2048), (4097, 200, 144)]  # (M, I, H)


@pytest.mark.parametrize("m,inter,hidden", B2_FP8_SHAPES)
def test_fp8_swiglu_backward_matches_the_cpu_recipe(m, inter, hidden, placement):
    """B2 over FP8 operands with dz quantized, fused or split, against the CPU recipe on the same
    codes: dz's codes (both copies) dequantized against dSwiGLU of the CPU's fp64 da = dx_out ·
    W_down (fp8_gemm), and the ZdZ partials (the rows < M the kernel defines) against Σ g·dg +
    u·du per tile of da (128 columns fused, 64 split) in fp64 by the FP8 GEMM tolerance, from
    that da, or split from da rounded to bf16 as the plain GEMM writes it."""
    gen = torch.Generator().manual_seed(m + 13 * inter)
    dx_out, w_t = wide_bf16(m, hidden, gen).cuda(), wide_bf16(inter, hidden, gen).cuda()
    z = (torch.randn(m, 2 * inter, generator=gen) * 2).to(BF16).cuda()
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(dx_out)
    wtc, wts, _, _ = CODA.fp8_quantize_blocks(w_t)  # W_downᵀ (I, H)
    *q, s = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, z, True, True)
    assert s.dtype == torch.float32
    ops_cpu = [t.cpu() for t in (dxc, dxs, wtc, wts)]
    s_cpu = CODA.fp8_gemm_swiglu_backward(*ops_cpu, z.cpu().double())[-1]
    # Fused: per 128 columns of da, as the CPU program's; split: per 64 (the pass's 128 of dz).
    width = 128 if placement == "fused" else 64
    assert s.shape == (-(-inter // width), s_cpu.shape[1])
    da = CODA.fp8_gemm(*ops_cpu)  # fp64 on the CPU
    gate, up = z.cpu().double()[:, 0::2], z.cpu().double()[:, 1::2]
    sig = torch.sigmoid(gate)
    dz_ref = torch.stack([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], 2).flatten(1)
    fp8_row_cast_near(q, dz_ref, "dz")
    da_used = da if placement == "fused" else da.to(BF16).double()
    dg, du = da_used * up * sig * (1 + gate * (1 - sig)), da_used * gate * sig
    tiles = s.shape[0]
    pair_dot = torch.nn.functional.pad(gate * dg + up * du, (0, tiles * width - inter))
    s_ref = pair_dot.view(m, tiles, width).sum(2).t()
    fp8_gemm_close(s[:, :m], s_ref, "ZdZ partials")


def test_fp8_bad_arguments_on_cuda():
    x = torch.randn(19, 32, device="cuda").to(BF16)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16, got Float"):
        CODA.fp8_quantize_rows(x.float())
    xc, xs, _, _ = CODA.fp8_quantize_rows(x)
    with pytest.raises(RuntimeError, match=r"must be on cuda:0, got cuda:0 and cpu"):
        CODA.fp8_gemm(xc, xs.cpu(), xc, xs)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(torch.randn(24, 32, device="cuda").to(BF16))
    with pytest.raises(RuntimeError, match=r"N must be a multiple of 8"):
        CODA.fp8_gemm(xc, xs, wc[:20], ws)
