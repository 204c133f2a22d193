"""bench/ncu_sass_regions.py: region boundaries and retry-loop attribution on a synthetic SASS
export, and on the committed B2 profiles of runs 55 and 72 (five and six mainloop stages)."""

import csv
import gzip
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
RESULTS = os.path.join(BENCH, "results")
sys.path.insert(0, BENCH)

import ncu_sass_regions as regions  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples"]


def write_export(path, program):
    """program: (sass, samples) pairs at consecutive 16-byte addresses from 0x1000."""
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "synthetic"])
        w.writerow(HEADER)
        for i, (sass, samples) in enumerate(program):
            w.writerow([hex(0x1000 + 16 * i), sass, str(samples), str(samples)])


def addr(i):
    return hex(0x1000 + 16 * i)


def synthetic_program():
    # 0-19 setup and the pre-mainloop wait (its TRYWAIT retries at 80), 20-23 mainloop,
    # 24-29 epilogue (a fence, a barrier, a TRYWAIT retrying at 83), 30 the consumer's EXIT,
    # 31-79 producer, 80-85 two retry loops.
    p = [("NOP", 1)] * 20
    p[17] = ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 5)
    p[18] = (f"@!P0  BRA {addr(80)}", 7)
    p += [("WARPGROUP.ARRIVE", 2), ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 11),
          ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88, gsb0", 13),
          ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 17), ("NOP", 0)]
    p += [("MEMBAR.ALL.CTA", 19), ("FENCE.VIEW.ASYNC.S", 23),
          ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x80", 29),
          ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R3", 31), (f"@!P1  BRA {addr(83)}", 37),
          ("EXIT", 41)]
    p += [("UTMALDG.3D [UR8], [UR10]", 43)] + [("NOP", 0)] * 48
    p += [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 47), (f"@!P0  BRA {addr(80)}", 53),
          (f"BRA {addr(19)}", 59),
          ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R3", 61), (f"@!P1  BRA {addr(83)}", 67),
          (f"BRA {addr(29)}", 71)]
    return p


def test_synthetic_regions_and_retry_attribution(tmp_path):
    path = tmp_path / "k.csv.gz"
    program = synthetic_program()
    write_export(path, program)
    total, totals, bounds, fence, fences, waits = regions.split(str(path))
    assert total == sum(s for _, s in program)
    assert sum(totals.values()) == total
    assert bounds == (20, 23, 30, 80)
    # The first retry loop returns into the pre-mainloop wait, the second into the epilogue.
    # The 16 instructions before the mainloop (4-19: 14 NOPs and the wait) and its retry loop.
    assert totals["setup"] == 4
    assert totals["pre-mainloop wait"] == 14 + 5 + 7 + 47 + 53 + 59
    assert totals["mainloop"] == 2 + 11 + 13 + 17
    assert totals["epilogue"] == 0 + 19 + 23 + 29 + 31 + 37 + 41 + 61 + 67 + 71
    assert totals["producer"] == 43
    assert "retry" not in totals
    assert fences == 1
    # MEMBAR, FENCE.VIEW and BAR.SYNC, each with the instruction after it.
    assert fence == 19 + 23 + 29 + 31
    assert waits == 31 + 37


def test_committed_b2_profiles():
    five = os.path.join(RESULTS, "2026-11-30-run55-ncu-b2-sass.csv.gz")
    six = os.path.join(RESULTS, "2026-11-30-run72-ncu-b2-six-stages-sass.csv.gz")
    for path, expected_fences in ((five, 16), (six, 8)):
        total, totals, bounds, fence, fences, waits = regions.split(path)
        assert sum(totals.values()) == total
        assert totals.get("retry", 0) == 0
        ml_start, ml_end, consumer_exit, retry_start = bounds
        assert 0 < ml_start < ml_end < consumer_exit < retry_start
        # The stock collective fences twice per 64x32 subtile (after reading C, before the TMA
        # store): 16 in a 128x128 tile. With C's buffers reused for D (run 67) the first goes.
        assert fences == expected_fences
        assert 0 < fence < totals["epilogue"]
