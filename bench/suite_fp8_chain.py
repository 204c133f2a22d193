"""The suite's FP8 layer chain (section fp8-chain, docs/math.md §4 and §6): one layer's chain forward
+ backward in blockwise FP8, against the FP8 GEMM-only floor, our bf16 chain and torchao's float8
training under torch.compile, one process, the variants interleaved.

Chain = out-proj + residual + RMSNorm -> gate/up + SwiGLU -> down-proj + residual + RMSNorm ->
QKV + RoPE, one layer, attention excluded (the chain of bench/suite_chain.py), forward then the
backward from the upstream gradients of x2 (the residual stream) and qkv. LLaMA-3 shapes only.
Variants (each one a whole forward + backward):
  coda_fp8            our FP8 block ops through autograd (torch.ops.coda fp8_out_proj_residual_norm
                      -> fp8_mlp -> fp8_norm_qkv); the weights' FP8 caches (fp8_quantize_blocks,
                      128x128 blocks) made once, outside the timed region, as a training step
                      quantizes its weights once per optimizer step; wᵀ's codes transposed from
                      them in the backward (fp8_transpose_blocks), as the model does
  coda_fp8_z          the same with the MLP's z saved in FP8 (fp8_mlp's fp8_z: F2 quantizes z
                      in its epilogue, B2 decodes it; the gradients at the decoded z, checked
                      against the same bound)
  coda_fp8_cutlass    the same with the weight gradients on our CUTLASS kernel
                      (coda::set_fp8_wgrad_backend "cutlass"; coda_fp8 runs them on the op's
                      default backend, cuBLASLt's blockwise GEMM, or on whatever CODA_FP8_WGRAD
                      names)
  coda_fp8_wcast      the same with the four weight casts (fp8_quantize_blocks) inside the timed
                      step: a step of one micro-batch per optimizer step, as torchao's chain runs
                      (it casts its weights in every forward)
  fp8_floor           the FP8 GEMM-only floor on cuBLASLt's blockwise GEMM (torch._scaled_mm with
                      1x128 / 128x128 scales): the chain's 4 forward, 4 data-gradient and 4
                      weight-gradient GEMMs (wgrad: both operands 1x128 along the tokens, as the
                      fp8 section's wgrad rows), every operand quantized outside the timed region
  fp8_floor_coda      the same 12 GEMMs on our FP8 GEMMs (fp8_gemm, fp8_gemm_xyt)
  coda_bf16           our bf16 block ops through autograd (out_proj_residual_norm -> mlp -> norm_qkv,
                      the chain section's `coda`)
  bf16_floor          the same 12 GEMMs in bf16 on cuBLAS (the chain section's `gemm_only`)
  torchao_tensorwise  the unfused PyTorch chain (HF-style RMSNorm, SwiGLU, RoPE; suite_chain's
  torchao_rowwise     make_chain) as a module whose four projections torchao's
                      convert_to_float8_training turned into Float8Linear
                      (Float8LinearConfig.from_recipe_name("tensorwise" / "rowwise")), the whole
                      module torch.compile'd (default mode); absent (with the reason) when torchao
                      cannot be imported
Checks, before anything is timed (a failed check prints FAIL and times nothing of that variant):
  - every FP8 chain (coda_fp8, torchao_*): x2, qkv and the gradients of y, x0, every weight and
    both γ against an fp32 evaluation of the same chain (fp64 on the CPU) through autograd, by
    relative Frobenius error ||out - ref|| / ||ref||. Bound: FP8_TOL = 0.1 where every operand is
    e4m3 (ours, torchao rowwise): blockwise e4m3 on both operands of a GEMM gives 2-4% relative
    error per GEMM (3 mantissa bits; the fp8 section measured 3.8% on every projection), and a
    gradient passes through up to four quantized GEMMs (dW_o: the qkv, down and gate/up data
    gradients, then its own), so a correct chain lands at ~3-8% while a wrong layout, scale or
    missing term lands near 100%. torchao's tensorwise recipe casts the output gradients to e5m2
    (2 mantissa bits: twice the rounding error), so its gradients get 2 x FP8_TOL.
  - coda_bf16: every gradient's max |err| within 2 x eager bf16's + 1e-6 (the chain section's rule).
  - the floors: each of the 12 FP8 GEMMs, ours and cuBLASLt's, within FP8_TOL (relative Frobenius)
    of the bf16 GEMM on the unquantized operands, and ours within 1e-2 of cuBLASLt's on the same
    codes and scales (the fp8 section's rule); bf16_floor is that reference itself.
Row (section "fp8_chain"): ms_<variant>, check and rel_err per variant, and the issue's ratios
(reported, not asserted): fp8_over_floor (coda_fp8 / fp8_floor; target <= 1.08),
fp8_over_floor_coda, speedup_vs_torchao (best torchao variant / coda_fp8; target >= 1.5 at 1B,
1.25 at 8B and 70B), speedup_vs_torchao_wcast (the same against coda_fp8_wcast: weights cast in
the step on both sides), speedup_vs_coda_bf16 (target >= 1.35 at 8B and 70B).

`python3 bench/suite_fp8_chain.py --cpu-check` runs every check (no timing) at a tiny shape on the
CPU: the CPU kernels of the ops, torchao in its emulation mode.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":  # run as a script: suite_chain beside it, a source checkout's coda
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import suite_chain as cb  # noqa: E402
from suite_chain import EPS, MODELS, bench_interleaved, rms_norm, rope_hf  # noqa: E402
from suite_fp8 import on_wgrad_backend, rel_err, scaled_mm  # noqa: E402

CODA = torch.ops.coda
NAN = float("nan")
FP8_TOL = 0.1
LT_TOL = 1e-2  # ours vs cuBLASLt on the same codes (suite_fp8's rule)
# The four FP8 ops of the chain; coda_fp8 is absent (with this reason) while any is missing.
FP8_BLOCK_OPS = ("fp8_out_proj_residual_norm", "fp8_mlp", "fp8_norm_qkv", "fp8_quantize_blocks",
                 "fp8_transpose_blocks")
# Gradient names in the HF layouts (suite_chain_fwd_bwd's order), then the two outputs.
GRADS = ("y", "x0", "wo", "g_ffn", "wgu", "wd", "g_attn", "wqkv")
OUTPUTS = ("x2", "qkv")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
# The targets, reported next to the ratios (never asserted).
TARGETS = {
    "fp8_over_floor_max": 1.08,
    "speedup_vs_torchao_min": {"llama3-1B": 1.5, "llama3-8B": 1.25, "llama3-70B": 1.25},
    "speedup_vs_coda_bf16_min": {"llama3-8B": 1.35, "llama3-70B": 1.35},
}
PROJECTIONS = ("out-proj", "gate/up", "down-proj", "qkv")


def max_err(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def missing_fp8_ops():
    """The FP8 block ops this build lacks (empty when coda_fp8 can run)."""
    return [n for n in FP8_BLOCK_OPS if not hasattr(CODA, n)]


def load_torchao(absent):
    """torchao's float8 training API, or None with the reason in `absent` (as suite.py records
    Liger and FlashInfer)."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401

        return torchao
    except Exception as ex:  # noqa: BLE001 - the reason goes into the results file
        absent["torchao"] = f"import torchao.float8 failed: {ex!r}"[:300]
        return None


def to_hf(g):
    """Our layouts' gradients (gate/up rows interleaved, Q/K rows in adjacent RoPE pairs) -> HF's,
    in place of a dict {name: tensor} also holding 'qkv' in our column order; needs g['inv']."""
    inv = g.pop("inv")
    g["wgu"] = torch.cat([g["wgu"][0::2], g["wgu"][1::2]], 0)
    g["wqkv"] = g["wqkv"][inv]
    g["qkv"] = g["qkv"][:, inv]
    return g


def reference(t, dx2_up, dqkv_up, dtype):
    """The chain (suite_chain.make_chain, HF layouts) through autograd in `dtype`: x2, qkv and the
    gradient of every leaf of GRADS."""
    leaves = [v.detach().to(dtype).requires_grad_()
              for v in (t.y, t.x0, t.wo, t.g_ffn, t.wgu_split, t.wd, t.g_attn, t.wqkv_hf)]
    x2, qkv = cb.make_chain(t.hq, t.hkv, t.d, t.inter)(*leaves, t.cos.to(dtype), t.sin.to(dtype))
    g = torch.autograd.grad([x2, qkv], leaves, [dx2_up.to(dtype), dqkv_up.to(dtype)])
    return {"x2": x2.detach(), "qkv": qkv.detach(), **dict(zip(GRADS, g))}


# ---- ours: FP8 and bf16 block ops through autograd ----


def fused_leaves(t):
    """The chain's inputs in our layouts (gate/up interleaved, Q/K rows permuted), as fresh
    leaves that need gradients, in GRADS' order."""
    return [v.detach().requires_grad_()
            for v in (t.y, t.x0, t.wo, t.g_ffn, t.wgu_inter, t.wd, t.g_attn, t.wqkv_f)]


def fp8_weight_caches(t):
    """Each weight's FP8 operands as the model's cache holds them (coda.nn._quantize_weight: codes
    and scales in 128x128 blocks; wᵀ's None, transposed by each backward, inside the timed
    step): made once per optimizer step in training, so once here, outside the timed region."""
    return {k: CODA.fp8_quantize_blocks(w, True, False)[:2] + (None, None)
            for k, w in (("wo", t.wo), ("wgu", t.wgu_inter), ("wd", t.wd), ("wqkv", t.wqkv_f))}


def fp8_chain_forward(t, leaves, q, fp8_z=False):
    """Our FP8 chain: x2 and qkv (qkv in our column order); `fp8_z`: z saved in FP8."""
    y, x0, wo, g_ffn, wgu, wd, g_attn, wqkv = leaves
    x1, h1, h1s, r1, *_ = CODA.fp8_out_proj_residual_norm(y, wo, *q["wo"], x0, g_ffn, EPS)
    x2, h2, h2s, r2, *_ = CODA.fp8_mlp(x1, g_ffn, wgu, *q["wgu"], wd, *q["wd"], h1, h1s, r1,
                                       g_attn, EPS, False, True, False, False, fp8_z)
    qkv = CODA.fp8_norm_qkv(x2, g_attn, wqkv, *q["wqkv"], h2, h2s, r2, t.pos, t.rope_table)
    return x2, qkv


def bf16_chain_forward(t, leaves):
    """Our bf16 chain (the block ops a model calls): x2 and qkv (our column order)."""
    y, x0, wo, g_ffn, wgu, wd, g_attn, wqkv = leaves
    x1, h1, r1 = CODA.out_proj_residual_norm(y, wo, x0, g_ffn, EPS)
    x2, h2, r2, _ = CODA.mlp(x1, g_ffn, wgu, wd, h1, r1, g_attn, EPS)
    return x2, CODA.norm_qkv(x2, g_attn, wqkv, h2, r2, t.pos, t.rope_table)


def ours_step(t, forward, dx2_up, dqkv_f):
    """(step, check): step() runs forward + backward (the timed call); check() does the same and
    returns x2, qkv and every gradient in the HF layouts."""
    leaves = fused_leaves(t)

    def run():
        x2, qkv = forward(leaves)
        return x2, qkv, torch.autograd.grad([x2, qkv], leaves, [dx2_up, dqkv_f])

    def check():
        x2, qkv, g = run()
        return to_hf({"x2": x2.detach(), "qkv": qkv.detach(), **dict(zip(GRADS, g)), "inv": t.inv})

    return run, check


# ---- the per-stage profile: our chain cut at its three ops ----

# Each stage of our FP8 chain and the floor GEMMs (floor_gemms' names) it holds: the op's forward,
# or its backward (the data and weight gradients of its projections, gate/up's too in the MLP's).
STAGES = (
    ("out-proj fwd", ("fwd out-proj",)),
    ("mlp fwd", ("fwd gate/up", "fwd down-proj")),
    ("norm+qkv fwd", ("fwd qkv",)),
    ("norm+qkv bwd", ("dX qkv", "dW qkv")),
    ("mlp bwd", ("dX down-proj", "dW down-proj", "dX gate/up", "dW gate/up")),
    ("out-proj bwd", ("dX out-proj", "dW out-proj")),
)


# Where a cut op's input comes from: (op, input index) -> (producing op, output index); every
# other differentiable input is a leaf of the chain.
LINKS = {(1, 0): (0, 0), (1, 6): (0, 3), (2, 0): (1, 0), (2, 5): (1, 3)}


def stage_calls(t, q, dx2_up, dqkv_f):
    """Our FP8 chain cut at its three ops, each op's inputs leaves of its own: ({stage: variant}
    for bench_interleaved: a forward stage is the op's call, a backward stage is (prepare = that
    op's forward, run = its backward from the gradients the whole chain hands its outputs)), and
    the leaf gradients of the cut chain in GRADS' order. Those output gradients come from one
    backward of the cut chain, the last op first (x2 also gets the chain's upstream dx2), so the
    six stages together are the chain; the leaf gradients are the check of that."""
    leaves = fused_leaves(t)
    y, x0, wo, g_ffn, wgu, wd, g_attn, wqkv = leaves

    def cut(v):  # an op output as the next op's input: a leaf of its own where differentiable
        return v.detach().requires_grad_() if v.requires_grad else v

    def op1(y, x0, wo, g_ffn):
        return CODA.fp8_out_proj_residual_norm(y, wo, *q["wo"], x0, g_ffn, EPS)

    def op2(x1, g_ffn, wgu, wd, h1, h1s, r1, g_attn):
        return CODA.fp8_mlp(x1, g_ffn, wgu, *q["wgu"], wd, *q["wd"], h1, h1s, r1, g_attn, EPS)

    def op3(x2, g_attn, wqkv, h2, h2s, r2):
        return (CODA.fp8_norm_qkv(x2, g_attn, wqkv, *q["wqkv"], h2, h2s, r2, t.pos,
                                  t.rope_table),)

    in1 = [y, x0, wo, g_ffn]
    out1 = op1(*in1)
    in2 = [cut(out1[0]), g_ffn, wgu, wd, out1[1], out1[2], cut(out1[3]), g_attn]
    out2 = op2(*in2)
    in3 = [cut(out2[0]), g_attn, wqkv, out2[1], out2[2], cut(out2[3])]
    out3 = op3(*in3)
    ops = [(op1, in1, out1), (op2, in2, out2), (op3, in3, out3)]

    def diff_inputs(ins):
        return [i for i, v in enumerate(ins) if v.requires_grad]

    into = {(2, 0): dqkv_f, (1, 0): dx2_up}  # (op, output) -> the gradient it receives
    leaf_grads = {}
    seeds_of = {}
    for k in (2, 1, 0):
        _, ins, outs = ops[k]
        idx = sorted(i for (op, i) in into if op == k)
        seeds_of[k] = (idx, [into[(k, i)] for i in idx])
        diff = diff_inputs(ins)
        grads = torch.autograd.grad([outs[i] for i in idx], [ins[i] for i in diff],
                                    seeds_of[k][1], allow_unused=True)
        for i, g in zip(diff, grads):
            if g is None:
                continue
            src = LINKS.get((k, i))
            if src is not None:
                into[src] = into[src] + g if src in into else g
            else:
                leaf_grads[id(ins[i])] = leaf_grads[id(ins[i])] + g if id(ins[i]) in leaf_grads \
                    else g
    variants = {}
    for (name, _), k in zip(STAGES[:3], range(3)):
        fn, ins, _ = ops[k]
        variants[name] = (lambda fn=fn, ins=ins: fn(*ins))
    for (name, _), k in zip(STAGES[3:], (2, 1, 0)):
        fn, ins, _ = ops[k]
        idx, seeds = seeds_of[k]
        diff = [ins[i] for i in diff_inputs(ins)]

        def prepare(fn=fn, ins=ins, idx=idx):
            outs = fn(*ins)
            return [outs[i] for i in idx]

        def run(outs, seeds=seeds, diff=diff):
            torch.autograd.grad(outs, diff, seeds, allow_unused=True)

        variants[name] = (prepare, run)
    return variants, [leaf_grads.get(id(v)) for v in leaves]


# ---- torchao float8 + torch.compile ----


class TorchChain(torch.nn.Module):
    """suite_chain.make_chain's unfused chain (HF-style RMSNorm, SwiGLU, rotate_half RoPE) with its
    four projections as nn.Linear modules (HF layouts) and both γ as parameters, so that torchao's
    convert_to_float8_training can swap the projections. The weights share the inputs' storage."""

    def __init__(self, t):
        super().__init__()

        def linear(w):
            with torch.device("meta"):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight = torch.nn.Parameter(w.detach())
            return lin

        self.o, self.gu = linear(t.wo), linear(t.wgu_split)
        self.down, self.qkv = linear(t.wd), linear(t.wqkv_hf)
        self.g_ffn = torch.nn.Parameter(t.g_ffn.detach())
        self.g_attn = torch.nn.Parameter(t.g_attn.detach())
        self.heads = (t.hq, t.hkv, t.d)

    def forward(self, y, x0, cos, sin):
        x1 = self.o(y) + x0
        gate, up = self.gu(rms_norm(x1, self.g_ffn)).chunk(2, dim=-1)
        x2 = self.down(F.silu(gate) * up) + x1
        qkv = self.qkv(rms_norm(x2, self.g_attn))
        return x2, rope_hf(qkv, cos, sin, *self.heads)

    def grad_targets(self):
        """The parameters in GRADS' order after y and x0."""
        return [self.o.weight, self.g_ffn, self.gu.weight, self.down.weight, self.g_attn,
                self.qkv.weight]


def torchao_step(t, recipe, dx2_up, dqkv_up, emulate=False, compile=True):
    """(step, check) of the chain with torchao's Float8Linear projections (`recipe`), the module
    torch.compile'd. emulate: torchao's emulation (dequantize, then a high-precision matmul; the
    same quantization) where torch._scaled_mm cannot run (the CPU check)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    mod = convert_to_float8_training(TorchChain(t), config=config)
    fn = torch.compile(mod, dynamic=False) if compile else mod
    ins = [t.y.detach().requires_grad_(), t.x0.detach().requires_grad_()]
    targets = ins + mod.grad_targets()

    def run():
        x2, qkv = fn(*ins, t.cos, t.sin)
        return x2, qkv, torch.autograd.grad([x2, qkv], targets, [dx2_up, dqkv_up])

    def check():
        x2, qkv, g = run()
        return {"x2": x2.detach(), "qkv": qkv.detach(), **dict(zip(GRADS, g))}

    return run, check


# ---- the GEMM-only floors: 12 GEMMs, FP8 (cuBLASLt, ours) and bf16 ----


def floor_operands(t, m):
    """Per projection (PROJECTIONS' order): its input a (M, K), its weight w (N, K) in our layout
    and a stand-in for its output's gradient dy (M, N), random, in the chain's dtype."""
    ws = (t.wo, t.wgu_inter, t.wd, t.wqkv_f)
    return [(t.rnd(m, w.shape[1]), w, t.rnd(m, w.shape[0], scale=0.1)) for w in ws]


def floor_gemms(ops):
    """The 12 GEMMs of the floor, {name: (bf16 call, ours FP8 call, cuBLASLt FP8 call)}: per
    projection fwd a·wᵀ, dX dy·w, dW dyᵀ·a. Every FP8 operand is quantized here, once: a and dy
    in 1x128 blocks along K plus their transposed copies (1x128 along the tokens, for dW), w in
    128x128 blocks plus wᵀ's codes (for dX)."""
    calls = {}
    for n, (a, w, dy) in zip(PROJECTIONS, ops):
        ac, as_, atc, ats = CODA.fp8_quantize_rows(a, True, True)
        dyc, dys, dytc, dyts = CODA.fp8_quantize_rows(dy, True, True)
        wc, ws, wtc, wts = CODA.fp8_quantize_blocks(w, True, True)
        calls[f"fwd {n}"] = (
            lambda a=a, w=w: F.linear(a, w),
            lambda o=(ac, as_, wc, ws): CODA.fp8_gemm(*o),
            lambda o=(ac, as_, wc, ws): scaled_mm(o[0], o[1].t(), o[2], o[3].t()))
        calls[f"dX {n}"] = (
            lambda w=w, dy=dy: torch.matmul(dy, w),
            lambda o=(dyc, dys, wtc, wts): CODA.fp8_gemm(*o),
            lambda o=(dyc, dys, wtc, wts): scaled_mm(o[0], o[1].t(), o[2], o[3].t()))
        calls[f"dW {n}"] = (
            lambda a=a, dy=dy: torch.matmul(dy.t(), a),
            lambda o=(dytc, dyts, atc, ats): CODA.fp8_gemm_xyt(*o),
            lambda o=(dytc, dyts, atc, ats): scaled_mm(o[0], o[1].t(), o[2], o[3]))
    return calls


def check_floors(calls, absent):
    """Each FP8 GEMM of the floor against the bf16 GEMM on the unquantized operands (and ours
    against cuBLASLt's on the same codes). Returns ({variant: check}, {variant: {gemm: err}});
    cuBLASLt's variant is left out, with the reason in `absent`, where its blockwise GEMM raises."""
    errs = {"fp8_floor_coda": {}, "fp8_floor": {}, "fp8_floor_coda_vs_cublaslt": {}}
    have_lt = True
    for name, (bf16, ours, lt) in calls.items():
        ref = bf16()
        o = ours()
        errs["fp8_floor_coda"][name] = rel_err(o, ref)
        if have_lt:
            try:
                out_lt = lt()
            except (RuntimeError, ValueError) as ex:  # newer torch raises ValueError
                absent["cublaslt"] = str(ex).splitlines()[0][:300]
                have_lt = False
            else:
                errs["fp8_floor"][name] = rel_err(out_lt, ref)
                errs["fp8_floor_coda_vs_cublaslt"][name] = rel_err(o, out_lt)
                del out_lt
        del ref, o
    checks = {"fp8_floor_coda": all(e <= FP8_TOL for e in errs["fp8_floor_coda"].values())}
    if have_lt:
        checks["fp8_floor"] = all(e <= FP8_TOL for e in errs["fp8_floor"].values()) and all(
            e <= LT_TOL for e in errs["fp8_floor_coda_vs_cublaslt"].values())
    else:
        del errs["fp8_floor"], errs["fp8_floor_coda_vs_cublaslt"]
    return {k: "PASS" if v else "FAIL" for k, v in checks.items()}, errs


# ---- checks of the chains ----


def fp8_check(out, ref, grad_tol=FP8_TOL):
    """(passed, {tensor: relative Frobenius error}): outputs within FP8_TOL, gradients within
    grad_tol."""
    errs = {k: rel_err(out[k], ref[k]) for k in OUTPUTS + GRADS}
    ok = all(errs[k] <= FP8_TOL for k in OUTPUTS) and all(errs[k] <= grad_tol for k in GRADS)
    return ok, errs


def bf16_check(out, ref, eager):
    """(passed, {tensor: max |err|}): every output and gradient within 2 x eager's + 1e-6."""
    errs = {k: max_err(out[k], ref[k]) for k in OUTPUTS + GRADS}
    eager_errs = {k: max_err(eager[k], ref[k]) for k in OUTPUTS + GRADS}
    return all(errs[k] <= 2 * eager_errs[k] + 1e-6 for k in errs), errs, eager_errs


def ratios(ms, model):
    """The issue's ratios from one row's times (NaN where a side is missing)."""
    def div(a, b):
        return ms[a] / ms[b] if a in ms and b in ms else NAN

    tao = {k: v for k, v in ms.items() if k.startswith("torchao_")}
    best = min(tao, key=tao.get) if tao else None
    return {
        "fp8_over_floor": div("coda_fp8", "fp8_floor"),
        "fp8_over_floor_coda": div("coda_fp8", "fp8_floor_coda"),
        "speedup_vs_torchao": tao[best] / ms["coda_fp8"] if best and "coda_fp8" in ms else NAN,
        "speedup_vs_torchao_wcast": (tao[best] / ms["coda_fp8_wcast"]
                                     if best and "coda_fp8_wcast" in ms else NAN),
        "best_torchao": best,
        "speedup_vs_coda_bf16": div("coda_bf16", "coda_fp8"),
        "fp8_cutlass_over_floor": div("coda_fp8_cutlass", "fp8_floor"),
        "fp8_z_over_floor": div("coda_fp8_z", "fp8_floor"),
        "bf16_over_floor": div("coda_bf16", "bf16_floor"),
        "fp8_floor_speedup_vs_bf16_floor": div("bf16_floor", "fp8_floor"),
        "targets": {
            "fp8_over_floor_max": TARGETS["fp8_over_floor_max"],
            "speedup_vs_torchao_min": TARGETS["speedup_vs_torchao_min"].get(model),
            "speedup_vs_coda_bf16_min": TARGETS["speedup_vs_coda_bf16_min"].get(model),
        },
    }


def run_shape(model, m, sec, progress, torchao=None, time_it=True, dev="cuda", dtype=None,
              emulate_torchao=False, compile_torchao=True, profile=False):
    """One shape: checks every variant, then times those that passed, interleaved. `model`: a name
    of MODELS, or (hidden, q heads, kv heads, head dim, ffn) for a check at another shape
    (time_it=False, dev="cpu": the CPU check). `profile`: also our chain per stage (STAGES) next
    to the floor GEMMs each stage holds (the row's "stages"; stage_calls' cut chain checked
    against the whole chain's gradients first) and host_bound's check (the row's "host")."""
    if isinstance(model, str) and model not in MODELS:  # the paper's shapes have no FP8 rows
        return None
    name = model if isinstance(model, str) else "x".join(map(str, model))
    seed = 13 * m + (MODELS[model][0] if isinstance(model, str) else model[0])
    dtype = dtype or (torch.bfloat16 if dev == "cuda" else torch.float32)
    t = cb.chain_inputs(model, m, seed, dev=dev, dtype=dtype)
    dx2_up, dqkv_up = t.rnd(m, t.hidden, scale=0.1), t.rnd(m, t.qkv_w, scale=0.1)
    dqkv_f = dqkv_up[:, t.perm].contiguous()  # the upstream qkv gradient in our column order
    absent = sec.setdefault("absent", {})
    row = {"model": name, "m": m, "pass": "fwd+bwd", "check": {}, "rel_err": {}, "max_err": {}}

    ref = reference(t, dx2_up, dqkv_up, torch.float32 if dev == "cuda" else torch.float64)
    eager = reference(t, dx2_up, dqkv_up, dtype)
    variants = {}

    # ours, FP8 (absent until the build has the FP8 block ops)
    missing = missing_fp8_ops()
    if missing:
        absent["coda_fp8"] = f"torch.ops.coda lacks {', '.join(missing)} (this build)"
    else:
        q = fp8_weight_caches(t)
        step, check = ours_step(t, lambda lv: fp8_chain_forward(t, lv, q), dx2_up, dqkv_f)
        try:
            ok, row["rel_err"]["coda_fp8"] = fp8_check(check(), ref)
            row["check"]["coda_fp8"] = "PASS" if ok else "FAIL"
        except Exception as ex:  # noqa: BLE001 - an op that raises is reported, not timed
            row["check"]["coda_fp8"] = f"ERROR {ex!r}"[:300]
            ok = False
        if ok:
            variants["coda_fp8"] = step
            # the weights cast in the step, as every forward of torchao's chain casts them
            variants["coda_fp8_wcast"] = ours_step(
                t, lambda lv: fp8_chain_forward(t, lv, fp8_weight_caches(t)), dx2_up, dqkv_f)[0]
            # z saved in FP8 (checked as the chain is)
            z_step, z_check = ours_step(t, lambda lv: fp8_chain_forward(t, lv, q, True),
                                        dx2_up, dqkv_f)
            try:
                z_ok, row["rel_err"]["coda_fp8_z"] = fp8_check(z_check(), ref)
                row["check"]["coda_fp8_z"] = "PASS" if z_ok else "FAIL"
            except RuntimeError as ex:  # a build without the fp8_z programs
                absent["coda_fp8_z"] = str(ex).splitlines()[0][:300]
            else:
                if z_ok:
                    variants["coda_fp8_z"] = z_step
            # the weight gradients on our CUTLASS kernel (checked as the chain is)
            try:
                ours_ok, row["rel_err"]["coda_fp8_cutlass"] = fp8_check(
                    on_wgrad_backend("cutlass", check)(), ref)
                row["check"]["coda_fp8_cutlass"] = "PASS" if ours_ok else "FAIL"
            except RuntimeError as ex:
                absent["coda_fp8_cutlass"] = str(ex).splitlines()[0][:300]
            else:
                if ours_ok:
                    variants["coda_fp8_cutlass"] = on_wgrad_backend("cutlass", step)
        if ok and profile:
            stages, cut_grads = stage_calls(t, q, dx2_up, dqkv_f)
            whole = [g for g in ours_step(t, lambda lv: fp8_chain_forward(t, lv, q), dx2_up,
                                          dqkv_f)[0]()[2]]
            cut_errs = {n: rel_err(a, b) for n, a, b in zip(GRADS, cut_grads, whole)}
            row["rel_err"]["stages"] = cut_errs
            row["check"]["stages"] = "PASS" if max(cut_errs.values()) <= 1e-6 else "FAIL"

    # the floors
    calls = floor_gemms(floor_operands(t, m))
    checks, floor_errs = check_floors(calls, absent)
    row["check"].update(checks)
    row["rel_err"].update(floor_errs)
    def floor(i):  # the 12 GEMMs back to back, each output dropped (suite_chain_fwd_bwd's floor)
        def run():
            for c in calls.values():
                c[i]()
        return run

    if checks.get("fp8_floor") == "PASS":
        variants["fp8_floor"] = floor(2)
    if checks["fp8_floor_coda"] == "PASS":
        variants["fp8_floor_coda"] = floor(1)

    # ours, bf16
    step, check = ours_step(t, lambda lv: bf16_chain_forward(t, lv), dx2_up, dqkv_f)
    ok, row["max_err"]["coda_bf16"], row["max_err"]["eager"] = bf16_check(check(), ref, eager)
    row["check"]["coda_bf16"] = "PASS" if ok else "FAIL"
    if ok:
        variants["coda_bf16"] = step
    variants["bf16_floor"] = floor(0)

    # torchao float8 + torch.compile
    if torchao is not None:
        for recipe in TORCHAO_RECIPES:
            key = f"torchao_{recipe}"
            try:
                step, check = torchao_step(t, recipe, dx2_up, dqkv_up, emulate=emulate_torchao,
                                           compile=compile_torchao)
                ok, row["rel_err"][key] = fp8_check(
                    check(), ref, grad_tol=2 * FP8_TOL if recipe == "tensorwise" else FP8_TOL)
                row["check"][key] = "PASS" if ok else "FAIL"
            except Exception as ex:  # noqa: BLE001 - a baseline that cannot run is reported
                row["check"][key] = f"ERROR {ex!r}"[:300]
                ok = False
            if ok:
                variants[key] = step
    del ref, eager

    failed = {k: v for k, v in row["check"].items() if v != "PASS"}
    if time_it:
        times = bench_interleaved(variants, progress, f"fp8 chain fwd+bwd {name} M={m}")
        row.update({f"ms_{k}": v for k, v in times.items()})
        row.update(ratios(times, name))
        if row["check"].get("stages") == "PASS":
            row["stages"] = profile_stages(stages, calls, checks, times, progress,
                                           f"{name} M={m}")
            row["host"] = host_bound(variants["coda_fp8"], progress, f"{name} M={m}")
    sec["rows"].append(row)
    line = f"fp8-chain {name:11s} M={m:5d} "
    if time_it:
        line += " ".join(f"{k}={v:.3f}" for k, v in times.items()) + (
            f" | fp8/floor {row['fp8_over_floor']:.3f} (ours' floor "
            f"{row['fp8_over_floor_coda']:.3f}) | vs torchao {row['speedup_vs_torchao']:.3f}x "
            f"({row['speedup_vs_torchao_wcast']:.3f}x with the weight casts) | "
            f"vs bf16 {row['speedup_vs_coda_bf16']:.3f}x")
    else:
        line += "checks: " + " ".join(f"{k}={v}" for k, v in row["check"].items())
    for k in failed:
        errs = row["rel_err"].get(k) or row["max_err"].get(k)
        line += f"\n  FAIL {k}: {failed[k]}" + (f" {json.dumps(errs)}" if errs else "")
    print(line, flush=True)
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_stages(stages, calls, checks, times, progress, label):
    """{stage: ms of ours, of its floor GEMMs on cuBLASLt (fp8_floor) and on ours, and our
    stage's excess over the cuBLASLt ones} plus "glue": the whole chain's time minus its stages'
    (autograd between the ops). Stages, then each floor, interleaved on their own."""
    ours = bench_interleaved(stages, progress, f"fp8 chain stages {label}")
    gemm = {}
    for col, i, variant in (("floor_ms", 2, "fp8_floor"), ("floor_coda_ms", 1, "fp8_floor_coda")):
        if checks.get(variant) == "PASS":
            gemm[col] = bench_interleaved({n: c[i] for n, c in calls.items()}, progress,
                                          f"fp8 chain floor GEMMs ({variant}) {label}")
    out = {}
    for name, gemms in STAGES:
        r = {"ours_ms": ours[name]}
        for col, ms in gemm.items():
            r[col] = sum(ms[g] for g in gemms)
        if "floor_ms" in r:
            r["over_floor_ms"] = r["ours_ms"] - r["floor_ms"]
        out[name] = r
    if "coda_fp8" in times:
        out["glue"] = {"ours_ms": times["coda_fp8"] - sum(ours.values())}
    for name, r in out.items():
        print(f"  stage {name:13s} " + " ".join(f"{k}={v:.3f}" for k, v in r.items()), flush=True)
    return out


def sleep_cycles_per_ms():
    """torch.cuda._sleep's cycles in one millisecond on this GPU (timed, not read off a clock
    property: the SM clock under load is what the sleep counts)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    torch.cuda.synchronize()
    return 20_000_000 / s.elapsed_time(e)


def host_bound(step, progress, label):
    """Whether our chain waits on the CPU: the CPU's time to enqueue one step (median of 10, the
    GPU held in a sleep kernel meanwhile, so no launch waits on a full queue), and the step timed
    as the suite times it (L2 flush, then the step) beside the same step with the GPU asleep
    until the CPU has enqueued all of it (`queued_ms`: the step's GPU time alone). `gap_ms`, the
    difference, is the time the GPU spent waiting for launches."""
    per_ms = sleep_cycles_per_ms()
    cpu = []
    for _ in range(10):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(50 * per_ms))
        t0 = time.perf_counter()
        step()
        cpu.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    enqueue_ms = statistics.median(cpu)
    hold = int((2 * max(cpu) + 1) * per_ms)
    ms = bench_interleaved({"suite": step,
                            "queued": (lambda: torch.cuda._sleep(hold), lambda _: step())},
                           progress, f"fp8 chain host-bound check {label}")
    out = {"cpu_enqueue_ms": enqueue_ms, "suite_ms": ms["suite"], "queued_ms": ms["queued"],
           "gap_ms": ms["suite"] - ms["queued"]}
    print("  host " + " ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)
    return out


def main():
    """The CPU check: every variant's check at a tiny shape, no timing."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--cpu-check", action="store_true", required=True)
    ap.add_argument("--shape", default="256,4,2,64,512", help="hidden,hq,hkv,d,ffn")
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="torchao without torch.compile")
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    out = {"absent": {}, "sections": {"fp8_chain": {"rows": []}}}
    tao = load_torchao(out["absent"])
    sec = out["sections"]["fp8_chain"]
    row = run_shape(shape, a.m, sec, None, torchao=tao, time_it=False, dev="cpu",
                    emulate_torchao=True, compile_torchao=not a.no_compile)
    for k, v in {**out["absent"], **sec["absent"]}.items():
        print(f"absent: {k}: {v}")
    for kind in ("rel_err", "max_err"):
        for k, v in row[kind].items():
            worst = max(v, key=v.get) if v else None
            if worst:
                print(f"{kind} {k}: worst {worst} {v[worst]:.3g}; "
                      + " ".join(f"{n}={e:.3g}" for n, e in v.items()))
    return 0 if all(v == "PASS" for v in row["check"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
