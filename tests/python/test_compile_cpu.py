"""torch.compile(fullgraph=True) over the coda model: no graph breaks, and the compiled forward +
backward give eager's loss and gradients."""

from __future__ import annotations

import os

import pytest
import torch

from coda.nn import CodaLlamaForCausalLM, LlamaConfig
from helpers import assert_rel

CONFIG = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0,
                     rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=32),
                     rms_norm_eps=1e-5)


def make_model(dtype, tie=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CONFIG.__dict__, "tie_word_embeddings": tie})
    model = CodaLlamaForCausalLM(cfg, dtype=dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "gamma" in n:
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


def check_compiled(backend, dtype, tie=False, rel=1e-12):
    torch._dynamo.reset()
    model = make_model(dtype, tie)
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


@pytest.mark.skipif(os.environ.get("CODA_TEST_INDUCTOR", "1") == "0",
                    reason="CODA_TEST_INDUCTOR=0")
def test_compile_inductor_fullgraph():
    # Inductor generates C++ for the surrounding PyTorch ops; the coda ops stay extern calls.
    check_compiled("inductor", torch.float32, rel=1e-5)
