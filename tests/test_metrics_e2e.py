"""/metrics end to end: real servers on 127.0.0.1 serving the tiny checkpoint, real promtool, real Prometheus.

Contracts checked (DESIGN.md "Observability contracts"):
(a) after a mixed workload (greedy and seeded-sampled; chat and completions; streamed with
    stream_options.include_usage and not; n=2; a stop string that cancels its session), the sum over
    responses of ``usage.spec`` (rounds, drafted, accepted, pos_drafted, pos_accepted) equals EXACTLY the
    increase of the ``nextn_spec_decode_*`` counters of a ``nextn serve`` subprocess;
(b) a stream the client abandons mid-generation adds exactly the rounds its session ran: the counters'
    increase equals the server-side session's own ``SpecTelemetry`` (read through an injected
    ``session_factory`` of an in-process server), and ``request_success{finished_reason="abort"}`` +1;
    on that server (``metrics_compat="vllm"``) the ``vllm:`` series equal the ``nextn_`` ones;
(c) ``promtool check metrics`` passes on a real scrape after traffic;
(d) a real Prometheus scraping the server every second returns the spec counters with the values
    /metrics shows, and the PromQL documented in metrics/prometheus.py evaluates to metrics.derived's values.
promtool/Prometheus parts skip (with the reason) only when the binaries are not installed
(Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.spec import SPEC_TELEM_POS, SpecSession, SpecTelemetry
from metrics.derived import derived
from tests.server_fixtures import ServerThread, free_port, tiny_checkpoint, wait_until

K = 3
SPEC = "nextn_spec_decode_"
STARTUP_TIMEOUT_S = 120  # a cold `nextn serve` imports torch and loads the model; CI machines are shared


# ----------------------------------------------------------------------------------------------- helpers


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} parsed with prometheus_client's parser."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def spec_counters(series: dict, prefix: str = SPEC) -> SpecTelemetry:
    """The spec counters of one scrape as a SpecTelemetry (per-position lists padded to SPEC_TELEM_POS)."""
    t = SpecTelemetry()
    for (name, labels), v in series.items():
        pos = dict(labels).get("position")
        if name == prefix + "num_drafts_total":
            t.rounds += int(v)
        elif name == prefix + "num_draft_tokens_total":
            t.drafted += int(v)
        elif name == prefix + "num_accepted_tokens_total":
            t.accepted += int(v)
        elif name == prefix + "num_accepted_tokens_per_pos_total":
            t.pos_accepted[int(pos)] += int(v)
        elif name == prefix + "num_drafted_tokens_per_pos_total":
            t.pos_drafted[int(pos)] += int(v)
    return t


def as_tuple(t) -> tuple:
    pad = lambda xs: tuple(xs) + (0,) * (SPEC_TELEM_POS - len(xs))  # noqa: E731
    return (t.rounds, t.drafted, t.accepted, pad(t.pos_drafted), pad(t.pos_accepted))


def usage_sum(usages: list[dict]) -> SpecTelemetry:
    """Sum of the responses' usage.spec (per-position lists are trimmed to K by the server; pad them)."""
    total = SpecTelemetry()
    for u in usages:
        s = u["spec"]
        pad = lambda xs: list(xs) + [0] * (SPEC_TELEM_POS - len(xs))  # noqa: E731
        total.merge(SpecTelemetry(s["rounds"], s["drafted"], s["accepted"], pad(s["pos_drafted"]),
                                  pad(s["pos_accepted"])))
    return total


def sse_payloads(resp: httpx.Response) -> list[dict]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def scrape(url: str) -> tuple[str, dict]:
    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain")
    return r.text, parse_metrics(r.text)


def wait_quiescent(url: str, timeout: float = 30) -> None:
    """Until the server reports no running and no waiting request (its counters are then final)."""
    def idle() -> bool:
        s = scrape(url)[1]
        return all(v == 0 for (n, _), v in s.items() if n in ("nextn_num_requests_running",
                                                                 "nextn_num_requests_waiting"))
    assert wait_until(idle, timeout=timeout, interval=0.1), "server did not go idle"


# ------------------------------------------------------------------------------------------- a real CLI


def _nextn_exe() -> list[str]:
    exe = Path(sys.executable).with_name("nextn")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("nextn")
    if found is None:
        pytest.fail("the `nextn` console script is not installed (pip install -e .)")
    return [found]


@pytest.fixture(scope="module")
def cli_server():
    """`nextn serve TINY --num-speculative-tokens 3 --no-spec-adaptive` as a subprocess on 127.0.0.1; yields its
    base URL."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="nextn-serve-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTN_")}
    cmd = _nextn_exe() + ["serve", str(tiny_checkpoint()), "--host", "127.0.0.1", "--port", str(port),
                          "--device", "cpu", "--num-speculative-tokens", str(K), "--max-model-len", "1024",
                          "--log-level", "warning", "--no-spec-adaptive"]  # drafted counts at fixed K
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout=STARTUP_TIMEOUT_S, interval=0.2)
        if proc.poll() is not None or httpx.get(url + "/ready", timeout=2).status_code != 200:
            pytest.fail(f"`{' '.join(cmd)}` did not become ready:\n{Path(log.name).read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()  # SIGTERM: drain, exit 0
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def model_name(cli_server) -> str:
    return httpx.get(cli_server + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def workload(cli_server, model_name):
    """Run the mixed workload once; returns (scrape before, scrape after, usages, finish reasons)."""
    url = cli_server
    _, before = scrape(url)
    usages: list[dict] = []
    finish: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    chat = url + "/v1/chat/completions"
    compl = url + "/v1/completions"
    msgs = [{"role": "user", "content": "Hello world! The quick brown fox"}]

    def record(usage: dict, reasons: list[str]) -> None:
        assert usage is not None and "spec" in usage, usage
        with lock:
            usages.append(usage)
            finish.extend(reasons)

    def full(endpoint: str, body: dict) -> dict:
        r = httpx.post(endpoint, json={"model": model_name, **body}, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        record(j["usage"], [c["finish_reason"] for c in j["choices"]])
        return j

    def streamed(endpoint: str, body: dict) -> list[str]:
        body = {"model": model_name, "stream": True, "stream_options": {"include_usage": True}, **body}
        with httpx.stream("POST", endpoint, json=body, timeout=120) as r:
            assert r.status_code == 200
            payloads = sse_payloads(r)
        with_usage = [p for p in payloads if p.get("usage")]
        assert len(with_usage) == 1 and payloads[-1] is with_usage[0], "one final usage chunk"
        reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c.get("finish_reason")]
        record(with_usage[0]["usage"], reasons)
        return reasons

    def stopped_by_string(body: dict) -> None:
        reasons = streamed(compl, body)
        assert reasons == ["stop"], f"stop string {stop!r} did not end the stream: {reasons}"

    # A greedy completion first: a piece of its text becomes a stop string for a later request (a stop
    # string cancels the session mid-burst; its rounds must still be counted once, in usage and counters).
    greedy = full(compl, {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    text = greedy["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text.strip()[:1]
    assert stop, f"greedy text {text!r} gives no stop string"

    jobs = [
        lambda: full(chat, {"messages": msgs, "max_tokens": 12, "temperature": 0}),
        lambda: streamed(chat, {"messages": msgs, "max_tokens": 12, "temperature": 0}),
        lambda: full(chat, {"messages": msgs, "max_tokens": 12, "temperature": 0.9, "seed": 11}),
        lambda: streamed(compl, {"prompt": "Numbers 0 1 2", "max_tokens": 10, "temperature": 0.7, "seed": 5,
                                 "ignore_eos": True}),
        lambda: full(compl, {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.8, "seed": 1, "n": 2,
                             "ignore_eos": True}),
        lambda: stopped_by_string({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
                                   "ignore_eos": True, "stop": [stop]}),
    ]

    def run(fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    if errors:
        raise errors[0]
    assert len(usages) == len(jobs) + 1
    wait_quiescent(url)
    _, after = scrape(url)
    return before, after, usages, finish


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.slow
def test_usage_spec_sum_equals_counter_increase(workload):
    """(a) Σ usage.spec == Δ counters, every field, exactly."""
    before, after, usages, finish = workload
    total = usage_sum(usages)
    increase = spec_counters(after).delta_since(spec_counters(before))
    assert as_tuple(increase) == as_tuple(total)
    # the check is not vacuous: drafts were made and accepted, at more than one position
    assert total.rounds > 0 and total.drafted > 0 and total.accepted > 0 and total.pos_accepted[0] > 0
    assert all(total.pos_drafted[j] > 0 for j in range(K))
    # per-position series beyond K never appeared (K is fixed on this server)
    assert not any(total.pos_drafted[K:]) and not any(increase.pos_drafted[K:])
    assert finish.count("length") >= 4  # the max_tokens path ran (the stop-string job checks its own)


@pytest.mark.slow
def test_counter_increase_is_stable_after_quiescence(cli_server, workload):
    """Nothing is added after the last response: a later scrape shows the same spec counters."""
    _, after, _, _ = workload
    assert as_tuple(spec_counters(scrape(cli_server)[1])) == as_tuple(spec_counters(after))


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus); CI installs it")
    return exe


@pytest.mark.slow
def test_promtool_accepts_real_scrape(cli_server, workload):
    """(c) the live /metrics body after traffic lints clean."""
    exe = _promtool()
    text, series = scrape(cli_server)
    assert spec_counters(series).rounds > 0
    r = subprocess.run([exe, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


# ---------------------------------------------------------------------------------------- a real Prometheus


@pytest.fixture(scope="module")
def prometheus(cli_server):
    """A Prometheus scraping cli_server every second (temp config and storage); yields its query URL."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus); CI installs it")
    target = urllib.parse.urlsplit(cli_server).netloc
    with tempfile.TemporaryDirectory(prefix="nextn-prom-") as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: nextn\n    static_configs:\n"
                       f"      - targets: ['{target}']\n")
        port = free_port()
        log = Path(tmp) / "prometheus.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/data",
                                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                    stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            def up() -> bool:
                if proc.poll() is not None:
                    return True
                try:
                    return httpx.get(url + "/-/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(up, timeout=60, interval=0.2)
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def promql(url: str, query: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def prom_values(url: str, query: str, key: str | None = None) -> dict:
    """{label value of `key` (or None): float value} of an instant query's vector result."""
    return {(res["metric"].get(key) if key else None): float(res["value"][1]) for res in promql(url, query)}


@pytest.mark.slow
def test_prometheus_scrapes_spec_counters(prometheus, cli_server, workload):
    """(d) Prometheus's view equals /metrics (server idle, so values are final); documented PromQL works."""
    expected = spec_counters(scrape(cli_server)[1])
    assert expected.rounds > 0

    def caught_up() -> bool:
        return prom_values(prometheus, "nextn_spec_decode_num_drafts_total") == {None: expected.rounds}

    assert wait_until(caught_up, timeout=30, interval=0.5), (
        f"Prometheus has {promql(prometheus, 'nextn_spec_decode_num_drafts_total')}, /metrics {expected.rounds}")
    res = promql(prometheus, "nextn_spec_decode_num_drafts_total")
    assert len(res) == 1 and res[0]["metric"]["engine"] == "0" and res[0]["metric"]["job"] == "nextn"
    assert prom_values(prometheus, "nextn_spec_decode_num_draft_tokens_total") == {None: expected.drafted}
    assert prom_values(prometheus, "nextn_spec_decode_num_accepted_tokens_total") == {None: expected.accepted}
    acc_pos = prom_values(prometheus, "nextn_spec_decode_num_accepted_tokens_per_pos_total", "position")
    dr_pos = prom_values(prometheus, "nextn_spec_decode_num_drafted_tokens_per_pos_total", "position")
    assert acc_pos == {str(j): expected.pos_accepted[j] for j in range(K)}
    assert dr_pos == {str(j): expected.pos_drafted[j] for j in range(K)}

    # The module docstring's PromQL, with rate(x[5m]) replaced by x (a counter's whole history): the
    # expressions must parse, join the right series, and give metrics.derived's numbers.
    d = derived(expected, positions=K)
    acc = prom_values(prometheus, "nextn_spec_decode_num_accepted_tokens_total"
                                  " / nextn_spec_decode_num_draft_tokens_total")
    assert acc == {None: pytest.approx(d["acceptance_rate"], rel=1e-12)}
    mal = prom_values(prometheus, "1 + nextn_spec_decode_num_accepted_tokens_total"
                                  " / nextn_spec_decode_num_drafts_total")
    assert mal == {None: pytest.approx(d["mean_acceptance_length"], rel=1e-12)}
    vllm_style = prom_values(prometheus, "nextn_spec_decode_num_accepted_tokens_per_pos_total / ignoring(position)"
                                         " group_left nextn_spec_decode_num_drafts_total", "position")
    assert vllm_style == {str(j): pytest.approx(r, rel=1e-12) for j, r in enumerate(d["accept_rate_per_pos_vllm"])}
    memra_style = prom_values(prometheus, "nextn_spec_decode_num_accepted_tokens_per_pos_total"
                                          " / nextn_spec_decode_num_drafted_tokens_per_pos_total", "position")
    assert memra_style == {str(j): pytest.approx(r, rel=1e-12) for j, r in enumerate(d["accept_rate_per_pos"])}


# ------------------------------------------------------------------------------ cancellation (in-process)


class RecordingSession(SpecSession):
    """A real SpecSession that the test can see (every instance is recorded) and whose rounds run a little
    slower, so a client's cancel lands while the session is still generating."""

    sessions: list["RecordingSession"] = []
    burst_delay_s = 0.05

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingSession.sessions.append(self)

    def commit_round(self, *args, **kwargs) -> None:
        time.sleep(self.burst_delay_s)
        super().commit_round(*args, **kwargs)


@pytest.fixture(scope="module")
def compat_server():
    """In-process server (same wiring as `nextn serve`) with --metrics-compat vllm and session recording."""
    with ServerThread(worker_kw={"session_factory": RecordingSession}, num_speculative_tokens=K, spec_adaptive=False,
                      max_model_len=1024, metrics_compat="vllm") as s:
        yield s


def test_cancelled_stream_adds_exactly_its_rounds(compat_server):
    """(b) Δ counters == the abandoned session's own telemetry (rounds run before the worker saw the cancel)."""
    srv = compat_server
    _, before = scrape(srv.url)
    n_sessions = len(RecordingSession.sessions)
    max_tokens = 600
    body = {"model": srv.model, "prompt": "Hello world!", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:  # a few bursts in: leave
                    break
    assert len(RecordingSession.sessions) == n_sessions + 1
    sess = RecordingSession.sessions[-1]
    assert wait_until(lambda: srv.worker.num_active == 0 and srv.worker.num_waiting == 0, timeout=30), \
        "the abandoned session was not dropped"
    wait_quiescent(srv.url)  # the gauges are set after the retired session is accounted
    # close() marks a session that had not finished by itself as "abort"
    assert sess.finish_reason == "abort" and len(sess.emitted) < max_tokens, "the session ran to completion"
    _, after = scrape(srv.url)
    increase = spec_counters(after).delta_since(spec_counters(before))
    assert sess.telem.rounds >= 2  # the three chunks the client received: the prefill's first token + >= 2 rounds
    assert as_tuple(increase) == as_tuple(sess.telem)
    aborts = lambda s: s[("nextn_request_success_total",  # noqa: E731
                          frozenset({"model_name": srv.model, "engine": "0", "finished_reason": "abort"}.items()))]
    assert aborts(after) - aborts(before) == 1


def test_vllm_compat_names_equal_nextn_on_live_server(compat_server):
    """With metrics_compat=vllm every vllm: spec/serving series equals its nextn_ twin on a real scrape."""
    srv = compat_server
    r = httpx.post(srv.base_url + "/completions", json={"model": srv.model, "prompt": "Hi", "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    assert wait_until(lambda: srv.worker.num_active == 0, timeout=30)
    text, series = scrape(srv.url)
    vllm = {k: v for k, v in series.items() if k[0].startswith("vllm:")}
    assert {n for n, _ in vllm} >= {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                                    "vllm:spec_decode_num_accepted_tokens_total",
                                    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                    "vllm:generation_tokens_total", "vllm:num_requests_running"}
    for (name, labels), v in vllm.items():
        assert series[("nextn_" + name[len("vllm:"):], labels)] == v, name
    v, n = spec_counters(series, "vllm:spec_decode_"), spec_counters(series)
    assert (v.rounds, v.drafted, v.accepted, v.pos_accepted) == (n.rounds, n.drafted, n.accepted, n.pos_accepted)
    assert not any(v.pos_drafted)  # drafted-per-position is nextn-only, not aliased
    assert spec_counters(series).rounds > 0
