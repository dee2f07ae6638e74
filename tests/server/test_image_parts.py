"""An image sent to a model without an image encoder is a 400 that says so, in all three
APIs and through their SDKs, never dropped in silence; a part type no API defines is a 400
too; the server and the conversation go on. The shipped model and a Qwen3.5 checkpoint with
its chat template (whose template would render an image part) are both text-only here."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import openai
import pytest

from bench.serverproc import ServerProcess

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.integration
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()
DATA_URL = f"data:image/png;base64,{PNG}"


@pytest.fixture(params=["linear", "qwen"])
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    name = "server" if request.param == "linear" else "qwen_agent"
    server: ServerProcess = request.getfixturevalue(name)
    return server


def _openai(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _still_serves(srv: ServerProcess) -> None:
    reply = _openai(srv).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Speak."}], max_tokens=3)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_chat_with_an_image_part_is_a_400_that_says_so(srv: ServerProcess) -> None:
    content: Any = [{"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            _openai(srv).chat.completions.create(
                model="m", messages=[{"role": "user", "content": content}], max_tokens=4,
                stream=stream)
        assert err.value.status_code == 400
        assert "takes no image input" in err.value.message
        body: Any = err.value.body
        assert body["param"] == "messages[0].content" and body["code"] == "unsupported_input"
    _still_serves(srv)


def test_responses_with_an_input_image_is_a_400_that_says_so(srv: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _openai(srv).responses.create(model="m", max_output_tokens=4, input=[{
            "role": "user", "content": [
                {"type": "input_text", "text": "Describe it."},
                {"type": "input_image", "image_url": DATA_URL, "detail": "high"}]}])
    assert "takes no image input" in err.value.message
    _still_serves(srv)


def test_messages_with_an_image_block_is_a_400_that_says_so(srv: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    assert "takes no image input" in str(err.value)
    with pytest.raises(anthropic.BadRequestError):  # an image inside a tool's result too
        client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": "Look."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [image]}]}])
    count = httpx.post(srv.url + "/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "user", "content": [image]}]})
    assert count.status_code == 400 and "takes no image input" in count.text
    _still_serves(srv)


def test_a_part_type_no_api_defines_is_a_400(server: ServerProcess) -> None:
    reply = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
        "max_tokens": 3})
    assert reply.status_code == 400
    assert "'input_audio' are not supported" in reply.json()["error"]["message"]
