"""Reasoning kept apart from the answer (``--reasoning-parser qwen3`` or ``deepseek_r1``, vLLM's
names): text inside ``<think>`` … ``</think>`` goes to ``reasoning_content``, the rest to
``content``.

Whether an output starts inside the reasoning is read from the prompt, so a stream and a whole
reply always split alike: Qwen3.5's template ends the prompt with ``<think>\\n`` when thinking
is on (and with an empty ``<think>\\n\\n</think>\\n\\n`` block when ``chat_template_kwargs``
turns it off); an output that itself begins with ``<think>`` opens it too. An output cut off
before ``</think>`` is all reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def starts_thinking(prompt: str) -> bool:
    """Whether generation begins inside the reasoning block (the prompt opened it)."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ReasoningStream:
    """Split output text as it streams into ("reasoning", text) and ("content", text)."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.started = False  # any text seen (a leading <think> may open the block)
        self.held = ""  # text that may be the start of a tag
        self.after_close = False  # the newlines that follow </think> belong to it

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.held += text
        if not self.started:
            stripped = self.held.lstrip()
            if OPEN.startswith(stripped) and stripped != OPEN:
                return out  # could still become <think>
            self.started = True
            if stripped.startswith(OPEN):
                self.thinking, self.held = True, stripped[len(OPEN):]
        if self.thinking:
            at = self.held.find(CLOSE)
            if at < 0:
                keep = _partial(self.held, CLOSE)
                self._emit(out, "reasoning", self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return out
            self._emit(out, "reasoning", self.held[:at])
            self.thinking, self.held = False, self.held[at + len(CLOSE):]
            self.after_close = True
        if self.after_close:
            self.held = self.held.lstrip("\n")
            if not self.held:
                return out
            self.after_close = False
        self._emit(out, "content", self.held)
        self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, "reasoning" if self.thinking else "content", self.held)
        self.held = ""
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    stream = ReasoningStream(thinking)
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    return (reasoning.strip() or None), "".join(t for kind, t in parts if kind == "content")


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
