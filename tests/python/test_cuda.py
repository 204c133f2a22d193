"""The torch.ops.coda ops and coda.nn on a Hopper GPU (bf16): registration (opcheck), accuracy of
every op and of a whole Hugging Face model (converted, or patched in place) against fp64 references
by the docs/math.md §5 rule, torch.compile(fullgraph=True) with inductor, and a CUDA-graph capture
of a training step.
Skipped without an sm_90 GPU (CI has none; scripts/gpu-check runs these on the H200)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import ops
from helpers import assert_ops_rule
from test_ops_cpu import (
    ref_lm_head,
    ref_mlp_fn,
    ref_mlp_partial_fn,
    ref_norm,
    ref_norm_qkv_fn,
    ref_out_proj_fn,
    ref_r,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU",
)
CODA = torch.ops.coda
EPS = 1e-5
BF16 = torch.bfloat16
# Ragged M (77 is not a multiple of any tile); widths multiples of 8 (16 for 2I) as TMA needs.
S = dict(M=77, H=256, I=344, hq=4, hkv=2, d=64, V=1000)
# K > 2048 switches the scheduler options the heuristic picks (padded tile grids: NaNs in F4 / B4
# once wrote past their partial buffers there).
S_WIDE = dict(M=300, H=4096, I=1536, hq=32, hkv=8, d=128, V=4000)
OP_SHAPES = pytest.mark.parametrize("s", [S, S_WIDE], ids=["H256", "H4096"])


def rand(*size, scale=1.0, shift=0.0, gen):
    t = torch.randn(*size, generator=gen, dtype=torch.float64) * scale + shift
    return t.to(BF16).cuda()


def caches(x, gamma):
    """(h, r) as the producing op hands them on: h in bf16, r in fp32."""
    return x * gamma, ref_r(x.float())


def grads_of(fn, inputs, names, upstream):
    """Outputs of fn(**inputs) and d(Σ upstream·out)/d inputs[names]."""
    leaves = {k: (v.detach().clone().requires_grad_(k in names) if v.is_floating_point() else v)
              for k, v in inputs.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not names:
        return [o.detach() for o in outs], {}
    total = sum((o.double() * u).sum() for o, u in zip(outs, upstream) if u is not None)
    grads = torch.autograd.grad(total, [leaves[n] for n in names])
    return [o.detach() for o in outs], dict(zip(names, grads))


def check_op(name, ours_fn, ref_fn, inputs, diff_names, n_diff_out, seed=0):
    """ours (CUDA bf16) vs ref in fp64 on the CPU, with PyTorch's bf16 unfused result as the bar."""
    gen = torch.Generator().manual_seed(seed)
    outs_bf, _ = grads_of(ours_fn, inputs, [], [])
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64).cuda() if i < n_diff_out
                else None for i, o in enumerate(outs_bf)]
    ours, g_ours = grads_of(ours_fn, inputs, diff_names, upstream)
    plain, g_plain = grads_of(ref_fn, inputs, diff_names, upstream)
    cpu64 = {k: (v.double().cpu() if v.is_floating_point() else v.cpu()) for k, v in inputs.items()}
    ref, g_ref = grads_of(ref_fn, cpu64, diff_names, [u.cpu() if u is not None else None
                                                      for u in upstream])
    for i, (o, p, r) in enumerate(zip(ours, plain, ref)):
        assert torch.isfinite(o.float()).all(), f"{name} output {i} has NaN/inf"
        assert_ops_rule(o.cpu(), r, p.cpu(), f"{name} output {i}")
    for n in diff_names:
        assert_ops_rule(g_ours[n].cpu(), g_ref[n], g_plain[n].cpu(), f"{name} d{n}")


def qkv_inputs(gen, s=S, bias=False):
    """norm_qkv's arguments; with `bias` a Q/K/V bias (Qwen2) several times the projection."""
    W = (s["hq"] + 2 * s["hkv"]) * s["d"]
    x = rand(s["M"], s["H"], gen=gen)
    gamma = rand(s["H"], scale=0.3, shift=1.0, gen=gen)
    h, r = caches(x, gamma)
    out = dict(x=x, gamma=gamma, w_qkv=rand(W, s["H"], scale=s["H"] ** -0.5, gen=gen), h=h, r=r,
               pos=torch.randint(0, 131072, (s["M"],), generator=gen, dtype=torch.int32).cuda(),
               rope_table=ops.rope_table(ops.rope_inv_freq(s["d"], 500000.0, {
                   "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}), s["hq"], s["hkv"], s["d"]).cuda())
    if bias:
        out["b_qkv"] = rand(W, scale=3.0, gen=gen)
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@OP_SHAPES
def test_norm_qkv_matches_fp64_reference(s, bias):
    gen = torch.Generator().manual_seed(1)
    inp = qkv_inputs(gen, s, bias)
    inv = ops.rope_inv_freq(s["d"], 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192})

    def ref(**a):  # the frequencies go where the inputs are (CPU fp64 or CUDA bf16)
        return ref_norm_qkv_fn(s, inv.to(a["x"].device))(**a)

    check_op("norm_qkv", CODA.norm_qkv, ref, inp, ["x", "gamma", "w_qkv"] + ["b_qkv"] * bias, 1)


@OP_SHAPES
def test_norm_qkv_qk_norm_matches_fp64_reference(s):
    """Qwen3's QK-norm: F3q (per-head RMSNorm in F3's epilogue) and B3q; qkv, the saved pre-norm
    Q and K columns, and every gradient by the §5 rule."""
    from test_qk_norm_cpu import ref_norm_qkv_qk_norm_fn

    gen = torch.Generator().manual_seed(9)
    inp = qkv_inputs(gen, s)
    inp["q_gamma"] = rand(s["d"], scale=0.3, shift=1.0, gen=gen)
    inp["k_gamma"] = rand(s["d"], scale=0.3, shift=1.0, gen=gen)
    inv = ops.rope_inv_freq(s["d"], 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192})
    sizes = dict(n_heads=s["hq"], n_kv_heads=s["hkv"], eps=1e-6)
    normed = (s["hq"] + s["hkv"]) * s["d"]

    def ours(**a):
        return CODA.norm_qkv_qk_norm(**a, **sizes)

    def ref(**a):
        qkv = ref_norm_qkv_qk_norm_fn(s, inv.to(a["x"].device))(**a, **sizes)
        return qkv, (ref_norm(a["x"], a["gamma"]) @ a["w_qkv"].t())[:, :normed]

    check_op("norm_qkv_qk_norm", ours, ref, inp, ["x", "gamma", "w_qkv", "q_gamma", "k_gamma"],
             1)


@OP_SHAPES
def test_out_proj_residual_norm_matches_fp64_reference(s):
    gen = torch.Generator().manual_seed(2)
    K = s["hq"] * s["d"]
    inp = dict(y=rand(s["M"], K, gen=gen), w_o=rand(s["H"], K, scale=K ** -0.5, gen=gen),
               residual=rand(s["M"], s["H"], gen=gen),
               gamma=rand(s["H"], scale=0.3, shift=1.0, gen=gen))

    def ours(y, w_o, residual, gamma):
        return CODA.out_proj_residual_norm(y, w_o, residual, gamma, EPS)

    def ref(y, w_o, residual, gamma):
        x, h, r = ref_out_proj_fn(y, w_o, residual, gamma)
        return x, h, r.float() if r.dtype == BF16 else r

    check_op("out_proj_residual_norm", ours, ref, inp, ["y", "w_o", "residual"], 1)


def mlp_inputs(s, seed):
    """x, gamma, w_gu, w_down and the caches h, r of one MLP op (mlp adds gamma_next)."""
    gen = torch.Generator().manual_seed(seed)
    x = rand(s["M"], s["H"], gen=gen)
    gamma = rand(s["H"], scale=0.3, shift=1.0, gen=gen)
    h, r = caches(x, gamma)
    return dict(x=x, gamma=gamma, w_gu=rand(2 * s["I"], s["H"], scale=s["H"] ** -0.5, gen=gen),
                w_down=rand(s["H"], s["I"], scale=s["I"] ** -0.5, gen=gen), h=h, r=r), gen


@OP_SHAPES
def test_mlp_matches_fp64_reference(s):
    inp, gen = mlp_inputs(s, 3)
    inp["gamma_next"] = rand(s["H"], scale=0.3, shift=1.0, gen=gen)

    def ours(**a):
        return CODA.mlp(**a, eps=EPS)

    def ref(**a):
        x_out, h_out, r_out, z = ref_mlp_fn(**a)
        return x_out, h_out, r_out.float() if r_out.dtype == BF16 else r_out, z

    check_op("mlp", ours, ref, inp, ["x", "gamma", "w_gu", "w_down"], 1)


@OP_SHAPES
def test_mlp_partial_matches_fp64_reference(s):
    inp, _ = mlp_inputs(s, 4)
    check_op("mlp_partial", lambda **a: CODA.mlp_partial(**a), ref_mlp_partial_fn, inp,
             ["x", "gamma", "w_gu", "w_down"], 1)


def check_lm_head(s, reduction, z_loss, chunk_bytes, seed=4, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    x = rand(s["M"], s["H"], gen=gen)
    gamma = rand(s["H"], scale=0.3, shift=1.0, gen=gen)
    h, r = caches(x, gamma)
    targets = torch.randint(0, s["V"], (s["M"],), generator=gen)
    targets[::5] = ignore_index
    targets[1] = s["V"] - 1  # the last column (alone in its pair at an odd vocabulary)
    inp = dict(x=x, gamma=gamma, w_vocab=rand(s["V"], s["H"], scale=s["H"] ** -0.5, gen=gen),
               h=h, r=r, targets=targets.cuda())

    def ours(x, gamma, w_vocab, h, r, targets):
        return CODA.lm_head_loss(x, gamma, w_vocab, h, r, targets, ignore_index, reduction,
                                 z_loss, chunk_bytes)

    def ref(x, gamma, w_vocab, h, r, targets):
        if x.dtype == torch.float64:
            return ref_lm_head(x, gamma, w_vocab, targets, ignore_index, reduction, z_loss)
        # What a PyTorch user runs today: bf16 norm and logits, the loss on fp32 logits.
        logits = (ref_norm(x, gamma) @ w_vocab.t()).float()
        keep = targets != ignore_index
        lse = torch.logsumexp(logits, -1)
        picked = logits.gather(1, torch.where(keep, targets, 0)[:, None])[:, 0]
        tok = torch.where(keep, lse - picked + z_loss * lse * lse, torch.zeros_like(lse))
        loss = {"mean": tok.sum() / keep.sum(), "sum": tok.sum(), "none": tok}[reduction]
        return loss, lse

    check_op("lm_head_loss", ours, ref, inp, ["x", "gamma", "w_vocab"], 1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
# 1 GiB: one chunk. 32000 B: mean / sum (the three-GEMM path) run 8-token chunks, so dW
# accumulates over 10 of them (the last 5 tokens); 'none' (the recompute path) runs 8-column
# vocabulary slices.
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 16 * 1000 * 2])
# The three-GEMM path forms lse and dℓ after a plain GEMM at H <= 2048 and in F4's epilogue above.
@pytest.mark.parametrize("hidden", [256, 2304], ids=["plain-gemm-lse", "f4-lse"])
def test_lm_head_loss_matches_fp64_reference(reduction, z_loss, chunk_bytes, hidden):
    if hidden != S["H"] and chunk_bytes < 1 << 30:
        chunk_bytes = 8 * (S["V"] + hidden) * 2  # 8-token chunks at this hidden size too
    check_lm_head(dict(S, H=hidden), reduction, z_loss, chunk_bytes)


@pytest.mark.parametrize("vocab", [50257, 32001, 1001])
@pytest.mark.parametrize("reduction,chunked", [("mean", True), ("none", False), ("none", True)])
@pytest.mark.parametrize("hidden", [256, 2304], ids=["plain-gemm-lse", "f4-lse"])
def test_lm_head_loss_at_an_odd_vocabulary(vocab, reduction, chunked, hidden):
    """Odd vocabularies: the logits' scratch rows padded to 16 bytes. mean: the three-GEMM path
    (row kernel or F4 + B4 from logits) in 8-token chunks; none: B4 recomputing dℓ over the
    whole vocabulary or over 8-aligned slices whose last is odd."""
    s = dict(S, H=hidden, V=vocab)
    if reduction == "mean":
        chunk_bytes = 8 * (vocab + hidden) * 2 if chunked else 1 << 30
    else:  # 'none' slices the vocabulary: about 3 slices, the last one odd
        chunk_bytes = S["M"] * hidden * 6 + S["M"] * (vocab // 3 // 8 * 8 + 8) * 2 if chunked \
            else 1 << 30
    check_lm_head(s, reduction, 1e-3, chunk_bytes, seed=13)


@pytest.mark.parametrize("hidden", [256, 2304], ids=["plain-gemm-lse", "f4-lse"])
def test_lm_head_loss_with_an_ignore_index_inside_the_vocabulary(hidden):
    """ignore_index = 3, a real column: its tokens count nothing (loss and one-hot), and column 3
    of every other token's gradient is an ordinary softmax column."""
    check_lm_head(dict(S, H=hidden), "mean", 1e-3, 8 * (S["V"] + hidden) * 2, seed=9,
                  ignore_index=3)


def test_lm_head_loss_three_gemm_path_at_hidden_2048():
    """The mean gradient formed in the forward at H = 2048 (the largest hidden size whose lse and
    dℓ come from the plain GEMM's logits; the K > 2048 scheduler options) with ragged token
    chunks: 340 tokens in chunks of 40, the last 20."""
    check_lm_head(dict(M=340, H=2048, V=4000), "mean", 1e-3, 40 * (4000 + 2048) * 2, seed=12)


@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_lm_head_loss_at_llama_hidden_sizes(hidden):
    """K > 2048 runs other scheduler options than the small shapes above (padded tile grids)."""
    gen = torch.Generator().manual_seed(10)
    M, V = 300, 4000
    x = rand(M, hidden, gen=gen).requires_grad_()
    gamma = rand(hidden, scale=0.1, shift=1.0, gen=gen)
    w = rand(V, hidden, scale=hidden ** -0.5, gen=gen).requires_grad_()
    h, r = caches(x.detach(), gamma)
    t = torch.randint(0, V, (M,), generator=gen).cuda()
    loss, lse = CODA.lm_head_loss(x, gamma, w, h, r, t)
    loss.backward()
    logits = (x.detach().double() * r.double()[:, None] * gamma.double()) @ w.detach().double().t()
    ref_lse = torch.logsumexp(logits, -1)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    assert abs(loss.item() - F.cross_entropy(logits, t).item()) < 2e-2
    for name, g in (("dx", x.grad), ("dw", w.grad)):
        assert torch.isfinite(g.float()).all(), f"{name} has NaN/inf"


@pytest.mark.parametrize("reduction,expect", [("mean", "nan"), ("sum", 0.0)])
def test_lm_head_loss_all_ignored_matches_pytorch(reduction, expect):
    gen = torch.Generator().manual_seed(5)
    x = rand(S["M"], S["H"], gen=gen).requires_grad_()
    gamma = rand(S["H"], scale=0.3, shift=1.0, gen=gen)
    w = rand(S["V"], S["H"], gen=gen).requires_grad_()
    h, r = caches(x.detach(), gamma)
    t = torch.full((S["M"],), -100, device="cuda")
    loss, _ = CODA.lm_head_loss(x, gamma, w, h, r, t, -100, reduction)
    pt = F.cross_entropy(torch.zeros(S["M"], S["V"], device="cuda"), t, reduction=reduction)
    if expect == "nan":
        assert torch.isnan(loss) and torch.isnan(pt)
    else:
        assert loss.item() == 0.0 == pt.item()
        loss.backward()
        assert x.grad.abs().max().item() == 0.0 and w.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("hidden", [256, 2304], ids=["plain-gemm-lse", "f4-lse"])
def test_lm_head_loss_extreme_logits_stay_finite(hidden):
    gen = torch.Generator().manual_seed(6)
    s = dict(S, H=hidden)
    x = rand(s["M"], s["H"], gen=gen).requires_grad_()
    gamma = torch.ones(s["H"], dtype=BF16, device="cuda")
    # Rows of ±1e4/√H-ish weights: logits around ±1e4.
    w = (torch.sign(torch.randn(s["V"], s["H"], generator=gen)) * 1e4 / s["H"] ** 0.5 * 0.3)
    w = w.to(BF16).cuda().requires_grad_()
    h, r = caches(x.detach(), gamma)
    t = torch.randint(0, s["V"], (s["M"],), generator=gen).cuda()
    loss, lse = CODA.lm_head_loss(x, gamma, w, h, r, t)
    loss.backward()
    assert lse.abs().max().item() > 1e3, "the test did not reach extreme logits"
    for name, v in (("loss", loss), ("lse", lse), ("dx", x.grad), ("dw", w.grad)):
        assert torch.isfinite(v.float()).all(), f"{name} has NaN/inf"
    logits = (x.detach().float() * r[:, None]) @ w.detach().float().t()
    pt = F.cross_entropy(logits, t)
    assert abs(loss.item() - pt.item()) <= 1e-2 * abs(pt.item()) + 1.0


def test_lm_head_loss_invalid_target_gives_nan_not_garbage():
    gen = torch.Generator().manual_seed(7)
    x = rand(S["M"], S["H"], gen=gen)
    gamma = torch.ones(S["H"], dtype=BF16, device="cuda")
    w = rand(S["V"], S["H"], gen=gen)
    h, r = caches(x, gamma)
    t = torch.randint(0, S["V"], (S["M"],), generator=gen).cuda()
    t[3] = S["V"] + 5
    loss, _ = CODA.lm_head_loss(x, gamma, w, h, r, t, -100, "none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[:3]).all()


def test_opcheck_every_op_on_cuda():
    gen = torch.Generator().manual_seed(8)
    q = qkv_inputs(gen)
    for k in ("x", "gamma", "w_qkv"):
        q[k] = q[k].requires_grad_()
    torch.library.opcheck(CODA.norm_qkv, tuple(q.values()))
    qb = qkv_inputs(gen, bias=True)
    for k in ("x", "gamma", "w_qkv", "b_qkv"):
        qb[k] = qb[k].requires_grad_()
    torch.library.opcheck(CODA.norm_qkv, tuple(qb.values()))
    K = S["hq"] * S["d"]
    y, w_o = rand(S["M"], K, gen=gen).requires_grad_(), rand(S["H"], K, gen=gen).requires_grad_()
    res = rand(S["M"], S["H"], gen=gen).requires_grad_()
    gamma = rand(S["H"], shift=1.0, scale=0.3, gen=gen)
    torch.library.opcheck(CODA.out_proj_residual_norm, (y, w_o, res, gamma, EPS))
    x = rand(S["M"], S["H"], gen=gen)
    h, r = caches(x, gamma)
    w_gu = rand(2 * S["I"], S["H"], scale=0.06, gen=gen).requires_grad_()
    w_down = rand(S["H"], S["I"], scale=0.05, gen=gen).requires_grad_()
    torch.library.opcheck(CODA.mlp, (x.requires_grad_(), gamma, w_gu, w_down, h, r, gamma, EPS))
    torch.library.opcheck(CODA.mlp_partial, (x, gamma, w_gu, w_down, h, r))
    torch.library.opcheck(CODA.rmsnorm_stats, (x.detach(), gamma, EPS))
    w_v = rand(S["V"], S["H"], scale=0.06, gen=gen).requires_grad_()
    t = torch.randint(0, S["V"], (S["M"],), generator=gen).cuda()
    torch.library.opcheck(CODA.lm_head_loss, (x.detach().requires_grad_(), gamma, w_v, h, r, t))
    # The backward ops, called directly.
    dq = rand(S["M"], q["w_qkv"].shape[0], gen=gen)
    qkv = CODA.norm_qkv(*[v.detach() for v in q.values()])
    torch.library.opcheck(CODA.norm_qkv_backward, (dq, qkv, q["x"].detach(), q["gamma"].detach(),
                                                   q["w_qkv"].detach(), q["r"], q["pos"],
                                                   q["rope_table"]))
    qkv_b = CODA.norm_qkv(*[v.detach() for v in qb.values()])
    torch.library.opcheck(CODA.norm_qkv_backward,
                          (dq, qkv_b, qb["x"].detach(), qb["gamma"].detach(),
                           qb["w_qkv"].detach(), qb["r"], qb["pos"], qb["rope_table"],
                           qb["b_qkv"].detach()))
    qn = qkv_inputs(gen)
    for k in ("x", "gamma", "w_qkv"):
        qn[k] = qn[k].requires_grad_()
    qn["q_gamma"] = rand(S["d"], scale=0.3, shift=1.0, gen=gen).requires_grad_()
    qn["k_gamma"] = rand(S["d"], scale=0.3, shift=1.0, gen=gen).requires_grad_()
    torch.library.opcheck(CODA.norm_qkv_qk_norm, (*qn.values(), S["hq"], S["hkv"], 1e-6))
    plain_qn = [v.detach() for v in qn.values()]
    qkv_n, pre_n = CODA.norm_qkv_qk_norm(*plain_qn, S["hq"], S["hkv"], 1e-6)
    torch.library.opcheck(CODA.norm_qkv_qk_norm_backward,
                          (dq, qkv_n, pre_n, *plain_qn[:3], *plain_qn[4:], S["hq"], S["hkv"],
                           1e-6))
    torch.library.opcheck(CODA.linear_backward, (rand(S["M"], S["H"], gen=gen), y.detach(),
                                                 w_o.detach()))
    z = CODA.mlp(x.detach(), gamma, w_gu.detach(), w_down.detach(), h, r, gamma, EPS)[3]
    torch.library.opcheck(CODA.mlp_backward, (rand(S["M"], S["H"], gen=gen), x.detach(), gamma,
                                              w_gu.detach(), w_down.detach(), r, z))
    torch.library.opcheck(CODA.mlp_backward, (rand(S["M"], S["H"], gen=gen), x.detach(), gamma,
                                              w_gu.detach(), w_down.detach(), r, z, False))
    _, lse = CODA.lm_head_loss(x.detach(), gamma, w_v.detach(), h, r, t)
    torch.library.opcheck(CODA.lm_head_loss_backward,
                          (torch.ones((), device="cuda"), x.detach(), gamma, w_v.detach(), h, r,
                           t, lse, -100, "mean", 0.0, 1 << 30))


def test_bad_cuda_inputs_name_the_argument():
    x = torch.randn(77, 256, device="cuda").to(BF16)
    g = torch.ones(256, device="cuda", dtype=BF16)
    with pytest.raises(RuntimeError, match="x must be bfloat16 on CUDA"):
        CODA.rmsnorm_stats(x.float(), g.float(), EPS)
    with pytest.raises(RuntimeError, match="gamma is on cpu"):
        CODA.rmsnorm_stats(x, g.cpu(), EPS)
    with pytest.raises(RuntimeError, match="hidden .* must be a multiple of 8"):
        CODA.rmsnorm_stats(x[:, :250].contiguous(), g[:250].contiguous(), EPS)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        CODA.rmsnorm_stats(x.t().contiguous().t(), g, EPS)


def capture_matches_eager(fn):
    """fn() -> tensors; run eagerly, then captured in a CUDA graph and replayed: identical.

    fn must return detached tensors: an autograd graph kept alive from the eager run keeps its
    AccumulateGrad nodes, whose stream (the legacy default stream) the capture would then join."""
    expected = [t.clone() for t in fn()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    torch.cuda.synchronize()
    return [torch.equal(a, b) for a, b in zip(static, expected)]


def op_cases(gen):
    """(name, forward fn, differentiable inputs) for every differentiable op."""
    q = qkv_inputs(gen)
    K = S["hq"] * S["d"]
    y, w_o = rand(S["M"], K, gen=gen), rand(S["H"], K, scale=K ** -0.5, gen=gen)
    res, gamma = rand(S["M"], S["H"], gen=gen), rand(S["H"], shift=1.0, scale=0.3, gen=gen)
    x = rand(S["M"], S["H"], gen=gen)
    h, r = caches(x, gamma)
    w_gu = rand(2 * S["I"], S["H"], scale=0.06, gen=gen)
    w_down = rand(S["H"], S["I"], scale=0.05, gen=gen)
    w_v = rand(S["V"], S["H"], scale=0.06, gen=gen)
    t = torch.randint(0, S["V"], (S["M"],), generator=gen).cuda()
    t[::7] = -100
    return [
        ("norm_qkv", lambda a, b, c: CODA.norm_qkv(a, b, c, q["h"], q["r"], q["pos"],
                                                   q["rope_table"]),
         [q["x"], q["gamma"], q["w_qkv"]]),
        ("out_proj_residual_norm", lambda a, b, c: CODA.out_proj_residual_norm(a, b, c, gamma,
                                                                               EPS)[0],
         [y, w_o, res]),
        ("mlp", lambda a, b, c, d: CODA.mlp(a, b, c, d, h, r, gamma, EPS)[0],
         [x, gamma, w_gu, w_down]),
        ("lm_head_loss", lambda a, b, c: CODA.lm_head_loss(a, b, c, h, r, t)[0], [x, gamma, w_v]),
        ("lm_head_loss chunked", lambda a, b, c: CODA.lm_head_loss(
            a, b, c, h, r, t, -100, "mean", 0.0, 16 * S["V"] * 2)[0], [x, gamma, w_v]),
    ]


@pytest.mark.parametrize("case", range(5))
def test_each_op_forward_and_backward_capture_in_a_cuda_graph(case):
    name, fwd, inputs = op_cases(torch.Generator().manual_seed(9))[case]
    leaves = [v.detach().clone().requires_grad_() for v in inputs]
    up = torch.randn(fwd(*leaves).shape, device="cuda", dtype=torch.float32)

    def fn():
        out = fwd(*leaves)
        grads = torch.autograd.grad((out.float() * up).sum(), leaves)
        return [out.detach(), *grads]

    same = capture_matches_eager(fn)
    assert all(same), f"{name}: graph replay differs from eager for outputs {same}"


# ---- whole model ---------------------------------------------------------------------------------


def hf_llama(tie, scaling, dtype, device, seed=0, vocab=S["V"], qwen2=False, qwen3=False):
    """A small HF LlamaForCausalLM, or with `qwen2` a Qwen2ForCausalLM (Q/K/V biases), with
    `qwen3` a Qwen3ForCausalLM (QK-norm)."""
    import transformers

    HFConfig = (transformers.Qwen2Config if qwen2 else transformers.Qwen3Config if qwen3 else
                transformers.LlamaConfig)
    cfg = HFConfig(vocab_size=vocab, hidden_size=S["H"], intermediate_size=S["I"],
                   num_hidden_layers=2, num_attention_heads=S["hq"],
                   num_key_value_heads=S["hkv"], head_dim=S["d"], rms_norm_eps=EPS,
                   tie_word_embeddings=tie, attn_implementation="sdpa",
                   rope_parameters=({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64} if scaling else
                                    {"rope_type": "default", "rope_theta": 10000.0}))
    torch.manual_seed(seed)
    model_class = (transformers.Qwen2ForCausalLM if qwen2 else transformers.Qwen3ForCausalLM
                   if qwen3 else transformers.LlamaForCausalLM)
    model = model_class(cfg).to(torch.float64)
    with torch.no_grad():  # non-trivial norm weights so that every γ gradient matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):  # HF initializes biases to 0; trained ones are not
                p.normal_(0.0, 1.0)
    return model.to(dtype=dtype, device=device)


def hf_references(ids, labels, tie, scaling, **kw):
    """The same HF model in fp64 on the CPU and in bf16 on CUDA, each after its training step on
    (ids, labels): (fp64 model, its loss, bf16 model, its loss)."""
    out = []
    for dtype, device in ((torch.float64, "cpu"), (BF16, "cuda")):
        model = hf_llama(tie, scaling, dtype, device, **kw)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        out += [model, loss]
    return tuple(out)


def hf_grads(model):
    return {n: p.grad for n, p in model.state_dict(keep_vars=True).items() if p.grad is not None}


def coda_grads_as_hf(model):
    sd = {n: p.grad for n, p in model.state_dict(keep_vars=True).items()
          if isinstance(p, torch.nn.Parameter)}
    return coda.convert.coda_to_hf_state_dict(sd, model.config)


def batch(seed=0, B=2, Sq=64, vocab=S["V"]):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, Sq), generator=gen)
    labels = ids.clone()
    labels[0, 10:20] = -100
    return ids, labels


@pytest.mark.parametrize("tie,scaling", [(False, False), (True, True)])
def test_converted_hf_model_loss_and_every_gradient(tie, scaling):
    ids, labels = batch()
    ref = hf_llama(tie, scaling, torch.float64, "cpu")
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    plain = hf_llama(tie, scaling, BF16, "cuda")
    pt_loss = plain(input_ids=ids.cuda(), labels=labels.cuda()).loss
    pt_loss.backward()
    ours_model = coda.convert.from_hf(hf_llama(tie, scaling, BF16, "cuda"))
    loss = ours_model(ids.cuda(), labels.cuda())
    loss.backward()
    assert_ops_rule(loss.detach().cpu(), ref_loss.detach(), pt_loss.detach().cpu(), "loss")
    g_ref, g_pt, g_ours = hf_grads(ref), hf_grads(plain), coda_grads_as_hf(ours_model)
    assert set(g_ours) >= set(g_ref), sorted(set(g_ref) - set(g_ours))
    for n in g_ref:
        assert_ops_rule(g_ours[n].cpu(), g_ref[n], g_pt[n].cpu(), f"d {n}")


@pytest.mark.parametrize("params", ["bf16", "fp32-autocast"])
def test_hf_model_patched_in_place_loss_and_every_gradient(params):
    """coda.integrations.patch_hf on CUDA: bfloat16 parameters, or float32 ones under bfloat16
    autocast (Trainer's bf16=True), by the §5 rule against HF with bfloat16 parameters (the op's
    own dtype; HF under autocast keeps a float32 residual stream, which coda does not)."""
    from coda.integrations import patch_hf

    ids, labels = batch(2)
    ids, labels = ids.cuda(), labels.cuda()
    ref = hf_llama(False, True, torch.float64, "cpu")
    ref_loss = ref(input_ids=ids.cpu(), labels=labels.cpu()).loss
    ref_loss.backward()
    dtype = BF16 if params == "bf16" else torch.float32
    plain = hf_llama(False, True, BF16, "cuda")
    ours = patch_hf(hf_llama(False, True, dtype, "cuda"))
    losses = []
    for model in (plain, ours):
        with torch.autocast("cuda", BF16, enabled=model is ours and params != "bf16"):
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach().float().cpu())
    assert out.logits is None, "the patched model took the fused path"
    assert_ops_rule(losses[1], ref_loss.detach(), losses[0], "loss")
    g_ref, g_pt, g_ours = hf_grads(ref), hf_grads(plain), hf_grads(ours)
    assert set(g_ours) == set(g_ref)
    for n in g_ref:
        assert g_ours[n].dtype == dtype, f"d {n} in {g_ours[n].dtype}"
        assert_ops_rule(g_ours[n].float().cpu(), g_ref[n], g_pt[n].float().cpu(), f"d {n}")


@pytest.mark.parametrize("vocab,tie", [(50257, True), (32001, False)])
def test_hf_model_patched_in_place_at_an_odd_vocabulary(vocab, tie):
    """GPT-2's vocabulary (tied) and LLaMA's 32000 plus a pad token: the logits' scratch rows
    padded to 16 bytes, the LM head's programs masking the last column; loss and every gradient
    by the §5 rule."""
    from coda.integrations import patch_hf

    ids, labels = batch(3, vocab=vocab)
    labels[1, 5] = vocab - 1  # the last column, alone in its pair, is a target
    ref, ref_loss, plain, pt_loss = hf_references(ids, labels, tie, True, vocab=vocab)
    ids, labels = ids.cuda(), labels.cuda()
    ours = patch_hf(hf_llama(tie, True, BF16, "cuda", vocab=vocab))
    out = ours(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None, "the patched model took the fused path"
    assert_ops_rule(out.loss.detach().float().cpu(), ref_loss.detach(),
                    pt_loss.detach().float().cpu(), "loss")
    g_ref, g_pt, g_ours = hf_grads(ref), hf_grads(plain), hf_grads(ours)
    assert set(g_ours) == set(g_ref)
    for n in g_ref:
        assert_ops_rule(g_ours[n].float().cpu(), g_ref[n], g_pt[n].float().cpu(), f"d {n}")


def check_family_model(how, seed, tie, scaling, family, config_flag, grad_suffix):
    """A Qwen-family HF model (`family`: hf_llama's qwen2= / qwen3= flag) in bf16, patched in
    place or converted to coda.nn: loss and every gradient by the §5 rule against the same HF
    model in fp64 and in bf16. The converted config must have `config_flag` set and the
    reference a gradient whose name ends in `grad_suffix` (the family's own parameters)."""
    from coda.integrations import patch_hf

    ids, labels = batch(seed)
    ref, ref_loss, plain, pt_loss = hf_references(ids, labels, tie, scaling, **{family: True})
    ids, labels = ids.cuda(), labels.cuda()
    model = hf_llama(tie, scaling, BF16, "cuda", **{family: True})
    if how == "patched":
        ours = patch_hf(model)
        out = ours(input_ids=ids, labels=labels)
        assert out.logits is None, "the patched model took the fused path"
        loss = out.loss
    else:
        ours = coda.convert.from_hf(model)
        assert getattr(ours.config, config_flag)
        loss = ours(ids, labels)
    loss.backward()
    assert_ops_rule(loss.detach().float().cpu(), ref_loss.detach(),
                    pt_loss.detach().float().cpu(), "loss")
    g_ref, g_pt = hf_grads(ref), hf_grads(plain)
    g_ours = hf_grads(ours) if how == "patched" else coda_grads_as_hf(ours)
    assert {n for n in g_ref if n.endswith(grad_suffix)}, f"the reference has no {grad_suffix}"
    assert set(g_ours) >= set(g_ref), sorted(set(g_ref) - set(g_ours))
    for n in g_ref:
        assert_ops_rule(g_ours[n].float().cpu(), g_ref[n], g_pt[n].float().cpu(), f"d {n}")


@pytest.mark.parametrize("how", ["patched", "converted"])
def test_qwen2_model_loss_and_every_gradient(how):
    """Qwen2 (Q/K/V bias added in F3's epilogue before RoPE, its gradient from B3's output): the
    biases' gradients too."""
    check_family_model(how, 4, True, False, "qwen2", "qkv_bias", "bias")


@pytest.mark.parametrize("how", ["patched", "converted"])
def test_qwen3_model_loss_and_every_gradient(how):
    """Qwen3 (QK-norm inside F3's epilogue before RoPE, its backward in B3q): the head norms'
    gradients too."""
    check_family_model(how, 5, False, True, "qwen3", "qk_norm", "q_norm.weight")


def test_torch_compile_fullgraph_inductor_matches_eager():
    ids, labels = batch(1)
    ref = hf_llama(False, True, torch.float64, "cpu")
    ref(input_ids=ids, labels=labels).loss.backward()
    plain = hf_llama(False, True, BF16, "cuda")
    pt_loss = plain(input_ids=ids.cuda(), labels=labels.cuda()).loss
    pt_loss.backward()
    model = coda.convert.from_hf(hf_llama(False, True, BF16, "cuda"))
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    loss = compiled(ids.cuda(), labels.cuda())
    loss.backward()
    g_ref, g_pt, g_ours = hf_grads(ref), hf_grads(plain), coda_grads_as_hf(model)
    for n in g_ref:
        assert_ops_rule(g_ours[n].cpu(), g_ref[n], g_pt[n].cpu(), f"compiled d {n}")


def math_attention(q, k, v):
    """Deterministic attention (no atomics in its backward) for the bit-exact replay check."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ v.float()).to(q.dtype)


def test_training_step_captures_in_a_cuda_graph_and_replays_identically():
    ids, labels = (t.cuda() for t in batch(2))
    model = coda.convert.from_hf(hf_llama(True, True, BF16, "cuda"))
    params = list(model.parameters())

    def step():
        loss = model(ids, labels, attention=math_attention)
        loss.backward()
        return loss.detach()

    # Eager reference (twice: the eager path itself is deterministic).
    expected = []
    for _ in range(2):
        for p in params:
            p.grad = None
        loss = step()  # detached: no eager graph may outlive its step (see capture_matches_eager)
        expected.append([loss.clone()] + [p.grad.clone() for p in params])
    for a, b in zip(*expected):
        assert torch.equal(a, b), "eager step is not deterministic"

    # No host synchronization anywhere in forward + backward: error on any synchronizing call.
    for p in params:
        p.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        got = [static_loss] + [p.grad for p in params]
        for i, (a, b) in enumerate(zip(got, expected[0])):
            assert torch.equal(a, b), f"graph replay differs from eager at output {i}"


def test_scale_grad_skips_one_and_scales_every_element_otherwise():
    """coda::scale_grad_ (the LM head's gradient formed for d loss = 1, scaled in backward): no
    change for g == 1; otherwise bf16(t * g) with g in fp32, on aligned 8-element vectors and on
    the odd tail of an unaligned view."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(8 * 1000 + 13, generator=gen).to(torch.bfloat16).cuda()
    for g in (1.0, 2.5, -0.3):
        for view in (slice(None), slice(1, None)):
            t = base.clone()
            part = t[view]
            want = (part.float() * torch.tensor(g, dtype=torch.float32)).to(torch.bfloat16)
            CODA.scale_grad_(part, torch.tensor(g, device="cuda"))
            assert torch.equal(part, want), f"g={g} view={view}"
            if view == slice(1, None):
                assert t[0] == base[0], "wrote before the view"
