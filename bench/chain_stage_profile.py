"""Per-stage time of the layer chain forward + backward measured inside the running chain.

The suite times each op alone (L2 cleared, idle gaps between runs). A 15-130 ms stream of GEMMs
runs at other clocks, so the sum of those times does not explain the chain's total. Here the whole
chain runs back to back, with a CUDA event between every two launches:
- ours: the fused chain of bench/chain_train_bench.py, every launch, a fold counted with its GEMM;
- the GEMM-only floor: its 12 cuBLAS GEMMs, run in the order of our stages (the 4 forward GEMMs,
  then QKV's, down-proj's, gate/up's and out-proj's gradients, as our backward runs them), so each
  floor GEMM sits after the same predecessors as the stage it is paired with. (The suite's
  gemm_only runs the backward out-proj first; the total is the same GEMMs.)
Rounds alternate between the two, with L2 cleared before each. Per stage the median over rounds;
next to it the floor's GEMM of the same shape.

  python3 bench/chain_stage_profile.py --lib .gpubin/libcoda_capi.so [--models llama3-8B]
      [--m 16384] [--rounds 20] [--energy CHAINS] [--json out.json] [--commit sha]

--energy CHAINS adds, per shape, the time and the energy (NVML's cumulative counter) per chain of
each variant run CHAINS times back to back, alternating over 6 rounds: whether ours spends more
energy per chain than the floor, which at the power limit (70B) becomes time.
"""

import argparse
import statistics
import sys

import torch

from chain_bench import (ALL_MODELS, MODELS, Coda, EnergyCounter, bench_sustained, chain_inputs,
                         flush_l2, progress_printer, results_file, write_json)
from chain_train_bench import ours_chain, ours_floor_gemms

# Our stage -> the floor's GEMM of the same shape (B3 has none).
FLOOR_OF = {
    "F1 out-proj": "fwd out-proj", "F2 gate/up": "fwd gate/up", "F1 down-proj": "fwd down-proj",
    "F3 qkv+RoPE": "fwd qkv", "B1 qkv": "dX qkv", "dW qkv": "dW qkv", "B2 SwiGLU bwd": "dX down-proj",
    "dW down": "dW down-proj", "B1 gate/up": "dX gate/up", "dW gate/up": "dW gate/up",
    "dW o": "dW out-proj", "d(y)": "dX out-proj",
}


def timed_sequence(named):
    """Runs the (stage, fn) launches back to back with an event at every boundary; returns a
    function that, after synchronization, gives {stage: ms} (summed over a stage's launches) and
    the total."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(named) + 1)]
    ev[0].record()
    for i, (_, fn) in enumerate(named):
        fn()
        ev[i + 1].record()

    def read():
        per = {}
        for i, (stage, _) in enumerate(named):
            per[stage] = per.get(stage, 0.0) + ev[i].elapsed_time(ev[i + 1])
        return per, ev[0].elapsed_time(ev[-1])

    return read


def profile_shape(coda, model, m, rounds, progress, energy=None):
    t = chain_inputs(model, m, 7 * m + ALL_MODELS[model][0])
    dx2_up, dqkv_up = t.rnd(m, t.hidden, scale=0.1), t.rnd(m, t.qkv_w, scale=0.1)
    o = ours_chain(coda, t, m, dx2_up, dqkv_up)
    ours = o.named_calls
    floor_gemm = ours_floor_gemms(t, o)
    # The floor's GEMMs in our stages' order, so each pair sits after the same predecessors.
    order = list(dict.fromkeys(FLOOR_OF[s] for s, _ in ours if s in FLOOR_OF))
    assert sorted(order) == sorted(floor_gemm), (order, list(floor_gemm))
    floor = [(name, floor_gemm[name]) for name in order]
    variants = {"coda": ours, "gemm_only": floor}
    for v in variants.values():  # warm-up
        for _, fn in v:
            fn()
    torch.cuda.synchronize()
    progress(f"{model} M={m}: {rounds} rounds")
    samples = {k: [] for k in variants}
    keys = list(variants)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            flush_l2()
            read = timed_sequence(variants[k])
            torch.cuda.synchronize()
            samples[k].append(read())
    out = {}
    if energy is not None:
        progress(f"{model} M={m}: energy, {energy[1]} rounds of {energy[0]} chains")
        chains, rounds_e, counter = energy
        out["energy"] = bench_sustained(
            {k: (lambda seq=seq: [fn() for _, fn in seq]) for k, seq in variants.items()},
            chains, rounds_e, counter)
    for k, runs in samples.items():
        stages = list(dict.fromkeys(s for s, _ in variants[k]))
        out[k] = {"total_ms": statistics.median(tot for _, tot in runs),
                  "stages_ms": {s: statistics.median(per[s] for per, _ in runs) for s in stages}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--m", default="8192,16384")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--energy", type=int, default=0, metavar="CHAINS",
                    help="also the energy per chain (NVML), CHAINS back to back per sample")
    a = ap.parse_args()
    coda = Coda(a.lib)
    energy = None
    if a.energy:
        counter = EnergyCounter()
        if counter.nvml is None:
            sys.exit("chain_stage_profile: --energy needs NVML (libnvidia-ml.so.1)")
        energy = (a.energy, 6, counter)
    res, progress = results_file("chain_stage_profile", a.commit), progress_printer()
    for model in a.models.split(","):
        for m in (int(x) for x in a.m.split(",")):
            p = profile_shape(coda, model, m, a.rounds, progress, energy)
            res["rows"].append({"model": model, "m": m, **p})
            ours, fl = p["coda"], p["gemm_only"]
            print(f"\n{model} M={m}: ours {ours['total_ms']:.3f} ms, GEMM-only floor "
                  f"{fl['total_ms']:.3f} ms (in-chain medians)")
            if "energy" in p:
                e = p["energy"]
                eo, ef = e["coda"], e["gemm_only"]
                print(f"  sustained, per chain: ours {eo['ms']:.3f} ms {eo['joules']:.2f} J "
                      f"({eo['joules'] / eo['ms'] * 1000:.0f} W), floor {ef['ms']:.3f} ms "
                      f"{ef['joules']:.2f} J ({ef['joules'] / ef['ms'] * 1000:.0f} W); ratio "
                      f"time {eo['ms'] / ef['ms']:.3f}, energy {eo['joules'] / ef['joules']:.3f}")
            print(f"  {'stage':16s} {'ours':>8s} {'floor GEMM':>11s} {'ratio':>6s}")
            for s, v in ours["stages_ms"].items():
                f = fl["stages_ms"].get(FLOOR_OF.get(s, ""), float("nan"))
                print(f"  {s:16s} {v:8.3f} {f:11.3f} {v / f:6.3f}")
            sys.stdout.flush()
            del p
            torch.cuda.empty_cache()
            write_json(a.json, res)


if __name__ == "__main__":
    main()
