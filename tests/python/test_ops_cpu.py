"""The torch.ops.coda ops on the CPU: registration (opcheck), values and gradients against a
plain PyTorch implementation of docs/math.md's math, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from coda import ops
from helpers import assert_ops_rule, assert_rel, max_abs

CODA = torch.ops.coda
EPS = 1e-5
THETA = 10000.0
DTYPES = [torch.float32, torch.float64]
# Small, ragged shapes: M odd, V not a power of two, d = 4 (K = H) and d = 8 (K != H).
SHAPES = {
    "M5_d4": dict(M=5, H=16, I=24, hq=4, hkv=2, d=4, V=40),
    "M19_d8": dict(M=19, H=16, I=24, hq=4, hkv=2, d=8, V=40),
}


# ---------------------------------------------------------------------------------------------
# Plain PyTorch reference (unfused, differentiable by autograd), from docs/math.md


def ref_r(x, eps=EPS):
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def ref_norm(x, gamma, eps=EPS):
    return x * ref_r(x, eps)[:, None] * gamma


def ref_rope(z, pos, inv_freq, hq, hkv, d):
    """Adjacent pairs (2i, 2i+1) of every Q and K head rotated by pos * inv_freq[i]; V untouched."""
    rot = (hq + hkv) * d
    col_freq = inv_freq[(torch.arange(rot) % d) // 2]  # (rot,) float64
    angle = pos.to(torch.float64)[:, None] * col_freq[None, :]  # angles in fp64, like the host
    cos, sin = angle[:, 0::2].cos().to(z.dtype), angle[:, 0::2].sin().to(z.dtype)
    x0, x1 = z[:, :rot:2], z[:, 1:rot:2]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(1)
    return torch.cat((y, z[:, rot:]), dim=1)


def ref_swiglu(z):
    return F.silu(z[:, 0::2]) * z[:, 1::2]


def ref_lm_head(x, gamma, w_vocab, targets, ignore_index=-100, reduction="mean", z_loss=0.0):
    logits = ref_norm(x, gamma) @ w_vocab.t()
    lse = torch.logsumexp(logits, dim=-1)
    keep = targets != ignore_index
    picked = logits.gather(1, torch.where(keep, targets, 0)[:, None])[:, 0]
    per_token = torch.where(keep, lse - picked + z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "mean":
        loss = per_token.sum() / keep.sum()
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token
    return loss, lse


# Each reference takes the op's arguments by name (caches h, r are recomputed from x instead).
def ref_rmsnorm_stats_fn(x, gamma):
    return x * gamma, ref_r(x)


def ref_norm_qkv_fn(s, inv_freq):
    def fn(x, gamma, w_qkv, h, r, pos, rope_table, b_qkv=None):
        y = ref_norm(x, gamma) @ w_qkv.t()
        return ref_rope(y if b_qkv is None else y + b_qkv, pos, inv_freq, s["hq"], s["hkv"],
                        s["d"])
    return fn


def ref_out_proj_fn(y, w_o, residual, gamma):
    x = y @ w_o.t() + residual
    return x, x * gamma, ref_r(x)


def ref_mlp_fn(x, gamma, w_gu, w_down, h, r, gamma_next):
    z = ref_norm(x, gamma) @ w_gu.t()
    x_out = x + ref_swiglu(z) @ w_down.t()
    return x_out, x_out * gamma_next, ref_r(x_out), z


def ref_mlp_partial_fn(x, gamma, w_gu, w_down, h, r):
    z = ref_norm(x, gamma) @ w_gu.t()
    return ref_swiglu(z) @ w_down.t(), z


# ---------------------------------------------------------------------------------------------
# Inputs


class Rand:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *size, dtype, scale=1.0, shift=0.0):
        t = torch.randn(*size, generator=self.g, dtype=torch.float64) * scale + shift
        return t.to(dtype)

    def ints(self, low, high, *size, dtype=torch.int64):
        return torch.randint(low, high, size, generator=self.g, dtype=dtype)


def caches(x, gamma):
    """(h, r) of x for gamma, computed independently of the ops (r in fp64, then cast)."""
    return x * gamma, ref_r(x.double()).to(x.dtype)


def inv_freq_for(d):
    return ops.rope_inv_freq(d, THETA)


def norm_qkv_inputs(s, dtype, seed=0, max_pos=4096, bias=False):
    """norm_qkv's arguments; with `bias` a Q/K/V bias (Qwen2) several times the projection."""
    rnd = Rand(seed)
    W = (s["hq"] + 2 * s["hkv"]) * s["d"]
    x = rnd(s["M"], s["H"], dtype=dtype)
    gamma = rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0)
    h, r = caches(x, gamma)
    out = dict(
        x=x, gamma=gamma, w_qkv=rnd(W, s["H"], dtype=dtype, scale=s["H"] ** -0.5), h=h, r=r,
        pos=rnd.ints(0, max_pos, s["M"], dtype=torch.int32),
        rope_table=ops.rope_table(inv_freq_for(s["d"]), s["hq"], s["hkv"], s["d"]),
    )
    if bias:
        out["b_qkv"] = rnd(W, dtype=dtype, scale=3.0)
    return out


def qk_norm_inputs(s, dtype, seed=0):
    """norm_qkv_qk_norm's tensor arguments (Qwen3): norm_qkv's and the two head-norm weights."""
    rnd = Rand(seed + 40)
    out = norm_qkv_inputs(s, dtype, seed)
    out["q_gamma"] = rnd(s["d"], dtype=dtype, scale=0.5, shift=1.0)
    out["k_gamma"] = rnd(s["d"], dtype=dtype, scale=0.5, shift=1.0)
    return out


def qk_norm_sizes(s, eps=1e-6):
    return dict(n_heads=s["hq"], n_kv_heads=s["hkv"], eps=eps)


def out_proj_inputs(s, dtype, seed=1):
    rnd = Rand(seed)
    K = s["hq"] * s["d"]
    return dict(
        y=rnd(s["M"], K, dtype=dtype), w_o=rnd(s["H"], K, dtype=dtype, scale=K ** -0.5),
        residual=rnd(s["M"], s["H"], dtype=dtype),
        gamma=rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0),
    )


def mlp_inputs(s, dtype, seed=2):
    rnd = Rand(seed)
    x = rnd(s["M"], s["H"], dtype=dtype)
    gamma = rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0)
    h, r = caches(x, gamma)
    return dict(
        x=x, gamma=gamma, w_gu=rnd(2 * s["I"], s["H"], dtype=dtype, scale=s["H"] ** -0.5),
        w_down=rnd(s["H"], s["I"], dtype=dtype, scale=s["I"] ** -0.5), h=h, r=r,
        gamma_next=rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0),
    )


def lm_head_inputs(s, dtype, seed=3, ignore_index=-100):
    rnd = Rand(seed)
    x = rnd(s["M"], s["H"], dtype=dtype)
    gamma = rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0)
    h, r = caches(x, gamma)
    targets = rnd.ints(0, s["V"], s["M"])
    targets[1::3] = ignore_index  # some ignored tokens, never all
    return dict(x=x, gamma=gamma, w_vocab=rnd(s["V"], s["H"], dtype=dtype, scale=0.5), h=h, r=r,
                targets=targets)


# ---------------------------------------------------------------------------------------------
# Forward + backward comparison driver


def run(fn, inputs, diff, grad_outs, extra=None):
    """Calls fn(**inputs, **extra) with fresh leaves (requires_grad for names in `diff`) and
    back-propagates grad_outs (a dict output-index -> upstream grad). Returns (outputs, grads)."""
    leaves = {
        k: v.detach().clone().requires_grad_(k in diff) if v.is_floating_point() else v
        for k, v in inputs.items()
    }
    outs = fn(**leaves, **(extra or {}))
    outs = outs if isinstance(outs, tuple) else (outs,)
    idx = sorted(grad_outs)
    grads = torch.autograd.grad(
        [outs[i] for i in idx], [leaves[k] for k in diff],
        [grad_outs[i].to(outs[i].dtype) for i in idx], allow_unused=True,
    )
    return tuple(o.detach() for o in outs), dict(zip(diff, grads))


def to64(inputs):
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def check_against_reference(op, ref, inputs, diff, grad_outs, dtype, out_names, extra=None,
                            ref_extra=None):
    """Values and gradients of `op` vs the fp64 reference (fp64: 1e-9 relative; fp32: docs/math.md §5
    rule against the same reference run in fp32)."""
    got_out, got_grad = run(op, inputs, diff, grad_outs, extra)
    ref_out, ref_grad = run(ref, to64(inputs), diff, grad_outs, ref_extra)
    plain_out, plain_grad = run(ref, inputs, diff, grad_outs, ref_extra)
    assert len(got_out) == len(out_names), f"{len(got_out)} outputs, expected {out_names}"

    def compare(got, want, plain, what):
        assert got.dtype == dtype or got.dtype in (torch.int64, torch.int32), f"{what}: {got.dtype}"
        if dtype == torch.float64:
            assert_rel(got, want, 1e-9, what)
        else:
            # float32: the §5 rule plus 4 ulps of the output's magnitude. A loss summed over tokens
            # (~70 here) rounds by ~1e-5 whatever the order of its sum, while PyTorch's own error
            # can land below one ulp by chance; the 1e-6 floor is sized for values near 1.
            assert_ops_rule(got, want, plain, what,
                            slack=4 * torch.finfo(torch.float32).eps * max_abs(want))

    for name, g, w, p in zip(out_names, got_out, ref_out, plain_out):
        if name is not None:
            compare(g, w, p, f"output {name}")
    for k in diff:
        assert got_grad[k] is not None, f"no gradient for {k}"
        compare(got_grad[k], ref_grad[k], plain_grad[k], f"grad {k}")
    return got_out, got_grad


def no_grad_for(op, inputs, name, out_idx):
    """Gradient w.r.t. a non-differentiable argument is None or zero."""
    leaves = dict(inputs)
    leaves[name] = inputs[name].detach().clone().requires_grad_()
    out = op(**leaves)[out_idx]
    if not out.requires_grad:
        return  # not connected at all: fine
    (g,) = torch.autograd.grad(out, [leaves[name]], torch.ones_like(out), allow_unused=True)
    assert g is None or not g.any(), f"{name} got a nonzero gradient"


# ---------------------------------------------------------------------------------------------
# Values and gradients


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_stats(shape, dtype):
    s = SHAPES[shape]
    rnd = Rand(4)
    x = rnd(s["M"], s["H"], dtype=dtype, scale=3.0)
    gamma = rnd(s["H"], dtype=dtype, scale=0.3, shift=1.0)
    h, r = ops.rmsnorm_stats(x, gamma, EPS)
    assert h.shape == (s["M"], s["H"]) and r.shape == (s["M"],)
    assert h.dtype == dtype and r.dtype == dtype  # stat dtype = activation dtype on the CPU
    for got, want, plain, what in zip((h, r), ref_rmsnorm_stats_fn(x.double(), gamma.double()),
                                      ref_rmsnorm_stats_fn(x, gamma), ("h", "r")):
        if dtype == torch.float64:
            assert_rel(got, want, 1e-12, what)
        else:
            assert_ops_rule(got, want, plain, what)
    # eps really enters r: a zero row gives r = eps ** -0.5
    h0, r0 = ops.rmsnorm_stats(torch.zeros(2, s["H"], dtype=dtype), gamma, 0.25)
    assert torch.allclose(r0, torch.full_like(r0, 2.0))


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_qkv(shape, dtype, bias):
    s = SHAPES[shape]
    inputs = norm_qkv_inputs(s, dtype, bias=bias)
    W = inputs["w_qkv"].shape[0]
    g = Rand(10)(s["M"], W, dtype=torch.float64)
    check_against_reference(ops.norm_qkv, ref_norm_qkv_fn(s, inv_freq_for(s["d"])), inputs,
                            ["x", "gamma", "w_qkv"] + ["b_qkv"] * bias, {0: g}, dtype, ["qkv"])


def test_norm_qkv_bias_is_checked():
    s = SHAPES["M5_d4"]
    inputs = norm_qkv_inputs(s, torch.float64, bias=True)
    W = inputs["w_qkv"].shape[0]
    inputs["b_qkv"] = inputs["b_qkv"][:-2].contiguous()
    with pytest.raises(RuntimeError, match=rf"coda::norm_qkv: b_qkv must have shape \({W},\)"):
        ops.norm_qkv(**inputs)
    inputs["b_qkv"] = torch.zeros(W, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="coda::norm_qkv: b_qkv must be .*Double"):
        ops.norm_qkv(**inputs)


def test_norm_qkv_long_positions():
    """Angles stay exact at 2^20 positions (fixed-point turns), float64."""
    s = SHAPES["M19_d8"]
    inputs = norm_qkv_inputs(s, torch.float64, seed=5)
    inputs["pos"] = torch.arange(2**20 - s["M"], 2**20, dtype=torch.int32)
    W = inputs["w_qkv"].shape[0]
    g = Rand(11)(s["M"], W, dtype=torch.float64)
    check_against_reference(ops.norm_qkv, ref_norm_qkv_fn(s, inv_freq_for(s["d"])), inputs,
                            ["x", "gamma", "w_qkv"], {0: g}, torch.float64, ["qkv"])


def test_norm_qkv_v_is_not_rotated():
    s = SHAPES["M5_d4"]
    inputs = norm_qkv_inputs(s, torch.float64)
    qkv = ops.norm_qkv(**inputs)
    rot = (s["hq"] + s["hkv"]) * s["d"]
    plain = ref_norm(inputs["x"], inputs["gamma"]) @ inputs["w_qkv"].t()
    assert_rel(qkv[:, rot:], plain[:, rot:], 1e-12, "V columns")
    # and Q/K are rotated (positions are nonzero), so this test can tell the two apart
    assert (qkv[:, :rot] - plain[:, :rot]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_out_proj_residual_norm(shape, dtype):
    s = SHAPES[shape]
    inputs = out_proj_inputs(s, dtype)
    g = Rand(12)(s["M"], s["H"], dtype=torch.float64)
    check_against_reference(ops.out_proj_residual_norm, ref_out_proj_fn, inputs,
                            ["y", "w_o", "residual"], {0: g}, dtype, ["x", "h", "r"],
                            extra={"eps": EPS})
    no_grad_for(lambda **kw: ops.out_proj_residual_norm(**kw, eps=EPS), inputs, "gamma", 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mlp(shape, dtype):
    s = SHAPES[shape]
    inputs = mlp_inputs(s, dtype)
    g = Rand(13)(s["M"], s["H"], dtype=torch.float64)
    check_against_reference(ops.mlp, ref_mlp_fn, inputs, ["x", "gamma", "w_gu", "w_down"],
                            {0: g}, dtype, ["x_out", "h_out", "r_out", "z"], extra={"eps": EPS})
    no_grad_for(lambda **kw: ops.mlp(**kw, eps=EPS), inputs, "gamma_next", 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mlp_partial(shape, dtype):
    """The MLP branch without residual and next norm: values and gradients vs fp64; and the
    gradient reaching x has no residual part (it is the norm path only)."""
    s = SHAPES[shape]
    inputs = {k: v for k, v in mlp_inputs(s, dtype).items() if k != "gamma_next"}
    g = Rand(14)(s["M"], s["H"], dtype=torch.float64)
    check_against_reference(ops.mlp_partial, ref_mlp_partial_fn, inputs,
                            ["x", "gamma", "w_gu", "w_down"], {0: g}, dtype, ["y", "z"])


def test_mlp_partial_plus_residual_is_mlp():
    """mlp(x) = x + mlp_partial(x), forward and every gradient, in fp64."""
    s = SHAPES["M19_d8"]
    inputs = mlp_inputs(s, torch.float64)
    g = Rand(15)(s["M"], s["H"], dtype=torch.float64)
    diff = ["x", "gamma", "w_gu", "w_down"]
    full_out, full_grad = run(lambda **kw: ops.mlp(**kw, eps=EPS), inputs, diff, {0: g})
    part_in = {k: v for k, v in inputs.items() if k != "gamma_next"}
    part_out, part_grad = run(lambda **kw: (kw["x"] + ops.mlp_partial(**kw)[0],), part_in, diff,
                              {0: g})
    assert_rel(part_out[0], full_out[0], 1e-12, "x_out")
    for k in diff:
        assert_rel(part_grad[k], full_grad[k], 1e-12, f"grad {k}")


# An odd vocabulary (V = 41: the programs' last column pair holds one column).
LM_SHAPES = dict(SHAPES, M19_V41=dict(SHAPES["M19_d8"], V=41))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LM_SHAPES)
@pytest.mark.parametrize("reduction,z_loss,ignore_index",
                         [("mean", 0.0, -100), ("sum", 0.1, -100), ("none", 0.0, 7)])
def test_lm_head_loss(shape, dtype, reduction, z_loss, ignore_index):
    s = LM_SHAPES[shape]
    inputs = lm_head_inputs(s, dtype, ignore_index=ignore_index)
    inputs["targets"][0] = s["V"] - 1  # the last column is a target
    kw = dict(ignore_index=ignore_index, reduction=reduction, z_loss=z_loss)
    upstream = Rand(14)(s["M"], dtype=torch.float64) if reduction == "none" else torch.tensor(1.7)

    def ref(x, gamma, w_vocab, h, r, targets, **k):
        return ref_lm_head(x, gamma, w_vocab, targets, **k)

    (loss, lse), _ = check_against_reference(
        ops.lm_head_loss, ref, inputs, ["x", "gamma", "w_vocab"], {0: upstream}, dtype,
        ["loss", "lse"], extra=kw, ref_extra=kw)
    assert loss.shape == ((s["M"],) if reduction == "none" else ())
    if reduction == "none":
        assert not loss[inputs["targets"] == ignore_index].any(), "ignored tokens must have loss 0"


def test_lm_head_loss_all_ignored_mean_is_nan():
    """Like PyTorch's cross_entropy: a mean over zero counted tokens is NaN."""
    s = SHAPES["M5_d4"]
    inputs = lm_head_inputs(s, torch.float64)
    inputs["targets"] = torch.full((s["M"],), -100, dtype=torch.int64)
    loss, _ = ops.lm_head_loss(**inputs)
    assert torch.isnan(loss)
    loss_sum, _ = ops.lm_head_loss(**inputs, reduction="sum")
    assert loss_sum.item() == 0.0


def test_lm_head_loss_int32_targets_are_converted():
    s = SHAPES["M19_d8"]
    inputs = lm_head_inputs(s, torch.float64)
    want, _ = ops.lm_head_loss(**inputs)
    inputs["targets"] = inputs["targets"].to(torch.int32)
    got, _ = ops.lm_head_loss(**inputs)
    assert torch.equal(got, want)


def test_norm_qkv_int64_pos_is_converted():
    s = SHAPES["M5_d4"]
    inputs = norm_qkv_inputs(s, torch.float64)
    want = ops.norm_qkv(**inputs)
    inputs["pos"] = inputs["pos"].to(torch.int64)
    assert torch.equal(ops.norm_qkv(**inputs), want)


# ---------------------------------------------------------------------------------------------
# RoPE frequencies and the table


def independent_inv_freq(head_dim, theta, scaling=None):
    """Vectorized fp64 version of the Hugging Face / Meta LLaMA-3.1 formula."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv
    old = scaling["original_max_position_embeddings"]
    lo, hi, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, out)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rope_inv_freq(scaling):
    got = ops.rope_inv_freq(16, THETA, scaling)
    want = independent_inv_freq(16, THETA, scaling)
    assert got.dtype == torch.float64 and got.shape == (8,)
    assert_rel(got, want, 1e-14, "inv_freq")
    if scaling is not None:
        plain = independent_inv_freq(16, THETA)
        # with original length 32 the three bands are all present: kept, smoothed, divided
        ratio = got / plain
        assert ratio[0] == 1.0
        assert ((ratio > 1 / 8 + 1e-9) & (ratio < 1 - 1e-9)).any()
        assert torch.isclose(ratio[-1], torch.tensor(1 / 8, dtype=torch.float64))


def test_rope_inv_freq_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="coda::rope_inv_freq: .*head_dim"):
        ops.rope_inv_freq(7, THETA)
    with pytest.raises(RuntimeError, match="coda::rope_inv_freq: .*theta"):
        ops.rope_inv_freq(8, 1.0)
    with pytest.raises(ValueError, match="llama3"):
        ops.rope_inv_freq(8, THETA, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="missing"):
        ops.rope_inv_freq(8, THETA, {"factor": 8.0})


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 4), (4, 4, 8), (2, 1, 16)])
def test_rope_table_layout(hq, hkv, d):
    inv_freq = ops.rope_inv_freq(d, THETA, LLAMA3)
    table = ops.rope_table(inv_freq, hq, hkv, d)
    W = (hq + 2 * hkv) * d
    assert table.dtype == torch.int32 and table.shape == (2, W) and table.device.type == "cpu"
    hi = table[0].to(torch.int64) & 0xFFFFFFFF
    lo = table[1].to(torch.int64) & 0xFFFFFFFF
    turns = hi.double() * 2.0**-32 + lo.double() * 2.0**-64
    rot = (hq + hkv) * d
    want = inv_freq[(torch.arange(rot) % d) // 2] / (2 * math.pi)
    want = want - want.floor()
    assert (turns[:rot] - want).abs().max() < 1e-15
    assert not table[:, rot:].any(), "V columns must have frequency 0"


# ---------------------------------------------------------------------------------------------
# A whole block composed from the ops (the docs/torch-ops.md sketch) vs the unfused block


def test_two_layer_chain_matches_unfused_block():
    """Cache-based gradient split: every gamma and x gets its gradient from the right op."""
    B, S, H, I, hq, hkv, d, V, L = 2, 7, 16, 24, 4, 2, 4, 40, 2
    M = B * S
    rnd = Rand(20)
    dt = torch.float64
    params = {"x0": rnd(M, H, dtype=dt), "gamma_final": rnd(H, dtype=dt, scale=0.3, shift=1.0),
              "w_vocab": rnd(V, H, dtype=dt, scale=0.5)}
    for l in range(L):
        params.update({
            f"gamma_attn{l}": rnd(H, dtype=dt, scale=0.3, shift=1.0),
            f"w_qkv{l}": rnd((hq + 2 * hkv) * d, H, dtype=dt, scale=H ** -0.5),
            f"w_o{l}": rnd(H, hq * d, dtype=dt, scale=(hq * d) ** -0.5),
            f"gamma_ffn{l}": rnd(H, dtype=dt, scale=0.3, shift=1.0),
            f"w_gu{l}": rnd(2 * I, H, dtype=dt, scale=H ** -0.5),
            f"w_down{l}": rnd(H, I, dtype=dt, scale=I ** -0.5),
        })
    pos = torch.arange(S, dtype=torch.int32).repeat(B)
    targets = rnd.ints(0, V, M)
    targets[::5] = -100
    inv_freq = inv_freq_for(d)
    table = ops.rope_table(inv_freq, hq, hkv, d)

    def attend(qkv):
        t = qkv.view(B, S, hq + 2 * hkv, d)
        q, k, v = (t[:, :, :hq], t[:, :, hq:hq + hkv], t[:, :, hq + hkv:])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(M, hq * d)

    def fused(p):
        x = p["x0"]
        h, r = ops.rmsnorm_stats(x, p["gamma_attn0"], EPS)
        for l in range(L):
            qkv = ops.norm_qkv(x, p[f"gamma_attn{l}"], p[f"w_qkv{l}"], h, r, pos, table)
            x1, h1, r1 = ops.out_proj_residual_norm(attend(qkv), p[f"w_o{l}"], x,
                                                    p[f"gamma_ffn{l}"], EPS)
            g_next = p[f"gamma_attn{l + 1}"] if l + 1 < L else p["gamma_final"]
            x, h, r, _ = ops.mlp(x1, p[f"gamma_ffn{l}"], p[f"w_gu{l}"], p[f"w_down{l}"], h1, r1,
                                 g_next, EPS)
        return ops.lm_head_loss(x, p["gamma_final"], p["w_vocab"], h, r, targets)[0]

    def unfused(p):
        x = p["x0"]
        for l in range(L):
            qkv = ref_rope(ref_norm(x, p[f"gamma_attn{l}"]) @ p[f"w_qkv{l}"].t(), pos, inv_freq,
                           hq, hkv, d)
            x = x + attend(qkv) @ p[f"w_o{l}"].t()
            x = x + ref_swiglu(ref_norm(x, p[f"gamma_ffn{l}"]) @ p[f"w_gu{l}"].t()) \
                @ p[f"w_down{l}"].t()
        return ref_lm_head(x, p["gamma_final"], p["w_vocab"], targets)[0]

    results = []
    for fn in (fused, unfused):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = fn(leaves)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results.append((loss.detach(), dict(zip(leaves, grads))))
    (loss_f, grads_f), (loss_u, grads_u) = results
    assert_rel(loss_f, loss_u, 1e-10, "loss")
    for k in params:
        assert_rel(grads_f[k], grads_u[k], 1e-9, f"grad {k}")


# ---------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake/meta kernels, AOT dispatch


def forward_op_cases(s, dtype):
    """(op, args, kwargs) for every forward op; differentiable inputs require grad."""
    def rg(t):
        return t.clone().requires_grad_()

    q = norm_qkv_inputs(s, dtype)
    qb = norm_qkv_inputs(s, dtype, bias=True)
    qn = qk_norm_inputs(s, dtype)
    o = out_proj_inputs(s, dtype)
    m = mlp_inputs(s, dtype)
    lm = lm_head_inputs(s, dtype)
    x0 = Rand(30)(s["M"], s["H"], dtype=dtype)
    return {
        "rope_table": (CODA.rope_table.default,
                       (inv_freq_for(s["d"]), s["hq"], s["hkv"], s["d"]), {}),
        "rmsnorm_stats": (CODA.rmsnorm_stats.default, (x0, q["gamma"], EPS), {}),
        "norm_qkv": (CODA.norm_qkv.default,
                     (rg(q["x"]), rg(q["gamma"]), rg(q["w_qkv"]), q["h"], q["r"], q["pos"],
                      q["rope_table"]), {}),
        "norm_qkv_bias": (CODA.norm_qkv.default,
                          (rg(q["x"]), rg(q["gamma"]), rg(q["w_qkv"]), q["h"], q["r"], q["pos"],
                           q["rope_table"], rg(qb["b_qkv"])), {}),
        "norm_qkv_qk_norm": (CODA.norm_qkv_qk_norm.default,
                             (rg(qn["x"]), rg(qn["gamma"]), rg(qn["w_qkv"]), qn["h"], qn["r"],
                              qn["pos"], qn["rope_table"], rg(qn["q_gamma"]), rg(qn["k_gamma"]),
                              s["hq"], s["hkv"], 1e-6), {}),
        "out_proj_residual_norm": (CODA.out_proj_residual_norm.default,
                                   (rg(o["y"]), rg(o["w_o"]), rg(o["residual"]), o["gamma"], EPS),
                                   {}),
        "mlp": (CODA.mlp.default,
                (rg(m["x"]), rg(m["gamma"]), rg(m["w_gu"]), rg(m["w_down"]), m["h"], m["r"],
                 m["gamma_next"], EPS), {}),
        "mlp_partial": (CODA.mlp_partial.default,
                        (rg(m["x"]), rg(m["gamma"]), rg(m["w_gu"]), rg(m["w_down"]), m["h"],
                         m["r"]), {}),
        "lm_head_loss": (CODA.lm_head_loss.default,
                         (rg(lm["x"]), rg(lm["gamma"]), rg(lm["w_vocab"]), lm["h"], lm["r"],
                          lm["targets"]), {"ignore_index": -100, "reduction": "mean",
                                           "z_loss": 0.01}),
        # per-token losses: the gradient depends on the incoming one, so the backward op runs
        # after the forward (mean / sum form it in the forward, through lm_head_loss_grad)
        "lm_head_loss_none": (CODA.lm_head_loss.default,
                              (rg(lm["x"]), rg(lm["gamma"]), rg(lm["w_vocab"]), lm["h"], lm["r"],
                               lm["targets"]), {"ignore_index": -100, "reduction": "none",
                                                "z_loss": 0.01}),
    }


FORWARD_OPS = ["rope_table", "rmsnorm_stats", "norm_qkv", "norm_qkv_bias", "norm_qkv_qk_norm",
               "out_proj_residual_norm", "mlp",
               "mlp_partial", "lm_head_loss", "lm_head_loss_none"]
# The ops that compute gradients (lm_head_loss_grad: the loss with its gradient for d loss = 1,
# which lm_head_loss's autograd calls in the forward when the reduction is mean or sum).
BACKWARD_OPS = {"norm_qkv_backward", "norm_qkv_qk_norm_backward", "linear_backward",
                "mlp_backward", "lm_head_loss_backward",
                "lm_head_loss_grad"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FORWARD_OPS)
def test_opcheck_forward(name, dtype):
    shape = "M19_d8" if dtype == torch.float32 else "M5_d4"
    op, args, kwargs = forward_op_cases(SHAPES[shape], dtype)[name]
    torch.library.opcheck(op, args, kwargs)


class CaptureBackwardOps(TorchDispatchMode):
    """Records every coda::*_backward call (with cloned arguments) that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("coda::") and name.endswith(("_backward", "_grad")):
            clone = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls.append((name.split("::")[1], func, tree_map(clone, args),
                               tree_map(clone, kwargs)))
        return func(*args, **kwargs)


def captured_backward_calls(dtype):
    s = SHAPES["M19_d8" if dtype == torch.float32 else "M5_d4"]
    calls = {}
    for name, (op, args, kwargs) in forward_op_cases(s, dtype).items():
        if name in ("rope_table", "rmsnorm_stats"):
            continue
        mode = CaptureBackwardOps()
        with mode:
            outs = op(*args, **kwargs)
            first = outs[0] if isinstance(outs, (tuple, list)) else outs
            first.backward(torch.ones_like(first))
        calls[name] = mode.calls
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_ops_are_dispatched(dtype):
    """Each differentiable op's gradient comes from a public coda::*_backward op (for the LM
    head's mean / sum, coda::lm_head_loss_grad) so that it can be traced, and together they
    cover the documented gradient ops."""
    calls = captured_backward_calls(dtype)
    for name, c in calls.items():
        assert c, f"{name}: its gradient came from no coda::*_backward / *_grad op"
    seen = {n for c in calls.values() for n, *_ in c}
    assert seen == BACKWARD_OPS, f"backward ops seen {sorted(seen)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BACKWARD_OPS))
def test_opcheck_backward(name, dtype):
    calls = [c for cs in captured_backward_calls(dtype).values() for c in cs if c[0] == name]
    assert calls, f"{name} was never called"
    for _, op, args, kwargs in calls:  # e.g. norm_qkv_backward with and without a bias
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lm_head_gradient_formed_in_forward_is_scaled_and_survives_retain_graph(reduction):
    """For mean / sum, lm_head_loss's autograd forms the gradient in the forward (d loss = 1) and
    scales it by the incoming gradient in backward; a second backward through a retained graph
    recomputes it (lm_head_loss_backward). Both must equal the backward op called directly."""
    op, args, kwargs = forward_op_cases(SHAPES["M19_d8"], torch.float64)["lm_head_loss"]
    kwargs = dict(kwargs, reduction=reduction)
    x, gamma, w = args[:3]
    loss, lse = op(*args, **kwargs)
    want = CODA.lm_head_loss_backward(
        torch.tensor(2.5, dtype=torch.float64), *(t.detach() for t in args), lse,
        kwargs["ignore_index"], reduction, kwargs["z_loss"], 1 << 30)
    for retain in (True, False):
        (2.5 * loss).backward(retain_graph=retain)
        for got, ref, what in zip((x.grad, gamma.grad, w.grad), want, ("dx", "dgamma", "dw")):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=what)
        for t in (x, gamma, w):
            t.grad = None


def test_lm_head_gradient_not_formed_under_no_grad_and_create_graph_raises_on_second_order():
    """Parameters still say requires_grad under torch.no_grad: the forward must not form the
    gradient there (no lm_head_loss_grad call). With create_graph the backward takes the
    recompute path, whose op has no derivative: differentiating the gradient raises."""
    op, args, kwargs = forward_op_cases(SHAPES["M5_d4"], torch.float64)["lm_head_loss"]
    mode = CaptureBackwardOps()
    with torch.no_grad(), mode:
        op(*args, **kwargs)
    assert not mode.calls, [c[0] for c in mode.calls]
    loss, _ = op(*args, **kwargs)
    (gx,) = torch.autograd.grad(loss, args[0], create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_lm_head_loss_grad_rejects_reduction_none():
    _, args, kwargs = forward_op_cases(SHAPES["M5_d4"], torch.float64)["lm_head_loss"]
    with pytest.raises(RuntimeError, match="reduction must be 'mean' or 'sum'.*got 'none'"):
        CODA.lm_head_loss_grad(*(t.detach() for t in args), -100, "none", 0.0)


# ---------------------------------------------------------------------------------------------
# Argument checks: the message names the offending argument


S0 = SHAPES["M5_d4"]


def _bad(case, **change):
    args = dict(case)
    args.update(change)
    return args


def noncontig(t):
    """Same values and shape, transposed storage."""
    return t.t().contiguous().t() if t.dim() == 2 else t.repeat_interleave(2)[::2]


BAD_CASES = {
    # rmsnorm_stats
    "rmsnorm_stats:x dtype": (CODA.rmsnorm_stats, lambda: [torch.ones(5, 16, dtype=torch.int32),
                                                           torch.ones(16), EPS], "x"),
    "rmsnorm_stats:gamma dtype": (CODA.rmsnorm_stats, lambda: [torch.ones(5, 16),
                                                               torch.ones(16, dtype=torch.float64),
                                                               EPS], "gamma"),
    "rmsnorm_stats:gamma shape": (CODA.rmsnorm_stats, lambda: [torch.ones(5, 16), torch.ones(17),
                                                               EPS], "gamma"),
    "rmsnorm_stats:x noncontig": (CODA.rmsnorm_stats, lambda: [noncontig(torch.randn(5, 16)),
                                                               torch.ones(16), EPS], "x"),
}


def _norm_qkv_bad(**change):
    return lambda: list(_bad(norm_qkv_inputs(S0, torch.float32), **change).values())


def _out_proj_bad(**change):
    return lambda: list(_bad(out_proj_inputs(S0, torch.float32), **change).values()) + [EPS]


def _mlp_bad(**change):
    return lambda: list(_bad(mlp_inputs(S0, torch.float32), **change).values()) + [EPS]


def _lm_bad(**change):
    return lambda: list(_bad(lm_head_inputs(S0, torch.float32), **change).values())


BAD_CASES.update({
    "norm_qkv:w_qkv dtype": (CODA.norm_qkv, _norm_qkv_bad(w_qkv=torch.ones(32, 16,
                                                                           dtype=torch.float64)),
                             "w_qkv"),
    "norm_qkv:r shape": (CODA.norm_qkv, _norm_qkv_bad(r=torch.ones(6)), "r"),
    "norm_qkv:h shape": (CODA.norm_qkv, _norm_qkv_bad(h=torch.ones(5, 15)), "h"),
    "norm_qkv:pos dtype": (CODA.norm_qkv, _norm_qkv_bad(pos=torch.zeros(5, dtype=torch.int64)),
                           "pos"),
    "norm_qkv:pos shape": (CODA.norm_qkv, _norm_qkv_bad(pos=torch.zeros(4, dtype=torch.int32)),
                           "pos"),
    "norm_qkv:rope_table dtype": (CODA.norm_qkv, _norm_qkv_bad(
        rope_table=torch.zeros(2, 32, dtype=torch.int64)), "rope_table"),
    "norm_qkv:x noncontig": (CODA.norm_qkv, _norm_qkv_bad(x=noncontig(torch.randn(5, 16))), "x"),
    "out_proj:w_o shape": (CODA.out_proj_residual_norm, _out_proj_bad(w_o=torch.ones(16, 15)),
                           "w_o"),
    "out_proj:residual dtype": (CODA.out_proj_residual_norm,
                                _out_proj_bad(residual=torch.ones(5, 16, dtype=torch.float64)),
                                "residual"),
    "out_proj:y noncontig": (CODA.out_proj_residual_norm,
                             _out_proj_bad(y=noncontig(torch.randn(5, 16))), "y"),
    "mlp:w_gu shape": (CODA.mlp, _mlp_bad(w_gu=torch.ones(47, 16)), "w_gu"),
    "mlp:w_down shape": (CODA.mlp, _mlp_bad(w_down=torch.ones(16, 23)), "w_down"),
    "mlp:gamma_next dtype": (CODA.mlp, _mlp_bad(gamma_next=torch.ones(16, dtype=torch.float64)),
                             "gamma_next"),
    "mlp:w_gu noncontig": (CODA.mlp, _mlp_bad(w_gu=noncontig(torch.randn(48, 16))), "w_gu"),
    "lm_head_loss:targets dtype": (CODA.lm_head_loss, _lm_bad(targets=torch.zeros(5)), "targets"),
    "lm_head_loss:targets int32": (CODA.lm_head_loss,
                                   _lm_bad(targets=torch.zeros(5, dtype=torch.int32)), "targets"),
    "lm_head_loss:targets shape": (CODA.lm_head_loss,
                                   _lm_bad(targets=torch.zeros(4, dtype=torch.int64)), "targets"),
    "lm_head_loss:targets range": (CODA.lm_head_loss,
                                   _lm_bad(targets=torch.full((5,), 40, dtype=torch.int64)),
                                   "targets"),
    "lm_head_loss:w_vocab noncontig": (CODA.lm_head_loss,
                                       _lm_bad(w_vocab=noncontig(torch.randn(40, 16))), "w_vocab"),
    "lm_head_loss:reduction": (CODA.lm_head_loss,
                               lambda: _lm_bad()() + [-100, "average", 0.0], "reduction"),
    "rope_table:inv_freq dtype": (CODA.rope_table,
                                  lambda: [torch.ones(2, dtype=torch.float32), 4, 2, 4],
                                  "inv_freq"),
    "rope_table:inv_freq shape": (CODA.rope_table,
                                  lambda: [torch.ones(3, dtype=torch.float64), 4, 2, 4],
                                  "inv_freq"),
})


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_names_the_argument(case):
    op, make_args, arg = BAD_CASES[case]
    args = make_args()
    with pytest.raises(RuntimeError, match=rf"\b{arg}\b"):
        op(*args)


def test_a_meta_argument_among_cpu_ones_names_both():
    """The dispatcher picks the Meta kernel when any argument is on meta; mixed with CPU tensors
    it raises instead of returning uninitialized CPU outputs."""
    x = torch.randn(8, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"rmsnorm_stats: x is on cpu but gamma is on meta"):
        CODA.rmsnorm_stats(x, torch.ones(16, dtype=torch.float64, device="meta"), EPS)
    with pytest.raises(RuntimeError, match=r"rmsnorm_stats: gamma is on cpu but x is on meta"):
        CODA.rmsnorm_stats(x.to("meta"), torch.ones(16, dtype=torch.float64), EPS)
    x2, r = CODA.rmsnorm_stats(x.to("meta"), torch.ones(16, dtype=torch.float64, device="meta"),
                               EPS)
    assert x2.device.type == "meta" and x2.shape == x.shape and r.shape == (8,)


@pytest.mark.skipif(
    not torch.cuda.is_available()
    or not torch._C._dispatch_has_kernel_for_dispatch_key("coda::rmsnorm_stats", "CUDA"),
    reason="wrong-device checks need a GPU and a CUDA build of libcoda_torch.so")
def test_bad_device_names_the_argument():
    x = torch.randn(8, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"\bgamma\b"):
        CODA.rmsnorm_stats(x, torch.ones(16, dtype=torch.bfloat16), EPS)


# ---------------------------------------------------------------------------------------------
# coda.nn.NormLMHeadLoss: the loss op as a standalone module


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_norm_lm_head_loss_module(reduction):
    from coda.nn import NormLMHeadLoss

    rnd = Rand(40)
    B, S, H, V = 2, 5, 16, 40
    module = NormLMHeadLoss(H, V, eps=EPS, dtype=torch.float64)
    with torch.no_grad():
        module.gamma.copy_(rnd(H, dtype=torch.float64, scale=0.3, shift=1.0))
    hidden = rnd(B, S, H, dtype=torch.float64).requires_grad_()
    targets = rnd.ints(0, V, B, S)
    targets[0, 1] = -100
    loss = module(hidden, targets, reduction=reduction)
    assert loss.shape == (() if reduction == "mean" else (B, S))
    upstream = torch.ones_like(loss) if reduction == "mean" else rnd(B, S, dtype=torch.float64)
    got = torch.autograd.grad(loss, [hidden, module.gamma, module.w_vocab], upstream)
    gamma = module.gamma.detach().clone().requires_grad_()
    w = module.w_vocab.detach().clone().requires_grad_()
    h2 = hidden.detach().clone().requires_grad_()
    logits = ref_norm(h2.view(-1, H), gamma) @ w.t()
    want = F.cross_entropy(logits, targets.view(-1), reduction=reduction)
    if reduction == "none":
        want = want.view(B, S)
    assert_rel(loss.detach(), want.detach(), 1e-12, "loss")
    for g, wg, what in zip(got, torch.autograd.grad(want, [h2, gamma, w], upstream),
                           ("hidden", "gamma", "w_vocab")):
        assert_rel(g, wg, 1e-9, f"grad {what}")
