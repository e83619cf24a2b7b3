"""OPTIPIPE research door: OptiFork gate modes, gate stats, session-state identity, the increment-2 controller.

OptiFork (memra's "optimistic round pipelining", reference/memra-concepts.md §6) overlaps a K = 1 round N with
an optimistic successor: while N verifies [last, d1], the successor drafts from N's full-accept tip (d1 accepted)
and would verify [d2, d3] at once. The successor is valid iff n_acc == 1 and bonus == d2; otherwise it is
discarded and reconciled. Measured on memra (increment 2): NO-GO -- the shadow draft is paid on every check,
including rejected ones, and the controller stayed below the serial K = 1 loop at every threshold. This module is
kept as a diagnostic door to reproduce that verdict, off by default.

Here it is a bookkeeping layer around the batched round, reached through its one door `engine.spec.ROUND_HOOK`:
arming a mode sets the hook to `optipipe_round` (disarming sets it back to None, so a disarmed round does not even
call it). `engine.spec.spec_round` calls `optipipe_round(rows, ks)` before drafting and `OptiForkRound.resolve(model,
drafts, host)` after the round's commits. Per servable row and round:

  fork     save the MTP-head KV rows the shadow writes: P (the round's last committed row), P + 1, P + 2;
  check    shadow d2 from the full-accept tip: one head step over (d1, h1) at P + 1, where h1 is the head
           hidden that drafted d1 (recomputed from the same input row at P); q_proxy = p(d1) * p(d2), the
           uncalibrated product of the two drafts' top probabilities;
  admit    Controller: q_proxy >= q and the session's breaker closed; forced modes: every check (Abort: one,
           ever). An admitted attempt drafts d3 from (d2, h2) at P + 2;
  resolve  a session that ended in the round drains its attempt (abort_drains); else hit iff n_acc == 1 and
           bonus == d2: retain the successor rows (the next round writes its committed rows over both);
           else miss: reconcile, restoring the forked rows. Row P is restored in every case.
The round itself never sees any of it: drafts, verify, acceptance and commits are the serial round's, so every
emitted token is, and the session state (`OptiForkStateIdentity`, the live tensors byte for byte) equals the
serial run's after every round.

Refused (`refusals`, one per row and round while armed): sampled rows, rows with penalties, rounds with K != 1,
grammar-constrained rows, and rows it cannot fork: no MTP head or queued draft row, fork rows past the pool's
capacity, or no room for a K = 1 successor round before max_new_tokens (the tail).

Modes. `CONTROLLER` is armed by `set_optipipe_controller_threshold(q)` (the server's fresh-process door,
`nextn serve --research-opti-controller-q Q`); q = 0 is the unconditional measurement arm; q > 0 trips a session's
breaker after `BREAKER_MISSES` consecutive admitted misses (that session is not checked again). The forced modes
(`set_optipipe_gate_mode`, the `nextn optipipe-gate` harness only) admit every servable check with real
resolution; the harness forces the verdict through the drafts (an oracle drafter: its sessions are
`engine.spec.DraftedSession`s; the plain-greedy tokens give hits, a wrong shadow d2 misses), so no acceptance is
ever fabricated. `ABORT` drains its first attempt and then stops attempting.

Accounting: shadow_draft_tokens = gate_checks + gate_admits (d2 per check, d3 per admission);
wasted_draft_tokens = gate_rejects + 2 * (misses + abort_drains).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import spec
from engine.cache import KVPool, StatePool
from engine.model.qwen35 import FwdCtx, Qwen35ForCausalLM
from engine.sampling import SpecSampling
from engine.spec import DraftedSession, SpecSession, generate_spec, spec_round

__all__ = [
    "OptiForkGateMode", "OptiForkGateStats", "OptiForkStateIdentity", "OptiForkStateMismatch", "OptiForkRound",
    "optipipe_gate_stats", "reset_optipipe_gate_stats", "set_optipipe_controller_threshold",
    "set_optipipe_gate_mode", "optipipe_gate_mode", "optipipe_round", "optipipe_compare_session_state",
    "gate_invariants", "run_gate", "GateReport",
]

log = logging.getLogger("nextn.optipipe")

#: Consecutive admitted misses that trip a session's breaker (controller with q > 0).
BREAKER_MISSES = 3
#: Attempts the Alternate harness needs (with both hits and misses).
ALTERNATE_MIN_ATTEMPTS = 16
#: MTP-head KV rows a fork saves: P (the recomputed d1 row), P + 1 (d2's), P + 2 (d3's).
FORK_ROWS = 3


class OptiForkGateMode(enum.Enum):
    """Which OptiFork path runs. DISABLED (default) is inert; CONTROLLER is the increment-2 controller; the rest
    are the forced harness modes."""

    DISABLED = "off"
    HIT = "hit"
    MISS = "miss"
    ALTERNATE = "alternate"
    ABORT = "abort"
    CONTROLLER = "controller"

    @classmethod
    def parse(cls, name: str) -> OptiForkGateMode:
        """memra's CLI mapping: off, hit (also ring, stream), miss, alternate, abort, controller."""
        key = name.strip().lower()
        key = {"ring": "hit", "stream": "hit"}.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ValueError(f"unknown OPTIPIPE gate mode {name!r} (expected off, hit, ring, stream, miss, "
                             f"alternate, abort or controller)") from None


def _fieldwise_sum(a: Any, b: Any) -> Any:
    """a + b field by field, for two instances of one dataclass of ints."""
    return type(a)(*(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))


def _counter(doc: str) -> Any:
    return field(default=0, metadata={"doc": doc})


@dataclass(frozen=True)
class OptiForkGateStats:
    """Process-wide OptiFork counters (all zero while disabled). Each field's metadata["doc"] describes it."""

    attempts: int = _counter("admitted optimistic successors")
    hits: int = _counter("attempts whose successor was valid (n_acc == 1 and bonus == d2)")
    misses: int = _counter("attempts whose successor was invalid")
    abort_drains: int = _counter("attempts drained because the session ended (or a forced abort)")
    refusals: int = _counter("rows refused: sampling, penalties, K != 1, a grammar, or not forkable")
    gate_checks: int = _counter("shadow d2 drafts checked against the threshold")
    gate_admits: int = _counter("checks admitted")
    gate_rejects: int = _counter("checks rejected")
    reconciles: int = _counter("successor states restored after a miss")
    wasted_draft_tokens: int = _counter("shadow draft tokens not used: one per reject, two per miss or drain")
    shadow_draft_tokens: int = _counter("shadow draft tokens drafted: d2 per check, d3 per admission")
    breaker_trips: int = _counter("session breakers tripped by consecutive admitted misses")

    def __add__(self, other: OptiForkGateStats) -> OptiForkGateStats:
        return _fieldwise_sum(self, other)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class OptiForkStateIdentity:
    """Byte counts of one session's live decode state, by part: trunk KV rows [0, length) of every attention
    layer, the live GDN conv + recurrent states, the MTP head's final KV rows [0, scratch.length), and the queued
    carrier hiddens. Two sessions with equal identities and equal tensors are in the same state."""

    trunk_kv_bytes: int = 0
    recurrent_bytes: int = 0
    scratch_kv_bytes: int = 0
    hidden_bytes: int = 0

    @classmethod
    def of(cls, sess: SpecSession) -> OptiForkStateIdentity:
        return cls(**{k: sum(t.numel() * t.element_size() for t in ts) for k, ts in _state_parts(sess).items()})

    def __add__(self, other: OptiForkStateIdentity) -> OptiForkStateIdentity:
        return _fieldwise_sum(self, other)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


class OptiForkStateMismatch(AssertionError):
    """A candidate session's state differs from the serial reference's (the message names the first difference)."""


# ------------------------------------------------------------------------------------------ process-global gate
_lock = threading.Lock()
_mode = OptiForkGateMode.DISABLED
_threshold = 0.0
_abort_spent = False  # ABORT: the one forced drain has happened
_stats = OptiForkGateStats()


@dataclass
class _SessionGate:
    """Per-session gate state (kept in a weak map, so sessions carry nothing when the door is off)."""

    consecutive_misses: int = 0
    closed: bool = False  # the breaker tripped
    checks: int = 0
    refusals: int = 0


_sessions: weakref.WeakKeyDictionary[SpecSession, _SessionGate] = weakref.WeakKeyDictionary()


def _check_q(q: float) -> float:
    q = float(q)
    if not (math.isfinite(q) and 0.0 <= q <= 1.0):
        raise ValueError(f"the OPTIPIPE controller threshold must be a finite number in [0, 1], got {q!r}")
    return q


def set_optipipe_controller_threshold(q: float) -> None:
    """Arm the increment-2 diagnostic controller: admit a successor iff p(d1) * p(d2) >= q (the uncalibrated
    two-token draft-probability product). q must be finite in [0, 1] (ValueError). Serving calls this only from
    its fresh-process research door; without the door the engine stays byte-for-byte disabled."""
    _rearm(OptiForkGateMode.CONTROLLER, _check_q(q))


def _rearm(mode: OptiForkGateMode, q: float | None = None) -> None:
    """Set the mode (and q unless None) and clear the Abort latch; arm the round's door (`engine.spec.ROUND_HOOK`)
    for any mode but DISABLED, and close it (None) for DISABLED."""
    global _mode, _threshold, _abort_spent
    with _lock:
        _mode, _abort_spent = mode, False
        if q is not None:
            _threshold = q
        spec.ROUND_HOOK = None if mode is OptiForkGateMode.DISABLED else optipipe_round


def set_optipipe_gate_mode(mode: OptiForkGateMode | str) -> None:
    """Arm or disarm the forced harness (`nextn optipipe-gate` only; serving never calls it). CONTROLLER keeps the
    last threshold set (0 unless `set_optipipe_controller_threshold` said otherwise); DISABLED disarms."""
    _rearm(mode if isinstance(mode, OptiForkGateMode) else OptiForkGateMode.parse(mode))


def optipipe_gate_mode() -> tuple[OptiForkGateMode, float]:
    """(the armed mode, the controller threshold q)."""
    with _lock:
        return _mode, _threshold


def optipipe_gate_stats() -> OptiForkGateStats:
    """A consistent copy of the process-wide counters (updated once per round)."""
    with _lock:
        return _stats


def reset_optipipe_gate_stats() -> None:
    """Zero the counters (harness and tests; the server never resets)."""
    global _stats
    with _lock:
        _stats = OptiForkGateStats()


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """The gate is inert inside (the harness's serial reference rounds); the armed mode and latches survive."""
    global _mode
    with _lock:
        saved, _mode = _mode, OptiForkGateMode.DISABLED
    try:
        yield
    finally:
        with _lock:
            _mode = saved


# ------------------------------------------------------------------------------------------ the round hooks
def _refusal(r: SpecSession, k: int) -> str | None:
    """Why row `r` (drafting k tokens this round) cannot host an OptiFork successor, or None."""
    if k != 1:
        return "k"
    if not r.sampling.greedy:
        return "sampling"
    if r.sampling.has_penalties:
        return "penalties"
    if r.constraint is not None:
        return "grammar"
    if r.scratch is None or r._mtp_hidden is None or not r._mtp_tokens:
        return "no draft row"
    if len(r.committed) - 1 + FORK_ROWS > r.scratch.kv.k.shape[1]:
        return "capacity"
    if len(r.emitted) + 4 > r.max_new_tokens:  # after a full accept (2 tokens) no K = 1 successor round fits
        return "tail"
    return None


def optipipe_round(rows: Sequence[SpecSession], ks: Sequence[int]) -> OptiForkRound | None:
    """`engine.spec.ROUND_HOOK` while a mode is armed, called at the start of `spec_round` (before drafting). None
    -- and nothing else happens -- while the gate is suspended or disarmed; otherwise the round's fork: its
    servable rows with the MTP input row that drafts their d1."""
    if _mode is OptiForkGateMode.DISABLED:
        return None
    return OptiForkRound.begin(rows, ks)


@dataclass
class OptiForkRound:
    """One round's OptiFork bookkeeping: built by `optipipe_round`, finished by `resolve` after the commits."""

    mode: OptiForkGateMode
    threshold: float
    rows: list[int]  # indices of the servable rows in the round
    sessions: list[SpecSession]
    pos: list[int]  # P: the MTP row that drafts d1 (= the last committed row)
    in_tok: list[int]  # its token (the pending token)
    in_hid: list[torch.Tensor]  # its carrier hidden [1, H]
    refusals: int

    @classmethod
    def begin(cls, rows: Sequence[SpecSession], ks: Sequence[int]) -> OptiForkRound | None:
        global _abort_spent
        with _lock:
            mode, threshold, spent = _mode, _threshold, _abort_spent
        if mode is OptiForkGateMode.DISABLED or (mode is OptiForkGateMode.ABORT and spent):
            return None
        fr = cls(mode, threshold, [], [], [], [], [], 0)
        for i, (r, k) in enumerate(zip(rows, ks)):
            gate = _sessions.get(r)
            if gate is None:
                gate = _sessions[r] = _SessionGate()
            if gate.closed:
                continue
            if _refusal(r, k) is not None:
                fr.refusals += 1
                gate.refusals += 1
                continue
            if mode is OptiForkGateMode.ABORT and fr.rows:
                continue  # one forced abort, ever
            fr.rows.append(i)
            fr.sessions.append(r)
            fr.pos.append(len(r.committed) - 1)
            fr.in_tok.append(r._mtp_tokens[-1])
            fr.in_hid.append(r._mtp_hidden[-1:])
        if mode is OptiForkGateMode.ABORT and fr.rows:
            with _lock:
                _abort_spent = True
        return fr

    def resolve(self, model: Qwen35ForCausalLM, drafts: torch.Tensor, host: list[list[int]]) -> None:
        """Fork, check, admit and resolve every servable row, after the round committed. `drafts` [N, K] are the
        round's drafts, `host[i]` = [n_acc, drafted, accepted drafts..., bonus] as the round copied them.
        Fail-closed: if the bookkeeping itself fails (the forked rows are restored first), the controller disarms
        with one error log and the round's counts are dropped, so the round's tokens still go out; the forced
        harness modes re-raise."""
        global _stats
        delta: dict[str, int] = {"refusals": self.refusals}
        try:
            if self.rows:
                self._resolve(model, drafts, host, delta)
        except Exception:
            if self.mode is not OptiForkGateMode.CONTROLLER:
                raise
            log.exception("OPTIPIPE controller failed; disarmed (emitted tokens and session state are unaffected)")
            _rearm(OptiForkGateMode.DISABLED)
            return
        with _lock:
            _stats = _stats + OptiForkGateStats(**delta)

    def _resolve(self, model: Qwen35ForCausalLM, drafts: torch.Tensor, host: list[list[int]],
                 delta: dict[str, int]) -> None:
        def add(key: str, n: int = 1) -> None:
            delta[key] = delta.get(key, 0) + n

        sess = self.sessions
        pool: StatePool = sess[0].pool  # type: ignore[assignment]
        assert pool.mtp is not None
        mtp, slots, P = pool.mtp, [s.slot for s in sess], self.pos
        dev = drafts.device
        saved = [(mtp.k[s, p:p + FORK_ROWS].clone(), mtp.v[s, p:p + FORK_ROWS].clone())  # fork
                 for s, p in zip(slots, P)]
        keep = [False] * len(sess)  # hit: retain the successor rows P + 1, P + 2
        try:
            d1 = drafts[self.rows, 0]  # [A]
            tok0 = torch.tensor(self.in_tok, device=dev)
            h1 = _head_step(model, mtp, slots, P, tok0, torch.stack(self.in_hid))  # [A, 1, H] (rewrites row P)
            p1 = torch.softmax(model.logits(h1[:, 0]), dim=-1).amax(dim=-1)  # [A]
            h2 = _head_step(model, mtp, slots, [p + 1 for p in P], d1, h1)  # [A, 1, H]
            p2, d2 = torch.softmax(model.logits(h2[:, 0]), dim=-1).max(dim=-1)  # [A]
            d2 = _override(sess, P, 1, d2)
            q = (p1 * p2).tolist()
            add("gate_checks", len(sess))
            add("shadow_draft_tokens", len(sess))
            admit = []
            for a, r in enumerate(sess):
                _sessions[r].checks += 1
                ok = q[a] >= self.threshold if self.mode is OptiForkGateMode.CONTROLLER else True
                admit.append(ok)
                add("gate_admits" if ok else "gate_rejects")
                if not ok:
                    add("wasted_draft_tokens")
            adm = [a for a in range(len(sess)) if admit[a]]
            if adm:  # the successor's second draft
                h3 = _head_step(model, mtp, [slots[a] for a in adm], [P[a] + 2 for a in adm], d2[adm], h2[adm])
                d3 = _override([sess[a] for a in adm], [P[a] for a in adm], 2, model.logits(h3[:, 0]).argmax(-1))
                add("attempts", len(adm))
                add("shadow_draft_tokens", len(adm))
            d2h = d2.tolist()
            for a in adm:
                r, i = sess[a], self.rows[a]
                gate = _sessions[r]
                n_acc = host[i][0]
                bonus = host[i][2 + n_acc]
                hit = n_acc == 1 and bonus == d2h[a]
                if r.finished or self.mode is OptiForkGateMode.ABORT:
                    verdict = "drain"
                    add("abort_drains")
                    add("wasted_draft_tokens", 2)
                elif hit:
                    verdict = "hit"
                    add("hits")
                    gate.consecutive_misses = 0
                    keep[a] = True
                else:
                    verdict = "miss"
                    add("misses")
                    add("reconciles")
                    add("wasted_draft_tokens", 2)
                    gate.consecutive_misses += 1
                    if (self.mode is OptiForkGateMode.CONTROLLER and self.threshold > 0
                            and gate.consecutive_misses >= BREAKER_MISSES):
                        gate.closed = True
                        add("breaker_trips")
                if log.isEnabledFor(logging.DEBUG):
                    tag = "opti-controller" if self.mode is OptiForkGateMode.CONTROLLER else f"opti-gate {self.mode.value}"
                    log.debug("[%s] resolve slot=%d pos=%d n_acc=%d bonus=%d d2=%d d3=%d verdict=%s hit=%s q=%.4f",
                              tag, r.slot, P[a] + 1, n_acc, bonus, d2h[a], int(d3[adm.index(a)]), verdict,
                              hit, q[a])
        finally:  # reconcile: every forked row back, except a hit's successor rows; row P always
            for a, (s, p) in enumerate(zip(slots, P)):
                n = 1 if keep[a] else FORK_ROWS
                mtp.k[s, p:p + n] = saved[a][0][:n]
                mtp.v[s, p:p + n] = saved[a][1][:n]


def _head_step(model: Qwen35ForCausalLM, kv: KVPool, slots: list[int], pos: list[int], tok: torch.Tensor,
               hid: torch.Tensor) -> torch.Tensor:
    """One MTP head row per session: token tok[a] [A] with hidden hid[a] [A, 1, H] at position pos[a] of slot
    slots[a] (writes that KV row). Returns the head hidden [A, 1, H]."""
    A = len(slots)
    ctx = FwdCtx.make(model.config, tok.device, hid.dtype, slots, pos, [0] * A, [0] * A, 1, False)
    return model.mtp_forward(tok[:, None], hid, ctx, kv)


def _override(sess: Sequence[SpecSession], P: Sequence[int], j: int, tok: torch.Tensor) -> torch.Tensor:
    """Apply each `DraftedSession`'s drafter to shadow draft j (the round's d_j sits at position P + 2 + j, as
    `engine.draft._draft` numbers it)."""
    if not any(isinstance(r, DraftedSession) for r in sess):
        return tok
    tok = tok.clone()
    for a, r in enumerate(sess):
        if isinstance(r, DraftedSession):
            tok[a] = r.drafter(P[a] + 2 + j, j, int(tok[a]))
    return tok


# ------------------------------------------------------------------------------------------ state identity
def _state_parts(sess: SpecSession) -> dict[str, list[torch.Tensor]]:
    """The live state tensors of `sess`, keyed by `OptiForkStateIdentity` field."""
    c = sess.cache
    s, n = c.slot, c.length
    kv: list[torch.Tensor] = []
    rec: list[torch.Tensor] = []
    for layer in c.layers:
        if isinstance(layer, KVPool):
            kv += [layer.k[s, :n], layer.v[s, :n]]
        else:
            rec += [layer.conv[s, c.cur], layer.rec[s, c.cur]]
    sc = sess.scratch
    scratch = [] if sc is None else [sc.kv.k[sc.slot, :sc.length], sc.kv.v[sc.slot, :sc.length]]
    hidden = [] if sess._mtp_hidden is None else [sess._mtp_hidden]
    return {"trunk_kv_bytes": kv, "recurrent_bytes": rec, "scratch_kv_bytes": scratch, "hidden_bytes": hidden}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def optipipe_compare_session_state(ref: SpecSession, cand: SpecSession) -> OptiForkStateIdentity:
    """Check that `cand` is in exactly `ref`'s state: the same bookkeeping (trunk length, live GDN slot, MTP final
    rows, committed / pending / emitted tokens, queued MTP rows) and byte-identical live tensors. Returns the
    common `OptiForkStateIdentity`; raises `OptiForkStateMismatch` naming the first difference."""
    def book(s: SpecSession) -> dict[str, Any]:
        return {"length": s.cache.length, "gdn_slot": s.cache.cur,
                "scratch_length": None if s.scratch is None else s.scratch.length, "committed": s.committed,
                "pending": s.pending, "emitted": s.emitted, "mtp_tokens": s._mtp_tokens,
                "finish_reason": s.finish_reason}
    rb, cb = book(ref), book(cand)
    for key in rb:
        if rb[key] != cb[key]:
            raise OptiForkStateMismatch(f"{key} differs: serial {rb[key]!r} vs candidate {cb[key]!r}")
    ident = OptiForkStateIdentity.of(ref)
    if OptiForkStateIdentity.of(cand) != ident:
        raise OptiForkStateMismatch(f"byte counts differ: serial {ident} vs candidate {OptiForkStateIdentity.of(cand)}")
    rp, cp = _state_parts(ref), _state_parts(cand)
    for key in rp:
        for j, (a, b) in enumerate(zip(rp[key], cp[key])):
            if not _same_bytes(a, b):
                raise OptiForkStateMismatch(f"{key.removesuffix('_bytes')} tensor {j} differs from the serial run's")
    return ident


# ------------------------------------------------------------------------------------------ invariants, harness
def gate_invariants(stats: OptiForkGateStats, mode: OptiForkGateMode) -> list[tuple[str, bool]]:
    """memra's gate invariants for `mode` over `stats` accumulated from zero, as (statement, holds)."""
    s = stats
    if mode is OptiForkGateMode.DISABLED:
        return [("stats stay all-default", s == OptiForkGateStats())]
    out = [
        (f"gate_checks == gate_admits + gate_rejects ({s.gate_checks} == {s.gate_admits} + {s.gate_rejects})",
         s.gate_checks == s.gate_admits + s.gate_rejects),
        (f"attempts == gate_admits ({s.attempts} == {s.gate_admits})", s.attempts == s.gate_admits),
        (f"attempts == hits + misses + abort_drains ({s.attempts} == {s.hits} + {s.misses} + {s.abort_drains})",
         s.attempts == s.hits + s.misses + s.abort_drains),
        (f"reconciles == misses ({s.reconciles} == {s.misses})", s.reconciles == s.misses),
        (f"shadow_draft_tokens == gate_checks + gate_admits ({s.shadow_draft_tokens} == {s.gate_checks} + "
         f"{s.gate_admits})", s.shadow_draft_tokens == s.gate_checks + s.gate_admits),
        (f"wasted_draft_tokens == gate_rejects + 2 (misses + abort_drains) ({s.wasted_draft_tokens} == "
         f"{s.gate_rejects} + 2 ({s.misses} + {s.abort_drains}))",
         s.wasted_draft_tokens == s.gate_rejects + 2 * (s.misses + s.abort_drains)),
    ]
    if mode is OptiForkGateMode.HIT:
        out.append((f"forced hit: hits == attempts > 0 ({s.hits} == {s.attempts})", s.hits == s.attempts > 0))
    elif mode is OptiForkGateMode.MISS:
        out.append((f"forced miss: misses == attempts > 0 ({s.misses} == {s.attempts})",
                    s.misses == s.attempts > 0))
    elif mode is OptiForkGateMode.ALTERNATE:
        out.append((f"alternate: attempts >= {ALTERNATE_MIN_ATTEMPTS} with hits and misses ({s.attempts}, "
                    f"{s.hits}, {s.misses})", s.attempts >= ALTERNATE_MIN_ATTEMPTS and s.hits > 0 and s.misses > 0))
    elif mode is OptiForkGateMode.ABORT:
        out.append((f"abort: attempts == 1 == abort_drains ({s.attempts}, {s.abort_drains})",
                    s.attempts == 1 == s.abort_drains))
    return out


class _AllowAll:
    """A SpecConstraint that allows every token (the harness's grammar-shaped row: refused, output unchanged)."""

    def is_allowed(self, tok: int) -> bool:
        return True

    def mask_logits(self, row: torch.Tensor) -> torch.Tensor:
        return row

    def consume(self, tok: int) -> None:
        pass


def _oracle_drafter(mode: OptiForkGateMode, ref: list[int], plen: int,
                    vocab: int) -> Callable[[int, int, int], int] | None:
    """The forced verdict's drafter: d1 = the plain-greedy token (so n_acc = 1); the shadow d2 (j = 1) and d3 =
    the greedy tokens (Hit, Abort), wrong ones (Miss), or alternately right and wrong (Alternate). None: the
    model's own drafts (Controller, off)."""
    if mode in (OptiForkGateMode.DISABLED, OptiForkGateMode.CONTROLLER):
        return None
    checks = [0]

    def override(pos: int, j: int, d: int) -> int:
        i = pos - plen  # index of `pos` in the generated stream
        if i >= len(ref):
            return d
        good, bad = ref[i], (ref[i] + 1) % vocab
        if j == 0 or mode in (OptiForkGateMode.HIT, OptiForkGateMode.ABORT):
            return good
        if mode is OptiForkGateMode.MISS:
            return bad
        if j == 1:
            checks[0] += 1
        return good if checks[0] % 2 else bad

    return override


@dataclass
class GateReport:
    """What `run_gate` found: the checks (statement, holds) and the numbers behind them."""

    mode: OptiForkGateMode
    threshold: float | None
    stats: OptiForkGateStats
    checks: list[tuple[str, bool]]
    rounds: int
    sessions: int
    forkable: int
    tokens: int
    identity_first: OptiForkStateIdentity | None = None
    identity_continued: OptiForkStateIdentity | None = None

    @property
    def passed(self) -> bool:
        return all(ok for _, ok in self.checks)

    def lines(self) -> list[str]:
        """The human-readable report (the last line is PASS/FAIL)."""
        q = f" q={self.threshold:g}" if self.threshold is not None else ""
        out = [f"[optipipe-gate] mode={self.mode.value}{q} sessions={self.sessions} ({self.forkable} forkable, "
               f"{self.sessions - self.forkable} refused shapes) rounds={self.rounds} tokens={self.tokens}",
               "stats: " + " ".join(f"{k}={v}" for k, v in self.stats.to_dict().items())]
        out += [f"{'PASS' if ok else 'FAIL'}  {text}" for text, ok in self.checks]
        out.append("=== OPTIPIPE GATE PASS ===" if self.passed else "=== OPTIPIPE GATE FAIL ===")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "threshold": self.threshold, "stats": self.stats.to_dict(),
                "checks": [{"check": t, "ok": ok} for t, ok in self.checks], "rounds": self.rounds,
                "sessions": self.sessions, "forkable": self.forkable, "tokens": self.tokens,
                "identity_first": dataclasses.asdict(self.identity_first) if self.identity_first else None,
                "identity_continued": (dataclasses.asdict(self.identity_continued)
                                       if self.identity_continued else None),
                "pass": self.passed}


@torch.inference_mode()
def run_gate(model: Qwen35ForCausalLM, mode: OptiForkGateMode, prompts: Sequence[list[int]], *,
             max_new_tokens: int = 48, threshold: float = 0.7) -> GateReport:
    """The forced harness (`nextn optipipe-gate`). Runs one batch twice in lockstep on two state pools -- the
    serial reference with the gate inert, the candidate with `mode` armed -- and checks: `mode`'s invariants on the
    counters; every session's state (`optipipe_compare_session_state`) equal to the reference's after every
    round, the whole pools byte-identical at the end; tokens equal to the reference's and, for greedy rows, to
    plain greedy decode; refused shapes counted and never checked. The batch: one K = 1 greedy session per prompt
    (forkable; forced modes draft with the oracle), plus a sampled K = 1, a greedy K = 2 and a grammar-constrained
    K = 1 session on the first prompt (refused). EOS is ignored (full-length runs). The gate's previous mode
    is restored and its counters are reset before the run."""
    cfg, V = model.config, model.config.vocab_size
    if not cfg.has_mtp:
        raise ValueError("the model has no MTP head: OptiFork needs K = 1 speculation")
    plain = [generate_spec(model, p, max_new_tokens, k=0)[0] for p in prompts]
    specs: list[dict[str, Any]] = [dict(prompt=i, k=1, oracle=True) for i in range(len(prompts))]
    specs += [dict(prompt=0, k=1, sampling=SpecSampling(temperature=0.8, seed=7)), dict(prompt=0, k=2),
              dict(prompt=0, k=1, constraint=_AllowAll())]
    capmax = 2
    capacity = max(len(p) for p in prompts) + max_new_tokens + capmax + 1 + FORK_ROWS
    dev = model.lm_head.weight.device

    def build() -> tuple[StatePool, list[SpecSession]]:
        pool = StatePool(cfg, len(specs), capacity, capmax + 1, dev, cfg.dtype, mtp=True)
        out = []
        for sp in specs:
            i = sp["prompt"]
            ov = _oracle_drafter(mode, plain[i], len(prompts[i]), V) if sp.get("oracle") else None
            kw = dict(k=sp["k"], capmax=capmax, pool=pool, sampling=sp.get("sampling", SpecSampling()),
                      constraint=sp.get("constraint"))
            out.append(SpecSession(model, prompts[i], max_new_tokens, **kw) if ov is None
                       else DraftedSession(model, prompts[i], max_new_tokens, drafter=ov, **kw))
        for s in out:
            while s.prefilling:
                s.prefill_chunk()
        return pool, out

    prev_mode, prev_q = optipipe_gate_mode()
    checks: list[tuple[str, bool]] = []
    first = cont = None
    rounds = 0
    try:
        reset_optipipe_gate_stats()
        if mode is OptiForkGateMode.CONTROLLER:
            set_optipipe_controller_threshold(threshold)
        else:
            set_optipipe_gate_mode(mode)
        ref_pool, ref = build()
        cand_pool, cand = build()
        mismatch = None
        while mismatch is None and any(not s.finished for s in ref):
            live = [i for i, s in enumerate(ref) if not s.finished]
            with _suspended():
                spec_round(model, [ref[i] for i in live])
            spec_round(model, [cand[i] for i in live if not cand[i].finished])
            rounds += 1
            try:
                ident = OptiForkStateIdentity()
                for a, b in zip(ref, cand):
                    ident = ident + optipipe_compare_session_state(a, b)
                cont = ident
                if first is None and optipipe_gate_stats().gate_checks > 0:
                    first = ident
            except OptiForkStateMismatch as e:
                mismatch = f"round {rounds}: {e}"
        stats = optipipe_gate_stats()
        checks += gate_invariants(stats, mode)
        if mode is not OptiForkGateMode.DISABLED:
            refused = cand[len(prompts):]
            checks.append((f"refused shapes (sampled, K=2, grammar): refusals > 0 and never checked "
                           f"({stats.refusals}, {sum(_session_checks(s) for s in refused)})",
                           stats.refusals > 0 and all(_session_checks(s) == 0 for s in refused)))
        checks.append((f"every session's state equals the serial run's after each of {rounds} rounds"
                       + (f" -- {mismatch}" if mismatch else ""), mismatch is None))
        if first is not None:
            checks.append((f"state identity first: {first}", mismatch is None))
        if cont is not None:
            checks.append((f"state identity continued: {cont}", mismatch is None))
        pools_equal = all(_same_bytes(a, b) for a, b in zip(_pool_tensors(ref_pool), _pool_tensors(cand_pool)))
        checks.append(("whole state pools byte-identical to the serial run's at the end", pools_equal))
        same = [a.emitted == b.emitted for a, b in zip(ref, cand)]
        greedy = [s.emitted == plain[sp["prompt"]] for s, sp in zip(cand, specs) if "sampling" not in sp]
        checks.append((f"tokens: candidate == serial for all {len(cand)} sessions, == plain greedy for the "
                       f"{len(greedy)} greedy ones", all(same) and all(greedy)))
    finally:
        _rearm(prev_mode, prev_q)
    return GateReport(mode, threshold if mode is OptiForkGateMode.CONTROLLER else None, stats, checks, rounds,
                      len(specs), len(prompts), sum(len(s.emitted) for s in cand), first, cont)


def _session_checks(sess: SpecSession) -> int:
    gate = _sessions.get(sess)
    return 0 if gate is None else gate.checks


def _pool_tensors(pool: StatePool) -> list[torch.Tensor]:
    ts = [t for c in pool.layers for t in ((c.k, c.v) if isinstance(c, KVPool) else (c.conv, c.rec))]
    return ts + ([pool.mtp.k, pool.mtp.v] if pool.mtp is not None else [])
