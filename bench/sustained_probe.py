"""Why our chain slows down under sustained load: host launch rate, graph replay, energy per GEMM.

chain_train_bench.py --sustained (run 119) found our fused fwd+bwd chain 9-10% slower per step when
run back to back than in single runs after an L2 clear, where the GEMM-only floor and torch.compile
moved by 0-2%. This probe separates the candidate causes, per model at one token count:

  host    the host time to enqueue one step of ours (perf_counter around launches, no sync), next
          to the GPU time of a step: a host slower than the GPU starves it under sustained load;
  graph   ours launched step by step vs the same step captured once into a CUDA graph and
          replayed, both sustained (bench_sustained, NVML energy): equal times clear the host;
  gemms   every fused op of the chain (F1-F3, B1, B2) vs our plain GEMM (empty epilogue) and
          cuBLAS of its shape, sustained: at the 700 W limit a kernel that spends more energy per
          FLOP gets a lower clock. (The weight- and data-gradient plain GEMMs: coda_gemm_bench
          --operands XtY|XW --sustained.)

  alt     with --alt NAME=SPEC (repeatable): our chain also with those kernel configuration
          overrides (coda::kernel::set_kernel_overrides, SPEC as CODA_KERNEL_OVERRIDE), its
          buffers laid out under them, its outputs compared with the heuristic's chain, and all
          timed side by side flushed (bench_interleaved) and sustained, in one process.

  python3 bench/sustained_probe.py --lib .gpubin/libcoda_capi.so [--models llama3-1B,llama3-8B]
      [--m 8192[,16384]] [--alt NAME=SPEC ...] [--chain-only] [--json out.json]
"""

import argparse
import os
import statistics
import sys
import time

import torch

from chain_bench import (ALL_MODELS, Coda, EnergyCounter, bench_interleaved, bench_sustained,
                         chain_inputs, progress_printer, results_file, write_json)
from chain_train_bench import ours_chain, ours_floor_gemms


def host_enqueue_ms(step, steps=20, rounds=5):
    """Median host ms to enqueue one step (no sync inside the batch) and GPU ms per step."""
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host.append((time.perf_counter() - t0) * 1e3 / steps)
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e) / steps)
    return statistics.median(host), statistics.median(gpu)


def batch_for(fn, target_ms=400.0):
    """Runs per sustained batch so that one batch lasts about target_ms (NVML's energy counter
    is too coarse for shorter batches)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        fn()
    e.record()
    torch.cuda.synchronize()
    return max(3, int(target_ms / max(s.elapsed_time(e) / 3, 1e-3)))


def fmt(st):
    return " ".join(f"{k}={v['ms']:.3f}ms/{v['joules']:.3f}J/{v['sm_clock_mhz']}MHz/{v['power_w']}W"
                    for k, v in st.items())


def with_overrides(coda, spec, fn):
    """fn() with the kernel configuration overrides `spec` active, then none."""
    coda("coda_set_kernel_overrides", spec.encode())
    try:
        return fn()
    finally:
        coda("coda_set_kernel_overrides", b"")


def max_rel_diff(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def probe(coda, model, m, counter, progress, alts=None, chain_only=False):
    t = chain_inputs(model, m, 7 * m + ALL_MODELS[model][0])
    dx2_up, dqkv_up = t.rnd(m, t.hidden, scale=0.1), t.rnd(m, t.qkv_w, scale=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # our launches go to `side`, so the step can be captured there
        o = ours_chain(coda, t, m, dx2_up, dqkv_up)

        def step():
            o.forward()
            o.backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        host_ms, gpu_ms = host_enqueue_ms(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            step()
        torch.cuda.synchronize()
        floor_calls = ours_floor_gemms(t, o)

        def floor():
            for fn in floor_calls.values():
                fn()

        floor_graph = torch.cuda.CUDAGraph()
        floor()
        torch.cuda.synchronize()
        with torch.cuda.graph(floor_graph, stream=side):
            floor()
        torch.cuda.synchronize()
        row = {"model": model, "m": m, "host_enqueue_ms_per_step": host_ms, "gpu_ms_per_step": gpu_ms}
        print(f"{model} M={m}: host enqueue {host_ms:.3f} ms/step, GPU {gpu_ms:.3f} ms/step", flush=True)
        chain_variants = {"coda": step, "coda_graph": graph.replay, "gemm_only": floor,
                          "gemm_only_graph": floor_graph.replay}
        outs = ("x2", "qkv", "dy", "dx1", "dwo", "dwd", "dwgu", "dwqkv", "dg_ffn", "dg_attn")
        row["alt"] = {}
        for name, spec in (alts or {}).items():
            # Built under its overrides: its partial buffers and folds follow those tiles.
            oa = with_overrides(coda, spec, lambda: ours_chain(coda, t, m, dx2_up, dqkv_up))

            def alt_step(oa=oa, spec=spec):
                with_overrides(coda, spec, lambda: (oa.forward(), oa.backward()))

            alt_step()
            step()
            torch.cuda.synchronize()
            diff = {k: max_rel_diff(getattr(oa, k), getattr(o, k)) for k in outs}
            row["alt"][name] = {"spec": spec, "max_rel_diff_vs_heuristic": diff}
            print(f"  alt {name} = {spec}: max |diff| / max |heuristic's| "
                  + " ".join(f"{k}={v:.1e}" for k, v in diff.items()), flush=True)
            chain_variants[f"coda_{name}"] = alt_step
        if alts:
            flushed = bench_interleaved({k: v for k, v in chain_variants.items()
                                         if not k.endswith("_graph")}, progress,
                                        f"{model} M={m} flushed")
            row["chain_flushed_ms"] = flushed
            print(f"{model} M={m} chain flushed: "
                  + " ".join(f"{k}={v:.3f}" for k, v in flushed.items()), flush=True)
        n = batch_for(step)
        progress(f"{model} M={m}: chain sustained, batches of {n}")
        row["chain"] = bench_sustained(chain_variants, n, rounds=6, counter=counter)
        row["chain_batch"] = n
        print(f"{model} M={m} chain sustained x{n}: {fmt(row['chain'])}", flush=True)
        row["ops"] = {}
        for name, ours, _, plain, cublas, shape in ([] if chain_only else o.ops):
            if plain is None or cublas is None:
                continue
            v = {"fused": ours, "plain": plain, "cublas": cublas}
            n = batch_for(cublas)
            st = bench_sustained(v, n, rounds=6, counter=counter)
            row["ops"][name] = {"shape": shape, "batch": n, **st}
            print(f"  {name:14s} {shape}: {fmt(st)}", flush=True)
    torch.cuda.synchronize()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--models", default="llama3-1B,llama3-8B")
    ap.add_argument("--m", default="8192")
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=SPEC",
                    help="also our chain under these kernel configuration overrides")
    ap.add_argument("--chain-only", action="store_true", help="skip the per-GEMM section")
    ap.add_argument("--json")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    alts = {}
    for x in a.alt:
        name, eq, spec = x.partition("=")
        if not eq or not name or not spec:
            ap.error(f"--alt expects NAME=SPEC, got '{x}'")
        if name in alts:
            ap.error(f"--alt: the name '{name}' is given twice")
        alts[name] = spec
    if alts and os.environ.get("CODA_KERNEL_OVERRIDE"):
        # with_overrides() clears the overrides after each alternative's launches, so the
        # heuristic's chain would run under other overrides than its buffers were laid out for.
        ap.error("--alt cannot be combined with CODA_KERNEL_OVERRIDE (unset it)")
    counter = EnergyCounter()
    if counter.nvml is None:
        sys.exit("sustained_probe: needs NVML (libnvidia-ml.so.1) for the energy counter")
    coda = Coda(a.lib)
    res, progress = results_file("sustained_probe", a.commit), progress_printer()
    for model in a.models.split(","):
        for m in (int(x) for x in a.m.split(",")):
            res["rows"].append(probe(coda, model, m, counter, progress, alts, a.chain_only))
            write_json(a.json, res)


if __name__ == "__main__":
    main()
