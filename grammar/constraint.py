"""`GuidanceConstraint`: the engine's SpecConstraint over one llguidance matcher, exact under speculation.

Engine contract (`SpecConstraint`, engine/session.py): every emitted token is `consume`d in order; plain steps
choose from `mask_logits(row)`; a verify round first drafts (`draft_begin`, then `draft_allowed(d)` per draft, False
stops the chain), then walks the accepted drafts with `is_allowed`/`consume` from the committed state and
masks the bonus column when it is illegal.

One truth: a token is allowed iff its bit is set in llguidance's token mask for the state. (The mask is
stricter than `LLMatcher.validate_tokens`: where the grammar forces bytes it allows only the canonical
token, e.g. `{"` but not `{` at the start of a JSON object. Using the mask everywhere keeps constrained spec
equal to constrained plain greedy, which chooses by the mask.) Each state's mask is computed at most once.

Draft-side masking: `draft_allowed` checks a draft against the mask of the state reached by the drafts
before it and, when legal, consumes it (so the next draft is checked in the right state) and records it with
that mask. The next non-draft call settles lazily: the verify walk re-`consume`s accepted drafts in order,
which only advances a cursor over the records (no matcher work); the first call that departs from them
(`mask_logits`, a different token) rolls the matcher back over the unaccepted tail and reuses the recorded
mask of the state it lands in. A draft the grammar forbids is therefore never verified, and a round costs at
most K+1 mask computations.

Phases: with `reasoning=True` the output starts inside `<think>`: everything is allowed until the `</think>`
token is consumed (drafted or not); then up to SEPARATOR_MAX newline-only tokens the grammar does not take
are allowed (the template's `</think>\\n\\n`), then the grammar. EOS is allowed only where the grammar
accepts; once the grammar is complete (no continuation) only EOS is allowed, so the choice ends "stop".
After EOS only EOS stays allowed (harmless under ignore_eos).

Engine hooks (engine/draft.py calls both inside the batched round when the constraint has them):
- verify-mask: `window_mask(n, device)` masks the verify columns (K+1 bitmasks, as vLLM does), so greedy
  acceptance follows each column's masked argmax, which is what constrained plain greedy picks after the same
  prefix (penalties leave -inf entries at -inf); `_apply_constraint` then never cuts. It reuses the masks
  computed while drafting: one extra mask per round.
- draft-mask: `draft_mask_logits(row)` masks the drafter's logits by the state the drafts so far reach, so a
  trained drafter's legal runner-up is proposed instead of ending the chain. Drafts never affect exactness.
bench/grammar_mask.py measures both (they pay only together).
"""
from __future__ import annotations

import llguidance.numpy as llg_np
import numpy as np
import torch

from .compiled import CompiledGrammar

SEPARATOR_MAX = 2  # newline-only tokens allowed between </think> and the grammar's first token

_THINK, _SEP, _GRAMMAR, _ENDED = range(4)
_FREE, _TO_SEP, _EOS, _MATCH, _NEWLINE = range(5)  # how an allowed token is taken


class ConstraintError(RuntimeError):
    """The engine consumed a token the grammar forbids, or llguidance failed; the request cannot continue."""


class GuidanceConstraint:
    """SpecConstraint for one request/choice (not thread-safe: the worker thread owns it). Build it from a
    CompiledGrammar (`GrammarCompiler.constraint`); the grammar's matcher is deep-copied, never advanced."""

    def __init__(self, grammar: CompiledGrammar, *, reasoning: bool = False) -> None:
        tok = grammar.tokenizer
        if reasoning and tok.think_end_id is None:
            raise ValueError("reasoning=True needs a </think> token in the vocabulary")
        self.grammar, self.reasoning = grammar, reasoning  # what an engine process rebuilds it from
        self._m = grammar.matcher.deep_copy()
        self._eos, self._think, self._newlines, self._n_vocab = tok.eos_ids, tok.think_end_id, tok.newline_ids, tok.n_vocab
        self._words = (self._n_vocab + 31) // 32
        self._st: tuple[int, int] = (_THINK if reasoning else _GRAMMAR, 0)  # (phase, separator tokens used)
        self._gbits: np.ndarray | None = None  # llguidance mask of the current state (uint32 [W]), lazily
        # drafts: (token, state before, grammar mask before or None, fed to the matcher)
        self._drafts: list[tuple[int, tuple[int, int], np.ndarray | None, bool]] = []
        self._cursor = 0  # drafts[:cursor] were re-consumed by the verify walk (committed)
        self._drafting = False
        self._fill = llg_np.allocate_token_bitmask(1, self._n_vocab)  # int32 [1, W] scratch for llguidance
        self._shifts: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ masks
    def _grammar_bits(self) -> np.ndarray:
        """The matcher's token mask in the current state (cached until the state changes)."""
        if self._gbits is None:
            if self._st[0] == _ENDED:
                bits = np.zeros(self._words, dtype=np.uint32)
                for t in self._eos:
                    bits[t >> 5] |= np.uint32(1 << (t & 31))
            else:
                llg_np.fill_next_token_bitmask(self._m, self._fill, 0)
                if self._m.is_error():
                    raise ConstraintError(f"llguidance mask failed: {self._m.get_error()}")
                bits = self._fill[0].view(np.uint32).copy()
                self._fix_special_bits(bits)
            self._gbits = bits
        return self._gbits

    def _fix_special_bits(self, bits: np.ndarray) -> None:
        """Where a grammar forces the TEXT of an added token (a regex or schema spelling `<tool_call>`), llguidance's
        mask offers the added token itself (it tokenizes the forced bytes with the added tokens), but the matcher
        then refuses it: added tokens are special to llguidance. Clear such bits and allow, instead, the ordinary
        tokens that start the forced bytes and that the matcher takes. Costs one bit test per added token."""
        tok = self.grammar.tokenizer
        bad = [t for t in tok.special_ids if self._bit(bits, t) and self._m.validate_tokens([t]) != 1]
        if not bad:
            return
        for t in bad:
            bits[t >> 5] &= ~np.uint32(1 << (t & 31))
        for t in tok.plain_prefix_tokens(bytes(self._m.compute_ff_bytes())):
            if self._m.validate_tokens([t]) == 1:
                bits[t >> 5] |= np.uint32(1 << (t & 31))

    @staticmethod
    def _bit(bits: np.ndarray, tok: int) -> bool:
        return 0 <= tok < bits.shape[0] * 32 and bool((int(bits[tok >> 5]) >> (tok & 31)) & 1)

    def _route(self, tok: int) -> int | None:
        """How `tok` would be taken in the current (possibly drafted) state; None when it is not allowed."""
        phase, sep = self._st
        if phase == _THINK:
            return _TO_SEP if tok == self._think else (_EOS if tok in self._eos else _FREE)
        if tok >= self._n_vocab or tok < 0:
            return None
        if self._bit(self._grammar_bits(), tok):
            return _EOS if tok in self._eos else _MATCH
        if phase == _SEP and sep < SEPARATOR_MAX and tok in self._newlines:
            return _NEWLINE
        return None

    def _apply(self, tok: int, route: int) -> bool:
        """Take an allowed token; returns whether it was fed to the matcher."""
        fed = route == _MATCH
        if fed:
            if not self._m.consume_token(tok):
                raise ConstraintError(f"llguidance refused token {tok}: {self._m.get_error()}")
            self._st = (_GRAMMAR, 0)
            self._gbits = None
        elif route == _TO_SEP:
            self._st = (_SEP, 0)
        elif route == _EOS:
            self._st = (_ENDED, 0)
            self._gbits = None
        elif route == _NEWLINE:
            self._st = (_SEP, self._st[1] + 1)  # the grammar's own mask is unchanged
        return fed

    def _settle(self) -> None:
        """Leave drafting: roll the matcher back over drafts not re-consumed by the verify walk."""
        self._drafting = False
        c = self._cursor
        if c < len(self._drafts):
            n = sum(fed for _, _, _, fed in self._drafts[c:])
            if n and not self._m.rollback(n):
                raise ConstraintError(f"llguidance rollback of {n} tokens failed: {self._m.get_error()}")
            _, self._st, self._gbits, _ = self._drafts[c]
        self._drafts.clear()
        self._cursor = 0

    def _next_draft_is(self, tok: int) -> bool:
        self._drafting = False
        if self._cursor < len(self._drafts):
            if self._drafts[self._cursor][0] == tok:
                return True
            self._settle()
        return False

    # ------------------------------------------------------------------ SpecConstraint
    def is_allowed(self, tok: int) -> bool:
        """May `tok` come next in the committed state?"""
        if self._next_draft_is(tok):
            return True  # checked against exactly this state's mask when it was drafted
        return self._route(tok) is not None

    def consume(self, tok: int) -> None:
        """Advance the committed state by `tok` (ConstraintError when it is not allowed)."""
        if self._next_draft_is(tok):
            self._cursor += 1
            if self._cursor == len(self._drafts):
                self._drafts.clear()
                self._cursor = 0
            return
        route = self._route(tok)
        if route is None:
            raise ConstraintError(f"token {tok} is not allowed by the grammar here")
        self._apply(tok, route)

    def draft_begin(self) -> None:
        """A new draft chain starts from the committed state."""
        self._settle()
        self._drafting = True

    def draft_allowed(self, tok: int) -> bool:
        """Is draft `tok` legal after the drafts before it? If so it is consumed provisionally (rolled back
        lazily unless the verify walk accepts it). False: the engine stops the chain before `tok`."""
        if not self._drafting:
            self.draft_begin()
        route = self._route(tok)
        if route is None:
            return False
        st, bits = self._st, self._gbits
        self._drafts.append((tok, st, bits, self._apply(tok, route)))
        return True

    def mask_logits(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (fp32 [V], any device) with every token the committed state forbids set to -inf (unchanged
        inside reasoning). Eager masked fill from llguidance's bitmask; no compiled kernels."""
        self._settle()
        if self._st[0] == _THINK:
            return row
        if row.shape[-1] != self._n_vocab:
            raise ValueError(f"logit row has {row.shape[-1]} entries, the grammar's vocabulary {self._n_vocab}")
        return row.masked_fill(~self.allowed_mask(row.device), float("-inf"))

    def draft_mask_logits(self, row: torch.Tensor) -> torch.Tensor:
        """`row` ([..., V]) masked by the state the drafts so far reach, without settling: the engine's draft-mask
        hook (module docstring), so the drafter proposes grammar-legal tokens."""
        if not self._drafting:
            self.draft_begin()
        if self._st[0] == _THINK:
            return row
        allowed = self._unpack(self._state_bits(self._st, self._grammar_bits())[None], row.device)[0]
        return row.masked_fill(~allowed, float("-inf"))

    def allowed_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [V]: the tokens allowed next in the committed state (all True inside reasoning)."""
        self._settle()
        gbits = None if self._st[0] == _THINK else self._grammar_bits()
        return self._unpack(self._state_bits(self._st, gbits)[None], torch.device(device))[0]

    def window_mask(self, n_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [n_rows, V]: row j = tokens allowed after the first j drafts of the current window (call after
        drafting, before the verify walk; n_rows <= drafts + 1). The engine's verify-mask hook (module docstring)."""
        if self._cursor:
            raise RuntimeError("window_mask must be called before the verify walk")
        recs = self._drafts
        if not 1 <= n_rows <= len(recs) + 1:
            raise ValueError(f"n_rows must be in 1..{len(recs) + 1}, got {n_rows}")
        rows = []
        for j in range(n_rows):
            if j < len(recs):
                _, st, gbits, _ = recs[j]
            else:
                st, gbits = self._st, (None if self._st[0] == _THINK else self._grammar_bits())
            rows.append(self._state_bits(st, gbits))
        return self._unpack(np.stack(rows), torch.device(device))

    def _state_bits(self, st: tuple[int, int], gbits: np.ndarray | None) -> np.ndarray:
        """uint32 [W]: the allowed set of a state from its grammar mask (None inside reasoning)."""
        phase, sep = st
        if phase == _THINK:
            return np.full(self._words, 0xFFFFFFFF, dtype=np.uint32)
        assert gbits is not None
        if phase == _SEP and sep < SEPARATOR_MAX and self._newlines:
            gbits = gbits.copy()
            for t in self._newlines:
                gbits[t >> 5] |= np.uint32(1 << (t & 31))
        return gbits

    def _unpack(self, bits: np.ndarray, dev: torch.device) -> torch.Tensor:
        """uint32 [n, W] packed masks -> bool [n, V] on `dev` (the small packed array is what crosses to the device)."""
        shifts = self._shifts.get(dev)
        if shifts is None:
            shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        packed = torch.from_numpy(np.ascontiguousarray(bits).view(np.int32)).to(dev)  # int32 [n, W]
        return ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : self._n_vocab]  # [n, W*32] -> [n, V]
