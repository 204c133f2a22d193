#!/usr/bin/env python3
"""coda.nn under FSDP2 or tensor parallelism on several GPUs vs one GPU: the same model (same
initialization), the same global batches, AdamW. FSDP2: per-layer fully_shard units, each rank a
share of the batch. TP: coda.parallel.TensorParallelLlama (heads / intermediate split, sequence-
parallel rows, vocabulary-parallel LM head unless --lm-head sequence), every rank the whole
batch. Two sizes: --model small (H 1024, 4 layers, V 32000: mostly communication) and
--model llama3-1B (the LLaMA-3.2 1B shape, tied embeddings). Reports both loss curves, their max relative
difference, and tokens/s per GPU (median step time after warm-up).

    python3 bench/fsdp_check.py --mode single --out R            # one GPU, writes R-single.json
    torchrun --nproc-per-node 2 bench/fsdp_check.py --mode fsdp --out R   # writes R-fsdp.json,
                                                                  # compared with R-single.json
    torchrun --nproc-per-node 2 bench/fsdp_check.py --mode tp --out R     # writes R-tp.json
    ... --mode tp-unfused   the same sharding with plain PyTorch ops (the unfused TP baseline)
    ... --precision fp8     (single, fsdp and tp) the FP8 model (precision="fp8"):
                            R-single-fp8.json, R-fsdp-fp8.json, R-tp-fp8.json, each sharded run
                            compared with the single FP8 run

NCCL runs through PyTorch's process group with NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the GPU machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import coda  # noqa: E402
from coda.nn import CodaLlamaForCausalLM, LlamaConfig  # noqa: E402
from suite_train import token_stream  # noqa: E402


MODELS = {
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=4,
                  num_heads=16, num_kv_heads=4, rope_theta=500000.0),
    "llama3-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                      tie_word_embeddings=True),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["single", "fsdp", "tp", "tp-unfused"], required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--lm-head", choices=["vocab", "sequence"], default="vocab",
                    help="TP only: vocabulary- or sequence-parallel LM head")
    ap.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                    help="the model's projections (fp8: blockwise FP8; not with tp-unfused)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.precision == "fp8" and args.mode == "tp-unfused":
        raise SystemExit("fsdp_check: --precision fp8 runs with --mode single, fsdp or tp (the "
                         "unfused TP baseline runs in bf16)")
    fsdp, tp = args.mode == "fsdp", args.mode in ("tp", "tp-unfused")
    if fsdp or tp:
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    torch.cuda.set_device(rank)
    cfg = LlamaConfig(**MODELS[args.model])
    torch.manual_seed(0)  # the same initialization on every rank and in the single run
    model = CodaLlamaForCausalLM(cfg, device="cuda", dtype=torch.bfloat16,
                                 precision=args.precision)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if tp:
        from coda.parallel import TensorParallelLlama

        model = TensorParallelLlama(model, fused=args.mode == "tp", lm_head=args.lm_head)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = token_stream(cfg.vocab_size, args.batch, args.seq, args.steps).cuda()
    per = args.batch // world if fsdp else args.batch
    losses, times = [], []
    for step in range(args.steps):
        first = rank * per if fsdp else 0  # TP: every rank takes the whole batch
        ids = data[step, first:first + per]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = model(ids, ids)
        loss.backward()
        if tp:  # norms, embedding, LM head: each rank holds its share of their gradient
            model.all_reduce_replicated_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e.record()
        total = loss.detach().clone()
        if fsdp:  # equal token counts per rank: the mean of the means is the global mean
            dist.all_reduce(total)
            total /= world
        if tp:  # each rank's loss is its rows' share of the global mean
            dist.all_reduce(total)
        losses.append(total)
        times.append((s, e))
    torch.cuda.synchronize()
    curve = [float(x) for x in torch.stack(losses).float().cpu()]
    warm = max(1, args.steps // 5)
    step_ms = statistics.median(s.elapsed_time(e) for s, e in times[warm:])
    tokens_per_gpu = per * args.seq / (world if tp else 1)
    res = {"mode": args.mode, "model": args.model, "precision": args.precision,
           "lm_head": args.lm_head if tp else None,
           "batch": args.batch, "seq": args.seq, "world": world, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "commit": os.environ.get("CODA_COMMIT", "unknown"),
           "command": " ".join(sys.argv), "loss": curve, "median_step_ms": step_ms,
           "tokens_per_s_per_gpu": tokens_per_gpu / (step_ms / 1e3),
           "peak_mib_per_gpu": torch.cuda.max_memory_allocated() / 2**20}
    if rank == 0:
        single_path = args.out + "-single" + ("-fp8" if args.precision == "fp8" else "") + ".json"
        if (fsdp or tp) and os.path.exists(single_path):
            with open(single_path) as f:
                single = json.load(f)
            same = {k: (single.get(k, "bf16" if k == "precision" else None), res[k])
                    for k in ("model", "batch", "seq", "precision")}
            if any(a != b for a, b in same.values()):
                raise SystemExit(f"fsdp_check: {single_path} ran another problem "
                                 f"(single, this run): {same}")
            rel = [abs(a - b) / abs(b) for a, b in zip(curve, single["loss"])]
            res["vs_single"] = {
                "max_rel_loss_diff": max(rel), "single_tokens_per_s_per_gpu":
                single["tokens_per_s_per_gpu"],
                "per_gpu_throughput_ratio": res["tokens_per_s_per_gpu"] /
                single["tokens_per_s_per_gpu"]}
        tag = args.mode + ("-seq" if tp and args.lm_head == "sequence" else "") + (
            "-fp8" if args.precision == "fp8" else "")
        with open(f"{args.out}-{tag}.json", "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: v for k, v in res.items() if k != "loss"}, indent=1), flush=True)
        print("[fsdp_check] loss first/last:", curve[0], curve[-1], flush=True)
    if fsdp or tp:
        dist.destroy_process_group()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"[fsdp_check] {time.time() - t0:.0f} s", flush=True)
