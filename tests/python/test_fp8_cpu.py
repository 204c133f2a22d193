"""The blockwise FP8 ops (torch/fp8_ops.cpp) on the CPU, where they run the reference recipe,
against the recipe written out independently in plain PyTorch: the block scale as the smallest
power of two p with amax <= 448·p (found by search, not by the bit rule the functor uses), the
codes by torch's own float8_e4m3fn cast, the GEMM as the fp64 matmul of the dequantized
operands."""

from __future__ import annotations

import pytest
import torch

import coda  # noqa: F401  (loads the extension: torch.ops.coda)

CODA = torch.ops.coda
E4M3 = torch.float8_e4m3fn


def wide(rows, cols, g):
    """bf16 values over many binades: each 8x8 patch scaled by its own power of two."""
    e = torch.randint(-24, 9, ((rows + 7) // 8, (cols + 7) // 8), generator=g)
    e = e.repeat_interleave(8, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
    v = (torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2 - 1) * torch.exp2(e.double())
    v[0, 0] = 0.0
    return v.to(torch.bfloat16)


def power_of_two_scale(amax):
    """The smallest power of two p (at least 2^-126) with amax <= 448·p; 1 where amax is 0."""
    amax = amax.double()
    p = torch.exp2(torch.floor(torch.log2(torch.where(amax > 0, amax / 448, 1.0))))
    p = torch.where(amax > 448 * p, p * 2, p)  # log2 rounding may land one short
    p = torch.where(amax <= 448 * p / 2, p / 2, p)  # ... or one over
    p = torch.clamp(p, min=2.0**-126)
    return torch.where(amax == 0, torch.ones_like(p), p).float()


def quantize_ref(x, block_rows, block_cols=128):
    """(codes, scales on the block grid) of x in (block_rows, block_cols) blocks, ragged edges."""
    x = x.float()
    rows, cols = x.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    padded = torch.zeros(gr * block_rows, gc * block_cols)
    padded[:rows, :cols] = x.abs()
    amax = padded.view(gr, block_rows, gc, block_cols).amax(dim=(1, 3))
    s = power_of_two_scale(amax)
    full = s.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return (x / full).to(E4M3), s


def dequantize(codes, scales, block_rows, block_cols=128):
    rows, cols = codes.shape
    full = scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return codes.double() * full.double()


def same_codes(a, b, what):
    assert a.dtype == E4M3 and a.shape == b.shape, what
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
    assert diff == 0, f"{what}: {diff} codes differ"


@pytest.fixture
def g():
    return torch.Generator().manual_seed(5)


@pytest.mark.parametrize("m,k", [(1, 16), (19, 272), (300, 144)])
def test_row_cast_matches_the_recipe(m, k, g):
    x = wide(m, k, g)
    codes, scales, codes_t, scales_t = CODA.fp8_quantize_rows(x, True, True)
    want, want_s = quantize_ref(x, 1)
    same_codes(codes, want, "codes")
    assert scales.shape == (-(-k // 128), m) and scales.stride(0) == -(-m // 4) * 4
    assert torch.equal(scales, want_s.t())
    # The transposed copy: 1x128 blocks along the rows of xᵀ, zero codes up to 16-padded tokens.
    want_t, want_ts = quantize_ref(x.t(), 1)
    m16 = -(-m // 16) * 16
    assert codes_t.shape == (k, m16)
    same_codes(codes_t[:, :m], want_t, "codes_t")
    assert (codes_t[:, m:].view(torch.uint8) == 0).all()
    assert torch.equal(scales_t, want_ts.t())


def test_rows_not_asked_for_stay_empty(g):
    x = wide(40, 32, g)
    codes, scales, codes_t, scales_t = CODA.fp8_quantize_rows(x)
    assert codes.shape == (40, 32) and codes_t.numel() == 0 and scales_t.numel() == 0
    codes, scales, codes_t, _ = CODA.fp8_quantize_rows(x, False, True)
    assert codes.numel() == 0 and scales.numel() == 0 and codes_t.shape == (32, 48)


@pytest.mark.parametrize("n,k", [(16, 16), (272, 400), (128, 256)])
def test_block_cast_matches_the_recipe(n, k, g):
    w = wide(n, k, g)
    codes, scales, codes_t, scales_t = CODA.fp8_quantize_blocks(w, True, True)
    want, want_s = quantize_ref(w, 128)
    same_codes(codes, want, "codes")
    assert torch.equal(scales, want_s)
    # wᵀ in the same blocks, transposed.
    same_codes(codes_t, want.t().contiguous(), "codes_t")
    assert torch.equal(scales_t, want_s.t())


def test_nan_spoils_its_blocks_only(g):
    x = wide(130, 256, g)
    x[3, 200] = float("nan")
    codes, scales, codes_t, scales_t = CODA.fp8_quantize_rows(x, True, True)
    assert torch.isnan(scales[1, 3])
    assert torch.isfinite(scales[0, 3]) and torch.isfinite(scales[1, 4])
    assert torch.isnan(codes[3, 128:].float()).all()
    assert torch.isfinite(codes[3, :128].float()).all()
    assert torch.isnan(scales_t[0, 200]) and torch.isfinite(scales_t[1, 200])


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (19, 24, 272), (130, 264, 400)])
def test_gemms_are_the_dequantized_matmul(m, n, k, g):
    x, w, y = wide(m, k, g), wide(n, k, g), wide(n, k, g)
    xc, xs, _, _ = CODA.fp8_quantize_rows(x)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w)
    yc, ys, _, _ = CODA.fp8_quantize_rows(y)
    xd = dequantize(xc, xs.t(), 1)
    ref = xd @ dequantize(wc, ws, 128).t()
    out = CODA.fp8_gemm(xc, xs, wc, ws)
    assert out.dtype == torch.float64 and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())
    ref_xy = xd @ dequantize(yc, ys.t(), 1).t()
    torch.testing.assert_close(
        CODA.fp8_gemm_xyt(xc, xs, yc, ys), ref_xy, rtol=1e-12, atol=1e-12 * ref_xy.abs().max()
    )
    d = torch.randn(m, n, generator=g)
    start = d.clone()
    CODA.fp8_gemm_xyt_accumulate_(d, xc, xs, yc, ys)
    torch.testing.assert_close(d, start + ref_xy.float(), rtol=1e-6, atol=1e-6)


def test_weight_gradient_from_the_transposed_copies(g):
    """dW = dyᵀ·x over tokens from the 128x1 copies; the padded tokens add nothing."""
    m, n, k = 300, 32, 48
    x, dy = wide(m, k, g), wide(m, n, g)
    _, _, xt, xts = CODA.fp8_quantize_rows(x, False, True)
    _, _, dyt, dyts = CODA.fp8_quantize_rows(dy, False, True)
    out = CODA.fp8_gemm_xyt(dyt, dyts, xt, xts)
    ref = dequantize(*quantize_ref(dy.t(), 1), 1) @ dequantize(*quantize_ref(x.t(), 1), 1).t()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def test_bad_arguments_name_what_is_wrong(g):
    x = wide(19, 32, g)
    with pytest.raises(RuntimeError, match=r"quantize_rows: x's columns must be a multiple of 16"):
        CODA.fp8_quantize_rows(wide(19, 24, g))
    with pytest.raises(RuntimeError, match=r"neither rows nor transposed"):
        CODA.fp8_quantize_rows(x, False, False)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \(or float32 / float64 on the CPU"):
        CODA.fp8_quantize_rows(x.to(torch.int32))
    with pytest.raises(RuntimeError, match=r"needs rows a multiple of 16"):
        CODA.fp8_quantize_blocks(x, True, True)
    xc, xs, _, _ = CODA.fp8_quantize_rows(x)
    wc, ws, _, _ = CODA.fp8_quantize_blocks(wide(16, 32, g))
    with pytest.raises(RuntimeError, match=r"fp8_gemm: w must be float8_e4m3fn, got Float"):
        CODA.fp8_gemm(xc, xs, wc.float(), ws)
    with pytest.raises(RuntimeError, match=r"w_scales must have shape \(1, 1\), got \(1, 2\)"):
        CODA.fp8_gemm(xc, xs, wc, torch.ones(1, 2))
    with pytest.raises(RuntimeError, match=r"their K differ"):
        CODA.fp8_gemm(xc, xs, CODA.fp8_quantize_blocks(wide(16, 48, g))[0], ws)
    with pytest.raises(RuntimeError, match=r"d must be a contiguous float32 \(19, 19\)"):
        CODA.fp8_gemm_xyt_accumulate_(torch.zeros(19, 19, dtype=torch.float64), xc, xs, xc, xs)


def f1_fp64(a, a_scales, w, w_scales, residual, gamma):
    """F1 over FP8 operands in fp64 from the dequantized operands: x, h = x ⊙ γ, Σx² per row and
    128-column tile (rows padded to 128 with zeros: the partials' layout)."""
    x = dequantize(a, a_scales.t(), 1) @ dequantize(w, w_scales, 128).t() + residual.double()
    h = x * gamma.double()
    m, n = x.shape
    tiles = -(-n // 128)
    sq = torch.zeros(-(-m // 128) * 128, tiles * 128, dtype=torch.float64)
    sq[:m, :n] = x * x
    return x, h, sq.view(-1, tiles, 128).sum(2).t()


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (19, 272, 144), (130, 400, 272)])
def test_fp8_residual_rmsnorm_is_f1_then_the_cast(m, n, k, g):
    """F1 over FP8 operands: x and the partials are the fp64 formula on the dequantized operands;
    h = x ⊙ γ, and its codes and scales (both copies) are the recipe's cast of that h."""
    a, w = wide(m, k, g), wide(n, k, g)
    ac, acs, _, _ = CODA.fp8_quantize_rows(a)
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(w)
    residual = torch.randn(m, n, generator=g, dtype=torch.float64)
    gamma = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    x, h, hs, h_t, h_ts, s = CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, residual, gamma,
                                                            True, True)
    x_ref, h_ref, s_ref = f1_fp64(ac, acs, wc, wcs, residual, gamma)
    assert x.dtype == torch.float64 and s.dtype == torch.float64
    torch.testing.assert_close(x, x_ref, rtol=1e-12, atol=1e-12 * x_ref.abs().max().item())
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12 * s_ref.abs().max().item())
    torch.testing.assert_close(x * gamma, h_ref, rtol=1e-12, atol=1e-12 * h_ref.abs().max().item())
    # The cast of the op's own h (x ⊙ γ from its x): an fp64 h a rounding away could sit on the
    # other side of an e4m3 tie.
    want, want_s = quantize_ref(x * gamma, 1)
    same_codes(h, want, "h codes")
    assert torch.equal(hs, want_s.t())
    want_t, want_ts = quantize_ref((x * gamma).t(), 1)
    same_codes(h_t[:, :m], want_t, "hᵀ codes")
    assert (h_t[:, m:].view(torch.uint8) == 0).all()
    assert torch.equal(h_ts, want_ts.t())
    assert (hs.stride(0), h_t.shape) == (-(-m // 4) * 4, (n, -(-m // 16) * 16))
    # Folded, the partials give F1's r.
    r = CODA.rmsnorm_fold(s, m, n, 1e-6)
    torch.testing.assert_close(r, torch.rsqrt((x_ref**2).mean(1) + 1e-6), rtol=1e-12, atol=0)


def test_fp8_residual_rmsnorm_in_bf16_rounds_h_before_the_cast(g):
    """With bf16 residual and γ, h is x ⊙ γ rounded to bf16 and then cast, as on CUDA."""
    m, n, k = 40, 144, 160
    ac, acs, _, _ = CODA.fp8_quantize_rows(wide(m, k, g))
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(wide(n, k, g))
    residual = torch.randn(m, n, generator=g).bfloat16()
    gamma = (torch.rand(n, generator=g) + 0.5).bfloat16()
    x, h, hs, _, _, _ = CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, residual, gamma)
    x_ref, h_ref, _ = f1_fp64(ac, acs, wc, wcs, residual, gamma)
    assert x.dtype == torch.bfloat16
    assert torch.equal(x, x_ref.bfloat16())
    want, want_s = CODA.fp8_quantize_rows(h_ref.bfloat16())[:2]
    same_codes(h, want, "h codes")
    assert torch.equal(hs, want_s)


def test_fp8_residual_rmsnorm_bad_arguments(g):
    ac, acs, _, _ = CODA.fp8_quantize_rows(wide(19, 32, g))
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(wide(16, 32, g))
    r, gm = torch.zeros(19, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match=r"residual must be \(19, 16\), got \(19, 32\)"):
        CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, torch.zeros(19, 32), gm)
    with pytest.raises(RuntimeError, match=r"gamma must be a contiguous \(16\) vector"):
        CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, r, torch.ones(16).double())
    with pytest.raises(RuntimeError, match=r"neither rows nor transposed"):
        CODA.fp8_gemm_residual_rmsnorm(ac, acs, wc, wcs, r, gm, False, False)
    with pytest.raises(RuntimeError, match=r"a_scales must have shape \(1, 19\)"):
        CODA.fp8_gemm_residual_rmsnorm(ac, torch.ones(2, 19), wc, wcs, r, gm)
