"""Where a checkpoint is, torch-free: a folder, a GGUF file (every shard of a split one), a
BlinkDL ``.pth`` (or a folder holding one), or a Hugging Face repo id through
huggingface_hub's cache (:func:`resolve`). Both processes resolve ``--model`` alike; the
HTTP process, which imports no torch, only this."""

from __future__ import annotations

import os
from pathlib import Path

from linserve.model.gguf import vocab_cache
from linserve.model.gguf.files import is_gguf, shards
from linserve.model.info import CheckpointError

ALLOW = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


def pth_file(path: Path) -> Path | None:
    """The ``.pth`` checkpoint ``path`` is or holds (a folder with exactly one and no
    ``config.json``); None otherwise."""
    if path.is_file():
        return path if path.suffix == ".pth" else None
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.pth"))
        return found[0] if len(found) == 1 else None
    return None


def is_pth(path: Path) -> bool:
    return pth_file(path) is not None


def resolve(path_or_id: str | Path) -> Path:
    """A local folder or GGUF file as it is; otherwise a Hub repo id (``owner/name``, or
    ``owner/name:FILE.gguf`` for one GGUF file of it), through huggingface_hub's cache."""
    path = Path(path_or_id)
    if path.is_dir() or (path.is_file() and (is_gguf(path) or is_pth(path))):
        return path
    repo, _, file = str(path_or_id).partition(":")
    if file and is_gguf(file) and repo.count("/") == 1 and not path.exists():
        return _hub_file(repo, file)
    if is_gguf(path):
        raise CheckpointError(f"{path_or_id}: no such GGUF file")
    if path.exists() or str(path_or_id).count("/") != 1:
        raise CheckpointError(f"{path_or_id}: not a checkpoint folder, a GGUF file or a repo "
                              f"id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(str(path_or_id), allow_patterns=ALLOW,
                                      local_files_only=offline))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        where = "the local Hugging Face cache" if offline else "the Hub or the local cache"
        raise CheckpointError(f"{path_or_id}: not found in {where} "
                              f"({type(exc).__name__})") from None


def _hub_file(repo: str, file: str) -> Path:
    """One GGUF file of a Hub repo (every shard of a split one), through the cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        first = Path(hf_hub_download(repo, file, local_files_only=offline))
        for shard in gguf_shard_names(first)[1:]:
            hf_hub_download(repo, str(Path(file).with_name(shard)), local_files_only=offline)
        return first
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        where = "the local Hugging Face cache" if offline else "the Hub or the local cache"
        raise CheckpointError(f"{repo}:{file}: not found in {where} "
                              f"({type(exc).__name__})") from None


def gguf_shard_names(first: Path) -> list[str]:
    """The file names of every shard of the split GGUF model ``first`` names."""
    from linserve.model.gguf.files import SPLIT

    hit = SPLIT.match(first.name)
    if hit is None:
        return [first.name]
    n = int(hit.group("n"))
    return [f"{hit.group('stem')}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def tokenizer_source(path: Path) -> Path | None:
    """The ``tokenizers`` file the checkpoint at ``path`` reads its vocabulary from, where
    one is known without its config: a folder's (or a ``.pth``'s folder's)
    ``tokenizer.json``, or the vocabulary kept for a GGUF file (:mod:`.gguf.vocab_cache`).
    None where there is none (a GGUF file read for the first time, RWKV's world
    vocabulary)."""
    if is_gguf(path):
        try:
            kept = vocab_cache.cache_file(shards(path))
        except (OSError, ValueError):  # a shard missing: the check says so
            return None
        return kept if kept.is_file() else None
    folder = path.parent if path.is_file() else path
    file = folder / "tokenizer.json"
    return file if file.is_file() else None
