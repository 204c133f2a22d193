"""The suite's e2e section: a whole model's training step, forward + backward + AdamW, in tokens/s
and peak memory, for the systems people train LLaMA with, from one initialization on one batch:

  hf_eager        transformers' LlamaForCausalLM (Qwen3ForCausalLM for the Qwen3 shape), eager
                  (sdpa attention)
  hf_compile      the same with each decoder block torch.compile'd (TorchTitan's per-block style)
  liger           the same patched by Liger Kernel (RMSNorm, RoPE, SwiGLU, fused linear
                  cross-entropy), eager
  coda            coda.nn (coda.convert.from_hf of the same weights), eager
  coda_compile    coda.nn with each decoder block torch.compile'd (the documented way)
  coda_patched    the HF model patched in place (coda.integrations.patch_hf), eager
  coda_fullgraph  coda.nn under torch.compile(fullgraph=True) (not in the default list: its first
                  step is the whole model's compilation)
  coda_fp8        coda.nn with precision="fp8": every projection GEMM in blockwise FP8 (docs/math.md
                  §6), eager
  coda_fp8_ra     coda_fp8 with fp8_recompute_a: a's weight-gradient copy made from z in the
                  backward instead of kept (less memory, one more pass over z)
  coda_fp8_z      coda_fp8 with fp8_z: the MLP's pre-activation z saved for the backward in FP8
                  (F2's epilogue quantizes it; 2I bytes a token and layer instead of 4I)
  coda_fp8_z_recast
                  coda_fp8_z with fp8_weight_cache=False: no FP8 copy of a weight kept (each
                  forward casts w, each backward casts wᵀ), a's copy kept
  coda_fp8_ra_recast
                  coda_fp8_ra with fp8_weight_cache=False (z in bf16)
  coda_fp8_lean   coda_fp8_ra with fp8_z and fp8_weight_cache=False: no FP8 copy of a weight
                  kept, each forward casts w and each backward casts wᵀ (recast_w_t): the least
                  memory, for two weight casts a micro-batch instead of one an optimizer step
  coda_fp8_cutlass
                  coda_fp8 with the weight gradients on our CUTLASS kernel
                  (coda::set_fp8_wgrad_backend "cutlass"; the others run them on the op's
                  default backend, cuBLASLt where it has a kernel, ours elsewhere)
  coda_patched_fp8
                  the HF model patched in place with precision="fp8", eager
  SYSTEM@PLACEMENT
                  a coda FP8 system with its process's FP8 epilogue placement set first
                  (torch.ops.coda.set_fp8_epilogue: fused, split or auto; docs/design.md), e.g.
                  coda_fp8_z_recast@split beside coda_fp8_z_recast@fused in one run
  torchao_fp8_tensorwise, torchao_fp8_rowwise
                  the HF model with torchao's float8 training (convert_to_float8_training with the
                  recipe's Float8LinearConfig; the LM head left in bf16, as coda's), each decoder
                  block torch.compile'd (torchao's float8 needs compile to be fast)

Each system runs in a process of its own (Liger patches transformers' classes module-wide, and
Dynamo's caches and the allocator's pools would carry over), builds the model from the same seed,
and has its first step timed on the wall clock
(compilation included), then `warmup` more steps and `steps` timed ones (CUDA events; the median
is the result). With `rounds` > 1 the systems run round after round (A B C, A B C, ...), a fresh
process each time, so that a drift of the GPU's clocks or temperature over the call lands on every
system alike; a row then holds each round's median (`round_ms`) and the median of those. Peak
memory is torch.cuda.max_memory_allocated over the timed steps (the largest over rounds), parameters
and optimizer state included. The first step's loss is recorded: every system starts from the
same weights and batch, so they must agree to bf16 accuracy. So is the last: each system's loss
drop over its steps, relative to the bf16 reference's (`coda`, else `hf_eager`), is the row's
`loss_drop_vs_ref`, and a drop below suite_report.LOSS_DROP_FLOOR of the reference's marks the
row `loss_lags` (a system that does not learn as the others do, e.g. weights left stale after an
optimizer step, is not a result).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
from suite_report import loss_check

import coda

MODEL_SHAPES = {
    # LLaMA-3.2-1B: all 16 layers, tied embeddings; 4 x 4096 tokens per step.
    "llama3.2-1B": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192,
                        vocab=128256, tie=True, batch=4, seq=4096),
    # LLaMA-3-8B's layer shape, 8 of its 32 layers; 2 x 4096 tokens per step.
    "llama3-8B": dict(layers=8, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                      vocab=128256, tie=False, batch=2, seq=4096),
    # Qwen3-1.7B's layer shape (QK-norm, head_dim 128, 151936 vocabulary, tied), 8 of its 28
    # layers; 4 x 4096 tokens per step.
    "qwen3-1.7B": dict(family="qwen3", layers=8, hidden=2048, heads=16, kv_heads=8, head_dim=128,
                       intermediate=6144, vocab=151936, tie=True, batch=4, seq=4096),
}
# coda.nn's FP8 systems: (fp8_recompute_a, fp8_z, weight cache kept) of each (docstring above).
FP8_VARIANTS = {
    "coda_fp8": (False, False, True), "coda_fp8_cutlass": (False, False, True),
    "coda_fp8_ra": (True, False, True), "coda_fp8_z": (False, True, True),
    "coda_fp8_z_recast": (False, True, False), "coda_fp8_ra_recast": (True, False, False),
    "coda_fp8_lean": (True, True, False),
}
SYSTEMS = ("hf_eager", "hf_compile", "liger", "coda", "coda_compile", "coda_patched")
FP8_SYSTEMS = ("coda_fp8", "torchao_fp8_tensorwise", "torchao_fp8_rowwise", "coda_fp8_ra",
               "coda_fp8_z", "coda_fp8_z_recast", "coda_fp8_ra_recast", "coda_fp8_lean",
               "coda_fp8_cutlass", "coda_patched_fp8")
# The FP8 comparison (suite.py --e2e-systems fp8): the FP8 systems beside our bf16 path and the
# fastest bf16 peers of the default run, all in one run; coda's FP8 variants last, so a run cut
# short by its time limit keeps the peers.
FP8_COMPARISON = FP8_SYSTEMS[:3] + ("coda", "liger", "hf_compile") + FP8_SYSTEMS[3:]


def hf_config(s):
    import transformers

    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"],
                  intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  head_dim=s.get("head_dim", s["hidden"] // s["heads"]),
                  max_position_embeddings=s["seq"], tie_word_embeddings=s["tie"],
                  attn_implementation="sdpa")
    if s.get("family") == "qwen3":
        return transformers.Qwen3Config(**common, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 1000000.0})
    return transformers.LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def new_hf(cfg):
    """A bf16 LlamaForCausalLM (Qwen3ForCausalLM) on the GPU, initialized from the current seed
    (the caller seeds: every system, each in its own process, starts from the same weights)."""
    import transformers

    cls = (transformers.Qwen3ForCausalLM if cfg.model_type == "qwen3" else
           transformers.LlamaForCausalLM)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model


PLACEMENTS = ("auto", "fused", "split")


def placement_of(system):
    """(system, FP8 epilogue placement or None) of a system name, `SYSTEM@PLACEMENT` or `SYSTEM`."""
    base, at, placement = system.partition("@")
    if not at:
        return system, None
    if base not in FP8_VARIANTS and base != "coda_patched_fp8":
        raise ValueError(f"{system}: a placement (@{placement}) is for coda's FP8 systems "
                         f"({', '.join(list(FP8_VARIANTS) + ['coda_patched_fp8'])}), not {base}")
    if placement not in PLACEMENTS:
        raise ValueError(f"{system}: the placement must be one of {', '.join(PLACEMENTS)}, got "
                         f"'{placement}'")
    return base, placement


def build(system, cfg):
    """(model, step's loss function) of one system (a `@placement` suffix: placement_of)."""
    system, placement = placement_of(system)
    if placement:  # process-wide; each system runs in a process of its own
        torch.ops.coda.set_fp8_epilogue(placement)
    hf = new_hf(cfg)
    if system.startswith("torchao_fp8_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = system.removeprefix("torchao_fp8_")
        convert_to_float8_training(
            hf.model, config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))
        for layer in hf.model.layers:
            layer.compile()
        return hf, lambda m, ids: m(input_ids=ids, labels=ids).loss
    if system in ("hf_eager", "hf_compile", "liger"):
        if system == "hf_compile":
            for layer in hf.model.layers:
                layer.compile()
        if system == "liger":
            import liger_kernel.transformers as liger

            apply = (liger.apply_liger_kernel_to_qwen3 if cfg.model_type == "qwen3" else
                     liger.apply_liger_kernel_to_llama)
            apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=True, model=hf)
        return hf, lambda m, ids: m(input_ids=ids, labels=ids).loss
    if system in ("coda_patched", "coda_patched_fp8"):
        from coda.integrations import patch_hf

        precision = "fp8" if system == "coda_patched_fp8" else "bf16"
        return patch_hf(hf, precision), lambda m, ids: m(input_ids=ids, labels=ids).loss
    fp8 = FP8_VARIANTS.get(system)
    if system == "coda_fp8_cutlass":  # process-wide; each system runs in a process of its own
        torch.ops.coda.set_fp8_wgrad_backend("cutlass")
    model = coda.convert.from_hf(hf, precision="fp8" if fp8 else "bf16")
    if fp8:
        model.fp8_recompute_a, model.fp8_z, cache = fp8
        if not cache:
            model.fp8_weight_cache = False
    del hf
    if system == "coda_compile":
        for layer in model.layers:
            layer.compile()
    if system == "coda_fullgraph":
        model = torch.compile(model, fullgraph=True)
    return model, lambda m, ids: m(ids, labels=ids)


def measure(system, cfg, ids, warmup, steps, progress):
    model, loss_of = build(system, cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first_loss = step().item()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    peak = torch.cuda.max_memory_allocated()
    last_loss = loss.item()
    ms = statistics.median(times)
    row = dict(system=system, first_step_s=round(first_s, 2), median_step_ms=round(ms, 2),
               min_step_ms=round(min(times), 2), tokens_per_s=round(ids.numel() / ms * 1e3),
               peak_gib=round(peak / 2**30, 2), first_loss=round(first_loss, 5),
               last_loss=round(last_loss, 5))
    progress(f"e2e {system}: {row['median_step_ms']} ms/step, first step {first_s:.1f} s")
    return row


def one(name, system, warmup, steps):
    """One system at one model shape, in this process: its row."""
    s = MODEL_SHAPES[name]
    cfg = hf_config(s)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen).cuda()
    return measure(system, cfg, ids, warmup, steps, lambda m: print(m, file=sys.stderr))


def combine_rounds(rows, tokens):
    """One system's row from its rounds' rows (the first round's losses and first step): the
    median of the rounds' medians, each round's median, the fastest step, the largest peak."""
    row = dict(rows[0])
    medians = [r["median_step_ms"] for r in rows]
    ms = statistics.median(medians)
    row.update(median_step_ms=round(ms, 2), round_ms=medians,
               min_step_ms=min(r["min_step_ms"] for r in rows),
               tokens_per_s=round(tokens / ms * 1e3), peak_gib=max(r["peak_gib"] for r in rows))
    return row


def run(progress=print, models=tuple(MODEL_SHAPES), systems=SYSTEMS, warmup=3, steps=10,
        timeout_s=300, out=None, save=lambda: None, rounds=1, launch=subprocess.run):
    """The section's results (filled into `out`, `save()` called after every system, so a run
    cut short keeps what it measured): per model shape, one row per system (or the reason it is
    absent), each from a process of its own under `timeout_s`; with `rounds` > 1 every system runs
    once a round, the rounds one after another (combine_rounds). A system absent in any round is
    absent. `launch`: subprocess.run's stand-in (tests)."""
    for system in systems:  # a bad placement suffix fails here, before any process starts
        placement_of(system)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out = {} if out is None else out
    out.update(config=dict(warmup=warmup, steps=steps, rounds=rounds,
                           optimizer="AdamW(fused, bf16 params)", process_per_system=True,
                           timeout_s=timeout_s),
               models={})
    for name in models:
        res = out["models"][name] = {"shape": MODEL_SHAPES[name], "rows": [], "absent": {}}
        shape = MODEL_SHAPES[name]
        per_system = {system: [] for system in systems}
        for k in range(rounds):
            for system in systems:
                if system in res["absent"]:
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), name, system, str(warmup),
                       str(steps)]
                at = f"e2e {name} {system}" + (f" (round {k + 1}/{rounds})" if rounds > 1 else "")
                try:
                    p = launch(cmd, capture_output=True, text=True, timeout=timeout_s)
                    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                    if p.returncode or not lines:
                        raise RuntimeError(f"rc={p.returncode}: {p.stderr.strip()[-300:]}")
                    row = json.loads(lines[-1])
                    per_system[system].append(row)
                    progress(f"{at}: {row['median_step_ms']} ms/step, {row['tokens_per_s']} tok/s, "
                             f"peak {row['peak_gib']} GiB, first step {row['first_step_s']} s")
                except (subprocess.TimeoutExpired, RuntimeError, ValueError) as ex:
                    res["absent"][system] = f"{type(ex).__name__}: {ex}"[:400]
                    progress(f"{at}: absent ({res['absent'][system][:160]})")
                res["rows"] = [
                    r[0] if rounds == 1 else combine_rounds(r, shape["batch"] * shape["seq"])
                    for s_, r in per_system.items() if r and s_ not in res["absent"]]
                save()
        for line in loss_check(res):
            progress(line)
        best_peer = max((r for r in res["rows"] if not r["system"].startswith("coda")),
                        key=lambda r: r["tokens_per_s"], default=None)
        if best_peer:
            res["best_peer"] = best_peer["system"]
            for r in res["rows"]:
                r["vs_best_peer"] = round(r["tokens_per_s"] / best_peer["tokens_per_s"], 3)
        save()
    return out


if __name__ == "__main__":  # one system: MODEL SYSTEM WARMUP STEPS -> its row as a JSON line
    name_, system_, warmup_, steps_ = sys.argv[1:5]
    print(json.dumps(one(name_, system_, int(warmup_), int(steps_))))
