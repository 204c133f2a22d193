"""How `import coda` finds libcoda_torch.so, checked in fresh interpreters on a copy of the
package (the library can be loaded only once per process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import coda
from coda.nn import LlamaConfig


def import_coda(package_root: Path, env_value: str | None):
    env = {k: v for k, v in os.environ.items() if k != "CODA_TORCH_LIBRARY"}
    if env_value is not None:
        env["CODA_TORCH_LIBRARY"] = env_value
    env["PYTHONPATH"] = str(package_root)
    code = "import coda; print('LOADED', coda.library_path, coda.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=package_root, timeout=120)


@pytest.fixture(scope="module")
def lone_package(tmp_path_factory):
    """<tmp>/repo/python/coda: a source-tree layout with no build next to it."""
    root = tmp_path_factory.mktemp("repo") / "python"
    shutil.copytree(Path(coda.__file__).parent, root / "coda",
                    ignore=shutil.ignore_patterns("__pycache__", "lib"))
    return root


def test_missing_library_lists_every_place_searched(lone_package):
    res = import_coda(lone_package, None)
    assert res.returncode != 0
    assert "ImportError" in res.stderr
    repo = lone_package.parent
    for place in ("CODA_TORCH_LIBRARY", str(lone_package / "coda" / "lib" / "libcoda_torch.so"),
                  str(repo / "build-torch" / "torch" / "libcoda_torch.so"),
                  str(repo / "build" / "torch" / "libcoda_torch.so")):
        assert place in res.stderr, f"{place} not listed in:\n{res.stderr}"


def test_env_var_that_is_not_a_file_is_an_error(lone_package, tmp_path):
    res = import_coda(lone_package, str(tmp_path / "nope.so"))
    assert res.returncode != 0
    assert "ImportError" in res.stderr and "nope.so" in res.stderr


def test_env_var_names_the_library(lone_package):
    if coda.library_path is None:
        pytest.skip("the ops were registered before coda was imported; no path to reuse")
    res = import_coda(lone_package, str(coda.library_path))
    assert res.returncode == 0, res.stderr
    assert f"LOADED {coda.library_path} 0.1.0" in res.stdout


def test_config_normalizes_rope_scaling():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2)
    keys = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    a = LlamaConfig(**base, rope_scaling=dict(keys, rope_type="llama3"))
    assert a == LlamaConfig(**base, rope_scaling=keys)
    assert (a.num_kv_heads, a.head_dim) == (2, 4)
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig(**base, rope_scaling=dict(keys, rope_type="yarn"))
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig(**base, rope_scaling={"factor": 8.0})
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(**base, num_kv_heads=3)
