#!/usr/bin/env python3
"""Warp-state samples of one pingpong GEMM kernel by region, from ncu's SASS source export.

Input: the gzipped CSV of
    ncu --section SourceCounters -k regex:device_kernel -c 1 -o X <bench> ...
    ncu -i X.ncu-rep --page source --csv --print-source sass | gzip > X.csv.gz
Regions, found from the SASS itself (CUTLASS's sm90 pingpong kernel lays out setup, the consumer
warpgroup's mainloop and epilogue, the producer warps, then the out-of-line retry loops of its
mbarrier waits):
    mainloop   the WARPGROUP.ARRIVE before the first HGMMA .. the last `WARPGROUP.DEPBAR gsb0, 0x0`
    pre-mainloop wait  the 16 instructions before it (the warpgroup's wait for its MMA turn and the
               first operand stage)
    epilogue   after the mainloop .. the consumer's EXIT
    producer   after that .. the first retry loop
Retry-loop samples count for the region they return to. Within the epilogue it also sums the
samples on its proxy fences (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S) and named barriers (BAR.SYNC),
each with the instruction after it, where a wait for it is sampled, and on its mbarrier waits
(TRYWAIT and its branch).
These boundaries hold for the kernels profiled in runs 55, 60 and 72 (bench/results); check them
(printed) before trusting a new kernel's split.

Usage: bench/ncu_sass_regions.py FILE.csv.gz [FILE.csv.gz ...]
"""
import csv
import gzip
import re
import sys


def load(path):
    header, rows = None, []
    with gzip.open(path, "rt") as f:
        for row in csv.reader(f):
            if row and row[0] == "Address":
                header = row
            elif len(row) > 3 and row[0].startswith("0x"):
                rows.append(row)
    if header is None:
        sys.exit(f"{path}: no 'Address' header: not an ncu --page source --csv export")
    return header, rows


def split(path):
    header, rows = load(path)
    samples_col = header.index("Warp Stall Sampling (All Samples)")
    src = [r[1].strip() for r in rows]
    samples = [int(r[samples_col]) for r in rows]
    index_of = {int(r[0], 16): i for i, r in enumerate(rows)}

    first_mma = min(i for i, s in enumerate(src) if "HGMMA" in s)
    last_mma = max(i for i, s in enumerate(src) if "HGMMA" in s)
    ml_start = max(i for i in range(first_mma) if "WARPGROUP.ARRIVE" in src[i])
    ml_end = min(i for i in range(last_mma, len(src)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in src[i])
    consumer_exit = min(i for i in range(ml_end, len(src)) if re.search(r"\bEXIT\b", src[i]))
    retry_start = len(src)
    for i, s in enumerate(src):
        m = re.match(r"@!?P\d\s+BRA (0x[0-9a-f]+)", s)
        if m and i > 0 and "TRYWAIT" in src[i - 1]:
            target = index_of.get(int(m.group(1), 16))
            if target is not None and target > i + 50:
                retry_start = min(retry_start, target)

    region = []
    for i in range(len(src)):
        if i >= retry_start:
            region.append("retry")
        elif i > consumer_exit:
            region.append("producer")
        elif i > ml_end:
            region.append("epilogue")
        elif i >= ml_start:
            region.append("mainloop")
        elif i >= ml_start - 16:
            region.append("pre-mainloop wait")
        else:
            region.append("setup")
    # Each retry loop ends with an unconditional branch back to its wait.
    i = retry_start
    while i < len(src):
        j = i
        while j < len(src) and not re.match(r"BRA (0x[0-9a-f]+)", src[j]):
            j += 1
        if j < len(src):
            target = index_of.get(int(re.match(r"BRA (0x[0-9a-f]+)", src[j]).group(1), 16))
            owner = region[target] if target is not None else "retry"
            for k in range(i, j + 1):
                region[k] = owner
        i = j + 1

    totals = {}
    for r, s in zip(region, samples):
        totals[r] = totals.get(r, 0) + s
    # Fences and barriers in the epilogue: the instructions themselves and the one after each
    # (where a wait for them is sampled).
    counted, waits = set(), 0
    fences = sum(1 for i in range(ml_end + 1, consumer_exit + 1) if "MEMBAR.ALL.CTA" in src[i])
    for i in range(ml_end + 1, consumer_exit + 1):
        if any(op in src[i] for op in ("MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S", "BAR.SYNC")):
            counted.update((i, i + 1))
        if "TRYWAIT" in src[i]:
            waits += samples[i] + samples[i + 1]
    fence = sum(samples[i] for i in counted if i <= consumer_exit)
    bounds = (ml_start, ml_end, consumer_exit, retry_start)
    return sum(samples), totals, bounds, fence, fences, waits


def main(paths):
    for path in paths:
        total, totals, bounds, fence, sequences, waits = split(path)
        print(f"{path}: {total} samples; instruction indices mainloop {bounds[0]}-{bounds[1]}, "
              f"consumer EXIT {bounds[2]}, retry loops from {bounds[3]}")
        for name, v in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:20s} {v:7d}  {100 * v / total:5.1f}%")
        epi = totals.get("epilogue", 0)
        if epi:
            print(f"  epilogue: {sequences} proxy fences; fences and barriers {fence} "
                  f"({100 * fence / epi:.0f}%), mbarrier waits {waits} ({100 * waits / epi:.0f}%)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
