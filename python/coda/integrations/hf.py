"""A transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` patched in
place to train through coda's fused ops (Qwen2's Q/K/V bias is added in the QKV GEMM's epilogue,
before RoPE; Qwen3's QK-norm is the per-head RMSNorm inside the QKV GEMM's epilogue).

:func:`patch_hf` replaces the model instance's ``forward`` and nothing else: the parameters, their
names and layouts, the config and the module tree stay Hugging Face's. So the model is still a
``PreTrainedModel``: ``Trainer`` trains it, ``save_pretrained`` writes the stock checkpoint that
stock transformers reloads, ``generate`` works, the model pickles, and optimizer state keyed by
parameter carries over.

A training call (``model.train()``, gradients enabled) with ``labels`` (and, as in HF, optionally
``shift_labels``) runs the decoder on coda's block ops and the loss on its fused LM head, which
never holds the logits: the output has the loss and ``logits=None``. Every other call (evaluation,
no labels, a KV cache, attentions or hidden states asked for) runs the model's own forward,
unchanged. So do training calls coda cannot run, with a warning once per reason: a module with
forward hooks or a projection that is no longer a plain ``nn.Linear`` (PEFT adapters, pruning,
FSDP and offloading wrappers), sharded or meta parameters, an unsupported dtype, device or CUDA
width, a mask that is not 2-D, or keyword arguments the fused path does not know.

The fused path rebuilds coda's weight layouts from the HF parameters on every forward: Q and K
rows permuted so that RoPE pairs are adjacent, ``[Q | K | V]`` packed, gate and up rows
interleaved, and each weight cast to the compute dtype (bfloat16 under CUDA autocast). That costs
one copy of each weight per forward and, for the backward, one more: autograd saves the rebuilt
weights as the recipe to rebuild them (a saved-tensor hook that hands every other saved tensor to
the hooks already installed, e.g. activation offloading), not as tensors, so the patched model
holds no second copy of its weights between forward and backward.

With ``patch_hf(model, precision="fp8")`` the decoder layers' projection GEMMs run in blockwise
FP8 (the ops of ``CodaLlamaForCausalLM(config, precision="fp8")``). Their FP8 weights are
quantized from the packed weights and kept, outside the model's state, until one of the HF
parameters they come from changes (its version counter: an optimizer step, ``load_state_dict``),
so once per optimizer step; after a write through ``.data``, :func:`refresh_fp8_weights`.

Attention is PyTorch's scaled-dot-product attention with HF's masks: causal; with a 2-D
``attention_mask`` (1 = token, 0 = padding) the padded keys masked, and a row with no key left
giving 0, as HF's SDPA path does; without a mask, position ids that restart mark packed
sequences, which attend only within themselves (when no KV cache is asked for, as in HF). As in
HF, an all-ones mask and unpacked positions are detected with one host sync each. Gradient
checkpointing (``gradient_checkpointing_enable``) checkpoints each decoder layer, as HF does.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..convert import config_from_hf, rope_half_to_adjacent_view
from ..nn import (FP8_PROJECTIONS, Fp8WeightCache, LlamaConfig, _check_precision,
                  _keeps_fp8_weights, decoder_layer, decoder_layer_fp8, positions)

__all__ = ["patch_hf", "unpatch_hf", "is_patched", "refresh_fp8_weights"]

_ATTR = "_coda_patch"
# The keyword arguments the fused path reads (Trainer passes num_items_in_batch; shift_labels
# and return_dict as in HF's forward). Any other keyword sends the call to HF's forward.
_KNOWN_KWARGS = frozenset({"num_items_in_batch", "shift_labels", "return_dict"})
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")
_IGNORE = -100  # HF's causal-LM loss ignores this label
_MAX_CUDA_VOCAB = 1 << 24


@dataclass
class _Patch:
    config: LlamaConfig
    precision: str = "bf16"
    fp8_recompute_a: bool = False  # FP8: a's weight-gradient copy made from z in the backward
    fp8_z: bool = False  # FP8: the MLP's pre-activation z saved for the backward in FP8
    # FP8: the weights' operands kept between forwards (Fp8WeightCache): None keeps them unless
    # fully_shard manages the model (CodaLlamaForCausalLM.fp8_weight_cache), False never
    fp8_weight_cache: bool | None = None
    tables: dict[torch.device, Tensor] = field(default_factory=dict)  # RoPE table per device
    warned: set[str] = field(default_factory=set)
    # precision="fp8": each layer's projection weights in FP8, kept while their HF parameters
    # are unchanged (Fp8WeightCache, keyed on the parameters the packed weight is built from)
    fp8_caches: dict[int, Fp8WeightCache] = field(default_factory=dict)

    def fp8_cache(self, layer: int, persist: bool) -> Fp8WeightCache:
        cache = self.fp8_caches.setdefault(layer, Fp8WeightCache())
        cache.persist = persist  # (not persisting: get() drops what the cache holds)
        return cache

    def __getstate__(self) -> dict:  # a pickled or copied model quantizes its own weights
        return {**vars(self), "fp8_caches": {}}

    @torch.compiler.disable
    def rope_table(self, device: torch.device) -> Tensor:
        table = self.tables.get(device)
        if table is None:
            c = self.config
            inv = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
            table = ops.rope_table(inv, c.num_heads, c.num_kv_heads, c.head_dim).to(device)
            self.tables[device] = table
        return table


class _PatchedForward:
    """The patched model's ``forward``: a picklable stand-in for a bound method (``__func__`` and
    ``__self__`` as accelerate's autocast wrapper expects them), with HF's signature, which
    ``generate`` and ``Trainer`` inspect."""

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model
        self.__func__ = _forward

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None,
                 past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                 logits_to_keep=0, **kwargs):
        return _forward(self.__self__, input_ids, attention_mask, position_ids, past_key_values,
                        inputs_embeds, labels, use_cache, logits_to_keep, **kwargs)

    def __reduce__(self):
        return _PatchedForward, (self.__self__,)


def is_patched(model: nn.Module) -> bool:
    return isinstance(getattr(model, _ATTR, None), _Patch)


def _supported_classes() -> tuple[type, ...]:
    import transformers

    return (transformers.LlamaForCausalLM, transformers.Qwen2ForCausalLM,
            transformers.Qwen3ForCausalLM)


def patch_hf(model: nn.Module, precision: str = "bf16", fp8_recompute_a: bool = False,
             fp8_z: bool = False, fp8_weight_cache: bool | None = None) -> nn.Module:
    """Make ``model`` (a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
    ``Qwen3ForCausalLM``) train through
    coda, in place; returns it. Raises ``NotImplementedError`` for configurations coda does not
    run (LLaMA's attention or MLP biases, sliding-window attention, another activation or RoPE
    type) and ``TypeError`` for another model class, a model whose projections are not plain
    ``nn.Linear`` modules, or one whose ``forward`` is already wrapped (patch before handing the
    model to accelerate or Trainer).

    ``precision="fp8"`` runs every projection GEMM of the decoder layers in blockwise FP8
    (docs/math.md §6), as ``CodaLlamaForCausalLM(config, precision="fp8")`` does: the packed
    weights are quantized when their HF parameters change (once per optimizer step), kept
    outside the model's state; the embedding, norms, LM head and the parameters keep their dtype.
    Every extent must be a multiple of 16 (ValueError naming it otherwise); Qwen3's QK-norm runs
    in the QKV GEMM's epilogue as in bf16. ``fp8_recompute_a``: as
    ``CodaLlamaForCausalLM.fp8_recompute_a`` (a's weight-gradient copy made from z in the
    backward: about I bytes less kept per token and layer); ``fp8_z``: as
    ``CodaLlamaForCausalLM.fp8_z`` (z saved in FP8: about 2I bytes less); ``fp8_weight_cache``:
    as ``CodaLlamaForCausalLM.fp8_weight_cache`` (None: the FP8 weights kept between forwards
    unless ``fully_shard`` manages the model, whose gathered weights come back at the same
    address without a version change, so a kept copy would go stale; False: never kept, each
    backward casts wᵀ itself, 1 byte a projection parameter less at the peak). Patching a patched
    model again sets all four."""
    known = [c for c in _supported_classes() if isinstance(model, c)]
    if not known or type(model).forward is not known[0].forward:
        raise TypeError(f"patch_hf: expected a transformers LlamaForCausalLM, Qwen2ForCausalLM or "
                        f"Qwen3ForCausalLM (its own forward), got {type(model).__name__}")
    if is_patched(model):
        patch = getattr(model, _ATTR)
        _check_precision(patch.config, precision)
        patch.precision, patch.fp8_recompute_a = precision, bool(fp8_recompute_a)
        patch.fp8_z = bool(fp8_z)
        patch.fp8_weight_cache = fp8_weight_cache
        patch.fp8_caches.clear()
        return model
    if "forward" in vars(model):
        raise TypeError(f"patch_hf: model.forward is already replaced ({vars(model)['forward']!r});"
                        " patch the model before wrapping it")
    config = config_from_hf(model.config)
    problem = _foreign_module(model, config)
    if problem:
        raise TypeError(f"patch_hf: {problem}")
    _check_precision(config, precision)
    patch = _Patch(config, precision, bool(fp8_recompute_a), bool(fp8_z), fp8_weight_cache)
    patch.rope_table(model.lm_head.weight.device)  # built eagerly, outside any compiled region
    setattr(model, _ATTR, patch)
    model.forward = _PatchedForward(model)
    return model


def refresh_fp8_weights(model: nn.Module) -> None:
    """Drops the FP8 weights a patched model keeps, so that its next forward quantizes them
    again: needed after writes that do not move a parameter's version counter (through
    ``.data``); optimizer steps and ``load_state_dict`` are seen on their own."""
    if is_patched(model):
        getattr(model, _ATTR).fp8_caches.clear()


def unpatch_hf(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_hf`: the model runs its own forward again (a wrapper installed around the
    patched forward since then stays, and reaches HF's forward)."""
    if is_patched(model):
        if isinstance(vars(model).get("forward"), _PatchedForward):
            del model.forward
        delattr(model, _ATTR)
    return model


def _foreign_module(model: nn.Module, c: LlamaConfig) -> str | None:
    """Why the fused path cannot read the model's weights, or None."""
    layers = model.model.layers
    if len(layers) != c.num_layers:
        return f"model.model.layers has {len(layers)} layers, the config {c.num_layers}"
    biased = ("q_proj", "k_proj", "v_proj") if c.qkv_bias else ()  # Qwen2's Q/K/V bias
    for i, layer in enumerate(layers):
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                m = getattr(getattr(layer, part), name)
                bias = name in biased
                if type(m) is not nn.Linear or (m.bias is not None) != bias:
                    what = "with" if m.bias is not None else "without"
                    return (f"model.layers.{i}.{part}.{name} is a {type(m).__name__}"
                            f"{f' {what} a bias' if type(m) is nn.Linear else ''}; the fused path "
                            f"needs a plain nn.Linear {'with' if bias else 'without'} bias "
                            "(adapters such as PEFT's change the weight it would read)")
        if c.qk_norm:  # Qwen3: the fused path reads each head norm's weight and the config's eps
            for name in ("q_norm", "k_norm"):
                m = getattr(layer.self_attn, name, None)
                weight = getattr(m, "weight", None)
                if (type(m).__name__ != "Qwen3RMSNorm" or weight is None
                        or tuple(weight.shape) != (c.head_dim,)):
                    return (f"model.layers.{i}.self_attn.{name} is a {type(m).__name__}; the "
                            f"fused path needs Qwen3's RMSNorm with a ({c.head_dim},) weight")
    if type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None:
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear without bias"
    return None


def _hooked_or_sharded(model: nn.Module) -> str | None:
    """A module whose forward (pre-)hooks or parameters the fused path would bypass, or None. The
    model itself and its embedding are called as modules, so their hooks run."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # a torch built without distributed
        FSDP1 = ()
    skip = {id(model), id(model.model.embed_tokens)}
    for name, m in model.named_modules():
        if isinstance(m, FSDP1):
            return (f"{name} is a FullyShardedDataParallel (FSDP1) unit, whose flat parameters "
                    "the fused path cannot read")
        if id(m) in skip:
            continue
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"):
            return (f"{name or 'the model'} has forward hooks (pruning, FSDP, offloading or a "
                    "user hook), which the fused path would not run")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()
    for name, p in model.named_parameters():
        if p.is_meta or isinstance(p, DTensor) or hasattr(p, "ds_id"):
            return f"parameter {name} is sharded or on the meta device"
    return None


def _cuda_widths(c: LlamaConfig) -> str | None:
    """The CUDA programs' width limits (16-byte rows for TMA), or None when every width fits."""
    widths = {"hidden_size": (c.hidden_size, 8), "2 x intermediate_size":
              (2 * c.intermediate_size, 16), "the QKV width": (c.qkv_width, 8),
              "num_heads x head_dim": (c.num_heads * c.head_dim, 8)}  # any vocabulary size
    for what, (width, multiple) in widths.items():
        if width % multiple:
            return f"{what} = {width} is not a multiple of {multiple} (CUDA: 16-byte rows)"
    if c.vocab_size > _MAX_CUDA_VOCAB:
        return f"vocab_size = {c.vocab_size} exceeds {_MAX_CUDA_VOCAB} on CUDA"
    if c.qk_norm and (c.head_dim < 8 or 128 % c.head_dim):
        return f"QK-norm on CUDA needs head_dim dividing 128 (8 to 128), got {c.head_dim}"
    return None


def _compute_dtype(model: nn.Module, device: torch.device) -> tuple[torch.dtype | None, str]:
    """The dtype the fused ops run in on ``device``, or (None, why not)."""
    params = model.lm_head.weight.dtype
    if device.type == "cuda":
        dtype = (torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda")
                 else params)
        if dtype != torch.bfloat16:
            return None, (f"coda's CUDA programs run in bfloat16; the parameters are {params} "
                          "(use bfloat16 parameters or bfloat16 autocast)")
        return dtype, ""
    if device.type == "cpu":
        if params not in (torch.float32, torch.float64):
            return None, (f"coda's CPU reference runs in float32 or float64; the parameters are "
                          f"{params}")
        return params, ""
    return None, f"coda runs on CPU or CUDA, the inputs are on {device}"


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
             inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    patch = getattr(self, _ATTR, None)
    # HF's forward answers these itself: not training, no loss to fuse, a KV cache, outputs only
    # it forms, or inputs it rejects (neither or both of input_ids and inputs_embeds).
    quiet = (patch is None or not (self.training and torch.is_grad_enabled()) or labels is None
             or past_key_values is not None
             or any(kwargs.get(f) or getattr(self.config, f, False) for f in _OUTPUT_FLAGS)
             or (input_ids is None) == (inputs_embeds is None))
    why = None if quiet else _why_unfused(self, patch, input_ids, inputs_embeds, attention_mask,
                                          kwargs)
    if quiet or why:
        if why and why not in patch.warned:
            patch.warned.add(why)
            warnings.warn(f"coda.integrations.patch_hf: running the model's own forward: {why}",
                          stacklevel=2)
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    use_cache = self.config.use_cache if use_cache is None else use_cache
    return _fused_forward(self, patch, input_ids, inputs_embeds, attention_mask, position_ids,
                          labels, bool(use_cache), kwargs)


def _why_unfused(model, patch, input_ids, inputs_embeds, attention_mask, kwargs) -> str | None:
    unknown = sorted(k for k in kwargs if k not in _KNOWN_KWARGS and k not in _OUTPUT_FLAGS)
    if unknown:
        return f"the fused path does not take the keyword arguments {unknown}"
    ref = input_ids if input_ids is not None else inputs_embeds
    if attention_mask is not None and attention_mask.dim() != 2:
        return f"attention_mask is {attention_mask.dim()}-D (the fused path takes a 2-D mask)"
    problem = (_foreign_module(model, patch.config) or _hooked_or_sharded(model)
               or _compute_dtype(model, ref.device)[1])
    if not problem and ref.device.type == "cuda":
        problem = _cuda_widths(patch.config)
    return problem or None


class _RebuiltOnBackward:
    """While active, autograd saves each weight registered by :meth:`derive` as the recipe to
    rebuild it from its parameters, not as a tensor; every other saved tensor goes to the
    saved-tensor hooks that were active outside (or is saved as is). The derived tensors stay
    alive (and their addresses unique) until the context exits."""

    def __init__(self) -> None:
        self.recipes: dict[int, tuple[Tensor, Callable[[], Tensor], list, list[int]]] = {}
        self.active = False
        self._outer: tuple[Callable, Callable] | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> _RebuiltOnBackward:
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.active = True
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.active = False
        self.recipes.clear()

    def derive(self, build: Callable[..., Tensor], *params: Tensor) -> Tensor:
        t = build(*params)
        if self.active and all(t is not p for p in params):
            rebuild = functools.partial(build, *(p.detach() for p in params))
            self.recipes[t.data_ptr()] = (t, rebuild, list(params), [p._version for p in params])
        return t

    def _pack(self, t: Tensor) -> Any:
        entry = self.recipes.get(t.data_ptr()) if t.layout == torch.strided else None
        if entry is not None:
            derived, rebuild, params, versions = entry
            # A view of a derived weight (other shape or strides) is saved as any tensor.
            if (t.shape == derived.shape and t.stride() == derived.stride()
                    and t.dtype == derived.dtype):
                return _Recipe(rebuild, params, versions)
        if self._outer is None:
            return t
        return _Outer(self._outer[1], self._outer[0](t))

    @staticmethod
    def _unpack(saved: Any) -> Tensor:
        if isinstance(saved, (_Recipe, _Outer)):
            return saved.unpack()
        return saved


@dataclass
class _Recipe:
    build: Callable[[], Tensor]
    params: Sequence[Tensor]
    versions: Sequence[int]

    def unpack(self) -> Tensor:
        if any(p._version != v for p, v in zip(self.params, self.versions)):
            raise RuntimeError("coda.integrations.patch_hf: a parameter was modified in place "
                               "between the forward and the backward")
        with torch.no_grad():
            return self.build()


@dataclass
class _Outer:  # a tensor packed by the saved-tensor hooks active outside the fused forward
    unpack_hook: Callable[[Any], Tensor]
    packed: Any

    def unpack(self) -> Tensor:
        return self.unpack_hook(self.packed)


def _qkv(c: LlamaConfig, dtype: torch.dtype, wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """HF's q/k/v weights (or biases) -> coda's packed ``[Q | K | V]`` with RoPE pairs adjacent,
    in ``dtype``: one pass, each part permuted and cast as it is copied into its rows."""
    d, q, kv = c.head_dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = wq.new_empty((q + 2 * kv, *wq.shape[1:]), dtype=dtype)
    for rows, w, heads in ((out[:q], wq, c.num_heads), (out[q:q + kv], wk, c.num_kv_heads)):
        rows.view(heads, d // 2, 2, *wq.shape[1:]).copy_(rope_half_to_adjacent_view(w, heads, d))
    out[q + kv:].copy_(wv)
    return out


def _gate_up(dtype: torch.dtype, gate: Tensor, up: Tensor) -> Tensor:
    """HF's gate / up weights -> coda's interleaved rows ``[g0, u0, g1, u1, ...]`` in ``dtype``,
    in one pass."""
    out = gate.new_empty((2 * gate.shape[0], gate.shape[1]), dtype=dtype)
    pairs = out.view(gate.shape[0], 2, -1)
    pairs[:, 0].copy_(gate)
    pairs[:, 1].copy_(up)
    return out


def _head_norm(c: LlamaConfig, dtype: torch.dtype, g: Tensor) -> Tensor:
    """A QK-norm weight (one head's rows, HF's half-split order) -> adjacent RoPE pairs."""
    out = g.new_empty(g.shape, dtype=dtype)
    out.view(1, c.head_dim // 2, 2).copy_(rope_half_to_adjacent_view(g, 1, c.head_dim))
    return out


def _cast(dtype: torch.dtype, w: Tensor) -> Tensor:
    return w.to(dtype)


def _weights(c: LlamaConfig, dtype: torch.dtype, layer: nn.Module) -> dict[str, tuple]:
    """Each projection's build (HF parameters -> coda's layout in ``dtype``) and its parameters,
    by coda's parameter name."""
    a, f = layer.self_attn, layer.mlp
    cast = functools.partial(_cast, dtype)
    return {"w_qkv": (functools.partial(_qkv, c, dtype),
                      (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
            "w_o": (cast, (a.o_proj.weight,)),
            "w_gu": (functools.partial(_gate_up, dtype), (f.gate_proj.weight, f.up_proj.weight)),
            "w_down": (cast, (f.down_proj.weight,))}


def _layer(c, dtype, layer, gamma_next, pos, table, batch, attention, rebuilt, fp8_cache,
           recompute_a, fp8_z, last, x, r, *h):
    """One decoder layer on the HF parameters: ``(x, r, *h) -> (x, r, *h)`` with ``h`` one
    tensor, or in FP8 (``fp8_cache`` set) its codes and scales (one tensor after the last
    layer: the LM head's input)."""
    a = layer.self_attn
    cast = functools.partial(_cast, dtype)
    w = rebuilt.derive
    spec = _weights(c, dtype, layer)
    weights = {n: w(build, *params) for n, (build, params) in spec.items()}
    b_qkv = (w(functools.partial(_qkv, c, dtype), a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
             if c.qkv_bias else None)
    gamma, gamma_ffn = (w(cast, layer.input_layernorm.weight),
                        w(cast, layer.post_attention_layernorm.weight))
    head_norm = functools.partial(_head_norm, c, dtype)
    q_gamma = w(head_norm, a.q_norm.weight) if c.qk_norm else None
    k_gamma = w(head_norm, a.k_norm.weight) if c.qk_norm else None
    if fp8_cache is not None:
        fp8 = {n: (weights[n], fp8_cache.get(n, weights[n], spec[n][1])) for n in FP8_PROJECTIONS}
        x, h, r = decoder_layer_fp8(c, x, tuple(h), r, gamma, fp8, gamma_ffn, pos, table,
                                    w(cast, gamma_next), batch, attention, last, b_qkv,
                                    recompute_a, q_gamma=q_gamma, k_gamma=k_gamma,
                                    recast_w_t=not fp8_cache.persist, fp8_z=fp8_z)
        return (x, r, h) if last else (x, r, *h)
    x, h, r = decoder_layer(
        c, x, h[0], r, gamma, weights["w_qkv"], weights["w_o"], gamma_ffn, weights["w_gu"],
        weights["w_down"], pos, table, w(cast, gamma_next), batch, attention, b_qkv, q_gamma,
        k_gamma)
    return x, r, h


def _attention_mask(mask: Tensor | None, position_ids: Tensor | None, use_cache: bool,
                    batch: int, seq: int) -> Tensor | None:
    """HF's SDPA mask as a (B, 1, S, S) bool tensor (True = attend), or None for plain causal:
    padding from a 2-D mask, else packed sequences from restarting positions."""
    if mask is not None:
        if mask.shape != (batch, seq):
            raise ValueError(f"patch_hf: attention_mask must be (B, S) = ({batch}, {seq}), got "
                             f"{tuple(mask.shape)}")
        if bool(mask.all()):  # HF's SDPA path drops an all-ones mask the same way (a host sync)
            return None
        causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
        return causal & mask.bool()[:, None, None, :]
    if position_ids is None or use_cache:
        return None
    # As transformers' find_packed_sequence_indices: a new sequence wherever the position does
    # not advance by one.
    pos = position_ids.reshape(-1, seq).expand(batch, seq)
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    sequence = (step != 1).cumsum(-1)
    if bool((sequence[:, -1] == 0).all()):  # one sequence per row (a host sync, as in HF)
        return None
    causal = torch.ones(seq, seq, dtype=torch.bool, device=pos.device).tril()
    return causal & (sequence[:, None, :, None] == sequence[:, None, None, :])


def _attention(allowed: Tensor | None, dropout: float) -> Callable:
    """Causal SDPA, or SDPA under ``allowed`` with rows that allow no key giving 0 (as HF)."""
    nonempty = None if allowed is None else allowed.any(-1, keepdim=True)
    if allowed is not None:
        # A row without keys attends to itself (finite), then is zeroed.
        eye = torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
        allowed = allowed | (eye & ~nonempty)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        # K / V heads repeated (HF's repeat_kv): SDPA with a mask and enable_gqa falls back to
        # its math kernel.
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout)
        return y * nonempty

    return attend


def _fused_forward(self, patch, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                   use_cache, kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    c = patch.config
    m = self.model
    ref = input_ids if input_ids is not None else inputs_embeds
    batch, seq = ref.shape[:2]
    tokens = batch * seq
    device = ref.device
    dtype, _ = _compute_dtype(self, device)
    shift_labels = kwargs.get("shift_labels")
    if labels.shape != (batch, seq):
        raise ValueError(f"patch_hf: labels must be (B, S) = ({batch}, {seq}), got "
                         f"{tuple(labels.shape)}")
    # HF's shift: position s predicts labels[:, s + 1]; the last position predicts nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=_IGNORE) if shift_labels is None else shift_labels
    if targets.shape != (batch, seq):
        raise ValueError(f"patch_hf: shift_labels must be (B, S) = ({batch}, {seq}), got "
                         f"{tuple(targets.shape)}")
    targets = targets.to(device=device, dtype=torch.int64).reshape(tokens).contiguous()
    dropout = float(getattr(self.config, "attention_dropout", 0.0))
    attention = _attention(_attention_mask(attention_mask, position_ids, use_cache, batch, seq),
                           dropout)
    pos = positions(position_ids, batch, seq, device)
    table = patch.rope_table(device)
    cast = functools.partial(_cast, dtype)

    with torch.autocast(device.type, enabled=False):
        x = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = x.reshape(tokens, c.hidden_size).to(dtype).contiguous()
        with _RebuiltOnBackward() as rebuilt:
            h, r = ops.rmsnorm_stats(x, rebuilt.derive(cast, m.layers[0].input_layernorm.weight),
                                     c.rms_norm_eps)
        fp8 = patch.precision == "fp8"
        persist = fp8 and _keeps_fp8_weights(self, patch.fp8_weight_cache)
        hs = tuple(torch.ops.coda.fp8_quantize_rows(h)[:2]) if fp8 else (h,)  # one cast pass
        for i, layer in enumerate(m.layers):
            last = i + 1 == len(m.layers)
            gamma_next = m.norm.weight if last else m.layers[i + 1].input_layernorm.weight
            cache = patch.fp8_cache(i, persist) if fp8 else None
            with _RebuiltOnBackward() as rebuilt:
                run = functools.partial(_layer, c, dtype, layer, gamma_next, pos, table, batch,
                                        attention, rebuilt, cache, patch.fp8_recompute_a,
                                        patch.fp8_z, last)
                if layer.gradient_checkpointing:
                    x, r, *hs = layer._gradient_checkpointing_func(run, x, r, *hs)
                else:
                    x, r, *hs = run(x, r, *hs)
        (h,) = hs
        n_items = kwargs.get("num_items_in_batch")
        with _RebuiltOnBackward() as rebuilt:
            loss, _ = ops.lm_head_loss(
                x, rebuilt.derive(cast, m.norm.weight), rebuilt.derive(cast, self.lm_head.weight),
                h, r, targets, _IGNORE, "mean" if n_items is None else "sum", 0.0)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if isinstance(n_items, Tensor) else n_items)
    out = CausalLMOutputWithPast(loss=loss, logits=None)
    return out.to_tuple() if kwargs.get("return_dict") is False else out
