"""Prompt prefill on the fixed grid: the forwards that run joining sessions' prompt blocks, and whether one forward
may carry several rows; `prefill` runs one sequence into a `ModelCache` the same way (tools, tests, research).

A prompt is prefilled in grid blocks (`engine.cache.PREFILL_GRID`): a block starts where the session's cache ends
and stops at the next multiple of the grid (absolute positions) or at the prompt's end, so where a prompt's chunks
split never depends on the token budget, the batch or K. What a block computes must not depend on the batch either:

  * on a CPU with the C kernels (fp32, the GEMM built; MoE experts too) every op of the forward is row-wise with a fixed
    order of sums (engine/model/ops/cpu.py), so one forward may carry the next block of several sessions
    (right-padded) and a block's bits are what its row alone computes: `packs_rows` is True. The same kernels run the
    decode and verify steps, so a state reached by decoding is bitwise the state a prefill of the same tokens
    reaches (`steps_match_prefill`): the prefix cache may then keep blocks that generated tokens completed;
  * on the kernel path (CUDA with triton) every op of a prefill forward is row-wise too: the GEMMs are the
    batch-invariant Triton matmul in the "prefill" tiling (`FwdCtx.phase`: chosen by the forward's kind, never by its
    rows), the norms, gates and activations row-wise kernels, the MoE experts the grouped matmul and the slot-order
    combine, attention the prefill kernel over each row's own keys (per-row slot and pos0), the GDN recurrence the
    chunked kernel from each row's first token (per-row slot, read and write window slots, and real length: the
    padding leaves the state alone; its chunks restart at each grid block inside a row), the conv an explicit
    per-token tap sum. So the next blocks of several sessions share one forward (right-padded) as on the C path, and
    several blocks of one session share one row (`prefill_rows` blocks), while every prefill kernel runs (`packs_rows`: a kernel that
    fell back to its torch twin ends the packing); decode steps there run other kernels (the recurrent GDN update,
    the "step" tiling), so they do not reach a prefill's bits (`steps_match_prefill` is False);
  * elsewhere (the torch path: a GEMM whose rounding follows the row count, SDPA over padded rows) each forward
    carries one block of one session, whose shape depends on the block alone, so its bits are the same whatever
    else runs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .cache import PREFILL_GRID, ModelCache
from .model.ops import cpu
from .model.ops import dispatch as ops
from .model.ops.matmul_fp8 import FP8
from .model.qwen35 import FwdCtx, GatedDeltaNet, Qwen35ForCausalLM, rope_table
from .session import SessionState, _queued_mtp_rows


def prefill(model: Qwen35ForCausalLM, ids: list[int], cache: ModelCache,
            want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run `ids` into `cache` at cache.length, one forward per prefill-grid block (as a session prefills).
    Returns (fp32 logits of the last row [V], post-norm hiddens [T, H] and pre-norm hiddens [T, H] of every row
    when want_hidden, else None)."""
    dev = model.lm_head.weight.device
    cache.check_room(len(ids))
    pres, last = [], None
    c0 = 0
    while c0 < len(ids):
        n = min(len(ids) - c0, PREFILL_GRID - cache.length % PREFILL_GRID)
        x = torch.tensor([ids[c0:c0 + n]], device=dev)
        c0 += n
        h = model.forward_hidden(x, cache.length, cache)[0]  # [t, H]
        cache.length += x.shape[1]
        if want_hidden:
            pres.append(h)
        last = h[-1]
    logits = model.logits(model.model.norm(last))
    if not want_hidden:
        return logits, None, None
    pre = torch.cat(pres)
    return logits, model.model.norm(pre), pre


#: the kernels a prefill forward on the kernel path runs (a fallen-back one is its torch twin: not row-wise)
PREFILL_KERNELS = ("matmul", "rms_norm", "gated_rms_norm", "attention_prefill", "gdn_prefill", "gdn_gates", "silu_mul")
#: ... and a MoE model's, and an FP8 checkpoint's
MOE_KERNELS = ("grouped_matmul", "moe_combine")


def prefill_kernels(model: Qwen35ForCausalLM) -> tuple[str, ...]:
    """The Triton kernels (`ops.KERNELS` names) a prefill forward of `model` calls on the kernel path."""
    fp8 = any(p.dtype == FP8 for p in model.parameters())
    return PREFILL_KERNELS + (MOE_KERNELS if model.config.is_moe else ()) + (("matmul_fp8",) if fp8 else ())


def packs_rows(model: Qwen35ForCausalLM, kernels: tuple[str, ...] | None = None) -> bool:
    """Whether every op of this model's prefill forward is row-wise (see the module docstring): one forward may then
    carry several sessions' blocks. On the kernel path: while every kernel a prefill forward calls runs (`kernels`,
    default `prefill_kernels(model)`; the startup self-check may hand one to its twin, so a caller asks again after
    it); on a CPU: the C kernels in fp32."""
    w = model.lm_head.weight
    cfg = model.config
    if ops.use_triton(w):
        return all(ops.use_kernel(n, w) for n in (kernels if kernels is not None else prefill_kernels(model)))
    return (w.device.type == "cpu" and w.dtype == torch.float32 and cpu.available()
            and cpu.gemm_takes(w[:1], w) and 2 <= cfg.linear_conv_kernel_dim <= 16
            and all(p.shape[-1] % 8 == 0 and p.is_contiguous() for n, p in model.named_parameters()
                    if p.dim() >= 2 and not n.endswith(("embed_tokens.weight", "conv1d.weight")))
            and (not cfg.is_moe or cfg.moe_intermediate_size % 8 == 0))


def steps_match_prefill(model: Qwen35ForCausalLM) -> bool:
    """Whether a decode step reaches bitwise the state a prefill of the same tokens reaches (the prefix cache may then
    keep blocks that generated tokens completed): the C path only, where one set of row-wise kernels runs both."""
    return packs_rows(model) and not ops.use_triton(model.lm_head.weight)


def splits_rows(model: Qwen35ForCausalLM) -> bool:
    """Whether a prefill forward's row may carry several blocks of one prompt on the C path (`steps_match_prefill`
    and every GDN layer fused): its recurrence runs token by token, so the row's blocks run as consecutive calls
    with one call's bits, and each inner boundary's state stays in a window slot (the scheduler cuts a prompt's
    last block at its tail without a forward of its own)."""
    return steps_match_prefill(model) and all(layer.fused for layer in model.modules()
                                               if isinstance(layer, GatedDeltaNet))


@torch.inference_mode()
def prefill_rows(model: Qwen35ForCausalLM, rows: list[SessionState], blocks: list[int] | None = None,
                 keep: list[list[int]] | None = None,
                 after_block: Callable[[int, list[SessionState]], None] | None = None,
                 defer: list[Callable[[], None]] | None = None) -> None:
    """Prefill the next grid blocks (`SessionState.next_chunks`: blocks[i] of row i, default 1 each) of every row's
    queued prompt in ONE trunk forward, each row's blocks one after the other in one row, then each row's host side
    block by block as `SessionState.prefill_chunk` does: for block j, every row that has one runs `prefilled`, the
    MTP head writes their ready rows in one head forward (so the head's forwards are those of one block per
    forward), the rows that ended their prompt choose their first token, and `after_block(j, rows)` sees the rows
    that completed block j (the prefix cache writes it there). Several blocks in a row need the kernel path (the
    GDN chunks restart at each block: `FwdCtx.seg`) or the C path (`splits_rows`); keep[i]: the window slot for
    the GDN and conv state at each of row i's inner block boundaries (-1: not kept; never the live slot; on the C
    path each must be kept), so the caller can cache every block.

    defer (a list; no row has images): the head forwards are not run here but appended to it, one callable per
    block (the same rows in the same forwards; one that raises fails its rows), and the rows that ended their
    prompt choose their first token at once, so it does not wait for them. The caller runs them, in order,
    before anything else reads these rows' MTP scratch or queue (their next forward or round, a prefix-cache
    write of their blocks: after_block's work then waits behind them too).

    Rows are right-padded to the longest: the padding's K/V land past the row's length (overwritten later) and its
    GDN tokens leave the state unchanged (`FwdCtx` lens), so each row ends in the state of its own tokens. The caller
    checks that every row's cache.length + longest row fits the pool's capacity, and that the forward's rows are
    independent (`packs_rows`, or one row). A row whose blocks do not fit its cache or whose host side fails is
    failed alone; a failing forward raises (every row is then in doubt)."""
    blocks = blocks or [1] * len(rows)
    chunks: list[list[list[int]]] = []
    live: list[SessionState] = []
    kept: list[list[int]] = []
    for i, (r, n) in enumerate(zip(rows, blocks)):
        try:
            chunks.append([r.next_chunk()] if n == 1 else r.next_chunks(n))
            live.append(r)
            kept.append(list(keep[i][:len(chunks[-1]) - 1]) if keep is not None else [-1] * (len(chunks[-1]) - 1))
        except Exception as e:  # noqa: BLE001 - a prompt that does not fit fails its own request
            r.fail(e)
    if not live:
        return
    flat = [sum(cs, []) for cs in chunks]
    seg = [[len(c) for c in cs] for cs in chunks]
    T = max(len(f) for f in flat)
    r0 = live[0]
    x = torch.tensor([f + [0] * (T - len(f)) for f in flat], device=r0.device)  # [N, T]
    cur = [r.cache.cur for r in live]
    pos0 = [r.cache.length for r in live]
    emb, rope = _image_inputs(model, live, x, pos0, [r.input_embeds(p, f) for r, p, f in zip(live, pos0, flat)])
    ctx = FwdCtx.make(model.config, r0.device, r0.dtype, [r.slot for r in live], pos0,
                      cur, cur, T, False, lens=[len(f) for f in flat], rope=rope, seg=seg, keep=kept)
    # (image rows: the embeddings given; a text-only forward is the plain call)
    pre = model.forward_step(x, ctx, r0.pool) if emb is None else \
        model.forward_step(x, ctx, r0.pool, emb)  # [N, T, H]
    ok = set(range(len(live)))
    owed = [0] * len(live)  # (defer) MTP rows of each row already handed to a deferred head forward
    for j in range(max(len(cs) for cs in chunks)):
        done = []
        for i, r in enumerate(live):
            if i not in ok or j >= len(chunks[i]):
                continue
            a = sum(seg[i][:j])
            try:
                r.prefilled(chunks[i][j], pre[i, a:a + seg[i][j]], ctx, flush_mtp=False)  # [t, H]
                done.append(i)
            except Exception as e:  # noqa: BLE001 - one row's host side (its logprobs, ...) fails that row
                r.fail(e)
                ok.discard(i)
        if defer is not None:
            counts = [live[i].mtp_ready - owed[i] for i in done]  # this block's rows (nothing written yet)
            for i, c in zip(done, counts):
                owed[i] += c
            defer.append(functools.partial(flush_mtp_or_fail, model, [live[i] for i in done], counts))
        elif not flush_mtp_or_fail(model, [live[i] for i in done]):
            ok.difference_update(done)
            done = []
        for i in list(done):
            try:
                live[i].choose_first()
            except Exception as e:  # noqa: BLE001 - one row's choice (its grammar) fails that row
                live[i].fail(e)
                ok.discard(i)
                done.remove(i)
        if after_block is not None:
            after_block(j, [live[i] for i in done])
            ok = {i for i in ok if live[i].error is None}  # a row whose block write failed stops here


def flush_mtp_rows(model: Qwen35ForCausalLM, rows: list[SessionState], counts: list[int] | None = None) -> None:
    """Write every row's ready MTP rows (`SessionState.mtp_ready`: a prompt block's last row waits for the next
    block; or its first counts[i] queued rows) into its scratch in ONE head forward, rows right-padded (the
    padding's K/V land past each row's scratch length and are overwritten later). Rows of sessions that prefill
    alone or finish go through here too (a row's rows are final once their next token is known)."""
    counts = [r.mtp_ready for r in rows] if counts is None else counts
    rows, counts = [r for r, c in zip(rows, counts) if c], [c for c in counts if c]
    if len(rows) <= 1:
        for r, c in zip(rows, counts):
            r._flush_mtp(c)
        return
    toks, hid, n = _queued_mtp_rows(rows, counts)  # [A, Tm], [A, Tm, H]
    r0, sc = rows[0], [r.scratch for r in rows]
    pos0 = [s.length for s in sc]
    emb, rope = _image_inputs(model, rows, toks, pos0, [r.input_embeds(p + 1, r._mtp_tokens[:k]) if r.images else None
                                                        for r, p, k in zip(rows, pos0, n)])
    ctx = FwdCtx.make(model.config, r0.device, r0.dtype, [s.slot for s in sc], pos0,
                      [0] * len(rows), [0] * len(rows), toks.shape[1], False, rope=rope)
    if emb is None:
        model.mtp_forward(toks, hid, ctx, r0.pool.mtp)  # [A, Tm, H]: only the K/V it writes is used
    else:
        model.mtp_forward(toks, hid, ctx, r0.pool.mtp, emb)
    for r, k in zip(rows, n):
        r.scratch.set_len(r.scratch.length + k)
        r._mtp_tokens, r._mtp_hidden = r._mtp_tokens[k:], r._mtp_hidden[k:] if k < len(r._mtp_tokens) else None


def flush_mtp_or_fail(model: Qwen35ForCausalLM, rows: list[SessionState], counts: list[int] | None = None) -> bool:
    """`flush_mtp_rows`, failing every row of it (their requests get the error) if the batched head forward raises
    (its rows are in doubt). Returns whether it ran; a failed row is skipped."""
    live = [(r, c) for r, c in zip(rows, counts or [None] * len(rows)) if r.error is None]
    try:
        flush_mtp_rows(model, [r for r, _ in live], None if counts is None else [c for _, c in live])
    except Exception as e:  # noqa: BLE001 - the batched head forward failed: its rows are in doubt
        for r, _ in live:
            r.fail(e)
        return False
    return True


def _image_inputs(model: Qwen35ForCausalLM, rows: list[SessionState], ids: torch.Tensor, pos0: list[int],
                  embeds: list[torch.Tensor | None]) -> tuple[torch.Tensor | None,
                                                          tuple[torch.Tensor, torch.Tensor] | None]:
    """A batched prefill or MTP forward's inputs when some of its rows belong to sessions with images: the input
    embeddings [N, T, H] (the token embeddings, row i's first len(embeds[i]) replaced by embeds[i] where given) and
    every token's rotary rows [N, T, R] (a session with images: `SessionState.rope_rows`; the others: the table's
    rows at pos0[i] + t, the bits they rotate with otherwise). (None, None) when no row has images: the plain
    forward. ids [N, T] (right-padded)."""
    if not any(r.images for r in rows):
        return None, None
    N, T = ids.shape
    emb = None
    if any(e is not None for e in embeds):
        emb = model.model.embed_tokens(ids)  # [N, T, H]
        for i, e in enumerate(embeds):
            if e is not None:
                emb[i, :e.shape[0]] = e
    cos, sin = rope_table(model.config, max(pos0) + T, ids.device, rows[0].dtype)
    at = torch.tensor(pos0, device=ids.device)[:, None] + torch.arange(T, device=ids.device)  # [N, T]
    cos, sin = cos[at], sin[at]  # [N, T, R] each
    for i, r in enumerate(rows):
        rr = r.rope_rows(pos0[i], T)
        if rr is not None:
            cos[i], sin[i] = rr
    return emb, (cos, sin)
