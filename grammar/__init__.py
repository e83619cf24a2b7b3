"""Structured outputs and tool calling for nextn: request fields -> llguidance grammar (`compile`), the
engine's SpecConstraint over it (`constraint`), and the output parsers (`parsers`: reasoning split, Qwen3.5
tool calls). The engine never imports this package; the server does."""
from .compile import CompileResult, GrammarCompiler, GrammarSource, GuidanceTokenizer, source_from_request
from .compiled import CompiledGrammar
from .constraint import ConstraintError, GuidanceConstraint
from .errors import GrammarError
from .parsers import (ReasoningParser, ToolCall, ToolCallDelta, ToolCallParser, parse_tool_calls,
                      prompt_opens_reasoning, split_reasoning)

__all__ = [
    "CompiledGrammar", "CompileResult", "GrammarCompiler", "GrammarSource", "GuidanceTokenizer", "source_from_request",
    "ConstraintError", "GuidanceConstraint", "GrammarError", "ReasoningParser", "ToolCall", "ToolCallDelta",
    "ToolCallParser", "parse_tool_calls", "prompt_opens_reasoning", "split_reasoning",
]
