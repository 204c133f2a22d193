"""coda inside the model classes people already train.

``coda.integrations.hf``: a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3ForCausalLM`` patched in place (:func:`patch_hf`, in bf16 or blockwise FP8), so that it
stays a ``PreTrainedModel`` with its own parameters and checkpoint layout.

``coda.integrations.torchtitan``: a TorchTitan model converter (``CodaConverter``), listed in a
llama3 registry's ``converters`` as float8's is. Imported on demand (it needs TorchTitan).
"""

from __future__ import annotations

from .hf import is_patched, patch_hf, refresh_fp8_weights, unpatch_hf

__all__ = ["patch_hf", "unpatch_hf", "is_patched", "refresh_fp8_weights"]
