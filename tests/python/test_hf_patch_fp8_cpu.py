"""coda.integrations.patch_hf(model, precision="fp8") on the CPU in float64: a transformers model
patched in place trains exactly as the same weights converted to CodaLlamaForCausalLM(...,
precision="fp8") (loss and every gradient, through HF's parameter layouts), its FP8 weights are
quantized once per change of the parameters they come from, and configurations the FP8 path
cannot run are refused at patch time, naming the setting. Qwen3 (QK-norm) included."""

from __future__ import annotations

import copy

import pytest
import torch

import coda.nn
from coda import convert
from coda.integrations import hf as coda_hf
from coda.integrations import patch_hf, refresh_fp8_weights
from helpers import CountOps, assert_rel
from test_hf_cpu import batch, coda_grads_in_hf_layout, make_hf
from test_hf_patch_cpu import checkpointed

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def step(model, ids, labels):
    """(loss, gradients by HF parameter name) of one training step of a patched HF model."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None, "the fused path returns no logits"
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def converted_step(hf, ids, labels, precision, fp8_z=False):
    """The same step on the HF weights converted to coda's model: its gradients in HF's layout."""
    ref = convert.from_hf(hf, dtype=F64, precision=precision)
    ref.fp8_z = fp8_z
    loss = ref(ids, labels)
    loss.backward()
    return loss.detach(), coda_grads_in_hf_layout(ref)


def expect_step(got, want, rel, what):
    (loss, grads), (want_loss, want_grads) = got, want
    assert_rel(loss, want_loss, rel, f"{what}: loss")
    # (a tied model lists its one embedding / LM-head parameter once; the conversion names both)
    assert set(grads) <= set(want_grads) and len(grads) >= len(want_grads) - 1
    for n, g in grads.items():
        assert g is not None, f"{what}: {n} has no gradient"
        assert_rel(g, want_grads[n], rel, f"{what}: grad {n}")


@pytest.mark.parametrize("name", ["untied", "tied", "llama3", "qwen2", "qwen3"])
def test_fp8_patch_trains_as_the_converted_fp8_model(name):
    hf = make_hf(name, seed=2)
    ids, labels = batch(seed=3)
    want = converted_step(hf, ids, labels, "fp8")
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    expect_step(step(patched, ids, labels), want, 1e-12, name)
    # It runs FP8: the bf16 path's step differs by the recipe's rounding, and not by more.
    bf16_loss, _ = converted_step(hf, ids, labels, "bf16")
    rel = abs(float(want[0]) / float(bf16_loss) - 1)
    assert 1e-6 < rel < 0.05, f"FP8 loss {float(want[0])} vs bf16 {float(bf16_loss)}"


def test_patching_again_switches_the_precision():
    hf = make_hf("untied", seed=4)
    ids, labels = batch(seed=5)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    assert patch_hf(patched, precision="bf16") is patched
    expect_step(step(patched, ids, labels), converted_step(hf, ids, labels, "bf16"), 1e-12,
                "back to bf16")
    patch_hf(patched, precision="fp8")
    expect_step(step(patched, ids, labels), converted_step(hf, ids, labels, "fp8"), 1e-12,
                "fp8 again")
    with pytest.raises(ValueError, match="precision must be one of"):
        patch_hf(patched, precision="fp16")


def test_fp8_recompute_a_trains_as_the_kept_copy():
    """fp8_recompute_a: a's copy made from z in the backward; in float64 z holds F2's a exactly,
    so the step equals the converted FP8 model's (which keeps the copy)."""
    hf = make_hf("qwen2", seed=14)
    ids, labels = batch(seed=15)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8", fp8_recompute_a=True)
    expect_step(step(patched, ids, labels), converted_step(hf, ids, labels, "fp8"), 0, "recompute")
    # ... and keeps less for the backward than with the copy kept.
    kept = patch_hf(copy.deepcopy(hf), precision="fp8")
    saved = []
    for model in (kept, patched):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t):
            model(input_ids=ids, labels=labels)
        saved.append(sum(sizes))
    assert saved[1] < saved[0], saved


def test_fp8_z_trains_as_the_converted_model_with_it():
    """fp8_z: z saved in FP8; the step equals the converted FP8 model's with fp8_z, whose own
    tests (test_fp8_z_cpu.py) check it against the decoded z, and differs from the step without
    it (the backward reads the decoded z)."""
    hf = make_hf("qwen2", seed=16)
    ids, labels = batch(seed=17)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8", fp8_z=True)
    got = step(patched, ids, labels)
    expect_step(got, converted_step(hf, ids, labels, "fp8", fp8_z=True), 0, "fp8_z")
    plain = converted_step(hf, ids, labels, "fp8")
    assert torch.equal(got[0], plain[0]), "the forward changed"
    assert any(not torch.equal(g, plain[1][n]) for n, g in got[1].items()), "z not read in FP8"


def test_fp8_gradient_checkpointing():
    hf = make_hf("llama3", seed=6)
    ids, labels = batch(seed=7)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    calls = checkpointed(patched)
    expect_step(step(patched, ids, labels), converted_step(hf, ids, labels, "fp8"), 1e-12,
                "checkpointed")
    assert len(calls) == len(patched.model.layers), "each layer runs checkpointed"


def test_fp8_weights_are_quantized_once_per_change_of_their_parameters(monkeypatch):
    hf = make_hf("qwen2", seed=8)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    quantized = []
    real = coda.nn._quantize_weight
    monkeypatch.setattr(coda.nn, "_quantize_weight",
                        lambda w: quantized.append(tuple(w.shape)) or real(w))
    ids, labels = batch(seed=9)
    layers = len(patched.model.layers)
    step(patched, ids, labels)
    assert len(quantized) == 4 * layers, quantized
    step(patched, ids, labels)  # a second micro-batch, no update: nothing quantized again
    assert len(quantized) == 4 * layers, quantized
    with torch.no_grad():  # one of the three parameters behind layer 1's packed QKV weight
        patched.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    quantized.clear()
    step(patched, ids, labels)
    c = coda_hf.config_from_hf(hf.config)
    assert quantized == [(c.qkv_width, c.hidden_size)], quantized
    # ... and the step is the converted model's with that weight.
    edited = copy.deepcopy(hf)
    with torch.no_grad():
        edited.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    expect_step(step(patched, ids, labels), converted_step(edited, ids, labels, "fp8"), 1e-12,
                "after the edit")
    torch.optim.SGD(patched.parameters(), lr=0.1).step()  # every parameter moves
    quantized.clear()
    step(patched, ids, labels)
    assert len(quantized) == 4 * layers, quantized
    # a fused optimizer's step leaves the version counters alone: seen all the same
    torch.optim.AdamW(patched.parameters(), lr=0.01, fused=True).step()
    quantized.clear()
    step(patched, ids, labels)
    assert len(quantized) == 4 * layers, quantized


def test_fp8_weight_cache_off_keeps_nothing_and_trains_as_the_kept_cache():
    """patch_hf(..., fp8_weight_cache=False): every forward quantizes the weights and every
    backward casts their transposes from them (the layers' recast_w_t) instead of transposing
    kept codes, nothing is kept between forwards, and the step equals the kept cache's bit for
    bit (wᵀ's cast and the transpose of w's codes are the same codes). Patching again without
    the argument keeps them again."""
    hf = make_hf("llama3", seed=14)
    ids, labels = batch(seed=15)
    kept_model = patch_hf(copy.deepcopy(hf), precision="fp8")
    layers = len(kept_model.model.layers)
    count = CountOps()
    with count:
        kept = step(kept_model, ids, labels)
    assert count["coda::fp8_quantize_blocks"] == 4 * layers
    assert count["coda::fp8_transpose_blocks"] == 4 * layers
    patched = patch_hf(copy.deepcopy(hf), precision="fp8", fp8_weight_cache=False)
    for _ in range(2):
        count = CountOps()
        with count:
            expect_step(step(patched, ids, labels), kept, 0, "without the cache")
        assert count["coda::fp8_quantize_blocks"] == 2 * 4 * layers  # w forward, wᵀ backward
        assert count["coda::fp8_transpose_blocks"] == 0
        patch = getattr(patched, coda_hf._ATTR)
        assert all(not c._entries for c in patch.fp8_caches.values()), "an FP8 weight was kept"
    patch_hf(patched, precision="fp8")
    step(patched, ids, labels)
    assert patch.fp8_weight_cache is None
    assert sum(len(c._entries) for c in patch.fp8_caches.values()) == 4 * layers


def test_data_writes_are_seen_after_refresh_fp8_weights():
    hf = make_hf("untied", seed=10)
    ids, labels = batch(seed=11)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    before = step(patched, ids, labels)
    patched.model.layers[0].mlp.down_proj.weight.data.mul_(2.0)  # no version change
    stale = step(patched, ids, labels)
    # the forward reads the weight through its FP8 operands only: the old ones still run
    assert torch.equal(stale[0], before[0])
    refresh_fp8_weights(patched)
    edited = copy.deepcopy(hf)
    edited.model.layers[0].mlp.down_proj.weight.data.mul_(2.0)
    want = converted_step(edited, ids, labels, "fp8")
    assert not torch.equal(stale[0], want[0]), "the stale step already matched: no check"
    expect_step(step(patched, ids, labels), want, 1e-12, "refreshed")


def test_a_dtype_round_trip_of_a_patched_model_requantizes_its_weights():
    """.to() replaces each parameter's storage through .data (no version change, and the round
    trip may land at the old address): the kept FP8 weights hold references to the storages they
    came from and are remade, so the next step is that of the converted weights."""
    hf = make_hf("untied", seed=16)
    ids, labels = batch(seed=17)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    step(patched, ids, labels)
    patched.to(torch.float32).to(F64)  # rounds every weight to float32
    rounded = copy.deepcopy(hf).to(torch.float32).to(F64)
    want = converted_step(rounded, ids, labels, "fp8")
    assert not torch.equal(want[0], converted_step(hf, ids, labels, "fp8")[0]), "no rounding"
    expect_step(step(patched, ids, labels), want, 1e-12, "after the round trip")


def test_copies_of_an_fp8_patched_model_quantize_their_own_weights(tmp_path):
    hf = make_hf("tied", seed=12)
    ids, labels = batch(seed=13)
    patched = patch_hf(copy.deepcopy(hf), precision="fp8")
    want = step(patched, ids, labels)
    torch.save(patched, tmp_path / "model.pt")
    for other in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(patched)):
        assert not getattr(other, coda_hf._ATTR).fp8_caches, "a copy carried the FP8 weights"
        expect_step(step(other, ids, labels), want, 0, "copy")


def test_fp8_patch_refuses_what_it_cannot_run():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=72,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).to(F64)
    with pytest.raises(ValueError, match="needs intermediate_size a multiple of 16.*got 72"):
        patch_hf(model, precision="fp8")
    assert not coda_hf.is_patched(model), "a refused patch left the model patched"
    with pytest.raises(ValueError, match="precision must be one of"):
        patch_hf(make_hf("untied"), precision="e5m2")
