"""Test-only speed-up of triton's CPU interpreter (TRITON_INTERPRET=1): nothing of nextn changes.

The interpreter re-patches the triton.language modules a @triton.jit helper sees (`_patch_lang`: a scan of every
builtin) on each call of the helper from inside a kernel (tl.zeros and tl.sum are such helpers), although those
modules stay patched until the launch ends: the helper's patch scope is never restored. That scan was a third of
the interpreter's time in our kernel tests. Here a helper whose modules this launch patched already skips it;
everything else runs as triton wrote it.
Applied by tests/conftest.py, and by `python -m tests.interp_speed script.py args` for a subprocess.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def install() -> bool:
    """Make helper calls skip the redundant re-patch; False (and no change) where the interpreter's shape differs."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # noqa: BLE001 - no triton: nothing to speed up
        return False
    fn_cls, kern_cls = getattr(ti, "InterpretedFunction", None), getattr(ti, "GridExecutor", None)
    if fn_cls is None or kern_cls is None or getattr(fn_cls, "_nextn_fast", False) or not hasattr(ti, "_patch_lang"):
        return False
    state: dict = {"launch": False, "done": set()}  # done: ids of the language modules patched in this launch
    langs_of: dict = {}  # fn -> ids of the triton.language modules its globals see (what _patch_lang patches)
    kern_call, orig_patch = kern_cls.__call__, ti._patch_lang

    def launch(self, *args, **kwargs):
        state["launch"], state["done"] = True, set()
        try:
            return kern_call(self, *args, **kwargs)
        finally:
            state["launch"], state["done"] = False, set()

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is ti.tl or v is ti.tl.core)
        if state["launch"] and langs <= state["done"]:
            return ti._LangPatchScope()  # these modules are patched for this launch already
        scope = orig_patch(fn)
        if state["launch"]:
            state["done"] |= langs
        return scope

    kern_cls.__call__ = launch
    ti._patch_lang = patch_lang
    fn_cls._nextn_fast = True
    return True


if __name__ == "__main__":
    install()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))  # as `python script.py` would
    runpy.run_path(sys.argv[0], run_name="__main__")
