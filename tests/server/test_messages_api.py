"""Anthropic's Messages API through the official anthropic SDK: messages.create and
messages.stream, stop reasons, system blocks, a tool-use round trip, thinking blocks,
count_tokens, the prefix cache's reads, and errors in Anthropic's envelope. On the
project's default model and on a tiny Qwen3.5 checkpoint with its own template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serverproc import ServerProcess

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.integration
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER}]
GREEDY: dict[str, Any] = {"max_tokens": 12, "extra_body": {"temperature": 0.0}}
HELLO: list[Any] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(params=["linear", "qwen"])
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    name = "server" if request.param == "linear" else "qwen_agent"
    server: ServerProcess = request.getfixturevalue(name)
    return server


def sdk(server: ServerProcess, key: str = "none") -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_create_and_stream_agree(srv: ServerProcess) -> None:
    c = sdk(srv)
    whole = c.messages.create(model="m", messages=HELLO, system="Be brief.", **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "m"
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content
    assert whole.usage.output_tokens <= 12
    with c.messages.stream(model="m", messages=HELLO,
                           system=[{"type": "text", "text": "Be brief."}], **GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(kinds)
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    counted = c.messages.count_tokens(model="m", messages=HELLO, system="Be brief.")
    assert counted.input_tokens == total


def test_stop_sequences_and_max_tokens(server: ServerProcess) -> None:
    c = sdk(server)
    free = c.messages.create(model="m", messages=HELLO, max_tokens=40,
                             extra_body={"temperature": 0.0})
    assert free.stop_reason == "max_tokens"
    text = free.content[0].text
    word = next(w for w in text.split()[1:] if w.isalpha())
    cut = c.messages.create(model="m", messages=HELLO, max_tokens=40, stop_sequences=[word],
                            extra_body={"temperature": 0.0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert text.startswith(cut.content[0].text) and word not in cut.content[0].text


def test_resending_the_conversation_reads_the_cache(srv: ServerProcess) -> None:
    """A client that resends the whole conversation at once has all of it but the new
    message served from the prefix cache (``cache_read_input_tokens``): with a template,
    the next turn waits for the conversation's prefill that the reply started."""
    c = sdk(srv)
    history: list[Any] = [{"role": "user", "content": "Hello there, tell me a story"}]
    first = c.messages.create(model="m", messages=history, system="Be brief.", **GREEDY)
    history += [{"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "And then?"}]
    second = c.messages.create(model="m", messages=history, system="Be brief.", **GREEDY)
    whole = second.usage.input_tokens + second.usage.cache_read_input_tokens
    new = c.messages.count_tokens(model="m", messages=history, system="Be brief.")
    assert new.input_tokens == whole
    earlier = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= earlier + first.usage.output_tokens - 2


def test_errors_in_anthropics_envelope(srv: ServerProcess) -> None:
    c = sdk(srv)
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model="m", messages=HELLO, max_tokens=0)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    for body, needle in [({"model": "m", "messages": HELLO}, "max_tokens"),
                         ({"model": "m", "max_tokens": 5, "messages": [
                             {"role": "user", "content": [{"type": "image", "source": {}}]}]},
                          "messages"),
                         ({"model": "m", "max_tokens": 5, "messages": HELLO,
                           "tool_choice": {"type": "any"}}, "tool_choice"),
                         ({"model": "m", "max_tokens": 5, "messages": HELLO,
                           "mcp_servers": [{"url": "x"}]}, "mcp_servers")]:
        r = httpx.post(srv.url + "/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert needle in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", content=b"{", headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_keys_by_either_header(linear_weights: Path) -> None:
    with ServerProcess(linear_weights, env={"LINSERVE_API_KEYS": "key-a"}) as keyed:
        assert sdk(keyed, "key-a").messages.create(model="m", messages=HELLO, **GREEDY)
        with pytest.raises(anthropic.AuthenticationError) as err:
            sdk(keyed, "wrong").messages.create(model="m", messages=HELLO, **GREEDY)
        assert err.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(keyed.url + "/v1/chat/completions", headers={"x-api-key": "key-a"},
                       json={"messages": HELLO, "max_tokens": 2})
        assert r.status_code == 200


def test_a_tool_use_round_trip(qwen_agent: ServerProcess) -> None:
    c = sdk(qwen_agent)
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.messages.create(model="q", messages=ask, tools=TOOLS, max_tokens=80,
                              tool_choice={"type": "any"},
                              extra_body={"temperature": 1.0, "seed": 1})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and set(uses[0].input) == {"city"}
    assert uses[0].id.startswith("toolu_")
    with c.messages.stream(model="q", messages=ask, tools=TOOLS, max_tokens=80,
                           tool_choice={"type": "any"},
                           extra_body={"temperature": 1.0, "seed": 1}) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    pieces = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert len(pieces) > 2, "the input streams as it is generated, not whole at the end"
    assert json.loads("".join(pieces)) == uses[0].input
    assert [b.input for b in streamed.content if b.type == "tool_use"] == \
        [u.input for u in uses]
    follow = c.messages.create(model="q", tools=TOOLS, messages=[
        *ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny, 21 C"}]}], **GREEDY)
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the conversation with the call, as the template renders it next, was cached
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert follow.usage.cache_read_input_tokens > before
    rendered = httpx.post(qwen_agent.url + "/v1/messages/count_tokens", json={
        "model": "q", "tools": TOOLS, "messages": [
            *ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "sunny, 21 C"}]}]})
    assert rendered.status_code == 200 and rendered.json()["input_tokens"] > 30
    assert json.dumps(uses[0].input)


def test_thinking_blocks(qwen_agent: ServerProcess) -> None:
    c = sdk(qwen_agent)
    on = c.messages.create(model="q", messages=HELLO, max_tokens=20,
                           thinking={"type": "enabled", "budget_tokens": 10},
                           extra_body={"seed": 2})
    assert on.content[0].type == "thinking" and on.content[0].thinking
    with c.messages.stream(model="q", messages=HELLO, max_tokens=20,
                           thinking={"type": "enabled", "budget_tokens": 10},
                           extra_body={"seed": 2}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == on.content[0].thinking
    off = c.messages.create(model="q", messages=HELLO, max_tokens=20,
                            extra_body={"seed": 2})
    assert all(b.type == "text" for b in off.content)
