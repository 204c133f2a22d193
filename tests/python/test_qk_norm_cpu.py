"""coda.ops.norm_qkv_qk_norm (Qwen3's QK-norm) on the CPU: values and gradients against a plain
PyTorch implementation, and argument checks. Its opcheck runs with the other ops' in
test_ops_cpu.py."""

from __future__ import annotations

import pytest
import torch

from coda import ops
from test_ops_cpu import (DTYPES, SHAPES, Rand, check_against_reference, inv_freq_for,
                          qk_norm_inputs, qk_norm_sizes, ref_norm, ref_rope)


def ref_norm_qkv_qk_norm_fn(s, inv_freq):
    """Qwen3: an RMSNorm over every Q and K head (weights q_gamma, k_gamma), then RoPE."""
    def fn(x, gamma, w_qkv, h, r, pos, rope_table, q_gamma, k_gamma, n_heads, n_kv_heads, eps):
        y = ref_norm(x, gamma) @ w_qkv.t()
        d, M = s["d"], x.shape[0]
        q = y[:, :n_heads * d].reshape(M, n_heads, d)
        k = y[:, n_heads * d:(n_heads + n_kv_heads) * d].reshape(M, n_kv_heads, d)

        def head_norm(t, g):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g

        y = torch.cat((head_norm(q, q_gamma).flatten(1), head_norm(k, k_gamma).flatten(1),
                       y[:, (n_heads + n_kv_heads) * d:]), dim=1)
        return ref_rope(y, pos, inv_freq, s["hq"], s["hkv"], d)
    return fn



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_qkv_qk_norm(shape, dtype):
    s = SHAPES[shape]
    inputs = qk_norm_inputs(s, dtype)
    W = inputs["w_qkv"].shape[0]
    g = Rand(12)(s["M"], W, dtype=torch.float64)
    sizes = qk_norm_sizes(s)
    check_against_reference(ops.norm_qkv_qk_norm, ref_norm_qkv_qk_norm_fn(s, inv_freq_for(s["d"])),
                            inputs, ["x", "gamma", "w_qkv", "q_gamma", "k_gamma"], {0: g}, dtype,
                            ["qkv"], extra=sizes, ref_extra=sizes)


def test_norm_qkv_qk_norm_arguments_are_checked():
    s = SHAPES["M5_d4"]
    inputs = qk_norm_inputs(s, torch.float64)
    sizes = qk_norm_sizes(s)
    bad = dict(inputs, q_gamma=inputs["q_gamma"][:-2].contiguous())
    with pytest.raises(RuntimeError,
                       match=r"coda::norm_qkv_qk_norm: q_gamma must have shape \(4,\)"):
        ops.norm_qkv_qk_norm(**bad, **sizes)
    with pytest.raises(RuntimeError, match=r"must be \(n_heads \+ 2\*n_kv_heads\) = 9 times"):
        ops.norm_qkv_qk_norm(**inputs, **dict(sizes, n_kv_heads=1, n_heads=7))
    with pytest.raises(RuntimeError, match="n_heads a multiple of n_kv_heads, got n_heads=3"):
        ops.norm_qkv_qk_norm(**inputs, **dict(sizes, n_heads=3))
    with pytest.raises(RuntimeError, match="coda::norm_qkv_qk_norm: eps must be >= 0"):
        ops.norm_qkv_qk_norm(**inputs, **dict(sizes, eps=-1.0))
