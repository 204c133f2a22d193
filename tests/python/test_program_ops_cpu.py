"""The program-level ops (torch/program_ops.cpp: one GEMM-epilogue program or fold each, what the
benchmark suite times on its own) on the CPU in float64, against the math written out in plain
PyTorch (docs/math.md) and against the block ops that compose the same programs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda import ops
from helpers import assert_rel
from test_ops_cpu import ref_rope

CODA = torch.ops.coda
EPS = 1e-5
M, H, I, HQ, HKV, D = 19, 16, 24, 4, 2, 4  # ragged M, K != N


def rnd(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.fixture
def g():
    return torch.Generator().manual_seed(7)


def test_plain_gemms(g):
    x, w, y = rnd(M, H, g=g), rnd(24, H, g=g), rnd(M, 24, g=g)
    assert_rel(CODA.gemm(x, w), x @ w.t(), 1e-12, "gemm")
    assert_rel(CODA.gemm_xw(y, w), y @ w, 1e-12, "gemm_xw")
    assert_rel(CODA.gemm_xty(y, x), y.t() @ x, 1e-12, "gemm_xty")


def test_forward_programs_compose_to_the_block_ops(g):
    y, w_o, x0, gamma = rnd(M, 24, g=g), rnd(H, 24, g=g), rnd(M, H, g=g), 1 + rnd(H, g=g) / 10
    x, h, s = CODA.gemm_residual_rmsnorm_partial(y, w_o, x0, gamma)
    r = CODA.rmsnorm_fold(s, M, H, EPS)
    xb, hb, rb = CODA.out_proj_residual_norm(y, w_o, x0, gamma, EPS)
    assert_rel(x, xb, 0, "x")
    assert_rel(h, hb, 0, "h")
    assert_rel(r, rb, 0, "r")
    assert_rel(x, y @ w_o.t() + x0, 1e-12, "x vs math")
    assert_rel(r, torch.rsqrt(x.pow(2).mean(-1) + EPS), 1e-12, "r vs math")
    w_gu = rnd(2 * I, H, g=g)
    z, a = CODA.gemm_rmsnorm_swiglu(h, w_gu, r)
    assert_rel(z, r[:, None] * (h @ w_gu.t()), 1e-12, "z")
    assert_rel(a, F.silu(z[:, 0::2]) * z[:, 1::2], 1e-12, "a")
    inv = ops.rope_inv_freq(D, 10000.0)
    table = ops.rope_table(inv, HQ, HKV, D)
    pos = torch.arange(M, dtype=torch.int32) * 3
    w_qkv = rnd((HQ + 2 * HKV) * D, H, g=g)
    qkv = CODA.gemm_rmsnorm_rope(h, w_qkv, r, pos, table)
    assert_rel(qkv, CODA.norm_qkv(x, gamma, w_qkv, h, r, pos, table), 0, "qkv vs norm_qkv")
    assert_rel(qkv, ref_rope(r[:, None] * (h @ w_qkv.t()), pos, inv, HQ, HKV, D), 1e-12, "qkv")
    b = 3 * rnd(w_qkv.shape[0], g=g)  # Qwen2's Q/K/V bias, before RoPE
    qkv_b = CODA.gemm_rmsnorm_rope(h, w_qkv, r, pos, table, b)
    assert_rel(qkv_b, CODA.norm_qkv(x, gamma, w_qkv, h, r, pos, table, b), 0, "biased qkv")
    assert_rel(qkv_b, ref_rope(r[:, None] * (h @ w_qkv.t()) + b, pos, inv, HQ, HKV, D), 1e-12,
               "biased qkv vs math")


def test_rmsnorm_backward_program(g):
    dz, w, x = rnd(M, 24, g=g), rnd(24, H, g=g), rnd(M, H, g=g)
    gamma, dres = 1 + rnd(H, g=g) / 10, rnd(M, H, g=g)
    r, zdz = torch.rsqrt(x.pow(2).mean(-1) + EPS), rnd(M, g=g)
    dx, h_out, s = CODA.gemm_rmsnorm_backward(dz, w, x, r, gamma, zdz, dres)
    dgamma = CODA.dgamma_fold(s, H)
    gr = dz @ w
    n = x * r[:, None]
    assert_rel(dx, dres + r[:, None] * (gr * gamma - n * zdz[:, None]), 1e-12, "dx")
    assert_rel(h_out, n * gamma, 1e-12, "h_out")
    assert_rel(dgamma, (gr * n).sum(0), 1e-12, "dgamma")
    # Without dres (the QKV norm's backward): the norm's gradient alone, h_out and dγ unchanged.
    dx0, h0, s0 = CODA.gemm_rmsnorm_backward(dz, w, x, r, gamma, zdz, None)
    assert_rel(dx0, r[:, None] * (gr * gamma - n * zdz[:, None]), 1e-12, "dx without dres")
    assert torch.equal(h0, h_out) and torch.equal(s0, s)


def test_swiglu_backward_program(g):
    dx_out, w_down, z = rnd(M, H, g=g), rnd(H, I, g=g), rnd(M, 2 * I, g=g)
    dz, a, s = CODA.gemm_swiglu_backward(dx_out, w_down, z)
    zdz = CODA.zdz_fold(s, M, H)
    zz = z.clone().requires_grad_()
    a_ref = F.silu(zz[:, 0::2]) * zz[:, 1::2]
    da = dx_out @ w_down
    (dz_ref,) = torch.autograd.grad(a_ref, zz, da)
    assert_rel(a, a_ref.detach(), 1e-12, "a")
    assert_rel(dz, dz_ref, 1e-12, "dz")
    assert_rel(zdz, (z * dz_ref).sum(-1) / H, 1e-12, "zdz")


def test_rope_backward_program(g):
    inv = ops.rope_inv_freq(D, 10000.0)
    table = ops.rope_table(inv, HQ, HKV, D)
    pos = torch.arange(M, dtype=torch.int32) * 5
    pre = rnd(M, (HQ + 2 * HKV) * D, g=g).requires_grad_()
    qkv = ref_rope(pre, pos, inv, HQ, HKV, D)
    dqkv = rnd(*qkv.shape, g=g)
    (dpre_ref,) = torch.autograd.grad(qkv, pre, dqkv)
    dpre, zdz = CODA.rope_backward(qkv.detach(), dqkv, pos, table, H)
    assert_rel(dpre, dpre_ref, 1e-12, "dqkv_pre")
    assert_rel(zdz, (qkv.detach() * dqkv).sum(-1) / H, 1e-12, "zdz")
    # With F3's bias b (qkv = rope(z + b)): ZdZ is over z = pre − b; dpre is unchanged.
    b = 3 * rnd(pre.shape[1], g=g)
    dpre_b, zdz_b = CODA.rope_backward(qkv.detach(), dqkv, pos, table, H, b)
    assert_rel(dpre_b, dpre_ref, 1e-12, "dqkv_pre with a bias")
    assert_rel(zdz_b, ((pre.detach() - b) * dpre_ref).sum(-1) / H, 1e-12, "zdz with a bias")


def test_program_ops_name_bad_arguments(g):
    x = rnd(M, H, g=g)
    with pytest.raises(RuntimeError, match=r"coda::gemm: .*x.size\(1\) = 16 must equal w.size\(1\)"):
        CODA.gemm(x, rnd(8, 12, g=g))
    with pytest.raises(RuntimeError, match="coda::gemm_xty: y must be Double, got Float"):
        CODA.gemm_xty(x, rnd(M, 8, g=g).float())
    with pytest.raises(RuntimeError, match="coda::rmsnorm_fold: partials must be"):
        CODA.rmsnorm_fold(torch.zeros(2, 8, dtype=torch.float64), M, H, EPS)


def test_program_ops_check_the_shapes_the_operands_imply(g):
    # Every argument whose shape follows from the GEMM operands is checked against it (on the
    # CPU the reference executor would otherwise read past the end of a short tensor).
    y, w_o, x0, gamma = rnd(M, 24, g=g), rnd(H, 24, g=g), rnd(M, H, g=g), rnd(H, g=g)
    with pytest.raises(RuntimeError, match=r"residual must have shape \(19, 16\), got \(18, 16\)"):
        CODA.gemm_residual_rmsnorm_partial(y, w_o, x0[:-1].contiguous(), gamma)
    with pytest.raises(RuntimeError, match=r"gamma must have shape \(16,\), got \(8,\)"):
        CODA.gemm_residual_rmsnorm_partial(y, w_o, x0, gamma[:8].contiguous())
    h, r = rnd(M, H, g=g), rnd(M, g=g).abs()
    with pytest.raises(RuntimeError, match=r"coda::gemm_rmsnorm_swiglu: r must have shape \(19,\)"):
        CODA.gemm_rmsnorm_swiglu(h, rnd(2 * I, H, g=g), r[:5].contiguous())
    table = ops.rope_table(ops.rope_inv_freq(D, 10000.0), HQ, HKV, D)
    w_qkv = rnd((HQ + 2 * HKV) * D, H, g=g)
    pos = torch.arange(M, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"pos must have shape \(19,\), got \(3,\)"):
        CODA.gemm_rmsnorm_rope(h, w_qkv, r, pos[:3].contiguous(), table)
    with pytest.raises(RuntimeError, match=r"rope_table must have shape \(2, 32\)"):
        CODA.gemm_rmsnorm_rope(h, w_qkv, r, pos, table[:, :8].contiguous())
    with pytest.raises(RuntimeError, match="pos must be >= 0, got min -1"):
        CODA.gemm_rmsnorm_rope(h, w_qkv, r, pos - 1, table)
    dz, w = rnd(M, 24, g=g), rnd(24, H, g=g)
    with pytest.raises(RuntimeError, match=r"coda::gemm_rmsnorm_backward: zdz must have shape"):
        CODA.gemm_rmsnorm_backward(dz, w, h, r, gamma, r[:4].contiguous(), h)
    with pytest.raises(RuntimeError, match=r"dres must have shape \(19, 16\), got \(19, 8\)"):
        CODA.gemm_rmsnorm_backward(dz, w, h, r, gamma, r, h[:, :8].contiguous())
    with pytest.raises(RuntimeError, match=r"z must have shape \(19, 48\), got \(19, 24\)"):
        CODA.gemm_swiglu_backward(h, rnd(H, I, g=g), rnd(M, I, g=g))
    qkv = rnd(M, w_qkv.shape[0], g=g)
    with pytest.raises(RuntimeError, match=r"dqkv must have shape \(19, 32\)"):
        CODA.rope_backward(qkv, qkv[:-1].contiguous(), pos, table, H)
    with pytest.raises(RuntimeError, match="coda::rope_backward: hidden must be positive, got 0"):
        CODA.rope_backward(qkv, qkv, pos, table, 0)
    with pytest.raises(RuntimeError, match="coda::zdz_fold: hidden must be positive, got 0"):
        CODA.zdz_fold(torch.zeros(2, M, dtype=torch.float64), M, 0)
