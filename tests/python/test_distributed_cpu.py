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


def shard(model, world: int, per_layer: bool):
    """FSDP2 over this rank's gloo group: a unit per layer (per_layer), then the root; loads the
    ops in this process."""
    import coda  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if per_layer:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank: int, world: int, tie: bool, per_layer: bool, out: dict) -> None:
    """One rank, inside the gloo group helpers.run_gloo made."""
    model = shard(build(tie), world, per_layer)
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


# ---- FSDP2 with precision="fp8": the weight cache must see every all-gathered update -------------
FP8_CFG = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, rope_theta=10000.0)
FP8_STEPS = 3


def build_fp8() -> CodaLlamaForCausalLM:
    torch.manual_seed(0)
    return CodaLlamaForCausalLM(LlamaConfig(**FP8_CFG), dtype=torch.float64, precision="fp8")


def fp8_batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, FP8_CFG["vocab_size"], (4, 12), generator=g)
    return ids, ids.clone()


def train_fp8(model, ids, labels, rank=0, world=1, refresh=False):
    """FP8_STEPS SGD steps on this rank's rows: the losses (averaged over ranks) of every step and
    every parameter's gradient of the first, full tensors. ``refresh``: drop the FP8 weight caches
    before every step (the reference: its weights quantized anew whatever the cache would do)."""
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    per = ids.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)
    losses, grads = [], None
    for step in range(FP8_STEPS):
        if refresh:
            model.refresh_fp8_weights()
        loss = model(ids[mine], labels[mine])
        loss.backward()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append((total / world).item())
        if grads is None:
            grads = {n: (p.grad.full_tensor() if world > 1 else p.grad).clone()
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads


def fp8_worker(rank: int, world: int, per_layer: bool, out: dict) -> None:
    model = shard(build_fp8(), world, per_layer)
    ids, labels = fp8_batch()
    losses, grads = train_fp8(model, ids, labels, rank, world)
    if rank == 0:
        out["losses"], out["grads"] = losses, grads
        out["kept"] = sum(len(layer._fp8_cache._entries) for layer in model.layers)


@pytest.mark.parametrize("per_layer", [False, True], ids=["root-unit", "unit-per-layer"])
def test_fsdp2_fp8_model_quantizes_each_steps_gathered_weights(per_layer):
    """precision="fp8" under FSDP2 (two ranks): the layers quantize the weights FSDP2 gathers,
    after each optimizer step the updated ones, and keep no FP8 copy of them between forwards, so
    every step's loss equals that of the single-process FP8 model whose caches are dropped before
    every step (fp64). The SGD steps move the weights' power-of-two scales, so a stale operand
    shows in the losses (a version-keyed cache fails here, at random steps: FSDP2 often gathers
    into the same address without a version change). The first step's gradients: the
    gradients' 128x1 copies (1x128 along the tokens) see each rank's tokens, not the whole
    batch's, so their block amax and scale differ by a power of two; that rescales an e4m3 code
    exactly except in the subnormal range (below 2^-6 of the scale, in steps of 2^-9 of it; the
    scale is at most 2·amax/448), where the two roundings differ by up to
    2^-9·2·amax/448 = 8.7e-6 amax per element: they agree to 1e-5 of their largest entry
    (measured ~1.5e-7). The first loss agrees to fp64 rounding; later ones come from weights
    updated by those slightly different gradients, where a weight next to an e4m3 rounding
    boundary can round the other way: 1e-3 relative (measured up to 5e-5; a stale operand is
    off by 10% here)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ref = build_fp8()
    ids, labels = fp8_batch()
    ref_losses, ref_grads = train_fp8(ref, ids, labels, refresh=True)
    assert len(set(ref_losses)) == FP8_STEPS, ref_losses  # the steps moved the weights
    got = run_gloo(fp8_worker, 2, per_layer)
    assert got["kept"] == 0, "FP8 weight operands kept between forwards under FSDP2"
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        tol = 1e-12 if step == 0 else 1e-3
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a!r} vs one process {b!r}"
    assert set(got["grads"]) == set(ref_grads)
    for n, g in ref_grads.items():
        err = (got["grads"][n] - g).abs().max().item()
        assert err <= 1e-5 * g.abs().max().item(), f"d {n}: {err:.3e}"


# ---- a Hugging Face model patched in FP8 (coda.integrations.patch_hf) under FSDP2 ---------------
def build_hf_fp8():
    """A tiny transformers Llama in fp64 (test_hf_cpu.make_hf), patched with precision="fp8"."""
    from coda.integrations import patch_hf
    from test_hf_cpu import make_hf
    return patch_hf(make_hf("untied", seed=4, vocab=FP8_CFG["vocab_size"]), precision="fp8")


def train_hf_fp8(model, ids, labels, rank=0, world=1, refresh=False):
    """train_fp8's steps on a patched HF model (its loss from HF's output; ``refresh``: the
    patched model's FP8 weights dropped before every step)."""
    from coda.integrations import refresh_fp8_weights
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    per = ids.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)
    losses = []
    for _ in range(FP8_STEPS):
        if refresh:
            refresh_fp8_weights(model)
        loss = model(input_ids=ids[mine], labels=labels[mine]).loss
        loss.backward()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append((total / world).item())
        opt.step()
        opt.zero_grad()
    return losses


def hf_fp8_worker(rank: int, world: int, out: dict) -> None:
    import warnings
    from coda.integrations import hf as coda_hf
    model = shard(build_hf_fp8(), world, per_layer=False)
    ids, labels = fp8_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to HF's forward warns: fail on it
        losses = train_hf_fp8(model, ids, labels, rank, world)
    if rank == 0:
        out["losses"] = losses
        patch = getattr(model, coda_hf._ATTR)
        out["kept"] = sum(len(c._entries) for c in patch.fp8_caches.values())


def test_fsdp2_hf_model_patched_in_fp8_quantizes_each_steps_gathered_weights():
    """patch_hf(precision="fp8") on a transformers model, then fully_shard on the model (a unit
    per decoder layer would hook the layers, whose forward the fused path bypasses: it runs HF's
    forward then, with a warning): every step quantizes the weights FSDP2 has gathered, keeping
    none between forwards, so the losses are those of one process whose FP8 weights are dropped
    before every step (tolerances: test_fsdp2_fp8_model_quantizes_each_steps_gathered_weights')."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("transformers")
    ids, labels = fp8_batch()
    ref_losses = train_hf_fp8(build_hf_fp8(), ids, labels, refresh=True)
    assert len(set(ref_losses)) == FP8_STEPS, ref_losses
    got = run_gloo(hf_fp8_worker, 2)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        tol = 1e-12 if step == 0 else 1e-3
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a!r} vs one process {b!r}"
    assert got["kept"] == 0, "FP8 weight operands kept between forwards under FSDP2"


class Parent(torch.nn.Module):
    """A module holding the coda model, as a wrapper with a value head would: fully_shard on it
    alone gathers the model's weights, and the model sees no FSDP2 unit of its own."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels)


def fp8_parent_worker(rank: int, world: int, out: dict) -> None:
    parent = shard(Parent(build_fp8()), world, per_layer=False)
    ids, labels = fp8_batch()
    opt = torch.optim.SGD(parent.parameters(), lr=2.0)
    per = ids.shape[0] // world
    losses = []
    for _ in range(FP8_STEPS + 3):
        loss = parent(ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
        opt.step()
        opt.zero_grad()
    if rank == 0:
        out["losses"] = losses


def test_fsdp2_on_a_parent_module_requantizes_each_steps_gathered_weights():
    """fully_shard on a module above the FP8 model only: the model cannot tell (no FSDP2 unit
    inside it), so its weight cache keys the gathered weights, which no optimizer holds, on every
    optimizer's steps (Fp8WeightCache._key): each step quantizes the updated weights, and the
    losses are those of one process whose FP8 weights are dropped before every step (tolerances:
    test_fsdp2_fp8_model_quantizes_each_steps_gathered_weights')."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_fp8_memory_cpu import train_steps
    ids, labels = fp8_batch()
    ref_losses = train_steps(build_fp8(), ids, labels, FP8_STEPS + 3, refresh=True)
    got = run_gloo(fp8_parent_worker, 2)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        tol = 1e-12 if step == 0 else 1e-3
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a!r} vs one process {b!r}"


def hf_fsdp1_worker(rank: int, world: int, out: dict) -> None:
    import warnings
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    import coda  # noqa: F401
    model = FullyShardedDataParallel(build_hf_fp8(), use_orig_params=True,
                                     auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"))
    ids, labels = fp8_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(input_ids=ids[:2], labels=labels[:2]).loss
        loss.backward()
    if rank == 0:
        out["warnings"] = [str(w.message) for w in caught if "coda" in str(w.message)]
        out["loss"] = loss.item()


def test_fsdp1_units_per_decoder_layer_run_hf_forward_with_a_warning():
    """A patched HF model whose decoder layers are FSDP1 units (the usual accelerate / Trainer
    FSDP1 setup): the fused path cannot read their flat parameters, so the step runs HF's own
    forward, with the warning naming the unit (it used to fail inside the fused ops)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("transformers")
    got = run_gloo(hf_fsdp1_worker, 2)
    assert any("model.layers.0" in w and "FSDP1" in w for w in got["warnings"]), got["warnings"]
    assert got["loss"] == got["loss"] and got["loss"] > 0
