"""The OpenAI Responses API through the official openai SDK: whole and streamed responses,
three turns through ``previous_response_id`` (only the new input prefilled, the same tokens
as the conversation resent whole), branching, a tool round trip, structured outputs,
reasoning, the stored responses' routes and the errors. On the project's default model
(plain template) and on a tiny Qwen3.5 checkpoint with its own template."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                     "description": "The weather in a city"}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 12,
                          "reasoning": {"effort": "none"}}


@pytest.fixture(params=["linear", "qwen"])
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    name = "server" if request.param == "linear" else "qwen_agent"
    server: ServerProcess = request.getfixturevalue(name)
    return server


def sdk(server: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def model(server: ServerProcess) -> str:
    return str(httpx.get(server.url + "/v1/models").json()["data"][0]["id"])


def test_create_and_stream_agree(srv: ServerProcess) -> None:
    """A streamed response is the created one: the SDK's accumulated final response, the
    events in order with increasing sequence numbers, and GET of the stored one."""
    c, m = sdk(srv), model(srv)
    whole = c.responses.create(model=m, input="Hello there", instructions="Be brief.",
                               **GREEDY)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.usage is not None
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    with c.responses.stream(model=m, input="Hello there", instructions="Be brief.",
                            **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    stored = c.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage == final.usage


def test_three_turns_continue_like_the_conversation_resent(srv: ServerProcess) -> None:
    """Each turn through previous_response_id prefills only its new input (cached_tokens:
    all the stored conversation) and says what the whole conversation resent says."""
    c, m = sdk(srv), model(srv)
    questions = ["Hello there", "And then?", "Why so?"]
    previous = None
    history: list[Any] = []
    for k, question in enumerate(questions):
        extra = {"previous_response_id": previous.id} if previous else {
            "instructions": "Be brief."}
        turn = c.responses.create(model=m, input=question, **extra, **GREEDY)
        history.append({"role": "user", "content": question})
        resent = c.responses.create(model=m, input=history, instructions="Be brief.",
                                    store=False, **GREEDY)
        assert turn.output_text == resent.output_text, f"turn {k}"
        assert turn.usage is not None and resent.usage is not None
        assert turn.usage.input_tokens == resent.usage.input_tokens
        if previous is not None:
            assert previous.usage is not None
            cached = turn.usage.input_tokens_details.cached_tokens
            assert cached >= previous.usage.input_tokens
            assert turn.usage.input_tokens - cached <= resent.usage.input_tokens - \
                previous.usage.input_tokens - previous.usage.output_tokens + 8
        assert turn.previous_response_id == (previous.id if previous else None)
        history.append({"role": "assistant", "content": turn.output_text})
        previous = turn


def test_two_continuations_of_one_response_are_forks(srv: ServerProcess) -> None:
    c, m = sdk(srv), model(srv)
    root = c.responses.create(model=m, input="Hello there", **GREEDY)
    a = c.responses.create(model=m, input="And then?", previous_response_id=root.id, **GREEDY)
    b = c.responses.create(model=m, input="Tell me more of it",
                           previous_response_id=root.id, **GREEDY)
    again = c.responses.create(model=m, input="And then?", previous_response_id=root.id,
                               **GREEDY)
    assert again.output_text == a.output_text
    assert a.usage is not None and b.usage is not None
    assert a.usage.input_tokens_details.cached_tokens == \
        b.usage.input_tokens_details.cached_tokens
    assert c.responses.retrieve(root.id).output_text == root.output_text


def test_stored_response_routes(srv: ServerProcess) -> None:
    c, m = sdk(srv), model(srv)
    first = c.responses.create(model=m, input=[
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "!"}]}],
        metadata={"k": "v"}, **GREEDY)
    assert first.metadata == {"k": "v"}
    items = c.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message", "message"]
    assert [i.content[0].text for i in items.data] == ["!", "Hello"]  # newest first
    asc = c.responses.input_items.list(first.id, order="asc", limit=1)
    assert [i.content[0].text for i in asc.data] == ["Hello"] and asc.has_more
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=m, input="x", previous_response_id=first.id)
    unstored = c.responses.create(model=m, input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.retrieve(unstored.id)
    assert err.value.body["param"] == "response_id"  # type: ignore[index]


def test_structured_output_through_text_format(srv: ServerProcess) -> None:
    c, m = sdk(srv), model(srv)
    age = {"type": "integer", "minimum": 0, "maximum": 150}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": age},
              "required": ["name", "age"], "additionalProperties": False}
    reply = c.responses.create(model=m, input="A person, as JSON", max_output_tokens=60,
                               text={"format": {"type": "json_schema", "name": "person",
                                                "schema": schema, "strict": True}},
                               reasoning={"effort": "none"}, extra_body={"seed": 3})
    data = json.loads(reply.output_text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)
    assert reply.text is not None and reply.text.format.type == "json_schema"


def test_errors_name_the_field(srv: ServerProcess) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({}, "input")]
    for body, param in bad:
        r = httpx.post(srv.url + "/v1/responses", json=body)
        assert r.status_code == 400, (body, r.text)
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    first = sdk(srv).responses.create(model=model(srv), input="Hi", instructions="A",
                                      **GREEDY)
    r = httpx.post(srv.url + "/v1/responses", json={
        "input": "x", "instructions": "B", "previous_response_id": first.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instructions"
    r = httpx.post(srv.url + "/v1/responses", json={
        "input": "x", "instructions": "A", "previous_response_id": first.id,
        "max_output_tokens": 2})
    assert r.status_code == 200


def test_a_tool_round_trip(qwen_agent: ServerProcess) -> None:
    """A forced call comes back as a function_call item; its output continues the stored
    response, and the same items resent whole are accepted too."""
    c = sdk(qwen_agent)
    ask = "What is the weather in Paris?"
    first = c.responses.create(model="q", input=ask, tools=TOOLS, tool_choice="required",
                               max_output_tokens=80,
                               extra_body={"seed": 1})
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with c.responses.stream(model="q", input=ask, tools=TOOLS, tool_choice="required",
                            max_output_tokens=80,
                            extra_body={"seed": 1}) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 2, "the arguments stream as they are generated, not whole at the end"
    assert done == ["".join(pieces)] == [calls[0].arguments]
    assert [(o.type, getattr(o, "arguments", None)) for o in streamed.output] == \
        [(o.type, getattr(o, "arguments", None)) for o in first.output]
    result = [{"type": "function_call_output", "call_id": calls[0].call_id,
               "output": "sunny, 21 C"}]
    follow = c.responses.create(model="q", input=result, previous_response_id=first.id,
                                tools=TOOLS, **GREEDY)
    resent = c.responses.create(model="q", input=[
        {"role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in calls],
        *result], tools=TOOLS, store=False, **GREEDY)
    assert follow.output_text == resent.output_text
    assert follow.usage is not None and resent.usage is not None
    assert follow.usage.input_tokens == resent.usage.input_tokens


def test_reasoning_items(qwen_agent: ServerProcess) -> None:
    c = sdk(qwen_agent)
    on = c.responses.create(model="q", input="Think", reasoning={"effort": "high"},
                            max_output_tokens=20, extra_body={"seed": 2})
    kinds = [o.type for o in on.output]
    assert kinds[0] == "reasoning" and on.output[0].content[0].text  # type: ignore[union-attr]
    assert on.usage is not None and on.usage.output_tokens_details.reasoning_tokens > 0
    off = c.responses.create(model="q", input="Think", reasoning={"effort": "none"},
                             max_output_tokens=20, extra_body={"seed": 2})
    assert [o.type for o in off.output] == ["message"]
    assert off.usage is not None and off.usage.output_tokens_details.reasoning_tokens == 0


def test_the_readme_lists_every_refused_field(server: ServerProcess) -> None:
    """Each field the Responses and Messages APIs refuse is named in docs/api.md's lists and
    answered with a 400 that names it."""
    from bench.serverproc import ROOT
    from linserve.server.api.messages.protocol import REFUSED as MESSAGES_REFUSED
    from linserve.server.api.responses.protocol import REFUSED as RESPONSES_REFUSED

    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/input_items", "/v1/messages",
            "/v1/messages/count_tokens"} <= set(paths)
    readme = (ROOT / "docs" / "api.md").read_text()
    section = readme[readme.index("## Agent APIs"):]
    responses = section[section.index("**`POST /v1/responses`**"):
                        section.index("**Stored responses")]
    messages = section[section.index("**`POST /v1/messages`**"):]
    for name in RESPONSES_REFUSED:
        assert f"`{name}`" in responses.split("*Refused")[1], name
        r = httpx.post(server.url + "/v1/responses", json={"input": "x", name: [1]})
        assert r.status_code == 400 and name in r.json()["error"]["message"], name
    for name in MESSAGES_REFUSED:
        assert f"`{name}`" in messages.split("*Refused")[1], name
        r = httpx.post(server.url + "/v1/messages", json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
            name: [1]})
        assert r.status_code == 400 and name in r.json()["error"]["message"], name
