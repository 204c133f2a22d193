"""coda in TorchTitan (0.3) as a model converter, turned on by configuration like float8.

TorchTitan 0.3 has no converter names: a converter is a ``ModelConfigConverter`` whose ``Config``
is listed in a model registry's ``converters`` (``model_registry("8B",
converters=[Float8LinearConverter.Config()])``), built and applied to the *model config tree*
before the model is built. :class:`CodaConverter` works the same way, so coda is turned on by
listing ``CodaConverter.Config()`` there (or with :func:`with_coda` on a whole ``Trainer.Config``,
or from the command line with ``--module coda.integrations.torchtitan --config llama3_8b``: this
module serves every ``llama3_*`` config of ``torchtitan.models.llama3.config_registry`` with coda
on).

The design: a block-level swap in the config tree, as float8 swaps ``Linear.Config``. Each
``Llama3TransformerBlock.Config`` becomes a :class:`CodaLlama3TransformerBlock` config whose
forward runs the block on coda's fused ops (RMSNorm statistics, norm + QKV GEMM + RoPE, output
projection + residual + RMSNorm, SwiGLU MLP + residual), with the layer's own TorchTitan attention
module (``inner_attention``: FlexAttention with its document masks, varlen, ...) between them. The
embedding, final norm, LM head, loss, weight tying and every block's signature stay TorchTitan's,
so its trainer, loss functions (including ``ChunkedLossWrapper``), FSDP units, activation
checkpointing, per-block compile and pipeline stages see the model they expect. The root config
becomes :class:`CodaLlama3Model` (a ``Llama3Model`` subclass) only to reject, at
``update_from_config``, the parallelisms the blocks do not run.

Why not replace the model by a ``CodaLlamaForCausalLM``: TorchTitan computes the loss outside the
model (``loss_fn(model(tokens), labels)``), always wraps each block as an FSDP unit (even on one
GPU) and splits blocks into pipeline stages; coda's model chains the RMSNorm caches across layers
(layer ``l`` reads layer ``l + 1``'s norm weight, another FSDP unit's parameter) and fuses the
loss. So each coda block here is self-contained: it recomputes its attention norm's statistics
(one extra pass over the residual stream per layer) and drops the next-norm caches its MLP op
writes.

Parameters are held in coda's layouts, so the fused ops read them without a copy (a per-forward
copy would be saved for the backward, one full copy of the weights held outside FSDP's sharding):
``attention.qkv_linear.w_qkv.weight`` packs ``[Q | K | V]`` (TorchTitan's fused ``wqkv`` groups
rows per KV head; RoPE already pairs adjacent dims in both) and ``feed_forward.w_gu.weight``
interleaves gate and up rows. State-dict hooks save and load them in the stock layout
(``qkv_linear.wq/wk/wv.weight``, ``feed_forward.w1/w3.weight``), as TorchTitan's own fused
modules do, so checkpoints (DCP, HF through the state-dict adapter) are interchangeable with
coda off. Optimizer state is keyed by parameter name, and the names differ on purpose: a run's
optimizer state does not load across coda on/off (its names are not there) rather than pairing
Adam moments with permuted rows. Initialization draws the same random numbers in the same order
as the stock model, so a seed gives the same initial weights with coda on or off.

``CodaConverter.Config(precision="fp8")`` runs every projection GEMM of the blocks in blockwise
FP8 (docs/math.md §6, coda's FP8 block ops): each forward casts the block's four weights (FSDP2
gathers them for every forward anyway, and a compiled block casts in its graph) and its attention
norm's h, and each backward casts the weights' transposes (``recast_w_t``: no FP8 copy of a
weight is kept from the forward); the embedding, final norm, LM head and loss stay TorchTitan's.
``fp8_recompute_a=True`` keeps the MLP's a for the down-projection's weight gradient as the
bf16 path does, not at all (its FP8 copy made from z in the backward: about I bytes less per
token and block; CodaLlamaForCausalLM.fp8_recompute_a).

Not supported, with an error naming the setting: MoE layers, QK norm, biases, RoPE other than
``ComplexRoPE`` with ``scaling`` ``"none"``/``"llama"``, partial rotary dims, RMSNorm without a
weight or eps, another block/attention/FFN type (e.g. ``tp_gemm_backend="dist_gemm"``), linears
already swapped by float8/MX/LoRA converters (list coda alone, or first; a converter listed after
it that swaps these modules is caught when the model is built), tensor and context parallelism and
the ``full_dtensor`` SPMD backend. Numerics: on CUDA the ops run in bfloat16 (TorchTitan's default
``mixed_precision_param``), on the CPU in float32/float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.models.common.attention import (
    BaseQKVLinear,
    FusedQKVLinear,
    GQAttention,
    QKVLinear,
)
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import ComplexRoPE
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from .. import ops
from ..nn import _quantize_weight
from ..nn import positions as _positions

__all__ = ["CodaConverter", "CodaLlama3Model", "CodaLlama3TransformerBlock", "CodaQKVLinear",
           "CodaFeedForward", "with_coda"]

_WHO = "coda (TorchTitan converter)"


def _unsupported(fqn: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{_WHO}: {fqn}: {what}")


def _replicated(t: Tensor) -> Tensor:
    """A sharded DTensor gathered to Replicate (so row slicing is local), else ``t``."""
    if isinstance(t, DTensor):
        return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
    return t


def _draw(init: Callable | None, like: Tensor, rows: int) -> Tensor:
    """A ``(rows, like.shape[1])`` tensor drawn by ``init`` (nn.Linear's default without one).
    On a sharded DTensor ``new_empty`` gives a Replicate one, as TorchTitan's fused inits use."""
    t = like.new_empty((rows, like.shape[1]))
    if init is None:
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    else:
        init(t)
    return t


# ---------------------------------------------------------------------------------------------
# Q/K/V in coda's packed [Q | K | V] layout


class CodaQKVLinear(BaseQKVLinear):
    """Q/K/V projection with one weight ``w_qkv.weight`` in coda's ``[Q | K | V]`` row order
    (RoPE pairs adjacent, as in TorchTitan). Saves and loads as stock ``wq/wk/wv.weight``.

    The config is a ``FusedQKVLinear.Config`` (its ``wqkv`` field describes ``w_qkv``), so
    TorchTitan's sharding setup treats it as the fused projection it is."""

    @dataclass(kw_only=True, slots=True)
    class Config(FusedQKVLinear.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.w_qkv = config.wqkv.build()
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._merge_on_load)

    def _rows(self) -> list[int]:
        d = self.head_dim
        return [self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """TorchTitan's contract: ``x (B, L, D)`` -> unrotated ``q, k, v (B, L, heads, d)``
        (the coda block does not call it; it reads ``w_qkv`` into the fused op)."""
        qkv = self.w_qkv(x).unflatten(-1, (-1, self.head_dim))
        return qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
        key = f"{prefix}w_qkv.weight"
        if key not in state_dict:
            return
        parts = _replicated(state_dict.pop(key)).split(module._rows(), dim=0)
        for name, part in zip(("wq", "wk", "wv"), parts):
            state_dict[f"{prefix}{name}.weight"] = part.contiguous()

    @staticmethod
    def _merge_on_load(module, state_dict, prefix, *args) -> None:
        keys = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
        if all(k in state_dict for k in keys):  # else a native w_qkv key (or missing: strict)
            parts = [_replicated(state_dict.pop(k)) for k in keys]
            state_dict[f"{prefix}w_qkv.weight"] = torch.cat(parts, dim=0)


def _packed_qkv_init(src: BaseQKVLinear.Config, n_heads: int, n_kv: int,
                     head_dim: int) -> dict[str, Callable] | None:
    """An init for the packed ``w_qkv`` drawing what the stock projection draws, in its order."""
    q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
    if isinstance(src, FusedQKVLinear.Config):
        fused = (src.wqkv.param_init or {}).get("weight")
        if fused is None:
            return None
        r = n_heads // n_kv + 2

        def init(t: Tensor) -> None:
            # The stock init fills its (n_kv, heads_per_kv + 2, d) grouped layout; repack it.
            grouped = t.new_empty(t.shape)
            fused(grouped)
            g = grouped.view(n_kv, r, head_dim, t.shape[1])
            packed = torch.cat([g[:, : r - 2].reshape(q_rows, -1), g[:, r - 2].reshape(kv_rows, -1),
                                g[:, r - 1].reshape(kv_rows, -1)], dim=0)
            with torch.no_grad():
                t.copy_(packed)
    else:
        q_init = (src.wq.param_init or {}).get("weight")
        kv_init = (src.wkv.param_init or {}).get("weight")
        if q_init is None and kv_init is None:
            return None

        def init(t: Tensor) -> None:  # QKVLinear builds wq, wk, wv in that order
            packed = torch.cat([_draw(q_init, t, q_rows), _draw(kv_init, t, kv_rows),
                                _draw(kv_init, t, kv_rows)], dim=0)
            with torch.no_grad():
                t.copy_(packed)
    return {"weight": init}


# ---------------------------------------------------------------------------------------------
# SwiGLU with gate and up interleaved


class CodaFeedForward(FeedForward):
    """SwiGLU FFN with gate and up in one weight ``w_gu.weight (2I, D)``, rows interleaved
    ``[g0, u0, g1, u1, ...]`` (coda's layout), and the stock ``w2``. Saves and loads as stock
    ``w1/w2/w3.weight``. The config is the stock ``FeedForward.Config`` (``w1``/``w3`` describe
    the two halves of ``w_gu``); initialization draws gate, down, up in the stock order."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def __init__(self, config: Config):
        Module.__init__(self)  # not FeedForward's: no separate w1 / w3
        gate, up = config.w1, config.w3
        self.hidden_dim = gate.out_features
        self.w_gu = Linear.Config(in_features=gate.in_features, out_features=2 * gate.out_features,
                                  sharding_config=gate.sharding_config).build()
        self.w2 = config.w2.build()
        self._gate_init = (gate.param_init or {}).get("weight")
        self._up_init = (up.param_init or {}).get("weight")
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._merge_on_load)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        w = self.w_gu.weight
        gate = _draw(self._gate_init, w, self.hidden_dim)
        self.w2.init_states(buffer_device=buffer_device)
        up = _draw(self._up_init, w, self.hidden_dim)
        with torch.no_grad():
            w.copy_(torch.stack((gate, up), dim=1).reshape(w.shape))

    def forward(self, x: Tensor) -> Tensor:
        gu = self.w_gu(x).unflatten(-1, (-1, 2))
        return self.w2(F.silu(gu[..., 0]) * gu[..., 1])

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
        key = f"{prefix}w_gu.weight"
        if key not in state_dict:
            return
        pairs = _replicated(state_dict.pop(key)).unflatten(0, (-1, 2))
        # In the stock order w1, w2, w3 (this module's entries are the last ones so far).
        down = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith(f"{prefix}w2.")}
        state_dict[f"{prefix}w1.weight"] = pairs[:, 0].contiguous()
        state_dict.update(down)
        state_dict[f"{prefix}w3.weight"] = pairs[:, 1].contiguous()

    @staticmethod
    def _merge_on_load(module, state_dict, prefix, *args) -> None:
        k1, k3 = f"{prefix}w1.weight", f"{prefix}w3.weight"
        if k1 in state_dict and k3 in state_dict:
            gate, up = _replicated(state_dict.pop(k1)), _replicated(state_dict.pop(k3))
            state_dict[f"{prefix}w_gu.weight"] = torch.stack((gate, up), dim=1).flatten(0, 1)


# ---------------------------------------------------------------------------------------------
# The block


@dataclass(frozen=True)
class _Shape:
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps_attn: float
    eps_ffn: float
    theta: float
    scaling: dict[str, Any] | None

    @property
    def qkv_width(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


def _shape_of(config: Llama3TransformerBlock.Config) -> _Shape:
    a, rope = config.attention, config.attention.rope
    n_kv = a.n_kv_heads or a.n_heads
    scaling = None
    if rope.scaling == "llama":
        scaling = {"factor": rope.scaling_factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    return _Shape(dim=a.dim, hidden=config.feed_forward.w1.out_features, n_heads=a.n_heads,
                  n_kv_heads=n_kv, head_dim=a.head_dim or a.dim // a.n_heads,
                  eps_attn=float(config.attention_norm.eps), eps_ffn=float(config.ffn_norm.eps),
                  theta=float(rope.theta), scaling=scaling)


class CodaLlama3TransformerBlock(Llama3TransformerBlock):
    """A llama3 block, TorchTitan's modules and signature, whose forward runs coda's fused ops
    (see the module docstring). Holds the RoPE frequency table of the packed QKV row as a
    non-persistent buffer ``coda_rope_table``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        precision: str = "bf16"  # "fp8": the projections in blockwise FP8 (CodaConverter.Config)
        fp8_recompute_a: bool = False  # FP8: a's weight-gradient copy made from z in the backward
        fp8_z: bool = False  # FP8: the MLP's pre-activation z saved for the backward in FP8

    def __init__(self, config: Config):
        super().__init__(config)
        _check_built(self)
        self._shape = _shape_of(config)
        self._fp8 = _precision(config.precision, "precision") == "fp8"
        self._recompute_a = bool(config.fp8_recompute_a)
        self._fp8_z = bool(config.fp8_z)
        self.register_buffer("coda_rope_table", self._rope_table(None), persistent=False)

    def _rope_table(self, device) -> Tensor:
        s = self._shape
        inv_freq = ops.rope_inv_freq(s.head_dim, s.theta, s.scaling)
        table = ops.rope_table(inv_freq, s.n_heads, s.n_kv_heads, s.head_dim)
        return table if device is None else table.to(device)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        # After to_empty() the buffer holds garbage on the target device: recompute it there.
        self.coda_rope_table = self._rope_table(buffer_device or self.coda_rope_table.device)

    def forward(self, x: Tensor, attention_masks=None, positions: Tensor | None = None) -> Tensor:
        s = self._shape
        batch, seq, dim = x.shape
        tokens = batch * seq
        attn, ffn = self.attention, self.feed_forward
        weights = (self.attention_norm.weight, attn.qkv_linear.w_qkv.weight, attn.wo.weight,
                   self.ffn_norm.weight, ffn.w_gu.weight, ffn.w2.weight)
        dtype = _compute_dtype(x.device, weights[0])
        _check_weights(s, weights, x)
        g_attn, w_qkv, w_o, g_ffn, w_gu, w_down = (
            w if w.dtype == dtype else w.to(dtype) for w in weights)
        pos = _positions(positions, batch, seq, x.device)
        coda = torch.ops.coda
        with torch.autocast(x.device.type, enabled=False):
            xm = x.to(dtype).reshape(tokens, dim).contiguous()
            h, r = ops.rmsnorm_stats(xm, g_attn, s.eps_attn)
            if self._fp8:  # the weights' FP8 operands (128x128 blocks) and h's rows
                # Cast every forward (the weights FSDP2 gathered), so recast_w_t (the True last
                # arguments below): each backward casts wᵀ from w, and no FP8 copy of a weight
                # lives from the block's forward to its backward.
                q8 = [_quantize_weight(w) for w in (w_qkv, w_o, w_gu, w_down)]
                h8 = coda.fp8_quantize_rows(h)[:2]  # (h: the norm's cache, no gradient)
                qkv = coda.fp8_norm_qkv(xm, g_attn, w_qkv, *q8[0], *h8, r, pos,
                                        self.coda_rope_table, None, True)
            else:
                qkv = ops.norm_qkv(xm, g_attn, w_qkv, h, r, pos, self.coda_rope_table)
        # (M, W) -> (B, L, heads, d): q, k, v as TorchTitan's attention takes them (views).
        q, k, v = qkv.view(batch, seq, -1, s.head_dim).split(
            [s.n_heads, s.n_kv_heads, s.n_kv_heads], dim=2)
        y = attn.inner_attention(q, k, v, attention_masks=attention_masks, scale=attn.scaling,
                                 enable_gqa=attn.enable_gqa)
        with torch.autocast(x.device.type, enabled=False):
            y = y.to(dtype).reshape(tokens, s.n_heads * s.head_dim).contiguous()
            # The MLP op's next-norm caches (for g_ffn here) are not used: the next block
            # recomputes its own (its norm weight belongs to another FSDP unit). In FP8 they
            # are the activation-dtype h (`last`), which skips the quantizing epilogue.
            if self._fp8:
                copies = torch.is_grad_enabled()  # the weight gradients' operands
                # recompute_y: y is a view of the attention's output, which its backward keeps;
                # the out-projection's backward makes y's copy from it (decoder_layer_fp8's way)
                x1, h1, h1s, r1, _, _ = coda.fp8_out_proj_residual_norm(
                    y, w_o, *q8[1], xm, g_ffn, s.eps_ffn, copies, True, True)
                out = coda.fp8_mlp(x1, g_ffn, w_gu, *q8[2], w_down, *q8[3], h1, h1s, r1, g_ffn,
                                   s.eps_ffn, True, copies, self._recompute_a, True,
                                   self._fp8_z)[0]
            else:
                x1, h1, r1 = ops.out_proj_residual_norm(y, w_o, xm, g_ffn, s.eps_ffn)
                out, _, _, _ = ops.mlp(x1, g_ffn, w_gu, w_down, h1, r1, g_ffn, s.eps_ffn)
        return out.view(batch, seq, dim).to(x.dtype)


def _compute_dtype(device: torch.device, param: Tensor) -> torch.dtype:
    kind = device.type
    autocast = torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind) if autocast else param.dtype
    if kind == "cuda" and dtype != torch.bfloat16:
        raise TypeError(f"{_WHO}: coda's CUDA programs run in bfloat16, the block computes in "
                        f"{dtype}; keep training.mixed_precision_param = 'bfloat16' (FSDP mixed "
                        "precision) or bfloat16 parameters / autocast")
    if kind == "cpu" and dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{_WHO}: coda's CPU reference runs in float32 or float64, the block "
                        f"computes in {dtype}")
    if kind not in ("cpu", "cuda"):
        raise TypeError(f"{_WHO}: coda runs on CPU or CUDA, the activations are on {device}")
    return dtype


def _check_weights(s: _Shape, weights: tuple[Tensor, ...], x: Tensor) -> None:
    """Sharded (tensor-parallel) or DTensor weights would reach the ops as something they do not
    take: say so. On CUDA, also the programs' 16-byte row rule."""
    if isinstance(x, DTensor) or any(isinstance(w, DTensor) for w in weights):
        raise NotImplementedError(f"{_WHO}: the block got DTensor activations or weights (tensor "
                                  "parallelism or spmd_backend='full_dtensor'); coda's blocks run "
                                  "on local tensors (FSDP's unsharded parameters)")
    expected = (s.qkv_width, s.dim)
    if tuple(weights[1].shape) != expected:
        raise NotImplementedError(f"{_WHO}: w_qkv is {tuple(weights[1].shape)}, expected "
                                  f"{expected}: sharded by tensor parallelism?")
    if x.device.type == "cuda":
        widths = {"dim": (s.dim, 8), "2 x hidden_dim": (2 * s.hidden, 16),
                  "the QKV width (n_heads + 2 n_kv_heads) x head_dim": (s.qkv_width, 8),
                  "n_heads x head_dim": (s.n_heads * s.head_dim, 8)}
        for what, (width, multiple) in widths.items():
            if width % multiple:
                raise NotImplementedError(f"{_WHO}: {what} = {width} is not a multiple of "
                                          f"{multiple} (CUDA: 16-byte rows)")


def _check_built(block: CodaLlama3TransformerBlock) -> None:
    """After build: the modules whose weights the fused path reads are the plain ones (a converter
    listed after coda, e.g. float8 or LoRA, or an override may have swapped them)."""
    expected = {"attention_norm": RMSNorm, "ffn_norm": RMSNorm,
                "attention.qkv_linear.w_qkv": Linear, "attention.wo": Linear,
                "feed_forward.w_gu": Linear, "feed_forward.w2": Linear,
                "attention.qkv_linear": CodaQKVLinear, "feed_forward": CodaFeedForward,
                "attention": GQAttention}
    for name, cls in expected.items():
        m = block.get_submodule(name)
        if type(m) is not cls:
            raise TypeError(f"{_WHO}: {name} was built as {type(m).__name__}, not "
                            f"{cls.__name__}: coda's fused block reads its weight directly, so "
                            "converters that swap modules (float8, MX, LoRA) cannot follow it; "
                            "list coda alone")


# ---------------------------------------------------------------------------------------------
# Config-tree conversion


def _plain_linear(cfg, fqn: str) -> None:
    if type(cfg) is not Linear.Config:
        raise TypeError(f"{_WHO}: {fqn} is a {type(cfg).__qualname__}, not a plain Linear.Config "
                        "(another converter, e.g. float8 / MX / LoRA, ran before coda; coda's "
                        "fused ops replace these GEMMs, so list coda alone)")
    if cfg.bias:
        raise _unsupported(fqn, "bias=True is not supported")


def _norm(cfg, fqn: str, dim: int) -> None:
    if type(cfg) is not RMSNorm.Config:
        raise TypeError(f"{_WHO}: {fqn} is a {type(cfg).__qualname__}, not RMSNorm.Config")
    if not cfg.elementwise_affine or cfg.eps is None or cfg.normalized_shape != dim:
        raise _unsupported(fqn, f"RMSNorm(normalized_shape={cfg.normalized_shape}, "
                                f"eps={cfg.eps}, elementwise_affine={cfg.elementwise_affine}) "
                                f"is not supported (needs a weight of size {dim} and a float eps)")


def _coda_qkv(a: GQAttention.Config, fqn: str) -> CodaQKVLinear.Config:
    src = a.qkv_linear
    n_kv = a.n_kv_heads or a.n_heads
    head_dim = a.head_dim or a.dim // a.n_heads
    if type(src) is FusedQKVLinear.Config:
        _plain_linear(src.wqkv, f"{fqn}.wqkv")
        sharding = src.wqkv.sharding_config
    elif type(src) is QKVLinear.Config:
        _plain_linear(src.wq, f"{fqn}.wq")
        _plain_linear(src.wkv, f"{fqn}.wkv")
        sharding = src.wq.sharding_config
    else:
        raise _unsupported(fqn, f"{type(src).__qualname__} is not supported (coda takes "
                                "FusedQKVLinear or QKVLinear; tp_gemm_backend='dist_gemm' is not "
                                "supported)")
    width = (a.n_heads + 2 * n_kv) * head_dim
    return CodaQKVLinear.Config(
        head_dim=head_dim, n_heads=a.n_heads, n_kv_heads=n_kv,
        param_init=src.param_init, sharding_config=src.sharding_config,
        wqkv=Linear.Config(in_features=a.dim, out_features=width, sharding_config=sharding,
                           param_init=_packed_qkv_init(src, a.n_heads, n_kv, head_dim)))


def _precision(value: str, setting: str) -> str:
    if value not in ("bf16", "fp8"):
        raise ValueError(f"{_WHO}: {setting} must be 'bf16' or 'fp8', got {value!r}")
    return value


def _coda_block(layer, fqn: str, precision: str = "bf16", recompute_a: bool = False,
                fp8_z: bool = False) -> CodaLlama3TransformerBlock.Config:
    if isinstance(layer, CodaLlama3TransformerBlock.Config):
        return replace(layer, precision=precision, fp8_recompute_a=recompute_a, fp8_z=fp8_z)
    if type(layer) is not Llama3TransformerBlock.Config:
        raise TypeError(f"{_WHO}: {fqn} is a {type(layer).__qualname__}; coda converts "
                        "Llama3TransformerBlock.Config blocks only (a converter such as LoRA "
                        "that ran before coda rewrites them: list coda alone)")
    if layer.moe is not None or layer.feed_forward is None:
        raise _unsupported(f"{fqn}.moe", "MoE layers are not supported (coda fuses dense SwiGLU "
                                         "blocks)")
    a = layer.attention
    if type(a) is not GQAttention.Config:
        raise _unsupported(f"{fqn}.attention", f"{type(a).__qualname__} is not supported "
                                               "(GQAttention only)")
    if a.qk_norm is not None:
        raise _unsupported(f"{fqn}.attention.qk_norm", "QK norm is not supported")
    head_dim = a.head_dim or a.dim // a.n_heads
    rope = a.rope
    if type(rope) is not ComplexRoPE.Config:
        raise _unsupported(f"{fqn}.attention.rope", f"{type(rope).__qualname__} is not supported "
                                                    "(coda pairs adjacent dims: ComplexRoPE)")
    if rope.scaling not in ("none", "llama"):
        raise _unsupported(f"{fqn}.attention.rope.scaling",
                           f"{rope.scaling!r} is not supported (only 'none' and 'llama')")
    if rope.dim != head_dim:
        raise _unsupported(f"{fqn}.attention.rope.dim", f"{rope.dim} != head_dim {head_dim} "
                                                        "(partial rotary is not supported)")
    _plain_linear(a.wo, f"{fqn}.attention.wo")
    _norm(layer.attention_norm, f"{fqn}.attention_norm", a.dim)
    _norm(layer.ffn_norm, f"{fqn}.ffn_norm", a.dim)
    ff = layer.feed_forward
    if type(ff) is not FeedForward.Config:
        raise _unsupported(f"{fqn}.feed_forward", f"{type(ff).__qualname__} is not supported "
                                                  "(plain SwiGLU FeedForward only)")
    for name in ("w1", "w2", "w3"):
        _plain_linear(getattr(ff, name), f"{fqn}.feed_forward.{name}")
    if ff.w1.out_features != ff.w3.out_features or ff.w2.in_features != ff.w1.out_features:
        raise _unsupported(f"{fqn}.feed_forward", "w1 / w3 / w2 hidden sizes differ")
    if precision == "fp8":  # e4m3 rows are whole 16-byte multiples: every GEMM extent
        n_kv = a.n_kv_heads or a.n_heads
        for setting, v in ((f"{fqn}.attention.dim", a.dim),
                           (f"{fqn}.attention.n_heads * head_dim", a.n_heads * head_dim),
                           (f"{fqn}.attention (n_heads + 2 * n_kv_heads) * head_dim",
                            (a.n_heads + 2 * n_kv) * head_dim),
                           (f"{fqn}.feed_forward.w1.out_features", ff.w1.out_features)):
            if v % 16:
                raise _unsupported(setting, f"{v} is not a multiple of 16, which "
                                            "precision='fp8' needs (16-byte rows of e4m3)")
    attention = replace(a, qkv_linear=_coda_qkv(a, f"{fqn}.attention.qkv_linear"))
    feed_forward = CodaFeedForward.Config(**{f.name: getattr(ff, f.name) for f in fields(ff)
                                             if f.init})
    return CodaLlama3TransformerBlock.Config(
        attention=attention, feed_forward=feed_forward, moe=None,
        attention_norm=layer.attention_norm, ffn_norm=layer.ffn_norm,
        param_init=layer.param_init, sharding_config=layer.sharding_config,
        precision=precision, fp8_recompute_a=recompute_a, fp8_z=fp8_z)


class CodaLlama3Model(Llama3Model):
    """``Llama3Model`` with coda blocks; its config rejects the parallelisms they do not run."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        def update_from_config(self, *, config, **kwargs) -> None:
            p = config.parallelism
            for setting in ("tensor_parallel_degree", "context_parallel_degree"):
                if getattr(p, setting, 1) > 1:
                    raise _unsupported(f"parallelism.{setting}={getattr(p, setting)}",
                                       "coda's blocks run data parallel (FSDP / HSDP / DDP) and "
                                       "pipeline stages only")
            if getattr(p, "spmd_backend", None) == "full_dtensor":
                raise _unsupported("parallelism.spmd_backend='full_dtensor'",
                                   "coda's blocks take local tensors ('spmd_types' or "
                                   "'partial_dtensor')")
            Llama3Model.Config.update_from_config(self, config=config, **kwargs)


class CodaConverter(ModelConfigConverter):
    """Turn coda on for a TorchTitan llama3 model: list ``CodaConverter.Config()`` in a model
    registry's ``converters`` (as float8's ``Float8LinearConverter.Config()``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        precision: str = "bf16"  # "fp8": every block's projections in blockwise FP8
        fp8_recompute_a: bool = False  # FP8: a's weight-gradient copy made in the backward
        fp8_z: bool = False  # FP8: the MLP's z saved in FP8 (CodaLlamaForCausalLM.fp8_z)

    def __init__(self, config: Config, **kwargs):
        self.config = config
        _precision(config.precision, "CodaConverter.Config.precision")

    def convert(self, model_config):
        if not isinstance(model_config, Llama3Model.Config):
            raise TypeError(f"{_WHO}: expects a llama3 model config (Llama3Model.Config), got "
                            f"{type(model_config).__qualname__}")
        layers = model_config.layers
        for i, layer in enumerate(layers):
            layers[i] = _coda_block(layer, f"layers.{i}", self.config.precision,
                                    self.config.fp8_recompute_a, self.config.fp8_z)
        if isinstance(model_config, CodaLlama3Model.Config):
            return model_config
        return CodaLlama3Model.Config(
            **{f.name: getattr(model_config, f.name) for f in fields(model_config) if f.init})


def with_coda(config):
    """A TorchTitan ``Trainer.Config`` with coda on (its ``model_spec.model`` converted, as
    listing :class:`CodaConverter` in the model registry's ``converters`` would); returns it."""
    spec = config.model_spec
    spec.model = CodaConverter.Config().build().convert(spec.model)
    return config


def __getattr__(name: str):
    """``--module coda.integrations.torchtitan --config llama3_8b``: TorchTitan's llama3 config
    of that name (``torchtitan.models.llama3.config_registry``) with coda on."""
    if not name.startswith("llama3_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torchtitan.models.llama3 import config_registry

    base = getattr(config_registry, name, None)
    if not callable(base):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (and TorchTitan's "
                             "llama3 config_registry has no such config)")

    def config_with_coda():
        return with_coda(base())

    config_with_coda.__name__ = config_with_coda.__qualname__ = name
    config_with_coda.__doc__ = f"TorchTitan's {name} with coda on."
    globals()[name] = config_with_coda
    return config_with_coda
