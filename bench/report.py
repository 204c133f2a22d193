"""Generates docs/performance.md from bench/results/*.json (the files gpu-check brings back).

  python3 bench/report.py [--results bench/results] [--out docs/performance.md]

Tables: plain GEMM vs cuBLAS, each fused program vs our plain GEMM, the forward layer chain vs
every baseline with accuracy. Every number comes from a results file; the file, its commit and its
command are printed with each table.
"""

import argparse
import glob
import json
import math
import os


def latest(results, pattern):
    files = sorted(glob.glob(os.path.join(results, pattern)))
    return files[-1] if files else None


def header(path, d):
    return (f"Source: `{os.path.relpath(path)}` — commit `{d.get('commit', '?')}`, "
            f"{d.get('device', '?')}; command: `{d.get('command', '?')}`.\n")


def gemm_table(path):
    d = json.load(open(path))
    rows = [r for r in d["rows"] if r.get("kind") == "best"]
    out = ["## Plain GEMM vs cuBLAS (bf16, D = X·Wᵀ)\n", header(path, d),
           "Ours with the configuration `kernel/heuristic.cpp` picks, timed alternately with "
           "cuBLASLt (top heuristic, 32 MiB workspace) in one process; median of 21 each, L2 "
           "flushed before every run.\n",
           "| model | op | M | N | K | cuBLAS ms | ours ms | ours TFLOP/s | ours / cuBLAS speed | config |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['op']} | {r['m']} | {r['n']} | {r['k']} | {r['cublas_ms']:.3f} | "
                   f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['ratio_vs_cublas']:.3f} | "
                   f"{r['config']} sw{r['swizzle']} {r['raster']} |")
    ratios = [r["ratio_vs_cublas"] for r in rows if r["ratio_vs_cublas"] == r["ratio_vs_cublas"]]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    out.append(f"\nGeometric mean {geo:.3f} over {len(ratios)} shapes, worst {min(ratios):.3f} "
               "(target: ≥ 0.98, none below 0.90).\n")
    return out


def program_table(path):
    d = json.load(open(path))
    out = ["## Fused programs vs our plain GEMM of the same shape and configuration\n", header(path, d),
           "Fused and plain timed alternately; each fused output spot-checked against fp64 first. "
           "Target: fused ≤ 1.03 × plain.\n",
           "| model | op | M | N | K | config | plain ms | fused ms | fused / plain |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['model']} | {r['op']} | {r['m']} | {r['n']} | {r['k']} | {r['config']} | "
                   f"{r['plain_ms']:.3f} | {r['fused_ms']:.3f} | {r['fused_over_plain']:.3f} |")
    return out + [""]


def chain_table(path):
    d = json.load(open(path))
    out = ["## Forward layer chain (out-proj+residual+RMSNorm → gate/up+SwiGLU → down+residual+RMSNorm → QKV+RoPE)\n",
           header(path, d) + f"torch {d.get('torch')}, CUDA {d.get('cuda')}. `triton.testing.do_bench` medians.\n",
           "| model | M | ours ms | GEMM-only | eager | torch.compile | Liger | speedup vs best baseline | max err x2 ours / eager | max err qkv ours / eager |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['model']} | {r['m']} | {r.get('ms_coda', float('nan')):.3f} | {r.get('ms_gemm_only', float('nan')):.3f} | "
                   f"{r.get('ms_eager', float('nan')):.3f} | {r.get('ms_compile', float('nan')):.3f} | {r.get('ms_liger', float('nan')):.3f} | "
                   f"{r['speedup_vs_best_baseline']:.3f} | {r['err_x2_ours']:.4f} / {r['err_x2_eager']:.4f} | "
                   f"{r['err_qkv_ours']:.4f} / {r['err_qkv_eager']:.4f} |")
    if d.get("accuracy"):
        out += ["", "Per-op accuracy: max |out − fp32 chain| of each fused op's outputs, ours vs eager bf16 "
                "(OPS.md §5 asks ours ≤ 2 × eager + 1e-6).", "",
                "| model | M | output | ours | eager bf16 |", "|---|---|---|---|---|"]
        for a in d["accuracy"]:
            out.append(f"| {a['model']} | {a['m']} | {a['output']} | {a['max_err_ours']:.4f} | {a['max_err_eager']:.4f} |")
    if d.get("absent"):
        out.append(f"\nAbsent baselines: {d['absent']}")
    return out + [""]


def train_table(path):
    d = json.load(open(path))
    out = ["## Layer chain forward + backward (given the upstream gradients of x2 and qkv)\n",
           header(path, d) + f"torch {d.get('torch')}, CUDA {d.get('cuda')}. `triton.testing.do_bench` medians.\n",
           "| model | M | ours ms | GEMM-only | eager | torch.compile | Liger | speedup vs best baseline | gradients vs fp32 (ours ≤ 2 × eager) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        worst = max((v["ours"] / max(v["eager"], 1e-12) for v in r["grad_errors"].values()), default=float("nan"))
        out.append(f"| {r['model']} | {r['m']} | {r.get('ms_coda', float('nan')):.3f} | {r.get('ms_gemm_only', float('nan')):.3f} | "
                   f"{r.get('ms_eager', float('nan')):.3f} | {r.get('ms_compile', float('nan')):.3f} | {r.get('ms_liger', float('nan')):.3f} | "
                   f"{r['speedup_vs_best_baseline']:.3f} | {r['check']} (worst ours/eager error ratio {worst:.2f}) |")
    for p in d.get("profile", []):
        out += ["", f"Per op, {p['model']} M = {p['m']} (ours alone vs the cuBLAS GEMM of the same shape, ms):", "",
                "| op | ours | cuBLAS GEMM | ratio |", "|---|---|---|---|"]
        for name, v in p["ops"].items():
            ratio = v["ours_ms"] / v["cublas_gemm_ms"] if v["cublas_gemm_ms"] else float("nan")
            out.append(f"| {name} | {v['ours_ms']:.3f} | {v['cublas_gemm_ms']:.3f} | {ratio:.2f} |")
    return out + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--out", default="docs/performance.md")
    a = ap.parse_args()
    lines = ["# Performance (generated by bench/report.py from bench/results — do not edit by hand)\n",
             "All numbers: one NVIDIA H200 (the lent machine), bf16 in, fp32 accumulate. Absolute times "
             "drift between runs by up to ~20% (clock and power state); compare ratios measured in the "
             "same run.\n"]
    for pattern, fn in (("*-gemm.json", gemm_table), ("*-programs.json", program_table),
                        ("*-chain-fwd.json", chain_table), ("*-chain-fwd-bwd*.json", train_table)):
        path = latest(a.results, pattern)
        if path:
            lines += fn(path)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
