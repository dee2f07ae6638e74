"""The chat template: plain text suited to a base model trained on plays.

    {system}\n\n            (if a system message is given)
    User: {content}\n
    Assistant: {content}\n
    ...
    Assistant:

Generation stops at the next ``\nUser:`` line (added to the request's own stop strings).
Within a session, only the new messages are rendered and appended after what is stored: after
each chat turn the session holds ``… Assistant: {reply stripped}\n``, exactly what a stateless
client resends (``server.sessions.transcript``), so both ways feed the model the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from server.api.protocol import ChatMessage

ROLE_NAMES = {"user": "User", "assistant": "Assistant"}
USER_CUE = f"{ROLE_NAMES['user']}:"
CHAT_STOP = (f"\n{USER_CUE}",)


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """Render messages and end with the ``Assistant:`` cue the model completes."""
    parts: list[str] = []
    for msg in messages:
        if msg.role in ("system", "developer"):
            parts.append(f"{msg.text().strip()}\n\n")
        else:
            parts.append(f"{ROLE_NAMES[msg.role]}: {msg.text().strip()}\n")
    return "".join(parts) + "Assistant:"
