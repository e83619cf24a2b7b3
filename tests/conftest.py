"""Session setup shared by all tests.

Without a GPU the Triton kernels run under triton's interpreter, which triton selects when a kernel is
decorated (module import), so TRITON_INTERPRET must be set before any engine.model.ops kernel module loads.

On a CPU the tests run torch on one intra-op thread (unless OMP_NUM_THREADS says otherwise), as `nextn serve`
does on a 2-core box (cores - 1): the tests' models are tiny, so a second OpenMP thread only spins, against the
other thread and any other process (a demo-model fp64 session took 1.2 s on two threads of a loaded 2-core box
against 0.06 s on one). Results do not depend on it: the exactness tests compare bits computed in one process.

A run started in the background by a shell without job control (`cmd &` in a script, some CI runners) inherits
SIGINT ignored, and so would every `nextn serve` the tests start (an ignored signal stays ignored across exec);
the Ctrl-C tests need it delivered, so the test process catches it again (a caught signal is default after exec).
"""
import os
import signal

import torch

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.interp_speed import install as _fast_interpreter

    _fast_interpreter()  # the interpreter's own redundant re-patching skipped; see tests/interp_speed.py
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
