"""Tight agent loops (next_turn.py): after a stateless chat reply the conversation is
prefilled as its next turn will render it, resuming where that rendering leaves the prompt
(the start of the generation prompt, kept as the prompt was prefilled), so it runs only the
reply as re-rendered and the next turn's header; and a turn sent the moment the reply ends
gets what it would have got after a pause. On a tiny Qwen3.5 with the real tokenizer and
template, measured by the prompt-token counters and the ``next_turn_prefill`` log events."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serverproc import ServerProcess
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration
WORDS = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}]
SLACK = 12  # template tokens around a re-rendered reply: its end, the next turn's header


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen-turns"), "i4-tied")


def serve(checkpoint: Path) -> ServerProcess:
    return ServerProcess.serving(checkpoint, "--reasoning-parser", "qwen3",
                                 "--served-model-name", "q")


@pytest.fixture(scope="module")
def srv(checkpoint: Path) -> Iterator[ServerProcess]:
    with serve(checkpoint) as s:
        yield s


def next_turn_events(srv: ServerProcess, after: int) -> list[dict[str, Any]]:
    """The ``next_turn_prefill`` events logged after the first ``after`` ones."""
    lines = [line for line in srv.logs().splitlines() if '"next_turn_prefill"' in line]
    return [json.loads(line[line.index("{"):]) for line in lines[after:]]


def counter(srv: ServerProcess, what: str, kind: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    m = re.search(rf'linserve_prompt_tokens_{what}_total\{{kind="{kind}"\}} ([\d.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def reply_then_prefill(srv: ServerProcess, body: dict[str, Any], kinds: int
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A chat reply, and the ``kinds`` post-reply prefills that follow it."""
    seen = len(next_turn_events(srv, 0))
    out = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
    deadline = time.monotonic() + 30
    while len(next_turn_events(srv, seen)) < kinds and time.monotonic() < deadline:
        time.sleep(0.05)
    return out, next_turn_events(srv, seen)


@pytest.mark.parametrize("thinking", [False, True])
def test_the_post_reply_prefill_runs_only_the_reply(srv: ServerProcess, thinking: bool) -> None:
    """It resumes at the previous prompt's generation prompt, not an older state, and runs
    at most the reply and the template's few boundary tokens; the prompt-token counters
    say the same."""
    before = counter(srv, "computed", "next_turn")
    msgs = [{"role": "user", "content": f"Tell me ({thinking}). {WORDS}"}]
    for _ in range(2):
        out, events = reply_then_prefill(srv, {
            "model": "q", "messages": msgs, "max_tokens": 16, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": thinking}}, 1)
        prompt, made = out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]
        print(f"thinking {thinking}: prompt {prompt}, reply {made}, post-reply prefill "
              f"reused {events[0]['reused']}, computed {events[0]['computed']}")
        assert len(events) == 1
        assert events[0]["reused"] >= prompt - SLACK, (events, prompt)
        assert events[0]["computed"] <= made + SLACK, (events, made)
        msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]
                  or ""}, {"role": "user", "content": f"And then? {WORDS}"}]
    computed = counter(srv, "computed", "next_turn") - before
    assert 0 < computed <= 2 * (16 + SLACK)


def test_a_tool_call_turn_runs_only_the_call(srv: ServerProcess) -> None:
    """After a forced tool call, each kind of next turn (the tool's result, a user message,
    both) is prefilled from the previous prompt's boundary: the call as the template renders
    it and the header of what follows."""
    msgs = [{"role": "user", "content": f"Weather in Paris? {WORDS}"}]
    out, events = reply_then_prefill(srv, {
        "model": "q", "messages": msgs, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 200, "seed": 3, "chat_template_kwargs": {"enable_thinking": False}}, 2)
    call = out["choices"][0]["message"]["tool_calls"][0]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"]
    prompt = out["usage"]["prompt_tokens"]
    rendered = httpx.post(srv.url + "/tokenize", json={
        "messages": [*msgs, out["choices"][0]["message"]], "add_generation_prompt": False,
        "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}).json()["count"]
    print(f"tool-call turn: prompt {prompt}, rendered {rendered}, post-reply prefills "
          f"{[(e['reused'], e['computed']) for e in events]} (reused, computed)")
    assert len(events) >= 2
    for event in events:
        assert event["reused"] >= prompt - SLACK, (event, prompt)
        assert event["computed"] <= rendered - prompt + 2 * SLACK, (event, rendered, prompt)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_other_apis_resent_whole_get_the_same(srv: ServerProcess, api: str) -> None:
    """Anthropic's Messages and the Responses API (``store: false``) resent whole go the same
    chat path: the post-reply prefill resumes at the previous prompt's boundary."""
    text = f"Tell me ({api}). {WORDS}"
    if api == "messages":
        url, body = "/v1/messages", {"model": "q", "max_tokens": 16, "messages": [
            {"role": "user", "content": text}]}
    else:
        url, body = "/v1/responses", {"model": "q", "max_output_tokens": 16, "input": text,
                                      "store": False}
    seen = len(next_turn_events(srv, 0))
    out = httpx.post(srv.url + url, json={**body, "temperature": 0}, timeout=120).json()
    deadline = time.monotonic() + 30
    while not next_turn_events(srv, seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    events = next_turn_events(srv, seen)
    usage = out["usage"]  # Messages counts cache reads apart from input_tokens
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert events and all(e["reused"] >= prompt - SLACK for e in events), (events, prompt)
    assert all(e["computed"] <= 16 + 2 * SLACK for e in events), events


def _conversation(srv: ServerProcess, pause: float) -> list[tuple[list[int], int]]:
    """Three turns, the next sent ``pause`` seconds after each reply: each reply's token
    ids and cached prompt tokens."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Begin. {WORDS}"}]
    got = []
    for turn in range(3):
        out = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "q", "messages": msgs, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}}).json()
        choice = out["choices"][0]
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        got.append((tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"]))
        msgs += [{"role": "assistant", "content": choice["message"]["content"] or ""},
                 {"role": "user", "content": f"Turn {turn}. {WORDS}"}]
        time.sleep(pause)
    return got


def test_a_turn_sent_at_once_gets_what_a_pause_gets(checkpoint: Path) -> None:
    """The same conversation on two fresh servers, each next turn sent the moment its reply
    ends or two seconds later: the same tokens, and the same cached prompt tokens."""
    with serve(checkpoint) as s:
        at_once = _conversation(s, 0.0)
    with serve(checkpoint) as s:
        paused = _conversation(s, 2.0)
    assert at_once == paused
    assert all(cached > 0 for _, cached in paused[1:])
