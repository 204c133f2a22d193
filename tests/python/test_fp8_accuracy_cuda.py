"""docs/math.md §6's accuracy rule for every FP8 program on CUDA: each output's max error against
an fp64 computation from the unquantized bf16 inputs is at most 1.5x the error of the same recipe
done unfused in PyTorch: the inputs quantized by the recipe (power-of-two block scales, torch's own
e4m3 cast), dequantized, multiplied in fp32, the epilogue's math in fp32, the bf16 outputs rounded,
a quantized output cast by the recipe again and dequantized. Normal-scale inputs, as a layer's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda  # noqa: F401  (loads the extension: torch.ops.coda)
from test_fp8_cpu import dequantize, quantize_ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU",
)

CODA = torch.ops.coda
BF16 = torch.bfloat16
M, K, H, INTER = 1024, 2048, 1024, 1408


def randn(*size, gen, scale=1.0):
    return (torch.randn(*size, generator=gen) * scale).to(BF16)


def recipe(x, block_rows):
    """x (bf16) through the recipe on the CPU: quantized and dequantized, float32."""
    codes, scales = quantize_ref(x, block_rows)
    return dequantize(codes, scales, block_rows).float()


def round_trip(v):
    """A bf16 output of the unfused path cast in 1x128 blocks and dequantized, float64."""
    return recipe(v.to(BF16), 1).double()


def ours_rows(codes, scales):
    """Our 1x128-blocked output (codes, scales in the kernels' layout) dequantized, float64."""
    return dequantize(codes.cpu(), scales.t().cpu(), 1)


def ours_cols(codes_t, scales_t, m):
    """Our transposed copy dequantized and transposed back, float64 (M, cols)."""
    return dequantize(codes_t[:, :m].cpu(), scales_t.t().cpu(), 1).t()


def within_rule(outputs):
    """outputs: name -> (ours, unfused, exact), all float64 on the CPU."""
    for name, (ours, unfused, exact) in outputs.items():
        e_ours = (ours - exact).abs().max().item()
        e_unfused = (unfused - exact).abs().max().item()
        assert torch.isfinite(ours).all(), name
        assert e_ours <= 1.5 * e_unfused, f"{name}: ours {e_ours:.4g} vs unfused {e_unfused:.4g}"


def test_fp8_residual_rmsnorm_accuracy():
    gen = torch.Generator().manual_seed(41)
    a, w = randn(M, K, gen=gen), randn(H, K, gen=gen, scale=K**-0.5)
    residual, gamma = randn(M, H, gen=gen), (torch.rand(H, generator=gen) + 0.5).to(BF16)
    x_exact = a.double() @ w.double().t() + residual.double()
    h_exact = x_exact * gamma.double()
    x32 = recipe(a, 1) @ recipe(w, 128).t() + residual.float()
    ac, acs, _, _ = CODA.fp8_quantize_rows(a.cuda())
    wc, wcs, _, _ = CODA.fp8_quantize_blocks(w.cuda())
    x, hc, hs, htc, hts, _ = CODA.fp8_gemm_residual_rmsnorm(
        ac, acs, wc, wcs, residual.cuda(), gamma.cuda(), True, True
    )
    h_unfused = round_trip(x32 * gamma.float())
    within_rule(
        {
            "x": (x.double().cpu(), x32.to(BF16).double(), x_exact),
            "h": (ours_rows(hc, hs), h_unfused, h_exact),
            "hᵀ": (ours_cols(htc, hts, M), h_unfused, h_exact),
        }
    )


def test_fp8_rmsnorm_swiglu_accuracy():
    gen = torch.Generator().manual_seed(42)
    h, w = randn(M, H, gen=gen), randn(2 * INTER, H, gen=gen, scale=H**-0.5)
    r = torch.rand(M, generator=gen) + 0.5
    z_exact = r.double()[:, None] * (h.double() @ w.double().t())
    a_exact = F.silu(z_exact[:, 0::2]) * z_exact[:, 1::2]
    z32 = r[:, None] * (recipe(h, 1) @ recipe(w, 128).t())
    a_unfused = round_trip(F.silu(z32[:, 0::2]) * z32[:, 1::2])
    hc, hs, _, _ = CODA.fp8_quantize_rows(h.cuda())
    wc, ws, _, _ = CODA.fp8_quantize_blocks(w.cuda())
    z, ac, as_, atc, ats = CODA.fp8_gemm_rmsnorm_swiglu(hc, hs, wc, ws, r.cuda(), True, True)
    within_rule(
        {
            "z": (z.double().cpu(), z32.to(BF16).double(), z_exact),
            "a": (ours_rows(ac, as_), a_unfused, a_exact),
            "aᵀ": (ours_cols(atc, ats, M), a_unfused, a_exact),
        }
    )


def test_fp8_rmsnorm_backward_accuracy():
    gen = torch.Generator().manual_seed(43)
    width = 2 * INTER  # the gate/up projection's width: the data gradient's K
    dz, w = randn(M, width, gen=gen), randn(width, H, gen=gen, scale=width**-0.5)  # W (K, H)
    x, dres = randn(M, H, gen=gen), randn(M, H, gen=gen)
    gamma = (torch.rand(H, generator=gen) + 0.5).to(BF16)
    r = torch.rand(M, generator=gen) + 0.5
    zdz = torch.randn(M, generator=gen) * 0.1

    def dx_of(g, xv, gam, rr, zz, dd):
        return dd + rr[:, None] * (g * gam - xv * rr[:, None] * zz[:, None])

    dx_exact = dx_of(
        dz.double() @ w.double(), x.double(), gamma.double(), r.double(), zdz.double(), dres.double()
    )
    g32 = recipe(dz, 1) @ recipe(w.t().contiguous(), 128).t()  # Wᵀ in 128x128 blocks
    dx32 = dx_of(g32, x.float(), gamma.float(), r, zdz, dres.float())
    h_exact = x.double() * r.double()[:, None] * gamma.double()
    h_unfused = round_trip(x.float() * r[:, None] * gamma.float())
    dzc, dzs, _, _ = CODA.fp8_quantize_rows(dz.cuda())
    _, _, wtc, wts = CODA.fp8_quantize_blocks(w.cuda(), False, True)
    dx, htc, hts, _ = CODA.fp8_gemm_rmsnorm_backward(
        dzc, dzs, wtc, wts, x.cuda(), r.cuda(), gamma.cuda(), zdz.cuda(), dres.cuda()
    )
    within_rule(
        {
            "dx": (dx.double().cpu(), dx32.to(BF16).double(), dx_exact),
            "h_outᵀ fp8": (ours_cols(htc, hts, M), h_unfused, h_exact),
        }
    )


def test_fp8_swiglu_backward_accuracy():
    gen = torch.Generator().manual_seed(44)
    dx_out, w_down = randn(M, H, gen=gen), randn(H, INTER, gen=gen, scale=H**-0.5)  # (H, I)
    z = randn(M, 2 * INTER, gen=gen, scale=2.0)

    def dz_of(da, zz):
        gate, up = zz[:, 0::2], zz[:, 1::2]
        sig = torch.sigmoid(gate)
        return torch.stack([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], 2).flatten(1)

    dz_exact = dz_of(dx_out.double() @ w_down.double(), z.double())
    da32 = recipe(dx_out, 1) @ recipe(w_down.t().contiguous(), 128).t()
    dz_unfused = round_trip(dz_of(da32, z.float()))
    dxc, dxs, _, _ = CODA.fp8_quantize_rows(dx_out.cuda())
    _, _, wtc, wts = CODA.fp8_quantize_blocks(w_down.cuda(), False, True)
    qc, qs, qtc, qts, _ = CODA.fp8_gemm_swiglu_backward(dxc, dxs, wtc, wts, z.cuda(), True, True)
    within_rule(
        {
            "dz": (ours_rows(qc, qs), dz_unfused, dz_exact),
            "dzᵀ": (ours_cols(qtc, qts, M), dz_unfused, dz_exact),
        }
    )
