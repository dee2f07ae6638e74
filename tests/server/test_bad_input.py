"""A matrix of bad inputs: each gets the right 4xx in OpenAI's envelope, never a 500, and the
server stays healthy."""

from __future__ import annotations

import os

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration

C = "/v1/completions"
CASES: list[tuple[str, str, object, int]] = [
    ("invalid json", C, b"{not json", 400),
    ("not an object", C, b"[1, 2]", 400),
    ("wrong type prompt", C, {"prompt": 5}, 400),
    ("wrong type max_tokens", C, {"prompt": "a", "max_tokens": "many"}, 400),
    ("negative max_tokens", C, {"prompt": "a", "max_tokens": -1}, 400),
    ("zero max_tokens", C, {"prompt": "a", "max_tokens": 0}, 400),
    ("huge max_tokens", C, {"prompt": "a", "max_tokens": 10**9}, 400),
    ("temperature too high", C, {"prompt": "a", "temperature": 5}, 400),
    ("negative temperature", C, {"prompt": "a", "temperature": -0.1}, 400),
    ("top_p zero", C, {"prompt": "a", "top_p": 0}, 400),
    ("top_p above one", C, {"prompt": "a", "top_p": 1.5}, 400),
    ("presence out of range", C, {"prompt": "a", "presence_penalty": 3}, 400),
    ("frequency out of range", C, {"prompt": "a", "frequency_penalty": -2.5}, 400),
    ("repetition penalty zero", C, {"prompt": "a", "repetition_penalty": 0}, 400),
    ("min_p out of range", C, {"prompt": "a", "min_p": 2}, 400),
    ("n above the limit", C, {"prompt": "a", "n": 17}, 400),
    ("best_of above the limit", C, {"prompt": "a", "best_of": 17}, 400),
    ("n with an unknown session", C, {"prompt": "a", "n": 2, "session_id": "sess_x"}, 404),
    ("logit_bias key not a token id", C, {"prompt": "a", "logit_bias": {"x": 1}}, 400),
    ("logit_bias token outside the vocabulary", C,
     {"prompt": "a", "logit_bias": {"99999": 1}}, 400),
    ("logit_bias value out of range", C, {"prompt": "a", "logit_bias": {"5": 101}}, 400),
    ("too many prompts", C, {"prompt": ["a"] * 33}, 400),
    ("bool for a number", C, {"prompt": "a", "presence_penalty": False}, 400),
    ("suffix (not implemented)", C, {"prompt": "a", "suffix": "end"}, 400),
    ("prompt_logprobs (not implemented)", C, {"prompt": "a", "prompt_logprobs": 1}, 400),
    ("guided_json not a schema", C, {"prompt": "a", "guided_json": {"type": "thing"}}, 400),
    ("response_format of an unknown type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "yaml"}},
     400),
    ("structural_tag (not implemented)", C,
     {"prompt": "a", "structured_outputs": {"structural_tag": "{}"}}, 400),
    ("guided_choice with an empty choice", C, {"prompt": "a", "guided_choice": ["a", ""]}, 400),
    ("logprobs too many", C, {"prompt": "a", "logprobs": 50}, 400),
    ("empty prompt without session", C, {"prompt": ""}, 400),
    ("empty token list", C, {"prompt": []}, 400),
    ("prompt over the limit", C, {"prompt": list(range(1, 8000)) * 5}, 400),
    ("token id out of vocabulary", C, {"prompt": [1, 2, 10**6]}, 400),
    ("negative token id", C, {"prompt": [-1]}, 400),
    ("stop token out of vocabulary", C, {"prompt": "a", "stop_token_ids": [10**7]}, 400),
    ("too many stops", C, {"prompt": "a", "stop": ["x"] * 20}, 400),
    ("empty stop", C, {"prompt": "a", "stop": [""]}, 400),
    ("unknown session", C, {"prompt": "a", "session_id": "sess_nope"}, 404),
    ("huge body", C, b'{"prompt": "' + b"a" * (33 << 20) + b'"}', 413),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe\xfd"}', 400),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, 400),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]},
     400),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**8]}, 400),
    ("tokenize nothing", "/tokenize", {}, 400),
    ("import random bytes", "/v1/sessions/import", os.urandom(4096), 400),
    ("import empty", "/v1/sessions/import", b"", 400),
    ("import truncated header", "/v1/sessions/import", b"\x10\x00\x00\x00\x00\x00\x00\x00{",
     400),
    ("unknown route", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(server: ServerProcess, name: str, path: str, body: object,
                   status: int) -> None:
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, timeout=30,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and "/work/" not in r.text and ".py" not in r.text


def test_unknown_fields_are_tolerated(server: ServerProcess) -> None:
    r = httpx.post(server.url + C, json={"prompt": "a", "max_tokens": 2, "best_of": 1,
                                         "use_beam_search": False, "skip_special_tokens": True,
                                         "spaces_between_special_tokens": True}, timeout=30)
    assert r.status_code == 200


def test_still_healthy_after_the_matrix(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


def test_best_of_below_n_is_refused(server: ServerProcess) -> None:
    """OpenAI and vLLM refuse best_of < n; so does this server, naming best_of."""
    from openai import BadRequestError, OpenAI

    r = httpx.post(server.url + C, json={"prompt": "a", "n": 12, "best_of": 2}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "best_of"
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="x", prompt="a", n=3, best_of=2, max_tokens=2)
    assert err.value.body["param"] == "best_of"  # type: ignore[index]
    ok = client.completions.create(model="x", prompt="a", n=2, best_of=2, max_tokens=2)
    assert len(ok.choices) == 2


REFUSED_VALUES: dict[str, object] = {
    "suffix": "end", "min_tokens": 2, "use_beam_search": True, "functions": [{"name": "f"}],
    "prompt_logprobs": 1, "include_stop_str_in_output": True, "bad_words": ["a"],
    "allowed_token_ids": [1, 2], "truncate_prompt_tokens": 5}


def _readme_list(start: str, end: str) -> str:
    from bench.serverproc import ROOT

    text = (ROOT / "docs" / "api.md").read_text()
    return text[text.index(start):text.index(end)]


def test_the_readme_field_lists_agree_with_the_server(server: ServerProcess) -> None:
    """Every field docs/api.md lists as refused is refused, every one it lists as ignored is
    accepted, and the request models refuse nothing the page does not list."""
    from linserve.server.api.protocol import REFUSED

    refused = _readme_list("*Refused (400):*", "*Accepted and ignored")
    ignored = _readme_list("*Accepted and ignored", "*Accepted and used in chat*")
    assert set(REFUSED) == set(REFUSED_VALUES)
    for name, value in REFUSED_VALUES.items():
        assert f"`{name}`" in refused, name
        r = httpx.post(server.url + C, json={"prompt": "a", name: value}, timeout=30)
        assert r.status_code == 400 and name in r.json()["error"]["message"], name
    for name, value in {"user": "u", "metadata": {"k": "v"}, "store": True,
                        "service_tier": "auto", "guided_decoding_backend": "xgrammar",
                        "model": "anything"}.items():
        assert f"`{name}`" in ignored, name
        r = httpx.post(server.url + C, json={"prompt": "a", "max_tokens": 2, name: value},
                       timeout=30)
        assert r.status_code == 200, (name, r.text)
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    assert "`tool_choice` of `required` or a named tool without `tools`" in refused
    r = httpx.post(server.url + chat, json={"messages": msgs, "tool_choice": "required"})
    assert r.status_code == 400
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}}}}]
    r = httpx.post(server.url + chat, json={"messages": msgs, "tools": tools, "max_tokens": 40,
                                            "tool_choice": "required"}, timeout=60)
    assert r.status_code == 200, r.text  # enforced by a grammar, not refused
