"""Checkpoint converters: Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` and TorchTitan
llama3 <-> coda.

The coda layout differs in three row permutations (all weights are ``(out, in)``; the converters
permute rows only, so they apply unchanged to gradients):

* RoPE: HF rotates the two halves of each Q/K head ("rotate_half": row ``i`` pairs with
  ``i + d/2``); coda, Meta and TorchTitan pair adjacent rows ``(2i, 2i + 1)``.
* QKV: separate ``Wq, Wk, Wv`` <-> one packed ``w_qkv = [Q heads | K heads | V heads]`` (and
  Qwen2's biases ``bq, bk, bv`` <-> ``b_qkv``, rows permuted as the weights'; Qwen3's QK-norm
  weights ``q_norm, k_norm`` <-> ``q_gamma, k_gamma``, permuted as one head's rows).
* SwiGLU: split ``W_gate, W_up`` <-> interleaved ``w_gu`` rows ``[g0, u0, g1, u1, ...]``.

The state-dict functions take and return plain ``{name: tensor}`` dicts (any tensors: weights or
their gradients); ``from_*`` / ``to_*`` wrap them for whole models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .nn import CodaLlamaForCausalLM, LlamaConfig

__all__ = [
    "rope_half_to_adjacent",
    "rope_half_to_adjacent_view",
    "rope_adjacent_to_half",
    "interleave_gate_up",
    "split_gate_up",
    "pack_qkv",
    "unpack_qkv",
    "config_from_hf",
    "hf_to_coda_state_dict",
    "coda_to_hf_state_dict",
    "torchtitan_to_coda_state_dict",
    "coda_to_torchtitan_state_dict",
    "from_hf",
    "to_hf",
    "from_torchtitan",
    "torchtitan_release_of",
    "to_torchtitan",
]

# ---------------------------------------------------------------------------------------------
# Row permutations


def rope_half_to_adjacent(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """HF half-split rows of each head -> adjacent RoPE pairs: row ``i`` -> ``2i``,
    row ``i + d/2`` -> ``2i + 1``."""
    return rope_half_to_adjacent_view(w, heads, head_dim).flatten(0, 2).contiguous()


def rope_half_to_adjacent_view(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """:func:`rope_half_to_adjacent` as a ``(heads, d/2, 2, ...)`` view of ``w`` (no copy), for
    callers that copy it anyway (e.g. into a packed QKV weight)."""
    _check_rows(w, heads * head_dim, "rope_half_to_adjacent")
    return w.unflatten(0, (heads, 2, head_dim // 2)).transpose(1, 2)


def rope_adjacent_to_half(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Inverse of :func:`rope_half_to_adjacent`."""
    _check_rows(w, heads * head_dim, "rope_adjacent_to_half")
    return w.unflatten(0, (heads, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2).contiguous()


def interleave_gate_up(w_gate: Tensor, w_up: Tensor) -> Tensor:
    """``(I, H)`` gate and up -> ``(2I, H)`` with rows ``[g0, u0, g1, u1, ...]``."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"interleave_gate_up: w_gate {tuple(w_gate.shape)} and w_up "
                         f"{tuple(w_up.shape)} differ")
    return torch.stack((w_gate, w_up), dim=1).flatten(0, 1)


def split_gate_up(w_gu: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`interleave_gate_up`: ``(2I, H)`` -> ``(w_gate, w_up)``."""
    if w_gu.shape[0] % 2:
        raise ValueError(f"split_gate_up: w_gu needs an even number of rows, got {w_gu.shape[0]}")
    return w_gu[0::2].contiguous(), w_gu[1::2].contiguous()


def pack_qkv(wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """Stack ``[wq; wk; wv]`` (already in the adjacent-pair RoPE layout)."""
    if wk.shape != wv.shape:
        raise ValueError(f"pack_qkv: wk {tuple(wk.shape)} and wv {tuple(wv.shape)} differ")
    return torch.cat((wq, wk, wv), dim=0)


def unpack_qkv(w_qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int):
    """Inverse of :func:`pack_qkv`: ``(wq, wk, wv)``."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    _check_rows(w_qkv, q + 2 * kv, "unpack_qkv")
    return (w_qkv[:q].contiguous(), w_qkv[q : q + kv].contiguous(), w_qkv[q + kv :].contiguous())


def _check_rows(w: Tensor, rows: int, who: str) -> None:
    if w.dim() < 1 or w.shape[0] != rows:
        raise ValueError(f"{who}: expected {rows} rows, got shape {tuple(w.shape)}")


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 scaling dict or None) from a transformers 5 (``rope_parameters``) or
    4.x (``rope_theta`` + ``rope_scaling``) config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("coda: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise NotImplementedError(f"coda: rope_type {rope_type!r} is not supported "
                                  "(only 'default' and 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {k: scaling[k] for k in keys}


# The transformers model types coda runs: LLaMA, Qwen2 / Qwen2.5 (LLaMA with a Q/K/V bias) and
# Qwen3 (LLaMA with an RMSNorm over every Q and K head before RoPE).
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def config_from_hf(hf_config: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a transformers ``LlamaConfig``, ``Qwen2Config`` or
    ``Qwen3Config``."""
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
        raise NotImplementedError(f"coda: model_type {model_type!r} is not supported (only "
                                  f"{', '.join(HF_MODEL_TYPES)})")
    qwen2, qwen3 = model_type == "qwen2", model_type == "qwen3"
    # LLaMA's and Qwen3's attention_bias put a bias on the output projection too; Qwen2's is on
    # Q/K/V only.
    for flag in ("mlp_bias",) if qwen2 else ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise NotImplementedError(f"coda: {flag}=True is not supported")
    if qwen2 or qwen3:
        layer_types = getattr(hf_config, "layer_types", None) or []
        if getattr(hf_config, "use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types):
            raise NotImplementedError("coda: sliding-window attention (use_sliding_window / "
                                      "layer_types) is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"coda: hidden_act {act!r} is not supported (SwiGLU uses silu)")
    heads = hf_config.num_attention_heads
    theta, scaling = _hf_rope(hf_config)
    return LlamaConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qwen2,
        qk_norm=qwen3,
    )


def _take(sd: dict[str, Tensor], *names: str) -> Tensor:
    """Pop the first of ``names`` present (aliases of tied weights), dropping the others."""
    found = [n for n in names if n in sd]
    if not found:
        raise KeyError(f"missing key {names[0]!r}")
    value = sd[found[0]]
    for n in found:
        del sd[n]
    return value


def _no_leftovers(sd: Mapping[str, Tensor], who: str) -> None:
    if sd:
        raise ValueError(f"{who}: unexpected keys {sorted(sd)[:10]}")


# HF and TorchTitan name the same tensors differently; only HF's Q/K rows need a permutation
# (rotate_half pairs -> adjacent pairs). HF state dicts go through the TorchTitan names, so the
# packing into coda's layouts is written once (torchtitan_to_coda_state_dict and its inverse).
_HF_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
_HF_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",  # Qwen2
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


def _rename_rope(sd: Mapping[str, Tensor], config: LlamaConfig, to_torchtitan: bool,
                 who: str) -> dict[str, Tensor]:
    """HF <-> TorchTitan names, permuting the Q/K rows of every head on the way."""
    top, layer = _HF_TOP, _HF_LAYER
    src, dst, permute = "model.layers.", "layers.", rope_half_to_adjacent
    if not to_torchtitan:
        top, layer = {v: k for k, v in top.items()}, {v: k for k, v in layer.items()}
        src, dst, permute = dst, src, rope_adjacent_to_half
    heads = {"attention.wq.weight": config.num_heads, "attention.wk.weight": config.num_kv_heads,
             "attention.wq.bias": config.num_heads, "attention.wk.bias": config.num_kv_heads,
             "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}  # one head's rows
    out: dict[str, Tensor] = {}
    for name, value in sd.items():
        if name in top:
            out[top[name]] = value
            continue
        index, _, leaf = name.removeprefix(src).partition(".")
        if not name.startswith(src) or not index.isdigit() or leaf not in layer:
            raise ValueError(f"{who}: unexpected key {name!r}")
        tt_leaf = layer[leaf] if to_torchtitan else leaf
        if tt_leaf in heads:
            value = permute(value, heads[tt_leaf], config.head_dim)
        out[f"{dst}{index}.{layer[leaf]}"] = value
    return out


def hf_to_coda_state_dict(hf_sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` names/layouts ->
    coda names/layouts."""
    return _torchtitan_to_coda(_rename_rope(hf_sd, config, True, "hf_to_coda_state_dict"),
                               config)


def coda_to_hf_state_dict(sd_in: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """coda names/layouts -> HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
    names/layouts
    (inverse of :func:`hf_to_coda_state_dict`). With tied embeddings either alias may be present."""
    return _rename_rope(_coda_to_torchtitan(sd_in, config, "0.2"), config, False,
                        "coda_to_hf_state_dict")


def _detached_params(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def from_hf(hf_model: torch.nn.Module, device=None, dtype=None,
            precision: str = "bf16") -> CodaLlamaForCausalLM:
    """A :class:`CodaLlamaForCausalLM` with the weights of a transformers ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``.

    The new model gets copies of the weights, on ``device`` / in ``dtype`` (default: those of
    the HF model), and runs its projections in ``precision`` ("bf16" or "fp8")."""
    config = config_from_hf(hf_model.config)
    ref = next(hf_model.parameters())
    return _model_from_state_dict(
        config, hf_to_coda_state_dict(_detached_params(hf_model), config),
        ref.device if device is None else device, ref.dtype if dtype is None else dtype,
        precision)


def _model_from_state_dict(config, sd, device, dtype, precision="bf16") -> CodaLlamaForCausalLM:
    # Built on the meta device (no throw-away random init), then given copies of the tensors:
    # the new model must never share storage with the source checkpoint.
    model = CodaLlamaForCausalLM(config, device="meta", dtype=dtype, precision=precision)
    sd = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in sd.items()}
    model.load_state_dict(sd, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter by two
    model.reset_rope_table()  # the buffer was left on the meta device
    return model


def _copy_into(model: torch.nn.Module, sd: Mapping[str, Tensor], who: str) -> None:
    # remove_duplicate=False: write every alias of a tied weight (they share storage anyway).
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in sd if n not in params]
    if missing:
        raise ValueError(f"{who}: the target model has no parameters {missing[:10]}")
    with torch.no_grad():
        for name, value in sd.items():
            params[name].copy_(value)


def to_hf(model: CodaLlamaForCausalLM, hf_model: torch.nn.Module) -> torch.nn.Module:
    """Write ``model``'s weights into ``hf_model`` (a transformers ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` of the same shape) in place; returns
    ``hf_model``."""
    theirs = config_from_hf(hf_model.config)
    if theirs != model.config:
        raise ValueError(f"to_hf: configs differ: coda {model.config} vs HF {theirs}")
    _copy_into(hf_model, coda_to_hf_state_dict(_detached_params(model), model.config), "to_hf")
    return hf_model


# ---------------------------------------------------------------------------------------------
# TorchTitan llama3 (RoPE already pairs adjacent dims, so Q/K rows are not permuted). Two releases'
# checkpoint names: 0.2 keeps the projections on `attention` and the LM head as `output`; 0.3
# keeps Q/K/V under `attention.qkv_linear` (its fused `wqkv` saves and loads in the stock wq / wk /
# wv layout through state-dict hooks) and the LM head as `lm_head`.

TORCHTITAN_RELEASES = ("0.2", "0.3")


def _tt_names(release: str) -> tuple[str, str]:
    """(prefix of wq / wk / wv within a layer, the LM head's key) of a TorchTitan release."""
    if release not in TORCHTITAN_RELEASES:
        raise ValueError(f"TorchTitan release must be one of {TORCHTITAN_RELEASES}, got "
                         f"{release!r}")
    return ("attention.", "output.weight") if release == "0.2" else (
        "attention.qkv_linear.", "lm_head.weight")


def torchtitan_release_of(tt_sd: Mapping[str, Tensor]) -> str:
    """The TorchTitan release whose names a llama3 state dict uses ("0.2" or "0.3")."""
    new = any(k.startswith("layers.0.attention.qkv_linear.") for k in tt_sd) or (
        "lm_head.weight" in tt_sd)
    old = "layers.0.attention.wq.weight" in tt_sd or "output.weight" in tt_sd
    if new == old:
        raise ValueError("torchtitan state dict: cannot tell the release from its names "
                         "(expected layers.0.attention.wq.weight and output.weight (0.2) or "
                         "layers.0.attention.qkv_linear.wq.weight and lm_head.weight (0.3))")
    return "0.3" if new else "0.2"


def _llama3_only(config: LlamaConfig, who: str) -> None:
    # TorchTitan's llama3 has neither; its Qwen3 keeps HF's half-split RoPE rows under the same
    # names, which the adjacent-pair mapping here would silently misplace.
    if config.qkv_bias or config.qk_norm:
        raise NotImplementedError(f"{who}: TorchTitan checkpoints are llama3's; a config with "
                                  "qkv_bias or qk_norm (Qwen2 / Qwen3) converts from and to "
                                  "Hugging Face only")


def torchtitan_to_coda_state_dict(
    tt_sd: Mapping[str, Tensor], config: LlamaConfig
) -> dict[str, Tensor]:
    """TorchTitan llama3 names (0.2 or 0.3, told apart by the names) -> coda names/layouts
    (w1 = gate, w3 = up, w2 = down)."""
    _llama3_only(config, "torchtitan_to_coda_state_dict")
    return _torchtitan_to_coda(tt_sd, config)


def _torchtitan_to_coda(tt_sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    # also the HF path's second half, with Qwen2's biases and Qwen3's head norms
    c = config
    sd = dict(tt_sd)
    sd.pop("freqs_cis", None)  # a derived buffer some TorchTitan versions keep in the state dict
    qkv, head = _tt_names(torchtitan_release_of(sd))
    out: dict[str, Tensor] = {}
    emb = _take(sd, "tok_embeddings.weight")
    out["embed_tokens.weight"] = emb
    for i in range(c.num_layers):
        p = q = f"layers.{i}."  # same prefix, different leaf names
        out[f"gamma_attn.{i}"] = _take(sd, p + "attention_norm.weight")
        out[q + "w_qkv"] = pack_qkv(_take(sd, p + qkv + "wq.weight"),
                                    _take(sd, p + qkv + "wk.weight"),
                                    _take(sd, p + qkv + "wv.weight"))
        if c.qkv_bias:  # Qwen2's, through the HF converter
            out[q + "b_qkv"] = pack_qkv(_take(sd, p + qkv + "wq.bias"),
                                        _take(sd, p + qkv + "wk.bias"),
                                        _take(sd, p + qkv + "wv.bias"))
        if c.qk_norm:  # Qwen3's, through the HF converter
            out[q + "q_gamma"] = _take(sd, p + "attention.q_norm.weight")
            out[q + "k_gamma"] = _take(sd, p + "attention.k_norm.weight")
        out[q + "w_o"] = _take(sd, p + "attention.wo.weight")
        out[q + "gamma_ffn"] = _take(sd, p + "ffn_norm.weight")
        out[q + "w_gu"] = interleave_gate_up(_take(sd, p + "feed_forward.w1.weight"),
                                             _take(sd, p + "feed_forward.w3.weight"))
        out[q + "w_down"] = _take(sd, p + "feed_forward.w2.weight")
    out["gamma_final"] = _take(sd, "norm.weight")
    if c.tie_word_embeddings:
        sd.pop(head, None)
        out["w_vocab"] = emb
    else:
        out["w_vocab"] = _take(sd, head)
    _no_leftovers(sd, "torchtitan_to_coda_state_dict")
    return out


def coda_to_torchtitan_state_dict(
    sd_in: Mapping[str, Tensor], config: LlamaConfig, release: str = "0.3"
) -> dict[str, Tensor]:
    """Inverse of :func:`torchtitan_to_coda_state_dict`, in the names of TorchTitan `release`."""
    _llama3_only(config, "coda_to_torchtitan_state_dict")
    return _coda_to_torchtitan(sd_in, config, release)


def _coda_to_torchtitan(sd_in: Mapping[str, Tensor], config: LlamaConfig,
                        release: str) -> dict[str, Tensor]:
    c = config
    qkv, head = _tt_names(release)
    sd = dict(sd_in)
    out: dict[str, Tensor] = {}
    if c.tie_word_embeddings:
        emb = _take(sd, "embed_tokens.weight", "w_vocab")
    else:
        emb = _take(sd, "embed_tokens.weight")
    out["tok_embeddings.weight"] = emb
    for i in range(c.num_layers):
        p = q = f"layers.{i}."
        wq, wk, wv = unpack_qkv(_take(sd, q + "w_qkv"), c.num_heads, c.num_kv_heads, c.head_dim)
        out[p + qkv + "wq.weight"] = wq
        out[p + qkv + "wk.weight"] = wk
        out[p + qkv + "wv.weight"] = wv
        if c.qkv_bias:
            bq, bk, bv = unpack_qkv(_take(sd, q + "b_qkv"), c.num_heads, c.num_kv_heads,
                                    c.head_dim)
            out[p + qkv + "wq.bias"] = bq
            out[p + qkv + "wk.bias"] = bk
            out[p + qkv + "wv.bias"] = bv
        if c.qk_norm:
            out[p + "attention.q_norm.weight"] = _take(sd, q + "q_gamma")
            out[p + "attention.k_norm.weight"] = _take(sd, q + "k_gamma")
        out[p + "attention.wo.weight"] = _take(sd, q + "w_o")
        out[p + "attention_norm.weight"] = _take(sd, f"gamma_attn.{i}")
        gate, up = split_gate_up(_take(sd, q + "w_gu"))
        out[p + "feed_forward.w1.weight"] = gate
        out[p + "feed_forward.w3.weight"] = up
        out[p + "feed_forward.w2.weight"] = _take(sd, q + "w_down")
        out[p + "ffn_norm.weight"] = _take(sd, q + "gamma_ffn")
    out["norm.weight"] = _take(sd, "gamma_final")
    out[head] = emb if c.tie_word_embeddings else _take(sd, "w_vocab")
    _no_leftovers(sd, "coda_to_torchtitan_state_dict")
    return out


def from_torchtitan(
    state_dict: Mapping[str, Tensor], config: LlamaConfig, device=None, dtype=None
) -> CodaLlamaForCausalLM:
    """A :class:`CodaLlamaForCausalLM` from a TorchTitan llama3 state dict and its config
    (``rope_theta`` / ``rope_scaling`` must match what TorchTitan's ``precompute_freqs_cis`` used).
    Device and dtype default to those of the state dict's tensors."""
    _llama3_only(config, "from_torchtitan")
    ref = state_dict["tok_embeddings.weight"]
    return _model_from_state_dict(
        config, torchtitan_to_coda_state_dict(state_dict, config),
        ref.device if device is None else device, ref.dtype if dtype is None else dtype)


def to_torchtitan(model: CodaLlamaForCausalLM, release: str = "0.3") -> dict[str, Tensor]:
    """A TorchTitan llama3 state dict in the names of `release` (detached tensors sharing or
    copying ``model``'s storage)."""
    return coda_to_torchtitan_state_dict(_detached_params(model), model.config, release)
