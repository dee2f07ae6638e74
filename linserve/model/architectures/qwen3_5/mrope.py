"""Qwen3.5's multimodal rotary positions (M-RoPE, transformers' ``get_rope_index``): each
token has a (t, row, column) position; a text token's three are equal; an image's tokens
share the t of its first token and add their row and column to it, and the text after it
continues max(rows, columns) past the image's start, not rows × columns. Each rotary
frequency reads one of the three (``mrope_section``, interleaved: frequency i reads the row
where i mod 3 = 1 and i < 3 · section[1], the column where i mod 3 = 2 and i < 3 ·
section[2], else t).

What a row's next text token adds to its index in the context (its offset: max(rows,
columns) − rows × columns summed over the images it has seen) is kept in the state
(:class:`linserve.model.state.PositionEntry`), so decoding, sessions and cached prefixes
carry it. A prompt split inside an image recovers the image's first position from the
virtual id's offset within the image, so any split gives the same positions.
"""

from __future__ import annotations

import torch

from linserve.model.inputs import InsertTable


def axes(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Which position (0 t, 1 row, 2 column) each of the ``rotary_dim / 2`` frequencies
    reads -> ``[rotary_dim / 2]`` int64."""
    out = torch.zeros(rotary_dim // 2, dtype=torch.long)
    for axis in (1, 2):
        out[axis : 3 * section[axis] : 3] = axis
    return out


def positions(tokens: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor,
              inserts: InsertTable | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (t, row, column) positions of ``tokens [B, T]`` after ``lengths [B]`` tokens
    with ``offsets [B]`` -> ``[3, B, T]`` int64 and the offsets after them ``[B]``."""
    b, t = tokens.shape
    base = lengths[:, None] + torch.arange(t)[None]  # [B, T] each token's index
    out = (base + offsets[:, None]).expand(3, b, t).clone()
    after = offsets.clone()
    virtual = tokens < 0
    for row in range(b):
        if bool(virtual[row].any()):
            after[row] = _row(tokens[row].tolist(), int(lengths[row]), int(offsets[row]),
                              inserts or InsertTable(), out[:, row])
    return out, after


def _row(ids: list[int], length: int, offset: int, inserts: InsertTable,
         out: torch.Tensor) -> int:
    """Fill one row's positions ``out [3, T]`` in place; returns its offset after them."""
    for i, token in enumerate(ids):
        index = length + i
        if token >= 0:
            out[:, i] = index + offset
            continue
        item, j = inserts.where(token)
        rows, cols = item.shape
        first = index - j + offset  # the image's first token's position
        out[0, i], out[1, i], out[2, i] = first, first + j // cols, first + j % cols
        if j == item.length - 1:  # the image's last token: the text after it moves on
            offset += max(rows, cols) - rows * cols
    return offset
