"""pyproject.toml's dependency floors are true: the server tests pass on the oldest web stack it allows.

The floors of the web stack (FLOOR_PACKAGES) are installed from the package registry into a throwaway
directory that is put in front of the main virtual environment on PYTHONPATH, so everything else (torch,
the test tools) comes from the main environment; then the server API and hardening tests run there in a
subprocess (about a minute). Skipped only when the registry cannot be reached.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from config.settings import REPO_ROOT

#: Packages whose floors the server tests exercise (pyproject.toml names each with a `>=` floor).
FLOOR_PACKAGES = ("fastapi", "uvicorn", "uvloop", "pydantic", "tokenizers", "jinja2", "prometheus-client")
#: What the floors bring that pyproject.toml does not name: the oldest starlette fastapi 0.115 accepts,
#: and the pydantic-core pydantic 2.12.0 pins. Update with the floors above.
COMPANIONS = {"starlette": "0.37.2", "pydantic-core": "2.41.1"}
TESTS = ["tests/test_server_api.py", "tests/test_server_hardening.py"]


def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def floors() -> dict[str, str]:
    """{package: its `>=` floor} for every dependency that declares one."""
    out = {}
    for dep in project()["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(,.*)?", dep)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_requires_python_matches_the_code():
    """config/settings.py imports tomllib (3.11+): requires-python must not admit 3.10."""
    spec = project()["requires-python"]
    assert spec == ">=3.11", spec
    assert sys.version_info >= (3, 11)


@pytest.mark.slow
def test_server_tests_pass_on_the_floor_versions(tmp_path):
    declared = floors()
    missing = [pkg for pkg in FLOOR_PACKAGES if pkg not in declared]
    assert not missing, f"pyproject.toml declares no floor for {missing}"
    pins = {**{pkg: declared[pkg] for pkg in FLOOR_PACKAGES}, **COMPANIONS}
    target = tmp_path / "floor"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
                        "--target", str(target), *(f"{pkg}=={v}" for pkg, v in pins.items())],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"could not install the floor versions: {r.stderr.strip()[-400:]}")
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    probe = ("import importlib.metadata as m, json, sys; "
             "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))")
    seen = subprocess.run([sys.executable, "-c", probe, *pins], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=60, check=True)
    def norm(versions: dict[str, str]) -> dict[str, str]:
        return {pkg: re.sub(r"(\.0)+$", "", v) for pkg, v in versions.items()}

    assert norm(json.loads(seen.stdout)) == norm(pins)  # the floors, not the main environment's, are imported
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                         capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
