"""coda.integrations.patch_hf on the CPU in float64: a transformers LlamaForCausalLM (and
Qwen2ForCausalLM, CONFIGS["qwen2"], and Qwen3ForCausalLM, CONFIGS["qwen3"]) patched in place
trains through coda's ops with HF's loss and every gradient, stays a PreTrainedModel (Trainer,
save_pretrained / from_pretrained, generate, gradient checkpointing), and hands every call it
cannot run to the model's own forward."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coda.integrations import hf as coda_hf
from coda.integrations import is_patched, patch_hf, unpatch_hf
from helpers import assert_rel
from test_hf_cpu import CONFIGS, batch, make_hf, make_hf_exact_fp64

transformers = pytest.importorskip("transformers")


def pair(name="untied", seed=0):
    """(fp64-exact HF reference, a patched copy of the same weights)."""
    hf = make_hf(name, seed)
    patched = patch_hf(copy.deepcopy(hf))
    return make_hf_exact_fp64(hf, name), patched


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def fp64_loss(ref, input_ids, labels, attention_mask=None, shift_labels=None,
              num_items_in_batch=None, **model_kwargs):
    """HF's causal-LM loss, kept in float64 (HF's own loss function computes in float32)."""
    logits = ref(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).logits
    targets = F.pad(labels[:, 1:], (0, 1), value=-100) if shift_labels is None else shift_labels
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         ignore_index=-100, reduction="sum")
    n = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return ce / n


def expect_same_training_step(ref, patched, rel=1e-9, **inputs):
    assert patched.training, "the fused path trains"
    loss_ref = fp64_loss(ref, **inputs)
    out = patched(**inputs)
    assert out.logits is None, "the fused path returns no logits"
    loss_ref.backward()
    out.loss.backward()
    assert_rel(out.loss.detach(), loss_ref.detach(), rel, "loss")
    want, got = grads(ref), grads(patched)
    assert set(want) == set(got)
    for n, g in want.items():
        assert g is not None and got[n] is not None, f"{n} has no gradient"
        assert_rel(got[n], g, rel, f"grad {n}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_every_gradient_match_hf(name):
    ref, patched = pair(name)
    assert is_patched(patched) and not is_patched(ref)
    assert isinstance(patched, transformers.PreTrainedModel)
    ids, labels = batch()
    expect_same_training_step(ref, patched, input_ids=ids, labels=labels)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_as_hf(side):
    # labels = input_ids, as collators often leave them: padded positions' targets count too, so
    # their outputs must be HF's (a row whose keys are all padding gives 0).
    ref, patched = pair("untied", seed=1)
    ids, _ = batch(seed=6, B=3, S=10)
    mask = torch.ones_like(ids)
    if side == "right":
        mask[0, -3:] = 0
        mask[2, -1:] = 0
    else:
        mask[1, :4] = 0
        mask[2, :1] = 0
    expect_same_training_step(ref, patched, input_ids=ids, attention_mask=mask, labels=ids)


def test_all_ones_mask_num_items_and_shift_labels():
    # Trainer's gradient accumulation: a sum over the batch divided by the items of all
    # micro-batches; and labels already shifted by the caller.
    ref, patched = pair("untied", seed=1)
    ids, labels = batch(seed=6, B=3, S=10)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    shifted[1, 2] = -100
    expect_same_training_step(ref, patched, input_ids=ids, attention_mask=torch.ones_like(ids),
                              shift_labels=shifted, labels=labels,
                              num_items_in_batch=torch.tensor(40))


def test_packed_sequences_attend_within_themselves():
    # Positions that restart without a mask mark packed sequences (transformers'
    # DataCollatorWithFlattening), when no KV cache is asked for.
    ref, patched = pair("llama3", seed=2)
    ids, labels = batch(seed=13, B=3, S=12)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], list(range(12)),
                        [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    expect_same_training_step(ref, patched, input_ids=ids, labels=labels, position_ids=pos,
                              use_cache=False)


@pytest.mark.parametrize("name", ["tied", "qwen2"])
def test_calls_other_than_training_run_the_hf_forward(name):
    hf = make_hf(name, seed=2)
    patched = patch_hf(copy.deepcopy(hf))
    ids, labels = batch(seed=7, B=3, S=6)
    out = patched(input_ids=ids, labels=labels, output_hidden_states=True)
    assert out.logits is not None and out.hidden_states is not None
    patched.eval()  # evaluation gets its logits (Trainer's compute_metrics needs them)
    assert torch.equal(patched(input_ids=ids, labels=labels).logits,
                       hf.eval()(input_ids=ids, labels=labels).logits)
    with torch.no_grad():
        assert torch.equal(patched(input_ids=ids).logits, hf(input_ids=ids).logits)
        want = hf.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(patched.generate(ids, max_new_tokens=5, do_sample=False), want)
    assert unpatch_hf(patched) is patched and not is_patched(patched)
    assert "forward" not in vars(patched)


@pytest.mark.parametrize("name", ["untied", "qwen2", "qwen3"])
def test_save_pretrained_writes_the_stock_checkpoint(tmp_path, name):
    hf = make_hf(name, seed=3)
    patched = patch_hf(hf)
    ids, labels = batch(seed=8)
    opt = torch.optim.SGD(patched.parameters(), lr=0.1)
    patched(input_ids=ids, labels=labels).loss.backward()
    opt.step()  # weights the patched model trained
    patched.save_pretrained(tmp_path)
    stock = type(hf).from_pretrained(tmp_path, dtype=torch.float64)
    assert type(stock) is type(hf)
    assert not is_patched(stock)
    saved, trained = stock.state_dict(), patched.state_dict()
    assert set(saved) == set(trained)
    for k in trained:
        assert torch.equal(saved[k], trained[k]), k
    fused = patched(input_ids=ids, labels=labels)
    assert fused.logits is None
    with torch.no_grad():
        # the same weights; PyTorch's CPU kernels may pick another code path for another
        # allocation (1e-15 apart seen), so not bit for bit
        assert_rel(stock(input_ids=ids).logits, patched(input_ids=ids).logits, 1e-12, "logits")
        assert_rel(fused.loss.detach(), stock(input_ids=ids, labels=labels).loss, 1e-5,
                   "loss after reload")


def test_the_patched_model_pickles_and_deep_copies(tmp_path):
    hf = make_hf("untied", seed=3)
    patched = patch_hf(copy.deepcopy(hf))
    ids, labels = batch(seed=8)
    want = patched(input_ids=ids, labels=labels).loss.detach()
    torch.save(patched, tmp_path / "model.pt")
    for other in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(patched)):
        assert is_patched(other) and other.forward.__self__ is other
        out = other(input_ids=ids, labels=labels)
        assert out.logits is None
        assert torch.equal(out.loss.detach(), want)


def checkpointed(model):
    """Turns on HF's gradient checkpointing; returns the list each layer's checkpointed call
    appends to."""
    model.gradient_checkpointing_enable()
    model.train()
    calls = []
    for layer in model.model.layers:
        def counted(*args, checkpoint=layer._gradient_checkpointing_func, **kw):
            calls.append(1)
            return checkpoint(*args, **kw)
        layer._gradient_checkpointing_func = counted
    return calls


def test_gradient_checkpointing():
    ref, patched = pair("llama3", seed=4)
    calls = checkpointed(patched)
    ref.train()
    ids, labels = batch(seed=9)
    expect_same_training_step(ref, patched, input_ids=ids, labels=labels)
    assert len(calls) == len(patched.model.layers), "each layer runs checkpointed"


@pytest.mark.parametrize("name", ["untied", "qwen2"])
def test_trainer_trains_the_patched_model_as_it_trains_hf(tmp_path, monkeypatch, name):
    pytest.importorskip("accelerate")
    ref, patched = pair(name, seed=5)
    ids, labels = batch(seed=10, B=8, S=9)
    data = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    fused = []
    real = coda_hf._fused_forward
    monkeypatch.setattr(coda_hf, "_fused_forward", lambda *a: fused.append(1) or real(*a))
    for model in (ref, patched):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / type(model).__name__), max_steps=3,
            per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=0.1,
            optim="sgd", use_cpu=True, report_to="none", save_strategy="no",
            logging_strategy="no", seed=0,
            dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    trained = dict(patched.named_parameters())
    assert set(trained) == {n for n, _ in ref.named_parameters()}
    for n, p in ref.named_parameters():
        # HF's loss runs in float32 (so do the reference model's gradients)
        assert_rel(trained[n].detach(), p.detach(), 1e-6, f"{n} after 3 Trainer steps")
    assert len(fused) == 3 * 2, "every micro-batch took the fused path"
    fresh = make_hf(name, seed=5)
    assert not torch.equal(fresh.lm_head.weight, patched.lm_head.weight), "training moved nothing"


def test_saved_tensor_hooks_installed_outside_still_see_the_activations():
    # e.g. activation offloading: every saved tensor but the rebuilt weights goes through them.
    ref, patched = pair("untied", seed=8)
    ids, labels = batch(seed=14)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return ("outside", t.clone())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved[1]):
        out = patched(input_ids=ids, labels=labels)
    assert out.logits is None
    assert len(packed) >= 10 * len(patched.model.layers), len(packed)
    out.loss.backward()
    fp64_loss(ref, input_ids=ids, labels=labels).backward()
    for n, p in ref.named_parameters():
        assert_rel(dict(patched.named_parameters())[n].grad, p.grad, 1e-9, f"grad {n}")


def test_rebuilt_weights_are_not_held_between_forward_and_backward(monkeypatch):
    _, patched = pair("untied", seed=6)
    derived = []
    original = coda_hf._RebuiltOnBackward.derive

    def spy(self, build, *params):
        t = original(self, build, *params)
        if all(t is not p for p in params):
            derived.append(weakref.ref(t))
        return t

    monkeypatch.setattr(coda_hf._RebuiltOnBackward, "derive", spy)
    ids, labels = batch(seed=11)
    loss = patched(input_ids=ids, labels=labels).loss
    gc.collect()
    # fp64 parameters need no cast: the packed QKV and the interleaved gate/up of each layer
    assert len(derived) == 2 * len(patched.model.layers)
    assert all(r() is None for r in derived), "a rebuilt weight outlived the forward"
    loss.backward()  # rebuilt from the parameters
    loss2 = patched(input_ids=ids, labels=labels).loss
    with torch.no_grad():
        patched.model.layers[0].mlp.up_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between the forward and"):
        loss2.backward()


class WrappedLinear(nn.Linear):
    """Stands for an adapter: a Linear subclass whose forward is not x @ W.T."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_models_coda_cannot_run():
    hf = make_hf("untied", seed=7)
    bad = copy.deepcopy(hf)
    q = bad.model.layers[1].self_attn.q_proj
    bad.model.layers[1].self_attn.q_proj = WrappedLinear(q.in_features, q.out_features,
                                                         bias=False, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"model.layers.1.self_attn.q_proj is a WrappedLinear"):
        patch_hf(bad)
    with pytest.raises(TypeError, match="expected a transformers LlamaForCausalLM, "
                                        "Qwen2ForCausalLM or Qwen3ForCausalLM"):
        patch_hf(hf.model)
    # A Qwen3 whose head norm was replaced: the fused path reads Qwen3's RMSNorm weight.
    qwen3 = make_hf("qwen3", seed=7)
    qwen3.model.layers[1].self_attn.k_norm = nn.LayerNorm(32, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"model.layers.1.self_attn.k_norm is a LayerNorm; the "
                                        r"fused path needs Qwen3's RMSNorm with a \(32,\) weight"):
        patch_hf(qwen3)
    # A Qwen2 whose q_proj lost its bias: the fused path would add none.
    qwen = make_hf("qwen2", seed=7)
    q = qwen.model.layers[0].self_attn.q_proj
    qwen.model.layers[0].self_attn.q_proj = nn.Linear(q.in_features, q.out_features, bias=False,
                                                      dtype=torch.float64)
    with pytest.raises(TypeError, match="q_proj is a Linear without a bias; the fused path needs "
                                        "a plain nn.Linear with bias"):
        patch_hf(qwen)
    cfg = copy.deepcopy(hf.config)
    cfg.attention_bias = True
    with pytest.raises(NotImplementedError, match="attention_bias"):
        patch_hf(transformers.LlamaForCausalLM(cfg))
    # An adapter added after patching: the model's own forward runs, with one warning.
    patched = patch_hf(copy.deepcopy(hf))
    patched.model.layers[1].self_attn.q_proj = bad.model.layers[1].self_attn.q_proj
    bad_ref = copy.deepcopy(bad)
    ids, labels = batch(seed=12)
    with pytest.warns(UserWarning, match="running the model's own forward: model.layers.1"):
        out = patched(input_ids=ids, labels=labels)
    assert out.logits is not None
    with torch.no_grad():
        assert torch.equal(out.loss, bad_ref(input_ids=ids, labels=labels).loss)
    # A forward hook the fused path would skip (pruning, FSDP, offloading and user hooks).
    hooked = patch_hf(copy.deepcopy(hf))
    seen = []
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: seen.append(1))
    with pytest.warns(UserWarning, match="model.layers.0.mlp has forward hooks"):
        assert hooked(input_ids=ids, labels=labels).logits is not None
    assert seen == [1]
    with pytest.raises(TypeError, match="already replaced"):
        other = copy.deepcopy(hf)
        other.forward = lambda *a, **k: None
        patch_hf(other)
    # bfloat16 on the CPU: the reference executor runs float32 / float64 only.
    cpu_bf16 = patch_hf(copy.deepcopy(hf).to(torch.bfloat16))
    with pytest.warns(UserWarning, match="CPU reference runs in float32 or float64"):
        assert cpu_bf16(input_ids=ids, labels=labels).logits is not None
