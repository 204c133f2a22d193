#!/usr/bin/env python3
"""The benchmark suite: one command, one process on the GPU, every op and the layer chain against
every baseline (docs/math.md §7), one results file, then `bench/report.py` turns it into tables and
plots.

  CODA_TORCH_LIBRARY=.../libcoda_torch.so PYTHONPATH=python python3 bench/suite.py [--quick]
        [--sections ops,chain-fwd,chain,lm-head] [--models llama3-1B,paper-H2048,...]
        [--json bench/results/<date>.json]

Ours runs through torch.ops.coda (the `coda` package loads the library CODA_TORCH_LIBRARY names):
the forward chain as the block ops a model calls, each op alone and the chain forward + backward
as the program ops (one program or fold each). Sections (each row is checked against an fp32
evaluation before anything of it is timed; a failed check prints FAIL and no time):
  ops        every fused op of the layer at each shape: ours (the fused kernel alone, and with its
             fold), our plain GEMM (empty epilogue), the cuBLAS GEMM, and the same op as cuBLAS +
             eager PyTorch, torch.compile, Liger Kernel and FlashInfer (forward ops). Backward ops
             are timed as the backward of the op's forward sub-graph (its forward untimed before
             each timed autograd.grad), so a baseline does exactly the work autograd would.
  chain-fwd  the forward layer chain (bench/suite_chain.py)
  chain      the layer chain forward + backward and backward alone (bench/suite_chain_fwd_bwd.py)
  lm-head    LM head + cross-entropy, forward + backward: time and peak memory
             (bench/suite_lm_head.py)
Every section above times its variants in interleaved rounds (suite_chain.bench_interleaved).
Not in the default list:
  sustained      the chain forward + backward single-step rows, then every variant in batches of
                 --sustained-runs steps back to back (no L2 clear), with NVML's SM clock, power and
                 energy (suite_chain.bench_sustained)
  chain-profile  the chain forward + backward rows plus each op of ours alone next to the cuBLAS
                 GEMM of its shape (events, no L2 clear; the ops section is the careful version)
  train          coda.nn vs Hugging Face training loss curves and tokens/s (bench/suite_train.py;
                 one model, not per shape; the plot goes beside the results file)
  train-parity   FP8 training parity on real text (.corpus from scripts/fetch-corpus): coda bf16,
                 coda FP8 and torchao float8 trained from one initialization on the same batches
                 (bench/suite_train.py, PARITY_DOC; the plot goes beside the results file)
  fp8            the blockwise FP8 GEMMs of every projection (fprop, dgrad, wgrad) against
                 cuBLASLt's blockwise GEMM and the bf16 GEMMs, and the cast passes against a copy
                 (bench/suite_fp8.py; LLaMA-3 shapes only)
  fp8-fused      only the fp8 section's fused rows: F1, F2, B1, B2 with an output quantized in
                 their epilogue against the plain FP8 GEMM of their shape
  fp8-chain      the layer chain forward + backward in blockwise FP8 (our FP8 block ops) against
                 the FP8 GEMM-only floor (cuBLASLt's blockwise GEMM and ours), our bf16 chain and
                 its floor, and torchao float8 (tensorwise, rowwise) + torch.compile
                 (bench/suite_fp8_chain.py; LLaMA-3 shapes only; torchao from its wheel, "absent"
                 with the reason when it cannot be imported)
  e2e            a whole model's training step (tokens/s, peak memory, first step with compile)
                 for HF eager, HF + per-block compile, Liger, coda (eager, per-block compiled, HF
                 patched in place) at the LLaMA-3.2-1B and LLaMA-3-8B shapes (bench/suite_e2e.py)

Shapes: LLaMA-3 1B / 8B / 70B at M = 8192 and 16384, and the CODA paper's block shapes at
M = 16384 (V = 32768 for its LM head). --quick: M = 8192, LLaMA-3 shapes. Liger comes from its
wheel (pip), FlashInfer from bench/flashinfer_kernels.py; when either cannot be imported the
results file says why ("absent") and the report prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.append(os.path.join(here, "..", "python"))  # a source checkout's coda, unless installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import suite_chain as cb  # noqa: E402
import suite_chain_fwd_bwd as ctb  # noqa: E402
from suite_chain import (  # noqa: E402
    ALL_MODELS,
    EPS,
    MODELS,
    PAPER_MODELS,
    bench_interleaved,
    invoke,
    rms_norm,
    rope_hf,
)

SECTIONS = (
    "ops", "chain-fwd", "chain", "lm-head", "sustained", "chain-profile", "train", "fp8",
    "fp8-fused", "fp8-chain", "e2e", "train-parity",
)
PAPER_V = 32768


def optional_baselines(absent):
    """Liger's functional ops and our FlashInfer loader, or the reason each is missing."""
    liger = fi = None
    try:
        from liger_kernel.transformers import functional as liger
    except Exception as ex:  # noqa: BLE001 - the reason goes into the results file
        absent["liger"] = f"import liger_kernel failed: {ex!r}"[:300]
    try:
        import flashinfer_kernels as fi  # loads the prebuilt modules, or raises with the reason
    except Exception as ex:  # noqa: BLE001
        fi = None
        absent["flashinfer"] = f"{ex}"[:400]
    return liger, fi


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


def evaluate(t, m, dtype, dx2_up, dqkv_up):
    """The chain in `dtype` through autograd: every intermediate and the gradient reaching it."""
    keep = {}
    leaves = [
        v.detach().to(dtype).requires_grad_()
        for v in (t.y, t.x0, t.wo, t.g_ffn, t.wgu_split, t.wd, t.g_attn, t.wqkv_hf)
    ]
    x2, qkv = cb.make_chain(t.hq, t.hkv, t.d, t.inter, keep)(
        *leaves, t.cos.to(dtype), t.sin.to(dtype)
    )
    wrt = [keep["x1"], keep["gate_up"], keep["x2"], keep["qkv_pre"], leaves[3], leaves[6]]
    g = torch.autograd.grad([x2, qkv], wrt, [dx2_up.to(dtype), dqkv_up.to(dtype)])
    vals = {k: v.detach() for k, v in keep.items()}
    vals.update(
        qkv=qkv.detach(), dx1=g[0], dgu=g[1], dx2=g[2], dqkv_pre=g[3], dg_ffn=g[4], dg_attn=g[5]
    )
    return vals


def split_gu(z):
    """Interleaved (gate, up) columns -> [gate | up], the HF layout."""
    return torch.cat([z[:, 0::2], z[:, 1::2]], dim=-1)


def backward_variant(forward, inputs, grad_out, extra=None):
    """(prepare, run) for bench_interleaved: the forward through autograd untimed, then its
    backward alone (`extra`: the residual gradient added to the first input's, as autograd's
    accumulation would)."""
    ins = [v.detach().requires_grad_() for v in inputs]

    def run(out):
        g = torch.autograd.grad(out, ins, grad_out)
        return [g[0] + extra, *g[1:]] if extra is not None else list(g)

    return (lambda: forward(*ins)), run


def ops_section(model, m, res, progress, liger, fi):
    t = cb.chain_inputs(model, m, 11 * m + ALL_MODELS[model][0])
    hidden, hq, hkv, d, qkv_w = t.hidden, t.hq, t.hkv, t.d, t.qkv_w
    dx2_up, dqkv_up = t.rnd(m, hidden, scale=0.1), t.rnd(m, qkv_w, scale=0.1)
    o = ctb.ours_chain(t, m, dx2_up, dqkv_up)
    o.forward()
    o.backward()
    torch.cuda.synchronize()
    ref = evaluate(t, m, torch.float32, dx2_up, dqkv_up)
    eg = evaluate(t, m, t.dtype, dx2_up, dqkv_up)  # the eager values: bf16 on the GPU
    torch.cuda.synchronize()
    cos, sin = t.cos, t.sin

    def f_res_norm(a, w, r, g):  # out-proj / down-proj + residual + RMSNorm
        x = F.linear(a, w) + r
        return x, rms_norm(x, g)

    def f_swiglu(n, w):
        gu = F.linear(n, w)
        gate, up = gu.chunk(2, dim=-1)
        return gu, F.silu(gate) * up

    def f_qkv_rope(n, w):
        return rope_hf(F.linear(n, w), cos, sin, hq, hkv, d)

    def heads(qkv):
        q = qkv[:, : hq * d].view(m, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(m, hkv, d)
        return q, k, qkv[:, (hq + hkv) * d :]

    def cat_qkv(q, k, v):
        return torch.cat([q.reshape(m, -1), k.reshape(m, -1), v], dim=-1)

    compiled = {}

    def comp(key, fn):
        if key not in compiled:
            compiled[key] = torch.compile(fn, dynamic=False)
        return compiled[key]

    # Each op: inputs of the unfused path (eager bf16 values), the reference outputs, ours, and the
    # baselines as {name: (callable, outputs of one call -> comparable list)}.
    ops = {}
    ours = {name: (fn, fold, plain, cublas, gemm) for name, fn, fold, plain, cublas, gemm in o.ops}

    def fwd_res(name, a, w, r, g, ref_x, ref_n, ours_out):
        base = {
            "eager": (lambda: f_res_norm(a, w, r, g), list),
            "compile": (lambda: comp(name, f_res_norm)(a, w, r, g), list),
        }
        if liger:
            base["liger"] = (
                lambda: liger.liger_fused_add_rms_norm(F.linear(a, w), r, g, EPS, in_place=False),
                lambda out: [out[1], out[0]],
            )
        if fi:
            scratch = (
                r.clone()
            )  # FlashInfer adds in place: residual += out, out = RMSNorm(residual)

            def fi_op(check=False):
                if check:
                    scratch.copy_(r)
                y_ = F.linear(a, w)
                fi.fused_add_rmsnorm(y_, scratch, g, EPS)
                return scratch, y_

            base["flashinfer"] = (fi_op, lambda out: [out[0].clone(), out[1]], lambda: fi_op(True))
        ops[name] = dict(ref=[ref_x, ref_n], ours=ours_out, base=base)

    fwd_res(
        "F1 out-proj",
        t.y,
        t.wo,
        t.x0,
        t.g_ffn,
        ref["x1"],
        ref["n1"],
        lambda: [o.x1, o.h1.float() * o.r1[:, None]],
    )
    base = {
        "eager": (lambda: f_swiglu(eg["n1"], t.wgu_split), list),
        "compile": (lambda: comp("F2", f_swiglu)(eg["n1"], t.wgu_split), list),
    }
    if liger:

        def liger_f2():
            gu = F.linear(eg["n1"], t.wgu_split)
            gate, up = gu.chunk(2, dim=-1)
            return gu, liger.liger_swiglu(gate, up)

        base["liger"] = (liger_f2, list)
    if fi:

        def fi_f2():
            gu = F.linear(eg["n1"], t.wgu_split)
            return gu, fi.silu_and_mul(gu)

        base["flashinfer"] = (fi_f2, list)
    ops["F2 gate/up"] = dict(
        ref=[ref["gate_up"], ref["a"]], ours=lambda: [split_gu(o.z), o.act], base=base
    )
    fwd_res(
        "F1 down-proj",
        eg["a"],
        t.wd,
        eg["x1"],
        t.g_attn,
        ref["x2"],
        ref["n2"],
        lambda: [o.x2, o.h2.float() * o.r2[:, None]],
    )
    base = {
        "eager": (lambda: f_qkv_rope(eg["n2"], t.wqkv_hf), lambda out: [out]),
        "compile": (lambda: comp("F3", f_qkv_rope)(eg["n2"], t.wqkv_hf), lambda out: [out]),
    }
    if liger:

        def liger_f3():
            qkv = F.linear(eg["n2"], t.wqkv_hf)
            q, k, v = heads(qkv)
            q, k = liger.liger_rope(
                q.view(1, m, hq, d).transpose(1, 2),
                k.view(1, m, hkv, d).transpose(1, 2),
                cos[None],
                sin[None],
            )
            return q, k, v

        base["liger"] = (
            liger_f3,
            lambda out: [cat_qkv(out[0].transpose(1, 2), out[1].transpose(1, 2), out[2])],
        )
    if fi:

        def fi_f3():
            q, k, v = heads(F.linear(eg["n2"], t.wqkv_hf))
            q, k = fi.apply_rope_pos_ids(q, k, t.pos, rope_theta=cb.THETA)
            return q, k, v

        base["flashinfer"] = (fi_f3, lambda out: [cat_qkv(*out)])
    ops["F3 qkv+RoPE"] = dict(ref=[ref["qkv"]], ours=lambda: [o.qkv[:, t.inv]], base=base)

    # Backward ops: the backward of the op's forward sub-graph (its data gradients and dγ).
    rope_fwd = lambda qkv: rope_hf(qkv, cos, sin, hq, hkv, d)  # noqa: E731
    norm_lin = lambda w: lambda x, g: F.linear(rms_norm(x, g), w)  # noqa: E731
    swiglu_lin = lambda gu: F.linear(F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1], t.wd)  # noqa: E731
    bwd_ops = {
        "B3 RoPE bwd": (
            [eg["qkv_pre"]],
            dqkv_up,
            None,
            rope_fwd,
            [ref["dqkv_pre"]],
            lambda: [o.dqkv_pre[:, t.inv]],
        ),
        "B1 qkv": (
            [eg["x2"], t.g_attn],
            eg["dqkv_pre"],
            dx2_up,
            norm_lin(t.wqkv_hf),
            [ref["dx2"], ref["dg_attn"]],
            lambda: [o.dx2, o.dg_attn],
        ),
        "B2 SwiGLU bwd": (
            [eg["gate_up"]],
            eg["dx2"],
            None,
            swiglu_lin,
            [ref["dgu"]],
            lambda: [split_gu(o.dz)],
        ),
        "B1 gate/up": (
            [eg["x1"], t.g_ffn],
            eg["dgu"],
            eg["dx2"],
            norm_lin(t.wgu_split),
            [ref["dx1"], ref["dg_ffn"]],
            lambda: [o.dx1, o.dg_ffn],
        ),
    }
    for name, (ins, gout, extra, fwd, refs, ours_out) in bwd_ops.items():
        base = {
            "eager": (backward_variant(fwd, ins, gout, extra), list),
            "compile": (
                backward_variant(torch.compile(fwd, dynamic=False), ins, gout, extra),
                list,
            ),
        }
        if liger:
            lfwd = {
                "B3 RoPE bwd": lambda qkv: (
                    lambda q, k, v: cat_qkv(
                        *[
                            x.transpose(1, 2)
                            for x in liger.liger_rope(
                                q.view(1, m, hq, d).transpose(1, 2),
                                k.view(1, m, hkv, d).transpose(1, 2),
                                cos[None],
                                sin[None],
                            )
                        ],
                        v,
                    )
                )(*heads(qkv)),
                "B1 qkv": lambda x, g: F.linear(liger.liger_rms_norm(x, g, EPS), t.wqkv_hf),
                "B2 SwiGLU bwd": lambda gu: F.linear(liger.liger_swiglu(*gu.chunk(2, -1)), t.wd),
                "B1 gate/up": lambda x, g: F.linear(liger.liger_rms_norm(x, g, EPS), t.wgu_split),
            }[name]
            base["liger"] = (backward_variant(lfwd, ins, gout, extra), list)
        ops[name] = dict(ref=refs, ours=ours_out, base=base)

    for name, spec in ops.items():
        fn, fold, plain, cublas, gemm = ours[name]
        row = {
            "model": model,
            "m": m,
            "op": name,
            "gemm_mnk": list(gemm) if gemm else None,
            "ms": {},
            "err": {},
            "check": {},
        }
        ref_out = spec["ref"]
        e_eager = [
            err(a, b)
            for a, b in zip(spec["base"]["eager"][1](invoke(spec["base"]["eager"][0])), ref_out)
        ]
        row["err"]["eager"] = max(e_eager)

        def passes(outs):
            errs = [err(a, b) for a, b in zip(outs, ref_out)]
            return max(errs), all(e <= 2 * ee + 1e-6 for e, ee in zip(errs, e_eager))

        row["err"]["coda"], ok = passes(spec["ours"]())
        row["check"]["coda"] = "PASS" if ok else "FAIL"
        timed = {}
        if ok:  # ours with its fold; the fused kernel alone too where there is a fold
            timed["coda"] = (lambda fn=fn, fold=fold: (fn(), fold())) if fold else fn
            if fold:
                timed["coda_fused"] = fn
            if plain:
                timed["coda_plain_gemm"] = plain
            if cublas:
                timed["cublas_gemm"] = cublas
        for bname, (call, extract, *check_call) in spec["base"].items():
            try:
                out = extract(invoke(check_call[0] if check_call else call))
                row["err"][bname], bok = passes(out)
                del out
            except Exception as ex:  # noqa: BLE001 - a baseline that cannot run this op is reported
                row["check"][bname] = f"ERROR {ex!r}"[:200]
                continue
            row["check"][bname] = "PASS" if bok else "FAIL"
            if bok:
                timed[bname] = call
        if timed:
            row["ms"] = bench_interleaved(timed, progress, f"ops {model} M={m} {name}")
        if gemm:
            row["tflops"] = {
                k: 2 * gemm[0] * gemm[1] * gemm[2] / (v * 1e9) for k, v in row["ms"].items()
            }
        if "coda" in row["ms"] and "coda_plain_gemm" in row["ms"]:
            fused = row["ms"].get("coda_fused", row["ms"]["coda"])
            row["fused_over_plain"] = fused / row["ms"]["coda_plain_gemm"]
        if "coda" in row["ms"]:
            row["speedup"] = {
                k: v / row["ms"]["coda"]
                for k, v in row["ms"].items()
                if k in ("eager", "compile", "liger", "flashinfer", "cublas_gemm")
            }
        res["rows"].append(row)
        print(
            f"ops {model:11s} M={m:5d} {name:14s} "
            + " ".join(f"{k}={v:.3f}" for k, v in row["ms"].items())
            + ("" if ok else " FAIL " + json.dumps(row["err"])),
            flush=True,
        )
    # the dW GEMMs and d(y): ours (XᵀY / XW on our mainloop) vs cuBLAS, no baseline op around them
    for name in ("dW qkv", "dW down", "dW gate/up", "dW o", "d(y)"):
        fn, _, _, cublas, gemm = ours[name]
        row = {
            "model": model,
            "m": m,
            "op": name,
            "gemm_mnk": list(gemm),
            "ms": bench_interleaved(
                {"coda": fn, "cublas_gemm": cublas}, progress, f"ops {model} M={m} {name}"
            ),
        }
        row["tflops"] = {
            k: 2 * gemm[0] * gemm[1] * gemm[2] / (v * 1e9) for k, v in row["ms"].items()
        }
        row["speedup"] = {"cublas_gemm": row["ms"]["cublas_gemm"] / row["ms"]["coda"]}
        res["rows"].append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="ops,chain-fwd,chain,lm-head",
                    help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument(
        "--models", default=None, help="comma list (default: LLaMA-3 and, unless --quick, paper)"
    )
    ap.add_argument("--json", default=None, help="default bench/results/<date>.json")
    ap.add_argument("--commit", default=os.environ.get("CODA_COMMIT", "unknown"))
    ap.add_argument("--lm-head-chunk-bytes", type=int, default=1 << 30)
    ap.add_argument("--sustained-runs", type=int, default=20, metavar="RUNS",
                    help="sustained: back-to-back steps per batch")
    ap.add_argument("--train-steps", type=int, default=200, help="train: AdamW steps")
    ap.add_argument("--train-compile", action="store_true",
                    help="train: also torch.compile'd twins of both models")
    ap.add_argument("--train-parity-steps", type=int, default=1000, help="train-parity: steps")
    ap.add_argument("--train-parity-budget", type=float, default=0, metavar="SECONDS",
                    help="train-parity: stop training after this long (0: no limit)")
    ap.add_argument("--train-parity-set", default="", metavar="K=V,...",
                    help="train-parity: other settings of suite_train.PARITY_DEFAULTS "
                         "(runs=coda_bf16+coda_fp8+torchao_fp8, corpus=DIR, batch=8, ...)")
    ap.add_argument("--e2e-models", default="llama3.2-1B,llama3-8B",
                    help="e2e: comma list of bench/suite_e2e.py's MODEL_SHAPES")
    ap.add_argument("--e2e-systems", default=None,
                    help="e2e: comma list of bench/suite_e2e.py's systems (default: SYSTEMS), or "
                         "'fp8' for FP8_COMPARISON")
    ap.add_argument("--fp8-chain-profile", action="store_true",
                    help="fp8-chain: also our FP8 chain per stage (each op's forward, backward) "
                         "next to the floor GEMMs each stage holds, and whether the chain "
                         "waits on the CPU's launches (the row's host)")
    ap.add_argument("--fp8-programs", default=None, metavar="F1,F2,...",
                    help="fp8 / fp8-fused: only these fused programs (F1, F2, F2z, B1, B2, B2z)")
    ap.add_argument("--e2e-timeout", type=int, default=300,
                    help="e2e: seconds each system's process may take")
    ap.add_argument("--e2e-steps", type=int, default=10,
                    help="e2e: timed steps per system (their median is the result)")
    ap.add_argument("--e2e-rounds", type=int, default=1,
                    help="e2e: rounds over the systems, a process each (the median of the "
                         "rounds' medians is the result)")
    a = ap.parse_args()
    path = a.json or os.path.join(here, "results", f"{datetime.date.today().isoformat()}.json")
    sections = a.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if a.fp8_programs:
        from suite_fp8 import FUSED_PROGRAMS

        bad = [p for p in a.fp8_programs.split(",") if p not in FUSED_PROGRAMS]
        if bad:
            ap.error(f"--fp8-programs: unknown programs {bad}; known: {', '.join(FUSED_PROGRAMS)}")
    models = (
        a.models.split(",") if a.models else list(MODELS) + ([] if a.quick else list(PAPER_MODELS))
    )
    t0 = time.time()

    def progress(s):
        print(f"  [{time.time() - t0:7.1f}s] {s}", file=sys.stderr, flush=True)

    out = {
        "benchmark": "suite",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": a.commit,
        "command": " ".join(sys.argv),
        "quick": a.quick,
        # the weight gradient's FP8 backend our ops ran on (include/coda/ops.hpp)
        "fp8_wgrad": os.environ.get("CODA_FP8_WGRAD") or "cublaslt",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "absent": {},
        "sections": {},
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    liger, fi = optional_baselines(out["absent"])
    if liger:
        import importlib.metadata as md

        out["liger_version"] = md.version("liger_kernel")
    if fi:
        out["flashinfer_version"] = fi.FLASHINFER_VERSION

    def save():
        out["elapsed_s"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    def shapes(model):
        if model in PAPER_MODELS:
            return (16384,)
        return (8192,) if a.quick else (8192, 16384)

    # torch.compile caches per code object and falls back to eager after `recompile_limit` shapes
    # (8): every shape below starts from a reset, so each compile baseline is really compiled.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 100000

    def fresh():
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    def per_shape(section, key, run, **extra):
        """Runs `run(model, m, section_dict)` at every shape, from a fresh Dynamo, saving after
        each."""
        if section not in sections:
            return
        sec = out["sections"].setdefault(key, {"rows": [], **extra})
        for model in models:
            for m in shapes(model):
                fresh()
                run(model, m, sec)
                save()

    def lm_head_shape(model, m, sec):
        import suite_lm_head as lhb

        ms = lhb.methods(a.lm_head_chunk_bytes)  # a new torch.compile wrapper per shape
        if "liger_unavailable" in ms:
            out["absent"]["liger (LM head)"] = ms.pop("liger_unavailable")
        vocab = PAPER_V if model in PAPER_MODELS else lhb.V
        row = lhb.run_shape(ms, ALL_MODELS[model][0], m, reps=6, vocab=vocab, progress=progress)
        row["model"] = model
        sec["rows"].append(row)
        print(
            f"lm-head {model:11s} M={m:5d} "
            + " ".join(f"{k}={v:.2f}" for k, v in row["ms"].items())
            + " | peak MiB "
            + " ".join(f"{k}={v:.0f}" for k, v in row["peak_extra_MiB"].items()),
            flush=True,
        )

    per_shape("ops", "ops", lambda model, m, sec: ops_section(model, m, sec, progress, liger, fi))
    per_shape("chain-fwd", "chain_fwd", lambda model, m, sec: cb.run_shape(model, m, sec, progress))
    per_shape(
        "chain",
        "chain",
        lambda model, m, sec: ctb.run_shape(model, m, sec, progress, backward_only=True),
    )
    per_shape("lm-head", "lm_head", lm_head_shape, chunk_bytes=a.lm_head_chunk_bytes)
    per_shape(
        "sustained",
        "sustained",
        lambda model, m, sec: ctb.run_shape(model, m, sec, progress, sustained=a.sustained_runs),
    )
    per_shape(
        "chain-profile",
        "chain_profile",
        lambda model, m, sec: ctb.run_shape(model, m, sec, progress, profile=True),
    )
    fp8_programs = a.fp8_programs.split(",") if a.fp8_programs else None
    if "fp8" in sections:
        import suite_fp8

        per_shape("fp8", "fp8", lambda model, m, sec: suite_fp8.run_shape(
            model, m, sec, progress, programs=fp8_programs))
    if "fp8-fused" in sections:
        import suite_fp8

        per_shape(
            "fp8-fused",
            "fp8",
            lambda model, m, sec: suite_fp8.run_shape(model, m, sec, progress, fused_only=True,
                                                      programs=fp8_programs),
        )
    if "fp8-chain" in sections:
        import suite_fp8_chain

        tao = suite_fp8_chain.load_torchao(out["absent"])
        if tao:
            out["torchao_version"] = tao.__version__
        per_shape(
            "fp8-chain",
            "fp8_chain",
            lambda model, m, sec: suite_fp8_chain.run_shape(model, m, sec, progress, torchao=tao,
                                                            profile=a.fp8_chain_profile),
            targets=suite_fp8_chain.TARGETS,
        )
    if "e2e" in sections:
        import suite_e2e

        systems = (suite_e2e.FP8_COMPARISON if a.e2e_systems == "fp8" else
                   a.e2e_systems.split(",") if a.e2e_systems else suite_e2e.SYSTEMS)
        suite_e2e.run(progress, a.e2e_models.split(","), systems, steps=a.e2e_steps,
                      rounds=a.e2e_rounds, timeout_s=a.e2e_timeout,
                      out=out["sections"].setdefault("e2e", {}), save=save)
    if "train" in sections:
        import suite_train

        fresh()
        # The loss-curve plot goes beside the results file: <stem>.png.
        out["sections"]["train"] = suite_train.run(
            os.path.splitext(path)[0], progress, steps=a.train_steps, compile=a.train_compile
        )
        tr = out["sections"]["train"]
        print(
            "train: max relative loss difference "
            f"{tr['max_rel_diff']:.2e} (step {tr['max_rel_diff_step']}); tokens/s "
            + " ".join(f"{k}={v:.0f}" for k, v in tr["tokens_per_s"].items()),
            flush=True,
        )
    if "train-parity" in sections:
        import suite_train

        fresh()

        def save_parity(sec):
            out["sections"]["train_parity"] = sec
            save()

        sec = suite_train.run_parity(
            os.path.splitext(path)[0], progress, save=save_parity,
            **suite_train.parse_settings(a.train_parity_set, steps=a.train_parity_steps,
                                         budget_s=a.train_parity_budget))
        save_parity(sec)
        print(suite_train.parity_line(sec), flush=True)
    save()
    for where, ab in [("", out["absent"])] + [
        (f"{n}: ", sec.get("absent", {})) for n, sec in out["sections"].items()
    ]:
        for k, v in ab.items():
            print(f"absent: {where}{k}: {v}", flush=True)
    progress(f"done: {path}")


if __name__ == "__main__":
    main()
