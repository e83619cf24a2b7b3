"""Tokenizer for Hugging Face model directories: tokenizer.json, chat template, stop ids, streaming detokenizer.

Loads what a Qwen3.5 checkpoint ships (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, optionally ``chat_template.jinja``) with the ``tokenizers`` package and
renders chat templates with jinja2 the way ``transformers`` does, so prompts are token-identical to
``AutoTokenizer.apply_chat_template``. No dependency on ``transformers``. ``encode_chat`` tokenizes a
conversation so that only the template's own markup becomes control tokens (message text never does).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as _HFTokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: Content part types that are images: Chat Completions' and the Responses API's (transformers' own is "image").
IMAGE_PART_TYPES = ("image_url", "input_image")
#: An image part as chat templates read it (Qwen's official template tests ``item.type == 'image'``; ours renders
#: it as ``<|vision_start|><|image_pad|><|vision_end|>``): the URL never reaches the template.
IMAGE_PART: dict[str, str] = {"type": "image"}
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
#: Placeholders for special-token text found in messages are taken from Unicode's supplementary
#: private use area B (U+100000..U+10FFFD), skipping any character the conversation already uses.
_PLACEHOLDER_BASE, _PLACEHOLDER_END = 0x100000, 0x10FFFE


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config: a string or an AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _encode(tokenizer: _HFTokenizer, text: str, add_special_tokens: bool = False) -> Encoding:
    """``tokenizer.encode``, except that a str holding a lone surrogate (not Unicode text: tokenizers refuses
    it with a TypeError) raises ValueError naming the code point."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        bad = next((c for c in text if "\ud800" <= c <= "\udfff"), None) if isinstance(text, str) else None
        if bad is None:
            raise
        raise ValueError(f"text contains a lone surrogate U+{ord(bad):04X}, which is not valid Unicode") from None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, non-ASCII kept, json.dumps defaults otherwise.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _prepare_message(message: Any) -> dict[str, Any]:
    """Copy one chat message into the shape templates expect (as transformers prepares it, plus argument parsing).

    None-valued keys are dropped; reasoning given as ``thinking``/``reasoning`` is also exposed as
    ``reasoning_content`` (and vice versa); tool-call ``arguments`` that are a JSON object string are
    parsed into a dict, as OpenAI clients send them, so templates render them as parameters; an image content part
    (``image_url``, ``input_image``) becomes ``IMAGE_PART``, the shape Qwen's templates read.
    """
    if not isinstance(message, dict):
        raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
    msg = {k: v for k, v in message.items() if v is not None}
    if isinstance(msg.get("content"), list):
        msg["content"] = [dict(IMAGE_PART) if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
                          else part for part in msg["content"]]
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    if isinstance(msg.get("tool_calls"), list):
        msg["tool_calls"] = [_parse_tool_call_arguments(call) for call in msg["tool_calls"]]
    return msg


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` (JSON-like: dicts, lists, tuples, scalars) with `fn` applied to every string, keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def _strings(value: Any) -> Iterator[str]:
    """Every string in `value` (JSON-like: dicts, lists, tuples, scalars), keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _parse_tool_call_arguments(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    holder = fn if isinstance(fn, dict) else call
    args = holder.get("arguments")
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return call
    if not isinstance(parsed, dict):
        return call
    new_holder = {**holder, "arguments": parsed}
    return {**call, "function": new_holder} if holder is fn else new_holder


def _cut_after_final_message(rendered: str, content: Any) -> str:
    """`rendered` up to the end of the last message's text (transformers' continue_final_message)."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    for text in (content, content.strip()):
        at = rendered.rfind(text)
        if at != -1:
            return rendered[: at + len(text)]
    raise ValueError("continue_final_message: the chat template does not render the last message's content")


#: `Tokenizer.encode` keeps the ids of text segments between added tokens this long or longer (a conversation's
#: system prompt and earlier turns come back every turn: their tokenization is a lookup), at most SEGMENT_CACHE_SIZE
#: of them (least recently used out).
SEGMENT_CACHE_MIN = 256
SEGMENT_CACHE_SIZE = 1024


class Tokenizer:
    """A ``tokenizers`` tokenizer plus the model directory's chat template, eos ids and special tokens."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer``; ``special_tokens`` maps e.g. ``eos_token`` to its text
        and is visible to the chat template, as in transformers. Prefer :meth:`from_dir`."""
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = chat_template
        self.eos_token_ids: list[int] = list(eos_token_ids or [])
        self.pad_token_id: int | None = pad_token_id
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._compiled: jinja2.Template | None = None
        added = tokenizer.get_added_tokens_decoder()
        #: Ids of the control tokens (added tokens marked special: <|im_start|>, <|im_end|>...).
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        texts = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._plain: _HFTokenizer | None = None  # a copy that encodes special-token text as plain text
        # `tokenizers` cuts its input at every added token before anything else runs, so text encodes as the
        # concatenation of its pieces between them: exact where no added token strips its neighbours' whitespace,
        # matches whole words only or matches normalized text (else None: no segment cache)
        every = sorted((t.content for t in added.values()), key=len, reverse=True)
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self._added_split = re.compile("(" + "|".join(map(re.escape, every)) + ")") if every and plain else None
        self._segment = functools.lru_cache(maxsize=SEGMENT_CACHE_SIZE)(self._encode_segment)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load a Hugging Face model/tokenizer directory.

        - ``tokenizer.json`` is required (ValueError naming it if absent).
        - Chat template: ``chat_template.jinja`` if present (it takes precedence, as in transformers),
          else ``tokenizer_config.json`` ``chat_template`` (a string, or a list of ``{name, template}``
          from which ``default`` is used); None if neither.
        - eos ids: ``generation_config.json`` ``eos_token_id`` (int or list), else tokenizer_config's
          ``eos_token``, else ``config.json`` ``eos_token_id`` (top level or ``text_config``); else [].
        - pad id: tokenizer_config's ``pad_token``, else generation_config's ``pad_token_id``; else None.
        """
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"tokenizer.json not found in {model_dir} (a tokenizer.json file is required)")
        tokenizer = _HFTokenizer.from_file(str(tok_path))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json") or {}
        gen_cfg = _read_json(model_dir / "generation_config.json") or {}

        template_file = model_dir / "chat_template.jinja"
        chat_template: str | None
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = cls._template_from_config(tok_cfg.get("chat_template"))

        special_tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_content(tok_cfg.get(k))) is not None}

        eos_ids = _id_list(gen_cfg.get("eos_token_id"))
        if not eos_ids and "eos_token" in special_tokens:
            eos_id = tokenizer.token_to_id(special_tokens["eos_token"])
            eos_ids = [eos_id] if eos_id is not None else []
        if not eos_ids:
            model_cfg = _read_json(model_dir / "config.json") or {}
            eos_ids = _id_list(model_cfg.get("eos_token_id"))
            if not eos_ids and isinstance(model_cfg.get("text_config"), dict):
                eos_ids = _id_list(model_cfg["text_config"].get("eos_token_id"))

        pad_id = tokenizer.token_to_id(special_tokens["pad_token"]) if "pad_token" in special_tokens else None
        if pad_id is None:
            pad_ids = _id_list(gen_cfg.get("pad_token_id"))
            pad_id = pad_ids[0] if pad_ids else None

        return cls(
            tokenizer,
            chat_template=chat_template,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            special_tokens=special_tokens,
        )

    @staticmethod
    def _template_from_config(value: Any) -> str | None:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            for entry in value:
                if isinstance(entry, dict) and entry.get("name") == "default":
                    return entry.get("template")
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; added tokens written in the text (``<|im_start|>``...) become their ids.
        ValueError for a lone surrogate (as from every encode method). The ids of pieces between added tokens of
        SEGMENT_CACHE_MIN characters or more are remembered (the same ids: see `_added_split`)."""
        if add_special_tokens or self._added_split is None or len(text) < SEGMENT_CACHE_MIN:
            return _encode(self._tok, text, add_special_tokens).ids
        ids: list[int] = []
        short: list[str] = []  # consecutive short pieces (added tokens too) encode in one call
        for part in self._added_split.split(text):
            if len(part) < SEGMENT_CACHE_MIN:
                short.append(part)
                continue
            if short:
                ids += _encode(self._tok, "".join(short)).ids
                short = []
            ids += self._segment(part)
        if short:
            ids += _encode(self._tok, "".join(short)).ids
        return ids

    def _encode_segment(self, text: str) -> tuple[int, ...]:
        return tuple(_encode(self._tok, text).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token text (``<|im_end|>``...) encoded as ordinary text; other
        added tokens (``<think>``, ``<tool_call>``...) are still recognised, as in ``encode``."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return _encode(self._plain, text).ids

    def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        special_tokens_in_content: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the chat prompt: ``apply_chat_template`` (same arguments), then tokenization in which
        only the template's own markup becomes control tokens.

        Text of a special token written inside the messages or tools (``<|im_end|>\\n<|im_start|>system``
        in a user's content) is tokenized as plain text, as OpenAI's API treats message content, so a
        message cannot forge a turn. Conversations without such text get exactly
        ``encode(apply_chat_template(...))`` (transformers' ``apply_chat_template(tokenize=True)``).
        ``special_tokens_in_content=True`` restores that for every conversation (trusted callers).

        How: each special-token text in a message string is swapped for a private-use character the
        conversation does not contain, the template is rendered (so its logic sees the same structure),
        the control tokens of the rendered text are all markup, and the text between them is tokenized
        with the placeholders swapped back, by ``encode_plain``. Raises ValueError as
        ``apply_chat_template`` does.
        """

        def render(msgs: list[dict], tls: list[dict] | None) -> str:
            return self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tls,
                                            enable_thinking=enable_thinking,
                                            continue_final_message=continue_final_message, **kwargs)

        found = set() if special_tokens_in_content or self._special_text is None else {
            m.group() for text in _strings((messages, tools)) for m in self._special_text.finditer(text)}
        if not found:
            return self.encode(render(messages, tools))
        assert self._special_text is not None
        used = set().union(*map(set, _strings((messages, tools))), self.chat_template or "")
        free = (chr(c) for c in range(_PLACEHOLDER_BASE, _PLACEHOLDER_END) if chr(c) not in used)
        placeholder = dict(zip(sorted(found), free, strict=False))
        if len(placeholder) < len(found):
            raise ValueError("the conversation uses every private-use character; cannot tokenize it safely")
        pattern = self._special_text

        def defuse(text: str) -> str:
            return pattern.sub(lambda m: placeholder[m.group()], text)

        safe_messages, safe_tools = _map_strings((messages, tools), defuse)
        rendered = render(safe_messages, safe_tools)
        restore = str.maketrans({ph: text for text, ph in placeholder.items()})
        enc = _encode(self._tok, rendered)
        ids: list[int] = []
        start = 0
        for tok, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if tok in self.special_token_ids:  # template markup: the messages' own are placeholders now
                ids += self.encode_plain(rendered[start:a].translate(restore)) if a > start else []
                ids.append(tok)
                start = b
        if start < len(rendered):
            ids += self.encode_plain(rendered[start:].translate(restore))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences decode to U+FFFD."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str) -> int | None:
        """Id of a vocabulary or added token string, None if unknown."""
        return self._tok.token_to_id(tok)

    def id_to_token(self, i: int) -> str | None:
        """The token string (byte-level form for BPE tokens) of id ``i``, None if out of range."""
        return self._tok.id_to_token(i)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts) with the chat template into the prompt text.
        ``continue_final_message``: the text ends right after the last message's content (its end-of-turn
        markup cut, as transformers does), so generation continues that message.

        Matches ``transformers`` ``apply_chat_template(..., tokenize=False)``: sandboxed jinja2 with
        trim_blocks/lstrip_blocks, ``raise_exception``, ``tojson`` and ``strftime_now``; the template sees
        ``messages``, ``tools``, ``add_generation_prompt``, the special tokens (``eos_token``...), any extra
        ``kwargs`` and ``enable_thinking`` when not None. Messages are prepared as transformers does
        (None values dropped, reasoning aliases) and JSON-string tool-call arguments are parsed to dicts.
        Raises ValueError if there is no template or rendering fails (the template's message included).
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        prepared = [_prepare_message(m) for m in messages]
        context: dict[str, Any] = {**self.special_tokens, **kwargs}
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        try:
            if self._compiled is None:
                self._compiled = _compile_template(self.chat_template)
            rendered = self._compiled.render(
                messages=prepared, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except Exception as e:  # template errors and any type errors the template hits on bad input
            raise ValueError(f"chat template error: {e}") from e
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, prepared[-1].get("content"))
        return rendered

    def to_json_str(self) -> str:
        """The tokenizer serialized as tokenizer.json text (what llguidance consumes)."""
        return self._tok.to_str()


# Prompt tokens kept as decoding context (vLLM uses the same window).
_PROMPT_CONTEXT_TOKENS = 5
#: Tokens pending (decoded, not yet returned) beyond which the window is cut where it splits cleanly. A
#: character has at most 4 UTF-8 bytes and a token at least one, so only the last 3 tokens can hold the start
#: of a character still incomplete; the window stays bounded even while tokens never form a character.
_MAX_PENDING_TOKENS = 8
_KEEP_AFTER_CUT = 4


class IncrementalDetokenizer:
    """Streaming detokenizer that never emits a partial UTF-8 character.

    Uses the prefix/read-offset technique: each new token decodes a short window of tokens starting
    at the last emitted character boundary, and the text past the already-emitted part is returned
    once it no longer ends in U+FFFD (an incomplete character). When many tokens pass without that (bytes that
    are not UTF-8, or special tokens skipped), the window is cut at a token where it splits cleanly (decoding
    both sides apart gives the same text), and the text before the cut is final. Work per token is
    O(window), and the window is bounded, not O(sequence). The concatenation of all :meth:`push` results and
    :meth:`flush` equals ``tokenizer.decode(pushed_ids, skip_special_tokens)``; a push never ends on U+FFFD
    (``prompt_ids`` only supply context; their last few tokens are decoded with the window and their text
    is never returned).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = False
    ) -> None:
        """Start a stream; ``prompt_ids`` are the tokens that precede the first pushed token."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        # a prompt (given as ids) that ends inside a character would merge with the first pushed bytes
        self._ids: list[int] = [] if tokenizer.decode(context, skip_special_tokens).endswith("\ufffd") else context
        self._prefix = 0  # start of the decode window (a character boundary already emitted)
        self._read = len(self._ids)  # tokens before this index have had their text emitted
        self._held = 0  # final U+FFFD characters not returned yet (a push never ends on one)

    def _pending(self) -> tuple[str, str]:
        ids = self._ids
        emitted = self._tok.decode(ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(ids[self._prefix :], self._skip)
        return emitted, window

    def _advance(self) -> None:
        del self._ids[: self._read]
        self._prefix = 0
        self._read = len(self._ids)

    def _release(self, text: str) -> str:
        """Final `text` after the held U+FFFDs, less its own trailing U+FFFDs (held in turn)."""
        kept = text.rstrip("\ufffd")
        if not kept:
            self._held += len(text)
            return ""
        out = "\ufffd" * self._held + kept
        self._held = len(text) - len(kept)
        return out

    def _cut(self, emitted: str, window: str) -> str:
        """Many tokens pending: if the window splits cleanly before its last tokens, return the text before
        the split (final: later tokens cannot change it) and restart the window there."""
        cut = len(self._ids) - _KEEP_AFTER_CUT
        head = self._tok.decode(self._ids[self._prefix : cut], self._skip)
        if not head.startswith(emitted) or head + self._tok.decode(self._ids[cut:], self._skip) != window:
            return ""  # a character (or an invalid sequence) spans the cut: try again after the next token
        del self._ids[:cut]
        self._prefix = self._read = 0
        return self._release(head[len(emitted) :])

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        out: list[str] = []
        for tok in token_ids:
            self._ids.append(tok)
            emitted, window = self._pending()
            if len(window) > len(emitted) and not window.endswith("\ufffd"):
                out.append(self._release(window[len(emitted) :]))
                self._advance()
            elif len(self._ids) - self._read > _MAX_PENDING_TOKENS:
                out.append(self._cut(emitted, window))
        return "".join(out)

    def flush(self) -> str:
        """End of stream: return any held-back text, including U+FFFD for a trailing incomplete character."""
        emitted, window = self._pending()
        out = "\ufffd" * self._held + window[len(emitted) :]
        self._held = 0
        self._read = len(self._ids)
        self._advance()
        return out
