"""Train a small Qwen3.5-style byte-level BPE tokenizer and write it in Hugging Face layout.

The output directory gets the three files a Qwen3.5 checkpoint ships for its tokenizer:

- ``tokenizer.json``: NFC normalizer, the Qwen3.5 split regex then ``ByteLevel`` (no prefix space, no
  regex of its own), a BPE model trained on the given texts, a ``ByteLevel`` decoder, and the 33
  Qwen3.5 added tokens placed right after the learned vocabulary in the official order;
- ``tokenizer_config.json``: loadable by ``transformers.AutoTokenizer`` (eos ``<|im_end|>``, pad
  ``<|endoftext|>``, the chat template, ``added_tokens_decoder``);
- ``generation_config.json``: ``eos_token_id [<|im_end|>, <|endoftext|>]``, pad/bos ``<|endoftext|>``.

As in the official tokenizer, 21 of the added tokens are *special* (control tokens that
``skip_special_tokens`` drops) and the 12 text-level markers (``<think>``, ``<tool_call>``, FIM,
``<tool_response>``...) are added but not special, so decoded reasoning and tool calls keep them.

Script use::

    python tools/make_tokenizer.py --corpus a.txt b.txt --vocab-size 4096 --out models/demo
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# The pre-tokenizer split pattern of Qwen3.5 (single digits, letters with marks, punctuation runs).
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in official id order; ids follow the learned vocabulary (248044.. in Qwen3.5).
QWEN35_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "engine" / "chat_template.jinja"

_BYTE_ALPHABET_SIZE = 256


def build_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: Path, chat_template: str | None = None
) -> None:
    """Train a Qwen3.5-style byte-level BPE on ``texts`` and write it to ``out_dir``.

    ``vocab_size`` is the size of the learned vocabulary (256 byte symbols plus merges, at least 256);
    the 33 added tokens come after it, so the final vocabulary has up to ``vocab_size + 33`` entries
    (fewer learned tokens if the corpus runs out of pairs to merge). ``chat_template`` defaults to the
    text of ``engine/chat_template.jinja``. Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``generation_config.json`` (the directory is created if needed). Training is deterministic.
    """
    if vocab_size < _BYTE_ALPHABET_SIZE:
        raise ValueError(f"vocab_size must be at least {_BYTE_ALPHABET_SIZE} (the byte alphabet), got {vocab_size}")
    if chat_template is None:
        chat_template = DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")

    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # One at a time so ids follow the official order; add_special_tokens would force special=True.
    for content, special in QWEN35_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    ids = {content: tokenizer.token_to_id(content) for content, _ in QWEN35_ADDED_TOKENS}
    added_tokens_decoder = {
        str(ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in QWEN35_ADDED_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": 262144,
        "added_tokens_decoder": added_tokens_decoder,
        "chat_template": chat_template,
    }
    generation_config = {
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _iter_lines(paths: Iterable[Path]) -> Iterable[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield from f


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: train on text files and write the tokenizer directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, nargs="+", required=True, help="UTF-8 text files to train on")
    parser.add_argument("--vocab-size", type=int, required=True, help="learned vocabulary size (>= 256)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--chat-template", type=Path, default=None, help="jinja file (default: engine's)")
    args = parser.parse_args(argv)
    template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
    build_tokenizer(_iter_lines(args.corpus), args.vocab_size, args.out, template)


if __name__ == "__main__":
    main()
