"""coda.convert against transformers' LlamaForCausalLM, Qwen2ForCausalLM (Q/K/V bias) and
Qwen3ForCausalLM (QK-norm) on the CPU in float64: loss and every parameter gradient, weight round
trips, and the TorchTitan mapping."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import convert
from helpers import CountOps, assert_rel

transformers = pytest.importorskip("transformers")

VOCAB = 50
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=32)
CONFIGS = {
    "untied": dict(tie_word_embeddings=False, rope=dict(rope_type="default", rope_theta=10000.0)),
    "tied": dict(tie_word_embeddings=True, rope=dict(rope_type="default", rope_theta=500000.0)),
    "llama3": dict(tie_word_embeddings=False, rope=LLAMA3),
    # Qwen2 / Qwen2.5: LLaMA with a bias on the Q, K and V projections (tied as the 0.5B-3B are).
    "qwen2": dict(tie_word_embeddings=True, rope=dict(rope_type="default", rope_theta=1e6),
                  family="qwen2"),
    # Qwen3: LLaMA with an RMSNorm over every Q and K head before RoPE; its head_dim is set on its
    # own (here 32 with 4 heads on H = 64, so the attention width is not H).
    "qwen3": dict(tie_word_embeddings=False, rope=dict(rope_type="default", rope_theta=1e6),
                  family="qwen3", head_dim=32),
}
FAMILIES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def make_hf(name, seed=0, vocab=VOCAB):
    spec = CONFIGS[name]
    config_name, model_name = FAMILIES.get(spec.get("family"),
                                           ("LlamaConfig", "LlamaForCausalLM"))
    extra = {"head_dim": spec["head_dim"]} if "head_dim" in spec else {}
    cfg = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=spec["tie_word_embeddings"],
        rope_parameters=dict(spec["rope"]), **extra,
    )
    # sdpa: the eager attention path runs its softmax in float32 even for a float64 model
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float64)
    # non-trivial norm weights, so a misplaced gamma shows; biases as large as the weights
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("norm.weight") or "layernorm" in name_:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def fp64_inv_freq(head_dim, rope):
    """HF's inverse-frequency formula (default / llama3) evaluated in float64."""
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope["rope_type"] != "llama3":
        return inv
    old, lo, hi, f = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                      rope["high_freq_factor"], rope["factor"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / f, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)


def make_hf_exact_fp64(model, name):
    """transformers' Llama casts to float32 in RMSNorm and in the rotary embedding (and builds
    inv_freq in float32) even for a float64 model. Replace those two modules' forwards with the same
    math in float64 so the model is a true fp64 reference."""

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                              self.variance_epsilon))

    cfg = model.config  # Qwen2's config has no head_dim
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = fp64_inv_freq(head_dim, CONFIGS[name]["rope"])

    def rope_forward(self, x, position_ids):
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for m in model.modules():
        if type(m).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"):
            m.forward = types.MethodType(rms_forward, m)
    model.model.rotary_emb.forward = types.MethodType(rope_forward, model.model.rotary_emb)
    return model


def causal_lm_loss(logits, labels):
    """HF's causal-LM loss (shift by one, mean over non-ignored), kept in float64."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def batch(seed=1, B=3, S=11, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[0, 3:6] = -100  # ignored labels inside a sequence
    labels[2, -1] = -100
    labels[1, 0] = -100  # position 0's label is never a target anyway
    return ids, labels


def coda_grads_in_hf_layout(model):
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"coda parameters without gradient: {missing}"
    return convert.coda_to_hf_state_dict(grads, model.config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_every_gradient_match_hf_fp64(name):
    hf = make_hf_exact_fp64(make_hf(name), name)
    model = convert.from_hf(hf)
    assert model.config.tie_word_embeddings == CONFIGS[name]["tie_word_embeddings"]
    assert (model.config.rope_scaling is not None) == (name == "llama3")
    ids, labels = batch()

    hf_loss = causal_lm_loss(hf(input_ids=ids).logits, labels)
    hf_loss.backward()
    loss = model(ids, labels=labels)
    loss.backward()

    assert loss.dtype == torch.float64
    assert_rel(loss.detach(), hf_loss.detach(), 1e-10, "loss")
    got = coda_grads_in_hf_layout(model)
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) <= set(got), f"not compared: {set(hf_params) - set(got)}"
    for n, p in hf_params.items():
        assert p.grad is not None and p.grad.abs().max() > 0, f"HF {n} has no gradient"
        assert_rel(got[n], p.grad, 1e-9, f"grad {n}")


# GPT-2's vocabulary and LLaMA / Mistral's 32000 with a pad token: odd sizes, the LM head's
# programs masking the last column pair.
@pytest.mark.parametrize("vocab,name", [(50257, "tied"), (32001, "llama3")])
def test_any_vocabulary_loss_and_every_gradient_match_hf_fp64(vocab, name):
    hf = make_hf_exact_fp64(make_hf(name, vocab=vocab), name)
    model = convert.from_hf(hf)
    ids, labels = batch(vocab=vocab)
    labels[1, -1] = vocab - 1  # the last column, alone in its pair, is a target
    hf_loss = causal_lm_loss(hf(input_ids=ids).logits, labels)
    hf_loss.backward()
    loss = model(ids, labels=labels)
    loss.backward()
    assert_rel(loss.detach(), hf_loss.detach(), 1e-10, "loss")
    got = coda_grads_in_hf_layout(model)
    for n, p in hf.named_parameters():
        assert_rel(got[n], p.grad, 1e-9, f"grad {n}")


def test_logits_match_hf_fp64():
    hf = make_hf_exact_fp64(make_hf("llama3"), "llama3")
    model = convert.from_hf(hf)
    ids, _ = batch(seed=2)
    with torch.no_grad():
        assert_rel(model(ids), hf(input_ids=ids).logits, 1e-10, "logits")


def test_loss_matches_stock_hf_loss():
    """The stock transformers model (float32 islands and its own loss function): same loss to
    float32-level accuracy, and the same label shifting and ignore_index handling."""
    hf = make_hf("untied")
    model = convert.from_hf(hf)
    ids, labels = batch(seed=3)
    with torch.no_grad():
        hf_loss = hf(input_ids=ids, labels=labels).loss
        loss = model(ids, labels=labels)
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())


def test_reductions_and_position_ids():
    hf = make_hf_exact_fp64(make_hf("untied"), "untied")
    model = convert.from_hf(hf)
    ids, labels = batch(seed=4)
    B, S = ids.shape
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
        per_token = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                    ignore_index=-100, reduction="none").view(B, S - 1)
        none = model(ids, labels=labels, reduction="none")
        assert none.shape == (B, S)
        assert_rel(none[:, :-1], per_token, 1e-10, "per-token loss")
        assert not none[:, -1].any(), "last position of each sequence has no target"
        assert_rel(model(ids, labels=labels, reduction="sum"), per_token.sum(), 1e-10, "sum")
        # explicit default positions give the same loss
        pos = torch.arange(S).expand(B, S)
        base = model(ids, labels=labels)
        assert torch.equal(model(ids, labels=labels, position_ids=pos), base)
        # RoPE only sees relative positions, so use non-uniform ones (two packed segments per
        # row, still one causal attention over the row) to check they reach the rotation
        packed = (torch.arange(S) % 6).expand(B, S)
        hf_packed = causal_lm_loss(hf(input_ids=ids, position_ids=packed).logits, labels)
        got = model(ids, labels=labels, position_ids=packed.to(torch.int32))
        assert_rel(got, hf_packed, 1e-10, "packed positions")
        assert (got - base).abs() > 1e-6


def test_custom_attention_callable():
    hf = make_hf("untied")
    model = convert.from_hf(hf)
    ids, labels = batch(seed=5)
    seen = []

    def attention(q, k, v):
        seen.append((q.shape, k.shape, v.shape))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        S = q.shape[2]
        mask = torch.ones(S, S, dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    with torch.no_grad():
        got = model(ids, labels=labels, attention=attention)
        want = model(ids, labels=labels)
    B, S = ids.shape
    assert seen[0] == ((B, 4, S, 16), (B, 2, S, 16), (B, 2, S, 16))
    assert len(seen) == 2  # once per layer
    assert_rel(got, want, 1e-12, "loss with a user attention")


def test_attention_gradients_return_to_qkv_in_one_concatenation():
    """Each layer's q, k, v gradients reach the packed qkv as one aten.cat (split's backward),
    not as three zero-filled qkv-sized tensors, each with its part copied in, summed
    (slice_backward and two additions): qkv's bytes read and written once instead of eleven
    times. The one addition left per layer is the residual stream's gradient sum."""
    model = convert.from_hf(make_hf("untied"))
    ids, labels = batch(seed=6)
    loss = model(ids, labels=labels)
    count = CountOps()
    with count:
        loss.backward()
    layers = model.config.num_layers
    assert count["aten::slice_backward"] == 0, count.calls
    assert count["aten::cat"] == layers, count.calls
    assert count["aten::add"] == layers, count.calls


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_round_trip_is_exact(name):
    hf = make_hf(name, seed=0)
    model = convert.from_hf(hf)
    other = make_hf(name, seed=7)  # different weights, overwritten by to_hf
    convert.to_hf(model, other)
    want = hf.state_dict()
    got = other.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the pure state-dict functions are inverse permutations of each other
    sd = {n: p.detach() for n, p in hf.named_parameters()}
    back = convert.coda_to_hf_state_dict(convert.hf_to_coda_state_dict(sd, model.config),
                                         model.config)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_rope_rows_are_permuted_to_adjacent_pairs():
    """An independent, index-by-index statement of the HF -> adjacent-pair permutation."""
    hf = make_hf("untied")
    model = convert.from_hf(hf)
    c = model.config
    d = c.head_dim
    wq = hf.model.layers[1].self_attn.q_proj.weight
    wk = hf.model.layers[1].self_attn.k_proj.weight
    wv = hf.model.layers[1].self_attn.v_proj.weight
    w_qkv = model.layers[1].w_qkv
    for block, heads, offset in ((wq, c.num_heads, 0), (wk, c.num_kv_heads, c.num_heads * d)):
        for h in range(heads):
            for i in range(d // 2):
                assert torch.equal(w_qkv[offset + h * d + 2 * i], block[h * d + i])
                assert torch.equal(w_qkv[offset + h * d + 2 * i + 1], block[h * d + i + d // 2])
    v0 = (c.num_heads + c.num_kv_heads) * d
    assert torch.equal(w_qkv[v0:], wv)
    gate = hf.model.layers[1].mlp.gate_proj.weight
    up = hf.model.layers[1].mlp.up_proj.weight
    assert torch.equal(model.layers[1].w_gu[0::2], gate)
    assert torch.equal(model.layers[1].w_gu[1::2], up)


def test_converted_models_own_their_storage():
    """Training the converted model must not write into the source checkpoint."""
    hf = make_hf("untied")
    model = convert.from_hf(hf)
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert not theirs & {p.untyped_storage().data_ptr() for p in model.parameters()}
    tt = convert.to_torchtitan(model)
    back = convert.from_torchtitan(tt, model.config)
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not ours & {p.untyped_storage().data_ptr() for p in back.parameters()}


def test_tied_embeddings_share_one_parameter():
    model = convert.from_hf(make_hf("tied"))
    assert model.w_vocab is model.embed_tokens.weight
    assert len(list(model.parameters())) == 1 + 2 * 6 + 1  # embedding, 2 layers, gamma_final


def test_config_from_hf():
    c = convert.config_from_hf(make_hf("llama3").config)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (4, 2, 16, 2)
    assert c.rope_theta == 10000.0
    assert c.rope_scaling == {k: LLAMA3[k] for k in ("factor", "low_freq_factor",
                                                      "high_freq_factor",
                                                      "original_max_position_embeddings")}
    # our float64 frequencies agree with transformers' float32 ones
    hf = make_hf("llama3")
    ours = coda.ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.double(), rtol=1e-6, atol=0)


def test_qwen2_bias_rows_follow_the_weights():
    """The packed b_qkv is permuted row for row as w_qkv (adjacent RoPE pairs), V unpermuted."""
    hf = make_hf("qwen2")
    model = convert.from_hf(hf)
    c = model.config
    assert c.qkv_bias and model.layers[0].b_qkv is not None
    a = hf.model.layers[1].self_attn
    w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
    # Each packed weight row is an HF row; its bias must be that row's bias.
    for i, row in enumerate(model.layers[1].w_qkv):
        (j,) = [j for j in range(w.shape[0]) if torch.equal(w[j], row)]
        assert torch.equal(model.layers[1].b_qkv[i], b[j]), f"row {i}"


def test_unsupported_hf_configs_are_rejected():
    cfg = make_hf("untied").config
    cfg.attention_bias = True
    with pytest.raises(NotImplementedError, match="attention_bias"):
        convert.config_from_hf(cfg)
    cfg = make_hf("qwen2").config
    cfg.use_sliding_window = True
    with pytest.raises(NotImplementedError, match="sliding-window"):
        convert.config_from_hf(cfg)
    cfg = make_hf("qwen3").config
    cfg.attention_bias = True  # Qwen3's is on the output projection too
    with pytest.raises(NotImplementedError, match="attention_bias"):
        convert.config_from_hf(cfg)
    # TorchTitan's Qwen3 keeps HF's half-split RoPE rows under llama3's names: refused, not
    # silently misplaced
    qwen3 = convert.from_hf(make_hf("qwen3"))
    with pytest.raises(NotImplementedError, match="converts from and to Hugging Face only"):
        convert.to_torchtitan(qwen3)
    with pytest.raises(NotImplementedError, match="converts from and to Hugging Face only"):
        convert.from_torchtitan({}, qwen3.config)
    cfg = make_hf("qwen2").config
    cfg.model_type = "mistral"
    with pytest.raises(NotImplementedError, match="model_type 'mistral'"):
        convert.config_from_hf(cfg)
    cfg = make_hf("untied").config
    cfg.rope_parameters = dict(rope_type="yarn", rope_theta=10000.0, factor=2.0)
    with pytest.raises(NotImplementedError, match="yarn"):
        convert.config_from_hf(cfg)


# ---------------------------------------------------------------------------------------------
# TorchTitan


@pytest.mark.parametrize("release", ["0.2", "0.3"])
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_torchtitan_round_trip(name, release):
    hf = make_hf_exact_fp64(make_hf(name), name)
    model = convert.from_hf(hf)
    tt = convert.to_torchtitan(model, release)
    c = model.config
    qkv = "attention." if release == "0.2" else "attention.qkv_linear."
    head = "output.weight" if release == "0.2" else "lm_head.weight"
    expected_keys = {"tok_embeddings.weight", "norm.weight", head} | {
        f"layers.{i}.{k}.weight" for i in range(c.num_layers) for k in (
            qkv + "wq", qkv + "wk", qkv + "wv", "attention.wo", "feed_forward.w1",
            "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm")}
    assert set(tt) == expected_keys
    assert convert.torchtitan_release_of(tt) == release
    # TorchTitan's RoPE already pairs adjacent dims: its wq is HF's with rows permuted, and
    # w1 / w3 / w2 are gate / up / down
    assert torch.equal(tt[f"layers.0.{qkv}wq.weight"],
                       convert.rope_half_to_adjacent(hf.model.layers[0].self_attn.q_proj.weight,
                                                     c.num_heads, c.head_dim))
    mlp = hf.model.layers[0].mlp
    assert torch.equal(tt["layers.0.feed_forward.w1.weight"], mlp.gate_proj.weight)
    assert torch.equal(tt["layers.0.feed_forward.w3.weight"], mlp.up_proj.weight)
    assert torch.equal(tt["layers.0.feed_forward.w2.weight"], mlp.down_proj.weight)

    back = convert.from_torchtitan({k: v.clone() for k, v in tt.items()}, c)
    for (n, p), (n2, p2) in zip(model.named_parameters(), back.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    if c.tie_word_embeddings:
        assert back.w_vocab is back.embed_tokens.weight
    ids, labels = batch(seed=6)
    with torch.no_grad():
        assert torch.equal(back(ids, labels=labels), model(ids, labels=labels))
    again = convert.to_torchtitan(back, release)
    for k in tt:
        assert torch.equal(again[k], tt[k]), k


def test_torchtitan_names_of_both_releases_are_not_mixed():
    model = convert.from_hf(make_hf("untied"))
    tt = convert.to_torchtitan(model, "0.3")
    tt["output.weight"] = tt.pop("lm_head.weight")  # 0.3 projections, 0.2 head
    with pytest.raises(ValueError, match="cannot tell the release"):
        convert.from_torchtitan(tt, model.config)
    with pytest.raises(ValueError, match=r"release must be one of \('0.2', '0.3'\)"):
        convert.to_torchtitan(model, "0.4")
