"""A LLaMA causal LM built from the fused ``torch.ops.coda`` ops.

The composition is the "decoder layer" sketch of docs/torch-ops.md: the op that produces the
residual stream ``x`` also returns the caches ``(h, r)`` of the *next* RMSNorm, and the op that
consumes that norm takes ``x``, its ``gamma`` and the caches. So layer ``l``'s ``mlp`` gets
``gamma_attn[l + 1]`` as ``gamma_next`` (``gamma_final`` after the last layer).

Where the parameters live follows from that: a layer's attention-norm weight ``gamma_attn[l]`` is
applied by the *previous* layer's last GEMM (or the model, for layer 0) and differentiated by the
layer's own QKV op, so it belongs to neither layer alone: the model holds the ``gamma_attn``
ParameterList. A layer holds only what it alone uses (``w_qkv``, ``w_o``, ``gamma_ffn``, ``w_gu``,
``w_down``). This is also what makes per-layer FSDP2 units (``fully_shard(layer)``) work: no layer
reads another unit's parameters.

Weight layouts differ from Hugging Face's (see ``coda.convert``): ``w_qkv`` is ``[Q | K | V]``
packed with RoPE pairs adjacent inside each Q/K head, and ``w_gu`` interleaves gate and up rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import ops

__all__ = ["LlamaConfig", "CodaDecoderLayer", "CodaLlamaForCausalLM", "Fp8WeightCache",
           "NormLMHeadLoss", "decoder_layer", "decoder_layer_fp8", "positions", "sdpa_causal"]

PRECISIONS = ("bf16", "fp8")

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# attention(q, k, v) with q (B, Hq, S, d) and k, v (B, Hkv, S, d) -> (B, Hq, S, d)
Attention = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class LlamaConfig:
    """Shape and hyper-parameters of a LLaMA model.

    ``num_kv_heads`` defaults to ``num_heads`` and ``head_dim`` to ``hidden_size // num_heads``.
    ``rope_scaling`` is ``None`` or a Hugging Face style LLaMA-3.1 dict with keys ``factor``,
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # a bias on the Q, K and V projections (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # an RMSNorm over every Q and K head before RoPE (Qwen3)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if self.qkv_bias and self.qk_norm:
            raise ValueError("LlamaConfig: qkv_bias together with qk_norm is not supported")
        if self.rope_scaling is not None:
            # Normalized to the four LLaMA-3.1 keys so configs compare equal however they were
            # spelled (e.g. with or without HF's "rope_type": "llama3").
            s = dict(self.rope_scaling)
            rope_type = s.pop("rope_type", s.pop("type", "llama3"))
            if rope_type != "llama3":
                raise ValueError(f"LlamaConfig: only 'llama3' rope_scaling is supported, "
                                 f"got {rope_type!r}")
            missing = [k for k in _LLAMA3_KEYS if k not in s]
            if missing or len(s) != len(_LLAMA3_KEYS):
                raise ValueError(f"LlamaConfig: rope_scaling needs exactly the keys "
                                 f"{list(_LLAMA3_KEYS)}, got {sorted(s)}")
            self.rope_scaling = {k: s[k] for k in _LLAMA3_KEYS}

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def sdpa_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Default attention: causal SDPA over each whole row, with grouped K/V heads (GQA)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )


def positions(position_ids: Tensor | None, batch: int, seq: int, device) -> Tensor:
    """The int32 ``(B * S,)`` positions the RoPE op takes: ``arange(S)`` per sequence, or
    ``position_ids`` given as ``(S,)``, ``(1, S)`` or ``(B, S)``."""
    if position_ids is None:
        pos = torch.arange(seq, dtype=torch.int32, device=device)
    else:
        if position_ids.shape not in ((seq,), (batch, seq), (1, seq)):
            raise ValueError(f"position_ids must be (S,), (1, S) or (B, S) = ({batch}, {seq}), "
                             f"got {tuple(position_ids.shape)}")
        pos = position_ids.to(device=device, dtype=torch.int32)
    return pos.expand(batch, seq).reshape(batch * seq).contiguous()


def _attention(c: LlamaConfig, qkv: Tensor, batch: int, attention: Attention) -> Tensor:
    """The attention of packed ``qkv (M, W)``: ``(M, Hq * d)``, contiguous."""
    M = qkv.shape[0]
    seq = M // batch
    # (M, W) -> (B, S, heads, d) -> per-part (B, heads, S, d) views; no copy needed. Split, not
    # sliced: split's backward concatenates the three gradients in one pass, where each slice's
    # would be a zero-filled tensor of qkv's size with its part copied in, the three then summed
    # (three fills, three copies and two additions over qkv's bytes in every layer's backward).
    qkv = qkv.view(batch, seq, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([c.num_heads, c.num_kv_heads,
                                                        c.num_kv_heads], dim=2))
    y = attention(q, k, v)
    if y.shape != q.shape:
        raise ValueError(f"attention must return {tuple(q.shape)} (B, Hq, S, d), "
                         f"got {tuple(y.shape)}")
    return y.transpose(1, 2).reshape(M, c.num_heads * c.head_dim).contiguous()


def decoder_layer(c: LlamaConfig, x: Tensor, h: Tensor, r: Tensor, gamma: Tensor, w_qkv: Tensor,
                  w_o: Tensor, gamma_ffn: Tensor, w_gu: Tensor, w_down: Tensor, pos: Tensor,
                  rope_table: Tensor, gamma_next: Tensor, batch: int, attention: Attention,
                  b_qkv: Tensor | None = None, q_gamma: Tensor | None = None,
                  k_gamma: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder layer from the fused ops, on weights in coda's layouts: ``x (M, H)`` with its
    caches ``(h, r)`` for ``gamma`` (the layer's attention norm) -> ``(x, h, r)`` of the layer
    output, the caches being for ``gamma_next``. ``b_qkv``: the Q/K/V bias in ``w_qkv``'s row
    order, or None; ``q_gamma, k_gamma``: the QK-norm weights (with ``c.qk_norm``), in the
    adjacent-pair order of a head's rows."""
    if c.qk_norm:
        qkv = ops.norm_qkv_qk_norm(x, gamma, w_qkv, h, r, pos, rope_table, q_gamma, k_gamma,
                                   c.num_heads, c.num_kv_heads, c.rms_norm_eps)
    else:
        qkv = ops.norm_qkv(x, gamma, w_qkv, h, r, pos, rope_table, b_qkv)
    y = _attention(c, qkv, batch, attention)
    x1, h1, r1 = ops.out_proj_residual_norm(y, w_o, x, gamma_ffn, c.rms_norm_eps)
    x2, h2, r2, _ = ops.mlp(x1, gamma_ffn, w_gu, w_down, h1, r1, gamma_next, c.rms_norm_eps)
    return x2, h2, r2


def decoder_layer_fp8(c: LlamaConfig, x: Tensor, h: tuple[Tensor, Tensor], r: Tensor,
                      gamma: Tensor, weights: Mapping[str, tuple[Tensor, Sequence[Tensor]]],
                      gamma_ffn: Tensor, pos: Tensor, rope_table: Tensor, gamma_next: Tensor,
                      batch: int, attention: Attention, last: bool, b_qkv: Tensor | None = None,
                      recompute_a: bool = False, q_gamma: Tensor | None = None,
                      k_gamma: Tensor | None = None, recast_w_t: bool = False,
                      fp8_z: bool = False
                      ) -> tuple[Tensor, tuple[Tensor, Tensor] | Tensor, Tensor]:
    """One decoder layer in blockwise FP8 (docs/math.md §6): ``x (M, H)`` with its norm's caches,
    ``h`` in 1x128 blocks (codes, scales: ``fp8_quantize_rows(h)[:2]``) and ``r`` -> ``(x, h, r)``
    of the layer output for ``gamma_next``; with ``last`` the output's ``h`` is the
    activation-dtype tensor the LM head reads (it stays in bf16). ``weights`` maps each of
    FP8_PROJECTIONS to ``(weight, its FP8 operands)``: the weight in coda's layout (what the
    gradient is for) and its FP8 operands (codes, scales, codes_t, scales_t), e.g. from an
    Fp8WeightCache (wᵀ's as None: the backward transposes the codes). ``recompute_a``: the
    backward makes the down-projection's weight-gradient operand (a's transposed copy) from z
    instead of keeping F2's (fp8_mlp). ``q_gamma, k_gamma``: the QK-norm weights (with
    ``c.qk_norm``), as decoder_layer takes them. ``recast_w_t`` (with wᵀ's operands None): the
    backward casts wᵀ's codes from the weight instead of transposing w's, which the forward then
    keeps none of: for weights cast in every forward (no Fp8WeightCache kept, FSDP2), so that no
    FP8 copy of a weight lives from a layer's forward to its backward. ``fp8_z``: the MLP's
    pre-activation z is saved for the backward in FP8 (1x128 blocks of its bf16 values) instead
    of bf16 (fp8_mlp)."""
    coda = torch.ops.coda
    (w_qkv, q_qkv), (w_o, q_o), (w_gu, q_gu), (w_down, q_down) = (
        weights[n] for n in FP8_PROJECTIONS)
    copies = torch.is_grad_enabled()  # the weight gradients' operands: none without a backward
    if c.qk_norm:
        qkv, _ = coda.fp8_norm_qkv_qk_norm(x, gamma, w_qkv, *q_qkv, *h, r, pos, rope_table, q_gamma,
                                           k_gamma, c.num_heads, c.num_kv_heads, c.rms_norm_eps,
                                           recast_w_t)
    else:
        qkv = coda.fp8_norm_qkv(x, gamma, w_qkv, *q_qkv, *h, r, pos, rope_table, b_qkv,
                                recast_w_t)
    y = _attention(c, qkv, batch, attention)
    # recompute_y: the out-projection's backward keeps y, which the attention's backward keeps
    # anyway, and makes y's transposed copy (dW_o's operand) from it: A + A/32 bytes a token less
    # than keeping the copy, for one more read of y.
    x1, h1, h1s, r1, _, _ = coda.fp8_out_proj_residual_norm(y, w_o, *q_o, x, gamma_ffn,
                                                            c.rms_norm_eps, copies, True,
                                                            recast_w_t)
    x2, h2, h2s, r2, *_ = coda.fp8_mlp(x1, gamma_ffn, w_gu, *q_gu, w_down, *q_down, h1, h1s, r1,
                                       gamma_next, c.rms_norm_eps, last, copies, recompute_a,
                                       recast_w_t, fp8_z)
    return x2, (h2 if last else (h2, h2s)), r2


def _check_precision(config: LlamaConfig, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        c = config
        for what, width in (("hidden_size", c.hidden_size),
                            ("num_heads * head_dim", c.num_heads * c.head_dim),
                            ("(num_heads + 2 * num_kv_heads) * head_dim", c.qkv_width),
                            ("intermediate_size", c.intermediate_size)):
            if width % 16:
                raise ValueError(f"precision='fp8' needs {what} a multiple of 16 (16-byte rows "
                                 f"of e4m3 codes), got {width}")


def _under_fsdp2(model: nn.Module) -> bool:
    """Whether fully_shard manages the model or any of its submodules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without torch.distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _keeps_fp8_weights(model: nn.Module, setting: bool | None) -> bool:
    """Whether ``model`` keeps its FP8 weights between forwards: ``setting`` (its
    fp8_weight_cache), or where None, unless fully_shard manages the model (its gathered weights
    come back at the same address with the same version: a kept copy would go stale)."""
    return not _under_fsdp2(model) if setting is None else bool(setting)


# The projection weights the FP8 path runs in FP8 (each layer's Fp8WeightCache entries).
FP8_PROJECTIONS = ("w_qkv", "w_o", "w_gu", "w_down")


def _quantize_weight(w: Tensor) -> tuple[Tensor | None, ...]:
    """w's FP8 operands as the FP8 block ops take them: the 128x128 codes and scales of w, and
    None for wᵀ's: each op's backward transposes the codes (fp8_transpose_blocks, bit for bit
    the cast of wᵀ) when it needs them, so no layer holds wᵀ's codes between its forward and its
    backward (1 byte a parameter, for one more pass over the codes in each backward)."""
    with torch.no_grad():
        codes, scales, _, _ = torch.ops.coda.fp8_quantize_blocks(w.detach(), True, False)
    return codes, scales, None, None


# Optimizer steps per parameter, counted by a global step post-hook: the fused AdamW / Adam / SGD
# kernels (`fused=True`, TorchTitan's default) update the parameters in place without moving
# their version counters, so a version counter alone misses those steps (Fp8WeightCache keys on
# both). Weak keys: an entry goes with its parameter. `_all_optimizer_steps`: every optimizer's
# steps together, the key of a weight that trains but that no optimizer holds (see _key).
_optimizer_steps = WeakIdKeyDictionary()
_all_optimizer_steps = 0


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _all_optimizer_steps
    _all_optimizer_steps += 1
    for group in optimizer.param_groups:
        for p in group["params"]:
            _optimizer_steps[p] = _optimizer_steps.get(p, 0) + 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _storage_refs(tensors: Sequence[Tensor]) -> tuple:
    """Weak references to the tensors' storages: a key's address (data_ptr) can come back in a new
    storage once the old one is freed (a parameter's .data replaced, .to() round trips, a tensor
    made anew each forward); a storage that died or was replaced tells the entry apart."""
    return tuple(weakref.ref(t.untyped_storage()) for t in tensors)


def _same_storages(refs: tuple, tensors: Sequence[Tensor]) -> bool:
    return len(refs) == len(tensors) and all(
        r() is t.untyped_storage() for r, t in zip(refs, tensors))


def _same_layout(a: Tensor | None, b: Tensor | None) -> bool:
    """Both absent, or both tensors of one shape, strides, dtype and device."""
    if a is None or b is None:
        return a is b
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


class Fp8WeightCache:
    """Each weight's FP8 operands (the 128x128 codes and scales of ``w``; ``wᵀ``'s left to the
    backward, see _quantize_weight), remade only when the weight changed: after a step of any
    ``torch.optim`` optimizer holding it (counted by a step post-hook: fused optimizer kernels
    leave the version counter alone) or any other in-place update (its version counter moves),
    so a weight is quantized once per step, not once per forward or micro-batch; a weight that
    trains but that no optimizer holds (a sharding wrapper's gathered copy, a parametrization's
    output) after every step of any optimizer. Not module state (no state_dict entries).
    Writes into a weight's storage through ``.data`` (``w.data.mul_(...)``) do not move the
    version counter: after one, call ``refresh()`` (or the model's ``refresh_fp8_weights()``).
    A new storage is seen (``.data`` replaced, ``.to()``): each entry holds a weak reference to
    the storage it was made from, since a freed storage's address can come back. A captured CUDA
    graph keeps reading the tensors it was captured with, and a replay runs no Python to see a
    weight change: ``refresh()`` writes the new operands into those same tensors, so call it
    after each update of the weights between replays (a version change seen by an eager forward
    makes new tensors instead, no copy: run every step through the graph then, or the graph keeps
    the tensors the eager step replaced).

    Under torch.compile the weights are cast inside the compiled graph in every forward (Dynamo
    cannot guard on a version counter), as torchao's float8 casts them: once per optimizer step
    when each step has one micro-batch, and a CUDA graph of it replays with the current weights.
    With ``persist`` off (the model under FSDP2, or ``fp8_weight_cache=False``) nothing is kept:
    every forward quantizes the weights FSDP2 has just gathered, and the layers run with
    ``recast_w_t`` (each backward casts wᵀ from the weight), so no FP8 copy of a weight outlives
    the op that made it. Under FSDP2 the optimizer updates the shards, the gathered weight lands
    at the same address without a version change, and a kept entry would be stale; it would also
    hold every layer's full weights in FP8 on every rank."""

    def __init__(self) -> None:
        # name -> (key, operands, weak references to the storages the key was taken from)
        self._entries: dict[str, tuple[tuple, tuple[Tensor, ...], tuple]] = {}
        self.persist = True

    def get(self, name: str, w: Tensor, sources: Sequence[Tensor] = ()) -> tuple[Tensor, ...]:
        """``w``'s FP8 operands. ``sources``: the parameters ``w`` is built from, when it is not a
        parameter itself but remade from them every forward (a patched Hugging Face model packs
        its q / k / v and gate / up weights so); the entry is then kept while they are
        unchanged."""
        if torch.compiler.is_compiling():  # no guard on a version counter: cast in the graph
            return _quantize_weight(w)
        if not self.persist:
            self._entries.clear()
            return _quantize_weight(w)
        held = tuple(sources) if sources else (w,)
        key = tuple(self._key(t) for t in sources) + (w.dtype,) if sources else self._key(w)
        entry = self._entries.get(name)
        if entry is None or entry[0] != key or not _same_storages(entry[2], held):
            entry = self._entries[name] = (key, _quantize_weight(w), _storage_refs(held))
        return entry[1]

    def refresh(self, name: str, w: Tensor) -> None:
        """Quantizes ``w`` now into ``name``'s entry: into the entry's own tensors when it has
        ones of the same shapes, strides, dtypes and device (in place, so a captured CUDA graph
        reads the new operands), else a new entry. Nothing without ``persist`` (every forward
        quantizes then). Call it after a step's backward: a forward saved these tensors for its
        backward, which an in-place write before it makes fail (autograd's version check)."""
        if not self.persist:
            return
        new = _quantize_weight(w)
        entry = self._entries.get(name)
        if entry is not None and all(_same_layout(a, b) for a, b in zip(entry[1], new)):
            with torch.no_grad():
                for old, t in zip(entry[1], new):
                    if old is not None:
                        old.copy_(t)
            new = entry[1]
        self._entries[name] = (self._key(w), new, _storage_refs((w,)))

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def _key(w: Tensor) -> tuple:
        steps = _optimizer_steps.get(w)
        if steps is None and w.requires_grad:
            # A weight that trains but that no optimizer holds is a copy or a function of the
            # parameters the optimizer updates: FSDP's gathered weights (FSDP1, or FSDP2 on a
            # parent module), a parametrization's output, ZeRO's 16-bit copies. Each can come back
            # changed at the same address with the same version, so it is remade after every
            # optimizer step.
            steps = ("any optimizer", _all_optimizer_steps)
        return (w._version, steps or 0, w.data_ptr(), w.dtype, w.device)


class CodaDecoderLayer(nn.Module):
    """One LLaMA decoder layer's parameters and its forward composition."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        c = config
        kw = {"device": device, "dtype": dtype}
        self.config = c
        self.w_qkv = nn.Parameter(torch.empty(c.qkv_width, c.hidden_size, **kw))
        # Q/K/V bias in w_qkv's row order (RoPE pairs adjacent); None without config.qkv_bias.
        self.b_qkv = nn.Parameter(torch.empty(c.qkv_width, **kw)) if c.qkv_bias else None
        # QK-norm weights (config.qk_norm), in the adjacent-pair order of a head's rows.
        self.q_gamma = nn.Parameter(torch.empty(c.head_dim, **kw)) if c.qk_norm else None
        self.k_gamma = nn.Parameter(torch.empty(c.head_dim, **kw)) if c.qk_norm else None
        self.w_o = nn.Parameter(torch.empty(c.hidden_size, c.num_heads * c.head_dim, **kw))
        self.gamma_ffn = nn.Parameter(torch.empty(c.hidden_size, **kw))
        self.w_gu = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size, **kw))
        self.w_down = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size, **kw))
        self._fp8_cache = Fp8WeightCache()  # a plain object: not module state
        # "bf16" or "fp8" (decoder_layer_fp8); the model sets it on its layers, and
        # fp8_recompute_a and fp8_z (CodaLlamaForCausalLM's).
        self.precision = "bf16"
        self.fp8_recompute_a = False
        self.fp8_z = False
        self.reset_parameters()

    def fp8_weights(self) -> dict[str, tuple[Tensor, ...]]:
        """The projection weights' FP8 operands (Fp8WeightCache), by parameter name."""
        return {n: self._fp8_cache.get(n, getattr(self, n)) for n in FP8_PROJECTIONS}

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            self.gamma_ffn.fill_(1.0)
            for w in (self.w_qkv, self.w_o, self.w_gu, self.w_down):
                w.normal_(0.0, std)
            if self.b_qkv is not None:
                self.b_qkv.zero_()
            for g in (self.q_gamma, self.k_gamma):
                if g is not None:
                    g.fill_(1.0)

    def forward(
        self,
        x: Tensor,
        h: Tensor,
        r: Tensor,
        gamma: Tensor,
        pos: Tensor,
        rope_table: Tensor,
        gamma_next: Tensor,
        batch: int,
        attention: Attention,
        last: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``x (M, H)`` with its caches ``(h, r)`` for ``gamma`` (this layer's attention norm) ->
        ``(x, h, r)`` of the layer output, the caches being for ``gamma_next``. With
        ``precision == "fp8"``, ``h`` is in 1x128 blocks (codes, scales) and ``last`` says the
        output's ``h`` feeds the LM head (decoder_layer_fp8). Called as a module, so module hooks
        (FSDP2's unshard, checkpoint wrappers) run around either precision."""
        if self.precision == "fp8":
            weights = {n: (getattr(self, n), self._fp8_cache.get(n, getattr(self, n)))
                       for n in FP8_PROJECTIONS}
            return decoder_layer_fp8(self.config, x, h, r, gamma, weights, self.gamma_ffn, pos,
                                     rope_table, gamma_next, batch, attention, last, self.b_qkv,
                                     self.fp8_recompute_a, q_gamma=self.q_gamma,
                                     k_gamma=self.k_gamma,
                                     recast_w_t=not self._fp8_cache.persist, fp8_z=self.fp8_z)
        return decoder_layer(self.config, x, h, r, gamma, self.w_qkv, self.w_o, self.gamma_ffn,
                             self.w_gu, self.w_down, pos, rope_table, gamma_next, batch, attention,
                             self.b_qkv, self.q_gamma, self.k_gamma)


class CodaLlamaForCausalLM(nn.Module):
    """LLaMA causal LM whose blocks, final norm and LM-head loss are the fused coda ops.

    Parameters: ``embed_tokens.weight (V, H)``; ``gamma_attn.{l}`` (layer l's attention norm,
    held by the model: see the module docstring); per layer ``w_qkv`` (packed
    ``[Q | K | V]``, RoPE pairs adjacent), ``b_qkv`` (with ``config.qkv_bias``), ``q_gamma`` and
    ``k_gamma`` (with ``config.qk_norm``), ``w_o``,
    ``gamma_ffn``, ``w_gu`` (gate/up interleaved), ``w_down``; ``gamma_final`` and ``w_vocab (V, H)``, which is the same Parameter as the
    embedding weight when ``config.tie_word_embeddings``. The RoPE frequency table is a
    non-persistent buffer (derived from the config).

    ``precision="fp8"`` runs every projection GEMM of the layers in blockwise FP8 (docs/math.md
    §6: activations and gradients in 1x128 blocks, weights in 128x128 blocks, each weight
    quantized once per optimizer step); the parameters, the residual stream, the norms, the
    embedding and the LM head keep their dtype. ``precision`` is not part of the state dict:
    the same checkpoint loads into either, and setting it later switches every layer.
    ``fp8_weight_cache``: see Fp8WeightCache (None: kept unless fully_shard manages the model;
    False: nothing FP8 of a weight is kept, not even from a layer's forward to its backward,
    which casts wᵀ itself: by arithmetic 1 byte a projection parameter less at the peak than the
    kept cache, for a second cast of each weight per micro-batch).
    ``fp8_recompute_a`` (False): the backward makes the down-projection's weight-gradient operand,
    a's 128x1 copy, from the saved z instead of keeping the forward's: I + I/32 bytes fewer kept
    per token and layer (at the 8B shape 14.8 kB, more than FP8 saves on y), for one more pass
    over z in the backward. The result differs from the kept copy's by a's rounding only (a from
    z as rounded to the activation dtype, as the bf16 path's backward makes it).
    ``fp8_z`` (False): the MLP's pre-activation z (M, 2I), which the backward reads, is saved in
    FP8 (the bf16 z quantized in 1x128 blocks by F2's epilogue) instead of bf16: 2I - 2I/32 bytes
    fewer kept per token and layer (at the 8B shape 27.6 kB, the largest saved tensor). The
    backward then differentiates SwiGLU at the decoded z (its rounding to e4m3, as DeepSeek-V3
    caches the SwiGLU input in FP8); a's copy, when recomputed, comes from the decoded z too.
    """

    def __init__(self, config: LlamaConfig, device=None, dtype=None,
                 precision: str = "bf16") -> None:
        super().__init__()
        _check_precision(config, precision)
        self._precision = precision
        self.config = config
        # FP8 weight operands kept between forwards (Fp8WeightCache): None decides by itself
        # (kept unless fully_shard manages the model); False for other sharding that gathers the
        # weights per forward (FSDP1, ZeRO-3, a fully_shard'ed parent), where a kept copy goes
        # stale; True to keep them regardless.
        self.fp8_weight_cache: bool | None = None
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            CodaDecoderLayer(config, **kw) for _ in range(config.num_layers)
        )
        self.gamma_attn = nn.ParameterList(
            nn.Parameter(torch.empty(config.hidden_size, **kw)) for _ in range(config.num_layers)
        )
        self.gamma_final = nn.Parameter(torch.empty(config.hidden_size, **kw))
        if config.tie_word_embeddings:
            self.w_vocab = self.embed_tokens.weight
        else:
            self.w_vocab = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw))
        self.precision = precision  # (the property: the layers too)
        self.fp8_recompute_a = False
        self.fp8_z = False
        self.register_buffer("rope_table", self._build_rope_table(device), persistent=False)
        self.reset_parameters()

    @property
    def fp8_recompute_a(self) -> bool:
        """Whether FP8 layers remake a's copy in the backward (see the class docstring); setting
        it sets every layer's."""
        return self._fp8_recompute_a

    @fp8_recompute_a.setter
    def fp8_recompute_a(self, value: bool) -> None:
        self._fp8_recompute_a = bool(value)
        for layer in self.layers:
            layer.fp8_recompute_a = self._fp8_recompute_a

    @property
    def fp8_z(self) -> bool:
        """Whether FP8 layers save z in FP8 (see the class docstring); setting it sets every
        layer's."""
        return self._fp8_z

    @fp8_z.setter
    def fp8_z(self, value: bool) -> None:
        self._fp8_z = bool(value)
        for layer in self.layers:
            layer.fp8_z = self._fp8_z

    @property
    def precision(self) -> str:
        """"bf16" or "fp8"; setting it sets every layer's."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        _check_precision(self.config, value)
        self._precision = value
        for layer in self.layers:
            layer.precision = value

    def _build_rope_table(self, device=None) -> Tensor:
        # Built on the host in float64 (the op's contract), then moved like any buffer.
        c = self.config
        inv_freq = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        table = ops.rope_table(inv_freq, c.num_heads, c.num_kv_heads, c.head_dim)
        return table if device is None else table.to(device)

    def reset_rope_table(self) -> None:
        """Rebuild the RoPE table on the parameters' device (e.g. after ``to_empty()`` from the
        meta device)."""
        self.rope_table = self._build_rope_table(self.gamma_final.device)

    def tie_weights(self) -> None:
        """Re-tie ``w_vocab`` to the embedding (conversions such as ``to_empty`` may untie it)."""
        if self.config.tie_word_embeddings:
            self.w_vocab = self.embed_tokens.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.normal_(0.0, std)
            self.gamma_final.fill_(1.0)
            for g in self.gamma_attn:
                g.fill_(1.0)
            if not self.config.tie_word_embeddings:
                self.w_vocab.normal_(0.0, std)
        for layer in self.layers:
            layer.reset_parameters(std)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention: Attention | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        z_loss: float = 0.0,
    ) -> Tensor:
        """Run the model on ``input_ids (B, S)``.

        With ``labels (B, S)`` returns the loss. As in Hugging Face, labels are *not* shifted by
        the caller: position ``s`` is trained to predict ``labels[:, s + 1]``. To keep all
        ``M = B * S`` rows in the fused LM-head op, the targets are ``labels[:, 1:]`` followed by
        ``ignore_index`` at the last position of each sequence. ``reduction='mean'`` averages over
        the non-ignored targets, ``'sum'`` sums, ``'none'`` returns ``(B, S)`` per-token losses
        (0 where ignored, and at each sequence's last position). ``z_loss`` adds
        ``z_loss * lse**2`` per counted token.

        Without labels returns the logits ``(B, S, V)`` (computed unfused; for inference/tests).

        ``position_ids`` (``(S,)`` or ``(B, S)``) default to ``arange(S)`` per sequence; they only
        feed RoPE. ``attention(q, k, v)`` gets ``q (B, Hq, S, d)``, ``k, v (B, Hkv, S, d)`` and
        must return ``(B, Hq, S, d)``; the default is causal SDPA over each row. Q and K come with
        their head dimension permuted (RoPE pairs adjacent), which does not change ``q . k``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, S), got {tuple(input_ids.shape)}")
        c = self.config
        batch, seq = input_ids.shape
        M = batch * seq
        attention = sdpa_causal if attention is None else attention
        pos = positions(position_ids, batch, seq, input_ids.device)

        x = F.embedding(input_ids.reshape(M), self.embed_tokens.weight)
        h, r = ops.rmsnorm_stats(x, self.gamma_attn[0], c.rms_norm_eps)
        if self.precision == "fp8":  # the first norm's h through one cast pass
            h = tuple(torch.ops.coda.fp8_quantize_rows(h)[:2])
            persist = _keeps_fp8_weights(self, self.fp8_weight_cache)
            for layer in self.layers:
                layer._fp8_cache.persist = persist
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            gamma_next = self.gamma_final if last else self.gamma_attn[i + 1]
            x, h, r = layer(x, h, r, self.gamma_attn[i], pos, self.rope_table, gamma_next,
                            batch, attention, last)

        if labels is None:
            normed = F.rms_norm(x, (c.hidden_size,), self.gamma_final, c.rms_norm_eps)
            return (normed @ self.w_vocab.t()).view(batch, seq, c.vocab_size)

        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(labels.shape)}")
        # Shift: row (b, s) predicts labels[b, s + 1]; the last row of each sequence is ignored.
        targets = F.pad(labels[:, 1:].to(torch.int64), (0, 1), value=ignore_index)
        loss, _ = ops.lm_head_loss(
            x, self.gamma_final, self.w_vocab, h, r, targets.reshape(M),
            ignore_index, reduction, z_loss,
        )
        return loss.view(batch, seq) if reduction == "none" else loss

    def refresh_fp8_weights(self) -> None:
        """Quantizes every layer's projection weights now, into the FP8 operands' own tensors
        (Fp8WeightCache.refresh). Needed after writes that do not move a parameter's version
        counter (through ``.data``, or ``load_state_dict`` into ``.data``), and between the
        replays of a captured CUDA graph whenever the weights changed; optimizer steps in eager
        training are seen on their own."""
        if self.precision != "fp8":
            return
        if _under_fsdp2(self):  # nothing kept: each forward quantizes the gathered weights
            for layer in self.layers:
                layer._fp8_cache.clear()
            return
        for layer in self.layers:
            for name in FP8_PROJECTIONS:
                layer._fp8_cache.refresh(name, getattr(layer, name))

    def extra_repr(self) -> str:
        return f"{self.config!r}, precision={self.precision!r}"



class NormLMHeadLoss(nn.Module):
    """Final RMSNorm + LM head + cross-entropy as one module, for models that are not built from
    coda layers: ``loss = CE(rmsnorm(hidden) @ weight.T, targets)`` without materializing all
    logits at once.

    ``forward(hidden (..., H), targets (...))``: targets are used as given (no shifting), with
    ``ignore_index`` marking tokens that do not count. Pass ``weight`` to use an outside LM-head
    weight (e.g. a tied embedding) instead of this module's own ``w_vocab``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, eps: float = 1e-5,
                 own_weight: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(hidden_size, **kw))
        self.w_vocab = (nn.Parameter(torch.empty(vocab_size, hidden_size, **kw).normal_(0, 0.02))
                        if own_weight else None)

    def forward(self, hidden: Tensor, targets: Tensor, weight: Tensor | None = None,
                ignore_index: int = -100, reduction: str = "mean",
                z_loss: float = 0.0) -> Tensor:
        weight = self.w_vocab if weight is None else weight
        if weight is None:
            raise ValueError("NormLMHeadLoss: built with own_weight=False, pass weight=")
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"NormLMHeadLoss: hidden {tuple(hidden.shape)} and targets "
                             f"{tuple(targets.shape)} disagree on the token dimensions")
        x = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        # The caches are not autograd edges; lm_head_loss differentiates x and gamma itself.
        h, r = ops.rmsnorm_stats(x, self.gamma, self.eps)
        loss, _ = ops.lm_head_loss(x, self.gamma, weight, h, r, targets.reshape(-1),
                                   ignore_index, reduction, z_loss)
        return loss.view(targets.shape) if reduction == "none" else loss
