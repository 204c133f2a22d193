"""bench/suite_e2e.py's system names: a coda FP8 system may carry the FP8 epilogue placement its
process runs (`SYSTEM@PLACEMENT`), and a bad suffix is refused before any process starts. Its
rounds: the systems interleaved, one process each, a row the median of its rounds."""

import json
import os
import sys
import types

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


class FakeLaunch:
    """subprocess.run's stand-in: each system's step times per call, in call order; records the
    order of the calls."""

    def __init__(self, ms, fail=()):
        self.ms, self.fail, self.calls = {k: list(v) for k, v in ms.items()}, set(fail), []

    def __call__(self, cmd, **kw):
        system = cmd[3]
        self.calls.append(system)
        if system in self.fail:
            return types.SimpleNamespace(returncode=1, stdout="", stderr="out of memory")
        ms = self.ms[system].pop(0)
        row = dict(system=system, first_step_s=1.0, median_step_ms=ms, min_step_ms=ms - 1,
                   tokens_per_s=round(8192 / ms * 1e3), peak_gib=20.0 + len(self.calls),
                   first_loss=12.0, last_loss=9.0)
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(row) + "\n", stderr="")


def test_rounds_interleave_the_systems_and_take_the_median_of_the_rounds():
    launch = FakeLaunch({"hf_compile": [220.0, 230.0, 224.0],
                         "coda_fp8_z_recast": [178.0, 185.0, 179.0]})
    out = suite_e2e.run(progress=lambda m: None, models=["llama3-8B"],
                        systems=["hf_compile", "coda_fp8_z_recast"], rounds=3, launch=launch)
    assert launch.calls == ["hf_compile", "coda_fp8_z_recast"] * 3
    rows = {r["system"]: r for r in out["models"]["llama3-8B"]["rows"]}
    assert rows["hf_compile"]["round_ms"] == [220.0, 230.0, 224.0]
    assert rows["hf_compile"]["median_step_ms"] == 224.0
    assert rows["coda_fp8_z_recast"]["median_step_ms"] == 179.0
    assert rows["coda_fp8_z_recast"]["min_step_ms"] == 177.0
    assert rows["coda_fp8_z_recast"]["peak_gib"] == 26.0  # its rounds: calls 2, 4, 6
    assert rows["coda_fp8_z_recast"]["tokens_per_s"] == round(2 * 4096 / 179.0 * 1e3)
    assert rows["coda_fp8_z_recast"]["vs_best_peer"] == round(224.0 / 179.0, 3)
    assert out["config"]["rounds"] == 3


def test_a_system_absent_in_a_round_is_absent_and_not_run_again():
    launch = FakeLaunch({"hf_compile": [220.0, 221.0]}, fail=["coda_fp8"])
    out = suite_e2e.run(progress=lambda m: None, models=["llama3-8B"],
                        systems=["hf_compile", "coda_fp8"], rounds=2, launch=launch)
    res = out["models"]["llama3-8B"]
    assert launch.calls == ["hf_compile", "coda_fp8", "hf_compile"]
    assert [r["system"] for r in res["rows"]] == ["hf_compile"]
    assert "out of memory" in res["absent"]["coda_fp8"]


def test_one_round_keeps_the_process_row_as_it_is():
    launch = FakeLaunch({"coda": [200.0]})
    out = suite_e2e.run(progress=lambda m: None, models=["llama3-8B"], systems=["coda"],
                        launch=launch)
    (row,) = out["models"]["llama3-8B"]["rows"]
    assert "round_ms" not in row and row["median_step_ms"] == 200.0


def test_rounds_below_one_are_refused():
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        suite_e2e.run(progress=lambda m: None, models=["llama3-8B"], systems=["coda"], rounds=0)
