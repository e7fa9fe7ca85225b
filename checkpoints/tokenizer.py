"""The GPT-2 tokenizer (tiktoken's r50k_base), built offline from the vendored BPE file."""

from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path

import tiktoken

BPE_FILE = Path(__file__).parent / "tokenizer" / "r50k_base.tiktoken"
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
ENDOFTEXT = "<|endoftext|>"
EOT_ID = 50256
# GPT-2's pre-tokenization regex, as tiktoken defines it for r50k_base / gpt2.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.cache
def load_tokenizer() -> tiktoken.Encoding:
    """Return GPT-2's tokenizer, identical to ``tiktoken.get_encoding("gpt2")``, without any download.

    Text is encoded with ``encoding.encode_ordinary(text)`` (or ``encode(text, disallowed_special=())``):
    a literal ``"<|endoftext|>"`` inside user text is then ordinary text, not the special token 50256.
    The generation API follows that rule; pass id 50256 yourself to mean end-of-text.

    Raises:
        ValueError: if the vendored file is missing or its sha256 is not the expected one.

    Example:
        >>> load_tokenizer().encode_ordinary("Hello, world")
        [15496, 11, 995]
    """
    try:
        contents = BPE_FILE.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the tokenizer file {BPE_FILE} ({e}); reinstall gptgen") from e
    digest = hashlib.sha256(contents).hexdigest()
    if digest != BPE_SHA256:
        raise ValueError(
            f"tokenizer file {BPE_FILE} has sha256 {digest}, expected {BPE_SHA256}; "
            "it is damaged, reinstall gptgen"
        )
    # tiktoken's format: one "base64(token bytes) rank" pair per line. Parsed here rather than with
    # tiktoken.load, which would also copy the file into a cache directory under /tmp.
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in contents.splitlines() if line)
    }
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT_ID},
        explicit_n_vocab=EOT_ID + 1,
    )
