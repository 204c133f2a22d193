"""coda.convert against TorchTitan 0.3's own llama3 model code (its pip package), in float64 on the
CPU: a TorchTitan model (fused QKV, GQA, LLaMA-3.1 RoPE scaling) converted to coda gives the same
logits, loss and every gradient, and coda's weights load back into a fresh TorchTitan model with
strict=True. TorchTitan 0.3 needs torch >= 2.12, so these run in scripts/test's newest-torch pass
and skip under the pinned torch.

The one substitution: TorchTitan's FlexAttention (no CPU backward, no float64) is swapped for the
same causal attention through SDPA in each layer's `inner_attention`; everything else (the fused
QKV split, its RoPE, the GQA head grouping, the FFN, the norms, the LM head) is TorchTitan's. Its
RoPE table is computed in float32 (coda's in float64), which bounds the agreement at ~1e-6
relative; a wrong layout (a permuted head, gate and up swapped) is off by O(1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

llama3 = pytest.importorskip("torchtitan.models.llama3",
                             reason="needs torchtitan 0.3 (torch >= 2.12)")

from coda import convert  # noqa: E402
from coda.nn import LlamaConfig  # noqa: E402

DIM, HEADS, KV_HEADS, LAYERS, FFN, VOCAB, THETA = 64, 4, 2, 2, 96, 256, 500000.0
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


class CausalSdpa(torch.nn.Module):
    """TorchTitan's inner-attention call, (B, L, N, H) in and out, as causal SDPA."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def llama3_config(tie=False, fuse_qkv=True):
    """A small llama3 config through TorchTitan's own builders: GQA, LLaMA-3.1 RoPE scaling."""
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tie,
        tok_embeddings=llama3.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                               param_init=llama3._EMBEDDING_INIT),
        norm=llama3.RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=llama3.Linear.Config(in_features=DIM, out_features=VOCAB,
                                     param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=fuse_qkv, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=FFN, attn_backend="flex",
            rope=llama3.ComplexRoPE.Config(
                dim=DIM // HEADS, max_seq_len=64, theta=THETA, scaling="llama",
                scaling_factor=SCALING["factor"], low_freq_factor=SCALING["low_freq_factor"],
                high_freq_factor=SCALING["high_freq_factor"],
                original_max_position_embeddings=SCALING["original_max_position_embeddings"])))


def torchtitan_model(seed, tie=False):
    torch.manual_seed(seed)
    model = llama3_config(tie).build()
    model.init_states()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSdpa()
    # Norm weights start at 1 and the LM head small: perturb them so every gradient is exercised.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.double()


def coda_config(tie=False):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                       num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                       rope_theta=THETA, rope_scaling=dict(SCALING), rms_norm_eps=1e-5,
                       tie_word_embeddings=tie)


def loss_of_logits(logits, labels):
    """coda's convention (as HF's): position s predicts labels[:, s + 1]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_converted_torchtitan_model_matches_it(tie):
    tt = torchtitan_model(3, tie)
    assert convert.torchtitan_release_of(tt.state_dict()) == "0.3"
    model = convert.from_torchtitan(tt.state_dict(), coda_config(tie))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), tt(ids, pos), rtol=1e-5, atol=1e-7)
    ours = model(ids, labels=ids)
    theirs = loss_of_logits(tt(ids, pos), ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    ours.backward()
    theirs.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    mapped = convert.coda_to_torchtitan_state_dict(grads, model.config)
    their_grads = {n: p.grad for n, p in tt.named_parameters()}
    # The fused wqkv's gradient in the stock wq / wk / wv layout, by TorchTitan's own save hook.
    for i, layer in tt.layers.items():
        qkv = layer.attention.qkv_linear
        type(qkv)._split_qkv_on_save(qkv, their_grads, f"layers.{i}.attention.qkv_linear.", None)
    if tie:  # one parameter under both names
        their_grads.setdefault("lm_head.weight", their_grads.get("tok_embeddings.weight"))
    assert set(mapped) == set(their_grads)
    for name, g in their_grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(mapped[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_coda_weights_load_into_torchtitan_strictly():
    tt = torchtitan_model(5)
    model = convert.from_torchtitan(tt.state_dict(), coda_config())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # trained, say
    fresh = torchtitan_model(6)
    fresh.load_state_dict(convert.to_torchtitan(model), strict=True)  # wq/wk/wv -> fused wqkv
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids, torch.arange(10)[None]), model(ids), rtol=1e-5,
                                   atol=1e-7)
