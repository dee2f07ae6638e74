"""Chat templates: a checkpoint's own Jinja template (:class:`TemplateChat`), or for the
project's base models this plain text suited to a model trained on plays:

    {system}\n\n            (if a system message is given)
    User: {content}\n
    Assistant: {content}\n
    Tool: {content}\n          (a tool message's result, if any)
    ...
    Assistant:

Generation stops at the next ``\nUser:`` line (added to the request's own stop strings).
Within a session, only the new messages are rendered and appended after what is stored: after
each chat turn the session holds ``… Assistant: {reply stripped}\n``, exactly what a stateless
client resends (``linserve.server.sessions.transcript``), so both ways feed the model the same
tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from linserve.server.api.protocol import ChatMessage

ROLE_NAMES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}
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


CONTENT_LOOP = re.compile(r"for \w+ in [\w.]*(\.content|\[['\"]content['\"]\])")
CONTENT_TEST = re.compile(r"content['\"]?\]?\s+is\s+(not\s+)?(string|iterable|sequence|mapping)")


def string_content(source: str) -> bool:
    """Whether a template takes each message's content as a string only (as vLLM detects a
    template's content format): it never tests the content's type nor loops over it. Such a
    template gets an array of text parts joined into one string, where it would fail on
    ``content.replace`` or render the list."""
    return not (CONTENT_TEST.search(source) or CONTENT_LOOP.search(source))


class TemplateChat:
    """A checkpoint's own Jinja chat template, rendered as Hugging Face's
    ``apply_chat_template`` renders it: a sandboxed environment (no file system, no
    attribute access to Python internals) with ``trim_blocks`` and ``lstrip_blocks``,
    the ``tojson`` filter, ``raise_exception`` and ``strftime_now``; variables ``messages``
    (as the client sent them), ``add_generation_prompt``, ``bos_token``, ``eos_token`` and
    any extra keyword (``tools``, ``documents``, ``chat_template_kwargs``)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        # OpenAI's newer name for the system role; templates that predate it get "system"
        self.developer_as_system = "developer" not in source
        self.string_content = string_content(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text; raises ValueError (the request's fault) when the template refuses
        the conversation. ``kwargs`` become template variables (``tools``, ``documents``,
        ``chat_template_kwargs``' entries such as ``enable_thinking``). With
        ``continue_final_message`` the text ends where the last message's content ends, so
        the model continues it (transformers' rule)."""
        from jinja2.exceptions import TemplateError

        dicts = [m.for_template() for m in messages]
        if self.string_content:
            for d, m in zip(dicts, messages, strict=True):
                if isinstance(d.get("content"), list):
                    d["content"] = m.text()
        if self.developer_as_system:
            for d in dicts:
                if d["role"] == "developer":
                    d["role"] = "system"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            text = str(self.template.render(
                messages=dicts, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs))
        except TemplateError as exc:
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        if continue_final_message:
            final = messages[-1].text().strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("continue_final_message: the template does not render the "
                                 "last message's content as it is")
            text = text[: at + len(final)]
        return text
