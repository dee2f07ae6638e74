"""Structured outputs over HTTP with the openai SDK on the shipped weights: JSON that always
parses and validates (50 seeds, checked with ``jsonschema``), regex, choice and grammar
obeyed, streaming, n, sessions and forks, and a 400 saying what is wrong for every invalid
schema or grammar."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "Name a character of the play, with age and role."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "role": {"enum": ["king", "queen", "fool", "ghost", "soldier"]},
        "alive": {"type": "boolean"},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 20},
                  "maxItems": 2},
    },
    "required": ["name", "age", "role", "alive", "lines"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA,
                                                 "strict": True}}


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_json_schema_output_validates_for_50_seeds(server: ServerProcess) -> None:
    def one(seed: int) -> tuple[str, str | None]:
        r = client(server).chat.completions.create(
            model="linear", messages=MESSAGES, response_format=FORMAT,  # type: ignore[arg-type]
            seed=seed, temperature=1.0, max_tokens=200)
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    for text, reason in results:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"
    assert len({text for text, _ in results}) > 40  # sampled, not one fixed answer
    assert list(json.loads(results[0][0])) == list(SCHEMA["properties"])  # schema order


def test_json_object_and_vllm_fields_on_completions(server: ServerProcess) -> None:
    c = client(server)
    r = c.completions.create(model="linear", prompt="HAMLET.\n", max_tokens=120, seed=3,
                             extra_body={"guided_json": {"type": "object", "properties": {
                                 "verdict": {"enum": ["to be", "not to be"]}},
                                 "required": ["verdict"], "additionalProperties": False}})
    assert json.loads(r.choices[0].text)["verdict"] in ("to be", "not to be")
    r = c.completions.create(model="linear", prompt="The year was ", max_tokens=10,
                             extra_body={"guided_regex": "1[56][0-9]{2}"}, temperature=1.0)
    assert re.fullmatch("1[56][0-9]{2}", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"
    choices = ["Montague", "Capulet", "neither, good sir"]
    for seed in range(6):
        r = c.completions.create(model="linear", prompt="Which house?", max_tokens=10, seed=seed,
                                 extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices
    gbnf = 'root ::= "I " verb " thee" \nverb ::= "love" | "hate" | "know"'
    r = c.completions.create(model="linear", prompt="JULIET.\n", max_tokens=10,
                             extra_body={"guided_grammar": gbnf})
    assert re.fullmatch("I (love|hate|know) thee", r.choices[0].text)
    chat = c.chat.completions.create(model="linear", messages=MESSAGES, max_tokens=150,
                                     response_format={"type": "json_object"}, seed=1)
    text = chat.choices[0].message.content or ""
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a free-form object may run out of tokens; it is still JSON so far
        assert text.startswith("{")


def test_streaming_and_n_choices_are_each_constrained(server: ServerProcess) -> None:
    stream = client(server).chat.completions.create(
        model="linear", messages=MESSAGES, response_format=FORMAT,  # type: ignore[arg-type]
        n=4, seed=21, max_tokens=200, stream=True)
    texts = ["", "", "", ""]
    reasons: dict[int, str] = {}
    pieces = 0
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            pieces += 1
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert pieces > 8  # streamed in pieces, not one blob
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert reasons == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}
    assert len(set(texts)) == 4


def test_constrained_turns_in_sessions_and_forks(server: ServerProcess) -> None:
    sess = httpx.post(server.url + "/v1/sessions", json={"prompt": "KING.\n"}).json()
    c = client(server)
    first = c.completions.create(model="linear", prompt="Speak: ", max_tokens=10,
                                 extra_body={"session_id": sess["id"],
                                             "guided_choice": ["ay", "nay"]})
    assert first.choices[0].text in ("ay", "nay")
    fork = httpx.post(f"{server.url}/v1/sessions/{sess['id']}/fork").json()
    before = httpx.get(f"{server.url}/v1/sessions/{sess['id']}").json()["tokens"]
    for sid in (sess["id"], fork["id"]):
        r = c.completions.create(model="linear", prompt=" Count: ", max_tokens=6,
                                 extra_body={"session_id": sid, "guided_regex": "[1-9]"})
        assert re.fullmatch("[1-9]", r.choices[0].text)
        assert r.choices[0].finish_reason == "stop"
        after = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens"]
        assert after > before  # both branches went on from the same constrained turn


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"guided_json": {"type": "foo"}}, "guided_json", "Invalid type"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "object", "if": {}}}, "guided_json", "Unimplemented keys"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "one output constraint"),
    ({"response_format": {"type": "xml"}}, None, "response_format"),
])
def test_invalid_schemas_and_grammars_get_400(server: ServerProcess, extra: dict[str, Any],
                                              param: str | None, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model="linear", prompt="A", max_tokens=4,
                                          extra_body=extra)
    body = err.value.response.json()["error"]
    assert words in body["message"]
    if param is not None:
        assert body["param"] == param and body["code"] == "invalid_grammar"
    assert "Traceback" not in server.logs()
