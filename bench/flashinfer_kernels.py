"""FlashInfer 0.7.4's own memory-bound forward kernels, built ahead of time.

The flashinfer-python package cannot be carried to the offline GPU machine (the
wheel is 100 MB and importing it pulls in cutlass-dsl, cuda-python, nccl4py,
cudnn-frontend, ...). Its CUDA kernels, though, are plain tvm-ffi modules that
FlashInfer JIT-builds on first use. <repo>/.flashinfer/ holds three of them,
built for sm_90a by FlashInfer's own JIT builder (see .flashinfer/README.txt):

    norm.so          -> fused_add_rmsnorm   (csrc/norm.cu; FlashInfer's CUDA path, which
                        its Python API uses when nvidia-cutlass-dsl is absent or
                        FLASHINFER_USE_CUDA_NORM=1, else it picks a CuTe-DSL kernel)
    silu_and_mul.so  -> silu_and_mul        (activation template, silu)
    rope.so          -> apply_rope_pos_ids  (csrc/rope.cu)

They are loaded with tvm_ffi.load_module (the apache-tvm-ffi wheel in the same
folder must be importable) and called here with torch tensors. tvm-ffi runs each
call on torch's current CUDA stream of the tensors' device: when the arguments
are CUDA torch tensors it queries torch (DLPack exchange API) for that stream and
sets it as the tvm-ffi environment stream, which the kernels read via
TVMFFIEnvGetStream. Calls therefore follow torch.cuda.stream(...) and can be
captured in CUDA graphs (checked on an H200). torch is imported first: it loads
the libcudart.so.13 that the .so files need.

Directory: $CODA_FLASHINFER_DIR, else <repo>/.flashinfer. Any missing piece
raises ImportError at import time with the reason.

Like FlashInfer's wrappers, PDL (programmatic dependent launch) is enabled on
compute capability >= 9 unless enable_pdl=False is passed.
"""

import functools
import os
from pathlib import Path

import torch

FLASHINFER_VERSION = "0.7.4"
KERNEL_DIR = Path(
    os.environ.get("CODA_FLASHINFER_DIR")
    or Path(__file__).resolve().parent.parent / ".flashinfer"
)


def _load_modules():
    try:
        import tvm_ffi
    except ImportError as e:
        raise ImportError(
            f"apache-tvm-ffi is not importable ({e}); install {KERNEL_DIR}/*.whl "
            "with pip --target DIR and put DIR on sys.path"
        ) from e
    if not KERNEL_DIR.is_dir():
        raise ImportError(f"FlashInfer kernel directory {KERNEL_DIR} does not exist")
    mods, keep = {}, []
    for name, func in (("norm", "fused_add_rmsnorm"), ("silu_and_mul", "silu_and_mul"),
                       ("rope", "apply_rope_pos_ids")):
        path = KERNEL_DIR / f"{name}.so"
        if not path.is_file():
            raise ImportError(f"FlashInfer kernel module {path} is missing")
        try:
            keep.append(tvm_ffi.load_module(str(path)))
            mods[name] = getattr(keep[-1], func)
        except Exception as e:
            raise ImportError(
                f"cannot load {func} from {path}: {type(e).__name__}: {e}"
            ) from e
    return mods, keep


_mods, _keep_loaded = _load_modules()


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index):
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl(t, enable_pdl):
    # FlashInfer's rule: PDL unless explicitly disabled, on devices that support it.
    return enable_pdl is not False and t.is_cuda and _sm90_or_newer(t.device.index)


def _check(cond, msg):
    if not cond:
        raise ValueError(msg)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, per row: residual += input; input = rmsnorm(residual) * weight.

    input, residual: [..., H] fp16/bf16, same dtype, last dim contiguous (rows
    may be strided; leading dims are flattened with .view). weight: [H], same
    dtype. The sum is formed in fp32, stored rounded into residual, and the
    unrounded fp32 sum is normalized: x * rsqrt(mean(x^2) + eps) * weight.
    Returns None, like FlashInfer.
    """
    _check(input.dtype == residual.dtype == weight.dtype,
           "input, residual and weight must share one dtype")
    _check(input.shape == residual.shape and weight.shape == input.shape[-1:],
           "shapes must be input=residual=[..., H], weight=[H]")
    if input.dim() != 2:
        h = input.shape[-1]
        input, residual = input.view(-1, h), residual.view(-1, h)
    _mods["norm"](input, residual, weight, float(eps), _pdl(input, enable_pdl))


def silu_and_mul(input, out=None, enable_pdl=None):
    """out = silu(input[..., :d]) * input[..., d:], d = input.shape[-1] // 2.

    The gate is the first half, the up projection the second. input must be
    contiguous fp16/bf16; out (optional, contiguous, [..., d], same dtype) is
    written and returned.
    """
    _check(input.shape[-1] % 2 == 0, "last dimension must be even (2 * d)")
    _check(input.is_contiguous(), "input must be contiguous")
    if out is None:
        out = torch.empty(input.shape[:-1] + (input.shape[-1] // 2,),
                          device=input.device, dtype=input.dtype)
    else:
        _check(out.is_contiguous() and out.dtype == input.dtype
               and out.shape == input.shape[:-1] + (input.shape[-1] // 2,),
               "out must be contiguous, same dtype, shape [..., d]")
    _mods["silu_and_mul"](out, input, _pdl(input, enable_pdl))
    return out


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False,
                       rope_scale=1.0, rope_theta=1e4, inplace=False):
    """RoPE with cos/sin computed in the kernel from per-row positions.

    q: [M, Hq, D], k: [M, Hkv, D] fp16/bf16, same dtype, last dim contiguous;
    D in {64, 128, 256, 512}. pos_ids: [M] int32 or int64, contiguous, same
    device. interleave=False is NeoX / HF rotate_half: the first rotary_dim/2
    dims are paired with the next rotary_dim/2; frequency of pair i is
    rope_theta ** (-2i / rotary_dim) / rope_scale. Dims past rotary_dim (default
    D) are copied unchanged. Returns (q_rope, k_rope): new tensors, or q and k
    themselves rotated in place when inplace=True.
    """
    _check(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0]
           and q.shape[2] == k.shape[2], "q must be [M, Hq, D], k [M, Hkv, D]")
    _check(q.dtype == k.dtype, "q and k must share one dtype")
    _check(pos_ids.dtype in (torch.int32, torch.int64) and pos_ids.shape == q.shape[:1]
           and pos_ids.device == q.device, "pos_ids must be int32/int64 [M] on q's device")
    pos_ids = pos_ids.contiguous()
    q_rope, k_rope = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _mods["rope"](q, k, q_rope, k_rope, pos_ids, int(rotary_dim or q.shape[-1]),
                  bool(interleave), float(rope_scale), float(rope_theta))
    return q_rope, k_rope
