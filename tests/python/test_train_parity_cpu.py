"""The training-parity section (bench/suite_train.py's run_parity, issue "FP8 training parity") for
3 steps of a tiny model on the CPU, on a tiny corpus made here: coda's bf16 model (float32 on the
CPU) and coda's FP8 model (its CPU kernels) from one initialization on the same batches; the
results' numbers, the report's table of them, and scripts/fetch-corpus itself (its --text-dir
mode: BPE training, deterministic and idempotent output) where its pinned tokenizers is here."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import report  # noqa: E402
import suite_train as st  # noqa: E402

FETCH = os.path.join(ROOT, "scripts", "fetch-corpus")
TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, batch=2,
            seq=32, steps=3, warmup=1, lr=1e-3, timing_skip=0, last=2, spike_window=1,
            holdout_windows=2, runs="coda_bf16,coda_fp8,coda_fp8_z")

WORDS = ("the kernel reads a block of tokens and writes its result back to memory while the next "
         "block is loaded; every program keeps its intermediate values on chip, so the residual "
         "stream, the norm statistics and the gated activation never travel through global memory "
         "twice. A model trained in eight bit floating point must reach the loss of the same model "
         "trained in bfloat16").split()


def tiny_texts(n=9):
    """n short English-like documents, deterministic."""
    g = torch.Generator().manual_seed(1)
    docs = []
    for i in range(n):
        idx = torch.randint(0, len(WORDS), (400,), generator=g).tolist()
        sentences = [" ".join(WORDS[j] for j in idx[k:k + 12]).capitalize() + "."
                     for k in range(0, len(idx), 12)]
        docs.append(f"Document {i}\n\n" + " ".join(sentences) + "\n")
    return docs


def fetch_module():
    loader = importlib.machinery.SourceFileLoader("fetch_corpus", FETCH)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


def write_bytes_corpus(out, texts):
    """The corpus format of scripts/fetch-corpus with byte ids (+1; 0 = end of text), for an
    interpreter without the pinned tokenizers."""
    os.makedirs(out, exist_ok=True)
    split = {"train": texts[:-2], "holdout": texts[-2:]}
    for name, docs in split.items():
        ids = [t for d in docs for t in [b + 1 for b in d.encode()] + [0]]
        np.save(os.path.join(out, f"{name}.npy"), np.asarray(ids, dtype=np.uint16))
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"vocab_size": 257, "eot_id": 0, "sources": [{"text_dir": "test"}],
                   "tokens": {"train": 0, "holdout": 0}}, f)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("parity")
    texts = tiny_texts()
    for i, t in enumerate(texts):
        (base / "text").mkdir(exist_ok=True)
        (base / "text" / f"doc{i}.txt").write_text(t)
    out = str(base / "corpus")
    if fetch_module().have_pinned():
        cmd = [sys.executable, FETCH, "--text-dir", str(base / "text"), "--vocab", "384",
               "--holdout-every", "4"]
        subprocess.run(cmd + ["--out", out], check=True, capture_output=True, text=True)
        return out, cmd, str(base)
    write_bytes_corpus(out, texts)
    return out, None, str(base)


def test_fetch_corpus_text_dir_is_deterministic_and_idempotent(corpus):
    out, cmd, base = corpus
    if cmd is None:
        pytest.skip("this interpreter lacks scripts/fetch-corpus's pinned tokenizers / numpy")
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    assert meta["vocab_size"] <= 384 and meta["eot_id"] == 0 and meta["dtype"] == "uint16"
    train = np.load(os.path.join(out, "train.npy"))
    assert train.size == meta["tokens"]["train"] and train.max() < meta["vocab_size"]
    assert meta["documents"] == {"train": 7, "holdout": 2}
    # Same input, another folder: byte-identical files.
    again = os.path.join(base, "again")
    subprocess.run(cmd + ["--out", again], check=True, capture_output=True)
    for name, digest in meta["sha256"].items():
        with open(os.path.join(again, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    # Run again in place: nothing to do.
    r = subprocess.run(cmd + ["--out", out], check=True, capture_output=True, text=True)
    assert "up to date" in r.stdout
    # The tokenizer round-trips text (byte-level BPE).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    text = "The kernel writes 12345 tokens; ünïcode too."
    assert tok.decode(tok.encode(text).ids) == text


def test_schedule_order_spikes_settings():
    a = st.SimpleNamespace(**{**st.PARITY_DEFAULTS, "steps": 1000})
    lrs = [st.lr_at(s, a) for s in range(a.steps)]
    assert lrs[0] == pytest.approx(a.lr / a.warmup) and lrs[a.warmup - 1] == pytest.approx(a.lr)
    assert lrs[-1] == pytest.approx(a.lr * a.min_lr_ratio)
    assert all(x >= y for x, y in zip(lrs[a.warmup:], lrs[a.warmup + 1:]))
    order = st.window_order(10, steps=7, batch=2, seed=0)  # 14 windows: one pass, then 4 more
    assert order.shape == (7, 2) and sorted(order.flatten()[:10].tolist()) == list(range(10))
    curve = [3.0] * 30
    curve[25] = 3.8
    assert st.find_spikes(curve, 20, 0.5) == [26]
    assert st.parse_settings("runs=coda_bf16+coda_fp8,batch=4,lr=1e-4", steps=7) == {
        "steps": 7, "runs": "coda_bf16,coda_fp8", "batch": 4, "lr": 1e-4}
    with pytest.raises(ValueError):
        st.parse_settings("nonsense=1")


def test_master_adamw_keeps_fp32_masters_of_bf16_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
    a = st.SimpleNamespace(**{**st.PARITY_DEFAULTS, "clip": 0.5})
    opt = st.MasterAdamW(model, a, torch.float32)
    assert opt.copy and all(m.dtype == torch.float32 for m in opt.master)
    # Decay on matrices only: the Linear's weight; not its bias nor the norm's parameters.
    decayed = [g for g in opt.opt.param_groups if g["weight_decay"] > 0]
    assert len(decayed) == 1 and len(decayed[0]["params"]) == 1
    model(torch.randn(4, 16, dtype=torch.bfloat16)).square().sum().mul(100).backward()
    grads = [p.grad.float() for p in opt.params]
    versions = [p._version for p in opt.params]
    norm = opt.step(1e-2)
    assert norm.item() == pytest.approx(torch.cat([g.flatten() for g in grads]).norm().item(),
                                        rel=1e-3)
    # Clipped (norm > 0.5), stepped on the masters, written back; the version counters moved (the
    # FP8 model's weight cache keys on them), the gradients are gone.
    for p, m, v in zip(opt.params, opt.master, versions):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.detach().bfloat16())
        assert p._version > v and p.grad is None and m.grad is None
    assert len(opt.tensors()) == 4 * len(opt.params)  # masters, exp_avg, exp_avg_sq, step


@pytest.fixture(scope="module")
def parity(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "train-parity")
    sec = st.run_parity(out, progress=lambda s: None, dev="cpu", dtype=torch.float32,
                        corpus=corpus[0], **TINY)
    return sec, out


def test_parity_bf16_reference(parity):
    sec, _ = parity
    r = sec["runs"]["coda_bf16"]
    vocab = sec["model_vocab"]
    assert vocab % 128 == 0 and sec["steps_done"] == 3 and "error" not in r
    assert len(r["loss"]) == 3 and len(r["grad_norm"]) == 3 and r["finite"]
    # From a 0.02-std init every token is about equally likely: the first loss is ~ln V.
    assert abs(r["loss"][0] - math.log(vocab)) < 0.3
    assert r["loss"][-1] < r["loss"][0]
    assert r["mean_last"] == pytest.approx(sum(r["loss"][-2:]) / 2)
    assert math.isfinite(r["holdout_loss"])
    assert sec["tokens_per_step"] == 64 and sec["parameters"] > 0


def test_parity_fp8_against_bf16(parity):
    sec, out = parity
    why = st.coda_fp8_missing()
    if why:
        assert sec["absent"]["coda_fp8"] == why
        pytest.skip(f"coda FP8 model not in this build: {why}")
    r, ref = sec["runs"]["coda_fp8"], sec["runs"]["coda_bf16"]
    assert len(r["loss"]) == 3 and r["finite"] and "error" not in r
    # Same initialization and batch: the first losses differ only by the FP8 rounding.
    assert abs(r["loss"][0] / ref["loss"][0] - 1) < 0.02
    assert r["rel_diff_last"] == pytest.approx(
        (r["mean_last"] - ref["mean_last"]) / ref["mean_last"])
    # ... and so do the first gradients: their global norm within 5% (blockwise e4m3 moves each
    # weight's gradient by ~5-10% relative Frobenius, the global norm by ~1%).
    assert abs(r["first_grad_norm_rel_diff"]) < 0.05, (
        f"first-step gradient norm {r['grad_norm'][0]:.4f} vs bf16's {ref['grad_norm'][0]:.4f}")
    assert abs(r["rel_diff_last"]) < 0.02 and r["spikes_not_in_ref"] == []
    assert r["pass"] is sec["pass"]["coda_fp8"] is True


def test_parity_fp8_z_has_coda_fp8s_forward(parity):
    sec, _ = parity
    if st.coda_fp8_missing():
        pytest.skip("coda FP8 model not in this build")
    r, fp8 = sec["runs"]["coda_fp8_z"], sec["runs"]["coda_fp8"]
    assert len(r["loss"]) == 3 and r["finite"] and "error" not in r
    # z saved in FP8 changes the backward only: the first step's loss is coda_fp8's bit for bit,
    # its gradients within the decoded z's error (z within 2^-4 relative).
    assert r["loss"][0] == fp8["loss"][0]
    assert abs(r["grad_norm"][0] / fp8["grad_norm"][0] - 1) < 0.05
    assert r["grad_norm"][0] != fp8["grad_norm"][0]
    assert r["loss"][-1] < r["loss"][0]


def test_report_table_of_the_section(parity):
    sec, out = parity
    path = out + ".json"
    with open(path, "w") as f:
        json.dump({"commit": "test", "device": "cpu", "command": "test",
                   "sections": {"train_parity": sec}}, f)
    text = "\n".join(report.train_parity_table(path))
    assert "FP8 training parity" in text and "| coda_bf16 |" in text and "reference" in text
    if "coda_fp8" in sec["runs"]:
        assert "| coda_fp8 |" in text
    else:
        assert "Absent: coda_fp8" in text
