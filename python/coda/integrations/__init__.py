"""coda inside the model classes people already train.

``coda.integrations.hf``: a transformers ``LlamaForCausalLM`` patched in place (:func:`patch_hf`),
so that it stays a ``PreTrainedModel`` with its own parameters and checkpoint layout.
"""

from __future__ import annotations

from .hf import is_patched, patch_hf, unpatch_hf

__all__ = ["patch_hf", "unpatch_hf", "is_patched"]
