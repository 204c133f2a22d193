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


@pytest.mark.parametrize("rows,transposed", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("op", ["fp8_quantize_rows", "fp8_quantize_blocks"])
def test_cast_meta_kernels_match_the_cpu_kernels(op, rows, transposed, g):
    """The casts' Meta kernels (torch.compile traces the model's casts through them) give every
    output's shape, stride and dtype the CPU kernel gives (opcheck's fake-tensor check, with
    ragged rows: scales padded to 4, the row cast's copy to 16 tokens), and bad input raises
    there as on the CPU."""
    x = wide(208 if op.endswith("blocks") else 37, 272, g)
    fn = getattr(CODA, op).default
    torch.library.opcheck(fn, (x, rows, transposed), test_utils=("test_faketensor",))
    on_meta = fn(x.to("meta"), rows, transposed)
    for got, want in zip(on_meta, fn(x, rows, transposed)):
        assert got.device.type == "meta"
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fn(torch.empty(37, 40, device="meta"), rows, transposed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,inter", [(1, 16), (37, 272), (130, 128)])
def test_swiglu_quantize_t_is_the_cast_of_a(m, inter, dtype, g):
    """fp8_swiglu_quantize_t(z): a = silu(g)·u of z's interleaved pairs, in fp64, rounded to z's
    dtype, then fp8_quantize_rows' transposed copy of it (ragged tokens: the copy padded to 16,
    scales per 128 tokens); its Meta kernel gives the same shapes, strides and dtypes."""
    z = (torch.randn(m, 2 * inter, generator=g, dtype=torch.float64) * 3).to(dtype)
    codes_t, scales_t = CODA.fp8_swiglu_quantize_t(z)
    gate, up = z.double()[:, 0::2], z.double()[:, 1::2]
    a = (gate * (1 / (1 + torch.exp(-gate))) * up).to(dtype)  # epilogue::SwiGlu's order
    _, _, want_t, want_ts = CODA.fp8_quantize_rows(a, False, True)
    assert torch.equal(codes_t.view(torch.uint8), want_t.view(torch.uint8))
    assert torch.equal(scales_t, want_ts)
    fn = CODA.fp8_swiglu_quantize_t.default
    torch.library.opcheck(fn, (z,), test_utils=("test_faketensor",))
    for got, want in zip(fn(z.to("meta")), (codes_t, scales_t)):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    with pytest.raises(RuntimeError, match=r"z's columns \(2I\) must be a multiple of 32"):
        CODA.fp8_swiglu_quantize_t(torch.zeros(4, 48, dtype=dtype))


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


@pytest.mark.parametrize("n,k", [(16, 16), (272, 400), (80, 1040)])
def test_block_transpose_is_the_cast_of_the_transpose(n, k, g):
    """fp8_transpose_blocks(codes, scales) of w's cast is the cast's own wᵀ operand, byte for
    byte (ragged: N, K multiples of 16, not of 128); its Meta kernel gives the same layouts."""
    w = wide(n, k, g)
    codes, scales, _, _ = CODA.fp8_quantize_blocks(w)
    _, _, want, want_s = CODA.fp8_quantize_blocks(w, False, True)
    codes_t, scales_t = CODA.fp8_transpose_blocks(codes, scales)
    same_codes(codes_t, want, "codes_t")
    assert torch.equal(scales_t, want_s) and scales_t.stride() == want_s.stride()
    torch.library.opcheck(CODA.fp8_transpose_blocks.default, (codes, scales),
                          test_utils=("test_faketensor",))
    for got, real in zip(CODA.fp8_transpose_blocks(codes.to("meta"), scales.to("meta")),
                         (codes_t, scales_t)):
        assert (got.device.type, got.shape, got.stride(), got.dtype) == (
            "meta", real.shape, real.stride(), real.dtype)


def test_block_transpose_bad_arguments(g):
    codes, scales, _, _ = CODA.fp8_quantize_blocks(wide(32, 144, g))
    op = CODA.fp8_transpose_blocks
    with pytest.raises(RuntimeError, match=r"codes must be float8_e4m3fn, got Float"):
        op(codes.float(), scales)
    with pytest.raises(RuntimeError, match=r"N and K positive multiples of 16, got \(24, 144\)"):
        op(codes[:24], scales)
    with pytest.raises(RuntimeError, match=r"scales must have shape \(1, 2\) for codes of shape "
                                           r"\(32, 144\), got \(2, 1\)"):
        op(codes, scales.t().contiguous())
    with pytest.raises(RuntimeError, match=r"codes must be contiguous"):
        op(torch.cat([codes.view(torch.uint8)] * 2, 1).view(E4M3)[:, :144], scales)
    with pytest.raises(RuntimeError, match=r"scales must be float32, got Double"):
        op(codes, scales.double())


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
    with pytest.raises(RuntimeError, match=r"d must be a contiguous float32 \(19, 19\) tensor on "
                                           r"cpu, got Double \(19, 19\) with strides \(19, 1\)"):
        CODA.fp8_gemm_xyt_accumulate_(torch.zeros(19, 19, dtype=torch.float64), xc, xs, xc, xs)
    with pytest.raises(RuntimeError, match=r"got Float \(19, 19\) with strides \(1, 19\)"):
        CODA.fp8_gemm_xyt_accumulate_(torch.zeros(19, 19).t(), xc, xs, xc, xs)
    # each op's messages use its own schema's names
    with pytest.raises(RuntimeError, match=r"fp8_quantize_blocks: w's columns must be a multiple"):
        CODA.fp8_quantize_blocks(wide(32, 40, g))
    with pytest.raises(RuntimeError, match=r"fp8_gemm_xyt: y_scales must be float32, got Double"):
        CODA.fp8_gemm_xyt(xc, xs, xc, xs.double())
    with pytest.raises(RuntimeError, match=r"fp8_gemm_xyt: x is \(19, 32\) and y is \(19, 16\)"):
        CODA.fp8_gemm_xyt(xc, xs, *CODA.fp8_quantize_rows(wide(19, 16, g))[:2])
    with pytest.raises(RuntimeError, match=r"fp8_swiglu_quantize_t: z must be a matrix, got 3 "):
        CODA.fp8_swiglu_quantize_t(torch.randn(4, 2, 64, dtype=torch.float64))


def per_row_partials(v):
    """Row sums of v (M, N) over each 128-column tile, in PartialLayout::per_row(M, N, 128, 128):
    (tiles, M rounded up to 128), padding rows 0."""
    m, n = v.shape
    tiles = -(-n // 128)
    p = torch.zeros(-(-m // 128) * 128, tiles * 128, dtype=torch.float64)
    p[:m, :n] = v
    return p.view(-1, tiles, 128).sum(2).t()


def per_column_partials(v):
    """Column sums of v (M, N) over each 128-row tile, in PartialLayout::per_column(M, N, 128,
    128): (tiles, N rounded up to 128), padding columns 0."""
    m, n = v.shape
    tiles = -(-m // 128)
    p = torch.zeros(tiles * 128, -(-n // 128) * 128, dtype=torch.float64)
    p[:m, :n] = v
    return p.view(tiles, 128, -1).sum(1)


def f1_fp64(a, a_scales, w, w_scales, residual, gamma):
    """F1 over FP8 operands in fp64 from the dequantized operands: x, h = x ⊙ γ, Σx² per row and
    128-column tile (rows padded to 128 with zeros: the partials' layout)."""
    x = dequantize(a, a_scales.t(), 1) @ dequantize(w, w_scales, 128).t() + residual.double()
    h = x * gamma.double()
    return x, h, per_row_partials(x * x)


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


# ---- F2's a, B1's h_outᵀ, B2's dz quantized in the epilogue ------------------------------------
def raises(pattern):
    return pytest.raises(RuntimeError, match=pattern)


def check_row_cast(outs, v, what):
    """outs = (codes, scales, codes_t, scales_t) are quantize_ref of v (rows, cols) and of vᵀ in
    fp8_quantize_rows' layouts: scales' row stride rows rounded up to 4, the transposed codes'
    rows padded to 16 tokens with code 0."""
    codes, scales, codes_t, scales_t = outs
    m, n = v.shape
    want, want_s = quantize_ref(v, 1)
    same_codes(codes, want, f"{what} codes")
    assert scales.shape == (-(-n // 128), m) and scales.stride(0) == -(-m // 4) * 4, what
    assert torch.equal(scales, want_s.t()), f"{what} scales"
    want_t, want_ts = quantize_ref(v.t(), 1)
    assert codes_t.shape == (n, -(-m // 16) * 16), f"{what}ᵀ shape {tuple(codes_t.shape)}"
    same_codes(codes_t[:, :m], want_t, f"{what}ᵀ codes")
    assert (codes_t[:, m:].view(torch.uint8) == 0).all(), f"{what}ᵀ padding"
    assert torch.equal(scales_t, want_ts.t()), f"{what}ᵀ scales"


def same_cast(outs, want, what):
    """Two (codes, scales, codes_t, scales_t) tuples, bit for bit (scales' strides included)."""
    for name, a, b in zip(["codes", "scales", "codes_t", "scales_t"], outs, want):
        if a.dtype == E4M3:
            same_codes(a, b, f"{what} {name}")
        else:
            assert torch.equal(a, b) and a.stride() == b.stride(), f"{what} {name}"


def close64(got, want, what):
    """fp64 algebra: the op's fp64 result against the formula's, to 1e-12 of the largest entry."""
    assert got.dtype == torch.float64 and got.shape == want.shape, what
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item(),
                               msg=what)


def f2_fp64(h, h_scales, w_gu, w_gu_scales, r):
    """F2 on the dequantized operands: z = r ⊙ (h · w_guᵀ), a = silu(z_g) · z_u with gate / up in
    the even / odd columns."""
    z = dequantize(h, h_scales.t(), 1) @ dequantize(w_gu, w_gu_scales, 128).t()
    z = z * r.double()[:, None]
    return z, torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]


F2_SHAPES = [(1, 32, 16), (19, 288, 144), (130, 416, 272)]  # (M, 2I, K): I = 16, 144, 208


@pytest.mark.parametrize("m,two_i,k", F2_SHAPES)
def test_fp8_rmsnorm_swiglu_is_f2_then_the_cast(m, two_i, k, g):
    """F2 over FP8 operands in fp64 (dtype=float64): z is the formula on the dequantized operands,
    and a's codes and scales (both copies) are the recipe's cast of silu(z_g) · z_u from the op's
    own z (a itself is not an output)."""
    hc, hs, _, _ = CODA.fp8_quantize_rows(wide(m, k, g))
    wc, ws, _, _ = CODA.fp8_quantize_blocks(wide(two_i, k, g))
    r = torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    z, *a = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, True, True, dtype=torch.float64)
    z_ref, a_ref = f2_fp64(hc, hs, wc, ws, r)
    close64(z, z_ref, "z")
    a_own = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    close64(a_own, a_ref, "a")
    check_row_cast(a, a_own, "a")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rmsnorm_swiglu_rounds_a_to_the_dtype_before_the_cast(dtype, g):
    """With bf16 (the default, as on CUDA) or float32, z is the formula rounded to that dtype and
    a = silu(z_g) · z_u from the unrounded z is rounded to it before the cast: its codes are what
    fp8_quantize_rows writes for that tensor. Outputs not asked for are empty."""
    m, two_i, k = 40, 288, 160
    hc, hs, _, _ = CODA.fp8_quantize_rows(wide(m, k, g))
    wc, ws, _, _ = CODA.fp8_quantize_blocks(wide(two_i, k, g))
    r = torch.rand(m, generator=g) + 0.5
    kwargs = {} if dtype == torch.bfloat16 else {"dtype": dtype}
    z, *a = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, True, True, **kwargs)
    z_ref, a_ref = f2_fp64(hc, hs, wc, ws, r)
    assert z.dtype == dtype
    assert torch.equal(z, z_ref.to(dtype))
    same_cast(a, CODA.fp8_quantize_rows(a_ref.to(dtype), True, True), "a")
    _, codes, scales, codes_t, scales_t = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r, False,
                                                                       True, **kwargs)
    assert codes.numel() == 0 and scales.numel() == 0
    same_codes(codes_t, a[2], "a_t alone")
    assert torch.equal(scales_t, a[3])


def test_fp8_rmsnorm_swiglu_bad_arguments(g):
    hc, hs, _, _ = CODA.fp8_quantize_rows(wide(19, 32, g))
    wc, ws, _, _ = CODA.fp8_quantize_blocks(wide(32, 32, g))
    r = torch.ones(19)
    op = CODA.fp8_gemm_rmsnorm_swiglu
    with raises(r"w_gu's rows \(2I\) must be a multiple of 32 .*got 48"):
        op(hc, hs, *CODA.fp8_quantize_blocks(wide(48, 32, g))[:2], r)
    with raises(r"r must be a contiguous \(19\) vector, got \(18,\)"):
        op(hc, hs, wc, ws, torch.ones(18))
    with raises(r"r must be float32 \(or float64 on the CPU\), got Int"):
        op(hc, hs, wc, ws, r.int())
    with raises(r"dtype must be bfloat16 \(or float32 / float64 on the CPU\), got Half"):
        op(hc, hs, wc, ws, r, dtype=torch.float16)
    with raises(r"rmsnorm_swiglu: neither rows nor transposed"):
        op(hc, hs, wc, ws, r, False, False)
    with raises(r"w_gu_scales must have shape \(1, 1\), got \(1, 2\)"):
        op(hc, hs, wc, torch.ones(1, 2), r)
    with raises(r"h is \(19, 32\) and w_gu is \(32, 48\): their K"):
        op(hc, hs, *CODA.fp8_quantize_blocks(wide(32, 48, g))[:2], r)
    with raises(r"w_gu must be float8_e4m3fn, got Float"):
        op(hc, hs, wc.float(), ws, r)


def b1_fp64(dz, dz_scales, w, w_scales, x, r, gamma, zdz, dres):
    """B1 on the dequantized operands, W (K, H) from its own (row) codes: g = dz · W, n = x·r,
    dx = dres + r·(g·γ − n·ZdZ), h_out = n ⊙ γ, and g·n (whose column sums are dγ)."""
    gr = dequantize(dz, dz_scales.t(), 1) @ dequantize(w, w_scales, 128)
    r, zdz = r.double()[:, None], zdz.double()[:, None]
    n = x.double() * r
    return dres.double() + r * (gr * gamma.double() - n * zdz), n * gamma.double(), gr * n


def check_copy_cast(codes_t, scales_t, v, what):
    """(codes_t, scales_t) are quantize_ref of vᵀ (v (rows, cols)) in fp8_quantize_rows'
    transposed layout: rows padded to 16 tokens with code 0."""
    m, n = v.shape
    want_t, want_ts = quantize_ref(v.t(), 1)
    assert codes_t.shape == (n, -(-m // 16) * 16), f"{what}ᵀ shape {tuple(codes_t.shape)}"
    same_codes(codes_t[:, :m], want_t, f"{what}ᵀ codes")
    assert (codes_t[:, m:].view(torch.uint8) == 0).all(), f"{what}ᵀ padding"
    assert torch.equal(scales_t, want_ts.t()), f"{what}ᵀ scales"


def b1_inputs(m, hidden, k, g, dtype):
    """dz codes (M, K); W (K, H) quantized in 128x128 blocks, its rows and its transposed copy
    (the op's w_t); x, r, γ, ZdZ, dres in dtype (r and ZdZ float32 unless dtype is float64)."""
    dzc, dzs, _, _ = CODA.fp8_quantize_rows(wide(m, k, g))
    wc, ws, wtc, wts = CODA.fp8_quantize_blocks(wide(k, hidden, g), True, True)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(m, hidden, generator=g, dtype=torch.float64).to(dtype)
    r = (torch.rand(m, generator=g, dtype=torch.float64) + 0.5).to(stat)
    gamma = (torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    zdz = (torch.randn(m, generator=g, dtype=torch.float64) * 0.1).to(stat)
    dres = torch.randn(m, hidden, generator=g, dtype=torch.float64).to(dtype)
    return (dzc, dzs, wtc, wts, x, r, gamma, zdz, dres), (wc, ws)


B1_SHAPES = [(1, 16, 16), (19, 272, 144), (130, 400, 272)]  # (M, H, K)


@pytest.mark.parametrize("m,hidden,k", B1_SHAPES)
def test_fp8_rmsnorm_backward_is_b1_then_the_cast(m, hidden, k, g):
    """B1 over FP8 operands in fp64, w_t the transposed copy of W's blocks: dx and the dγ
    partials are the formula with W's own codes; h_out = x·r·γ's transposed copy (the weight
    gradient's operand) is the recipe's cast of the formula's h_out; folded, the partials are
    dγ."""
    args, (wc, ws) = b1_inputs(m, hidden, k, g, torch.float64)
    dx, ht, hts, s = CODA.fp8_gemm_rmsnorm_backward(*args)
    dx_ref, h_ref, gn = b1_fp64(args[0], args[1], wc, ws, *args[4:])
    close64(dx, dx_ref, "dx")
    check_copy_cast(ht, hts, h_ref, "h_out")
    close64(s, per_column_partials(gn), "dγ partials")
    close64(CODA.dgamma_fold(s, hidden), gn.sum(0), "dγ")
    # Without dres (None): dx is the norm's gradient alone; the rest as with it.
    dx0, ht0, hts0, s0 = CODA.fp8_gemm_rmsnorm_backward(*args[:-1], None)
    close64(dx0, dx_ref - args[-1], "dx without dres")
    assert torch.equal(ht0, ht) and torch.equal(hts0, hts) and torch.equal(s0, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rmsnorm_backward_rounds_h_out_to_the_dtype_before_the_cast(dtype, g):
    """With x, dres and γ in bf16 (or float32) dx is the formula rounded to that dtype, h_out's
    copy what fp8_quantize_rows writes for h_out rounded to it; the partials are float32."""
    m, hidden, k = 40, 144, 160
    args, (wc, ws) = b1_inputs(m, hidden, k, g, dtype)
    dx, ht, hts, s = CODA.fp8_gemm_rmsnorm_backward(*args)
    dx_ref, h_ref, gn = b1_fp64(args[0], args[1], wc, ws, *args[4:])
    assert dx.dtype == dtype and s.dtype == torch.float32
    assert torch.equal(dx, dx_ref.to(dtype))
    _, _, want_t, want_ts = CODA.fp8_quantize_rows(h_ref.to(dtype), False, True)
    same_codes(ht, want_t, "h_outᵀ codes")
    assert torch.equal(hts, want_ts)
    want = per_column_partials(gn)
    torch.testing.assert_close(s.double(), want, rtol=2**-23, atol=2**-23 * want.abs().max())


def test_fp8_rmsnorm_backward_bad_arguments(g):
    args, _ = b1_inputs(19, 16, 32, g, torch.float64)
    r, gamma, zdz, dres = args[5:]
    op = CODA.fp8_gemm_rmsnorm_backward

    def call(**changed):
        names = ["dz", "dz_scales", "w_t", "w_t_scales", "x", "r", "gamma", "zdz", "dres"]
        return op(*[changed.get(n, a) for n, a in zip(names, args)])

    with raises(r"w_t's rows \(H\) must be a multiple of 16 .*got 24"):
        call(**dict(zip(["w_t", "w_t_scales"], CODA.fp8_quantize_blocks(wide(24, 32, g))[:2])))
    with raises(r"rmsnorm_backward: x must be \(19, 16\), got \(19, 32\)"):
        call(x=torch.zeros(19, 32, dtype=torch.float64))
    with raises(r"dres must have x's dtype Double, got Float"):
        call(dres=dres.float())
    with raises(r"gamma must be a contiguous \(16\) vector of x's dtype"):
        call(gamma=gamma.float())
    with raises(r"zdz must be a contiguous \(19\) vector, got \(19, 1\)"):
        call(zdz=zdz[:, None])
    with raises(r"r must be float32 \(or float64 on the CPU\), got BFloat16"):
        call(r=r.bfloat16())
    with raises(r"w_t_scales must have shape \(1, 1\), got \(2, 1\)"):
        call(w_t_scales=torch.ones(2, 1))


def b2_fp64(dx_out, dx_out_scales, w_down_t, w_down_t_scales, z):
    """B2 on the dequantized operands: da = dx_out · W_down (w_down_t = W_downᵀ); with (g, u) the
    interleaved pairs of z, σ = sigmoid(g): dg = da·u·σ·(1 + g·(1 − σ)), du = da·silu(g), dz
    interleaved; and g·dg + u·du per (row, pair)."""
    da = dequantize(dx_out, dx_out_scales.t(), 1) @ dequantize(w_down_t, w_down_t_scales, 128).t()
    gate, up = z.double()[:, 0::2], z.double()[:, 1::2]
    sig = torch.sigmoid(gate)
    dg, du = da * up * sig * (1 + gate * (1 - sig)), da * gate * sig
    return torch.stack([dg, du], 2).flatten(1), gate * dg + up * du


def b2_inputs(m, inter, hidden, g, dtype):
    """dx_out codes (M, H); W_downᵀ (I, H) in 128x128 blocks (quantized as such: W_down's own
    transposed copy needs I a multiple of 16, B2 only a multiple of 8); z (M, 2I) in dtype."""
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(wide(m, hidden, g))
    wtc, wts, _, _ = CODA.fp8_quantize_blocks(wide(inter, hidden, g))
    z = (torch.randn(m, 2 * inter, generator=g, dtype=torch.float64) * 2).to(dtype)
    return dxc, dxs, wtc, wts, z


B2_SHAPES = [(1, 8, 16), (19, 200, 144), (130, 136, 272)]  # (M, I, H)


@pytest.mark.parametrize("m,inter,hidden", B2_SHAPES)
def test_fp8_swiglu_backward_is_b2_then_the_cast(m, inter, hidden, g):
    """B2 over FP8 operands in fp64: dz's codes and scales (both copies) are the recipe's cast of
    the formula's dz (dz itself is not an output: equal codes need the op's fp64 dz and the
    formula's on one side of every fp32 rounding boundary, which holds for these seeds), the ZdZ
    partials the formula's; folded (zdz_fold divides by H) they are ZdZ."""
    args = b2_inputs(m, inter, hidden, g, torch.float64)
    *q, s = CODA.fp8_gemm_swiglu_backward(*args, True, True)
    dz_ref, pair_dot = b2_fp64(*args)
    check_row_cast(q, dz_ref, "dz")
    close64(s, per_row_partials(pair_dot), "ZdZ partials")
    close64(CODA.zdz_fold(s, m, hidden), pair_dot.sum(1) / hidden, "ZdZ")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_swiglu_backward_rounds_dz_to_the_dtype_before_the_cast(dtype, g):
    """With z in bf16 (or float32) dz is rounded to that dtype before the cast: its codes are what
    fp8_quantize_rows writes for the formula's dz in that dtype; the partials are float32."""
    m, inter, hidden = 40, 200, 160
    args = b2_inputs(m, inter, hidden, g, dtype)
    *q, s = CODA.fp8_gemm_swiglu_backward(*args, True, True)
    dz_ref, pair_dot = b2_fp64(*args)
    assert s.dtype == torch.float32
    same_cast(q, CODA.fp8_quantize_rows(dz_ref.to(dtype), True, True), "dz")
    want = per_row_partials(pair_dot)
    torch.testing.assert_close(s.double(), want, rtol=2**-23, atol=2**-23 * want.abs().max())
    codes, scales, codes_t, scales_t, _ = CODA.fp8_gemm_swiglu_backward(*args, False, True)
    assert codes.numel() == 0 and scales.numel() == 0
    same_codes(codes_t, q[2], "dz_t alone")
    assert torch.equal(scales_t, q[3])


def test_fp8_swiglu_backward_bad_arguments(g):
    args = b2_inputs(19, 16, 32, g, torch.float64)
    dxc, dxs, wtc, wts, z = args
    op = CODA.fp8_gemm_swiglu_backward
    w20 = CODA.fp8_quantize_blocks(wide(20, 32, g))[:2]
    with raises(r"w_down_t's rows \(I\) must be a multiple of 8 .*got 20"):
        op(dxc, dxs, *w20, torch.zeros(19, 40, dtype=torch.float64))
    with raises(r"swiglu_backward: z must be \(19, 32\), got \(19, 16\)"):
        op(dxc, dxs, wtc, wts, z[:, :16])
    with raises(r"z must be bfloat16 \(or float32 / float64 on the CPU\)"):
        op(dxc, dxs, wtc, wts, z.int())
    with raises(r"dx_out_scales must have shape \(1, 19\), got \(1, 18\)"):
        op(dxc, dxs[:, :18], wtc, wts, z)
    with raises(r"w_down_t must be float8_e4m3fn, got Float"):
        op(dxc, dxs, wtc.float(), wts, z)
    with raises(r"swiglu_backward: neither rows nor transposed"):
        op(*args, False, False)


def test_set_fp8_wgrad_backend_names_the_choices():
    """coda::set_fp8_wgrad_backend returns the backend it replaces and refuses other names; a
    build without CUDA kernels has ours only (and says so for cuBLASLt)."""
    old = CODA.set_fp8_wgrad_backend("cutlass")
    assert old in ("cutlass", "cublaslt", "cublaslt-only")
    with pytest.raises(RuntimeError, match="must be 'cutlass', 'cublaslt' or 'cublaslt-only'"):
        CODA.set_fp8_wgrad_backend("cublas")
    try:
        previous = CODA.set_fp8_wgrad_backend("cublaslt")
    except RuntimeError as e:
        assert "no CUDA kernels" in str(e)
    else:
        assert previous == "cutlass"
        assert CODA.set_fp8_wgrad_backend("cutlass") == "cublaslt"
    assert CODA.set_fp8_wgrad_backend(old) == "cutlass"


def test_set_fp8_epilogue_names_the_choices_and_leaves_the_cpu_recipe_alone():
    """coda::set_fp8_epilogue refuses other names and returns the placement it replaces (a build
    without CUDA kernels: "auto", having none to place); the CPU op runs the recipe either way."""
    with pytest.raises(RuntimeError, match="must be 'auto', 'fused' or 'split', got 'unfused'"):
        CODA.set_fp8_epilogue("unfused")
    gen = torch.Generator().manual_seed(3)
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(torch.randn(130, 256, generator=gen))
    wtc, wts, _, _ = CODA.fp8_quantize_blocks(torch.randn(144, 256, generator=gen))
    z = torch.randn(130, 288, generator=gen, dtype=torch.float64)
    old = CODA.set_fp8_epilogue("fused")
    try:
        fused = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, z, True, True)
        assert CODA.set_fp8_epilogue("split") in ("fused", "auto")
        split = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, z, True, True)
    finally:
        CODA.set_fp8_epilogue(old)
    for a, b in zip(fused, split):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)

