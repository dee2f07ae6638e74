"""Tokenizers: the interface the server uses (:class:`TextTokenizer`), and the one every
vocabulary served today implements (:class:`Tokenizer`, over ``tokenizers``: a checkpoint's
``tokenizer.json``, and a GGUF file's gpt2 and llama vocabularies as
:mod:`linserve.model.gguf.vocab` writes them out).

Every token stands for a fixed byte string (``token_bytes``), so decoding concatenates token
bytes and the incremental detokenizer feeds them to an incremental UTF-8 decoder: text is
emitted only once its bytes are complete, so a stream never carries U+FFFD or half a
character. A vocabulary of another kind (a greedy longest match over bytes, say) implements
:class:`TextTokenizer` with its own ``encode`` and its byte table.
"""

from __future__ import annotations

import codecs
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_DECODER = _byte_decoder()
BYTE_CHARS = {b: ch for ch, b in _DECODER.items()}  # a byte's ByteLevel character
# The same table for str.translate: each byte-level character to the character of its byte,
# so that a piece's bytes are its translation encoded as Latin-1 (a 250k-token vocabulary's
# byte table: 1.8 s a character at a time, 0.1 s so).
# Characters below 256 outside the table become byte 0, as they did a character at a time.
_TO_LATIN1 = str.maketrans({**{chr(c): "\x00" for c in range(256)},
                            **{ch: chr(b) for ch, b in _DECODER.items()}})


def _piece_bytes(piece: str) -> bytes:
    """A ByteLevel piece's bytes; a character outside the table (not a byte-level vocabulary)
    is byte 0, as before."""
    try:
        return piece.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return bytes(_DECODER.get(ch, 0) for ch in piece)


def train_tokenizer(files: Iterable[Path], vocab_size: int = 8192) -> HFTokenizer:
    """Train a byte-level BPE on ``files`` with one special token, ``<|endoftext|>``."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def byte_table(tok: HFTokenizer) -> list[bytes]:
    """The exact bytes of each of ``tok``'s tokens (``[tok.get_vocab_size()]``): a special
    added token prints nothing, another added one its text, ``<|endoftext|>`` nothing, any
    other its ByteLevel piece's bytes."""
    table = [b""] * tok.get_vocab_size()
    added = tok.get_added_tokens_decoder()
    for piece, idx in tok.get_vocab().items():
        if idx in added:  # special tokens print nothing; other added ones their text
            table[idx] = b"" if added[idx].special else piece.encode()
        elif piece != EOS_TOKEN:
            table[idx] = _piece_bytes(piece)
    return table


class TextTokenizer(ABC):
    """What the server needs of a vocabulary. ``token_bytes[i]``: the exact byte string of
    token i (empty for ids past the vocabulary, up to the model's ``vocab_size``);
    ``eos_ids``: the ids that end a generation (``eos_id`` the first, or None)."""

    vocab_size: int
    eos_ids: tuple[int, ...]
    eos_id: int | None
    token_bytes: list[bytes]

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text to ids, special tokens' names included as their ids."""

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """A token's own text (a special token's name, such as ``<|im_end|>``)."""

    @abstractmethod
    def special_tokens(self) -> list[str]:
        """The names of the special tokens, which are never merged with text around them."""

    @abstractmethod
    def token_id(self, text: str) -> int | None:
        """The id of a token given as its text (a special token's name), or None."""

    @abstractmethod
    def to_json(self) -> str:
        """The vocabulary as ``tokenizers`` JSON (what the grammar engine loads)."""

    def prefetch(self, then: Callable[[], object] | None = None) -> None:
        """Read whatever the tokenizer reads lazily, in the background, then call ``then``
        (a tokenizer with nothing to read calls nothing)."""
        del then

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; special tokens and items' virtual ids (negative:
        :mod:`linserve.model.inputs`) are dropped, broken UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes[i] for i in ids if i >= 0).decode("utf-8",
                                                                            errors="replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.token_bytes)


class Tokenizer(TextTokenizer):
    """A ``tokenizers`` tokenizer (byte-level or SentencePiece BPE) behind
    :class:`TextTokenizer`.

    ``tok`` may be given as a function that reads it (with ``token_bytes`` kept from before):
    decoding, the end ids and the byte table need only the table, and reading a 250k-token
    vocabulary's JSON holds the GIL for half a second (``tokenizers`` does not release it),
    which an engine loading its weights beside it waited out. Such a tokenizer reads it at
    its first encode, or in a thread from :meth:`prefetch`."""

    def __init__(self, tok: HFTokenizer | Callable[[], HFTokenizer],
                 eos_ids: Sequence[int] | None = None, size: int | None = None,
                 token_bytes: list[bytes] | None = None, source: Path | None = None) -> None:
        """``eos_ids``: the ids that end a generation (default: ``<|endoftext|>``'s);
        ``size``: the model's vocabulary when it is larger than the tokenizer's (ids past the
        tokenizer decode to nothing); ``token_bytes``: the byte table :func:`byte_table`
        made of ``tok`` before (kept on disk: a 250k-token vocabulary's takes a second;
        required where ``tok`` is a function, whose tokenizer has exactly its tokens);
        ``source``: a ``tokenizers`` JSON file that holds exactly ``tok`` (where it was
        read from), which a pickled copy reads again instead of carrying it."""
        self.source = source
        self._read: Future[HFTokenizer] = Future()
        self._reader: Callable[[], HFTokenizer] | None = None
        self._lock = threading.Lock()
        if isinstance(tok, HFTokenizer):
            self._read.set_result(tok)
        elif token_bytes is None or eos_ids is None:
            raise ValueError("a tokenizer read later needs its byte table and end ids")
        else:
            self._reader = tok
        table = byte_table(self._tok) if token_bytes is None else token_bytes
        known = len(table) if self._reader is not None else self._tok.get_vocab_size()
        self.vocab_size: int = max(known, size or 0)
        if eos_ids is None:
            eos = self._tok.token_to_id(EOS_TOKEN)
            eos_ids = [] if eos is None else [eos]
        self.eos_ids: tuple[int, ...] = tuple(eos_ids)
        self.eos_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.token_bytes: list[bytes] = table + [b""] * (self.vocab_size - len(table))

    @property
    def _tok(self) -> HFTokenizer:
        """The ``tokenizers`` tokenizer, read now if it is not yet (once, by one thread)."""
        if not self._read.done():
            self._resolve()
        return self._read.result()

    def _resolve(self) -> None:
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is None:  # read, or being read by another thread: result() waits
            return
        try:
            self._read.set_result(reader())
        except BaseException as exc:  # handed to every caller
            self._read.set_exception(exc)

    def prefetch(self, then: Callable[[], object] | None = None) -> None:
        """Read a tokenizer given as a function in a daemon thread from now, then call
        ``then`` there (nothing when it is read or being read)."""
        if self._reader is None:
            return

        def read() -> None:
            self._resolve()
            if then is not None:
                then()

        threading.Thread(target=read, name="tokenizer-read", daemon=True).start()

    def __reduce__(self) -> tuple[Callable[..., Tokenizer], tuple[object, ...]]:
        """Pickled as its source file (else its JSON), end ids, size and byte table (the
        engine hands the HTTP process its tokenizer so), and read again lazily where it is
        unpickled: a 250k-token vocabulary's JSON written out and read back cost a start
        1.2 s, its file is read in the HTTP process's own time."""
        read = (functools.partial(read_file, self.source)
                if self.source is not None and self.source.is_file() else
                functools.partial(HFTokenizer.from_str, self.to_json()))
        return _unpickle, (read, self.eos_ids, self.vocab_size, self.token_bytes, self.source)

    @classmethod
    def from_file(cls, path: str | Path, eos_ids: Sequence[int] | None = None,
                  size: int | None = None) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)), eos_ids, size, source=Path(path))

    def token_text(self, token_id: int) -> str:
        return str(self._tok.id_to_token(token_id) or "")

    def special_tokens(self) -> list[str]:
        added = self._tok.get_added_tokens_decoder()
        return [t.content for t in added.values() if t.special]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def to_json(self) -> str:
        return str(self._tok.to_str())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)


# Tokenizer files being read ahead (preread), by path: the HTTP process starts reading its
# model's while the engine process imports torch, and the tokenizer the engine then sends
# (pickled with its source) takes what was read.
_AHEAD: dict[Path, Future[HFTokenizer]] = {}


def preread(path: Path) -> None:
    """Start reading the ``tokenizers`` file ``path`` in a daemon thread, for
    :func:`read_file` (a 250k-token vocabulary's takes 0.9 s, holding the GIL)."""
    if path in _AHEAD:
        return
    ahead: Future[HFTokenizer] = Future()
    _AHEAD[path] = ahead

    def read() -> None:
        try:
            ahead.set_result(HFTokenizer.from_file(str(path)))
        except BaseException as exc:  # read again by read_file, which raises it there
            ahead.set_exception(exc)

    threading.Thread(target=read, name="tokenizer-preread", daemon=True).start()


def read_file(path: Path) -> HFTokenizer:
    """The ``tokenizers`` file ``path``, as :func:`preread` read it ahead, else read now."""
    ahead = _AHEAD.pop(path, None)
    if ahead is not None and ahead.exception() is None:
        return ahead.result()
    return HFTokenizer.from_file(str(path))


def _unpickle(read: Callable[[], HFTokenizer], eos_ids: tuple[int, ...], size: int,
              token_bytes: list[bytes], source: Path | None) -> Tokenizer:
    return Tokenizer(read, eos_ids, size, token_bytes, source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that are always whole characters."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (possibly empty)."""
        return self._decoder.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        """End of stream: whatever bytes are left (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
