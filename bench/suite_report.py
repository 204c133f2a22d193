"""Tables, plots and the README summary from one results file of bench/suite.py (used by report.py).

Speed ratios are baseline time / our time (> 1: we are faster), both from the same run."""

import math
import os

NAN = float("nan")
BASELINES = ("eager", "compile", "liger", "flashinfer")
LABEL = {
    "eager": "eager",
    "compile": "torch.compile",
    "liger": "Liger",
    "flashinfer": "FlashInfer",
    "gemm_only": "GEMM-only floor",
    "cublas_gemm": "cuBLAS GEMM",
}
FWD_OPS = ("F1 out-proj", "F2 gate/up", "F1 down-proj", "F3 qkv+RoPE")
BWD_OPS = ("B3 RoPE bwd", "B1 qkv", "B2 SwiGLU bwd", "B1 gate/up")
GEMM_OPS = ("dW qkv", "dW down", "dW gate/up", "dW o", "d(y)")


# The e2e section's training check: the least loss drop over a system's steps, as a fraction of
# the bf16 reference's from the same weights and batch, of a system that trains as the others do
# (torchao's FP8 drops 0.92-0.94x of coda bf16's at the 1B / 8B shapes).
LOSS_DROP_FLOOR = 0.8


def loss_check(res):
    """Marks each e2e row of one model shape (`res`: its "rows") with its loss drop relative to
    the bf16 reference's (coda, else hf_eager, when measured), `loss_drop_vs_ref`, and
    `loss_lags` below LOSS_DROP_FLOOR; returns a line for each lagging row."""
    rows = {r["system"]: r for r in res["rows"]}
    ref = rows.get("coda") or rows.get("hf_eager")
    if ref is None or ref["first_loss"] <= ref["last_loss"]:
        return []
    res["loss_reference"] = ref["system"]
    lines = []
    for r in res["rows"]:
        r["loss_drop_vs_ref"] = round((r["first_loss"] - r["last_loss"])
                                      / (ref["first_loss"] - ref["last_loss"]), 3)
        r["loss_lags"] = r["loss_drop_vs_ref"] < LOSS_DROP_FLOOR
        if r["loss_lags"]:
            lines.append(f"e2e {r['system']}: LOSS LAGS the {ref['system']} reference (drop "
                         f"{r['loss_drop_vs_ref']}x of its): not a result")
    return lines


def f(v, fmt=".3f"):
    return "—" if v is None or v != v else format(v, fmt)


def ratio(base, ours):
    if not base or not ours or base != base or ours != ours:
        return "—"
    r = base / ours
    return f"**{r:.2f}**" if r > 1.0 else f"{r:.2f}"


def geo(vals):
    vals = [v for v in vals if v and v == v]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else NAN


def header(path, d):
    return (
        f"Source: `{os.path.relpath(path)}` — commit `{d.get('commit', '?')}`, {d.get('device', '?')}, "
        f"torch {d.get('torch')}, CUDA {d.get('cuda')}, Triton {d.get('triton', '?')}, Liger "
        f"{d.get('liger_version', 'absent')}, FlashInfer {d.get('flashinfer_version', 'absent')}; "
        f"{d.get('elapsed_s', NAN):.0f} s; command: `{d.get('command', '?')}`.\n"
    )


def absent_lines(d):
    """Why a baseline is missing: the suite's own reasons, then each section's."""
    out = [f"- {k} absent: {v}" for k, v in d.get("absent", {}).items()]
    for name, sec in d.get("sections", {}).items():
        out += [f"- {name}: {k} absent: {v}" for k, v in sec.get("absent", {}).items()]
    return out


def summary(path, d):
    """Where we beat each baseline and where we do not, per benchmark (geometric means over shapes
    plus the worst shape)."""
    out = [
        "## Summary: where coda is faster than each baseline, and where it is not\n",
        header(path, d),
        "Speed ratio = baseline time / our time, same run (> 1, bold: we are faster). Per row the "
        "geometric mean over its shapes, then the worst shape.\n",
        "| benchmark | shapes | vs eager | vs torch.compile | vs Liger | vs FlashInfer | vs GEMM-only floor |",
        "|---|---|---|---|---|---|---|",
    ]

    def line(label, rows, ours_key, key_of, shape_of):
        cells = []
        for b in ("eager", "compile", "liger", "flashinfer", "gemm_only"):
            rs = [
                (key_of(r, b) / key_of(r, ours_key), shape_of(r))
                for r in rows
                if key_of(r, b) and key_of(r, ours_key) and key_of(r, b) == key_of(r, b)
            ]
            if not rs:
                cells.append("—")
                continue
            g = geo([x for x, _ in rs])
            w = min(rs)
            cells.append(
                f"{'**' if g > 1 else ''}{g:.2f}{'**' if g > 1 else ''} (worst {w[0]:.2f} {w[1]})"
            )
        out.append(f"| {label} | {len(rows)} | " + " | ".join(cells) + " |")

    ops = d["sections"].get("ops", {}).get("rows", [])
    for name in FWD_OPS + BWD_OPS:
        rows = [r for r in ops if r["op"] == name and "coda" in r["ms"]]
        if rows:
            line(
                f"op {name}",
                rows,
                "coda",
                lambda r, k: r["ms"].get(k),
                lambda r: f"{r['model']} M={r['m']}",
            )
    for sec, label in (("chain_fwd", "layer chain forward"), ("chain", None)):
        rows = d["sections"].get(sec, {}).get("rows", [])
        for p in ("fwd", "fwd+bwd", "bwd"):
            rs = [r for r in rows if r.get("pass") == p and r.get("check") == "PASS"]
            if rs:
                line(
                    label
                    or f"layer chain {'forward + backward' if p == 'fwd+bwd' else 'backward'}",
                    rs,
                    "coda",
                    lambda r, k: r.get(f"ms_{k}"),
                    lambda r: f"{r['model']} M={r['m']}",
                )
    lm = d["sections"].get("lm_head", {}).get("rows", [])
    if lm:
        line(
            "LM head + CE fwd + bwd (chunked)"
            + (" ¹" if d["sections"]["lm_head"].get("source") else ""),
            lm,
            "coda_chunked",
            lambda r, k: r["ms"].get({"gemm_only": "gemm_floor"}.get(k, k)),
            lambda r: f"H={r['H']} M={r['M']} V={r['V']}",
        )
    fused = [r for r in ops if r.get("fused_over_plain")]
    over_f = [r for r in fused if r["op"].startswith("F") and r["fused_over_plain"] > 1.03]
    over_b = [r for r in fused if r["op"].startswith("B") and r["fused_over_plain"] > 1.05]
    out.append("")
    if fused:
        out.append(
            f"- Fused kernel vs our plain GEMM of the same shape: {len(fused) - len(over_f) - len(over_b)} of "
            f"{len(fused)} (op, shape) pairs within the target (forward ≤ 1.03×, backward ≤ 1.05×); above it: "
            + ", ".join(
                f"{r['op']} {r['model']} M={r['m']} {r['fused_over_plain']:.2f}×"
                for r in sorted(over_f + over_b, key=lambda r: -r["fused_over_plain"])
            )
            + "."
        )
    plain = [
        (r["ms"]["cublas_gemm"] / r["ms"]["coda_plain_gemm"], r)
        for r in ops
        if "coda_plain_gemm" in r["ms"] and "cublas_gemm" in r["ms"]
    ]
    if plain:
        w = min(plain, key=lambda x: x[0])
        out.append(
            f"- Our plain GEMM vs cuBLAS at the ops' shapes: geometric mean {geo([x for x, _ in plain]):.3f}× "
            f"cuBLAS's speed over {len(plain)} shapes, slowest {w[0]:.3f} ({w[1]['op']} {w[1]['model']} M={w[1]['m']})."
        )
    dw = [
        (r["ms"]["cublas_gemm"] / r["ms"]["coda"], r)
        for r in ops
        if r["op"] in GEMM_OPS and "coda" in r["ms"]
    ]
    if dw:
        w = min(dw, key=lambda x: x[0])
        out.append(
            f"- Our weight/data-gradient GEMMs (XᵀY, XW) vs cuBLAS: geometric mean {geo([x for x, _ in dw]):.3f}×, "
            f"slowest {w[0]:.3f} ({w[1]['op']} {w[1]['model']} M={w[1]['m']})."
        )
    if d["sections"].get("lm_head", {}).get("source"):
        out.append(f"- ¹ LM head rows from a later run: {d['sections']['lm_head']['source']}.")
    out += absent_lines(d)
    return out + [""]


def ops_table(path, d, plot_dir):
    rows = d["sections"].get("ops", {}).get("rows", [])
    if not rows:
        return []
    out = [
        "## Every op at every shape\n",
        header(path, d),
        "`ours` = the fused kernel plus its fold (A1 / A3) where it has one; `fused/plain` = the fused "
        "kernel alone over our plain GEMM of the same shape (targets 1.03 forward, 1.05 backward). "
        "Baselines run the same op unfused: cuBLAS GEMM + eager PyTorch, torch.compile of it, Liger's "
        "kernels, FlashInfer's kernels (forward); backward ops are the backward of the op's forward "
        "sub-graph. Errors: max |out − fp32| over the op's outputs; every timed variant passed "
        "≤ 2 × eager + 1e-6 first.\n",
        "| model | M | op | GEMM M×N×K | ours ms | ours TFLOP/s | fused / plain | plain vs cuBLAS | "
        "vs eager | vs compile | vs Liger | vs FlashInfer | max err ours / eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        g = r.get("gemm_mnk")
        tf = r.get("tflops", {}).get("coda")
        plain = (
            ratio(ms.get("cublas_gemm"), ms.get("coda_plain_gemm"))
            if "coda_plain_gemm" in ms
            else (ratio(ms.get("cublas_gemm"), ms.get("coda")) if r["op"] in GEMM_OPS else "—")
        )
        errs = r.get("err", {})
        failed = [k for k, v in r.get("check", {}).items() if v != "PASS"]
        out.append(
            f"| {r['model']} | {r['m']} | {r['op']} | {'×'.join(map(str, g)) if g else '—'} | "
            f"{f(ms.get('coda'))} | {f(tf, '.0f')} | {f(r.get('fused_over_plain'))} | {plain} | "
            + " | ".join(ratio(ms.get(b), ms.get("coda")) for b in BASELINES)
            + f" | {f(errs.get('coda'), '.4f')} / {f(errs.get('eager'), '.4f')}"
            + (f" (check failed: {', '.join(failed)})" if failed else "")
            + " |"
        )
    out.append("")
    for name in plots(d, path, plot_dir):
        out.append(f"![{name}]({name})\n")
    return out


def chain_tables(path, d):
    out = []
    for sec, p, title in (
        ("chain_fwd", "fwd", "Layer chain, forward"),
        ("chain", "bwd", "Layer chain, backward alone"),
        ("chain", "fwd+bwd", "Layer chain, forward + backward"),
    ):
        rows = [r for r in d["sections"].get(sec, {}).get("rows", []) if r.get("pass") == p]
        if not rows:
            continue
        programs = any("ms_coda_programs" in r for r in rows)
        out += [
            f"## {title}\n",
            "Out-proj + residual + RMSNorm → gate/up + SwiGLU → down + residual + RMSNorm → QKV + RoPE "
            "(attention excluded). ms, medians of interleaved rounds (L2 cleared before each run); speed ratio vs the best of "
            "eager / compile / Liger / FlashInfer (FlashInfer: forward only)."
            + (
                " Ours is what a model runs: the block ops (torch.ops.coda), through autograd in the "
                "backward; `programs` is the same programs composed directly through the "
                "program-level ops, without autograd's bookkeeping (the gradient sum where the "
                "residual stream branches, the zero-filled input of the QKV norm's backward)."
                if programs
                else ""
            )
            + (
                " Backward alone: every variant's forward runs untimed before each timed "
                "backward (`programs`: its backward kernels on the saved tensors)."
                if p == "bwd"
                else ""
            )
            + "\n",
            "| model | M | ours | " + ("programs | " if programs else "")
            + "GEMM-only | eager | torch.compile | Liger | FlashInfer | vs best baseline | check |",
            "|---|---|---|" + ("---|" if programs else "") + "---|---|---|---|---|---|---|",
        ]
        for r in rows:
            out.append(
                f"| {r['model']} | {r['m']} | {f(r.get('ms_coda'))} | "
                + (f"{f(r.get('ms_coda_programs'))} | " if programs else "")
                + f"{f(r.get('ms_gemm_only'))} | "
                f"{f(r.get('ms_eager'))} | {f(r.get('ms_compile'))} | {f(r.get('ms_liger'))} | "
                f"{f(r.get('ms_flashinfer'))} | {ratio(r['speedup_vs_best_baseline'], 1.0)} | {r.get('check', '?')} |"
            )
        out.append("")
    return out


def lm_head_table(path, d):
    sec = d["sections"].get("lm_head", {})
    rows = sec.get("rows", [])
    if not rows:
        return []
    methods = ["coda_chunked", "coda_one_chunk", "eager", "compile", "liger", "gemm_floor"]
    out = [
        "## LM head + cross-entropy, forward + backward\n",
        (f"Source: {sec['source']}.\n" if sec.get("source") else ""),
        "Medians of interleaved rounds; every method's loss and gradients checked against eager first. "
        "Peak extra memory = max_memory_allocated during one forward + backward minus what was held "
        f"before (gradients included); coda's scratch budget (the chunk's logits) {sec.get('chunk_bytes', 0) / 2**30:.2f} GiB.\n",
        "| model | H | M | V | "
        + " | ".join(f"{m} ms" for m in methods)
        + " | vs compile | peak extra MiB coda / compile / Liger | gradients MiB |",
        "|---|---|---|---|" + "---|" * (len(methods) + 3),
    ]
    for r in rows:
        ms, pk = r["ms"], r["peak_extra_MiB"]
        out.append(
            f"| {r.get('model', '')} | {r['H']} | {r['M']} | {r['V']} | "
            + " | ".join(f(ms.get(m), ".2f") for m in methods)
            + f" | {ratio(ms.get('compile'), ms.get('coda_chunked'))} | {f(pk.get('coda_chunked'), '.0f')} / "
            f"{f(pk.get('compile'), '.0f')} / {f(pk.get('liger'), '.0f')} | {f(r.get('outputs_MiB'), '.0f')} |"
        )
    return out + [""]


def plots(d, path, plot_dir):
    """Speedup per op per shape over each baseline; time breakdown of the layer (ours vs compile)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = d["sections"].get("ops", {}).get("rows", [])
    stem = os.path.basename(path).replace(".json", "")
    os.makedirs(plot_dir, exist_ok=True)
    names = []
    ops = [o for o in FWD_OPS + BWD_OPS if any(r["op"] == o for r in rows)]
    if ops:
        fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
        colors = {
            b: f"C{i}"
            for i, b in enumerate(("eager", "compile", "liger", "flashinfer", "cublas_gemm"))
        }
        for ax, op in zip(axes.flat, ops):
            rs = [r for r in rows if r["op"] == op and "coda" in r["ms"]]
            bs = [b for b in colors if any(b in r["ms"] for r in rs)]
            width = 0.8 / max(len(bs), 1)
            top = 1.0
            for i, b in enumerate(bs):
                ys = [r["ms"][b] / r["ms"]["coda"] if b in r["ms"] else 0 for r in rs]
                top = max(top, *ys)
                ax.bar(
                    [j + i * width for j in range(len(rs))],
                    ys,
                    width,
                    label=LABEL[b],
                    color=colors[b],
                )
            ax.set_ylim(0, top * 1.08)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rs))])
            ax.set_xticklabels(
                [
                    f"{r['model'].replace('llama3-', '').replace('paper-', 'p')}\n{r['m'] // 1024}k"
                    for r in rs
                ],
                fontsize=7,
            )
            ax.set_title(op, fontsize=10)
        for ax in axes.flat[len(ops) :]:
            ax.axis("off")
        axes[0][0].set_ylabel("baseline time / our time")
        axes[1][0].set_ylabel("baseline time / our time")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        labels = [LABEL[b] for b in colors]
        fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9)
        fig.suptitle(
            "Speedup of each fused op over each baseline (> 1: coda faster; each panel its own scale); H200, same run"
        )
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        name = f"{stem}-ops-speedup.png"
        fig.savefig(os.path.join(plot_dir, name), dpi=100)
        plt.close(fig)
        names.append("img/" + name)
    # Time breakdown of one layer's fused ops + gradient GEMMs: ours vs torch.compile per op (the
    # GEMM-only ops stand as cuBLAS for compile, which calls cuBLAS for them).
    order = ["llama3-1B", "llama3-8B", "llama3-70B", "paper-H2048", "paper-H4096", "paper-H8192"]
    shapes = sorted(
        {(r["model"], r["m"]) for r in rows},
        key=lambda s: (order.index(s[0]) if s[0] in order else len(order), s[1]),
    )
    seq = list(FWD_OPS + BWD_OPS + GEMM_OPS)
    if shapes:
        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
        cmap = plt.get_cmap("tab20")
        for si, (model, m) in enumerate(shapes):
            by_op = {r["op"]: r for r in rows if r["model"] == model and r["m"] == m}
            total = (
                sum(
                    by_op[o]["ms"].get("compile", by_op[o]["ms"].get("cublas_gemm", 0))
                    for o in seq
                    if o in by_op
                )
                or 1
            )
            for bi, key in enumerate(("coda", "compile")):
                bottom = 0.0
                for oi, o in enumerate(seq):
                    if o not in by_op:
                        continue
                    ms = by_op[o]["ms"]
                    v = (
                        ms.get("coda", 0)
                        if key == "coda"
                        else ms.get("compile", ms.get("cublas_gemm", 0))
                    )
                    ax.bar(
                        si + bi * 0.4,
                        v / total,
                        0.38,
                        bottom=bottom,
                        color=cmap(oi % 20),
                        label=o if si == 0 and bi == 0 else None,
                        edgecolor="white",
                        lw=0.3,
                    )
                    bottom += v / total
                ax.text(
                    si + bi * 0.4,
                    bottom + 0.01,
                    "coda" if key == "coda" else "compile",
                    ha="center",
                    fontsize=7,
                )
        ax.set_xticks([i + 0.2 for i in range(len(shapes))])
        ax.set_xticklabels([f"{mo}\nM={m}" for mo, m in shapes], fontsize=7)
        ax.set_ylabel("time / torch.compile's total")
        ax.set_title(
            "One layer (attention excluded), forward + backward, by op: coda (left) vs torch.compile (right)"
        )
        ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        fig.tight_layout()
        name = f"{stem}-layer-breakdown.png"
        fig.savefig(os.path.join(plot_dir, name), dpi=100)
        plt.close(fig)
        names.append("img/" + name)
    return names


def readme_section(path, d):
    """The README's Performance bullets, generated (between markers) from the suite file."""
    out = [
        f"Generated by `bench/report.py` from `{os.path.relpath(path)}` (commit `{d.get('commit')}`, "
        f"{d.get('device')}); tables and plots in [docs/performance.md](docs/performance.md). "
        "Ratios are speeds relative to ours, measured side by side in one run.",
        "",
    ]
    ops = d["sections"].get("ops", {}).get("rows", [])
    plain = [
        r["ms"]["cublas_gemm"] / r["ms"]["coda_plain_gemm"]
        for r in ops
        if "coda_plain_gemm" in r["ms"] and "cublas_gemm" in r["ms"]
    ]
    if plain:
        out.append(
            f"- Plain GEMM (our CUTLASS mainloop, empty epilogue) vs cuBLAS at the ops' shapes: "
            f"geometric mean {geo(plain):.3f}×, worst {min(plain):.3f}×."
        )
    for group, label in ((FWD_OPS, "forward"), (BWD_OPS, "backward")):
        fo = [r["fused_over_plain"] for r in ops if r["op"] in group and r.get("fused_over_plain")]
        comp = [
            r["ms"]["compile"] / r["ms"]["coda"]
            for r in ops
            if r["op"] in group and "compile" in r["ms"] and "coda" in r["ms"]
        ]
        if fo:
            out.append(
                f"- Fused {label} ops: {min(fo):.2f}–{max(fo):.2f}× our plain GEMM's time; "
                f"{min(comp):.2f}–{max(comp):.2f}× torch.compile's speed for the same op (geometric mean {geo(comp):.2f})."
            )
    for sec, p, label in (
        ("chain_fwd", "fwd", "Layer chain forward"),
        ("chain", "fwd+bwd", "Layer chain forward + backward"),
        ("chain", "bwd", "Layer chain backward"),
    ):
        rs = [
            r
            for r in d["sections"].get(sec, {}).get("rows", [])
            if r.get("pass") == p and r.get("check") == "PASS"
        ]
        if rs:
            best = "eager / torch.compile / Liger" + (" / FlashInfer" if p == "fwd" else "")
            out.append(
                f"- {label} vs the best of {best}: "
                + ", ".join(
                    f"{r['model'].replace('llama3-', '')} M={r['m']} {r['speedup_vs_best_baseline']:.2f}×"
                    for r in rs
                )
                + "."
            )
    lm = d["sections"].get("lm_head", {}).get("rows", [])
    if lm:
        src = d["sections"]["lm_head"].get("source")
        out.append(
            "- LM head + cross-entropy (three-GEMM path in token chunks) vs torch.compile"
            + (f" (from a later run: `{src.split(' ')[0]}`)" if src else "")
            + ": "
            + ", ".join(
                f"H={r['H']} M={r['M']} V={r['V']} {r['ms']['compile'] / r['ms']['coda_chunked']:.2f}× "
                f"({r['peak_extra_MiB']['coda_chunked']:.0f} vs {r['peak_extra_MiB']['compile']:.0f} MiB peak extra, gradients included)"
                for r in lm
            )
            + "."
        )
    out += absent_lines(d)
    return out
