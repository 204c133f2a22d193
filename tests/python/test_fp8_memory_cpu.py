"""The FP8 model's weight cache and what the FP8 path keeps for its backward, on the CPU (fp64):
the weights quantized once per optimizer step (fused optimizers included), refreshed in place,
or not kept at all (fp8_weight_cache=False: recast_w_t); wᵀ's codes made by each backward; the
variants that keep less (copies=False without a backward, recompute_a, recompute_y), each
training exactly as the kept operands do and saving exactly the bytes it should."""

from __future__ import annotations

import pytest
import torch

import coda  # noqa: F401  (loads the extension: torch.ops.coda)
import coda.nn
from helpers import CountOps
from test_fp8_block_cpu import (e4m3_as_bytes, mlp_args, out_proj_args, small_case, tiny_batch,
                                tiny_models, weight_cache)
from test_fp8_cpu import E4M3, same_codes

CODA = torch.ops.coda


# The optimizers a step must be seen from: a per-parameter loop (moves the version counters) and
# the fused kernels (TorchTitan's default AdamW), which leave the version counters alone.
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5, foreach=False),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.5, fused=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fp8_weight_cache_quantizes_once_per_step(optimizer):
    """The projection weights are quantized on the first forward, reused (the same cache entry)
    by later forwards and backwards, and requantized after an optimizer step's in-place update,
    to the codes of the updated weights, whether or not the step moved the version counters.
    The cache keeps no transposed codes (None): each backward transposes a weight's codes, once
    per weight."""
    _, model, _ = tiny_models()
    ids, labels = tiny_batch()
    opt = OPTIMIZERS[optimizer](model.parameters())
    layer = model.layers[0]
    n_weights = 4 * len(model.layers)

    def step_calls():
        count = CountOps()
        with count:
            model(ids, labels).backward()
        assert count["coda::fp8_transpose_blocks"] == n_weights
        return count["coda::fp8_quantize_blocks"]

    assert step_calls() == n_weights
    first = layer.fp8_weights()
    assert step_calls() == 0  # a second micro-batch: nothing requantized
    assert all(a is b for a, b in zip(first.values(), layer.fp8_weights().values()))
    opt.step()
    assert step_calls() == n_weights
    after = layer.fp8_weights()
    for name in after:
        assert after[name] is not first[name], name
        codes, scales, codes_t, scales_t = after[name]
        want = weight_cache(getattr(layer, name).detach())
        same_codes(codes, want[0], f"{name} codes after the step")
        assert torch.equal(scales, want[1]), name
        assert codes_t is None and scales_t is None, f"{name}: the cache keeps wᵀ's codes"


def test_fp8_weight_cache_misses_data_writes_until_refreshed():
    """A write through .data leaves the version counter alone, so the cache keeps the old codes
    (documented); refresh_fp8_weights() quantizes the written weights into the cache's own
    tensors (in place: what a captured CUDA graph reads), and later forwards use them."""
    _, model, _ = tiny_models()
    ids, labels = tiny_batch()
    layer = model.layers[0]
    with torch.no_grad():
        model(ids, labels)
    stale = layer.fp8_weights()["w_gu"]
    old_scales = stale[1].clone()
    layer.w_gu.data.mul_(3.0)
    assert layer.fp8_weights()["w_gu"] is stale
    model.refresh_fp8_weights()
    refreshed = layer.fp8_weights()["w_gu"]
    assert all(a is b for a, b in zip(refreshed, stale)), "refresh must write in place"
    with torch.no_grad():
        model(ids, labels)
    assert layer.fp8_weights()["w_gu"] is refreshed  # the refresh's key: no requantization
    codes, scales, _, _ = refreshed
    want = weight_cache(layer.w_gu.detach())
    same_codes(codes, want[0], "w_gu codes after the refresh")
    assert torch.equal(scales, want[1])
    assert not torch.equal(scales, old_scales)  # x3 moves every power-of-two scale


def test_fp8_weight_cache_tells_two_storages_at_one_address_apart():
    """A weight's address can come back in a new storage (its .data replaced and the old storage
    freed, a .to() round trip, a tensor made anew each forward) with the same version: the entry
    holds a weak reference to the storage it was made from and is remade for another one. Here
    two tensors over one buffer (torch.frombuffer twice): same address, version, dtype; the
    second sees the buffer's new values."""
    vals = torch.randn(128, 128, dtype=torch.float64)
    buf = bytearray(vals.numpy().tobytes())
    first = torch.frombuffer(buf, dtype=torch.float64).view(128, 128)
    cache = coda.nn.Fp8WeightCache()
    old = cache.get("w", first)
    second = torch.frombuffer(buf, dtype=torch.float64).view(128, 128)
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    buf[:] = (vals * 3.0).numpy().tobytes()  # (an in-place op would move the version)
    new = cache.get("w", second)
    assert new is not old
    want = weight_cache(second)
    same_codes(new[0], want[0], "codes of the second tensor")
    assert torch.equal(new[1], want[1])
    assert cache.get("w", second) is new  # the same storage again: kept


def test_refresh_fp8_weights_is_a_no_op_in_bf16_and_fills_an_empty_cache():
    """On the bf16 path nothing is quantized; on the FP8 path before any forward the refresh makes
    every projection's entry, which the first forward then uses as is."""
    ref, model, _ = tiny_models()
    ref.refresh_fp8_weights()
    assert all(not layer._fp8_cache._entries for layer in ref.layers)
    model.refresh_fp8_weights()
    made = [layer.fp8_weights() for layer in model.layers]
    ids, labels = tiny_batch()
    count = CountOps()
    with count:
        model(ids, labels).backward()
    assert count["coda::fp8_quantize_blocks"] == 0
    for layer, entries in zip(model.layers, made):
        assert all(entries[n] is layer.fp8_weights()[n] for n in entries)


# ---- argument checks and registration ---------------------------------------------------------
def test_fp8_weight_cache_off_keeps_nothing_and_requantizes_every_forward():
    """fp8_weight_cache=False (sharding that gathers the weights per forward, other than
    fully_shard on the model): no operands are kept, each forward quantizes the weights and
    each backward casts their transposes (recast_w_t)."""
    _, model, _ = tiny_models()
    model.fp8_weight_cache = False
    ids, labels = tiny_batch()
    for _ in range(2):
        count = CountOps()
        with count:
            model(ids, labels).backward()
        assert count["coda::fp8_quantize_blocks"] == 2 * 4 * len(model.layers)
        assert all(not layer._fp8_cache._entries for layer in model.layers)


def train_steps(model, ids, labels, steps, refresh=False):
    """The losses of ``steps`` SGD steps (``refresh``: the FP8 weights dropped before each)."""
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    losses = []
    for _ in range(steps):
        if refresh:
            for layer in model.layers:
                layer._fp8_cache.clear()
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_weights_no_optimizer_holds_are_requantized_after_every_step():
    """A projection weight that trains but that no optimizer holds is a function of parameters
    that one updates (here a parametrization's output, made anew every forward, often at the
    previous one's address with version 0; FSDP's gathered copies and ZeRO's 16-bit ones are the
    same case): it is quantized again after every optimizer step, so training matches a model
    whose FP8 weights are dropped before every step (a second forward before the next step
    reuses them only where the parametrization's new output lands at the old address)."""
    from torch.nn.utils import parametrize

    class Identity(torch.nn.Module):
        def forward(self, w):
            return w * 1.0

    ids, labels = tiny_batch()
    runs = []
    for refresh in (False, True):
        _, model, _ = tiny_models()
        for layer in model.layers:
            for name in ("w_qkv", "w_o", "w_gu", "w_down"):
                parametrize.register_parametrization(layer, name, Identity())
        runs.append(train_steps(model, ids, labels, 5, refresh))
    assert len(set(runs[1])) == 5, runs[1]  # the steps moved the weights
    assert runs[0] == runs[1], runs
    count = CountOps()
    with count:
        model(ids, labels).backward()  # after the last step: every weight, once
    assert count["coda::fp8_quantize_blocks"] == 4 * len(model.layers)
    # The key itself (whether the address comes back is up to the allocator): a step of any
    # optimizer changes a training weight's that no optimizer holds, not a frozen one's nor that
    # of a parameter another optimizer holds.
    key = coda.nn.Fp8WeightCache._key
    trains = torch.ones(8, dtype=torch.float64, requires_grad=True) * 1.0
    frozen = torch.ones(8, dtype=torch.float64)
    held = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))
    held.grad = torch.zeros(8, dtype=torch.float64)
    torch.optim.SGD([held], lr=0.1).step()  # held: counted by its own optimizer's steps
    before = [key(t) for t in (trains, frozen, held)]
    other = torch.nn.Parameter(torch.ones(1))
    other.grad = torch.ones(1)
    torch.optim.SGD([other], lr=0.1).step()
    assert [key(t) != k for t, k in zip((trains, frozen, held), before)] == [True, False, False]


def test_a_dtype_round_trip_remakes_the_fp8_weights():
    """.to() writes each parameter through .data (no version change) and a round trip can bring it
    back at the same address: the new storages are seen (the entries' storage references), so the
    FP8 weights are made anew and the next step is that of a fresh model holding the converted
    weights."""
    _, model, _ = tiny_models()
    ids, labels = tiny_batch()
    with torch.no_grad():
        model(ids, labels)
    before = [layer.fp8_weights() for layer in model.layers]
    model.to(torch.float32).to(torch.float64)  # rounds every weight to float32
    _, fresh, _ = tiny_models()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(ids, labels), fresh(ids, labels))
    for layer, old in zip(model.layers, before):
        assert all(layer.fp8_weights()[n] is not old[n] for n in old)


def test_refresh_after_a_device_move_makes_new_operands_there():
    """refresh() writes in place only into tensors on the weight's device: after model.to(...)
    (here the Meta device, which the casts' Meta kernels serve) the refreshed operands live there,
    not copied into the old device's tensors."""
    _, model, _ = tiny_models()
    ids, labels = tiny_batch()
    with torch.no_grad():
        model(ids, labels)
    old = model.layers[0].fp8_weights()["w_qkv"]
    model.to("meta")
    model.refresh_fp8_weights()
    new = model.layers[0]._fp8_cache._entries["w_qkv"][1][:2]  # codes, scales (wᵀ's: None)
    assert all(t.device.type == "meta" for t in new)
    assert all(t.device.type == "cpu" for t in old[:2])
    assert all(a is not b for a, b in zip(new, old[:2]))


def test_copies_false_leaves_out_the_weight_gradients_copies():
    """copies=False (what coda.nn and TensorParallelLlama pass without grad mode) leaves out y's
    transposed copy in out-proj and fp8_linear and a's in the MLP and fp8_mlp_partial (the weight
    gradients' operands only); every other output is the same, byte for byte; the Meta kernels
    give the same shapes. Where a gradient would be recorded it is refused, naming the way out;
    under no_grad it runs. The FP8 model's loss under no_grad equals its loss with grad."""
    case = small_case()
    for op, args_of, copy, flags in (
            (CODA.fp8_out_proj_residual_norm, out_proj_args, (4, 5), ()),
            (CODA.fp8_mlp, mlp_args, (5, 6), (False,)),  # the MLP's act_h_out comes first
            (CODA.fp8_linear, lambda c: out_proj_args(c)[:6], (1, 2), ()),
            (CODA.fp8_mlp_partial, lambda c: mlp_args(c)[:15], (2, 3), ())):
        full = op(*args_of(case))
        lean = op(*args_of(case), *flags, False)
        for i, (a, b) in enumerate(zip(full, lean)):
            if i in copy:
                assert a.numel() > 0 and b.numel() == 0, (op, i)
            else:
                assert torch.equal(e4m3_as_bytes(a)[0], e4m3_as_bytes(b)[0]), (op, i)
        meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args_of(case)],
                  *flags, False)
        for a, b in zip(meta, lean):
            assert (a.device.type, a.shape, a.dtype) == ("meta", b.shape, b.dtype), (op, a, b)
        args = args_of(case)
        args[0] = args[0].detach().clone().requires_grad_()
        with pytest.raises(RuntimeError, match="copies=False leaves out the weight gradients"):
            op(*args, *flags, False)
        with torch.no_grad():
            op(*args, *flags, False)
    _, model, _ = tiny_models()
    ids, labels = tiny_batch()
    with_grad = model(ids, labels)
    with torch.no_grad():
        assert torch.equal(model(ids, labels), with_grad.detach())


def saved_bytes(fn):
    """(fn's result, bytes of every tensor autograd saved while it ran)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(total)


def train_step(model, ids, labels):
    """One forward + backward of `model`: (loss, {name: gradient}, bytes autograd saved)."""
    model.zero_grad(set_to_none=True)
    loss, saved = saved_bytes(lambda: model(ids, labels))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved


def same_step(got, want):
    """The loss and every gradient of two train_step results equal, bit for bit."""
    assert torch.equal(got[0], want[0])
    for n, g in want[1].items():
        assert torch.equal(got[1][n], g), n


def block_bytes(weights):
    """Codes and fp32 scales of the 128x128-blocked FP8 operands of `weights`."""
    return sum(w.numel() + 4 * (-(-w.shape[0] // 128)) * (-(-w.shape[1] // 128)) for w in weights)


def projection_weights(model):
    return [w for layer in model.layers
            for w in (layer.w_qkv, layer.w_o, layer.w_gu, layer.w_down)]


def test_recompute_a_trains_as_the_kept_copy_and_keeps_less():
    """fp8_recompute_a: the backward makes a's copy from z. In fp64 z is F2's g, u unrounded, so
    a and its copy are F2's bit for bit: loss and every gradient equal the kept copy's. Saved for
    the backward: exactly a's copy less (I codes per token, padded to 16 tokens, and the
    ceil(M/128) x I scales) per layer."""
    _, fp8, _ = tiny_models()
    ids, labels = tiny_batch()
    kept = train_step(fp8, ids, labels)
    fp8.fp8_recompute_a = True
    assert all(layer.fp8_recompute_a for layer in fp8.layers)
    recomputed = train_step(fp8, ids, labels)
    same_step(recomputed, kept)
    m, inter = ids.numel(), fp8.config.intermediate_size
    a_copy = inter * ((m + 15) // 16 * 16) + 4 * inter * ((m + 127) // 128)
    assert kept[2] - recomputed[2] == len(fp8.layers) * a_copy, (kept[2], recomputed[2])


def test_weights_transposed_in_the_backward_train_as_the_kept_transpose(monkeypatch):
    """The model's weight cache passes None for wᵀ's operand: each backward transposes the
    weight's codes (fp8_transpose_blocks), bit for bit the cast of wᵀ, so the loss and every
    gradient equal a model's that keeps the cast's transposed codes, and the cache holds exactly
    those codes and scales less (N·K codes and ceil(K/128)·ceil(N/128) scales a weight)."""
    _, fp8, _ = tiny_models()
    ids, labels = tiny_batch()

    def cached_bytes():
        return sum(t.numel() * t.element_size() for layer in fp8.layers
                   for q in layer.fp8_weights().values() for t in q if t is not None)

    transposed = train_step(fp8, ids, labels)
    lean = cached_bytes()
    monkeypatch.setattr(coda.nn, "_quantize_weight",
                        lambda w: tuple(CODA.fp8_quantize_blocks(w.detach(), True, True)))
    for layer in fp8.layers:
        layer._fp8_cache.clear()
    same_step(train_step(fp8, ids, labels), transposed)
    assert cached_bytes() - lean == block_bytes(projection_weights(fp8)), (cached_bytes(), lean)


def test_uncached_weights_keep_nothing_fp8_of_a_weight_for_the_backward():
    """Without a kept weight cache (fp8_weight_cache=False; FSDP2) every forward casts the
    weights, and the ops run with recast_w_t: the backward casts wᵀ from the weight, so the
    forward saves neither w's nor wᵀ's codes. The loss and every gradient equal the cached
    model's (the cast of wᵀ is the transpose of w's codes), the weights are cast twice a step
    (once a forward, once a backward), and the tensors saved for the backward are smaller by
    exactly the codes and scales of every projection weight."""
    _, fp8, _ = tiny_models()
    ids, labels = tiny_batch()
    cached = train_step(fp8, ids, labels)
    fp8.fp8_weight_cache = False
    casts = CountOps()
    with casts:
        recast = train_step(fp8, ids, labels)
    assert all(not layer._fp8_cache._entries for layer in fp8.layers)
    weights = projection_weights(fp8)
    assert casts["coda::fp8_quantize_blocks"] == 2 * len(weights)
    same_step(recast, cached)
    assert cached[2] - recast[2] == block_bytes(weights), (cached[2], recast[2])


def test_recompute_y_keeps_y_itself_and_trains_as_the_kept_copy():
    """fp8_out_proj_residual_norm(recompute_y=True) returns no copy of y (every other output the
    same, byte for byte; the Meta kernel agrees); its backward keeps y itself, the tensor the
    caller passed (the attention output, which the attention's backward keeps: no bytes of its
    own), instead of the copy, and makes the copy from it: every gradient equals the kept
    copy's."""
    case = small_case()
    args = out_proj_args(case)
    kept = CODA.fp8_out_proj_residual_norm(*args)
    lean = CODA.fp8_out_proj_residual_norm(*args, True, True)
    assert lean[4].numel() == 0 and lean[5].numel() == 0, "y's copy was written"
    for a, b in zip(kept[:4], lean[:4]):
        assert torch.equal(e4m3_as_bytes(a)[0], e4m3_as_bytes(b)[0])
    meta = CODA.fp8_out_proj_residual_norm(
        *[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], True, True)
    for a, b in zip(meta, lean):
        assert (a.device.type, a.shape, a.dtype) == ("meta", b.shape, b.dtype)
    grads, saved = {}, {}
    for recompute in (False, True):
        leaves = [a.detach().clone().requires_grad_() if i in (0, 1, 6) else a
                  for i, a in enumerate(args)]  # x depends on y, w_o and the residual
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                      lambda t: t):
            x = CODA.fp8_out_proj_residual_norm(*leaves, True, recompute)[0]
        saved[recompute] = (packed, leaves[0])
        dx = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))
        grads[recompute] = torch.autograd.grad(x, [leaves[i] for i in (0, 1, 6)], dx)
    (lean_saved, y), (kept_saved, _) = saved[True], saved[False]
    assert any(t.data_ptr() == y.data_ptr() and t.shape == y.shape for t in lean_saved)
    copy = kept[4]
    assert not any(t.shape == copy.shape and t.dtype == copy.dtype for t in lean_saved)
    assert any(t.shape == copy.shape and t.dtype == copy.dtype for t in kept_saved)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    dx = torch.ones_like(kept[0])
    for inputs in ((kept[4], kept[5], args[0]), (None, None, None), (kept[4], None, None)):
        with pytest.raises(RuntimeError, match=r"pass input_t and input_t_scales \(the input's "
                                               r"transposed copy\), or input alone"):
            CODA.fp8_linear_backward(dx, inputs[0], inputs[1], args[1], args[4], args[5],
                                     inputs[2])


def test_fp8_mlp_backward_without_a_makes_its_copy_from_z():
    """fp8_mlp(recompute_a=True) returns no copy of a; fp8_mlp_backward without one makes it from
    z, which is fp8_swiglu_quantize_t(z): the same gradients as handing that copy in."""
    case = small_case()
    args = mlp_args(case)
    out = CODA.fp8_mlp(*args, False, True, True)
    assert out[5].numel() == 0 and out[6].numel() == 0, "a's copy was written"
    kept = CODA.fp8_mlp(*args, False, True, False)
    for a, b in zip(out[:5], kept[:5]):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b)
    p, _, _, cache, (x1, _, _, r1) = case
    z = out[4]
    dx_out = torch.randn_like(x1)
    common = (dx_out, x1, p["gamma_ffn"], p["w_gu"], *cache["w_gu"][2:], p["w_down"],
              *cache["w_down"][2:], r1, z)
    got = CODA.fp8_mlp_backward(*common, None, None)
    want = CODA.fp8_mlp_backward(*common, *CODA.fp8_swiglu_quantize_t(z))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="pass both a_t and a_t_scales"):
        CODA.fp8_mlp_backward(*common, kept[5], None)
