"""transformers as a test-only oracle. fla is blocked first: fla-core + triton on a CPU box breaks HF Qwen3.5."""
from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402


def load_hf(model_dir, dtype=torch.float32):
    """transformers' Qwen3_5(Moe)ForCausalLM from a checkpoint dir (it ignores mtp.* and model.visual.*)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
