"""torch.compile(fullgraph=True) over the coda model: no graph breaks, and the compiled forward +
backward give eager's loss and gradients."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from coda.nn import CodaLlamaForCausalLM, LlamaConfig
from helpers import assert_rel

CONFIG = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0,
                     rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=32),
                     rms_norm_eps=1e-5)


def make_model(dtype, tie=False, qk_norm=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CONFIG.__dict__, "tie_word_embeddings": tie, "qk_norm": qk_norm})
    model = CodaLlamaForCausalLM(cfg, dtype=dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "gamma" in n:  # the norms' weights, the QK-norm's too
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model


def batch(B=2, S=9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, CONFIG.vocab_size, (B, S), generator=g)
    labels[0, 2:4] = -100
    return ids, labels


def loss_and_grads(fn, model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, labels=labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def check_compiled(backend, dtype, tie=False, rel=1e-12, qk_norm=False):
    torch._dynamo.reset()
    model = make_model(dtype, tie, qk_norm)
    ids, labels = batch()
    eager = loss_and_grads(model, model, ids, labels)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = loss_and_grads(compiled, model, ids, labels)
    assert_rel(got[0], eager[0], rel, "loss")
    assert set(got[1]) == set(eager[1])
    for n in eager[1]:
        assert_rel(got[1][n], eager[1][n], rel, f"grad {n}")
    # a second call reuses the graph (no recompilation into a different result)
    again = loss_and_grads(compiled, model, ids, labels)
    assert_rel(again[0], eager[0], rel, "loss (second call)")


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compile_aot_eager_fullgraph(dtype, tie):
    # fullgraph=True turns any graph break into an error
    check_compiled("aot_eager", dtype, tie)


def test_compile_aot_eager_fullgraph_qk_norm():
    # Qwen3's QK-norm op (two outputs, one of them saved for the backward only)
    check_compiled("aot_eager", torch.float64, qk_norm=True)


@pytest.mark.skipif(os.environ.get("CODA_TEST_INDUCTOR", "1") == "0",
                    reason="CODA_TEST_INDUCTOR=0")
def test_compile_inductor_fullgraph():
    # Inductor generates C++ for the surrounding PyTorch ops; the coda ops stay extern calls.
    check_compiled("inductor", torch.float32, rel=1e-5)


def run_python(code):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


FALLBACKS_AFTER_IMPORT = """
import importlib.util, sys, torch, coda
print("LOADED_EARLY", "torch._inductor.lowering" in sys.modules)
assert importlib.util.find_spec("torch._inductor.lowering") is not None  # a probe, no import
from torch._inductor.lowering import lowerings
import torch._inductor.lowering as lowering_module
assert type(lowering_module.__loader__).__name__ == "SourceFileLoader", lowering_module.__loader__
ops = []
for qualified in torch._C._dispatch_get_all_op_names():
    # ops with a CompositeImplicitAutograd kernel never reach Inductor
    if qualified.startswith("coda::") and not torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified, "CompositeImplicitAutograd"):
        base, _, overload = qualified.split("::")[1].partition(".")
        ops.append(getattr(getattr(torch.ops.coda, base), overload or "default"))
print("OPS", len(ops))
print("MISSING", [str(op) for op in ops if op not in lowerings])
"""


def test_import_defers_the_inductor_fallbacks_until_inductor_loads():
    # `import coda` does not pay for importing Inductor; importing Inductor's lowering table
    # afterwards (after a find_spec probe of it, too) registers a fallback for every coda op
    out = run_python(FALLBACKS_AFTER_IMPORT)
    assert "LOADED_EARLY False" in out, out
    assert "OPS 0" not in out, out
    assert "MISSING []" in out, out


@pytest.mark.skipif(os.environ.get("CODA_TEST_INDUCTOR", "1") == "0",
                    reason="CODA_TEST_INDUCTOR=0")
def test_inductor_never_formats_the_implicit_fallback_message_for_coda_ops(monkeypatch):
    # The message's text grows exponentially with depth (python/coda/_inductor.py); with the
    # fallbacks registered up front Inductor has no reason to build it for a coda op.
    from torch._inductor import exc

    original = exc.OperatorIssue.operator_str

    def refusing(target, args, kwargs):
        # fail at once rather than spend minutes formatting the message
        assert not str(target).startswith("coda"), f"Inductor formats the message for {target}"
        return original(target, args, kwargs)

    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(refusing))
    torch._dynamo.reset()
    cfg = LlamaConfig(**{**CONFIG.__dict__, "num_layers": 4})
    torch.manual_seed(0)
    model = CodaLlamaForCausalLM(cfg, dtype=torch.float32)
    ids, labels = batch()
    eager = loss_and_grads(model, model, ids, labels)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    # a cached graph would skip the lowering this test is about
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = loss_and_grads(compiled, model, ids, labels)
    torch._dynamo.reset()
    assert_rel(got[0], eager[0], 1e-5, "loss")
    for n in eager[1]:
        assert_rel(got[1][n], eager[1][n], 1e-5, f"grad {n}")


def fp8_twins():
    """(config, two FP8 models with the same weights): fp32 on the CPU, tiny."""
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    eager = CodaLlamaForCausalLM(cfg, dtype=torch.float32, precision="fp8")
    compiled = CodaLlamaForCausalLM(cfg, dtype=torch.float32, precision="fp8")
    compiled.load_state_dict(eager.state_dict())
    return cfg, eager, compiled


@pytest.mark.parametrize("whole", [False, True], ids=["per-block", "fullgraph"])
def test_fp8_model_compiled_trains_as_eager(whole):
    """precision="fp8" with each decoder layer torch.compile'd (the documented way), or the whole
    model under fullgraph=True (the casts' Meta kernels; the weights cast inside the graph, as
    Dynamo cannot guard on a version counter): three SGD steps give the eager FP8 model's losses
    and gradients exactly (aot_eager, fp32 on the CPU), so the compiled model computes with each
    step's updated weights."""
    cfg, eager, compiled = fp8_twins()
    run = compiled
    if whole:
        run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    else:
        for layer in compiled.layers:
            layer.compile(backend="aot_eager")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (eager, compiled)]
    losses = []
    for _ in range(3):
        pair = []
        for m, opt in zip((eager, run), opts):
            loss = m(ids, ids)
            loss.backward()
            pair.append(loss.item())
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(p.grad, q.grad), f"d {n}"
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert pair[0] == pair[1], pair
        losses.append(pair[0])
    assert len(set(losses)) == 3, losses  # the steps moved the weights


@pytest.mark.parametrize("backend,recompute_a,fp8_z", [("aot_eager", False, False),
                                                       ("aot_eager", True, True),
                                                       ("inductor", False, False)],
                         ids=["kept-a", "recompute-a-fp8-z", "inductor"])
def test_fp8_model_compiled_at_dynamic_shapes_trains_as_eager(backend, recompute_a, fp8_z):
    """The FP8 model compiled with dynamic=True runs sequence lengths 24 and 40 (its Meta
    kernels take symbolic sizes, and the backward's branches on a's copy and on z's dtype read
    the op's flags, not a size; with fp8_z z travels as e4m3 codes with their scales). aot_eager
    gives eager's loss and gradients exactly (fp32 on the CPU); without
    symbolic-size Meta kernels the trace fails on the first call. Inductor (torch.compile's
    default backend) keeps the coda ops as fallback kernels and fuses what lies between them:
    eager's to fp32 rounding."""
    tol = 0.0 if backend == "aot_eager" else 1e-5
    cfg, eager, compiled = fp8_twins()
    eager.fp8_recompute_a = compiled.fp8_recompute_a = recompute_a
    eager.fp8_z = compiled.fp8_z = fp8_z
    run = torch.compile(compiled, dynamic=True, backend=backend)
    for seq in (24, 40):
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=gen)
        want, got = eager(ids, ids), run(ids, ids)
        want.backward()
        got.backward()
        assert abs(want.item() - got.item()) <= tol * abs(want.item()), (seq, want, got)
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert (q.grad - p.grad).abs().max() <= tol * p.grad.abs().max(), f"d {n} at {seq}"
            p.grad = q.grad = None
    torch._dynamo.reset()
