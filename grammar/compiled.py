"""`CompiledGrammar`: what `grammar.compile` produces and `grammar.constraint` consumes, in a module of its own so
neither of the two imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llguidance import LLMatcher

if TYPE_CHECKING:  # annotations only
    from .compile import GrammarSource, GuidanceTokenizer


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled grammar for one tokenizer; immutable and shared. Make constraints from it."""

    source: GrammarSource
    tokenizer: GuidanceTokenizer
    matcher: LLMatcher  # pristine: never advanced; constraints deep_copy() it
    compile_s: float
