#!/usr/bin/env python3
"""Per-kernel CUDA time of the LM head forward + backward (mean loss): coda's three-GEMM path,
torch.compile and the cuBLAS GEMM floor, at one shape, with torch.profiler. Answers "which stage
costs what" for the LM-head benchmark (bench/lm_head_bench.py).

    CODA_TORCH_LIBRARY=.../libcoda_torch.so python3 bench/lm_head_profile.py --hidden 2048 --m 8192
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from lm_head_bench import fwd_bwd, gemm_floor, make_inputs, methods  # noqa: E402


def kernel_times(fn, reps):
    fn()  # warm-up (and compile)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[label(e.name)] += e.device_time_total / 1e3 / reps  # ms per call
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def label(name: str) -> str:
    """Our CUTLASS kernels share a long (mangled) prefix: name them by the coda types in their
    template arguments (the fusion's epilogue nodes), the schedule and the MMA atom instead."""
    if "cutlass" not in name:
        return name[:110]
    nodes = []
    for m in re.finditer(r"4coda6kernel", name):  # length-prefixed identifiers follow
        i = m.end()
        while i < len(name) and name[i].isdigit():
            j = i
            while name[j].isdigit():
                j += 1
            n = int(name[i:j])
            nodes.append(name[j:j + n])
            i = j + n
    nodes = [n for n in dict.fromkeys(nodes) if n not in ("epilogue", "fusions")] or ["plain"]
    sched = "coop" if "Cooperative" in name else "ping" if "Pingpong" in name else "?"
    mma = re.search(r"MMA_(\d+x\d+)x\d+", name)
    return f"coda {sched} {mma.group(1) if mma else '?'} {' '.join(nodes[:4])}"[:110]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    x, gamma, w, t = make_inputs(a.hidden, a.m, vocab=a.vocab)
    x, gamma, w = (v.detach().requires_grad_() for v in (x, gamma, w))
    ms = methods(a.chunk_bytes)
    runs = {"coda_chunked": lambda: fwd_bwd(ms["coda_chunked"], x, gamma, w, t),
            "compile": lambda: fwd_bwd(ms["compile"], x, gamma, w, t),
            "gemm_floor": lambda: gemm_floor(x, gamma, w, t)}
    out = {"shape": vars(a), "device": torch.cuda.get_device_name(), "kernels_ms": {}}
    for name, fn in runs.items():
        k = kernel_times(fn, a.reps)
        out["kernels_ms"][name] = k
        print(f"== {name}: {sum(k.values()):.2f} ms of kernels per fwd+bwd", flush=True)
        for kname, v in list(k.items())[:12]:
            print(f"  {v:8.3f}  {kname}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
