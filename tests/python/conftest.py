"""Make `import coda` work from a source checkout: if the package is not installed, put
<repo>/python (found relative to this file) on sys.path."""

import importlib.util
import logging
import os
import sys
from pathlib import Path

if importlib.util.find_spec("coda") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

# torch.compile's structured trace logs at DEBUG; pytest would paste thousands of those empty lines
# into every failure report. Keep them only when a trace was asked for.
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").setLevel(logging.WARNING)
