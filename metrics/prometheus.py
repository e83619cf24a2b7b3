"""Prometheus metrics for nextn: the only module that creates Prometheus objects.

``ServingMetrics`` owns a private ``CollectorRegistry`` (never the process-global one), so two servers in
one process, or a test, never share series. The server feeds it and serves ``render()`` at ``/metrics``.

Schema: vLLM's (``reference/serving-anchors.md`` §1) under the ``nextn_`` prefix, because Prometheus
reserves ':' for recording rules and ``promtool check metrics`` rejects it in exported names. Every
series carries ``model_name`` (the served model name) and ``engine="0"`` (vLLM's per-engine label, so
vLLM dashboards' label matchers keep working).

Spec-decode counters (registered only when ``num_spec_tokens`` K > 0; fed from ``SpecTelemetry`` deltas):

====================================================================  ============================
``nextn_spec_decode_num_drafts_total``                                 verify rounds (``rounds``)
``nextn_spec_decode_num_draft_tokens_total``                           ``drafted``
``nextn_spec_decode_num_accepted_tokens_total``                        ``accepted`` (bonus excluded)
``nextn_spec_decode_num_accepted_tokens_per_pos_total{position="j"}``  ``pos_accepted[j]``
``nextn_spec_decode_num_drafted_tokens_per_pos_total{position="j"}``   ``pos_drafted[j]`` (nextn extra)
``nextn_spec_decode_k``                                                histogram: the k each row drafted in
                                                                       each round, 0..K (nextn extra; from
                                                                       ``engine.kpolicy.SpecKStats``)
====================================================================  ============================

Per-position children exist at 0 from startup for positions ``0..min(K, 8)-1`` (as vLLM pre-creates
them) so ``rate()`` has a baseline; a position >= K that later receives data is created then. Positions
are capped at ``SPEC_TELEM_POS`` = 8, the length of the telemetry arrays.

Serving metrics: counters ``nextn_prompt_tokens_total``, ``nextn_generation_tokens_total``,
``nextn_request_success_total{finished_reason=stop|length|abort|error}`` (all four pre-created); gauges
``nextn_num_requests_running``, ``nextn_num_requests_waiting``, ``nextn_kv_cache_usage_perc``; histograms
(vLLM's default buckets, ``vllm/v1/metrics/buckets.py``) ``nextn_time_to_first_token_seconds``,
``nextn_inter_token_latency_seconds``, ``nextn_e2e_request_latency_seconds``,
``nextn_request_queue_time_seconds``; the prefix cache's counters ``nextn_prefix_cache_queries_total`` and
``nextn_prefix_cache_hits_total`` (prompt tokens looked up and found, vLLM's semantics: hit rate =
``rate(hits) / rate(queries)``) and gauges ``nextn_prefix_cache_blocks`` and ``nextn_prefix_cache_bytes`` (the
blocks its index holds), ``nextn_prefix_cache_resident_bytes`` (the memory it has allocated: indexed, reserved and
free blocks; it grows up to the budget and is kept), ``nextn_prefix_cache_capacity_bytes``; the image counters
``nextn_mm_images_encoded_total`` (images the vision tower encoded), ``nextn_mm_encoder_cache_hits_total`` (images
whose embeddings came from the encoder cache instead) and ``nextn_mm_encoder_seconds_total`` (seconds spent
encoding; nextn's own names, vLLM has none; present when the model has a vision tower; encoder cache hit rate =
``rate(hits) / (rate(hits) + rate(encoded))``); and ``nextn_grammar_compile_seconds`` (nextn's own; vLLM has no
such metric; buckets ``GRAMMAR_COMPILE_BUCKETS``: 1 ms .. 30 s on a 1-2.5-5 ladder, because llguidance
compiles typical JSON schemas in milliseconds while large tool schemas can take seconds, and the
server caps compilation well below a minute).

Load gauges for a gateway in front of replicas: the Gateway API Inference Extension's model-server protocol
(``docs/proposals/003-model-server-protocol`` in kubernetes-sigs/gateway-api-inference-extension; the endpoint
picker's metric table in llm-d/llm-d-router ``docs/plugin-metric-protocol.md``). Each is a gauge, present at 0
from startup, with the protocol's semantics; one choice of a request is one session, as one vLLM request per
choice:

======================  ===============================  ======================================================
protocol metric         nextn (``vllm:`` under compat)   value
======================  ===============================  ======================================================
TotalQueuedRequests     ``nextn_num_requests_waiting``   sessions queued for a state-pool slot, not yet scheduled
TotalRunningRequests    ``nextn_num_requests_running``   sessions holding a slot: prefilling or decoding
KVCacheUtilization      ``nextn_kv_cache_usage_perc``    state-pool slots held / ``--max-num-seqs``, 0..1
======================  ===============================  ======================================================

``kv_cache_usage_perc`` is the state pool's use, as vLLM's is its KV blocks' use: each slot reserves a whole
context (``--max-model-len`` positions of KV, the GDN states, the MTP head's KV) however long its session is, so
the honest measure of what is left is slots, not positions; at 1 every slot is held and a new request waits in
the queue. The prefix cache's queries and hits (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` counters,
in tokens) are exported beside them for dashboards; the picker's prefix-aware scoring keeps its own index of what it
routed where.

Derived values (PromQL; add ``sum by (model_name)`` for several engines/models, pick any window):

- draft acceptance rate::

    rate(nextn_spec_decode_num_accepted_tokens_total[5m]) / rate(nextn_spec_decode_num_draft_tokens_total[5m])

- mean acceptance length (tokens per verify round, bonus included)::

    1 + rate(nextn_spec_decode_num_accepted_tokens_total[5m]) / rate(nextn_spec_decode_num_drafts_total[5m])

- per-position acceptance, vLLM/llama.cpp style (unconditional survival P(A >= j+1))::

    rate(nextn_spec_decode_num_accepted_tokens_per_pos_total[5m])
      / ignoring(position) group_left rate(nextn_spec_decode_num_drafts_total[5m])

- per-position acceptance, memra style (conditional on position j having been drafted)::

    rate(nextn_spec_decode_num_accepted_tokens_per_pos_total[5m])
      / rate(nextn_spec_decode_num_drafted_tokens_per_pos_total[5m])

The two per-position rates agree when every round drafts exactly K and diverge under p-min cuts or
grammar truncation. ``metrics.derived.derived`` computes the same quantities from one telemetry value.

``compat_vllm=True`` (``--metrics-compat vllm``) additionally exposes the families vLLM has under its
``vllm:`` names (``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_per_pos_total``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``), so
stock vLLM dashboards and ``vllm bench serve`` (which sums
lines starting ``vllm:spec_decode`` that end in ``_total``) read them. ``render`` reads every ``nextn_`` series
once and writes the ``vllm:`` twins from that same read, so the two names of a series show the same value in
every scrape, even while the engine updates it. It emits no
``_created`` samples (a ``vllm:spec_decode_*_created`` line would be summed by naive scrapers), and it
omits nextn-only families (drafted-per-position, grammar compile) so vLLM tooling sees only vLLM's
schema. This mode is knowingly NOT promtool-clean: ``promtool check metrics`` fails on every ``vllm:``
name ("metric names should not contain ':'"); the default mode passes it.

OPTIPIPE research door (only when ``nextn serve --research-opti-controller-q Q`` armed it; absent, no such
series exist): one counter per ``research.optipipe.OptiForkGateStats`` field, ``nextn_optipipe_<field>_total``
(``attempts``, ``hits``, ``misses``, ``abort_drains``, ``refusals``, ``gate_checks``, ``gate_admits``,
``gate_rejects``, ``reconciles``, ``wasted_draft_tokens``, ``shadow_draft_tokens``, ``breaker_trips``), read
from the engine's process-wide stats at scrape time; not aliased under ``vllm:``. Hit rate of admitted
successors: ``rate(nextn_optipipe_hits_total[5m]) / rate(nextn_optipipe_attempts_total[5m])``.

Consistency: ``add_spec`` and ``render`` share a lock, so one scrape never shows half of a delta (e.g.
drafts updated but accepted not yet), and ratios computed from a single scrape are exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

__all__ = [
    "ServingMetrics",
    "SPEC_TELEM_POS",
    "FINISHED_REASONS",
    "TTFT_BUCKETS",
    "ITL_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "GRAMMAR_COMPILE_BUCKETS",
    "CONTENT_TYPE",
    "MODEL_SERVER_PROTOCOL",
]

#: Length of SpecTelemetry's per-position arrays (must equal ``engine.spec.SPEC_TELEM_POS``; a test
#: checks it). Kept here so that importing metrics does not import the engine (and torch).
SPEC_TELEM_POS = 8

#: ``finished_reason`` label values (vLLM's ``FinishReason`` minus ``repetition``, which nextn never
#: produces). OpenAI's ``tool_calls``/``function_call`` finish reasons are stops.
FINISHED_REASONS = ("stop", "length", "abort", "error")
_FINISHED_ALIASES = {"tool_calls": "stop", "function_call": "stop"}

# vLLM 0.33 defaults (vllm/v1/metrics/buckets.py), copied so dashboards' histogram_quantile matches.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: nextn's own (no vLLM counterpart): 1 ms .. 30 s, 1-2.5-5 ladder.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                           30.0)

#: The Gateway API Inference Extension's model-server protocol (module docstring): each metric the endpoint picker
#: reads -> the gauge family that carries it, ``nextn_`` + name (and ``vllm:`` + name under --metrics-compat vllm).
MODEL_SERVER_PROTOCOL = {
    "TotalQueuedRequests": "num_requests_waiting",
    "TotalRunningRequests": "num_requests_running",
    "KVCacheUtilization": "kv_cache_usage_perc",
}

#: Content type of ``render()``'s body: the Prometheus text format 0.0.4, which every Prometheus
#: version scrapes (prometheus_client's ``generate_latest`` writes exactly that format).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_PREFIX = "nextn_"
_VLLM_PREFIX = "vllm:"
#: The image counters (nextn's own; vLLM has none): name and help, in `VisionStats`' field order.
_MM_COUNTERS = (("mm_images_encoded", "Images the vision tower encoded."),
                ("mm_encoder_cache_hits", "Images whose embeddings came from the encoder cache instead of the tower."),
                ("mm_encoder_seconds", "Seconds the engine spent encoding images."))
_LABELS = ("model_name", "engine")
_ENGINE = "0"


def _vllm_twin(fam: Metric) -> Metric:
    """`fam` (a ``nextn_`` family, as read) under its ``vllm:`` name, without ``_created`` samples: vLLM-tooling
    scrapers match on name prefixes and would mis-sum them."""

    def rename(name: str) -> str:
        assert name.startswith(_PREFIX), name
        return _VLLM_PREFIX + name[len(_PREFIX):]

    out = Metric(rename(fam.name), fam.documentation, fam.type, fam.unit)
    out.samples = [s._replace(name=rename(s.name)) for s in fam.samples if not s.name.endswith("_created")]
    return out


class _Read(Collector):
    """Families already read from the registry, handed to ``generate_latest`` as they are."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


class _OptipipeCounters(Collector):
    """The OPTIPIPE door's counters: ``source()`` returns the engine's stats dataclass (each field an int with a
    ``doc`` in its metadata); one ``nextn_optipipe_<field>_total`` counter per field, read at scrape time."""

    def __init__(self, source: Callable[[], Any], labels: tuple[str, str]):
        self._source, self._labels = source, labels

    def collect(self) -> Iterable[Metric]:
        stats = self._source()
        for f in dataclasses.fields(stats):
            fam = CounterMetricFamily(f"{_PREFIX}optipipe_{f.name}",
                                      f"OPTIPIPE research door: {f.metadata.get('doc', f.name)}.", labels=_LABELS)
            fam.add_metric(self._labels, getattr(stats, f.name))
            yield fam


class _KHistogram(Collector):
    """``nextn_spec_decode_k``: a histogram of integer k in 0..K, rendered at scrape time from cumulative counts
    per k (what the engine reports), so an update is one assignment, not one observation per row and round."""

    def __init__(self, name: str, doc: str, k: int, labels: tuple[str, str]):
        self._name, self._doc, self._labels = name, doc, labels
        self.counts: tuple[int, ...] = (0,) * (k + 1)

    def collect(self) -> Iterable[Metric]:
        counts = self.counts  # one read: a tuple replaced whole
        fam = HistogramMetricFamily(self._name, self._doc, labels=_LABELS)
        cum = list(itertools.accumulate(counts))
        fam.add_metric(self._labels, [(floatToGoString(k), c) for k, c in enumerate(cum)] + [("+Inf", cum[-1])],
                       float(sum(k * c for k, c in enumerate(counts))))
        yield fam


class ServingMetrics:
    """All of nextn's Prometheus series for one served model; thread-safe.

    Contracts:
    - ``add_spec(delta)`` adds a ``SpecTelemetry`` *delta* (the worker's stash-and-diff of a session's
      telemetry, ``delta_since``), so the counters' increase equals the sum of the deltas fed, exactly.
      Feeding cumulative values instead would double count; that is the caller's contract.
    - Spec families are registered iff ``num_spec_tokens > 0``; with K == 0, ``add_spec`` of an all-zero
      delta is a no-op and a non-zero one is dropped with a warning (it cannot happen when the engine
      does not speculate).
    - Counters never decrease: a negative value anywhere in a call raises ``ValueError`` before any
      series is touched, so a rejected delta leaves every counter unchanged.
    - ``render()`` returns ``(body, content_type)`` for the ``/metrics`` response.
    - ``optipipe_stats`` (given only when the OPTIPIPE research door is armed) adds the ``optipipe`` block;
      without it the series set is exactly the one above.
    """

    def __init__(self, model_name: str, num_spec_tokens: int, *, compat_vllm: bool = False,
                 optipipe_stats: Callable[[], Any] | None = None):
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        self.model_name = model_name
        self.num_spec_tokens = int(num_spec_tokens)
        self.compat_vllm = compat_vllm
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._warned_spec_off = False
        lv = (model_name, _ENGINE)
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(_PREFIX + name, doc, _LABELS + extra, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, _LABELS, registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(_PREFIX + name, doc, _LABELS, buckets=buckets, registry=reg)

        aliased: list[Collector] = []

        # Speculative decoding (vLLM SpecDecodingProm names and help texts, plus drafted-per-position).
        self._spec: dict[str, Any] | None = None
        self._pos_children: dict[tuple[str, int], Any] = {}
        if self.num_spec_tokens > 0:
            drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
            draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
            accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            acc_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              ("position",))
            dr_pos = counter("spec_decode_num_drafted_tokens_per_pos",
                             "Drafted tokens per draft position (rounds that drafted at least position+1 "
                             "tokens); denominator of the memra per-position acceptance rate.", ("position",))
            self._spec = {
                "rounds": drafts.labels(*lv),
                "drafted": draft_tokens.labels(*lv),
                "accepted": accepted.labels(*lv),
                "pos_accepted": acc_pos,
                "pos_drafted": dr_pos,
            }
            # each position's child looked up once (labels() per round per position cost the HTTP process
            # ~0.1 ms a round); positions >= K get theirs when they first carry data
            for j in range(min(self.num_spec_tokens, SPEC_TELEM_POS)):
                self._pos_child("pos_accepted", j)
                self._pos_child("pos_drafted", j)
            aliased += [drafts, draft_tokens, accepted, acc_pos]
            self._spec_k = _KHistogram(_PREFIX + "spec_decode_k", "Draft tokens a row asked for in one round (the "
                                       "speculation controller's k, 0 = a plain step inside the batch).",
                                       self.num_spec_tokens, lv)
            reg.register(self._spec_k)
        #: the speculation controller's cost table ({bucket: {T: ms}}) as last reported (/health)
        self.spec_costs: dict[str, dict[str, float]] = {}

        prompt = counter("prompt_tokens", "Number of prefill tokens processed.")
        generation = counter("generation_tokens", "Number of generation tokens processed.")
        success = counter("request_success", "Count of successfully processed requests.", ("finished_reason",))
        running = gauge("num_requests_running", "Number of requests in model execution batches.")
        waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        kv_usage = gauge("kv_cache_usage_perc",
                         "State-pool usage, 0 to 1 (1 means 100 percent): the fraction of the --max-num-seqs "
                         "session slots held. A slot reserves a whole context of KV and recurrent state, so a "
                         "held slot is used capacity whatever its length; at 1 new requests wait in the queue.")
        ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        queue = histogram("request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        grammar = histogram("grammar_compile_seconds",
                            "Histogram of grammar (response_format/tools) compile time in seconds.",
                            GRAMMAR_COMPILE_BUCKETS)
        aliased += [prompt, generation, success, running, waiting, kv_usage, ttft, itl, e2e, queue]

        # Prefix cache (vLLM's counters, in tokens; nextn's size gauges)
        pc_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        pc_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        pc_bytes = gauge("prefix_cache_bytes", "Bytes of the blocks the prefix cache's index holds now.")
        pc_blocks = gauge("prefix_cache_blocks", "Grid blocks (256 tokens each) the prefix cache's index holds now.")
        pc_resident = gauge("prefix_cache_resident_bytes",
                            "Bytes of memory the prefix cache has allocated (indexed, reserved and free blocks); it "
                            "grows up to the budget as the cache fills and is kept.")
        pc_capacity = gauge("prefix_cache_capacity_bytes", "The prefix cache's memory budget in bytes (0: off).")
        aliased += [pc_queries, pc_hits]
        self._pc = (pc_queries.labels(*lv), pc_hits.labels(*lv), pc_bytes.labels(*lv), pc_blocks.labels(*lv),
                    pc_resident.labels(*lv), pc_capacity.labels(*lv))
        self._pc_seen = (0, 0)  # the engine's counters at the last `set_prefix_cache`
        self._mm: tuple[Any, ...] | None = None  # the image counters, registered by the first `set_vision`
        self._mm_seen: tuple[float, ...] = (0, 0, 0.0)  # the engine's counters at the last `set_vision`

        self._prompt = prompt.labels(*lv)
        self._generation = generation.labels(*lv)
        self._success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        self._running = running.labels(*lv)
        self._waiting = waiting.labels(*lv)
        self._kv_usage = kv_usage.labels(*lv)
        self._ttft = ttft.labels(*lv)
        self._itl = itl.labels(*lv)
        self._e2e = e2e.labels(*lv)
        self._queue = queue.labels(*lv)
        self._grammar = grammar.labels(*lv)

        #: families also written under their vLLM names (``render``)
        self._aliased = frozenset(fam.name for c in aliased for fam in c.describe()) if compat_vllm else frozenset()
        if optipipe_stats is not None:  # the research door is armed
            reg.register(_OptipipeCounters(optipipe_stats, lv))

    # -- speculative decoding -------------------------------------------------------------------------

    def add_spec(self, delta: Any) -> None:
        """Add one ``SpecTelemetry`` delta (``rounds, drafted, accepted, pos_drafted[8], pos_accepted[8]``).

        Per-position entries beyond ``SPEC_TELEM_POS`` must be zero (ValueError otherwise); zero entries at
        positions >= K create no series.
        """
        rounds, drafted, accepted = int(delta.rounds), int(delta.drafted), int(delta.accepted)
        pos_drafted = [int(v) for v in delta.pos_drafted]
        pos_accepted = [int(v) for v in delta.pos_accepted]
        values = (rounds, drafted, accepted, *pos_drafted, *pos_accepted)
        if any(v < 0 for v in values):
            raise ValueError(f"spec telemetry delta has a negative field: {delta!r}")
        if any(pos_drafted[SPEC_TELEM_POS:]) or any(pos_accepted[SPEC_TELEM_POS:]):
            raise ValueError(f"spec telemetry delta has data beyond position {SPEC_TELEM_POS - 1}: {delta!r}")
        if not any(values):
            return
        if self._spec is None:
            if not self._warned_spec_off:
                self._warned_spec_off = True
                log.warning("spec telemetry received with speculation off (num_spec_tokens=0); dropped")
            return
        s = self._spec
        with self._lock:
            if rounds:
                s["rounds"].inc(rounds)
            if drafted:
                s["drafted"].inc(drafted)
            if accepted:
                s["accepted"].inc(accepted)
            for key, arr in (("pos_drafted", pos_drafted), ("pos_accepted", pos_accepted)):
                for j, v in enumerate(arr[:SPEC_TELEM_POS]):
                    if v:
                        self._pos_child(key, j).inc(v)

    def _pos_child(self, key: str, j: int) -> Any:
        """The per-position counter `key` ("pos_drafted" / "pos_accepted") at position j (created on first use)."""
        child = self._pos_children.get((key, j))
        if child is None:
            assert self._spec is not None
            child = self._pos_children[key, j] = self._spec[key].labels(self.model_name, _ENGINE, str(j))
        return child

    # -- tokens, queue, outcomes ----------------------------------------------------------------------

    @staticmethod
    def _nonneg(n: float, what: str) -> float:
        if n < 0:
            raise ValueError(f"{what} must be >= 0, got {n}")
        return n

    def add_prompt_tokens(self, n: int) -> None:
        """Prompt tokens prefilled (count each request's prompt once, when it is admitted)."""
        if self._nonneg(n, "prompt tokens"):
            self._prompt.inc(n)

    def add_generation_tokens(self, n: int) -> None:
        """Generated (emitted) tokens; under speculation one round adds accepted + 1."""
        if self._nonneg(n, "generation tokens"):
            self._generation.inc(n)

    def set_running(self, n: int) -> None:
        """Sessions holding a state-pool slot: prefilling or decoding (the protocol's TotalRunningRequests)."""
        self._running.set(self._nonneg(n, "running requests"))

    def set_waiting(self, n: int) -> None:
        """Sessions (one per choice) queued for a slot, not yet scheduled (the protocol's TotalQueuedRequests)."""
        self._waiting.set(self._nonneg(n, "waiting requests"))

    def set_prefix_cache(self, stats: Any) -> None:
        """The prefix cache's state (an ``engine.cache.PrefixCacheStats``: cumulative ``queries`` / ``hits`` in
        tokens, ``blocks`` / ``bytes`` / ``resident_bytes`` / ``capacity_bytes`` now); the counters advance by the
        increase since the last call."""
        q, h = int(stats.queries), int(stats.hits)
        q0, h0 = self._pc_seen
        queries, hits, nbytes, blocks, resident, capacity = self._pc
        with self._lock:
            if q > q0:
                queries.inc(q - q0)
            if h > h0:
                hits.inc(h - h0)
            self._pc_seen = (max(q, q0), max(h, h0))
            nbytes.set(self._nonneg(stats.bytes, "prefix cache bytes"))
            blocks.set(self._nonneg(stats.blocks, "prefix cache blocks"))
            resident.set(self._nonneg(stats.resident_bytes, "prefix cache resident bytes"))
            capacity.set(self._nonneg(stats.capacity_bytes, "prefix cache capacity"))

    def set_spec_k(self, stats: Any) -> None:
        """The engine's speculation-length counts (an ``engine.kpolicy.SpecKStats``: cumulative rows x rounds by
        drafted k, and the controller's cost table): the histogram holds each k's count (never below one reported
        before: counts only grow); the cost table is kept for /health. Dropped with speculation off."""
        with self._lock:
            self.spec_costs = dict(stats.costs)
            if self._spec is None:
                return
            old = self._spec_k.counts
            new = tuple(int(c) for c in stats.counts[:len(old)]) + (0,) * (len(old) - len(stats.counts))
            self._spec_k.counts = tuple(map(max, new, old))

    def set_vision(self, stats: Any) -> None:
        """The engine's image counters (an ``engine.images.VisionStats``: cumulative ``images_encoded``,
        ``encoder_cache_hits``, ``encoder_seconds``); each counter advances by the increase since the last call.
        The first call registers the three families (the worker makes it at startup when the model has a vision
        tower; a text-only server has none of them)."""
        now = (int(stats.images_encoded), int(stats.encoder_cache_hits), float(stats.encoder_seconds))
        with self._lock:
            if self._mm is None:
                lv = (self.model_name, _ENGINE)
                self._mm = tuple(Counter(_PREFIX + name, doc, _LABELS, registry=self.registry).labels(*lv)
                                 for name, doc in _MM_COUNTERS)
            for child, new, old in zip(self._mm, now, self._mm_seen, strict=True):
                if new > old:
                    child.inc(new - old)
            self._mm_seen = tuple(max(a, b) for a, b in zip(now, self._mm_seen, strict=True))

    def set_pool_usage(self, held: int, slots: int) -> None:
        """State-pool slots held by sessions out of the `slots` (``--max-num-seqs``) a session can hold; the
        gauge is their ratio (0..1). ValueError unless 0 <= held <= slots and slots > 0."""
        if slots <= 0 or not 0 <= held <= slots:
            raise ValueError(f"pool usage needs 0 <= held <= slots and slots > 0, got {held} of {slots}")
        self._kv_usage.set(held / slots)

    def request_finished(self, finished_reason: str) -> None:
        """One finished request: ``stop|length|abort|error`` (``tool_calls``/``function_call`` count as
        ``stop``). Any other value raises ``ValueError`` (label cardinality stays fixed)."""
        reason = _FINISHED_ALIASES.get(finished_reason, finished_reason)
        child = self._success.get(reason)
        if child is None:
            raise ValueError(f"unknown finished_reason {finished_reason!r}; expected one of {FINISHED_REASONS}")
        child.inc()

    # -- latencies (seconds; pass differences of time.monotonic()/perf_counter()) ---------------------

    def observe_ttft(self, s: float) -> None:
        """Arrival -> first generated token sent."""
        self._ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        """Gap between consecutive token emissions of one request. vLLM semantics: one sample per
        emission (a spec burst emitting several tokens is one sample, not divided by tokens)."""
        self._itl.observe(s)

    def observe_e2e(self, s: float) -> None:
        """Arrival -> last token/finish."""
        self._e2e.observe(s)

    def observe_queue_time(self, s: float) -> None:
        """Arrival in the admission queue -> admitted by the worker (start of prefill)."""
        self._queue.observe(s)

    def observe_grammar_compile(self, s: float) -> None:
        """One grammar compilation (cache misses only)."""
        self._grammar.observe(s)

    # -- startup kernel self-check (engine/selfcheck.py) ------------------------------------------------

    def set_kernel_info(self, impls: Mapping[str, str]) -> None:
        """``nextn_kernel_info{kernel, impl} 1`` per kernel: impl ``triton`` (it passed its startup check) or
        ``torch`` (it failed; its twin runs). Registered on the first non-empty call (CUDA); never on a CPU."""
        if not impls:
            return
        with self._lock:
            if getattr(self, "_kernel_info", None) is None:
                self._kernel_info = Gauge(_PREFIX + "kernel_info", "Implementation each Triton kernel runs after "
                                          "the startup self-check (1 per kernel): triton, or torch (its twin).",
                                          _LABELS + ("kernel", "impl"), registry=self.registry)
            self._kernel_info.clear()
            for kernel, impl in impls.items():
                self._kernel_info.labels(self.model_name, _ENGINE, kernel, impl).set(1)

    # -- exposition -----------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)``: the registry in Prometheus text format 0.0.4 (with compat_vllm, each aliased
        family also under its ``vllm:`` name, written from the same read, so the two names agree in every scrape)."""
        with self._lock:
            families = list(self.registry.collect())
        families += [_vllm_twin(f) for f in families if f.name in self._aliased]
        return generate_latest(_Read(families)), CONTENT_TYPE
