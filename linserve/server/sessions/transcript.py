"""What a session holds after a request: exactly the text the client received.

A request that ends on a stop string, or is cancelled part-way, has generated tokens the client
never saw. The session must not keep them (a chat session would otherwise hold ``\\nUser:``
twice). :func:`session_tokens` gives the tokens the session should hold instead: the longest
prefix of the generated tokens that spells a prefix of the text the client received, then the
tokenisation of whatever text is left. When nothing was cut this is the generated list itself.

Chat turns are normalised the way a stateless client resends them (``Assistant: {reply}\\n``,
reply stripped; see ``linserve.server.api.chat_template``), so a conversation continued through a
session holds the same tokens as the same conversation sent whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from linserve.model.tokenizer import TextTokenizer
from linserve.server.api.chat_template import USER_CUE


def chat_turn_text(reply: str) -> str:
    """The text a chat reply occupies in the transcript after the ``Assistant:`` cue."""
    return f" {reply.strip()}\n"


def chat_next_turn_text(reply: str) -> str:
    """How a stateless client's next prompt goes on after the ``Assistant:`` cue: the reply,
    then the next user message's cue."""
    return chat_turn_text(reply) + USER_CUE


def session_tokens(tok: TextTokenizer, generated: Sequence[int], text: str) -> list[int]:
    """Tokens that spell ``text``: a prefix of ``generated`` reused, the rest re-encoded."""
    target = text.encode("utf-8")
    kept, used = 0, 0
    for token in generated:
        piece = tok.token_bytes[token]
        if not piece or target[used : used + len(piece)] != piece:
            break
        kept, used = kept + 1, used + len(piece)
    if used == len(target) and kept == len(generated):
        return list(generated)
    while kept and used < len(target) and target[used] & 0xC0 == 0x80:  # mid-character cut
        kept -= 1
        used -= len(tok.token_bytes[generated[kept]])
    rest = target[used:].decode("utf-8", errors="replace")
    return list(generated[:kept]) + (tok.encode(rest) if rest else [])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
