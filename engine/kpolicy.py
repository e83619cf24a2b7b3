"""The speculation length controller: each round, the batch's verify width T and each row's draft count k.

`KPolicySpec` is what the operator asked for (K_max, adaptive or fixed, an optional K cap by batch size).
`KPolicy` decides, from two things it learns:
  * per row, the conditional acceptance a_j of draft position j (given drafts 0..j-1 were accepted): counts decayed
    by `DECAY` every round (evidence a row at k = 0 no longer renews fades, so it drafts again), blended with a
    pooled estimate over every row (the prior of a new row, and of a position the row never reached: the row's
    own previous position otherwise);
  * the cost table c(B, T): seconds of one round of B rows (a batch-size bucket) at verify width T, profiled at
    startup on the real model (`profile_costs`: the forwards alone) and refined by an EMA of measured round times
    (`observe_time`; the scheduler times a round from its start to the next step's); a width not measured yet is
    its profile plus the bucket's measured overhead (the host's work of a round, which the profile leaves out:
    without it deeper widths would look dearer than they are), and a measured width's own estimate fades back to
    that (by `STALE` for every round of its bucket at another width), so one slow measurement cannot keep a width
    unchosen, and so unmeasured again, for good;
  * the price of a deferred MTP row: a row outside the round's draft forwards (every row at T = 1; a row that
    neither drafts nor rides them otherwise) queues its MTP rows, written later in one head forward: in its next
    drafting round, or (prefix cache) when it finishes, timed apart from any round (`observe_deferred`: the price
    per row is the slope of those flushes' time over their rows). A round's cost is c(B, T) plus that price for
    each row it defers: without it a plain round looked as cheap as its forwards alone.
A row expects E(k) = 1 + sum_{j<k} prod_{i<=j} a_i tokens from k drafts; its useful depth d is the number of drafts
it reaches with a chance of at least `USEFUL` (E(j+1) - E(j) >= USEFUL). The batch's T maximises sum_r E_r(min(d_r,
T-1)) / c(B, T), rows drafting min(d_r, T-1): the verify pads every row to T, so a row whose drafts alone would not
pay for a wider verify still drafts when another row's widened it; a free row (greedy: its drafts cost nothing once
the round drafts, see `plan`) counts E_r(T-1) and drafts T - 1. That rate is the batch's throughput when a finished
row is replaced at once (steady load); a batch that runs down (closed batches, a burst's end) lasts as long as its
slowest rows' budgets, and a width that speeds the fast rows at their expense only empties it sooner: with the rows'
budgets, each width's rate is blended with its drain rate (the rows' remaining tokens over the time to finish them
all at that width, `_drains`) by the chance that a finished row is replaced while the batch runs (`refill`, learnt
from the rows' comings and goings, `observe_flow`). Rows at k = 0 are probed at k = 1 on probe rounds (every
`PROBE_EVERY` rounds, doubling up to `PROBE_MAX` while probes fail), and rows at 0 < k < cap probe k + 1 then: their
estimates can recover and deepen. Between probes, a batch in which neither a row nor the pooled estimate reaches a
first draft with a chance >= USEFUL stays plain, planned in O(1) (a quiet spell: the rows' decay applied when it
ends) until its rows change. Exactness never depends on any of this: spec == plain for every k of every row in every
round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

#: A row's counts are multiplied by this every round: ~10 rounds of memory.
DECAY = 0.9
#: Pseudo-observations of the pooled estimate in a row's estimate.
PRIOR_WEIGHT = 1.0
#: Pooled estimate's decay (across rows: a longer memory).
POOL_DECAY = 0.98
#: Acceptance assumed before anything was observed (optimistic: the first rounds draft, then learn).
A_INIT = 0.9
#: Probe rounds: every PROBE_EVERY rounds, doubling while probes accept nothing, up to PROBE_MAX.
PROBE_EVERY = 32
PROBE_MAX = 256
#: EMA weight of a measured round time in the cost table; a measurement counts at most SPIKE x the estimate (a
#: busy host's outliers: at 1.5 one slow round raised its width's estimate 10% and kept the demo at 8 rows off its
#: best width for dozens of rounds; a lasting slowdown still moves every width's estimate, 2% a round).
COST_EMA = 0.2
SPIKE = 1.1
#: A measured width's deviation from its profile + the bucket's overhead is multiplied by this for every round of
#: its bucket that ran another width (half-life ~23 rounds).
STALE = 0.97
#: Widths T are kept unless another's rate is this much better (ties: the smaller T).
MARGIN = 1e-3
#: A row drafts position j only while its chance of reaching it (prod_{i<=j} a_i: E(j + 1) - E(j)) is at least this.
USEFUL = 0.1
#: Decay of the sums over measured flushes of deferred MTP rows (their price's line), per flush.
DEFER_DECAY = 0.9
#: Decay of the refill counts (finished rows replaced while the batch ran, or not), per finished row.
REFILL_DECAY = 0.9


@dataclass(frozen=True)
class SpecKStats:
    """Rows x rounds by the k they drafted since start (counts[k]), and the controller's cost table ({bucket: {T:
    milliseconds}}; empty with fixed K): what metrics/ and /health report."""

    counts: tuple[int, ...] = ()
    costs: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class KPolicySpec:
    """The operator's speculation policy: k_max drafts at most; adaptive (the controller) or fixed K; schedule:
    ((batch size up to, K cap), ...) ascending, the cap of the first entry whose batch size >= N (beyond the last:
    the last's cap)."""

    k_max: int
    adaptive: bool = True
    schedule: tuple[tuple[int, int], ...] = ()

    def cap(self, n: int) -> int:
        """K cap for a batch of n rows (k_max, lowered by the schedule)."""
        for bs, k in self.schedule:
            if n <= bs:
                return min(self.k_max, k)
        return min(self.k_max, self.schedule[-1][1]) if self.schedule else self.k_max

    def describe(self) -> str:
        """One line for the startup log."""
        sched = (", K cap by batch size " + ", ".join(f"<={b}: {k}" for b, k in self.schedule)) if self.schedule else ""
        mode = "adaptive per row and round (0..K)" if self.adaptive else "fixed K"
        return f"speculation: K={self.k_max}, {mode}{sched}"


@dataclass
class _Est:
    """Decayed (hits, tries) per draft position."""

    hit: list[float]
    n: list[float]

    def add(self, drafted: int, n_acc: int, f: float = 1.0) -> None:
        """One round's outcome, the counts first multiplied by f."""
        if f != 1.0:
            self.decay(f)
        hit, n = self.hit, self.n
        for j in range(min(drafted, n_acc + 1)):  # position j was tried iff drafts 0..j-1 were accepted
            if j < n_acc:
                hit[j] += 1.0
            n[j] += 1.0

    def decay(self, f: float) -> None:
        """The counts multiplied by f, in place."""
        hit, n = self.hit, self.n
        for j in range(len(n)):
            hit[j] *= f
            n[j] *= f

    def estimate(self, pa: list[float], f: float = 1.0) -> list[float]:
        """The conditional acceptance per position from these counts times f, each blended with the pooled `pa`."""
        hit, n, out, prev = self.hit, self.n, [], -1.0
        for j, pj in enumerate(pa):
            h, m = hit[j] * f, n[j] * f
            # a position the row never reached: its own position j-1's estimate
            prev = prev if m < 0.5 and j else (h + PRIOR_WEIGHT * pj) / (m + PRIOR_WEIGHT)
            out.append(prev)
        return out

    def round_curve(self, pa: list[float], cap: int) -> tuple[list[float], int]:
        """The round's decay (DECAY), kept; then `KPolicy.curve` of the estimate (`estimate(pa)`) to cap, bit for bit,
        in one pass."""
        hit, n = self.hit, self.n
        out, prev, e, p, d = [1.0], -1.0, 1.0, 1.0, 0
        for j, pj in enumerate(pa):
            h = hit[j] = hit[j] * DECAY
            m = n[j] = n[j] * DECAY
            if j < cap:
                prev = prev if m < 0.5 and j else (h + PRIOR_WEIGHT * pj) / (m + PRIOR_WEIGHT)
                p *= prev
                e += p
                out.append(e)
                d += p >= USEFUL
        return out, d


@dataclass
class KPolicy:
    """Per-row, per-round K. `plan(rows)` -> each row's k for the next round; `observe(row, drafted, n_acc)` after
    it, `observe_time(n, T, seconds)` with the round's wall time; `forget(row)` when a row leaves. Rows are any
    hashable keys. Deterministic given the cost table and the history fed in. A serving loop's short paths, the same
    decisions: `resting(rows)` before `plan` (a quiet spell's round), `observe_plain` for a round nobody drafted in."""

    spec: KPolicySpec
    cost: dict[tuple[int, int], float]  # (bucket, T) -> seconds of one round
    buckets: list[int]
    rows: dict[Hashable, _Est] = field(default_factory=dict)
    seen: dict[tuple[int, int], float] = field(default_factory=dict)  # measured round seconds (EMA) by (B, T)
    overhead: dict[int, float] = field(default_factory=dict)  # measured - profiled seconds (EMA) by bucket
    _measured: dict[int, int] = field(default_factory=dict)  # rounds measured by bucket
    _at: dict[tuple[int, int], int] = field(default_factory=dict)  # (B, T) -> its bucket's count when last measured
    pool: _Est | None = None
    rounds: int = 0
    probe_every: int = PROBE_EVERY
    _probing: bool = False
    _probe_hits: int = 0
    last_t: int = 1
    _bucket_of: dict[int, int] = field(default_factory=dict)
    _pooled: list[float] | None = None  # `pooled()` since the pool last moved
    _quiet: list[Hashable] | None = None  # the rows of a quiet spell (every round plain, no row can draft)
    _lag: int = 0  # its rounds so far after the first (each owes its rows one DECAY)
    _defer: tuple[float, ...] = (0.0,) * 5  # decayed sums over measured flushes: 1, rows, s, rows^2, rows * s
    _refill: tuple[float, float] = (0.0, 0.0)  # decayed (replaced, finished) counts of finished rows
    _owed: int = 0  # rows that finished while others ran, not replaced yet
    _secs: dict[int, list[float]] = field(default_factory=dict)  # bucket -> `seconds(B, T)` for T = 1..k_max + 1
    _secs_of: dict | None = None  # the cost table `_secs` was computed from
    _down: dict[int, list[int]] = field(default_factory=dict)  # n -> [bucket(n - j) for j in range(n)]

    def __post_init__(self) -> None:
        K = self.spec.k_max
        self.pool = self.pool or _Est([0.0] * K, [0.0] * K)

    def bucket(self, n: int) -> int:
        """The cost table's bucket for n rows (the smallest >= n; the largest beyond it)."""
        b = self._bucket_of.get(n)
        if b is None:
            b = self._bucket_of[n] = next((b for b in self.buckets if b >= n), self.buckets[-1])
        return b

    def pooled(self) -> list[float]:
        """The pooled conditional acceptance per position (a new row's estimate): the pool's counts with one
        pseudo-observation of the previous position's (position 0's: A_INIT)."""
        if self._pooled is not None:  # the pool moved on no round since
            return self._pooled
        p = self.pool
        assert p is not None
        out, prev = [], A_INIT
        for h, n in zip(p.hit, p.n):
            prev = (h + PRIOR_WEIGHT * prev) / (n + PRIOR_WEIGHT)
            out.append(prev)
        self._pooled = out
        return out

    def accept(self, row: Hashable, pooled: list[float] | None = None) -> list[float]:
        """Row's estimated conditional acceptance per position (the pooled one for an unknown row); `pooled`: this
        round's `pooled()`, when the caller has it."""
        pa = self.pooled() if pooled is None else pooled
        e = self.rows.get(row)
        if e is None:
            return pa
        owed = self._lag if row in (self._quiet or ()) else 0  # a quiet spell's rounds of decay, not applied yet
        return e.estimate(pa, DECAY ** owed)

    @staticmethod
    def expected(a: list[float], k: int) -> float:
        """E(k) = 1 + sum_{j<k} prod_{i<=j} a_i: tokens one round emits with k drafts."""
        return KPolicy.curve(a, k)[0][k]

    @staticmethod
    def curve(a: list[float], k: int) -> tuple[list[float], int]:
        """([E(0), ..., E(k)] in one pass (each E(j) bitwise `expected(a, j)`), the useful depth: the number of drafts
        j < k reached with a chance prod_{i<=j} a_i >= USEFUL)."""
        e, p, out, d = 1.0, 1.0, [1.0], 0
        for j in range(k):
            p *= a[j]
            e += p
            out.append(e)
            d += p >= USEFUL
        return out, d

    def plan(self, rows: list[Hashable], free: list[bool] | None = None, left: list[int] | None = None) -> list[int]:
        """Each row's k for the next round (a round over `rows`, in order; none: []). `free[i]`: row i's drafts cost
        nothing once the round drafts at all (a greedy row, `engine.draft.rides`: it stays in the round's draft
        forwards to their end whatever its k, and a row that does not draft still writes its MTP rows later), so it
        drafts T - 1, and a round that drafts nothing (T = 1) runs it plain. `left[i]`: the most tokens row i may
        still emit (its budget): with it, a width's rate is blended with the batch's drain rate by `refill()`."""
        if not rows:
            return []
        rest = self.resting(rows)
        if rest is not None:
            return rest
        self.rounds += 1
        n, cap = len(rows), self.spec.cap(len(rows))
        if not self.spec.adaptive or cap == 0:
            self.last_t = cap + 1
            return [cap] * n
        if self._quiet is not None:
            self._wake()
        pa = self.pooled()
        # curves[i][k]: row i's tokens from k drafts; deep[i]: its useful depth, the drafts it reaches with a chance
        # >= USEFUL (the verify pads every row to T, so a row's drafts below T cost only its share of the draft
        # forwards)
        curves: list[list[float]] = []
        deep: list[int] = []
        new = None  # the curve of a row without an estimate yet (the pooled one)
        known = self.rows
        for r in rows:
            e = known.get(r)
            if e is not None:
                curve, d = e.round_curve(pa, cap)  # this round's decay, kept
            else:
                curve, d = new = new or self.curve(pa, cap)
            curves.append(curve)
            deep.append(d)
        ks = deep  # no row has a useful draft: whatever T wins, every row drafts min(0, T - 1) = 0
        wide = [bool(free and free[i]) for i in range(n)]  # rows that draft T - 1
        if any(deep):
            c = self.costs(self.bucket(n))[:cap + 1]  # c[T-1]
            m = self.deferred()
            if m:  # a plain round defers every row's MTP row; a wider one, those of rows that neither draft nor ride
                lazy = sum(1 for d, w in zip(deep, wide) if not d and not w)
                c = [x + m * (n if T == 1 else lazy) for T, x in enumerate(c, 1)]
            # cols[T-1][i] = E_i(min(d_i, T - 1)) (a free row: E_i(T - 1)): row i's tokens at T
            cols = list(zip(*(curve if w or d == cap else curve[:d + 1] + [curve[d]] * (cap - d)
                              for curve, d, w in zip(curves, deep, wide))))
            p = self.refill() if left is not None else 1.0
            p = 1.0 if p > 0.99 else p  # a drain weight under 1%: not worth its work
            # the batch may run down rather than be refilled: each width's drain rate too (one row's is its rate)
            drain = self._drains(cols, left, c) if p < 1.0 and left is not None and n > 1 else None
            rate, T = -1.0, 1
            for t in range(1, cap + 2):
                r = sum(cols[t - 1]) / c[t - 1]
                if drain is not None:
                    r = p * r + (1 - p) * drain[t - 1]
                if r > rate * (1 + MARGIN):
                    rate, T = r, t
            ks = [T - 1 if w else min(d, T - 1) for d, w in zip(deep, wide)]
        self._probing = self.rounds % self.probe_every == 0
        if self._probing:  # rows at 0 try 1, rows below the cap try one deeper
            ks = [min(k + 1, cap) for k in ks]
        self.last_t = max(ks) + 1
        if free:  # the round's width as probes or other rows set it
            ks = [self.last_t - 1 if f else k for f, k in zip(free, ks)]
        if self.last_t == 1 and pa[0] < USEFUL:
            # no row reaches its first draft with a chance >= USEFUL, nor does the pooled estimate: until the rows,
            # the pool or a probe round change that, no row will (decay moves a row's a_0 monotonically toward pa_0)
            self._quiet, self._lag = list(rows), 0
        return ks

    def resting(self, rows: list[Hashable]) -> list[int] | None:
        """`plan(rows)` of a round that continues a quiet spell (the same rows, not a probe round): [0] * n, in O(1)
        (no `free` or `left` needed); None for any other round (call `plan`)."""
        if self._quiet is None or rows != self._quiet or not (self.rounds + 1) % self.probe_every:
            return None
        self.rounds += 1
        self._lag, self._probing, self.last_t = self._lag + 1, False, 1
        return [0] * len(rows)

    def _wake(self) -> None:
        """Leave a quiet spell: the decay its rounds skipped, at once."""
        f = DECAY ** self._lag
        for r in self._quiet or ():
            e = self.rows.get(r)
            if e is not None:
                e.decay(f)
        self._quiet, self._lag = None, 0

    def observe(self, row: Hashable, drafted: int, n_acc: int) -> None:
        """A round's outcome for `row`: `drafted` drafts verified (after cuts), n_acc accepted."""
        self.observe_round([(row, drafted, n_acc)])

    def observe_round(self, outcomes: list[tuple[Hashable, int, int]]) -> None:
        """`observe(row, drafted, n_acc)` for each outcome of a round, in order: the row's counts (a new row's created)
        and, when it drafted, the pool's; a row it knows that drafted nothing has nothing to teach it (a plain round's
        rows: every round of a quiet spell) and is passed over."""
        known, pool, hits, K = self.rows, self.pool, 0, self.spec.k_max
        assert pool is not None
        for r, d, a in outcomes:
            e = known.get(r)
            if e is None:
                e = known[r] = _Est([0.0] * K, [0.0] * K)
            elif not d:
                continue
            e.add(d, a)
            if d:
                pool.add(d, a, POOL_DECAY)
                self._pooled = None
            hits += a
        if self._probing:
            self._probe_hits += hits

    def observe_plain(self, rows: list[Hashable]) -> None:
        """`observe_round` of a round in which no row drafted (T = 1): only a row it has not met yet is news (its
        estimate is created)."""
        known, K = self.rows, self.spec.k_max
        for r in rows:
            if r not in known:
                known[r] = _Est([0.0] * K, [0.0] * K)

    def seconds(self, B: int, T: int) -> float:
        """Estimated seconds of a round of bucket B at width T: the profile + the bucket's overhead, moved to the
        width's measured EMA, fully when that width ran the bucket's last measured round, then less by `STALE` for
        each of the bucket's rounds since."""
        prior = self.cost[(B, T)] + self.overhead.get(B, 0.0)
        got = self.seen.get((B, T))
        if got is None:
            return prior
        return prior + (got - prior) * STALE ** (self._measured[B] - self._at[(B, T)])

    def observe_time(self, n: int, T: int, seconds: float) -> None:
        """The round's wall time (n rows at width T) refines the cost table (an EMA from the width's estimate now);
        closes a probe round."""
        B = self.bucket(n)
        if (B, T) in self.cost:
            old = self.seconds(B, T) if (B, T) in self.seen else None
            seconds = seconds if old is None else min(seconds, SPIKE * old)
            old = seconds if old is None else old
            self._secs.pop(B, None)
            self.seen[(B, T)] = old + COST_EMA * (seconds - old)
            self._at[(B, T)] = self._measured[B] = self._measured.get(B, 0) + 1
            d = seconds - self.cost[(B, T)]
            self.overhead[B] = self.overhead.get(B, d) + COST_EMA * (d - self.overhead.get(B, d))
        if self._probing:  # a probe that found nothing waits twice as long for the next one
            self.probe_every = PROBE_EVERY if self._probe_hits else min(PROBE_MAX, 2 * self.probe_every)
            self._probing, self._probe_hits = False, 0

    def observe_deferred(self, rows: int, seconds: float) -> None:
        """A head forward that wrote `rows` deferred MTP rows (a finished row's queue) took `seconds`."""
        f = DEFER_DECAY
        self._defer = tuple(f * a + b for a, b in zip(self._defer, (1.0, rows, seconds, rows * rows, rows * seconds)))

    def deferred(self) -> float:
        """Seconds per deferred MTP row (0 until a flush was measured): the slope of the recent flushes' time over
        their rows (a least-squares line: a head forward's fixed part is no row's), the recent ones weighing most;
        at most their time over their rows (all that a line through flushes of one size can tell)."""
        w, n, s, nn, ns = self._defer
        if n <= 0:
            return 0.0
        var = w * nn - n * n
        slope = (w * ns - n * s) / var if var > 1e-9 * w * nn else s / n
        return min(max(slope, 0.0), s / n)

    def _drains(self, cols: list[tuple[float, ...]], left: list[int], c: list[float]) -> list[float]:
        """Each width's drain rate: tokens per second of the rows' remaining budgets if every row ran to its end at
        width T and no row joined: row i ends after left[i] / cols[T-1][i] rounds (its tokens a round at T), the batch
        shrinking as rows end, each stretch costing its smaller bucket's round (scaled as this round's c[T-1], the
        deferred MTP rows' price in it)."""
        n = len(left)
        down = self._down.get(n)
        if down is None:
            down = self._down[n] = [self.bucket(n - j) for j in range(n)]
        rows = [self.costs(b) for b in down]  # rows[j]: the cost row of the bucket rows j.. run in
        tl, out = sum(left), []
        for t, ct in enumerate(c):
            secs, prev = 0.0, 0.0
            for e, x in zip(sorted(m / tok for m, tok in zip(left, cols[t])), rows):  # rows j.. run from prev to e
                secs, prev = secs + (e - prev) * x[t], e
            out.append(tl / (secs * ct / rows[0][t]))
        return out

    def costs(self, B: int) -> list[float]:
        """[`seconds(B, T)` for T = 1..k_max + 1], kept until the bucket's next measured round (or a new cost
        table): no other bucket's round moves it."""
        if self._secs_of is not self.cost:
            self._secs, self._secs_of = {}, self.cost
        row = self._secs.get(B)
        if row is None:
            row = self._secs[B] = [self.seconds(B, T) for T in range(1, self.spec.k_max + 2)]
        return row

    def refill(self) -> float:
        """The chance that a row which finishes while others run is replaced before the batch empties (decayed over
        finished rows, 1 before any): a batch that is refilled earns its round's rate (`plan`'s objective); one
        that runs down (a closed batch, the end of a burst) earns its rows' drain rate, set by its slowest rows
        (a width that speeds the fast rows at the slow ones' expense only empties the batch sooner)."""
        got, n = self._refill
        return (got + PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)

    def observe_flow(self, joined: int, finished: int, running: int) -> None:
        """A step's rows: `joined` entered a batch that had rows (a join into an empty batch replaces nobody), then
        `finished` left it, `running` rows left in it (running or prefilling). A finished row is replaced by a later
        join while the batch has rows, or counts as not replaced when the batch empties first."""
        got, n = self._refill
        if joined:
            r, self._owed = min(joined, self._owed), self._owed - min(joined, self._owed)
            for _ in range(r):
                got, n = REFILL_DECAY * got + 1.0, REFILL_DECAY * n + 1.0
        if finished and running:
            self._owed += finished
        elif finished:
            for _ in range(self._owed):
                got, n = REFILL_DECAY * got, REFILL_DECAY * n + 1.0
            self._owed = 0
        self._refill = (got, n)

    def forget(self, row: Hashable) -> None:
        """`row` left: drop its estimate (and end a quiet spell it was in: the spell's rows are not kept)."""
        if self._quiet is not None and row in self._quiet:
            self._wake()
        self.rows.pop(row, None)

    def table(self) -> dict[str, dict[str, float]]:
        """The cost table for /health: {bucket: {T: milliseconds}} (estimates now)."""
        out: dict[str, dict[str, float]] = {}
        for b, t in sorted(self.cost):
            out.setdefault(str(b), {})[str(t)] = round(self.seconds(b, t) * 1e3, 3)
        return out


def profile_costs(run: Callable[[int, int], None], buckets: list[int], t_max: int, *, points: int = 3,
                  reps: int = 3, clock: Callable[[], float] = time.perf_counter) -> dict[tuple[int, int], float]:
    """The cost table {(bucket, T): seconds} for T = 1..t_max: `run(n, T)` runs one round's forwards (the verify
    of n x T tokens and its drafts) and must block until done; timed at up to `points` buckets (the smallest, the
    largest, and spread between), linear in the bucket between them. At a bucket, after one warm-up of each width,
    the widths are timed in turn `reps` times (a slow spell of the host hits several widths once each, not one
    width every time) and each keeps its best; the bucket's row is then made nondecreasing in T (a wider round does
    all of a narrower one's work and more: an inversion is the host's noise; adjacent violators are pooled)."""
    pick = sorted({buckets[round(i * (len(buckets) - 1) / max(1, points - 1))] for i in range(points)})
    meas: dict[tuple[int, int], float] = {}
    widths = range(1, t_max + 1)
    for b in pick:
        for T in widths:
            run(b, T)
        best = [float("inf")] * t_max
        for _ in range(reps):
            for T in widths:
                t0 = clock()
                run(b, T)
                best[T - 1] = min(best[T - 1], clock() - t0)
        for T, sec in zip(widths, _nondecreasing(best)):
            meas[(b, T)] = sec
    out = {}
    for b in buckets:
        lo = max((p for p in pick if p <= b), default=pick[0])
        hi = min((p for p in pick if p >= b), default=pick[-1])
        for T in widths:
            f = 0.0 if hi == lo else (b - lo) / (hi - lo)
            out[(b, T)] = (1 - f) * meas[(lo, T)] + f * meas[(hi, T)]
    return out


def _nondecreasing(xs: list[float]) -> list[float]:
    """The nondecreasing sequence nearest to xs in least squares: runs that decrease are pooled to their mean."""
    runs: list[list[float]] = []  # [sum, count] of each pooled run
    for x in xs:
        runs.append([x, 1])
        while len(runs) > 1 and runs[-2][0] / runs[-2][1] > runs[-1][0] / runs[-1][1]:
            tot, n = runs.pop()
            runs[-1][0] += tot
            runs[-1][1] += n
    return [tot / n for tot, n in runs for _ in range(int(n))]
