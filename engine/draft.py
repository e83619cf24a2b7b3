"""The batched round's draft and accept steps (`engine.spec.spec_round` calls them): the MTP drafts of every row,
one head forward per depth (`_draft`, choosing with `_pick`), and acceptance on the device (`_accept`). A row's own
hooks run through `_hook`, so a hook that raises fails that row alone."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .graphs import EAGER, GraphRunner, StepRunner
from .model.ops import dispatch as ops
from .model.qwen35 import Qwen35ForCausalLM
from .sampling import probs_from_logits, sample
from .session import SessionState, _queued_mtp_rows


def _hook(r: SessionState, fallback: Any, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn(*args, **kw)`: one of row r's own hooks (grammar, penalties) inside the batched round. If it raises, r
    fails (its request gets the error) and `fallback` stands in, so the batch's tensors keep their shape and no
    other row sees a difference; a failed row's hooks are not called again."""
    if r.error is not None:
        return fallback
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - one row's hook fails that row only
        r.fail(e)
        return fallback


def _pick(rows: list[SessionState], logits: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        list[torch.Tensor | None]]:
    """Each row's draft from its MTP logits [A, V] (fp32): argmax for greedy rows, a draw from q for sampled ones.
    `extra` [A, j] = the drafts so far (penalties; draft j is output token len(emitted) + j, for min_tokens).
    Returns (tokens [A] long, top probability [A] (None at depth 0, where the p-min cut does not apply, and when no
    row has p_min > 0: a probability is never below 0), q rows)."""
    j = extra.shape[1]
    proc = torch.stack([_hook(r, logits[i], r._pen.apply, logits[i], r.sampling, extra[i], n_out=len(r.emitted) + j)
                        for i, r in enumerate(rows)]) if any(r.sampling.processes for r in rows) else logits
    top = torch.softmax(proc, dim=-1).amax(dim=-1) if j and any(r.p_min > 0 for r in rows) else None  # [A]
    tok = ops.argmax(proc)  # [A]
    qs: list[torch.Tensor | None] = [None] * len(rows)
    for i, r in enumerate(rows):
        if not r.sampling.greedy and r.error is None:
            try:
                qs[i] = probs_from_logits(proc[i], r.sampling)  # [V]
                tok[i] = sample(qs[i], r._gen)
            except Exception as e:  # noqa: BLE001 - one row's sampler fails that row only
                r.fail(e)
                continue
            if top is not None:
                top[i] = qs[i].amax()
    return tok, top, qs


def rides(r: SessionState) -> bool:
    """Whether a row past its k can stay in the round's chained draft forwards with its drafts cut: greedy, no
    constraint, no logit processing, no p-min (nothing reads or draws from what it would draft). Such a row's drafts
    cost nothing once a round drafts (the controller's free rows, `engine.kpolicy.KPolicy.plan`)."""
    return r.sampling.greedy and r.constraint is None and not r.sampling.processes and r.p_min == 0


def rope_deltas(rows: list[SessionState]) -> dict[str, list[int]]:
    """The runner's `delta` keyword for these rows: {} when every row rotates at its cache positions (text-only
    sessions: the runner's plain call), else {"delta": each row's rope delta}."""
    d = [r.rope_delta for r in rows]
    return {"delta": d} if any(d) else {}


def _write_oldest(model: Qwen35ForCausalLM, rows: list[SessionState], n: list[int], runner: StepRunner) -> None:
    """Write the oldest n[a] queued MTP rows of each row a in one head forward, rows right-padded (the padding's K/V
    land past each row's scratch length and are overwritten later); the logits are not used."""
    toks, hid, _ = _queued_mtp_rows(rows, n)  # [A, Tm], [A, Tm, H]
    runner.draft(model, rows[0].pool, toks, hid, [r.slot for r in rows], [r.scratch.length for r in rows],
                 [k - 1 for k in n], **rope_deltas(rows))  # [A, 1, H], [A, V]: unused
    for r, k in zip(rows, n):
        r.scratch.set_len(r.scratch.length + k)
        r._mtp_tokens, r._mtp_hidden = r._mtp_tokens[k:], r._mtp_hidden[k:]


def _write_backlog(model: Qwen35ForCausalLM, rows: list[SessionState], runner: StepRunner, limit: int) -> None:
    """Write the oldest queued MTP rows of every row whose queue is longer than `limit` (a row that ran plain
    rounds, k = 0, queued one a round) in head forwards of at most `limit` rows each, until every queue holds
    `limit` rows or fewer: every forward has a shape the runner captured."""
    while True:
        over = [r for r in rows if len(r._mtp_tokens) > limit]
        if not over:
            return
        _write_oldest(model, over, [min(limit, len(r._mtp_tokens) - limit) for r in over], runner)


def _write_long_queues(model: Qwen35ForCausalLM, rows: list[SessionState], runner: StepRunner, limit: int) -> None:
    """Eager runner: write all but the newest `limit` queued MTP rows of every row whose queue is longer (a row that
    ran plain rounds, k = 0, queued one a round), so the depth-0 forward pads every row to at most `limit` rows,
    within each slot's headroom (`pool_capacity`: K + 1 past the context). Padded to the longest backlog, a row
    near its slot's end would write past it: those rows go in one head forward when every one of them has room for
    the padding, else one forward each (no padding)."""
    long = [r for r in rows if len(r._mtp_tokens) > limit]
    if not long:
        return
    n = [len(r._mtp_tokens) - limit for r in long]
    if all(r.scratch.length + max(n) <= r.pool.capacity for r in long):
        _write_oldest(model, long, n, runner)
        return
    for r, k in zip(long, n):
        _write_oldest(model, [r], [k], runner)


def _draft(model: Qwen35ForCausalLM, rows: list[SessionState], ks: list[int],
           runner: StepRunner = EAGER) -> tuple[torch.Tensor, list[list]]:
    """Draft up to ks[i] tokens per row, one MTP head forward per depth over every row still drafting.
    Returns drafts [N, max ks] (long, -1 where a row drafts nothing: fewer wanted, p-min cut, constraint) and the
    q rows of sampled rows (qs[i][j]). A row whose hook raises is failed and leaves the chained forwards; its drafts
    row is meaningless (`spec_round` drops it)."""
    N, K = len(rows), max(ks)
    dev = rows[0].device
    drafts = torch.full((N, K), -1, dtype=torch.long, device=dev)
    qs: list[list] = [[None] * K for _ in rows]
    act = [i for i in range(N) if ks[i] > 0]
    if not act:
        return drafts, qs
    pool = rows[0].pool
    if isinstance(runner, GraphRunner):  # graphs hold T <= the pool's window: older queued rows go first, in chunks
        _write_backlog(model, [rows[i] for i in act], runner, pool.window)
    else:  # long queues first: padded to one, a row near its slot's end would write past it
        _write_long_queues(model, [rows[i] for i in act], runner, pool.window)
    # depth 0: each row writes its queued committed rows (1..k+1 of them, padded) and drafts from the last one
    toks, hid, qlen = _queued_mtp_rows([rows[i] for i in act])  # [A, Tq], [A, Tq, H]
    sc_pos = [rows[i].scratch.length for i in act]
    h, lg = runner.draft(model, pool, toks, hid, [rows[i].slot for i in act], sc_pos,
                         [q - 1 for q in qlen], **rope_deltas([rows[i] for i in act]))  # [A, 1, H], [A, V]
    for i in act:
        r = rows[i]
        r.scratch.set_len(len(r.committed))
        r._mtp_tokens, r._mtp_hidden = [], None
        r._window = 0  # drafts the constraint consumed this round
        if r.constraint is not None and hasattr(r.constraint, "draft_begin"):
            _hook(r, None, r.constraint.draft_begin)
    alive = torch.ones(len(act), dtype=torch.bool, device=dev)
    for j in range(K):
        if j > 0:
            # rows done drafting ride along, their drafts cut (no gathers; the forwards are row-wise), unless a draw,
            # a hook or a failure would see the ride: sampled, constrained or penalised rows and failed ones leave
            live = [a for a, i in enumerate(act) if rows[i].error is None and (ks[i] > j or rides(rows[i]))]
            if not any(ks[act[a]] > j for a in live):
                break
            if len(live) < len(act):
                act, h, alive = [act[a] for a in live], h[live], alive[live]
            if any(ks[i] <= j for i in act):  # riders: their drafts from here on are cut
                alive &= torch.tensor([ks[i] > j for i in act], device=dev)
        ix = act if len(act) < N else slice(None)  # drafts' rows of `act` (all rows: views, not gathers)
        if j > 0:  # chained depth: the previous draft and the head's own hidden, one row each
            prev = drafts[ix, j - 1].clamp_min(0)[:, None]  # [A, 1]
            h, lg = runner.draft(model, pool, prev, h, [rows[i].slot for i in act],
                                 [len(rows[i].committed) - 1 + j for i in act], None,
                                 **rope_deltas([rows[i] for i in act]))  # [A, 1, H], [A, V]
        arows = [rows[i] for i in act]
        for a, r in enumerate(arows):  # grammars propose legal drafts only (drafts never affect exactness)
            if r.constraint is not None and hasattr(r.constraint, "draft_mask_logits") and r.error is None \
                    and bool(alive[a]):
                lg[a] = _hook(r, lg[a], r.constraint.draft_mask_logits, lg[a])
        tok, top, q = _pick(arows, lg, drafts[ix, :j])
        if top is not None:  # j > 0 and some row has p_min > 0
            # p-min tests the drafter's TOP probability before a token is chosen: whether position j is drafted
            # never depends on which token is drawn, so rejection sampling against q stays exact
            alive &= top >= torch.tensor([rows[i].p_min for i in act], device=dev, dtype=top.dtype)
        for a, i in enumerate(act):
            r = rows[i]
            qs[i][j] = q[a]
            if r.drafts_on_host:
                if r.error is not None or not bool(alive[a]):  # a host decision per draft (grammars)
                    continue
                try:
                    d = int(tok[a])
                    c = r.host_draft(len(r.committed) + 1 + j, j, d)
                    if c is None:
                        alive[a] = False
                    elif c != d:
                        tok[a] = c
                except Exception as e:  # noqa: BLE001 - one row's hook fails that row only
                    r.fail(e)
        drafts[ix, j] = torch.where(alive, tok, -1)
    # a cut is final: nothing after the first -1 counts
    drafts = torch.where(torch.cumprod((drafts >= 0).long(), dim=1).bool(), drafts, -1)
    return drafts, qs


def _accept(rows: list[SessionState], logits: torch.Tensor, drafts: torch.Tensor, qs: list[list],
            ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance for every row on the device. logits [N, T, V] (fp32), drafts [N, T-1] (-1 = none), ks the drafts
    each row asked for.
    Returns (n_acc [N], out [N, T]) with out[i, :n_acc] = the accepted drafts and out[i, n_acc] = the bonus (a row
    whose hook raised is failed; its entries are meaningless)."""
    N, T, _ = logits.shape
    K = T - 1
    dev = logits.device
    cols = torch.arange(T, device=dev)
    valid = drafts >= 0  # [N, K]
    proc = logits
    if any(r.sampling.processes for r in rows):
        # column t of row i chooses output token len(emitted) + t (min_tokens); host ints, no sync
        later = torch.arange(K, device=dev) >= cols[:, None]  # [T, K]: draft j comes after column t
        ex = drafts[:, None, :].expand(N, T, K).masked_fill(later, -1)  # [N, T, K]
        proc = torch.stack([_hook(r, logits[i], r._pen.apply, logits[i], r.sampling, ex[i], n_out=len(r.emitted))
                            for i, r in enumerate(rows)])
    # greedy rows under a grammar accept by the MASKED argmax of each column (what constrained plain greedy picks
    # after the same drafts): the masks of the states the drafts reached, kept while drafting
    masks = [(i, _hook(r, None, r.constraint.window_mask, r._window + 1, dev)) for i, r in enumerate(rows)
             if ks[i] > 0 and r.sampling.greedy and r.constraint is not None and hasattr(r.constraint, "window_mask")]
    if masks:
        proc = proc.clone()
        for i, m in masks:
            if m is not None:  # None: the row failed
                proc[i, :m.shape[0]] = proc[i, :m.shape[0]].masked_fill(~m, float("-inf"))
    am = ops.argmax(proc.flatten(0, 1)).view(N, T)  # [N, T]
    if K == 0:  # plain steps only: nothing to accept, each bonus is its row's column-0 choice
        n_acc, bonus = torch.zeros(N, dtype=torch.long, device=dev), am[:, 0]
    else:
        match = (am[:, :K] == drafts) & valid
        n_acc = torch.cumprod(match.long(), dim=1).sum(dim=1)  # [N]
        bonus = am.gather(1, n_acc[:, None])[:, 0]  # [N]
    for i, r in enumerate(rows):
        if r.sampling.greedy or r.constraint is not None or r.error is not None:  # constrained: in commit_round
            continue
        try:  # Leviathan/Chen: accept d_j w.p. min(1, p/q); on the first reject draw from norm(max(0, p - q));
            # when all are accepted the bonus comes from p of the next column
            p = probs_from_logits(proc[i], r.sampling)  # [T, V]
            q = torch.stack([qj if qj is not None else torch.zeros_like(p[0]) for qj in qs[i][:K]]
                            + [torch.zeros_like(p[0])])
            kw = ks[i]  # the draws a row makes depend on the row alone, never on the batch
            u = torch.rand(kw, generator=r._gen, dtype=torch.float64, device=dev)
            d = drafts[i, :kw].clamp_min(0)
            ok = (u * q[cols[:kw], d] < p[cols[:kw], d]) & valid[i, :kw]
            na = torch.cumprod(ok.long(), dim=0).sum()
            kd = valid[i].sum()
            resid = torch.clamp(p[na] - q[na], min=0.0)
            use_resid = (na < kd) & (resid.sum() > 0)
            dist = torch.where(use_resid, resid / resid.sum().clamp_min(1e-300), p[na])
            n_acc[i], bonus[i] = na, sample(dist, r._gen)
        except Exception as e:  # noqa: BLE001 - one row's sampler fails that row only
            r.fail(e)
    if K == 0:
        return n_acc, bonus[:, None]
    out = torch.where(cols < n_acc[:, None], torch.cat([drafts, bonus[:, None]], 1), bonus[:, None])  # [N, T]
    return n_acc, out
