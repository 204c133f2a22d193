"""FSDP2 (torch.distributed.fsdp.fully_shard) over coda.nn on the CPU: two processes (gloo), each
with half of the batch, must reproduce the single-process model's loss and every gradient in fp64.
(Multi-GPU runs of the same check are scripts/gpu-check's business; see docs/status.md.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from coda.nn import CodaLlamaForCausalLM, LlamaConfig
from helpers import run_gloo

CFG = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
           num_kv_heads=2, head_dim=4, rope_theta=10000.0)


def build(tie: bool, **config) -> CodaLlamaForCausalLM:
    """The test model (CFG, with ``config`` overriding entries) in fp64."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CFG, **config}, tie_word_embeddings=tie)
    model = CodaLlamaForCausalLM(cfg, dtype=torch.float64)
    with torch.no_grad():  # non-trivial norm weights so every γ gradient matters
        for n, p in model.named_parameters():
            if "gamma" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (4, 9), generator=g)
    return ids, ids.clone()


def worker(rank: int, world: int, tie: bool, per_layer: bool, out: dict) -> None:
    """One rank, inside the gloo group helpers.run_gloo made."""
    import coda  # noqa: F401  (loads the ops in this process)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(tie)
    mesh = init_device_mesh("cpu", (world,))
    if per_layer:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, labels = batch()
    per = ids.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)
    loss = model(ids[mine], labels[mine])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"rank {rank}: no gradient for {missing}"
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        out["loss"] = (total / world).item()
        out["grads"] = {n: g.clone() for n, g in grads.items()}


@pytest.mark.parametrize("per_layer", [False, True], ids=["root-unit", "unit-per-layer"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fsdp2_two_ranks_match_one_process_in_fp64(tie, per_layer):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ref = build(tie)
    ids, labels = batch()
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    got = run_gloo(worker, 2, tie, per_layer)
    # Every rank sees (S - 1) counted targets per row and the same number of rows, so the mean of
    # the per-rank means is the full-batch mean, and FSDP2's gradient average is the full gradient.
    assert abs(got["loss"] - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(got["grads"]) == set(ref_grads)
    for n, g in ref_grads.items():
        err = (got["grads"][n] - g).abs().max().item()
        assert err <= 1e-10 * g.abs().max().item() + 1e-300, f"d {n}: {err:.3e}"
