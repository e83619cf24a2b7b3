#!/bin/sh
# nextn's install steps. The Dockerfile runs them, and tests/test_docker.py runs the Dockerfile's very
# RUN lines in a fresh venv (CI has no docker engine). Both install into the Python first on PATH.
#
#   sh docker/install.sh deps cpu|cuda   the [project] dependencies of ./pyproject.toml (torch pinned there);
#                                        needs only pyproject.toml, so this layer survives source edits
#   sh docker/install.sh nextn           nextn itself from ., editable (no deps), so models/demo stays its
#                                        default MODEL_DIR; then checks that `nextn` runs
#
# Where torch comes from:
#   cpu   the CPU wheel: pip also reads https://download.pytorch.org/whl/cpu (--extra-index-url), where the
#         pinned torch==2.13.0 resolves to 2.13.0+cpu (a local version sorts above PyPI's 2.13.0, which on
#         Linux is the CUDA build); no CUDA libraries, no triton.
#   cuda  PyPI's default Linux wheel: CUDA 13.0 torch (CUDA libraries as pip wheels) with triton, a
#         dependency of that wheel.
# TORCH_INDEX_URL, when set (even to ""), replaces that extra index; "" = pip's configured indexes only
# (the test sets it so: pip there finds a local CPU wheel). The deps step fails if the torch it installed
# is not the variant's build (CUDA or not; triton importable for cuda).
set -eu

deps() {
    case $1 in
        cpu) default_index=https://download.pytorch.org/whl/cpu ;;
        cuda) default_index= ;;
        *) echo "install.sh: unknown variant '$1' (cpu or cuda)" >&2; exit 2 ;;
    esac
    index=${TORCH_INDEX_URL-$default_index}
    req=$(mktemp)
    python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' >"$req"
    python -m pip install ${index:+--extra-index-url "$index"} -r "$req"
    rm -f "$req"
    python - "$1" <<'PY'
import sys

import torch

variant, cuda = sys.argv[1], torch.version.cuda
if variant == "cpu" and cuda is not None:
    sys.exit(f"install.sh: expected the CPU torch wheel, got torch {torch.__version__} (CUDA {cuda})")
if variant == "cuda":
    if cuda is None:
        sys.exit(f"install.sh: expected a CUDA torch wheel, got torch {torch.__version__}")
    import triton  # noqa: F401  (the engine's GPU kernels)
print(f"install.sh: torch {torch.__version__} (CUDA {cuda})")
PY
}

case ${1:-} in
    deps) deps "${2:?usage: install.sh deps cpu|cuda}" ;;
    nextn)
        python -m pip install --no-deps -e .
        nextn --help >/dev/null
        ;;
    *) echo "usage: install.sh deps cpu|cuda | install.sh nextn" >&2; exit 2 ;;
esac
