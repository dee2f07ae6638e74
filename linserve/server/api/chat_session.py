"""Chat sessions with a checkpoint's own template: the session keeps exactly what the
template would render of the conversation for the next turn.

A template is a function of the whole conversation: Qwen3.5's drops an earlier turn's
reasoning once a newer user message follows, and renders a reply's tool calls in its own
syntax. So a template chat session keeps its conversation (:class:`Transcript`: the messages,
and the rendered text its state covers), and each turn:

1. renders the stored messages plus the new ones (:func:`next_prompt`); the rendered text
   must go on from the stored text (else the request changed how earlier turns render:
   other tools or ``chat_template_kwargs``; a 400), and what follows it is this turn's prompt;
2. after the reply, computes the text the template renders of the conversation and the reply
   *whatever message comes next* (:func:`stable_text`: the common part of renders followed by
   different next messages, cut after a special token, where tokenisation cannot merge across
   the cut), and the session's new state is its previous one with that text's new part
   prefilled (a replay: the reply as the model wrote it, its reasoning included, is not what
   the template shows of it later).

The state then always equals what a stateless client's resent conversation would prefill, so
a session and the whole conversation sent every turn continue alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.errors import APIError
from linserve.server.api.protocol import ChatMessage

# Probe messages that follow the reply in :func:`stable_text`: they differ from their first
# character, so the renders agree exactly up to where a next message's own text begins.
PROBES = ("\x01", "\x02")


@dataclass
class Transcript:
    """A template chat session's conversation: ``messages`` (as the client sent them, and the
    assistant's replies as parsed) and the rendered ``text`` the state covers (pending token
    included)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "text": self.text}

    @classmethod
    def from_json(cls, data: object) -> Transcript | None:
        """The transcript stored as ``data`` (None if it is not one)."""
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            return None
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        try:
            for m in messages:
                ChatMessage.model_validate(m)
        except ValueError:
            return None
        return cls(list(messages), data["text"])

    def chat_messages(self) -> list[ChatMessage]:
        return [ChatMessage.model_validate(m) for m in self.messages]


def next_prompt(chat: TemplateChat, stored: dict[str, Any] | None, session_tokens: int,
                new: Sequence[ChatMessage], **render: Any) -> tuple[str, Transcript]:
    """This turn's prompt text (what follows the session's text) and the conversation with
    the new messages. ``render``: the template variables (tools, documents, kwargs)."""
    prev = Transcript.from_json(stored) if stored is not None else None
    if prev is None:
        if session_tokens:
            raise APIError(400, "this session was not started as a chat with the model's "
                           "template (it holds raw text); start a new session, or send the "
                           "whole conversation without session_id", "session_id")
        prev = Transcript()
    full = [*prev.chat_messages(), *new]
    try:
        text = chat.render(full, True, **render)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages", "invalid_messages") from None
    if not text.startswith(prev.text):
        raise APIError(400, "with this request the chat template renders the session's earlier "
                       "turns differently (were tools, documents or chat_template_kwargs "
                       "changed?); send the same ones every turn, or start a new session",
                       "session_id")
    stored_messages = [m.model_dump(exclude_none=True) for m in full]
    return text[len(prev.text):], Transcript(stored_messages, prev.text)


def stable_text(chat: TemplateChat, conversation: Transcript, reply: dict[str, Any],
                specials: Sequence[str], **render: Any) -> str:
    """What the template renders of ``conversation`` and the assistant ``reply`` whatever the
    next message is (a user message, or a tool result after tool calls): the common prefix of
    renders with different next messages, cut after its last special token (never less than
    the conversation's stored text)."""
    messages = [*conversation.chat_messages(), ChatMessage.model_validate(reply)]
    kinds = _next_kinds(reply)[:2]  # a user message, or a tool result
    renders = [chat.render([*messages, *nexts], False, **render)
               for kind in kinds for nexts in kind]
    return _cut(_common(renders), specials, len(conversation.text))


def next_turn_texts(chat: TemplateChat, conversation: Transcript, reply: dict[str, Any],
                    specials: Sequence[str], **render: Any) -> list[str]:
    """What the template renders of ``conversation`` and ``reply`` for each kind of next turn:
    a user message; after tool calls also their results alone (the model goes on), and
    their results then a user message. Templates differ by kind (Qwen3.5's renders an
    assistant turn after the last user message with its reasoning block), so each kind gets
    its own text: the common prefix of renders with different probe contents, cut after a
    special token. Distinct texts only, longest first."""
    messages = [*conversation.chat_messages(), ChatMessage.model_validate(reply)]
    texts = {_cut(_common([chat.render([*messages, *nexts], False, **render)
                           for nexts in kind]), specials, len(conversation.text))
             for kind in _next_kinds(reply)}
    return sorted(texts, key=len, reverse=True)


def _next_kinds(reply: dict[str, Any]) -> list[list[list[ChatMessage]]]:
    """Per kind of next turn, one message list per probe."""
    def user(p: str) -> ChatMessage:
        return ChatMessage.model_validate({"role": "user", "content": p})

    kinds = [[[user(p)] for p in PROBES]]
    calls = reply.get("tool_calls") or []
    if calls:
        def tool(p: str) -> ChatMessage:
            return ChatMessage.model_validate({"role": "tool", "content": p,
                                               "tool_call_id": calls[0]["id"]})

        kinds += [[[tool(p)] for p in PROBES], [[tool(p), user(p)] for p in PROBES]]
    return kinds


def _common(texts: list[str]) -> str:
    common = texts[0]
    for other in texts[1:]:
        common = common[:next((i for i, (a, b) in enumerate(zip(common, other, strict=False))
                               if a != b), min(len(common), len(other)))]
    return common


def _cut(common: str, specials: Sequence[str], floor: int) -> str:
    """``common`` cut after its last special token (tokenization cannot merge across it),
    never shorter than ``floor``."""
    cut = max((common.rfind(s) + len(s) for s in specials if s and s in common), default=0)
    return common[:max(cut, floor)]


@dataclass
class ChatTurn:
    """A template chat session's turn in flight: the conversation with this turn's messages
    (its ``text``: what the state covered before the turn), the template variables, how the
    reply text becomes an assistant message, and the session version it was rendered from."""

    conversation: Transcript
    render: dict[str, Any]
    reply_message: Callable[[str], dict[str, Any]]
    version: int

    def after(self, chat: TemplateChat, specials: Sequence[str], reply: str) -> Transcript:
        """The session's transcript once ``reply`` is part of it."""
        message = self.reply_message(reply)
        text = stable_text(chat, self.conversation, message, specials, **self.render)
        stored = ChatMessage.model_validate(message).model_dump(exclude_none=True)
        return Transcript([*self.conversation.messages, stored], text)
