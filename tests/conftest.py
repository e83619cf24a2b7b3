"""Session setup shared by all tests.

Without a GPU the Triton kernels run under triton's interpreter, which triton selects when a kernel is
decorated (module import), so TRITON_INTERPRET must be set before any engine.model.ops kernel module loads.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
