"""Unit tests for metrics/: ServingMetrics (Prometheus exposition) and metrics.derived.

Contracts checked:
- counters equal, exactly, the sum of the SpecTelemetry deltas fed (parsed back from render());
- per-position series exist at 0 from startup for 0..min(K,8)-1, later positions appear only with data;
- K == 0 registers no spec families;
- compat_vllm exposes vLLM's names with values equal to the nextn_ ones (and no _created lines);
- the default rendering passes `promtool check metrics`; the vllm-compat one knowingly does not;
- metrics.derived matches the published definitions (memra receipt: 162/486/314 -> 2.938 tok/round).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import spec as engine_spec
from engine.spec import SpecTelemetry as Telemetry
from metrics.derived import derived
from engine.cache import PrefixCacheStats
from metrics.prometheus import (
    GRAMMAR_COMPILE_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    SPEC_TELEM_POS,
    TTFT_BUCKETS,
    ServingMetrics,
)

MODEL = "tiny-qwen35"
SPEC_FAMILIES = (
    "nextn_spec_decode_num_drafts",
    "nextn_spec_decode_num_draft_tokens",
    "nextn_spec_decode_num_accepted_tokens",
    "nextn_spec_decode_num_accepted_tokens_per_pos",
    "nextn_spec_decode_num_drafted_tokens_per_pos",
    "nextn_spec_decode_k",
)


def telem(rounds=0, drafted=0, accepted=0, pos_drafted=(), pos_accepted=()):
    """A telemetry value with the given fields (per-position lists zero-padded to SPEC_TELEM_POS)."""
    t = Telemetry()
    t.rounds, t.drafted, t.accepted = rounds, drafted, accepted
    t.pos_drafted = list(pos_drafted) + [0] * (SPEC_TELEM_POS - len(pos_drafted))
    t.pos_accepted = list(pos_accepted) + [0] * (SPEC_TELEM_POS - len(pos_accepted))
    return t


def record_round(t, k_round: int, n_acc: int) -> None:
    """memra's per-round counting rule (reference/memra-concepts.md §3), applied to t in place."""
    t.merge(telem(1, k_round, n_acc, [1] * min(k_round, SPEC_TELEM_POS), [1] * min(n_acc, SPEC_TELEM_POS)))


def scrape(m: ServingMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} parsed from render() with prometheus_client's own parser."""
    body, ctype = m.render()
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def lbl(**kw) -> frozenset:
    return frozenset({"model_name": MODEL, "engine": "0", **{k: str(v) for k, v in kw.items()}}.items())


def spec_values(series, prefix="nextn_"):
    """(rounds, drafted, accepted, pos_drafted{j}, pos_accepted{j}) as read from a scrape."""
    get = lambda n: series[(f"{prefix}spec_decode_{n}_total", lbl())]  # noqa: E731
    pos = {"pos_drafted": {}, "pos_accepted": {}}
    for (name, labels), v in series.items():
        d = dict(labels)
        if name == f"{prefix}spec_decode_num_accepted_tokens_per_pos_total":
            pos["pos_accepted"][int(d["position"])] = v
        elif name == f"{prefix}spec_decode_num_drafted_tokens_per_pos_total":
            pos["pos_drafted"][int(d["position"])] = v
    return (get("num_drafts"), get("num_draft_tokens"), get("num_accepted_tokens"),
            pos["pos_drafted"], pos["pos_accepted"])


# ------------------------------------------------------------------------------------------------
# spec counters


def test_memra_stash_and_diff_rounds_feed_exact_counters():
    """memra spec.rs test: rounds (3,3),(3,1); stash; (3,2) -> delta (1,3,2); counters = sum of deltas."""
    m = ServingMetrics(MODEL, 3)
    session, stash = Telemetry(), Telemetry()
    record_round(session, 3, 3)
    record_round(session, 3, 1)
    d1 = session.delta_since(stash)
    m.add_spec(d1)
    stash = session.copy()
    record_round(session, 3, 2)
    d2 = session.delta_since(stash)
    assert (d2.rounds, d2.drafted, d2.accepted) == (1, 3, 2)
    assert list(d2.pos_drafted) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert list(d2.pos_accepted) == [1, 1, 0, 0, 0, 0, 0, 0]
    m.add_spec(d2)
    rounds, drafted, accepted, pd, pa = spec_values(scrape(m))
    assert (rounds, drafted, accepted) == (3, 9, 6)
    assert pd == {0: 3, 1: 3, 2: 3}
    assert pa == {0: 3, 1: 2, 2: 1}
    # the stash-and-diff sum equals the session's cumulative telemetry
    assert (session.rounds, session.drafted, session.accepted) == (3, 9, 6)


def test_memra_receipt_counters_and_derived():
    """memra receipt (q9, K=3): 162 rounds, 486 drafted, 314 accepted, per-pos .796/.648/.494, 2.938 tok/round."""
    pa = [129, 105, 80]  # 129/162=.796, 105/162=.648, 80/162=.494; sum 314
    t = telem(162, 486, 314, [162, 162, 162], pa)
    m = ServingMetrics(MODEL, 3)
    m.add_spec(t)
    rounds, drafted, accepted, pdr, pac = spec_values(scrape(m))
    assert (rounds, drafted, accepted) == (162, 486, 314)
    assert pdr == {0: 162, 1: 162, 2: 162} and pac == {0: 129, 1: 105, 2: 80}

    d = derived(t)
    assert d["acceptance_rate"] == pytest.approx(314 / 486)
    assert round(d["tokens_per_round"], 3) == 2.938
    assert d["mean_acceptance_length"] == pytest.approx(1 + 314 / 162)
    assert [round(r, 3) for r in d["accept_rate_per_pos_vllm"]] == [0.796, 0.648, 0.494]
    # every round drafted K, so memra's conditional rate equals vLLM's
    assert d["accept_rate_per_pos"] == pytest.approx(d["accept_rate_per_pos_vllm"])
    assert d["pos_drafted"] == [162, 162, 162] and d["pos_accepted"] == pa


def test_counters_accumulate_many_deltas_exactly():
    """Counter increase == sum of many deltas (values well beyond float-rounding trouble for ints < 2**53)."""
    m = ServingMetrics(MODEL, 4)
    total = Telemetry()
    rounds = [(4, 4), (4, 0), (2, 2), (4, 3), (1, 0), (3, 1)] * 50  # k_round < K models p-min cuts
    for k, a in rounds:
        d = Telemetry()
        record_round(d, k, a)
        m.add_spec(d)
        total.merge(d)
    got = spec_values(scrape(m))
    assert got[:3] == (total.rounds, total.drafted, total.accepted) == (300, 900, 500)
    assert got[3] == {j: v for j, v in enumerate(total.pos_drafted) if j < 4}
    assert got[4] == {j: v for j, v in enumerate(total.pos_accepted) if j < 4}


def test_per_position_series_precreated_at_zero():
    m = ServingMetrics(MODEL, 3)
    s = scrape(m)
    rounds, drafted, accepted, pd, pa = spec_values(s)
    assert (rounds, drafted, accepted) == (0, 0, 0)
    assert pd == {0: 0, 1: 0, 2: 0}
    assert pa == {0: 0, 1: 0, 2: 0}


def test_positions_beyond_k_created_on_data_and_capped_at_8():
    m = ServingMetrics(MODEL, 2)
    m.add_spec(telem(1, 2, 1, [1, 1], [1]))
    assert set(spec_values(scrape(m))[3]) == {0, 1}
    # a delta reaching position 4 (e.g. K raised at run time): children 2..4 appear then, with its values
    m.add_spec(telem(1, 5, 3, [1, 1, 1, 1, 1], [1, 1, 1]))
    _, _, _, pd, pa = spec_values(scrape(m))
    assert pd == {0: 2, 1: 2, 2: 1, 3: 1, 4: 1}
    assert pa == {0: 2, 1: 1, 2: 1}  # zero entries create no series

    big = ServingMetrics(MODEL, 10)  # more spec tokens than telemetry positions
    assert set(spec_values(scrape(big))[3]) == set(range(SPEC_TELEM_POS))
    with pytest.raises(ValueError):
        big.add_spec(telem(1, 9, 0, [1] * 9))


def test_spec_off_registers_no_spec_families():
    m = ServingMetrics(MODEL, 0)
    m.add_spec(telem())  # all-zero delta: fine
    m.add_spec(telem(1, 3, 1, [1, 1, 1], [1]))  # cannot happen with spec off; dropped, not exported
    body, _ = m.render()
    assert b"spec_decode" not in body
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "nextn_prompt_tokens" in names and not any("spec" in n for n in names)
    on = {f.name for f in text_string_to_metric_families(ServingMetrics(MODEL, 1).render()[0].decode())}
    assert set(SPEC_FAMILIES) <= on and not set(SPEC_FAMILIES) & names


def test_spec_k_histogram_counts_each_rows_k_and_keeps_the_cost_table():
    """set_spec_k's cumulative counts become histogram observations (each k as often as its count grew); the cost
    table is kept for /health; with speculation off nothing is exported."""
    from engine.kpolicy import SpecKStats
    m = ServingMetrics(MODEL, 3)
    m.set_spec_k(SpecKStats((2, 0, 1, 4), {"1": {"1": 5.0}}))
    m.set_spec_k(SpecKStats((3, 0, 1, 6), {"1": {"1": 4.0}}))
    fam = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}["nextn_spec_decode_k"]
    le = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert le == {"0.0": 3, "1.0": 3, "2.0": 4, "3.0": 10, "+Inf": 10}
    assert [s.value for s in fam.samples if s.name.endswith("_sum")] == [2 + 18]
    assert m.spec_costs == {"1": {"1": 4.0}}
    off = ServingMetrics(MODEL, 0)
    off.set_spec_k(SpecKStats((5,), {}))
    assert b"spec_decode_k" not in off.render()[0]


def test_negative_delta_rejected_without_partial_update():
    m = ServingMetrics(MODEL, 3)
    m.add_spec(telem(2, 6, 3, [2, 2, 2], [2, 1]))
    before = scrape(m)
    with pytest.raises(ValueError):
        m.add_spec(telem(1, 3, 2, [1, 1, 1], [1, -1]))
    assert spec_values(scrape(m)) == spec_values(before)
    with pytest.raises(ValueError):
        m.add_prompt_tokens(-1)


def test_scrape_never_sees_half_a_delta():
    """add_spec and render share a lock: in every scrape drafted == 3*rounds and accepted == pos_accepted[0]."""
    m = ServingMetrics(MODEL, 3)
    d = telem(1, 3, 1, [1, 1, 1], [1])
    stop = threading.Event()

    def feed():
        while not stop.is_set():
            m.add_spec(d)

    th = threading.Thread(target=feed)
    th.start()
    try:
        for _ in range(100):
            rounds, drafted, accepted, pd, pa = spec_values(scrape(m))
            assert drafted == 3 * rounds and accepted == rounds == pa[0] == pd[2]
    finally:
        stop.set()
        th.join()


def test_independent_registries():
    """Each instance owns its registry: same model name twice in one process must not collide."""
    a, b = ServingMetrics(MODEL, 3), ServingMetrics(MODEL, 3)
    a.add_spec(telem(1, 3, 3, [1, 1, 1], [1, 1, 1]))
    assert spec_values(scrape(b))[0] == 0 and spec_values(scrape(a))[0] == 1


def test_metrics_import_is_light():
    """metrics/ never imports the engine or torch (the server process imports them anyway, tools must not)."""
    code = "import sys, metrics.prometheus, metrics.derived; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr


def test_engine_telemetry_width_matches():
    """metrics keeps its own copy of the width (importing metrics must not import torch); they must agree."""
    assert engine_spec.SPEC_TELEM_POS == SPEC_TELEM_POS


# ------------------------------------------------------------------------------------------------
# serving metrics


def _bucket_bounds(series, name):
    return sorted(float(dict(l)["le"]) for (n, l) in series if n == name + "_bucket")


def test_histogram_buckets_are_vllms():
    s = scrape(ServingMetrics(MODEL, 3))
    for name, buckets in [
        ("nextn_time_to_first_token_seconds", TTFT_BUCKETS),
        ("nextn_inter_token_latency_seconds", ITL_BUCKETS),
        ("nextn_e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
        ("nextn_request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
        ("nextn_grammar_compile_seconds", GRAMMAR_COMPILE_BUCKETS),
    ]:
        assert _bucket_bounds(s, name) == [*buckets, math.inf], name
    # spot-check against the values in reference/serving-anchors.md §1.2 (not just our own constants)
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80 and len(ITL_BUCKETS) == 19
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680
    assert len(REQUEST_LATENCY_BUCKETS) == 21


def test_serving_metrics_values():
    m = ServingMetrics(MODEL, 3)
    m.add_prompt_tokens(17)
    m.add_prompt_tokens(5)
    m.add_generation_tokens(40)
    m.set_running(3)
    m.set_waiting(2)
    m.set_running(1)
    for r in ("stop", "stop", "length", "abort", "error", "tool_calls"):
        m.request_finished(r)
    with pytest.raises(ValueError):
        m.request_finished("bogus")
    m.observe_ttft(0.03)
    m.observe_ttft(0.5)
    m.observe_itl(0.012)
    m.observe_e2e(1.2)
    m.observe_queue_time(0.0)
    m.observe_grammar_compile(0.004)
    s = scrape(m)
    assert s[("nextn_prompt_tokens_total", lbl())] == 22
    assert s[("nextn_generation_tokens_total", lbl())] == 40
    assert s[("nextn_num_requests_running", lbl())] == 1
    assert s[("nextn_num_requests_waiting", lbl())] == 2
    assert s[("nextn_kv_cache_usage_perc", lbl())] == 0  # present from the start
    for reason, n in {"stop": 3, "length": 1, "abort": 1, "error": 1}.items():
        assert s[("nextn_request_success_total", lbl(finished_reason=reason))] == n
    ttft = "nextn_time_to_first_token_seconds"
    assert s[(ttft + "_count", lbl())] == 2 and s[(ttft + "_sum", lbl())] == pytest.approx(0.53)
    assert s[(ttft + "_bucket", lbl(le="0.02"))] == 0
    assert s[(ttft + "_bucket", lbl(le="0.04"))] == 1
    assert s[(ttft + "_bucket", lbl(le="0.5"))] == 2
    assert s[("nextn_inter_token_latency_seconds_bucket", lbl(le="0.025"))] == 1
    assert s[("nextn_inter_token_latency_seconds_bucket", lbl(le="0.01"))] == 0
    assert s[("nextn_e2e_request_latency_seconds_bucket", lbl(le="1.0"))] == 0
    assert s[("nextn_e2e_request_latency_seconds_bucket", lbl(le="1.5"))] == 1
    assert s[("nextn_request_queue_time_seconds_bucket", lbl(le="0.3"))] == 1
    assert s[("nextn_grammar_compile_seconds_bucket", lbl(le="0.005"))] == 1
    assert s[("nextn_grammar_compile_seconds_bucket", lbl(le="0.0025"))] == 0


def test_pool_usage_is_the_fraction_of_slots_held():
    m = ServingMetrics(MODEL, 3)
    for held, slots, want in ((3, 8, 0.375), (8, 8, 1.0), (0, 1, 0.0)):
        m.set_pool_usage(held, slots)
        assert scrape(m)[("nextn_kv_cache_usage_perc", lbl())] == want
    for held, slots in ((9, 8), (-1, 8), (0, 0)):
        with pytest.raises(ValueError):
            m.set_pool_usage(held, slots)
    assert scrape(m)[("nextn_kv_cache_usage_perc", lbl())] == 0.0  # a rejected value changes nothing


def test_every_family_has_help_and_model_engine_labels():
    m = ServingMetrics(MODEL, 3, compat_vllm=True)
    body, _ = m.render()
    fams = list(text_string_to_metric_families(body.decode()))
    assert fams
    for f in fams:
        assert f.documentation, f.name
        for s in f.samples:
            assert s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0", s


# ------------------------------------------------------------------------------------------------
# vLLM compatibility alias


def _loaded(compat: bool) -> ServingMetrics:
    m = ServingMetrics(MODEL, 3, compat_vllm=compat)
    m.add_spec(telem(162, 486, 314, [162, 162, 162], [129, 105, 80]))
    m.add_spec(telem(1, 2, 0, [1, 1], []))
    m.add_prompt_tokens(9)
    m.add_generation_tokens(11)
    m.set_running(2)
    m.set_waiting(1)
    m.set_prefix_cache(PrefixCacheStats(queries=900, hits=512, blocks=3, bytes=3000, capacity_bytes=10_000))
    m.set_pool_usage(2, 8)
    m.request_finished("length")
    for f in (m.observe_ttft, m.observe_itl, m.observe_e2e, m.observe_queue_time, m.observe_grammar_compile):
        f(0.07)
    return m


VLLM_NAMES = {
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
}


def test_compat_vllm_exposes_equal_values_under_both_names():
    s = scrape(_loaded(True))
    vllm = {k: v for k, v in s.items() if k[0].startswith("vllm:")}
    assert VLLM_NAMES <= {n for n, _ in vllm}
    for (name, labels), v in vllm.items():
        assert not name.endswith("_created"), name
        assert s[("nextn_" + name[len("vllm:"):], labels)] == v, name
    # every nextn series of an aliased family has its vllm twin
    for (name, labels), v in s.items():
        base = name[len("nextn_"):]
        nextn_only = any(x in name for x in ("drafted_tokens_per_pos", "spec_decode_k_", "grammar_compile",
                                             "prefix_cache_bytes",
                                             "prefix_cache_resident_bytes",
                                             "prefix_cache_blocks", "prefix_cache_capacity"))
        if not name.startswith("nextn_") or name.endswith("_created") or nextn_only:
            continue
        assert vllm[("vllm:" + base, labels)] == v, name
    # nextn-only families are not aliased (vLLM tooling sees vLLM's schema only)
    assert not any("drafted_tokens_per_pos" in n or "grammar" in n for n, _ in vllm)
    # values stay in step after further updates (the alias reads the same collectors)
    assert s[("vllm:spec_decode_num_drafts_total", lbl())] == 163


def test_compat_vllm_off_by_default():
    body, _ = _loaded(False).render()
    assert b"vllm:" not in body


def _vllm_bench_style_parse(text: str) -> dict:
    """What `vllm bench serve` (fetch_spec_decode_metrics) reads: lines starting vllm:spec_decode."""
    out = defaultdict(float)
    per_pos = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        name, value = line.split("{")[0], float(line.split()[-1])
        if "num_accepted_tokens_per_pos" in name:
            per_pos[int(line.split('position="')[1].split('"')[0])] += value
        elif "num_drafts" in name:
            out["num_drafts"] += value
        elif "num_draft_tokens" in name:
            out["num_draft_tokens"] += value
        elif "num_accepted_tokens" in name:
            out["num_accepted_tokens"] += value
    return {**out, "per_pos": dict(per_pos)}


def test_compat_vllm_as_vllm_bench_reads_it():
    body, _ = _loaded(True).render()
    got = _vllm_bench_style_parse(body.decode())
    assert got == {"num_drafts": 163, "num_draft_tokens": 488, "num_accepted_tokens": 314,
                   "per_pos": {0: 129, 1: 105, 2: 80}}


# ------------------------------------------------------------------------------------------------
# promtool


def _promtool(body: bytes) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus); CI installs it")
    return subprocess.run([exe, "check", "metrics"], input=body, capture_output=True, timeout=60)


def test_promtool_accepts_default_rendering():
    for m in (_loaded(False), ServingMetrics(MODEL, 3), ServingMetrics(MODEL, 0)):
        r = _promtool(m.render()[0])
        assert r.returncode == 0, (r.stdout + r.stderr).decode()


def test_promtool_rejects_vllm_compat_rendering_as_documented():
    """compat_vllm is knowingly not promtool-clean; this also proves the lint above can fail."""
    r = _promtool(_loaded(True).render()[0])
    assert r.returncode != 0
    assert b"should not contain ':'" in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# derived


def test_derived_definitions_under_pmin_cuts():
    """Rounds drafting fewer than K tokens: memra's conditional rate and vLLM's survival rate diverge."""
    t = Telemetry()
    for k, a in [(3, 3), (1, 1), (3, 0), (2, 1)]:
        record_round(t, k, a)
    d = derived(t)
    assert (d["rounds"], d["drafted"], d["accepted"]) == (4, 9, 5)
    assert d["acceptance_rate"] == pytest.approx(5 / 9)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert d["tokens_per_round"] == pytest.approx((5 + 4) / 4)
    assert d["pos_drafted"] == [4, 3, 2] and d["pos_accepted"] == [3, 1, 1]
    assert d["accept_rate_per_pos"] == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    assert d["accept_rate_per_pos_vllm"] == pytest.approx([3 / 4, 1 / 4, 1 / 4])
    assert derived(t, positions=5)["pos_drafted"] == [4, 3, 2, 0, 0]
    assert derived(t, positions=5)["accept_rate_per_pos"][3:] == [None, None]


def test_derived_empty_and_mapping_input():
    d = derived(Telemetry())
    assert d["acceptance_rate"] is None and d["mean_acceptance_length"] is None
    assert d["tokens_per_round"] is None and d["pos_drafted"] == [] and d["accept_rate_per_pos"] == []
    as_json = {"rounds": 2, "drafted": 4, "accepted": 1, "pos_drafted": [2, 2], "pos_accepted": [1]}
    d = derived(as_json)
    assert d["acceptance_rate"] == 0.25 and d["pos_accepted"] == [1, 0]
    assert d["accept_rate_per_pos"] == [0.5, 0.0]


def test_prefix_cache_counters_advance_by_the_engine_counters_increase():
    m = ServingMetrics(MODEL, 3)
    m.set_prefix_cache(PrefixCacheStats(capacity_bytes=4096))
    s = scrape(m)
    assert s[("nextn_prefix_cache_queries_total", lbl())] == 0 and s[("nextn_prefix_cache_hits_total", lbl())] == 0
    assert s[("nextn_prefix_cache_capacity_bytes", lbl())] == 4096
    m.set_prefix_cache(PrefixCacheStats(queries=300, hits=256, blocks=1, bytes=1024, capacity_bytes=4096))
    m.set_prefix_cache(PrefixCacheStats(queries=700, hits=256, blocks=2, bytes=2048, capacity_bytes=4096))
    s = scrape(m)
    assert s[("nextn_prefix_cache_queries_total", lbl())] == 700 and s[("nextn_prefix_cache_hits_total", lbl())] == 256
    assert s[("nextn_prefix_cache_blocks", lbl())] == 2 and s[("nextn_prefix_cache_bytes", lbl())] == 2048
    with pytest.raises(ValueError):
        m.set_prefix_cache(PrefixCacheStats(queries=700, hits=256, blocks=-1))
