"""One request's decode state (`SessionState`) and the types it reports in: `SpecTelemetry`, `TokenLogprob`, and the
`SpecConstraint` hook it calls. The batched round (`engine.spec.spec_round`, with its draft and accept helpers in
`engine.draft`) reads and commits this state; the state never drives a round itself."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .cache import PREFILL_GRID, TAIL_MARGIN, ModelCache, MtpScratch, StatePool
from .encoder import encode_image
from .forward import mtp_head_forward
from .images import ImageInput, mrope_positions, mrope_table_rows
from .model.qwen35 import FwdCtx, Qwen35ForCausalLM, rope_table
from .sampling import PenaltyState, SpecSampling, probs_from_logits, sample

__all__ = ["SPEC_TELEM_POS", "DEFAULT_CAPMAX", "SpecTelemetry", "SpecConstraint", "TokenLogprob", "SessionState"]

SPEC_TELEM_POS = 8  # tracked draft positions (serve K defaults to 3; gates sweep K = 1..8)
DEFAULT_CAPMAX = 7
PROMPT_LOGPROB_ROWS = 64  # prompt logprobs: logit rows materialised at once ([64, V], never [prompt, V])


@dataclass
class SpecTelemetry:
    """Per-draft-position acceptance counters (vLLM / llama.cpp schema), updated once per verify round after
    grammar truncation. p-min-discarded draft tokens count in neither drafted nor accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_drafted: list[int] = field(default_factory=lambda: [0] * SPEC_TELEM_POS)
    pos_accepted: list[int] = field(default_factory=lambda: [0] * SPEC_TELEM_POS)
    k_rounds: int = 0  # rounds run, plain steps inside a speculative batch (k = 0) included
    k_sum: int = 0  # the k each of those rounds asked for, summed (mean_k = k_sum / k_rounds)

    def record_round(self, k_round: int, n_acc: int) -> None:
        """Count one verify round that drafted k_round tokens of which n_acc were accepted."""
        self.rounds += 1
        self.drafted += k_round
        self.accepted += n_acc
        for j in range(min(k_round, SPEC_TELEM_POS)):
            self.pos_drafted[j] += 1
        for j in range(min(n_acc, SPEC_TELEM_POS)):
            self.pos_accepted[j] += 1

    def delta_since(self, prev: "SpecTelemetry") -> "SpecTelemetry":
        """Fieldwise saturating self - prev (never negative)."""
        return SpecTelemetry(max(self.rounds - prev.rounds, 0), max(self.drafted - prev.drafted, 0),
                             max(self.accepted - prev.accepted, 0),
                             [a - b if a > b else 0 for a, b in zip(self.pos_drafted, prev.pos_drafted)],
                             [a - b if a > b else 0 for a, b in zip(self.pos_accepted, prev.pos_accepted)],
                             max(self.k_rounds - prev.k_rounds, 0), max(self.k_sum - prev.k_sum, 0))

    def merge(self, d: "SpecTelemetry") -> None:
        """Fieldwise += d."""
        self.rounds += d.rounds
        self.drafted += d.drafted
        self.accepted += d.accepted
        self.pos_drafted = [a + b for a, b in zip(self.pos_drafted, d.pos_drafted)]
        self.pos_accepted = [a + b for a, b in zip(self.pos_accepted, d.pos_accepted)]
        self.k_rounds += d.k_rounds
        self.k_sum += d.k_sum

    def copy(self) -> "SpecTelemetry":
        return SpecTelemetry(self.rounds, self.drafted, self.accepted, list(self.pos_drafted), list(self.pos_accepted),
                             self.k_rounds, self.k_sum)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """(accepted + rounds) / rounds: mean tokens emitted per verify round (bonus included)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def to_dict(self, k: int | None = None) -> dict:
        """JSON form; positions trimmed to k (default: the deepest position ever drafted)."""
        n = k if k is not None else max((j + 1 for j, c in enumerate(self.pos_drafted) if c), default=0)
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 6),
                "pos_drafted": self.pos_drafted[:n], "pos_accepted": self.pos_accepted[:n],
                "mean_k": round(self.k_sum / self.k_rounds, 4) if self.k_rounds else 0.0}


@runtime_checkable
class SpecConstraint(Protocol):
    """Grammar hook; the engine never imports a grammar library. Contract (verify-side truncation rule):
    accepted drafts are checked in order with `is_allowed` and `consume`d until the first illegal one (acceptance
    is truncated there); a cut or an illegal bonus is replaced by the masked argmax of the target's own column;
    every emitted token is `consume`d in order; plain steps choose from `mask_logits`. EOS handling is the
    implementor's job. Optional draft-side hooks: `draft_begin()`; `draft_allowed(tok) -> bool` (False stops the
    draft chain before that token; True consumes it provisionally); `draft_mask_logits(row)` (the drafter's
    logits masked by the state the drafts so far reach); `window_mask(n, device) -> bool [n, V]` (row j = tokens
    allowed after the first j drafts of the round; greedy acceptance then follows the masked argmax of each
    verify column, which is what constrained plain greedy picks, so the truncation rule never fires)."""

    def is_allowed(self, tok: int) -> bool: ...

    def mask_logits(self, row: torch.Tensor) -> torch.Tensor: ...

    def consume(self, tok: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of an emitted (or prompt) token under the target model's raw distribution, plus top
    alternatives; `rank` (1 = the most likely token) is filled for prompt tokens."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


class SessionState:
    """Per-request decode state: a slot of a state pool (trunk cache + MTP scratch), committed tokens,
    penalty history, generator, telemetry; its prefill, and the host side of a round (`commit_round`).

    It holds state and never drives a round: `engine.spec.SpecSession` (alone) and the scheduler do. k = 0 (or a
    model without MTP) is plain decode; `max_new_tokens` is never exceeded (the last rounds draft fewer tokens).

    images: the prompt's pictures in order (engine/images.py `ImageInput`); the prompt holds image k's n_tokens
    `<|image_pad|>` ids in one run (`expand_image_pads`). Their embeddings (`set_image_embedding`; alone, the session
    encodes them itself) replace the pads' embeddings in prefill, for the trunk and for the MTP head's input. The
    prompt's rotary positions are its M-RoPE positions (`mrope_positions`), every later token's its cache index +
    `rope_delta`; the KV / GDN index of a token stays its cache index. Without images nothing changes.
    """

    def __init__(self, model: Qwen35ForCausalLM, prompt_ids: list[int], max_new_tokens: int, *, k: int = 3,
                 sampling: SpecSampling = SpecSampling(), constraint: SpecConstraint | None = None,
                 eos_ids: list[int] | tuple[int, ...] | set[int] = (), p_min: float = 0.0,
                 capmax: int = DEFAULT_CAPMAX, logprobs: int | tuple[int, ...] | None = None, hidden_mode: str = "post",
                 max_len: int | None = None, stats_line: bool = False, pool: StatePool | None = None,
                 prompt_logprobs: int | None = None, images: Sequence[ImageInput] = ()):
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if k < 0 or k > capmax:
            raise ValueError(f"k must be in [0, capmax={capmax}], got {k}")
        if hidden_mode not in ("post", "pre"):
            raise ValueError("hidden_mode must be 'post' or 'pre'")
        cfg = model.config
        self.model, self.cfg = model, cfg
        # no MTP head -> plain; sampled + constrained -> plain (the truncation rule is a greedy-exactness rule)
        self.k = k if cfg.has_mtp and (constraint is None or sampling.greedy) else 0
        self.sampling, self.constraint = sampling, constraint
        #: the next round's draft count chosen by a scheduler's speculation controller (None: k); never above k
        self.k_next: int | None = None
        self.eos = set(eos_ids)
        self.p_min, self.capmax, self.hidden_mode = p_min, capmax, hidden_mode
        # emitted tokens' logprobs: None = off; n = with the n most likely alternatives; a tuple of token ids = with
        # those ids' logprobs instead (vLLM's logprob_token_ids)
        self.want_logprobs = logprobs
        # logprobs of each prompt token after the first (and `prompt_logprobs` alternatives), computed during
        # prefill only when asked; [None] + one entry per later prompt token
        self.want_prompt_logprobs = prompt_logprobs
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.stats_line = stats_line
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.device, self.dtype = model.lm_head.weight.device, cfg.dtype
        self.images: tuple[ImageInput, ...] = tuple(images)
        self.rope_delta = 0  # rotary position - cache index of every token after the prompt (images: < 0)
        self._mrope: torch.Tensor | None = None  # [3, prompt] long: the prompt's M-RoPE positions (images only)
        self.image_spans: list[tuple[int, int]] = []  # (first pad's index, pad count) of each image
        self._image_embeds: list[torch.Tensor | None] = []  # [n_tokens, H] each until the prompt is prefilled
        if self.images:
            self._init_images()
        need = len(prompt_ids) + max_new_tokens + capmax + 1
        self.max_len = max(max_len or 0, need)
        self.pool: StatePool | None = None
        self.slot: int | None = None
        self.cache: ModelCache = None  # type: ignore[assignment]  # set by attach()
        self.scratch: MtpScratch | None = None
        self.committed: list[int] = []  # tokens whose K/V + state are in the trunk cache
        self.pending: int | None = None  # last emitted token, not yet in the trunk cache
        self.emitted: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.telem = SpecTelemetry()
        self.full_accept = 0
        self.len_hist = [0] * (capmax + 1)  # rounds by drafted length
        self.acc_hist = [0] * (capmax + 1)  # rounds by accepted length
        self.constraint_cuts = 0  # rounds where the constraint truncated acceptance
        self.finished = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None  # set when the scheduler failed this session
        self._pen = PenaltyState(self.prompt_ids, cfg.vocab_size, self.device, sampling, self.eos)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        # MTP rows waiting to be written: row i = (token i+1, carrier hidden h_i), rows scratch.length..
        self._mtp_tokens: list[int] = []
        self._mtp_parts: list[torch.Tensor] = []  # their carriers [n_i, H], concatenated when read (`_mtp_hidden`)
        self.prefill_tokens = 0  # tokens run through prefill (multi-turn reuse prefills only the new suffix)
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache instead of prefilled
        self.last_pre: torch.Tensor | None = None  # [H] pre-norm hidden of the last position prefilled
        self.round_pre: torch.Tensor | None = None  # [T, H] the last round's pre-norm verify hiddens
        self._to_prefill: list[int] = []  # ids not yet prefilled (their first `_prefilled` are done)
        self._prefilled = 0
        #: the block holding the prompt's tail boundary stops there first (`block_len`; the scheduler sets it where
        #: the prefix cache keeps the state there and splitting a block leaves its bits alone:
        #: `engine.prefill.steps_match_prefill`)
        self.tail_cut = False
        self._constraint_consumed = 0  # drafts already consumed by the constraint walk of this round
        self._window = 0  # drafts the constraint consumed while drafting this round (for its window masks)
        self._last_row: tuple | None = None  # the prompt's last row (pre, post [1, H], its forward's ctx)
        self._closed = False
        if pool is None:  # alone: a private one-slot pool sized for this request
            pool = StatePool(cfg, 1, self.max_len, self.k + 1, self.device, self.dtype, mtp=self.k > 0)
        if self.k + 1 > pool.window:
            raise ValueError(f"k={self.k} needs {self.k + 1} GDN state slots; the pool has {pool.window}")
        self.attach(pool, pool.alloc())
        self.begin_prefill(self.prompt_ids)

    # ------------------------------------------------------------------ images
    def _init_images(self) -> None:
        """Check the images against the model and the prompt; the prompt's M-RoPE positions and rope delta."""
        icfg, tower = self.model.image_config, self.model.vision
        if tower is None or icfg is None:
            raise ValueError("this model has no vision tower (a text-only checkpoint, or loaded language-model-only): "
                             "it cannot take images")
        self._mrope, self.rope_delta = mrope_positions(self.prompt_ids, [i.grid_thw for i in self.images], icfg)
        pad, i, n = icfg.image_token_id, 0, len(self.prompt_ids)
        for inp in self.images:  # mrope_positions checked the runs: image k's pads are the k-th run
            while self.prompt_ids[i] != pad:
                i += 1
            j = i
            while j < n and self.prompt_ids[j] == pad:
                j += 1
            if j - i != inp.n_tokens:
                raise ValueError(f"image {len(self.image_spans)} has {inp.n_tokens} tokens but its prompt run has "
                                 f"{j - i} image pads")
            self.image_spans.append((i, j - i))
            i = j
        self._image_embeds = [None] * len(self.images)

    @property
    def image_keys(self) -> list[tuple[int, int, str]]:
        """(first pad's index, pad count, content hash) of each image: what the prefix cache's block keys add to
        the token ids (engine/cache.py `block_keys`). Empty for a text-only session."""
        return [(a, n, inp.hash) for (a, n), inp in zip(self.image_spans, self.images)]

    def images_missing(self) -> list[int]:
        """Images whose embeddings the rest of the prefill needs and the session does not hold yet: those with pads
        at or past the cache's length (a prefix restored from the cache needs none of its own images)."""
        if not self.prefilling:
            return []
        L = self.cache.length
        return [k for k, (a, n) in enumerate(self.image_spans) if a + n > L and self._image_embeds[k] is None]

    def set_image_embedding(self, k: int, emb: torch.Tensor) -> None:
        """Image k's embeddings [n_tokens, H] (the tower's output; the scheduler's encoder cache or `encode_images`)."""
        if tuple(emb.shape) != (self.image_spans[k][1], self.cfg.hidden_size):
            raise ValueError(f"image {k}: embeddings {tuple(emb.shape)}, want ({self.image_spans[k][1]}, "
                             f"{self.cfg.hidden_size})")
        self._image_embeds[k] = emb.to(device=self.device, dtype=self.dtype)

    def encode_images(self) -> None:
        """Alone: encode the images the prefill still needs with the model's tower (no cache)."""
        for k in self.images_missing():
            self.set_image_embedding(k, encode_image(self.model.vision, self.model.image_config, self.images[k],
                                                     self.dtype))

    def input_embeds(self, start: int, ids: list[int]) -> torch.Tensor | None:
        """The input embeddings [len(ids), H] of the prompt tokens ids = prompt[start:start + len(ids)]: the token
        embeddings with every image pad's row replaced by its image's embedding row; None for a session without
        images or a span that holds no pad (then the embedding is the plain lookup). RuntimeError when an image it
        needs is not encoded yet."""
        end = start + len(ids)
        hit = [(k, a, n) for k, (a, n) in enumerate(self.image_spans) if a < end and a + n > start]
        if not hit:
            return None
        x = self.model.model.embed_tokens(torch.tensor(ids, device=self.device))  # [T, H]
        for k, a, n in hit:
            emb = self._image_embeds[k]
            if emb is None:
                raise RuntimeError(f"image {k} is not encoded yet")
            lo, hi = max(a, start), min(a + n, end)
            x[lo - start:hi - start] = emb[lo - a:hi - a]
        return x

    def rope_rows(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [T, R] of the tokens at cache indices start..start+T-1: the prompt's M-RoPE positions inside
        the prompt, index + rope_delta after it; None for a session without images (its rows are the table's)."""
        if self._mrope is None:
            return None
        idx = torch.arange(start, start + T)
        pos = (idx + self.rope_delta).expand(3, -1).clone()  # [3, T]
        inside = idx < self._mrope.shape[1]
        pos[:, inside] = self._mrope[:, idx[inside]]
        tab = rope_table(self.cfg, int(pos.max()) + 1, self.device, self.dtype)
        return mrope_table_rows(tab, pos.to(self.device), self.model.image_config.mrope_section)

    # ------------------------------------------------------------------ public
    @property
    def started(self) -> bool:
        """The first token was emitted."""
        return bool(self.emitted) or self.pending is not None

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still waiting for prefill."""
        return self._prefilled < len(self._to_prefill)

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still waiting for prefill."""
        return len(self._to_prefill) - self._prefilled

    def attach(self, pool: StatePool, slot: int) -> None:
        """Bind this session to `slot` of `pool` (empty state)."""
        self.pool, self.slot = pool, slot
        self.cache = ModelCache(self.cfg, min(self.max_len, pool.capacity), pool=pool, slot=slot)
        self.cache.reset()
        self.scratch = MtpScratch(self.cfg, pool.capacity, pool=pool, slot=slot) if self.k > 0 else None

    def close(self) -> None:
        """Give the pool slot back (idempotent). The session cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        self.finished = True
        self.finish_reason = self.finish_reason or "abort"
        if self.pool is not None and self.slot is not None:
            self.pool.free(self.slot)
        self._mtp_hidden = None

    def continue_turn(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Multi-turn reuse: `prompt_ids` must start with this session's whole sequence (prompt + emitted);
        only the new suffix is prefilled. The session then generates up to max_new_tokens more tokens."""
        if self._closed or not self.started:
            raise RuntimeError("continue_turn needs a started, open session")
        if self.constraint is not None:
            raise ValueError("continue_turn is not supported with a constraint")
        seq = self.committed + [self.pending]
        if len(prompt_ids) <= len(seq) or prompt_ids[:len(seq)] != seq:
            raise ValueError("new prompt does not extend the committed sequence")
        if len(prompt_ids) + max_new_tokens + self.capmax + 1 > self.cache.max_len:
            raise ValueError("continued turn does not fit in the session's max_len")
        suffix = prompt_ids[len(self.committed):]
        self.prompt_ids = list(prompt_ids)
        self._pen = PenaltyState(self.prompt_ids, self.cfg.vocab_size, self.device, self.sampling, self.eos)
        self.emitted, self.logprobs = [], []
        self.pending = None
        self.max_new_tokens = max_new_tokens
        self.finished, self.finish_reason = False, None
        self.begin_prefill(suffix)
        while self.prefilling:  # alone: prefill now (the first token of the new turn is emitted)
            self.prefill_chunk()

    def resume(self, n: int, pre_last: torch.Tensor) -> None:
        """Start from a restored prefix (the prefix cache): the state of the first n prompt tokens is already in
        this session's slot (K/V rows 0..n-1, the GDN state at n in the live window slot, MTP rows 0..n-2), and
        `pre_last` [H] is position n-1's pre-norm hidden (the carrier of MTP row n-1). Only the rest of the prompt
        prefills; n < the prompt's length. A session that prefilled nothing itself may resume again, further."""
        if self.cache.length != self.cached_tokens or self.prefill_tokens or self.started \
                or not self.cache.length < n < len(self._to_prefill):
            raise ValueError(f"cannot resume a session at {n} of {len(self._to_prefill)} prompt tokens")
        self.cache.length = self._prefilled = self.cached_tokens = n
        self._mtp_tokens, self._mtp_hidden = [], None  # an earlier resume's row n'-1, superseded
        self.committed = self._to_prefill[:n]
        self.last_pre = pre_last
        if self.k > 0:
            assert self.scratch is not None
            self.scratch.set_len(n - 1)
            self._queue_mtp_rows([self._to_prefill[n]], self._boundary_carrier(pre_last))  # row n-1: (token n, h_{n-1})

    def begin_prefill(self, ids: list[int]) -> None:
        """Queue `ids` (a prompt, or a later turn's suffix) for prefill."""
        self._to_prefill, self._prefilled = list(ids), 0

    @torch.inference_mode()
    def prefill_chunk(self) -> int:
        """Prefill the next grid block of the queued prompt (`next_chunk`) in one trunk forward; the MTP head takes
        the block's rows right away, except its last row, which waits for the next block's forward (`mtp_ready`), or
        for the first token after the prompt's last block. The last block also chooses and emits the first token.
        Returns the number of tokens prefilled."""
        ids = self.next_chunk()
        cache = self.cache
        self.encode_images()
        x = torch.tensor([ids], device=self.device)
        rope = self.rope_rows(cache.length, len(ids))
        emb = self.input_embeds(cache.length, ids)
        ctx = FwdCtx.make(self.cfg, self.device, self.dtype, [self.slot], [cache.length], [cache.cur], [cache.cur],
                          len(ids), False, rope=None if rope is None else (rope[0][None], rope[1][None]))
        pre = self.model.forward_step(x, ctx, self.pool) if emb is None else \
            self.model.forward_step(x, ctx, self.pool, emb[None])  # [1, t, H]
        self.prefilled(ids, pre[0], ctx)  # [t, H]
        return len(ids)

    def block_len(self, pos: int, left: int) -> int:
        """Tokens of the prompt block that starts at position pos with `left` tokens still queued: up to the next
        multiple of PREFILL_GRID (absolute positions) or the prompt's end; with `tail_cut`, the block that holds the
        position TAIL_MARGIN tokens before the prompt's end stops first there (the rest of it is a block of its
        own)."""
        c = min(left, PREFILL_GRID - pos % PREFILL_GRID)
        if self.tail_cut:
            cut = pos + left - TAIL_MARGIN
            if pos < cut < pos + c:
                c = cut - pos
        return c

    def next_chunk(self) -> list[int]:
        """The next grid block of the queued prompt (`block_len`): its tokens from the cache's length up to the next
        multiple of PREFILL_GRID (absolute positions) or the prompt's end. Blocks never split elsewhere, whatever the
        budget, the batch or K, so a prompt's prefill math is the same alone and under load. Raises if they do not
        fit in the cache."""
        n = self.block_len(self.cache.length, self.prefill_left)
        ids = self._to_prefill[self._prefilled:self._prefilled + n]
        self.cache.check_room(len(ids))
        return ids

    def next_chunks(self, n: int) -> list[list[int]]:
        """The next n grid blocks of the queued prompt (fewer where it ends first), each as `next_chunk` cuts it, to
        prefill in one forward as one row (the kernel path). Raises if they do not fit in the cache."""
        out: list[list[int]] = []
        pos, at = self.cache.length, self._prefilled
        while len(out) < n and at < len(self._to_prefill):
            ids = self._to_prefill[at:at + self.block_len(pos, len(self._to_prefill) - at)]
            out.append(ids)
            pos, at = pos + len(ids), at + len(ids)
        self.cache.check_room(pos - self.cache.length)
        return out

    def chunks_len(self, n: int) -> int:
        """Tokens `next_chunks(n)` would take (0 when nothing is queued)."""
        pos, left = self.cache.length, self.prefill_left
        for _ in range(n):
            c = self.block_len(pos, left)
            pos, left = pos + c, left - c
        return pos - self.cache.length

    @property
    def next_chunk_len(self) -> int:
        """Tokens `next_chunk` would take (0 when nothing is queued)."""
        return self.block_len(self.cache.length, self.prefill_left)

    def prefilled(self, ids: list[int], pre: torch.Tensor, ctx: FwdCtx, flush_mtp: bool = True) -> None:
        """Host side of a prefill block: `ids` (from `next_chunk`) went through the trunk at cache.length.. in the
        forward `ctx`, `pre` [t, H] their pre-norm hiddens. Advances the cache, feeds the MTP head, and after the
        prompt's last block chooses and emits the first token. flush_mtp=False (a batched prefill): the block's MTP
        rows stay queued and the first token waits; the caller writes every row's queue in one head forward
        (`engine.prefill.flush_mtp_rows`), then calls `choose_first`."""
        model, cache = self.model, self.cache
        cache.length += len(ids)
        self._prefilled += len(ids)
        self.prefill_tokens += len(ids)
        self.committed += ids
        post = model.model.norm(pre, ctx)  # row by row on the CPU kernels, as a step forward's final norm
        self.last_pre = pre[-1].clone()
        done = not self.prefilling
        if self.want_prompt_logprobs is not None:
            self._prompt_logprobs(post, self._prefilled - len(ids), ctx)
        if self.k > 0:
            nxt = self._to_prefill[self._prefilled - len(ids) + 1:self._prefilled + 1]  # token i+1 of each row
            carrier = post if self.hidden_mode == "post" else pre
            if done:
                self._queue_mtp_rows(nxt, carrier[:len(nxt)])
            else:  # the block's last row waits for the next block's forward (`mtp_ready`), its carrier made as a
                # resume at this boundary makes it
                self._queue_mtp_rows(nxt, torch.cat([carrier[:len(nxt) - 1], self._boundary_carrier(pre[-1])]))
            if flush_mtp:
                self._flush_mtp()
        if done:
            self._last_row = (pre[-1:], post[-1:], ctx)  # [1, H] each: the prompt's last row
            if flush_mtp:
                self.choose_first()

    def choose_first(self) -> None:
        """After the prompt's last chunk and its MTP rows: choose, emit and queue the first token (else a no-op)."""
        if self._last_row is None:
            return
        pre, post, ctx = self._last_row
        self._last_row = None
        self._image_embeds = [None] * len(self.images)  # the prompt and its MTP rows are written: images done
        logits = self.model.logits(post[0], ctx=ctx)  # only the row that is used
        first = self._choose(logits)
        if self.k > 0:
            self._queue_mtp_rows([first], post if self.hidden_mode == "post" else pre)
        self._emit([first], logits[None])

    def _prompt_logprobs(self, post: torch.Tensor, start: int, ctx: FwdCtx) -> None:
        """Logprobs of the prompt tokens that the chunk's rows `post` [t, H] (prompt positions start..) predict,
        PROMPT_LOGPROB_ROWS rows at a time (only when asked: the default prefill computes one row's logits)."""
        ids, n_top = self._to_prefill, self.want_prompt_logprobs or 0
        if start == 0:
            self.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        rows = min(post.shape[0], len(ids) - 1 - start)  # the prompt's last row predicts the first output token
        for a in range(0, rows, PROMPT_LOGPROB_ROWS):
            b = min(rows, a + PROMPT_LOGPROB_ROWS)
            lp = torch.log_softmax(self.model.logits(post[a:b], ctx=ctx).float(), dim=-1)  # [n, V]
            nxt = torch.tensor(ids[start + a + 1:start + b + 1], device=lp.device)
            chosen = lp.gather(-1, nxt[:, None])  # [n, 1]
            rank = (lp > chosen).sum(-1) + 1  # [n]
            top_v, top_i = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)  # [n, n_top]
            for t, c, r, iv, vv in zip(nxt.tolist(), chosen[:, 0].tolist(), rank.tolist(), top_i.tolist(),
                                       top_v.tolist()):
                self.prompt_logprobs.append(TokenLogprob(t, c, list(zip(iv, vv)), r))

    def k_round(self) -> int:
        """Draft tokens this session wants in the next round (0 = a plain step): k (or the controller's `k_next`,
        never above k), fewer near max_new_tokens."""
        k = self.k if self.k_next is None else min(self.k, self.k_next)
        return max(0, min(k, self.max_new_tokens - len(self.emitted) - 1))

    def commit_round(self, drafted: int, n_acc: int, toks: list[int], logits: torch.Tensor,
                     carrier: torch.Tensor, pre: torch.Tensor | None = None) -> None:
        """Host side of one round for this row: `toks` = accepted drafts + the bonus (n_acc + 1 tokens) as decided
        on the device, `logits` [T, V] its verify logits, `carrier` [T, H] the hiddens the MTP head pairs with,
        `pre` [T, H] the pre-norm hiddens (kept as `round_pre` until the next round: the prefix cache's carrier of a
        grid boundary the commit crosses). Applies the constraint's truncation rule and EOS, commits, rolls back
        (O(1)), emits."""
        self.round_pre = pre
        drafts, bonus = toks[:n_acc], toks[n_acc]
        if self.constraint is not None and drafted == 0:  # a plain step: the masked choice, as plain decode does
            bonus = self._choose(logits[0])
        elif self.constraint is not None:
            n_acc, bonus = self._apply_constraint(logits, drafts, n_acc, bonus)
        out = drafts[:n_acc] + [bonus]
        eos_at = next((i for i, t in enumerate(out) if t in self.eos), None)
        if eos_at is not None and eos_at < n_acc:  # EOS among accepted drafts: nothing after it is emitted
            n_acc = eos_at + 1
            out = drafts[:n_acc]
        n = self.cache.length
        # keep [last] + out[:-1]; the GDN state after the last kept token sits in window slot len(out) - 1
        self.cache.keep(n + len(out), len(out) - 1)
        self.committed += [self.pending] + out[:-1]
        if self.k > 0:
            # rows n.. = (out[j], h_{n+j}) (every row of the round's carrier: no view to make)
            self._queue_mtp_rows(out, carrier if len(out) == len(carrier) else carrier[: len(out)])
        if drafted > 0:
            self.telem.record_round(drafted, n_acc)
            self.len_hist[drafted] += 1
            self.acc_hist[n_acc] += 1
            self.full_accept += int(n_acc == drafted)
        self._emit(out, logits[: len(out)])

    def fail(self, err: BaseException) -> None:
        """Mark the session failed (its request gets an error); the scheduler then frees its slot."""
        self.error = err
        self.finished = True
        self.finish_reason = "error"

    @property
    def drafts_on_host(self) -> bool:
        """Whether the round asks `host_draft` about each of this row's drafts (a constraint with `draft_allowed`)."""
        return self.constraint is not None and hasattr(self.constraint, "draft_allowed")

    def host_draft(self, pos: int, j: int, d: int) -> int | None:
        """The host's decision on draft j of this round (token d, at sequence position pos), asked only when
        `drafts_on_host`: the token to draft, or None to end the chain before it. Here the constraint's
        `draft_allowed` decides (True consumes d provisionally)."""
        assert self.constraint is not None
        if self.constraint.draft_allowed(d):
            self._window += 1
            return d
        return None

    def stats_text(self) -> str:
        """The `[spec-stats]` line: rounds, full accepts, draft-length histogram, per-slot rates, total."""
        t = self.telem
        n = max((j + 1 for j, c in enumerate(t.pos_drafted) if c), default=0)
        slots = " ".join(f"{a}/{d}={a / d:.3f}" for a, d in zip(t.pos_accepted[:n], t.pos_drafted[:n]) if d)
        return (f"[spec-stats] rounds={t.rounds} full_accept={self.full_accept} len_hist={self.len_hist[:self.k + 1]} "
                f"per_slot=[{slots}] total={t.accepted}/{t.drafted}={t.acceptance_rate:.3f} "
                f"tok_per_round={t.tokens_per_round:.3f}")

    # ------------------------------------------------------------------ internals
    def _choose(self, logits: torch.Tensor) -> int:
        """Plain-decode choice for one fp32 logit row (penalties, constraint mask, greedy or sampled)."""
        row = self._pen.apply(logits, self.sampling, n_out=len(self.emitted))
        if self.constraint is not None:
            row = self.constraint.mask_logits(row)
        if self.sampling.greedy:
            return int(torch.argmax(row).item())
        return int(sample(probs_from_logits(row, self.sampling), self._gen).item())

    @property
    def mtp_ready(self) -> int:
        """Queued MTP rows that a prefill flush writes now: all of them, except while the prompt still prefills, when
        the last one (the row of the grid boundary the last block ended on) waits for the next block's forward.
        So each prompt block's head forward covers rows bG-1 .. (b+1)G-2, exactly a prefix-cache block's MTP rows,
        and a session resumed at a boundary runs the forwards a miss runs (the same rows, positions and shapes:
        the same bits on every path, the torch path's shape-dependent rounding included)."""
        return len(self._mtp_tokens) - (1 if self.prefilling and self._mtp_tokens else 0)

    def _boundary_carrier(self, pre: torch.Tensor) -> torch.Tensor:
        """The MTP carrier [1, H] of the last row of a grid block from its pre-norm hidden [H], computed alone (one
        row), as a miss and a prefix-cache resume at that boundary both compute it."""
        if self.hidden_mode == "pre":
            return pre[None]
        n = self.cache.length
        ctx = FwdCtx.make(self.cfg, self.device, self.dtype, [self.slot], [n - 1], [0], [0], 1, False)
        return self.model.model.norm(pre[None], ctx)

    @property
    def _mtp_hidden(self) -> torch.Tensor | None:
        """The queued MTP rows' carriers [n, H] (None: no queue). Queued a piece at a time (a plain row queues one a
        round), concatenated once, when read."""
        parts = self._mtp_parts
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0] if parts else None

    @_mtp_hidden.setter
    def _mtp_hidden(self, hidden: torch.Tensor | None) -> None:
        self._mtp_parts = [] if hidden is None else [hidden]

    def _queue_mtp_rows(self, tokens: list[int], hidden: torch.Tensor) -> None:
        self._mtp_tokens += tokens  # in place: a plain row queues one a round, for as long as it runs
        self._mtp_parts.append(hidden)

    def _flush_mtp(self, n: int | None = None) -> None:
        """Write the first n queued MTP rows (default: those that are ready, `mtp_ready`) into the scratch (prefill:
        their next tokens are prompt tokens, so final)."""
        n = self.mtp_ready if n is None else n
        if n == 0:
            return
        sc = self.scratch
        assert sc is not None and self._mtp_hidden is not None
        emb, rope = self.mtp_inputs(sc.length, self._mtp_tokens[:n])
        mtp_head_forward(self.model, self._mtp_tokens[:n], self._mtp_hidden[:n], sc.length, sc, embeds=emb,
                         rope=rope, logits=False)
        sc.set_len(sc.length + n)
        self._mtp_tokens, self._mtp_hidden = self._mtp_tokens[n:], self._mtp_hidden[n:]

    def mtp_inputs(self, pos: int, tokens: list[int]) -> tuple[torch.Tensor | None,
                                                               tuple[torch.Tensor, torch.Tensor] | None]:
        """MTP rows at scratch positions pos.. (row i pairs token i+1 with the trunk's hidden at i): their input
        embeddings [n, H] (image rows for pads; None: the plain lookup) and their rotary rows (the trunk's at
        i; None: the table's), for a session with images."""
        if not self.images:
            return None, None
        return self.input_embeds(pos + 1, tokens), self.rope_rows(pos, len(tokens))

    def _apply_constraint(self, logits: torch.Tensor, drafts: list[int], n_acc: int, bonus: int) -> tuple[int, int]:
        """Verify-side truncation rule; consumes the accepted drafts (the bonus is consumed in `_emit`)."""
        cons = self.constraint
        assert cons is not None
        cut = False
        for j in range(n_acc):
            if not cons.is_allowed(drafts[j]):
                n_acc, cut = j, True
                self.constraint_cuts += 1
                break
            cons.consume(drafts[j])
        if cut or not cons.is_allowed(bonus):
            extra = torch.tensor(drafts[:n_acc] or [-1], device=self.device)
            masked = cons.mask_logits(self._pen.apply(logits[n_acc], self.sampling, extra,
                                                      n_out=len(self.emitted) + n_acc))
            if self.sampling.greedy:
                bonus = int(torch.argmax(masked).item())
            else:
                bonus = int(sample(probs_from_logits(masked, self.sampling), self._gen).item())
        self._constraint_consumed = n_acc
        return n_acc, bonus

    def _emit(self, toks: list[int], rows: torch.Tensor) -> None:
        """Append emitted tokens (the last one becomes pending), feed penalties/constraint, check stops.
        `rows` [len(toks), V]: the raw target logits each token was chosen from (for logprobs)."""
        cons = self.constraint
        pre_consumed, self._constraint_consumed = self._constraint_consumed, 0
        n = len(toks)
        for i, t in enumerate(toks):
            if cons is not None and i >= pre_consumed:
                cons.consume(t)
            if t in self.eos:
                n = i + 1
                break
        toks = toks[:n]
        self.emitted += toks
        if self.sampling.has_penalties:
            self._pen.push(toks)
        if self.want_logprobs is not None:
            lp = torch.log_softmax(rows[:n].float(), dim=-1)  # [n, V]
            chosen = lp.gather(-1, torch.tensor(toks, device=lp.device)[:, None])[:, 0].tolist()
            if isinstance(self.want_logprobs, tuple):  # the listed ids
                top_i = torch.tensor(self.want_logprobs, device=lp.device).expand(n, -1)  # [n, m]
                top_v = lp.gather(-1, top_i)  # [n, m]
            else:
                top_v, top_i = (torch.topk(lp, min(self.want_logprobs, lp.shape[-1]), dim=-1)
                                if self.want_logprobs > 0 else (lp[:, :0], lp[:, :0].long()))
            for t, c, iv, vv in zip(toks, chosen, top_i.tolist(), top_v.tolist()):
                self.logprobs.append(TokenLogprob(t, c, list(zip(iv, vv))))
        self.pending = self.emitted[-1]
        if toks[-1] in self.eos:
            self._finish("stop")
        elif len(self.emitted) >= self.max_new_tokens:
            self._finish("length")

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        if self.stats_line and self.k > 0:
            print(self.stats_text(), file=sys.stderr)


def _queued_mtp_rows(rows: list[SessionState], n: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     list[int]]:
    """The first n[a] queued MTP rows of each row a (default: its whole queue), right-padded to the longest: tokens
    [A, Tm] long (padding 0), carrier hiddens [A, Tm, H] (padding zeros), and n."""
    n = [len(r._mtp_tokens) for r in rows] if n is None else n
    Tm, r0 = max(n), rows[0]
    toks = torch.tensor([r._mtp_tokens[:k] + [0] * (Tm - k) for r, k in zip(rows, n)], device=r0.device)  # [A, Tm]
    if min(n) == Tm and all(r._mtp_hidden.shape[0] == Tm for r in rows):
        return toks, torch.stack([r._mtp_hidden for r in rows]), n
    hid = torch.zeros(len(rows), Tm, r0._mtp_hidden.shape[-1], dtype=r0.dtype, device=r0.device)
    for a, r in enumerate(rows):
        hid[a, :n[a]] = r._mtp_hidden[:n[a]]
    return toks, hid, n
