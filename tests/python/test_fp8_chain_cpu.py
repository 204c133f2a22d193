"""The fp8-chain benchmark section's correctness gate (bench/suite_fp8_chain.py's run_shape, no
timing) on the CPU at a tiny shape with a ragged M (200 tokens): our FP8 block ops' chain forward + backward (their CPU
kernels: the recipe in fp32), the FP8 GEMM-only floor on our GEMMs and our bf16 chain, each
against an fp32 evaluation of the same chain by the section's own rule; the GPU run times only
the variants that pass it. torchao and cuBLASLt are absent on the CPU (recorded as such)."""

from __future__ import annotations

import os
import sys


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import suite_fp8_chain as fc  # noqa: E402


def test_fp8_chain_variants_pass_the_sections_check_on_the_cpu():
    sec = {"rows": []}
    row = fc.run_shape((256, 4, 2, 64, 512), 200, sec, None, torchao=None, time_it=False,
                       dev="cpu", emulate_torchao=True, compile_torchao=False, profile=True)
    assert {k: row["check"].get(k) for k in ("coda_fp8", "fp8_floor_coda", "coda_bf16",
                                             "stages")} == {
        "coda_fp8": "PASS", "fp8_floor_coda": "PASS", "coda_bf16": "PASS", "stages": "PASS"}
    # The profile's cut chain (each op on leaves of its own, fed the gradients the chain hands
    # it) gives the whole chain's gradients: its six stages are the chain.
    assert set(row["rel_err"]["stages"]) == set(fc.GRADS)
    # The FP8 chain's error is the recipe's (a few per cent per tensor), not bf16's: the check
    # really compares quantized results.
    errs = row["rel_err"]["coda_fp8"]
    assert set(errs) >= {"x2", "qkv", "wo", "wgu", "wd", "wqkv"}
    assert 1e-3 < max(errs.values()) <= fc.FP8_TOL
    # With z saved in FP8 the same check passes; the forward's outputs are unchanged and the
    # gate/up weight gradient moves (the backward reads the decoded z).
    assert row["check"].get("coda_fp8_z") == "PASS"
    errs_z = row["rel_err"]["coda_fp8_z"]
    assert errs_z["x2"] == errs["x2"] and errs_z["qkv"] == errs["qkv"]
    assert errs_z["wgu"] != errs["wgu"] and max(errs_z.values()) <= fc.FP8_TOL
    # The weight gradients pinned to our kernel pass the same check (on the CPU the op has no
    # other backend, so its errors are the chain's own).
    assert row["check"].get("coda_fp8_cutlass") == "PASS"
    assert row["rel_err"]["coda_fp8_cutlass"] == errs
    assert sec["rows"] == [row]
