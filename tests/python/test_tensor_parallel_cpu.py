"""Tensor + sequence parallelism (coda.parallel, docs/tensor-parallel.md) on the CPU: two gloo
processes in fp64 against the unsharded computation.

The claim under test: with the residual stream split along tokens, a rank gathers the rows, runs
the unchanged fused op on its own output columns, and its backward (B3 -> B1) yields exactly its
share of the RMSNorm backward, dx_r = r·γ·(dz_r·W_r) − x·r²·ZdZ_r with ZdZ_r summed over its
columns only (both terms are linear in per-column sums). The reduce-scatter that sequence
parallelism performs anyway completes dx, one all-reduce completes dγ: no extra collective.
The whole model too: bf16 fused and unfused, the FP8 model, Qwen2's Q/K/V bias and Qwen3's
QK-norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import run_gloo
from test_distributed_cpu import CFG, build

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

H, HQ, HKV, D, BATCH, SEQ, EPS = 16, 4, 2, 4, 2, 6, 1e-5
M = BATCH * SEQ
WIDTH = (HQ + 2 * HKV) * D
WORLD = 2


def problem():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, H, generator=g, dtype=torch.float64)
    gamma = 1 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)
    w_qkv = 0.3 * torch.randn(WIDTH, H, generator=g, dtype=torch.float64)
    pos = torch.arange(SEQ, dtype=torch.int32).repeat(BATCH)
    dqkv = torch.randn(M, WIDTH, generator=g, dtype=torch.float64)  # the upstream gradient
    return x, gamma, w_qkv, pos, dqkv


def qkv_cols(rank: int):
    from coda.nn import LlamaConfig
    from coda.parallel import qkv_rows

    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=H,
        intermediate_size=8,
        num_layers=1,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
    )
    return qkv_rows(cfg, rank, WORLD)


def norm_qkv_worker(rank: int, world: int, out: dict) -> None:
    import coda.ops as ops
    from coda.parallel import _all_gather_rows, _GatherRows

    x, gamma, w_qkv, pos, dqkv = problem()
    mine = slice(rank * M // world, (rank + 1) * M // world)
    cols = qkv_cols(rank)
    x_local = x[mine].clone().requires_grad_()
    gamma_r = gamma.clone().requires_grad_()  # replicated across the TP group
    w_local = w_qkv[cols].clone().requires_grad_()  # column-parallel: this rank's heads
    table = ops.rope_table(ops.rope_inv_freq(D, 10000.0), HQ // world, HKV // world, D)
    x_all = _GatherRows.apply(x_local, None)
    h, r = ops.rmsnorm_stats(x_all.detach(), gamma, EPS)  # the caches of the gathered rows
    qkv_local = ops.norm_qkv(x_all, gamma_r, w_local, h, r, pos, table)
    qkv_local.backward(dqkv[:, cols])
    dist.all_reduce(gamma_r.grad)  # dγ: each rank has its columns' share
    got = {
        "qkv": _all_gather_rows(qkv_local.detach().t(), None),  # (world * W_r, M)
        "dx": _all_gather_rows(x_local.grad, None),
        "dgamma": gamma_r.grad,
        "dw": _all_gather_rows(w_local.grad, None),
    }
    if rank == 0:
        out.update({k: v.clone() for k, v in got.items()})


def test_column_parallel_norm_qkv_with_sequence_parallel_inputs_matches_unsharded_fp64():
    import coda.ops as ops

    x, gamma, w_qkv, pos, dqkv = problem()
    x_ref, gamma_ref, w_ref = (t.clone().requires_grad_() for t in (x, gamma, w_qkv))
    h, r = ops.rmsnorm_stats(x, gamma, EPS)
    table = ops.rope_table(ops.rope_inv_freq(D, 10000.0), HQ, HKV, D)
    qkv = ops.norm_qkv(x_ref, gamma_ref, w_ref, h, r, pos, table)
    qkv.backward(dqkv)
    got = run_gloo(norm_qkv_worker, WORLD)
    order = torch.cat([qkv_cols(rk) for rk in range(WORLD)])  # sharded column order

    def close(a, b, what):
        err = (a - b).abs().max().item()
        assert err <= 1e-12 * b.abs().max().item(), f"{what}: max error {err:.3e}"

    close(got["qkv"], qkv.detach()[:, order].t(), "qkv")
    close(got["dx"], x_ref.grad, "dx")
    close(got["dgamma"], gamma_ref.grad, "dgamma")
    close(got["dw"], w_ref.grad[order], "dw_qkv")


# ---- the whole model: coda.parallel.TensorParallelLlama vs CodaLlamaForCausalLM ----------------


# FP8 shards quantize in the unsharded model's blocks when every rank's share of a quantized
# width is whole 128-column blocks: a head (d = 128) of Q, K or V, I / world = 128.
FP8_TP_CFG = dict(hidden_size=256, intermediate_size=256, head_dim=128)


# The Q/K/V variants of ARCHS: Qwen2's bias, Qwen3's QK-norm.
ARCHS = {"llama": {}, "qkv_bias": {"qkv_bias": True}, "qk_norm": {"qk_norm": True}}


def model_worker(
    rank: int, world: int, tie: bool, fused: bool, lm_head: str, vocab: int, ignore: int,
    precision: str, arch: str, out: dict,
) -> None:
    from coda.parallel import TensorParallelLlama, vocab_range

    precision, _, option = precision.partition(":")  # "fp8:<option>": one of the FP8 model's
    fp8 = precision == "fp8"
    model = build(tie, vocab_size=vocab, **(FP8_TP_CFG if fp8 else {}), **ARCHS[arch])  # 44:
    model.precision = precision  # splits unevenly over the ranks
    if option:  # options, on the model before sharding (fp8_weight_cache: set to False)
        setattr(model, option, option != "fp8_weight_cache")
    c = model.config
    if c.qkv_bias:  # reset_parameters zeroes it: a bias that matters, another in each layer
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in model.layers:
                layer.b_qkv.normal_(0.0, 0.3, generator=gen)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    ids[0, 5], ids[1, 2] = 0, vocab - 1  # targets at both ends: owned by the first and last rank
    labels = ids.clone()
    labels[0, 3] = ignore
    if ignore >= 0:  # a counted target whose index in the second slice equals ignore_index
        v0 = vocab_range(vocab, 1, world)[0]
        labels[1, 4] = v0 + ignore
    # shards copied before the reference backward
    tp = TensorParallelLlama(model, fused=fused, lm_head=lm_head)
    ref_loss = model(ids, labels, ignore_index=ignore)
    ref_loss.backward()
    loss = tp(ids, labels, ignore_index=ignore)
    loss.backward()
    tp.all_reduce_replicated_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)

    pairs = grad_pairs(tp, model, rank, world, tie, lm_head, vocab)
    errs = {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()}
    errs["loss"] = abs(total.item() - ref_loss.item()) / abs(ref_loss.item())
    with torch.no_grad():  # evaluation: the FP8 ops without the weight gradients' copies
        eval_loss = tp(ids, labels, ignore_index=ignore)
    errs["loss under no_grad"] = abs(eval_loss.item() - loss.item()) / abs(loss.item())
    out[rank] = errs
    if option:  # what a forward saves for the backward, with the option and without it
        saved = {}
        off = None if option == "fp8_weight_cache" else False
        for flag, value in (("on", getattr(tp, option)), ("off", off)):
            setattr(tp, option, value)
            saved[flag] = saved_bytes(lambda: tp(ids, labels, ignore_index=ignore))
        out[f"saved bytes {rank}"] = saved


def grad_pairs(tp, model, rank: int, world: int, tie: bool, lm_head: str, vocab: int) -> dict:
    """{parameter: (the TP rank's gradient, the unsharded model's gradient of that shard)}; a
    gradient under FSDP2 (a DTensor) in full."""
    from coda.parallel import qkv_rows, vocab_range

    c = model.config
    # A wrong choice of Q/K/V rows would also change the loss, so the module's own is used here.
    rows = qkv_rows(model.config, rank, world)
    o = slice(  # w_o's columns: this rank's Q heads
        rank * c.num_heads // world * c.head_dim, (rank + 1) * c.num_heads // world * c.head_dim
    )
    i = c.intermediate_size // world
    pairs = {
        "embed": (tp.embed.grad, model.embed_tokens.weight.grad),
        "gamma_final": (tp.gamma_final.grad, model.gamma_final.grad),
    }
    if not tie:
        v0, v1 = vocab_range(vocab, rank, world) if lm_head == "vocab" else (0, vocab)
        pairs["w_vocab"] = (tp.w_vocab.grad, model.w_vocab.grad[v0:v1])
    for n, (sl, full) in enumerate(zip(tp.layers, model.layers)):
        pairs[f"gamma_attn.{n}"] = (tp.gamma_attn[n].grad, model.gamma_attn[n].grad)
        pairs[f"{n}.gamma_ffn"] = (sl.gamma_ffn.grad, full.gamma_ffn.grad)
        pairs[f"{n}.w_qkv"] = (sl.w_qkv.grad, full.w_qkv.grad[rows])
        pairs[f"{n}.w_o"] = (sl.w_o.grad, full.w_o.grad[:, o])
        pairs[f"{n}.w_gu"] = (sl.w_gu.grad, full.w_gu.grad[2 * rank * i : 2 * (rank + 1) * i])
        pairs[f"{n}.w_down"] = (sl.w_down.grad, full.w_down.grad[:, rank * i : (rank + 1) * i])
        if c.qkv_bias:
            pairs[f"{n}.b_qkv"] = (sl.b_qkv.grad, full.b_qkv.grad[rows])
        if c.qk_norm:
            pairs[f"{n}.q_gamma"] = (sl.q_gamma.grad, full.q_gamma.grad)
            pairs[f"{n}.k_gamma"] = (sl.k_gamma.grad, full.k_gamma.grad)
    return {k: (a.full_tensor() if hasattr(a, "full_tensor") else a, b)
            for k, (a, b) in pairs.items()}


def saved_bytes(forward) -> int:
    """The bytes of the distinct storages autograd saves for the backward during forward()."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


@pytest.mark.parametrize(
    "lm_head,vocab",
    [("vocab", 44), ("sequence", CFG["vocab_size"])],
    ids=["vocab-parallel-uneven", "sequence-parallel"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused-baseline"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tensor_parallel_model_matches_unsharded_fp64(tie, fused, lm_head, vocab):
    """Two ranks of TensorParallelLlama give the unsharded model's loss and every gradient (each
    rank's shard of the sharded weights, the summed replicated ones) in fp64; with fused=False
    (plain PyTorch ops: the unfused TP baseline) as well. The vocabulary-parallel LM head is
    checked with a vocabulary that splits unevenly (16 + 28 rows) and targets on both ranks."""
    got = run_gloo(model_worker, WORLD, tie, fused, lm_head, vocab, -100, "bf16", "llama")
    check_model_errors(got, tie)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused-baseline"])
def test_vocab_parallel_head_with_a_nonnegative_ignore_index(fused):
    """ignore_index = 5: the second rank's slice starts at 16, so the counted target 21 has the
    local index 5 there and must still count (the op runs with a local ignore value)."""
    got = run_gloo(model_worker, WORLD, False, fused, "vocab", 44, 5, "bf16", "llama")
    check_model_errors(got, False)


def check_model_errors(got: dict, tie: bool, per_layer: int = 0) -> None:
    """Every rank's relative errors (per_layer: the layer parameters beyond LLaMA's; the loss,
    and the loss of a forward under no_grad against the rank's loss with grad)."""
    assert sorted(got) == list(range(WORLD))
    for rank, errs in got.items():
        assert len(errs) == (6 + per_layer) * CFG["num_layers"] + 4 + (0 if tie else 1)
        bad = {k: v for k, v in errs.items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: relative errors above 1e-12: {bad}"


@pytest.mark.parametrize(
    "lm_head,vocab",
    [("vocab", 44), ("sequence", CFG["vocab_size"])],
    ids=["vocab-parallel-uneven", "sequence-parallel"],
)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tensor_parallel_fp8_model_matches_unsharded_fp64(tie, lm_head, vocab):
    """precision="fp8": two ranks of TensorParallelLlama (fp8_norm_qkv on the gathered rows, the
    out-projection's partial GEMM on y's cast, fp8_mlp_partial) give the unsharded FP8 model's
    loss and every gradient in fp64. Each rank's shares of Q, K, V (one head of 128 columns
    each), of I and of the heads' columns are whole 128-column blocks, so every shard quantizes
    in the unsharded model's blocks: the same codes and scales, the same numbers but for fp64
    summation order (a code one step apart would move them by ~1e-3)."""
    got = run_gloo(model_worker, WORLD, tie, True, lm_head, vocab, -100, "fp8", "llama")
    check_model_errors(got, tie)


@pytest.mark.parametrize("fused,precision", [(True, "bf16"), (False, "bf16"), (True, "fp8")],
                         ids=["fused", "unfused-baseline", "fp8"])
@pytest.mark.parametrize("arch", ["qkv_bias", "qk_norm"])
def test_tensor_parallel_qwen_layers_match_unsharded_fp64(arch, fused, precision):
    """Qwen2's Q/K/V bias (sharded with w_qkv's rows) and Qwen3's QK-norm (an RMSNorm over each
    of a rank's heads; its weights replicated, their gradient shares summed): the unsharded
    model's loss and every gradient, the bias's and the QK-norm weights' too, in fp64."""
    got = run_gloo(model_worker, WORLD, False, fused, "vocab", 44, -100, precision, arch)
    check_model_errors(got, False, per_layer=1 if arch == "qkv_bias" else 2)


@pytest.mark.parametrize("option", ["fp8_z", "fp8_recompute_a", "fp8_weight_cache"])
def test_tensor_parallel_fp8_options_match_unsharded_fp64(option):
    """The FP8 model's options that keep less for the backward (z saved in FP8, a's copy made
    from z, no weight cache: wᵀ cast from each weight in the backward), set on the model before
    sharding: the unsharded model's loss and every gradient with the same option, in fp64, and
    on every rank fewer bytes saved for the backward than without the option."""
    got = run_gloo(model_worker, WORLD, False, True, "vocab", 44, -100, "fp8:" + option, "llama")
    saved = {k: got.pop(k) for k in [k for k in got if isinstance(k, str)]}
    check_model_errors(got, False)
    assert len(saved) == WORLD
    for rank, b in saved.items():  # each keeps less on every rank
        assert b["on"] < b["off"], f"{rank}: {b}"


def test_tensor_parallel_fp8_checks_each_ranks_widths():
    """An FP8 shard's quantized widths (a rank's heads, its slice of I) must be whole 16-byte rows
    of codes; the unfused baseline has no FP8 form: each refused by name."""
    got = run_gloo(fp8_refusals_worker, WORLD)
    assert "num_kv_heads / world * head_dim a multiple of 16" in got["widths"], got
    assert got["widths"].endswith("got 8"), got
    assert "fused=False" in got["unfused"], got


def fp8_refusals_worker(rank: int, world: int, out: dict) -> None:
    from coda.parallel import TensorParallelLlama

    # The model's FP8 widths are whole 16-byte rows (H, hq·d = 32, the QKV width 64, I = 32), and
    # a rank's Q heads (2·8) and I (16) too, but not its K / V head (8).
    model = build(False, hidden_size=32, intermediate_size=32, head_dim=8)
    model.precision = "fp8"
    for key, kwargs in (("widths", {}), ("unfused", {"fused": False})):
        try:
            TensorParallelLlama(model, **kwargs)
            msg = "accepted"
        except (ValueError, NotImplementedError) as ex:
            msg = str(ex)
        if rank == 0:
            out[key] = msg


def compile_worker(rank: int, world: int, precision: str, out: dict) -> None:
    from coda.parallel import TensorParallelLlama

    model = build(False, vocab_size=44, **(FP8_TP_CFG if precision == "fp8" else {}))
    model.precision = precision
    tp = TensorParallelLlama(model)
    ids = torch.randint(0, 44, (2, 8), generator=torch.Generator().manual_seed(1))
    eager = tp(ids, ids)
    eager.backward()
    want = [p.grad.clone() for p in tp.parameters()]
    tp.zero_grad()
    loss = torch.compile(tp, fullgraph=True, backend="aot_eager")(ids, ids)
    loss.backward()
    out[rank] = max([abs(loss.item() - eager.item())] + [
        ((p.grad - g).abs().max() / g.abs().max()).item() for p, g in zip(tp.parameters(), want)])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_tensor_parallel_model_compiles_in_one_graph(precision):
    """torch.compile(fullgraph=True) of a rank's TensorParallelLlama (every coda op it calls has a
    Meta kernel; the collectives are autograd functions Dynamo traces): the eager loss and
    gradients (aot_eager, fp64)."""
    got = run_gloo(compile_worker, WORLD, precision)
    assert sorted(got) == list(range(WORLD))
    assert all(e <= 1e-12 for e in got.values()), got


def refresh_worker(rank: int, world: int, out: dict) -> None:
    from coda.parallel import TensorParallelLlama

    model = build(False, vocab_size=44, **FP8_TP_CFG)
    model.precision = "fp8"
    tp = TensorParallelLlama(model)
    ids = torch.randint(0, 44, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = tp(ids, ids)
        for layer in tp.layers:  # a write the version counter does not see
            layer.w_down.data.mul_(0.5)
        stale = tp(ids, ids)
        tp.refresh_fp8_weights()
        fresh = tp(ids, ids)
        for layer in tp.layers:  # the same weights quantized from scratch
            layer.fp8_cache.clear()
        want = tp(ids, ids)
        tp.fp8_weight_cache = False  # nothing kept: refresh has nothing to quantize
        tp(ids, ids)
        tp.refresh_fp8_weights()
        kept = sum(len(layer.fp8_cache._entries) for layer in tp.layers)
    out[rank] = (before.item(), stale.item(), fresh.item(), want.item(), kept)


def test_tensor_parallel_refresh_fp8_weights_sees_writes_through_data():
    """A write through .data leaves a shard's FP8 operands stale until refresh_fp8_weights(),
    after which the loss is that of the weights quantized anew; with fp8_weight_cache=False
    nothing is kept, refresh included."""
    got = run_gloo(refresh_worker, WORLD)
    for before, stale, fresh, want, kept in got.values():
        assert stale == before and fresh != before and fresh == want, got
        assert kept == 0, got


def tp_fsdp_worker(rank: int, world: int, precision: str, out: dict) -> None:
    """Tensor x data parallelism on a 2 x 2 mesh: TensorParallelLlama over the "tp" dimension,
    FSDP2 over "dp" (a unit per layer, then the root); each dp half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from coda.parallel import TensorParallelLlama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = build(False, vocab_size=44, **(FP8_TP_CFG if precision == "fp8" else {}))
    model.precision = precision
    ids = torch.randint(0, 44, (4, 8), generator=torch.Generator().manual_seed(1))
    ref = model(ids, ids)  # every sequence counts 7 targets: the halves' mean is the mean
    ref.backward()
    tp = TensorParallelLlama(model, group=mesh["tp"].get_group())
    for layer in tp.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(tp, mesh=mesh["dp"])
    half = slice(2 * dp, 2 * dp + 2)
    loss = tp(ids[half], ids[half])
    loss.backward()  # FSDP2 averages the gradients over dp
    tp.all_reduce_replicated_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)
    pairs = grad_pairs(tp, model, tp_rank, 2, False, "vocab", 44)
    errs = {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()}
    errs["loss"] = abs(total.item() / 2 - ref.item()) / abs(ref.item())
    out[rank] = errs
    if precision == "fp8":  # FP8 weight operands kept between forwards (none under FSDP2)
        out[f"kept {rank}"] = sum(len(layer.fp8_cache._entries) for layer in tp.layers)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_tensor_parallel_under_fsdp2_matches_unsharded_fp64(precision):
    """TensorParallelLlama inside FSDP2 (2-D: tensor parallel within a pair of ranks, data
    parallel across the pairs, four gloo ranks): each layer runs as a module call, so FSDP2
    gathers its shard's parameters, and the FP8 shards quantize the gathered weights in every
    forward, keeping none. The unsharded model's loss over the whole batch and every gradient, in
    fp64; in FP8 the weight gradients to 1e-5 of their largest entry: their operands' 128x1 blocks
    along the tokens hold each data-parallel half's tokens, not the whole batch's (see
    test_distributed_cpu's FSDP2 FP8 test: the block scales differ by a power of two, which moves
    subnormal codes only)."""
    got = run_gloo(tp_fsdp_worker, 4, precision)
    kept = {k: got.pop(k) for k in [k for k in got if isinstance(k, str)]}
    assert sorted(got) == [0, 1, 2, 3]
    assert len(kept) == (4 if precision == "fp8" else 0)
    assert not any(kept.values()), f"FP8 weight operands kept between forwards: {kept}"
    for rank, errs in got.items():
        assert len(errs) == 6 * CFG["num_layers"] + 4, errs
        bad = {k: v for k, v in errs.items()
               if not v <= (1e-5 if precision == "fp8" and ".w_" in k else 1e-12)}
        assert not bad, f"rank {rank}: relative errors above the bound: {bad}"
