"""Single-sequence forwards on a `ModelCache` / `MtpScratch`: one target step over T tokens (`decode_step_t`) and
the NextN head over a queue of rows (`mtp_head_forward`). The batched round runs its forwards through
`engine.graphs` instead; these are the same math for one sequence (a session's prefill flush, tools, tests)."""
from __future__ import annotations

import torch

from .cache import ModelCache, MtpScratch
from .model.qwen35 import FwdCtx, Qwen35ForCausalLM

__all__ = ["MTP_CHUNK", "decode_step_t", "mtp_head_forward"]

MTP_CHUNK = 512  # mtp_head_forward: rows per head forward of a long queue


def decode_step_t(model: Qwen35ForCausalLM, tokens: list[int], pos0: int, cache: ModelCache,
                  record: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward over T tokens of one sequence at positions pos0.. (cache.length must equal pos0);
    advances the cache by T. Returns (fp32 logits [T, V] for every column, post-norm hidden [T, H], pre-norm
    hidden [T, H]). record=True keeps per-position GDN states (the caller must have called cache.snapshot()).
    The batched round uses `verify_step`; this is the same forward for a single `ModelCache`."""
    assert cache.length == pos0, (cache.length, pos0)
    cache.check_room(len(tokens))
    x = torch.tensor([tokens], device=model.lm_head.weight.device)
    pre = model.forward_hidden(x, pos0, cache, record=record)[0]  # [T, H]
    cache.length += len(tokens)
    # a recording forward is a step forward: its final norm and LM head run as the round's verify runs them
    step = FwdCtx.make(model.config, x.device, pre.dtype, [cache.slot], [pos0], [0], [0], len(tokens),
                       True) if record else None
    post = model.model.norm(pre, step)
    return model.logits(post, ctx=step), post, pre


def mtp_head_forward(model: Qwen35ForCausalLM, tokens: list[int], hidden: torch.Tensor, pos: int,
                     scratch: MtpScratch, chunk: int = MTP_CHUNK, embeds: torch.Tensor | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """NextN step(s) for one sequence: rows (token i+1, trunk/head hidden of row i) at positions pos.. write the
    head's K/V into `scratch`; returns (fp32 draft logits of the LAST row [V], head hidden of the last row
    [1, H]). Long queues (after a prefill) run in chunks of `chunk` rows and only the last row (the one whose draft
    is used) ever gets logits, so memory stays O(chunk * context + V). The batched round drafts in `_draft`.
    embeds [n, H], rope (cos, sin [n, R]): the rows' input embeddings and rotary rows when they are not the plain
    ones (a prompt with images, `SessionState.mtp_inputs`). logits=False: only the K/V is wanted (a flush), and
    the logits are None (no LM head: at a real vocabulary it costs about as much as the head's layer itself)."""
    hm = hidden[:0]
    dt = model.model.embed_tokens.weight.dtype
    for c0 in range(0, len(tokens), chunk):
        x = torch.tensor([tokens[c0:c0 + chunk]], device=hidden.device)
        c1 = c0 + x.shape[1]
        ctx = FwdCtx.make(model.config, hidden.device, dt, [scratch.slot], [pos + c0], [0], [0], x.shape[1], False,
                          rope=None if rope is None else (rope[0][None, c0:c1], rope[1][None, c0:c1]))
        hm = (model.mtp_forward(x, hidden[None, c0:c1], ctx, scratch.kv) if embeds is None else
              model.mtp_forward(x, hidden[None, c0:c1], ctx, scratch.kv, embeds[None, c0:c1]))[0]  # [t, H]
    last = hm[-1:]  # [1, H]
    return (model.logits(last[0]) if logits else None), last
