"""A transformers ``LlamaForCausalLM`` patched in place to train through coda's fused ops.

:func:`patch_hf` replaces the model instance's ``forward`` and nothing else: the parameters, their
names and layouts, the config and the module tree stay Hugging Face's. So the model is still a
``PreTrainedModel``: ``Trainer`` trains it, ``save_pretrained`` writes the stock checkpoint that
stock transformers reloads, ``generate`` works, and optimizer state keyed by parameter carries over.

A call with ``labels`` (and, as in HF, optionally ``shift_labels``) runs the decoder on coda's
block ops and the loss on its fused LM head, which never holds the logits: the output has the loss
and ``logits=None``. Every other call (no labels, a KV cache, ``output_attentions`` /
``output_hidden_states``) runs the model's own forward, unchanged. So do calls coda cannot run,
with a warning once per reason: a projection that is no longer a plain ``nn.Linear`` (e.g. a PEFT
adapter), an unsupported dtype or device, a mask that is not 2-D, or keyword arguments the fused
path does not know.

The fused path rebuilds coda's weight layouts from the HF parameters on every forward: Q and K
rows permuted so that RoPE pairs are adjacent, ``[Q | K | V]`` packed, gate and up rows
interleaved, and each weight cast to the compute dtype (bfloat16 under CUDA autocast). That costs
one copy of each weight per forward and, for the backward, one more: autograd saves the rebuilt
weights as the recipe to rebuild them (a saved-tensor hook), not as tensors, so the patched model
holds no second copy of its weights between forward and backward.

Attention is PyTorch's scaled-dot-product attention, causal, with the 2-D ``attention_mask``
(1 = token, 0 = padding) applied to the keys; each padded position attends to itself only, which
keeps its row finite. Its output is therefore not HF's: with left padding, make the target of a
padded position ignored too (``shift_labels``), or pad on the right, where the shift does it.
Gradient checkpointing (``gradient_checkpointing_enable``) checkpoints each decoder layer, as HF
does.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..convert import config_from_hf, interleave_gate_up, rope_half_to_adjacent_view
from ..nn import LlamaConfig, decoder_layer, positions

__all__ = ["patch_hf", "unpatch_hf", "is_patched"]

_ATTR = "_coda_patch"
# The keyword arguments the fused path reads (Trainer passes num_items_in_batch; shift_labels
# and return_dict as in HF's forward). Any other keyword sends the call to HF's forward.
_KNOWN_KWARGS = frozenset({"num_items_in_batch", "shift_labels", "return_dict"})
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")
_IGNORE = -100  # HF's causal-LM loss ignores this label


@dataclass
class _Patch:
    config: LlamaConfig
    tables: dict[torch.device, Tensor] = field(default_factory=dict)  # RoPE table per device
    warned: set[str] = field(default_factory=set)

    def rope_table(self, device: torch.device) -> Tensor:
        table = self.tables.get(device)
        if table is None:
            c = self.config
            inv = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
            table = ops.rope_table(inv, c.num_heads, c.num_kv_heads, c.head_dim).to(device)
            self.tables[device] = table
        return table


def is_patched(model: nn.Module) -> bool:
    return isinstance(getattr(model, _ATTR, None), _Patch)


def patch_hf(model: nn.Module) -> nn.Module:
    """Make ``model`` (a transformers ``LlamaForCausalLM``) train through coda, in place; returns
    it. Raises ``NotImplementedError`` for configurations coda does not run (biases, another
    activation or RoPE type) and ``TypeError`` for a model whose projections are not plain
    ``nn.Linear`` modules."""
    import transformers

    if not isinstance(model, transformers.LlamaForCausalLM):
        raise TypeError(f"patch_hf: expected a transformers LlamaForCausalLM, got "
                        f"{type(model).__name__}")
    if is_patched(model):
        return model
    config = config_from_hf(model.config)
    problem = _foreign_module(model, config)
    if problem:
        raise TypeError(f"patch_hf: {problem}")
    setattr(model, _ATTR, _Patch(config))
    model.forward = types.MethodType(_forward, model)
    return model


def unpatch_hf(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_hf`: the model runs its own forward again."""
    if is_patched(model):
        del model.forward
        delattr(model, _ATTR)
    return model


def _foreign_module(model: nn.Module, c: LlamaConfig) -> str | None:
    """Why the fused path cannot read the model's weights, or None."""
    layers = model.model.layers
    if len(layers) != c.num_layers:
        return f"model.model.layers has {len(layers)} layers, the config {c.num_layers}"
    for i, layer in enumerate(layers):
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                m = getattr(getattr(layer, part), name)
                if type(m) is not nn.Linear or m.bias is not None:
                    return (f"model.layers.{i}.{part}.{name} is a {type(m).__name__}"
                            f"{' with a bias' if type(m) is nn.Linear else ''}; the fused path "
                            "needs a plain nn.Linear without bias (adapters such as PEFT's "
                            "change the weight it would read)")
    if type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None:
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear without bias"
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
    # The same signature as LlamaForCausalLM.forward: generate() and Trainer inspect it.
    patch: _Patch = getattr(self, _ATTR)
    shift_labels = kwargs.get("shift_labels")
    # HF's forward answers these itself: no loss to fuse, a KV cache, outputs only it forms, or
    # inputs it rejects (neither or both of input_ids and inputs_embeds).
    quiet = (labels is None or past_key_values is not None
             or any(kwargs.get(flag) for flag in _OUTPUT_FLAGS)
             or (input_ids is None) == (inputs_embeds is None))
    why = None
    if not quiet:
        why = _why_unfused(self, patch, input_ids, inputs_embeds, attention_mask, labels,
                           shift_labels, kwargs)
    if quiet or why:
        if why and why not in patch.warned:
            patch.warned.add(why)
            warnings.warn(f"coda.integrations.patch_hf: running the model's own forward: {why}",
                          stacklevel=2)
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    return _fused_forward(self, patch, input_ids, inputs_embeds, attention_mask, position_ids,
                          labels, shift_labels, kwargs)


def _why_unfused(model, patch, input_ids, inputs_embeds, attention_mask, labels, shift_labels,
                 kwargs) -> str | None:
    unknown = sorted(k for k in kwargs if k not in _KNOWN_KWARGS and k not in _OUTPUT_FLAGS)
    if unknown:
        return f"the fused path does not take the keyword arguments {unknown}"
    ref = input_ids if input_ids is not None else inputs_embeds
    if attention_mask is not None and attention_mask.dim() != 2:
        return f"attention_mask is {attention_mask.dim()}-D (the fused path takes a 2-D mask)"
    problem = _foreign_module(model, patch.config)
    if problem:
        return problem
    return _compute_dtype(model, ref.device)[1] or None


class _RebuiltOnBackward:
    """While active, autograd saves each weight registered by :meth:`derive` as the recipe to
    rebuild it from its parameters, not as a tensor. The derived tensors stay alive (and their
    addresses unique) until the context exits."""

    def __init__(self) -> None:
        self.recipes: dict[int, tuple[Tensor, Callable[[], Tensor], list, list[int]]] = {}
        self.active = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> _RebuiltOnBackward:
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
        if entry is None:
            return t
        derived, rebuild, params, versions = entry
        if t.shape != derived.shape or t.stride() != derived.stride() or t.dtype != derived.dtype:
            return t  # a view of a derived weight: saved as it is
        return _Recipe(rebuild, params, versions)

    @staticmethod
    def _unpack(saved: Any) -> Tensor:
        return saved.rebuild() if isinstance(saved, _Recipe) else saved


@dataclass
class _Recipe:
    build: Callable[[], Tensor]
    params: Sequence[Tensor]
    versions: Sequence[int]

    def rebuild(self) -> Tensor:
        if any(p._version != v for p, v in zip(self.params, self.versions)):
            raise RuntimeError("coda.integrations.patch_hf: a parameter was modified in place "
                               "between the forward and the backward")
        with torch.no_grad():
            return self.build()


def _qkv(c: LlamaConfig, dtype: torch.dtype, wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """HF's q/k/v weights -> coda's packed ``[Q | K | V]`` with RoPE pairs adjacent."""
    d = c.head_dim
    q = rope_half_to_adjacent_view(wq.to(dtype), c.num_heads, d).reshape(c.num_heads * d, -1)
    k = rope_half_to_adjacent_view(wk.to(dtype), c.num_kv_heads, d).reshape(c.num_kv_heads * d, -1)
    return torch.cat((q, k, wv.to(dtype)))


def _gate_up(dtype: torch.dtype, gate: Tensor, up: Tensor) -> Tensor:
    return interleave_gate_up(gate.to(dtype), up.to(dtype))


def _cast(dtype: torch.dtype, w: Tensor) -> Tensor:
    return w.to(dtype)


def _layer(c, dtype, layer, gamma_next, pos, table, batch, attention, rebuilt, x, h, r):
    a, f = layer.self_attn, layer.mlp
    cast = functools.partial(_cast, dtype)
    w = rebuilt.derive
    return decoder_layer(
        c, x, h, r, w(cast, layer.input_layernorm.weight),
        w(functools.partial(_qkv, c, dtype), a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
        w(cast, a.o_proj.weight), w(cast, layer.post_attention_layernorm.weight),
        w(functools.partial(_gate_up, dtype), f.gate_proj.weight, f.up_proj.weight),
        w(cast, f.down_proj.weight), pos, table, w(cast, gamma_next), batch, attention)


def _attention(mask: Tensor | None, batch: int, seq: int, dropout: float) -> Callable:
    """Causal SDPA; with a 2-D padding mask, keys at padding are masked (each position still
    attends to itself, so no row is empty)."""
    allowed = None
    if mask is not None:
        if mask.shape != (batch, seq):
            raise ValueError(f"patch_hf: attention_mask must be (B, S) = ({batch}, {seq}), got "
                             f"{tuple(mask.shape)}")
        ones = torch.ones(seq, seq, dtype=torch.bool, device=mask.device)
        causal = torch.tril(ones)
        allowed = (causal & mask.bool()[:, None, None, :]) | torch.eye(
            seq, dtype=torch.bool, device=mask.device)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        gqa = q.shape[1] != k.shape[1]
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                              enable_gqa=gqa)

    return attend


def _fused_forward(self, patch, input_ids, inputs_embeds, attention_mask, position_ids, labels,
                   shift_labels, kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    c = patch.config
    m = self.model
    ref = input_ids if input_ids is not None else inputs_embeds
    batch, seq = ref.shape[:2]
    tokens = batch * seq
    device = ref.device
    dtype, _ = _compute_dtype(self, device)
    if labels.shape != (batch, seq):
        raise ValueError(f"patch_hf: labels must be (B, S) = ({batch}, {seq}), got "
                         f"{tuple(labels.shape)}")
    # HF's shift: position s predicts labels[:, s + 1]; the last position predicts nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=_IGNORE) if shift_labels is None else shift_labels
    if targets.shape != (batch, seq):
        raise ValueError(f"patch_hf: shift_labels must be (B, S) = ({batch}, {seq}), got "
                         f"{tuple(targets.shape)}")
    targets = targets.to(device=device, dtype=torch.int64).reshape(tokens).contiguous()
    dropout = float(getattr(self.config, "attention_dropout", 0.0)) if self.training else 0.0
    attention = _attention(attention_mask, batch, seq, dropout)
    pos = positions(position_ids, batch, seq, device)
    table = patch.rope_table(device)
    cast = functools.partial(_cast, dtype)
    checkpointing = self.training and any(l.gradient_checkpointing for l in m.layers)

    with torch.autocast(device.type, enabled=False):
        x = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = x.reshape(tokens, c.hidden_size).to(dtype).contiguous()
        with _RebuiltOnBackward() as rebuilt:
            h, r = ops.rmsnorm_stats(x, rebuilt.derive(cast, m.layers[0].input_layernorm.weight),
                                     c.rms_norm_eps)
        for i, layer in enumerate(m.layers):
            gamma_next = (m.layers[i + 1].input_layernorm.weight if i + 1 < len(m.layers)
                          else m.norm.weight)
            with _RebuiltOnBackward() as rebuilt:
                run = functools.partial(_layer, c, dtype, layer, gamma_next, pos, table, batch,
                                        attention, rebuilt)
                if checkpointing and layer.gradient_checkpointing:
                    x, h, r = layer._gradient_checkpointing_func(run, x, h, r)
                else:
                    x, h, r = run(x, h, r)
        n_items = kwargs.get("num_items_in_batch")
        with _RebuiltOnBackward() as rebuilt:
            loss, _ = ops.lm_head_loss(
                x, rebuilt.derive(cast, m.norm.weight), rebuilt.derive(cast, self.lm_head.weight),
                h, r, targets, _IGNORE, "mean" if n_items is None else "sum", 0.0)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if isinstance(n_items, Tensor) else n_items)
    out = CausalLMOutputWithPast(loss=loss, logits=None)
    return out.to_tuple() if kwargs.get("return_dict") is False else out
