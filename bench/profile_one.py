"""Launches one fused op at a LLaMA shape, for ncu (`ncu -k regex:... python3 bench/profile_one.py`).

  python3 bench/profile_one.py --lib .gpubin/libcoda_capi.so --op swiglu_backward --m 8192 \
      --hidden 2048 --inter 8192
"""

import argparse
import ctypes

import torch

from chain_bench import Coda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--op", choices=["swiglu_backward", "rmsnorm_backward"], required=True)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    coda = Coda(a.lib)
    m, h, i = a.m, a.hidden, a.inter
    r = lambda *s: (torch.rand(*s, device="cuda") * 2 - 1).to(torch.bfloat16)  # noqa: E731
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ext = (ctypes.c_longlong * 2)()
    if a.op == "swiglu_backward":
        dx, wd, z = r(m, h), r(h, i) * 0.02, r(m, 2 * i)
        dz, act = torch.empty_like(z), torch.empty(m, i, device="cuda", dtype=torch.bfloat16)
        coda("coda_swiglu_backward_partials_layout", m, i, h, ext)
        part = torch.empty(ext[0] * ext[1], device="cuda")
        for _ in range(a.reps):
            coda("coda_gemm_swiglu_backward", dx, wd, z, dz, act, part, m, i, h, stream)
    else:
        dz, w, x = r(m, 2 * i), r(2 * i, h) * 0.02, r(m, h)
        rr, zz, g = torch.rand(m, device="cuda"), torch.rand(m, device="cuda"), r(h)
        dres, dxo, hout = r(m, h), torch.empty(m, h, device="cuda", dtype=torch.bfloat16), r(m, h)
        coda("coda_rmsnorm_backward_partials_layout", m, h, 2 * i, ext)
        part = torch.empty(ext[0] * ext[1], device="cuda")
        for _ in range(a.reps):
            coda("coda_gemm_rmsnorm_backward", dz, w, x, rr, g, zz, dres, dxo, hout, part, m, h, 2 * i,
                 stream)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
