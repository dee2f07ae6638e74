"""Tool calls and reasoning through HTTP with the openai SDK, on a random-weight Qwen3.5
checkpoint with the real Qwen tokenizer and Qwen3.5's own template, served with
``--reasoning-parser qwen3`` (the tool-call parser defaults to qwen3_xml from the template)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serverproc import ServerProcess
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.protocol import ChatMessage
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.integration
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen-tools"), "i4-tied")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess.serving(checkpoint, "--reasoning-parser", "qwen3",
                               "--served-model-name", "q") as srv:
        yield srv


def client(server: ServerProcess) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _check(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_are_valid_for_50_seeds(server: ServerProcess, choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "add"}}
    allowed = {"get_weather", "add"} if choice == "required" else {"add"}

    def one(seed: int) -> Any:
        return client(server).chat.completions.create(
            model="q", messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=seed,
            temperature=1.0, max_tokens=200, parallel_tool_calls=False).choices[0]

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(50)))
    for reply in replies:
        assert reply.finish_reason == "tool_calls"
        assert reply.message.content is None and len(reply.message.tool_calls) == 1
        _check(reply.message.tool_calls, allowed)
    assert len({r.message.tool_calls[0].function.arguments for r in replies}) > 10


def test_forced_calls_stream_and_reassemble(server: ServerProcess) -> None:
    for seed in range(5):
        stream = client(server).chat.completions.create(
            model="q", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            max_tokens=300, stream=True)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function and d.function.name:
                    assert d.id, "the first chunk of a call carries its id and name"
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
        assert finish == "tool_calls" and calls
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_forced_arguments_stream_through_the_sdk_helper(server: ServerProcess) -> None:
    """The openai SDK's stream helper sees each call's arguments in many pieces as they are
    generated; joined they are the final arguments, and the non-streamed reply's."""
    c = client(server)
    for seed in range(3):
        kwargs: dict[str, Any] = {"model": "q", "messages": ASK, "tools": TOOLS,
                                  "tool_choice": "required", "seed": seed, "max_tokens": 300,
                                  "parallel_tool_calls": False}
        whole = c.chat.completions.create(**kwargs).choices[0].message.tool_calls
        with c.chat.completions.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_completion().choices[0].message.tool_calls
        pieces = [e.arguments_delta for e in events
                  if e.type == "tool_calls.function.arguments.delta"]
        done = [e.arguments for e in events if e.type == "tool_calls.function.arguments.done"]
        assert len(pieces) > 2, "arguments must stream, not come whole at the end"
        assert done == ["".join(pieces)] == [final[0].function.arguments]
        assert [t.function.arguments for t in whole] == done


def test_auto_and_none_answer_in_text_without_crashing(server: ServerProcess) -> None:
    """A random model writes no calls: with auto its text stays content (and reasoning);
    with none the tools are not even rendered."""
    c = client(server)
    for choice in ("auto", "none"):
        reply = c.chat.completions.create(model="q", messages=ASK, tools=TOOLS,
                                          tool_choice=choice, max_tokens=30, seed=1,
                                          extra_body={"chat_template_kwargs": {
                                              "enable_thinking": False}}).choices[0]
        assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS})
    without = httpx.post(server.url + "/tokenize", json={"messages": ASK})
    assert "get_weather" in with_tools.json()["prompt"]
    assert with_tools.json()["count"] > without.json()["count"]


def test_reasoning_on_and_off(server: ServerProcess, checkpoint: Path) -> None:
    """Thinking on: the prompt opens <think>, and a reply that never closes it is all
    reasoning. Off (chat_template_kwargs): no reasoning_content, the text is the answer."""
    c = client(server)
    on = c.chat.completions.create(model="q", messages=ASK, max_tokens=20, seed=2,
                                   temperature=0)
    off = c.chat.completions.create(model="q", messages=ASK, max_tokens=20, seed=2,
                                    temperature=0,
                                    extra_body={"chat_template_kwargs": {
                                        "enable_thinking": False}})
    on_msg, off_msg = on.choices[0].message, off.choices[0].message
    assert getattr(on_msg, "reasoning_content", None) and not on_msg.content
    assert not getattr(off_msg, "reasoning_content", None) and off_msg.content is not None
    rendered = httpx.post(server.url + "/tokenize", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
    source = (checkpoint / "chat_template.jinja").read_text()
    assert rendered == TemplateChat(source).render([ChatMessage.model_validate(ASK[0])],
                                                   enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")


def test_a_tool_round_trip_is_accepted(server: ServerProcess) -> None:
    """The assistant's tool_calls and the tool's result, sent back as the next turn."""
    first = client(server).chat.completions.create(
        model="q", messages=ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=200,
        parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    messages: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    reply = client(server).chat.completions.create(model="q", messages=messages, tools=TOOLS,
                                                   max_tokens=10, seed=3)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]


def _assistant(message: Any) -> dict[str, Any]:
    """A reply as a client resends it in the next stateless request."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    extra = message.model_extra or {}
    if extra.get("reasoning_content") is not None:
        out["reasoning_content"] = extra["reasoning_content"]
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return out


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' ids (random per reply) blanked."""
    calls = [{**c, "id": ""} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls} if calls else message


def test_template_chat_session_continues_as_the_whole_conversation(server: ServerProcess
                                                                   ) -> None:
    """Three turns through ``session_id`` (thinking, a forced tool call, a tool result) give
    the replies the same conversation sent whole gives each turn: the session holds what the
    template renders of earlier turns (their reasoning dropped, calls in Qwen's syntax)."""
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    turns: list[tuple[list[Any], Any]] = [
        ([{"role": "user", "content": "Hello, who are you?"}], "auto"),
        ([{"role": "user", "content": "Add 2 and 3."}], "required"),
        ([{"role": "tool", "tool_call_id": "", "content": "5"},
          {"role": "user", "content": "Thanks."}], "auto")]
    history: list[Any] = []
    for new, choice in turns:
        if new[0]["role"] == "tool":
            new[0]["tool_call_id"] = history[-1]["tool_calls"][0]["id"]
        kwargs: dict[str, Any] = {"model": "q", "tools": TOOLS, "tool_choice": choice,
                                  "temperature": 0, "parallel_tool_calls": False,
                                  "max_tokens": 200 if choice == "required" else 24}
        via = client(server).chat.completions.create(
            messages=new, extra_body={"session_id": sid}, **kwargs).choices[0].message
        history += new
        whole = client(server).chat.completions.create(messages=history, **kwargs)
        assert _without_ids(_assistant(via)) == _without_ids(_assistant(whole.choices[0].message))
        history.append(_assistant(via))
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert info["tokens"] > 0


def test_template_chat_session_refuses_what_would_change_earlier_turns(server: ServerProcess
                                                                       ) -> None:
    """Other tools than the session's earlier turns were rendered with, or a session that
    holds raw text, are a 400 (the session is kept as it was)."""
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    first = {"model": "q", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
             "max_tokens": 4, "session_id": sid}
    assert httpx.post(server.url + "/v1/chat/completions", json=first,
                      timeout=60).status_code == 200
    tokens = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"]
    changed = {**first, "tools": TOOLS[:1]}
    bad = httpx.post(server.url + "/v1/chat/completions", json=changed, timeout=60)
    assert bad.status_code == 400 and "render" in bad.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"] == tokens
    raw = httpx.post(server.url + "/v1/sessions", json={"prompt": "Once upon a time"}).json()
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={**first, "session_id": raw["id"]}, timeout=60)
    assert bad.status_code == 400 and "raw text" in bad.json()["error"]["message"]


def test_template_chat_session_survives_export_and_import(server: ServerProcess) -> None:
    """An exported chat session carries its conversation: the imported copy continues
    exactly as the original does."""
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    ask = {"model": "q", "max_tokens": 6, "temperature": 0}
    httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **ask, "session_id": sid, "messages": [{"role": "user", "content": "Hi"}]})
    blob = httpx.get(f"{server.url}/v1/sessions/{sid}/state").content
    copy = httpx.post(server.url + "/v1/sessions/import", content=blob,
                      headers={"Content-Type": "application/octet-stream"}).json()["id"]
    nxt = [{"role": "user", "content": "And then?"}]
    a, b = (httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **ask, "session_id": s, "messages": nxt}).json()["choices"][0]["message"]
        for s in (sid, copy))
    assert a == b
