"""What a prompt holds besides tokens: items (an image, say) whose embeddings an encoder
makes, inserted at marked positions of the token ids.

A prompt stays one list of ids. The positions an item covers hold *virtual ids* instead of
its placeholder tokens: negative numbers derived from the item's content hash and the
position within the item (:func:`virtual_ids`). Everything keyed by a prompt's ids (the
prefix cache's radix, sessions, transcripts, a replica's shared prefixes) thereby tells two
items apart by content, though their placeholder tokens are the same; and the model, given
an :class:`InsertTable`, reads a virtual id's row of the item's embeddings where a token's
row of the embedding table would be. Shapes: n an item's positions, d the model's width.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch-free at run time: the HTTP process places items, the engine
    import torch  # encodes them

SPAN = 1 << 16  # positions an item may cover (an id's offset within its item)
ENCODED_CACHE_BYTES = 64 << 20  # the engine's cache of encoded items (EncodedCache)
DIGEST_BITS = 40  # bits of the content hash in a virtual id (with the offset: 56 of 63)


@dataclass(frozen=True)
class Insert:
    """An item at ``input_ids[start : start + length]``: ``kind`` names the encoder that
    makes its ``length`` embeddings from ``payload``; ``digest`` hashes its content (the
    decoded pixels of an image, not the bytes it was sent as). ``grid``: its positions as
    rows × columns (an image's tokens; (0, 0): one row of ``length``), for models whose
    positions are 2-D (M-RoPE)."""

    kind: str
    start: int
    length: int
    digest: str
    payload: bytes = field(default=b"", repr=False, compare=False)
    grid: tuple[int, int] = (0, 0)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of its positions."""
        return self.grid if self.grid != (0, 0) else (1, self.length)

    def moved(self, start: int) -> Insert:
        """The same item at another position of a prompt."""
        return Insert(self.kind, start, self.length, self.digest, self.payload, self.grid)


def digest_of(content: bytes) -> str:
    """The content hash an :class:`Insert` carries (hex)."""
    return hashlib.blake2b(content, digest_size=16).hexdigest()


def virtual_ids(digest: str, length: int) -> list[int]:
    """The ids of an item's ``length`` positions: ``-(1 + h · SPAN + offset)``, with h the
    digest's first :data:`DIGEST_BITS` bits."""
    if not 0 < length <= SPAN:
        raise ValueError(f"an item covers 1 to {SPAN} positions, not {length}")
    base = int(digest[: DIGEST_BITS // 4], 16) * SPAN
    return [-(1 + base + i) for i in range(length)]


def is_virtual(token: int) -> bool:
    return token < 0


def mark(ids: Sequence[int], inserts: Iterable[Insert]) -> list[int]:
    """``ids`` with each insert's positions replaced by its virtual ids (ValueError for an
    insert outside ``ids`` or overlapping another)."""
    out = list(ids)
    taken = 0
    for item in sorted(inserts, key=lambda i: i.start):
        if item.start < taken or item.end > len(out):
            raise ValueError(f"a {item.kind} at positions {item.start}-{item.end} does not fit "
                             f"a prompt of {len(out)} tokens")
        out[item.start : item.end] = virtual_ids(item.digest, item.length)
        taken = item.end
    return out


def text_ids(ids: Iterable[int]) -> list[int]:
    """The ids that are tokens (virtual ids left out): what penalties and logprobs count."""
    return [t for t in ids if t >= 0]


class Encoder(Protocol):
    """Makes an item's embeddings ``[length, d]`` (the model's dtype) from its payload."""

    def encode(self, item: Insert) -> torch.Tensor:
        ...


class InsertTable:
    """The embeddings of one prompt's items, by virtual id."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[torch.Tensor, int]] = {}
        self._items: dict[int, tuple[Insert, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, item: Insert, embeds: torch.Tensor) -> None:
        """``embeds`` ``[item.length, d]``, the item's rows in order."""
        if embeds.dim() != 2 or embeds.shape[0] != item.length:
            raise ValueError(f"the {item.kind} encoder gave {tuple(embeds.shape)} for "
                             f"{item.length} positions")
        for offset, vid in enumerate(virtual_ids(item.digest, item.length)):
            self._rows[vid] = (embeds, offset)
            self._items[vid] = (item, offset)

    def where(self, token: int) -> tuple[Insert, int]:
        """A virtual id's item and its offset within the item (ValueError for one this
        table does not hold)."""
        found = self._items.get(token)
        if found is None:
            raise ValueError("the prompt holds an item whose content was not sent with it")
        return found

    def place(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., d]`` (the token embeddings of ``tokens`` ``[...]``, virtual ids
        embedded as token 0) with each virtual id's row put in (ValueError for one this table
        does not hold)."""
        where = (tokens < 0).nonzero(as_tuple=False)
        if where.numel() == 0:
            return x
        x = x.clone()
        for idx in where.tolist():
            found = self._rows.get(int(tokens[tuple(idx)]))
            if found is None:
                raise ValueError("the prompt holds an item whose content was not sent with it")
            embeds, offset = found
            x[tuple(idx)] = embeds[offset].to(x.dtype)
        return x


class EncodedCache:
    """Items' embeddings by digest, least recently used dropped past ``capacity`` bytes: an
    image sent again is not encoded again."""

    def __init__(self, capacity: int = ENCODED_CACHE_BYTES) -> None:
        self.capacity = capacity
        self.bytes = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if key in self._items or size > self.capacity:
            return
        self._items[key] = embeds
        self.bytes += size
        while self.bytes > self.capacity:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
