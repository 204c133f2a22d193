"""Typed wrappers around ``torch.ops.coda.*``.

Every op works on flattened tokens: activations are contiguous 2-D ``(M, width)`` tensors. Turning
``(batch, seq, ...)`` into ``(M, ...)`` and back is the caller's job (``coda.nn`` does it). The math
of each op is in ``docs/torch-ops.md`` and ``docs/math.md``; the C++ side checks every argument.

Norm caches (``h = x * gamma`` and the reciprocal RMS ``r``) are never autograd edges: the op
that consumes a norm differentiates through it with respect to ``x`` and ``gamma`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "rope_inv_freq",
    "rope_table",
    "rmsnorm_stats",
    "norm_qkv",
    "norm_qkv_qk_norm",
    "out_proj_residual_norm",
    "mlp",
    "lm_head_loss",
]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, float] | None = None
) -> Tensor:
    """LLaMA RoPE inverse frequencies ``theta ** (-2i / head_dim)`` (radians per position).

    Returns a float64 CPU tensor of ``head_dim // 2`` entries, computed by
    ``coda::programs::rope_inv_freq`` (rope.hpp). ``scaling`` is ``None`` or a Hugging Face style
    LLaMA-3.1 dict with keys ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` (an optional ``rope_type`` must be ``"llama3"``):
    wavelengths longer than ``original / low_freq_factor`` are slowed by ``factor``, shorter than
    ``original / high_freq_factor`` are kept, and the band between is interpolated.
    """
    if scaling is None:
        return torch.ops.coda.rope_inv_freq(head_dim, theta)
    rope_type = scaling.get("rope_type", scaling.get("type", "llama3"))
    if rope_type != "llama3":
        raise ValueError(f"rope_inv_freq: only 'llama3' scaling is supported, got {rope_type!r}")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope_inv_freq: scaling is missing keys {missing}")
    # The math is the host code's (programs::rope_inv_freq in rope.hpp), through the op.
    return torch.ops.coda.rope_inv_freq(
        head_dim, theta, True, float(scaling["factor"]), float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def rope_table(
    inv_freq: Tensor | Sequence[float], n_heads: int, n_kv_heads: int, head_dim: int
) -> Tensor:
    """Per-column RoPE frequency table for a packed ``[Q | K | V]`` row.

    ``inv_freq``: ``head_dim // 2`` radians per position (float64; converted to a float64 CPU
    tensor if needed). Returns int32 ``(2, W)`` with ``W = (n_heads + 2 n_kv_heads) head_dim``:
    the high / low 32-bit words of each column's frequency in fixed-point turns (V columns 0).
    The table is a constant; move it to the activations' device with ``.to()``.
    """
    inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64, device="cpu").contiguous()
    return torch.ops.coda.rope_table(inv_freq, n_heads, n_kv_heads, head_dim)


def rmsnorm_stats(x: Tensor, gamma: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """F0: the norm caches of ``x`` without a GEMM before it (first layer).

    ``x (M, H)``, ``gamma (H)``. Returns ``h = x * gamma`` ``(M, H)`` and
    ``r = rsqrt(mean(x**2, -1) + eps)`` ``(M)`` in the stat dtype. Not differentiable.
    """
    return torch.ops.coda.rmsnorm_stats(x, gamma, eps)


def norm_qkv(
    x: Tensor, gamma: Tensor, w_qkv: Tensor, h: Tensor, r: Tensor, pos: Tensor, rope_table: Tensor,
    b_qkv: Tensor | None = None,
) -> Tensor:
    """F3: ``qkv = rope(rmsnorm(x) @ w_qkv.T + b_qkv)`` computed from the caches ``h``, ``r``.

    ``x, h (M, H)``, ``gamma (H)``, ``w_qkv (W, H)`` packed ``[Q | K | V]`` with RoPE pairs
    adjacent, ``r (M)``, ``pos (M)`` int32 positions (int64 is converted), ``rope_table`` from
    :func:`rope_table`, ``b_qkv (W)`` an optional bias in ``w_qkv``'s row order (Qwen2's q/k/v
    bias), added before RoPE. Returns ``qkv (M, W)`` with RoPE applied to Q and K.
    Differentiable in ``x``, ``gamma``, ``w_qkv`` and ``b_qkv``.
    """
    if pos.dtype == torch.int64:
        pos = pos.to(torch.int32)
    return torch.ops.coda.norm_qkv(x, gamma, w_qkv, h, r, pos, rope_table, b_qkv)


def norm_qkv_qk_norm(
    x: Tensor, gamma: Tensor, w_qkv: Tensor, h: Tensor, r: Tensor, pos: Tensor, rope_table: Tensor,
    q_gamma: Tensor, k_gamma: Tensor, n_heads: int, n_kv_heads: int, eps: float,
) -> Tensor:
    """F3 with QK-norm (Qwen3): :func:`norm_qkv` with an RMSNorm over every Q and K head before
    RoPE, ``q_gamma`` / ``k_gamma (head_dim)`` its weights and ``eps`` its epsilon; the heads
    give ``W = (n_heads + 2 * n_kv_heads) * head_dim``. Returns ``qkv (M, W)``. Differentiable in
    ``x``, ``gamma``, ``w_qkv``, ``q_gamma`` and ``k_gamma``. On CUDA ``head_dim`` must divide
    128 (8 to 128: the epilogue normalizes whole heads inside a 128-column tile).
    """
    if pos.dtype == torch.int64:
        pos = pos.to(torch.int32)
    qkv, _ = torch.ops.coda.norm_qkv_qk_norm(x, gamma, w_qkv, h, r, pos, rope_table, q_gamma,
                                             k_gamma, n_heads, n_kv_heads, eps)
    return qkv


def out_proj_residual_norm(
    y: Tensor, w_o: Tensor, residual: Tensor, gamma: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """F1 + A1: ``x = y @ w_o.T + residual`` and the next norm's caches.

    ``y (M, K)``, ``w_o (H, K)``, ``residual (M, H)``, ``gamma (H)`` (the *next* norm's weight).
    Returns ``(x, h, r)``: ``x (M, H)``, ``h = x * gamma``, ``r (M)``. Differentiable in ``y``,
    ``w_o`` and ``residual`` through ``x`` only (``h``, ``r`` are caches).
    """
    return torch.ops.coda.out_proj_residual_norm(y, w_o, residual, gamma, eps)


def mlp(
    x: Tensor,
    gamma: Tensor,
    w_gu: Tensor,
    w_down: Tensor,
    h: Tensor,
    r: Tensor,
    gamma_next: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """F2 + F1 + A1: the SwiGLU MLP block with its residual add and the next norm's caches.

    ``x, h (M, H)`` (``h``, ``r`` are the caches of ``x`` for ``gamma``), ``gamma, gamma_next (H)``,
    ``w_gu (2I, H)`` interleaved gate/up rows ``[g0, u0, g1, ...]``, ``w_down (H, I)``.
    Returns ``(x_out, h_out, r_out, z)``: ``x_out = x + swiglu(rmsnorm(x) @ w_gu.T) @ w_down.T``,
    ``h_out = x_out * gamma_next``, ``r_out (M)``, ``z (M, 2I)`` the saved pre-activation.
    Differentiable in ``x``, ``gamma``, ``w_gu``, ``w_down`` through ``x_out`` only.
    """
    return torch.ops.coda.mlp(x, gamma, w_gu, w_down, h, r, gamma_next, eps)


def mlp_partial(
    x: Tensor, gamma: Tensor, w_gu: Tensor, w_down: Tensor, h: Tensor, r: Tensor
) -> tuple[Tensor, Tensor]:
    """F2 + GEMM: the SwiGLU MLP branch alone, ``y = swiglu(rmsnorm(x) @ w_gu.T) @ w_down.T``,
    without the residual add and the next norm (what :func:`mlp` adds).

    For tensor parallelism (docs/tensor-parallel.md): with ``w_gu`` / ``w_down`` holding one rank's
    share of the intermediate dimension, ``y`` and the gradient reaching ``x`` are that rank's
    shares of the sums over ranks. Shapes as in :func:`mlp`; returns ``(y (M, H), z (M, 2I))``.
    Differentiable in ``x``, ``gamma``, ``w_gu``, ``w_down`` through ``y``.
    """
    return torch.ops.coda.mlp_partial(x, gamma, w_gu, w_down, h, r)


def lm_head_loss(
    x: Tensor,
    gamma: Tensor,
    w_vocab: Tensor,
    h: Tensor,
    r: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    max_chunk_bytes: int | None = None,
) -> tuple[Tensor, Tensor]:
    """F4 + A2: final norm, LM head and cross-entropy without materializing all logits at once.

    ``x, h (M, H)``, ``gamma (H)`` (the final norm's), ``w_vocab (V, H)``, ``r (M)``,
    ``targets (M)`` int64 (int32 is converted) where ``ignore_index`` marks tokens that do not
    count. ``reduction``: ``'mean'`` over non-ignored tokens, ``'sum'``, or ``'none'`` (per-token,
    0 where ignored). ``z_loss`` adds ``z_loss * lse**2`` per counted token. Returns
    ``(loss, lse)``, both in the stat dtype; differentiable in ``x``, ``gamma``, ``w_vocab``
    through ``loss`` only.
    ``max_chunk_bytes`` bounds the backward's scratch memory (dℓ for one slice of the
    vocabulary, and the fp32 dx accumulator when sliced); ``None`` keeps the op's default (1 GiB).
    """
    if targets.dtype == torch.int32:
        targets = targets.to(torch.int64)
    if max_chunk_bytes is None:
        return torch.ops.coda.lm_head_loss(
            x, gamma, w_vocab, h, r, targets, ignore_index, reduction, z_loss
        )
    return torch.ops.coda.lm_head_loss(
        x, gamma, w_vocab, h, r, targets, ignore_index, reduction, z_loss, max_chunk_bytes
    )
