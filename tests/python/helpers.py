"""Shared assertions for the Python tests (tolerances of docs/math.md §5)."""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def max_abs(t: Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def assert_rel(actual: Tensor, expected: Tensor, rel: float = 1e-9, what: str = "") -> None:
    """max|actual - expected| <= rel * max|expected| (fp64 algebra check, docs/math.md §5: the rewritten
    algebra must match the standard computation to ~1e-12 relative in fp64)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = max_abs(actual.double() - expected.double())
    scale = max_abs(expected)
    assert err <= rel * scale + 1e-300, f"{what}: max err {err:.3e} > {rel:.0e} * {scale:.3e}"


def assert_ops_rule(actual: Tensor, ref64: Tensor, plain: Tensor, what: str = "",
                    slack: float = 0.0) -> None:
    """docs/math.md §5: max|out - ref| <= 2 * max|out_pt - ref| + 1e-6, with ref the fp64 unfused result
    and out_pt the plain PyTorch result in the op's own dtype (+ `slack`, see its callers)."""
    assert actual.shape == ref64.shape, f"{what}: shape {actual.shape} vs {ref64.shape}"
    err = max_abs(actual.double() - ref64)
    bound = 2 * max_abs(plain.double() - ref64) + 1e-6 + slack
    assert err <= bound, f"{what}: max err {err:.3e} > bound {bound:.3e}"


def _gloo_main(rank, world, port, fn, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args, out)
        dist.barrier()  # no rank tears its gloo pairs down while the other still uses them
    finally:
        dist.destroy_process_group()
    # A rank that finished cleanly leaves without the interpreter's shutdown: there, after the
    # process group was destroyed, a rank sometimes aborted ("terminate called without an active
    # exception", a joinable C++ thread destroyed at exit; none is ours), failing 1 to 3 runs in 6
    # of the distributed tests on the CI machine. Its results are already in the manager's dict.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world: int, *args) -> dict:
    """Runs ``fn(rank, world, *args, out)`` in ``world`` spawned processes of one gloo group
    (``fn`` at module level, so that it pickles) and returns what the ranks put in ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            _gloo_main,
            args=(world, port, fn, args, out),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return dict(out)


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched while active, by schema name: ``calls["aten::cat"]`` (0 for
    an op that did not run)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        return self.calls.get(name, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
