"""The one error type of the grammar package."""
from __future__ import annotations


class GrammarError(ValueError):
    """A request's structured-output / tool source that cannot be served: bad shape, bad schema, regex or lark,
    unknown tool name, over the size or compile-time bound. `param` names the request field (OpenAI error
    `param`, e.g. "response_format", "tool_choice", "structured_outputs.regex"); the server answers 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param
