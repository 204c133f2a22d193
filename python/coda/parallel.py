"""Tensor parallelism with a sequence-parallel residual stream for coda models
(docs/tensor-parallel.md).

Each rank of the tensor-parallel group holds whole Q heads with their K/V group and a slice of the
MLP's intermediate dimension (column-parallel QKV and gate/up, row-parallel out-proj and down), and
``M / world`` rows of the residual stream. Before a column-parallel op the rows (and their norm
caches) are all-gathered; after a row-parallel GEMM the partial sums are reduce-scattered back to
rows. The fused ops need nothing else: their RMSNorm backward is a sum over output columns, so
each rank's dx and dγ are its shares of the sums (the reduce-scatter and one all-reduce finish
them). The LM head is vocabulary-parallel by default (``lm_head="vocab"``): each rank holds a
slice of the vocabulary, runs the LM-head op on all gathered rows against its slice, and the
ranks' log-sum-exps and target logits are combined with two collectives of M floats; each rank's
backward (B4 -> B1 with the global LSE) is its slice's share of dx and dγ. ``lm_head="sequence"``
keeps the whole vocabulary on every rank and runs the op on the rank's own rows.
``fused=False`` runs the same sharding and collectives with plain PyTorch ops: the unfused
tensor-parallel baseline. A model with ``precision="fp8"`` runs the shards' projection GEMMs in
blockwise FP8 (fp8_norm_qkv, fp8_linear for the out-projection's partial product,
fp8_mlp_partial), the rest as in bf16.

    tp = TensorParallelLlama(model)     # shards a CodaLlamaForCausalLM's weights
    loss = tp(input_ids, labels)        # this rank's share: the sum over ranks is the loss
    loss.backward()
    tp.all_reduce_replicated_grads()    # norms, embedding, LM head: sum the shares
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .nn import (FP8_PROJECTIONS, CodaLlamaForCausalLM, Fp8WeightCache, _keeps_fp8_weights,
                 sdpa_causal)


def _rows(t: Tensor, group) -> tuple[int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[0] % world:
        raise ValueError(f"coda.parallel: {t.shape[0]} rows do not split over {world} ranks")
    n = t.shape[0] // world
    return rank * n, (rank + 1) * n


def _all_gather_rows(t: Tensor, group) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter_rows(t: Tensor, group) -> Tensor:
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep our rows
        lo, hi = _rows(t, group)
        return _all_reduce(t, group)[lo:hi].clone()
    out = torch.empty(
        (t.shape[0] // dist.get_world_size(group),) + t.shape[1:], dtype=t.dtype, device=t.device
    )
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


def _all_reduce(t: Tensor, group) -> Tensor:
    """The sum over ranks, in a new tensor (the input is left as it is)."""
    t = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(t, group=group)
    return t


def _differentiable(forward, adjoint, doc: str):
    """An autograd function applying the collective ``forward(t, group)``, whose backward is its
    adjoint ``adjoint(g, group)``."""

    class Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, group):
            ctx.group = group
            return forward(t, group)

        @staticmethod
        def backward(ctx, g):
            return adjoint(g, ctx.group), None

    Collective.__doc__ = doc
    return Collective


_GatherRows = _differentiable(
    _all_gather_rows,
    _reduce_scatter_rows,
    "Forward: all-gather the rows; backward: sum the ranks' gradients, keep this rank's rows.",
)
_ReduceScatterRows = _differentiable(
    _reduce_scatter_rows,
    _all_gather_rows,
    "Forward: sum the ranks' partial results, keep this rank's rows; backward: all-gather.",
)
_AllReduceSum = _differentiable(
    _all_reduce,
    _all_reduce,
    "Forward: the sum over ranks (every rank gets it); backward: the same sum of the gradients.",
)


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[v0, v1)`` of the vocabulary that ``rank`` of ``world`` owns. Slices start at
    multiples of 8 (aligned rows for the kernels' bulk copies), so they can differ in size; the
    last takes the rest."""
    def start(k: int) -> int:
        return vocab if k == world else vocab * k // world // 8 * 8

    return start(rank), start(rank + 1)


def _vocab_targets(
    targets: Tensor, v0: int, v1: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Targets in the slice's own column indices, for the op run with ``local_ignore`` as its
    ignore_index: a value no local target can take (a global ``ignore_index`` >= 0 could equal
    an owned target's local index ``t - v0``). Forward: the owned targets, every other row
    ``local_ignore`` (the op then picks no target logit there). Backward: counted rows whose
    target another rank owns get a column past the slice (matches nothing: softmax, no one-hot).
    Returns ``(fwd, bwd, owned, local_ignore)``."""
    counted = targets.ne(ignore_index)
    owned = counted & (targets >= v0) & (targets < v1)
    local_ignore = -1 if ignore_index >= 0 else ignore_index
    local = targets - v0
    fwd = torch.where(owned, local, local_ignore)
    bwd = torch.where(owned, local, torch.where(counted, v1 - v0, local_ignore))
    return fwd, bwd, owned, local_ignore


class _VocabParallelLossSum(torch.autograd.Function):
    """The summed cross-entropy of every (gathered) row, with the vocabulary split over the
    group: this rank's fused LM-head op over its slice gives the slice's LSE and (for the targets
    it owns) the target logit; an all-gather of the LSEs and an all-reduce of the target logits
    (M floats each) give every rank the loss. Backward: the op's backward with the global LSE is
    this slice's share of dx and dγ (linear in the slices) and the whole dW of the slice."""

    @staticmethod
    def forward(ctx, x, gamma, w, h, r, targets, v0, vocab, ignore_index, group):
        v1 = v0 + w.shape[0]
        t_fwd, t_bwd, owned, local_ignore = _vocab_targets(targets, v0, v1, ignore_index)
        tok, lse_local = torch.ops.coda.lm_head_loss(
            x, gamma, w, h, r, t_fwd, local_ignore, "none", 0.0
        )
        # token loss of an owned row is lse_local - target logit; 0 elsewhere
        picked = _all_reduce(torch.where(owned, lse_local - tok, torch.zeros_like(tok)), group)
        lse = torch.logsumexp(_all_gather_rows(lse_local[None], group), dim=0)
        counted = targets.ne(ignore_index)
        valid = (targets >= 0) & (targets < vocab)
        loss = torch.where(counted, lse - picked, torch.zeros_like(lse))
        loss = torch.where(counted & ~valid, torch.full_like(loss, float("nan")), loss)
        ctx.save_for_backward(x, gamma, w, h, r, t_bwd, lse)
        ctx.ignore_index, ctx.group = local_ignore, group
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        x, gamma, w, h, r, t_bwd, lse = ctx.saved_tensors
        s = _all_reduce(g.detach().to(lse.dtype), ctx.group)  # the forward collectives' adjoint
        dx, dgamma, dw = torch.ops.coda.lm_head_loss_backward(
            s, x, gamma, w, h, r, t_bwd, lse, ctx.ignore_index, "sum", 0.0, 1 << 30
        )
        return dx, dgamma, dw, None, None, None, None, None, None, None


class _TensorParallelLayer(nn.Module):
    """One decoder layer's shard: its parameters (set by TensorParallelLlama) and FP8 weight cache.
    Its forward runs the layer, so that module hooks see it (FSDP2's unshard of a per-layer unit
    over a data-parallel mesh dimension: tensor x data parallelism)."""

    def forward(self, tp: "TensorParallelLlama", x: Tensor, gamma_attn: Tensor, pos: Tensor,
                rope, batch: int, seq: int) -> Tensor:
        g, d, hq, hkv = tp.group, tp.config.head_dim, tp.heads, tp.kv_heads
        # attention: gathered rows, this rank's heads; out-proj partial -> reduce-scatter
        qkv = tp._qkv(_GatherRows.apply(x, g), gamma_attn, self, pos, rope)
        qkv = qkv.view(batch, seq, hq + 2 * hkv, d)
        # split, not sliced: one concatenation of the gradients (nn._attention)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([hq, hkv, hkv], dim=2))
        y = sdpa_causal(q, k, v).transpose(1, 2).reshape(batch * seq, hq * d)
        x = x + _ReduceScatterRows.apply(tp._out_proj(y, self), g)
        # MLP: gathered rows, this rank's intermediate slice; partial -> reduce-scatter
        return x + _ReduceScatterRows.apply(tp._mlp(_GatherRows.apply(x, g), self), g)


def _share(p: Tensor, dim: int, lo: int, hi: int) -> nn.Parameter:
    return nn.Parameter(p.detach().narrow(dim, lo, hi - lo).clone())


def qkv_rows(config, rank: int, world: int) -> Tensor:
    """Rows of the packed ``[Q | K | V]`` weight that ``rank`` of ``world`` owns: its Q heads and
    the K/V heads their groups use (GQA groups stay whole on one rank)."""
    hq, hkv, d = config.num_heads // world, config.num_kv_heads // world, config.head_dim
    q0 = rank * hq * d
    k0 = (config.num_heads + rank * hkv) * d
    v0 = (config.num_heads + config.num_kv_heads + rank * hkv) * d
    return torch.cat(
        [
            torch.arange(q0, q0 + hq * d),
            torch.arange(k0, k0 + hkv * d),
            torch.arange(v0, v0 + hkv * d),
        ]
    )


class TensorParallelLlama(nn.Module):
    """This rank's shard of a :class:`coda.nn.CodaLlamaForCausalLM` (see the module docstring).

    Requires the head counts and the intermediate size to split evenly over the group (K/V
    groups stay whole on one rank) and ``batch * seq`` rows to split evenly. Replicated
    parameters (norm weights, QK-norm weights, embedding, LM head) hold this rank's share of
    their gradient after ``backward``; :meth:`all_reduce_replicated_grads` sums them. A Q/K/V
    bias (Qwen2) is sharded with w_qkv's rows.
    """

    def __init__(
        self,
        model: CodaLlamaForCausalLM,
        group=None,
        fused: bool = True,
        lm_head: str = "vocab",
    ) -> None:
        super().__init__()
        c = model.config
        if lm_head not in ("vocab", "sequence"):
            raise ValueError(f"coda.parallel: lm_head must be 'vocab' or 'sequence', got {lm_head!r}")
        if model.precision == "fp8" and not fused:
            raise NotImplementedError("coda.parallel: fused=False (the plain PyTorch baseline) "
                                      "runs in the activation dtype; got a model with "
                                      "precision='fp8'")
        self.config, self.group, self.fused, self.lm_head = c, group, fused, lm_head
        self.precision = model.precision
        # The FP8 model's options (coda.nn.CodaLlamaForCausalLM's), read in every forward.
        self.fp8_recompute_a, self.fp8_z = model.fp8_recompute_a, model.fp8_z
        self.fp8_weight_cache = model.fp8_weight_cache
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if c.num_kv_heads % world or c.num_heads % world or c.intermediate_size % world:
            raise ValueError(
                f"coda.parallel: heads {c.num_heads}/{c.num_kv_heads} and "
                f"intermediate size {c.intermediate_size} must split over {world} ranks"
            )
        hq, hkv, d, i = (
            c.num_heads // world,
            c.num_kv_heads // world,
            c.head_dim,
            c.intermediate_size // world,
        )
        if self.precision == "fp8":  # each rank's widths: 16-byte rows of e4m3 codes
            for what, width in (("num_heads / world * head_dim", hq * d),
                                ("num_kv_heads / world * head_dim", hkv * d),
                                ("intermediate_size / world", i)):
                if width % 16:
                    raise ValueError(f"coda.parallel: precision='fp8' needs {what} a multiple "
                                     f"of 16 (16-byte rows of e4m3 codes), got {width}")
        self.heads, self.kv_heads = hq, hkv
        rows = qkv_rows(c, rank, world)
        self.layers = nn.ModuleList()
        for layer in model.layers:
            shard = _TensorParallelLayer()
            shard.w_qkv = nn.Parameter(layer.w_qkv.detach()[rows.to(layer.w_qkv.device)].clone())
            # Qwen2's Q/K/V bias: this rank's rows, as w_qkv's; Qwen3's QK-norm weights: one per
            # head dimension, shared by every head, so replicated (each rank's gradient is its
            # heads' share, summed by all_reduce_replicated_grads).
            shard.b_qkv = (nn.Parameter(layer.b_qkv.detach()[rows.to(layer.b_qkv.device)].clone())
                           if c.qkv_bias else None)
            shard.q_gamma, shard.k_gamma = (
                (nn.Parameter(layer.q_gamma.detach().clone()),
                 nn.Parameter(layer.k_gamma.detach().clone())) if c.qk_norm else (None, None))
            shard.w_o = _share(layer.w_o, 1, rank * hq * d, (rank + 1) * hq * d)
            shard.gamma_ffn = nn.Parameter(layer.gamma_ffn.detach().clone())
            shard.w_gu = _share(layer.w_gu, 0, 2 * rank * i, 2 * (rank + 1) * i)  # (g, u) pairs
            shard.w_down = _share(layer.w_down, 1, rank * i, (rank + 1) * i)
            shard.fp8_cache = Fp8WeightCache()  # a plain object: not module state
            self.layers.append(shard)
        self.embed = nn.Parameter(model.embed_tokens.weight.detach().clone())
        self.gamma_attn = nn.ParameterList(
            nn.Parameter(g.detach().clone()) for g in model.gamma_attn
        )
        self.gamma_final = nn.Parameter(model.gamma_final.detach().clone())
        self.vocab_lo, self.vocab_hi = (
            vocab_range(c.vocab_size, rank, world) if lm_head == "vocab" else (0, c.vocab_size)
        )
        if not c.tie_word_embeddings:  # tied: the LM head uses rows of the (replicated) embedding
            self.w_vocab = _share(model.w_vocab, 0, self.vocab_lo, self.vocab_hi)
        inv_freq = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(self.embed.device), persistent=False)
        self.register_buffer(
            "rope_table",
            ops.rope_table(inv_freq, hq, hkv, d).to(self.embed.device),
            persistent=False,
        )

    def replicated_parameters(self) -> list[nn.Parameter]:
        ps = [self.embed, self.gamma_final, *self.gamma_attn]
        ps += [layer.gamma_ffn for layer in self.layers]
        if self.config.qk_norm:
            ps += [g for layer in self.layers for g in (layer.q_gamma, layer.k_gamma)]
        sharded = self.lm_head == "vocab" or self.config.tie_word_embeddings
        return ps if sharded else ps + [self.w_vocab]

    def refresh_fp8_weights(self) -> None:
        """As :meth:`CodaLlamaForCausalLM.refresh_fp8_weights`, for the shards: quantizes their
        projection weights now into the FP8 operands' own tensors. Needed after writes that do not
        move a weight's version counter (through ``.data``) and between the replays of a captured
        CUDA graph whenever the weights changed; optimizer steps are seen on their own."""
        if self.precision != "fp8" or not _keeps_fp8_weights(self, self.fp8_weight_cache):
            for layer in self.layers:  # nothing kept (under FSDP2 the weights are shards now)
                layer.fp8_cache.clear()
            return
        for layer in self.layers:
            for name in FP8_PROJECTIONS:
                layer.fp8_cache.refresh(name, getattr(layer, name))

    def _vocab_weight(self) -> Tensor:
        if self.config.tie_word_embeddings:
            return self.embed[self.vocab_lo : self.vocab_hi]
        return self.w_vocab

    def all_reduce_replicated_grads(self) -> None:
        for p in self.replicated_parameters():
            if p.grad is not None:  # under FSDP2 a DTensor: its shard, the same on each TP rank
                with torch.no_grad():
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(grad, group=self.group)

    def forward(self, input_ids: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
        """This rank's share of the mean loss over the batch's counted targets (labels shifted as
        in :meth:`CodaLlamaForCausalLM.forward`); the shares sum to the loss."""
        g = self.group
        batch, seq = input_ids.shape
        M = batch * seq
        if self.precision == "fp8":  # FP8 weight copies kept: fp8_weight_cache, or where None
            keep = _keeps_fp8_weights(self, self.fp8_weight_cache)  # unless under FSDP2 (as
            for layer in self.layers:  # the FP8 model decides), once per forward
                layer.fp8_cache.persist = keep
        lo, hi = _rows(input_ids.reshape(M), g)
        pos = torch.arange(seq, dtype=torch.int32, device=input_ids.device).repeat(batch)
        x = F.embedding(input_ids.reshape(M)[lo:hi], self.embed)
        rope = None if self.fused else self._rope(pos, x.dtype)
        for n, layer in enumerate(self.layers):  # a module call: its hooks (FSDP2's) run
            x = layer(self, x, self.gamma_attn[n], pos, rope, batch, seq)
        targets = F.pad(labels[:, 1:].to(torch.int64), (0, 1), value=ignore_index).reshape(M)
        count = targets.ne(ignore_index).sum()  # over the whole batch: every rank has the labels
        if self.lm_head == "sequence":
            return self._loss_sum(x, targets[lo:hi], ignore_index) / count
        # every rank computes the whole loss from its vocabulary slice: its share is 1/world
        world = dist.get_world_size(g)
        return self._vocab_loss_sum(_GatherRows.apply(x, g), targets, ignore_index) / (world * count)

    # The three pieces, fused (coda ops) or unfused (plain PyTorch: the baseline). The fused ones
    # take the norm caches of the rows they get; gathering x and recomputing them is cheaper
    # than gathering the caches too.

    def _caches(self, x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
        """The fused ops' norm caches (h, r) of the rows they get."""
        return ops.rmsnorm_stats(x.detach(), gamma, self.config.rms_norm_eps)

    def _fp8_caches(self, x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The FP8 ops' caches of the rows they get: h's 1x128 codes and scales (one cast pass,
        as the FP8 model makes its first norm's) and r."""
        h, r = self._caches(x, gamma)
        return (*torch.ops.coda.fp8_quantize_rows(h)[:2], r)

    @staticmethod
    def _recast(layer: nn.Module) -> bool:
        """No FP8 copy of the layer's weights kept between forwards, nor from its forward to its
        backward, which casts wᵀ from the weight (the cache's persist, set by forward)."""
        return not layer.fp8_cache.persist

    def _fp8(self, layer: nn.Module, name: str) -> tuple[Tensor, ...]:
        """A shard weight's FP8 operands (quantized once per change of the weight, or in every
        forward without the cache)."""
        return layer.fp8_cache.get(name, getattr(layer, name))

    def _out_proj(self, y: Tensor, layer: nn.Module) -> Tensor:
        """This rank's partial out-projection (row-parallel: its heads' columns of w_o)."""
        if self.precision == "fp8":  # y cast once; its copy kept for dW_o (none without grad)
            return torch.ops.coda.fp8_linear(y, layer.w_o, *self._fp8(layer, "w_o"),
                                             torch.is_grad_enabled(), self._recast(layer))[0]
        return F.linear(y, layer.w_o)

    def _norm(self, x: Tensor, gamma: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[1],), gamma, self.config.rms_norm_eps)

    def _logits(self, x: Tensor) -> Tensor:
        """Unfused: this rank's logits, fp32 for bf16 inputs (as Hugging Face computes the loss)."""
        logits = F.linear(self._norm(x, self.gamma_final), self._vocab_weight())
        return logits.float() if logits.dtype == torch.bfloat16 else logits

    def _qkv(self, x: Tensor, gamma: Tensor, layer: nn.Module, pos: Tensor, rope) -> Tensor:
        """This rank's heads' q, k, v of the gathered rows (with the layer's Q/K/V bias or its
        QK-norm over each of these heads)."""
        c, w_qkv, table = self.config, layer.w_qkv, self.rope_table
        hq, hkv, eps = self.heads, self.kv_heads, c.rms_norm_eps
        if self.precision == "fp8":
            coda, q = torch.ops.coda, self._fp8(layer, "w_qkv")
            if c.qk_norm:
                return coda.fp8_norm_qkv_qk_norm(x, gamma, w_qkv, *q, *self._fp8_caches(x, gamma),
                                                 pos, table, layer.q_gamma, layer.k_gamma, hq,
                                                 hkv, eps, self._recast(layer))[0]
            return coda.fp8_norm_qkv(x, gamma, w_qkv, *q, *self._fp8_caches(x, gamma), pos,
                                     table, layer.b_qkv, self._recast(layer))
        if self.fused:
            if c.qk_norm:
                return ops.norm_qkv_qk_norm(x, gamma, w_qkv, *self._caches(x, gamma), pos, table,
                                            layer.q_gamma, layer.k_gamma, hq, hkv, eps)
            return ops.norm_qkv(x, gamma, w_qkv, *self._caches(x, gamma), pos, table,
                                layer.b_qkv)
        qkv = F.linear(self._norm(x, gamma), w_qkv, layer.b_qkv)
        d = c.head_dim
        q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]
        if c.qk_norm:  # an RMSNorm over each head's d values, before RoPE
            q, k = (F.rms_norm(t.reshape(-1, n, d), (d,), w, eps).flatten(1)
                    for t, n, w in ((q, hq, layer.q_gamma), (k, hkv, layer.k_gamma)))
        return torch.cat([rope(torch.cat([q, k], dim=1)), qkv[:, (hq + hkv) * d:]], dim=1)

    def _mlp(self, x: Tensor, layer: nn.Module) -> Tensor:
        g = layer.gamma_ffn
        if self.precision == "fp8":
            return torch.ops.coda.fp8_mlp_partial(
                x, g, layer.w_gu, *self._fp8(layer, "w_gu"), layer.w_down,
                *self._fp8(layer, "w_down"), *self._fp8_caches(x, g), torch.is_grad_enabled(),
                self.fp8_recompute_a, self._recast(layer), self.fp8_z)[0]
        if self.fused:
            return ops.mlp_partial(x, g, layer.w_gu, layer.w_down, *self._caches(x, g))[0]
        gu = F.linear(self._norm(x, g), layer.w_gu)
        return F.linear(F.silu(gu[:, 0::2]) * gu[:, 1::2], layer.w_down)  # interleaved (g, u)

    def _loss_sum(self, x: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
        g = self.gamma_final
        if self.fused:
            h, r = self._caches(x, g)
            w = self._vocab_weight()
            return ops.lm_head_loss(x, g, w, h, r, targets, ignore_index, "sum", 0.0)[0]
        return F.cross_entropy(
            self._logits(x), targets, ignore_index=ignore_index, reduction="sum"
        )

    def _vocab_loss_sum(self, x: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
        g, v0, vocab = self.group, self.vocab_lo, self.config.vocab_size
        if self.fused:
            h, r = self._caches(x, self.gamma_final)
            return _VocabParallelLossSum.apply(
                x, self.gamma_final, self._vocab_weight(), h, r, targets, v0, vocab,
                ignore_index, g,
            )
        logits = self._logits(x)
        t_fwd, _, owned, _ = _vocab_targets(targets, v0, self.vocab_hi, ignore_index)
        top = logits.detach().amax(dim=1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=g)
        sumexp = _AllReduceSum.apply((logits - top[:, None]).exp().sum(dim=1), g)
        picked = logits.gather(1, torch.where(owned, t_fwd, 0)[:, None]).squeeze(1)
        picked = _AllReduceSum.apply(torch.where(owned, picked, torch.zeros_like(picked)), g)
        counted = targets.ne(ignore_index)
        loss = sumexp.log() + top - picked
        return torch.where(counted, loss, torch.zeros_like(loss)).sum()

    def _rope(self, pos: Tensor, dtype: torch.dtype):
        """Unfused RoPE on (M, heads·d) columns whose pairs are adjacent (the coda layout)."""
        ang = pos.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]
        d = self.config.head_dim

        def rope(t: Tensor) -> Tensor:
            t = t.view(t.shape[0], -1, d)
            a, b = t[..., 0::2], t[..., 1::2]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(1)

        return rope
