"""bench/suite_e2e.py's system names: a coda FP8 system may carry the FP8 epilogue placement its
process runs (`SYSTEM@PLACEMENT`), and a bad suffix is refused before any process starts."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

import suite_e2e  # noqa: E402


def test_a_plain_name_has_no_placement():
    assert suite_e2e.placement_of("hf_compile") == ("hf_compile", None)
    assert suite_e2e.placement_of("coda_fp8_z_recast") == ("coda_fp8_z_recast", None)


@pytest.mark.parametrize("placement", ["auto", "fused", "split"])
def test_an_fp8_system_takes_each_placement(placement):
    assert suite_e2e.placement_of(f"coda_fp8_z_recast@{placement}") == (
        "coda_fp8_z_recast", placement)
    assert suite_e2e.placement_of(f"coda_patched_fp8@{placement}") == (
        "coda_patched_fp8", placement)


def test_a_placement_on_a_bf16_or_peer_system_is_refused():
    for name in ("coda@split", "hf_compile@fused", "torchao_fp8_rowwise@split"):
        with pytest.raises(ValueError, match="is for coda's FP8 systems"):
            suite_e2e.placement_of(name)


def test_an_unknown_placement_is_refused_before_any_process():
    with pytest.raises(ValueError, match="must be one of auto, fused, split, got 'splt'"):
        suite_e2e.run(progress=lambda m: None, models=["llama3-8B"],
                      systems=["hf_compile", "coda_fp8@splt"])
