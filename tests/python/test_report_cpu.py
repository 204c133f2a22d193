"""bench/suite_report.py and report.py's README block, on a synthetic suite results file: the
speed ratios are baseline / ours, bold only where we are faster, and every absent baseline is
reported with its reason."""

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

import report  # noqa: E402
import suite_report as sr  # noqa: E402


def op_row(op, mnk, ms, check, fused_over_plain, tflops):
    return {"model": "llama3-1B", "m": 8192, "op": op, "gemm_mnk": mnk, "ms": ms,
            "err": {"coda": 0.01, "eager": 0.02}, "check": check,
            "fused_over_plain": fused_over_plain, "tflops": {"coda": tflops}}


def suite_file(tmp_path):
    ops = [
        op_row("F1 out-proj", [8192, 2048, 2048],
               {"coda": 0.20, "coda_fused": 0.19, "coda_plain_gemm": 0.18, "cublas_gemm": 0.17,
                "eager": 0.50, "compile": 0.25, "liger": 0.16, "flashinfer": 0.40},
               {"coda": "PASS", "eager": "PASS"}, 0.19 / 0.18, 344.0),
        op_row("B2 SwiGLU bwd", [8192, 8192, 2048],
               {"coda": 0.60, "coda_fused": 0.58, "coda_plain_gemm": 0.40, "cublas_gemm": 0.41,
                "eager": 1.40, "compile": 0.70},
               {"coda": "PASS", "liger": "FAIL"}, 0.58 / 0.40, 458.0),
    ]
    d = {
        "commit": "abc",
        "device": "test",
        "command": "synthetic",
        "elapsed_s": 1.0,
        "absent": {"flashinfer": "kernels not built"},
        "sections": {
            "ops": {"rows": ops},
            "chain": {
                "rows": [
                    {
                        "model": "llama3-8B",
                        "m": 8192,
                        "pass": "fwd+bwd",
                        "check": "PASS",
                        "ms_coda": 2.0,
                        "ms_eager": 3.0,
                        "ms_compile": 2.5,
                        "ms_gemm_only": 1.8,
                        "speedup_vs_best_baseline": 1.25,
                    }
                ],
                "absent": {"liger": "not installed"},
            },
        },
    }
    path = tmp_path / "2026-01-01.json"
    path.write_text(json.dumps(d))
    return str(path), d


def test_ratios_bold_only_where_faster(tmp_path):
    path, d = suite_file(tmp_path)
    table = "\n".join(sr.ops_table(path, d, str(tmp_path / "img")))
    f1 = next(line for line in table.splitlines() if "F1 out-proj" in line)
    cells = [c.strip() for c in f1.split("|")]
    # vs eager 0.50 / 0.20 = 2.50 (faster: bold); vs Liger 0.16 / 0.20 = 0.80 (slower: plain)
    assert "**2.50**" in cells and "0.80" in cells and "**0.80**" not in cells
    assert "**1.25**" in cells  # vs compile 0.25 / 0.20
    b2 = next(line for line in table.splitlines() if "B2 SwiGLU bwd" in line)
    assert "1.450" in b2  # fused / plain = 0.58 / 0.40
    assert "check failed: liger" in b2


def test_summary_lists_misses_and_absences(tmp_path):
    path, d = suite_file(tmp_path)
    text = "\n".join(sr.summary(path, d))
    assert "B2 SwiGLU bwd llama3-1B M=8192 1.45×" in text  # above the 1.05 backward target
    assert "flashinfer absent: kernels not built" in text
    assert "chain: liger absent: not installed" in text
    chain = next(
        line for line in text.splitlines() if line.startswith("| layer chain forward + backward")
    )
    # one shape: vs eager 3.0 / 2.0, vs compile 2.5 / 2.0, vs the GEMM-only floor 1.8 / 2.0
    assert "**1.50**" in chain and "**1.25**" in chain and "0.90 (worst" in chain


def test_readme_block_replaced_between_markers(tmp_path):
    path, d = suite_file(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.README_BEGIN}\nold line\n{report.README_END}\n\n## After\n")
    report.write_readme(sr.readme_section(path, d), str(readme))
    text = readme.read_text()
    assert "old line" not in text and "## After" in text
    assert (
        "Layer chain forward + backward vs the best of eager / torch.compile / Liger: "
        "8B M=8192 1.25×" in text
    )


def lm_head_only_run(tmp_path, started):
    row = {"H": 2048, "M": 8192, "V": 128256, "ms": {"coda_chunked": 2.0, "compile": 1.8},
           "peak_extra_MiB": {"coda_chunked": 100.0, "compile": 200.0}}
    run = {"commit": "def", "device": "test", "command": "lm only", "started": started,
           "sections": {"lm_head": {"rows": [row], "chunk_bytes": 1 << 30}}}
    (tmp_path / "2026-01-02-run9-lm-head-suite.json").write_text(json.dumps(run))


def test_later_lm_head_run_replaces_rows_and_names_its_source(tmp_path):
    path, d = suite_file(tmp_path)
    d["started"] = "2026-01-01T10:00:00"
    lm_head_only_run(tmp_path, "2026-01-02T09:00:00")
    report.with_later_lm_head(d, str(tmp_path))
    table = "\n".join(sr.lm_head_table(path, d))
    assert "2026-01-02-run9-lm-head-suite.json (commit def" in table
    assert "0.90" in table  # vs compile 1.8 / 2.0, from the later file
    text = "\n".join(sr.summary(path, d))
    assert "LM head rows from a later run" in text


def test_earlier_lm_head_run_leaves_a_newer_full_run_alone(tmp_path):
    path, d = suite_file(tmp_path)
    d["started"] = "2026-01-03T10:00:00"
    before = json.dumps(d["sections"].get("lm_head"), sort_keys=True)
    lm_head_only_run(tmp_path, "2026-01-02T09:00:00")
    report.with_later_lm_head(d, str(tmp_path))
    assert json.dumps(d["sections"].get("lm_head"), sort_keys=True) == before
    assert "LM head rows from a later run" not in "\n".join(sr.summary(path, d))


def sustained_file(tmp_path, name="2026-01-01-run7-sustained.json"):
    single = {"model": "llama3-1B", "m": 8192, "pass": "fwd+bwd", "check": "PASS", "ms_coda": 4.0,
              "ms_compile": 4.8, "ms_gemm_only": 3.9, "speedup_vs_best_baseline": 1.2}
    sustained = {"model": "llama3-1B", "m": 8192, "pass": "fwd+bwd sustained", "check": "PASS",
                 "batch": 20, "ms_coda": 4.5, "ms_compile": 4.6, "ms_gemm_only": 4.1,
                 "speedup_vs_best_baseline": 4.6 / 4.5, "sm_clock_mhz_coda": 1410.0,
                 "sm_clock_mhz_compile": 1785, "sm_clock_mhz_gemm_only": None}
    # A shape with no sustained row is left out: there is nothing to set it against.
    lone = dict(single, model="llama3-8B")
    d = {"commit": "abc", "device": "test", "command": "chain_train_bench --sustained 20",
         "rows": [single, sustained, lone]}
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def test_sustained_table_sets_each_shape_against_its_single_runs(tmp_path):
    table = "\n".join(report.sustained_table(sustained_file(tmp_path)))
    rows = [line for line in table.splitlines() if line.startswith("| llama3")]
    assert len(rows) == 1  # the 8B shape has no sustained row
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[3:8] == ["4.000 / 4.800 / 3.900", "1.200", "4.500 / 4.600 / 4.100", "1.022",
                          "1410 / 1785 / —"]
    assert "batches of 20 steps" in table


def test_readme_line_gives_sustained_and_single_speedups(tmp_path):
    path = sustained_file(tmp_path)
    line = "\n".join(report.sustained_readme_line(path))
    assert "1B/8192: 1.022 (single 1.200)" in line
    assert "8B/8192" not in line  # no sustained row for it
    assert "SM clock" not in line  # the floor's clock is missing: no clock claim
    d = json.load(open(path))
    d["rows"][1]["sm_clock_mhz_gemm_only"] = 1500
    open(path, "w").write(json.dumps(d))
    assert "SM clock ran 6% below the GEMM-only" in "\n".join(report.sustained_readme_line(path))


def test_clock_range_names_shapes_that_ran_above_the_floor():
    assert report.clock_range([0.02, 0.09]) == "2-9% below"
    assert report.clock_range([-0.029, 0.07]) == "from 3% above to 7% below"  # run 127's 1B / 8192
    assert report.clock_range([-0.05, -0.01]) == "1-5% above"
    assert report.clock_range([0.061, 0.064]) == "6% below"  # one value where both round alike


def test_sustained_files_skip_other_benchmarks_files(tmp_path):
    chain = sustained_file(tmp_path, "2026-01-01-run7-sustained.json")
    # A later coda_gemm_bench --sustained file has the same ending and no chain rows.
    (tmp_path / "2026-01-01-run8-xty-sustained.json").write_text(
        json.dumps({"rows": [{"kind": "sustained", "ms": 1.0}]}))
    assert report.sustained_files(str(tmp_path)) == [chain]


def test_the_suites_sustained_section_reads_like_the_earlier_files(tmp_path):
    earlier = sustained_file(tmp_path, "2026-01-01-run7-sustained.json")
    d = json.load(open(earlier))
    # bench/suite.py --sections sustained: the same rows under sections.sustained, and a later run.
    suite = {"benchmark": "suite", "commit": "def", "device": "test", "torch": "t", "cuda": "c",
             "command": "suite.py --sections sustained", "absent": {},
             "sections": {"sustained": {"rows": [dict(r, ms_coda=r["ms_coda"] * 0.9)
                                                 for r in d["rows"]]}}}
    later = tmp_path / "2026-01-01-run8-sustained.json"
    later.write_text(json.dumps(suite))
    files = report.sustained_files(str(tmp_path))
    assert files == [str(later), earlier]
    pairs = report.sustained_rows(files)
    assert list(pairs) == [("llama3-1B", 8192)] and pairs[("llama3-1B", 8192)]["path"] == str(later)
    table = "\n".join(report.sustained_table(files))
    assert "commit `def`" in table and "| 3.600 / 4.800 / 3.900 |" in table


def test_the_training_comparison_table_reads_the_suite_section(tmp_path):
    train = {"config": {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "vocab": 32000,
                        "steps": 200}, "tokens_per_step": 8192,
             "median_step_ms": {"hf_eager": 100.0, "coda": 80.0},
             "tokens_per_s": {"hf_eager": 81920.0, "coda": 102400.0}, "max_rel_diff": 1e-3,
             "max_rel_diff_step": 7, "mean_rel_diff_last_50": 1e-4}
    meta = {"benchmark": "suite", "commit": "abc", "device": "test", "command": "suite.py",
            "absent": {}}
    path = tmp_path / "2026-01-01-run1-train-compare.json"
    path.write_text(json.dumps(dict(meta, sections={"train": train})))
    assert "| coda | 80.00 | 102400 |" in "\n".join(report.train_compare_table(str(path)))


def test_a_later_partial_run_keeps_the_earlier_runs_other_shapes(tmp_path):
    earlier = sustained_file(tmp_path, "2026-01-01-run7-sustained.json")  # 1B / 8192
    d = json.load(open(earlier))
    moved = [dict(r, m=16384) for r in d["rows"][:2]]  # 1B / 16384, both passes
    d["rows"] += moved
    open(earlier, "w").write(json.dumps(d))
    # A later run of 1B / 8192 only, with another speedup, and a lone single row for 16384 (cut
    # short before its sustained batch): its pair wins, 16384 comes whole from the earlier file.
    later_rows = [dict(d["rows"][0], ms_coda=3.0, speedup_vs_best_baseline=1.6),
                  dict(d["rows"][1], speedup_vs_best_baseline=1.1),
                  dict(d["rows"][0], m=16384, speedup_vs_best_baseline=9.9)]
    later = tmp_path / "2026-01-01-run10-70B-sustained.json"
    later.write_text(json.dumps(dict(d, commit="def", rows=later_rows)))
    files = report.sustained_files(str(tmp_path))
    assert files == [str(later), earlier]  # run 10 sorts after run 7
    pairs = report.sustained_rows(files)
    assert list(pairs) == [("llama3-1B", 8192), ("llama3-1B", 16384)]
    assert pairs[("llama3-1B", 8192)]["path"] == str(later)
    assert pairs[("llama3-1B", 16384)]["path"] == earlier
    assert pairs[("llama3-1B", 16384)]["single"]["speedup_vs_best_baseline"] == 1.2  # not 9.9
    table = "\n".join(report.sustained_table(files))
    assert "commit `def`" in table and "commit `abc`" in table
    assert "Rows: llama3-1B 8192." in table and "Rows: llama3-1B 16384." in table
    line = "\n".join(report.sustained_readme_line(files))
    assert "1B/8192: 1.100 (single 1.600)" in line and "1B/16384: 1.022 (single 1.200)" in line


def test_a_failed_shape_is_shown_not_replaced_by_an_older_pass(tmp_path):
    earlier = sustained_file(tmp_path, "2026-01-01-run7-sustained.json")  # 1B / 8192 passes
    d = json.load(open(earlier))
    later_rows = [dict(d["rows"][0], check="FAIL"), dict(d["rows"][1])]
    (tmp_path / "2026-01-01-run8-sustained.json").write_text(json.dumps(dict(d, rows=later_rows)))
    files = report.sustained_files(str(tmp_path))
    pairs = report.sustained_rows(files)
    assert pairs[("llama3-1B", 8192)].get("failed")
    table = "\n".join(report.sustained_table(files))
    assert "| llama3-1B | 8192 | FAIL" in table
    assert "1B/8192: FAIL" in "\n".join(report.sustained_readme_line(files))


def test_an_older_days_run_does_not_fill_in(tmp_path):
    sustained_file(tmp_path, "2025-12-31-run3-sustained.json")  # 1B / 8192, a day earlier
    d = json.load(open(tmp_path / "2025-12-31-run3-sustained.json"))
    later = [dict(r, model="llama3-8B") for r in d["rows"][:2]]
    (tmp_path / "2026-01-01-run1-sustained.json").write_text(json.dumps(dict(d, rows=later)))
    pairs = report.sustained_rows(report.sustained_files(str(tmp_path)))
    assert list(pairs) == [("llama3-8B", 8192)]


def e2e_row(system, tok_s, peak, first, last):
    return {"system": system, "median_step_ms": 16384 / tok_s * 1e3, "tokens_per_s": tok_s,
            "peak_gib": peak, "first_loss": first, "last_loss": last}


def test_e2e_rows_that_do_not_train_are_marked_and_ratios_use_the_bf16_peers(tmp_path):
    """A system whose loss drops far less than coda bf16's from the same start is marked LAGS
    (its speed no result); `vs bf16 peer` divides by the fastest non-coda, non-torchao system."""
    rows = [e2e_row("coda_fp8", 72000, 25.0, 12.0, 11.9), e2e_row("coda", 63000, 21.0, 12.0, 11.0),
            e2e_row("torchao_fp8_tensorwise", 70000, 30.0, 12.0, 11.1),
            e2e_row("liger", 60000, 26.0, 12.0, 11.0)]
    shape = {"layers": 16, "batch": 4, "seq": 4096}
    d = {"commit": "abc", "device": "test", "commands": ["synthetic"],
         "sections": {"e2e": {"models": {"llama3.2-1B": {"shape": shape, "rows": rows}}}}}
    path = tmp_path / "2026-01-01-fp8-e2e.json"
    path.write_text(json.dumps(d))
    table = {line.split(" | ")[0].lstrip("| "): line for line in report.e2e_fp8_table(str(path))
             if line.startswith("| ") and not line.startswith("| system")}
    assert "0.100 **LAGS**" in table["coda_fp8"]
    torchao = table["torchao_fp8_tensorwise"]
    assert "0.900" in torchao and "LAGS" not in torchao
    assert "| 1.200 [1.15] |" in table["coda_fp8"]  # 72000 / liger's 60000, not torchao's 70000
    assert "| +4.00 |" in table["coda_fp8"]  # peak over coda bf16's
    # without a bf16 reference nothing is marked
    res = {"rows": [e2e_row("coda_fp8", 1, 1.0, 12.0, 11.9)]}
    assert sr.loss_check(res) == [] and "loss_drop_vs_ref" not in res["rows"][0]


def fp8_chain_file(tmp_path, name, commit, rows):
    d = {"commit": commit, "device": "test", "command": name,
         "sections": {"fp8_chain": {"rows": rows, "targets": {"fp8_over_floor_max": 1.08}}}}
    (tmp_path / name).write_text(json.dumps(d))
    return str(tmp_path / name)


def chain_row(model, m, ms):
    return {"model": model, "m": m, "ms_coda_fp8": ms, "ms_fp8_floor": 1.0,
            "fp8_over_floor": ms, "check": {"coda_fp8": "PASS"}}


def test_fp8_chain_rows_come_from_the_newest_call_of_the_commit_that_has_them(tmp_path):
    fp8_chain_file(tmp_path, "2026-01-01-run1-fp8-chain.json", "old",
                   [chain_row("llama3-8B", 16384, 9.0)])  # another commit: never used
    a = fp8_chain_file(tmp_path, "2026-01-01-run2-fp8-chain.json", "new",
                       [chain_row("llama3-70B", 8192, 1.5), chain_row("llama3-1B", 8192, 1.4)])
    b = fp8_chain_file(tmp_path, "2026-01-01-run3-fp8-chain.json", "new",
                       [chain_row("llama3-1B", 8192, 1.3), chain_row("llama3-1B", 16384, 1.2)])
    paths = report.same_commit_files(str(tmp_path), "*-fp8-chain.json")
    assert paths == [b, a]
    lines = report.fp8_chain_tables(paths)
    rows = [line for line in lines if line.startswith("| llama3-")]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| llama3-1B", "8192", "1.300"], ["| llama3-1B", "16384", "1.200"],
        ["| llama3-70B", "8192", "1.500"]]
    assert rows[0].endswith("2026-01-01-run3-fp8-chain.json |")
    assert rows[2].endswith("2026-01-01-run2-fp8-chain.json |")
    assert "llama3-8B" not in "\n".join(lines)
    # One file alone: no file column.
    single = report.fp8_chain_tables([a])
    assert not any("run2-fp8-chain.json |" in line for line in single)


def test_fp8_chain_profile_comes_from_an_earlier_profiled_call_named_as_such(tmp_path):
    """Rows of a call without --fp8-chain-profile keep the newest profiled call's per-stage
    table, with that file and commit named; a profiled current call uses its own."""
    staged = dict(chain_row("llama3-1B", 8192, 1.4),
                  stages={"mlp fwd": {"ours_ms": 0.9, "floor_ms": 0.7}, "glue": {"ours_ms": 0.1}})
    old = fp8_chain_file(tmp_path, "2026-01-01-run1-fp8-chain.json", "old", [staged])
    new = fp8_chain_file(tmp_path, "2026-01-02-fp8-chain.json", "new",
                         [chain_row("llama3-1B", 8192, 1.3)])
    assert report.profiled_chain_file(str(tmp_path), "*-fp8-chain.json") == old
    lines = report.fp8_chain_tables([new], report.profiled_chain_file(str(tmp_path),
                                                                      "*-fp8-chain.json"))
    text = "\n".join(lines)
    assert "another call's" in text and "run1-fp8-chain.json" in text and "`old`" in text
    assert "| llama3-1B | 8192 | 0.900 / 0.700 (+0.200) | 0.100 |" in lines
    chain_rows = [r for r in lines if r.startswith("| llama3-1B | 8192 | 1.")]
    assert [r.split(" | ")[2] for r in chain_rows] == ["1.300"]
    # a later profile-only call (its own name) serves the profile, not the table's rows
    later = fp8_chain_file(tmp_path, "2026-01-03-fp8-chain-profile.json", "later",
                           [dict(staged, ms_coda_fp8=1.2)])
    assert report.same_commit_files(str(tmp_path), "*-fp8-chain.json") == [new]
    assert report.profiled_chain_file(str(tmp_path), "*-fp8-chain*.json") == later
    # no profile anywhere: no per-stage table
    assert "Per stage" not in "\n".join(report.fp8_chain_tables([new]))
    # the current call profiled: its own table, no earlier file named
    own = report.fp8_chain_tables([old], old)
    assert "another call's" not in "\n".join(own) and any("Per stage" in x for x in own)


def test_e2e_rounds_show_each_rounds_median(tmp_path):
    """Rows combined over rounds (bench/suite_e2e.combine_rounds) list each round's median."""
    rows = [dict(e2e_row("coda", 63000, 21.0, 12.0, 11.0), round_ms=[260.1, 259.0, 261.5]),
            dict(e2e_row("liger", 60000, 26.0, 12.0, 11.0), round_ms=[273.0, 272.5, 274.0])]
    d = {"commit": "abc", "device": "test", "commands": ["synthetic"], "sections": {"e2e": {
        "models": {"llama3.2-1B": {"shape": {"layers": 16, "batch": 4, "seq": 4096},
                                   "rows": rows}}}}}
    path = tmp_path / "2026-01-01-fp8-e2e.json"
    path.write_text(json.dumps(d))
    lines = report.e2e_fp8_table(str(path))
    assert any(line.endswith("| rounds ms |") for line in lines)
    assert any(line.startswith("| coda |") and line.endswith("| 260.10, 259.00, 261.50 |")
               for line in lines)
    # a single round's rows: no rounds column
    for r in rows:
        del r["round_ms"]
    path.write_text(json.dumps(d))
    assert not any("rounds ms" in line for line in report.e2e_fp8_table(str(path)))


def fp8_gemm_row(model, m, p, ours, lt):
    return {"model": model, "M": m, "proj": "gate_up", "pass": p, "gemm": [m, 8, 8], "ok": True,
            "ms": {"coda": ours, "cublaslt": lt, "coda_bf16": 2 * ours},
            "tflops": {"coda": 1.0, "cublaslt": 1.0, "coda_bf16": 0.5}}


def test_fp8_gemm_rows_re_measured_later_replace_the_full_runs(tmp_path):
    full_rows = [fp8_gemm_row(model, 8192, "dgrad", 1.0, 1.0)
                 for model in ("llama3-1B", "llama3-8B", "llama3-70B")]
    full_rows[2] = fp8_gemm_row("llama3-70B", 8192, "dgrad", 1.25, 1.0)  # 0.8x
    older = {"commit": "o", "device": "test", "command": "o",
             "sections": {"fp8": {"rows": [fp8_gemm_row("llama3-1B", 8192, "dgrad", 9.0, 1.0)]}}}
    (tmp_path / "2025-12-31-fp8.json").write_text(json.dumps(older))  # before the full run
    full = tmp_path / "2026-01-01-fp8.json"
    full.write_text(json.dumps({"commit": "a", "device": "test", "command": "full",
                                "sections": {"fp8": {"rows": full_rows}}}))
    later = tmp_path / "2026-01-01-run3-fp8.json"
    later.write_text(json.dumps({"commit": "b", "device": "test", "command": "70B",
                                 "sections": {"fp8": {"rows": [
                                     fp8_gemm_row("llama3-70B", 8192, "dgrad", 1.0, 0.95)]}}}))
    paths = report.fp8_files(str(tmp_path), "*-fp8.json")
    assert paths == [str(later), str(full)]  # stops at the newest run of all three models
    text = "\n".join(report.fp8_tables(paths))
    assert "commit `a`" in text and "commit `b`" in text
    rows = [line for line in text.splitlines() if line.startswith("| llama3-")]
    assert [r.split(" | ")[0] for r in rows] == ["| llama3-1B", "| llama3-8B", "| llama3-70B"]
    assert rows[2].endswith("2026-01-01-run3-fp8.json |") and "| 0.950 |" in rows[2]
    assert rows[0].endswith("2026-01-01-fp8.json |") and "9.000" not in text
    # The geometric mean is over the merged rows: (1 · 1 · 0.95)^(1/3), worst 0.95, not 0.8.
    assert "dgrad: ours / cuBLASLt geometric mean 0.983 over 3 shapes, worst 0.950" in text


def test_train_parity_tables_keep_the_newest_run_of_each_run_set(tmp_path):
    def parity(name, runs):
        d = {"commit": name, "sections": {"train_parity": {"runs": {r: {} for r in runs}}}}
        (tmp_path / name).write_text(json.dumps(d))
        return str(tmp_path / name)

    older_ao = parity("2026-01-01-train-parity.json", ["coda_bf16", "coda_fp8", "torchao_fp8"])
    newer_ao = parity("2026-01-01-run2-train-parity.json", ["coda_bf16", "coda_fp8", "torchao_fp8"])
    newest_z = parity("2026-01-02-train-parity.json", ["coda_bf16", "coda_fp8", "coda_fp8_z"])
    assert older_ao not in report.train_parity_files(str(tmp_path))
    assert report.train_parity_files(str(tmp_path)) == [newest_z, newer_ao]


def e2e_file(path, systems, commit):
    rows = [{"system": s, "median_step_ms": ms, "tokens_per_s": int(8192e3 / ms), "peak_gib": 20.0,
             "first_loss": 12.0, "last_loss": 9.0, "loss_drop_vs_ref": 1.0}
            for s, ms in systems]
    d = {"commit": commit, "device": "test", "torch": "t", "command": f"suite.py {commit}",
         "sections": {"e2e": {"models": {"llama3-8B": {
             "shape": {"layers": 8, "batch": 2, "seq": 4096}, "rows": rows,
             "loss_reference": "coda"}}}}}
    path.write_text(json.dumps(d))
    return str(path)


def test_split_placement_e2e_file_is_its_own_table_and_leaves_the_fp8_one_alone(tmp_path):
    """gpu-check's fp8-split stage writes *-fp8-split-e2e.json: its own section, which neither
    matches the FP8 comparison's pattern nor replaces that file as the latest."""
    fp8 = e2e_file(tmp_path / "2026-01-01-run1-fp8-e2e.json",
                   [("hf_compile", 220.0), ("coda", 221.0), ("coda_fp8", 176.0)], "aaa")
    split = e2e_file(tmp_path / "2026-01-02-run2-fp8-split-e2e.json",
                     [("hf_compile", 222.0), ("coda", 224.0), ("coda_fp8_z_recast@fused", 179.6),
                      ("coda_fp8_z_recast@split", 177.8)], "bbb")
    assert report.latest(str(tmp_path), "*-fp8-e2e.json") == fp8
    assert report.latest(str(tmp_path), "*-fp8-split-e2e.json") == split
    table = "\n".join(report.e2e_split_table(split))
    assert "under each FP8 epilogue placement" in table and "`bbb`" in table
    assert "| coda_fp8_z_recast@split | 177.80 |" in table
    assert f"{222.0 / 177.8:.3f} [1.25]" in table  # tokens/s over HF + compile's, the 8B target
