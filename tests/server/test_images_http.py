"""Images served as users send them, to a Qwen3.5 vision-language checkpoint with its own
tokenizer and chat template: chat (streaming or not), the Responses API and Anthropic's
Messages API through their SDKs answer what transformers answers for the same picture; the
same picture sent again is served from the caches, one that differs in a pixel is not;
sessions and previous_response_id carry it; image URLs are fetched only where allowed;
bad images, too many and too large ones are 400s, and the server goes on."""

from __future__ import annotations

import base64
import http.server
import io
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from bench.serverproc import ServerProcess
from tests.model.qwen_fixtures import make_checkpoint, reference
from tests.model.vision_fixtures import hf_processor, picture

anthropic = pytest.importorskip("anthropic")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration
QUESTION = "What is in this picture?"


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vl-http")
    media = tmp / "media"
    media.mkdir()
    (media / "a.png").write_bytes(picture(120, 90, 7))
    return {"model": make_checkpoint(tmp / "vl", "i4-tied", vision=True), "media": media}


@pytest.fixture(scope="module")
def site(files: dict[str, Path]) -> Iterator[str]:
    """A local web server of the media folder."""
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                   {"log_message": lambda *a: None})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(files["media"])))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def srv(files: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess.serving(
            files["model"], "--served-model-name", "vl", "--limit-mm-per-prompt",
            '{"image": 3}', "--allowed-media-domains", "127.0.0.1",
            "--allowed-local-media-path", str(files["media"]), "--media-max-bytes",
            "400000") as s:
        yield s


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _chat(srv: ServerProcess, content: Any, **extra: Any) -> Any:
    return _client(srv).chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=6,
        temperature=0, **extra)


def _content(url: str, detail: str = "auto") -> list[dict[str, Any]]:
    return [{"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": url, "detail": detail}}]


def _reference_text(model: Path, pictures: list[bytes], n: int = 6) -> str:
    """What transformers answers, greedy, for QUESTION and the pictures (its tokenizer's
    chat template, each placeholder expanded as its processor does)."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image"} for _ in pictures]
    text = tok.apply_chat_template([{"role": "user", "content": content}],
                                   add_generation_prompt=True, tokenize=False)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    proc = hf_processor(model)(images=[Image.open(io.BytesIO(p)) for p in pictures],
                               return_tensors="pt")
    pad = 151655
    expanded: list[int] = []
    grids = iter(proc["image_grid_thw"].tolist())
    for t in ids:
        expanded += [pad] * (int(np.prod(next(grids))) // 4) if t == pad else [t]
    inputs = {"input_ids": torch.tensor([expanded]), "pixel_values": proc["pixel_values"],
              "image_grid_thw": proc["image_grid_thw"],
              "mm_token_type_ids": (torch.tensor([expanded]) == pad).int()}
    with torch.no_grad():
        out = reference(model).generate(**inputs, max_new_tokens=n, do_sample=False)
    return str(tok.decode(out[0, len(expanded):], skip_special_tokens=True))


def test_chat_answers_as_transformers_and_caches_the_picture(srv: ServerProcess,
                                                             files: dict[str, Path]) -> None:
    pic = picture(100, 180, 1)
    first = _chat(srv, _content(data_url(pic)))
    assert first.choices[0].message.content == _reference_text(files["model"], [pic])
    text_only = _chat(srv, QUESTION)
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + 18  # its 3 × 6 tokens
    again = _chat(srv, _content(data_url(pic)))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
    pixels = np.asarray(Image.open(io.BytesIO(pic))).copy()
    pixels[50, 50, 0] ^= 1  # one pixel, one bit
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    other = _chat(srv, _content(data_url(out.getvalue())))
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens < 20  # not the first picture's
    streamed = _chat(srv, _content(data_url(pic)), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == first.choices[0].message.content


def test_two_pictures_and_every_source(srv: ServerProcess, files: dict[str, Path],
                                       site: str) -> None:
    a, b = picture(100, 180, 1), (files["media"] / "a.png").read_bytes()
    content = [*_content(data_url(a)), {"type": "image_url",
                                        "image_url": {"url": f"{site}/a.png"}}]
    reply = _chat(srv, content)
    assert reply.choices[0].message.content == _reference_text(files["model"], [a, b])
    local = [*_content(data_url(a)), {"type": "image_url", "image_url": {
        "url": (files["media"] / "a.png").as_uri()}}]
    assert _chat(srv, local).choices[0].message.content == reply.choices[0].message.content


def test_responses_and_messages_see_the_picture(srv: ServerProcess,
                                                files: dict[str, Path]) -> None:
    pic = picture(90, 90, 3)
    want = _chat(srv, _content(data_url(pic))).choices[0].message.content
    first = _client(srv).responses.create(model="vl", max_output_tokens=6, temperature=0,
                                          input=[{"role": "user", "content": [
                                              {"type": "input_text", "text": QUESTION},
                                              {"type": "input_image",
                                               "image_url": data_url(pic)}]}])
    assert first.output_text == want
    follow = _client(srv).responses.create(model="vl", max_output_tokens=4, temperature=0,
                                           previous_response_id=first.id, input="And?")
    assert follow.status in ("completed", "incomplete")  # (max_output_tokens reached)
    assert follow.usage.input_tokens > first.usage.input_tokens  # the picture is still there
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    msg = client.messages.create(model="vl", max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(pic).decode()}}]}])
    plain = _chat(srv, _content(data_url(pic)),  # the Messages API thinks only when asked
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "".join(b.text for b in msg.content if b.type == "text") == \
        plain.choices[0].message.content
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(pic).decode()}}
    count = httpx.post(srv.url + "/v1/messages/count_tokens", json={
        "model": "vl", "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, image]}]}).json()["input_tokens"]
    assert count == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    tool = client.messages.create(model="vl", max_tokens=4, messages=[
        {"role": "user", "content": "Take a picture."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [image]}]}])
    assert tool.usage.input_tokens + (tool.usage.cache_read_input_tokens or 0) > count - 10


def test_a_session_keeps_its_picture(srv: ServerProcess) -> None:
    sid = httpx.post(srv.url + "/v1/sessions", json={}).json()["id"]
    first = _chat(srv, _content(data_url(picture(64, 128, 4))), extra_body={"session_id": sid})
    second = _client(srv).chat.completions.create(
        model="vl", messages=[{"role": "user", "content": "Tell me more."}], max_tokens=4,
        extra_body={"session_id": sid})
    assert first.choices[0].finish_reason and second.choices[0].finish_reason
    assert second.usage.prompt_tokens < first.usage.prompt_tokens  # only the new turn
    blob = httpx.get(f"{srv.url}/v1/sessions/{sid}/state").content  # exported, with the
    copy = httpx.post(srv.url + "/v1/sessions/import", content=blob,  # picture's positions
                      headers={"content-type": "application/octet-stream"}).json()["id"]
    turn = [{"role": "user", "content": "And the colours?"}]
    replies = [_client(srv).chat.completions.create(
        model="vl", messages=turn, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"session_id": s}).choices[0].message.content for s in (sid, copy)]
    assert replies[0] == replies[1]


@pytest.mark.parametrize(("url", "words"), [
    ("data:image/png;base64,AAAA", "not a PNG, JPEG, WebP or GIF"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "not fetched"),
    ("ftp://example.com/cat.png", "data:, http(s): or file:"),
    ("file:///etc/passwd", "no image file"),
])
def test_bad_images_are_400s_that_say_why(srv: ServerProcess, url: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(srv, _content(url))
    assert words in err.value.message
    assert err.value.body["param"] == "messages[0].content"  # type: ignore[index]
    _chat(srv, QUESTION)  # still serves


def test_truncated_too_large_and_too_many_images_are_400s(srv: ServerProcess, site: str
                                                          ) -> None:
    pic = picture(100, 100, 5)
    with pytest.raises(openai.BadRequestError, match="corrupt or truncated"):
        _chat(srv, _content(data_url(pic[: len(pic) // 2])))
    with pytest.raises(openai.BadRequestError, match="larger than 400,000 bytes"):
        _chat(srv, _content(data_url(picture(500, 500, 6))))
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        _chat(srv, _content(f"{site}/missing.png"))
    with pytest.raises(openai.BadRequestError, match="limit of 3"):
        _chat(srv, _content(data_url(pic)) * 4)
    with pytest.raises(openai.BadRequestError, match="placeholder"):
        _chat(srv, "Look: <|vision_start|><|image_pad|><|vision_end|>")
    assert _chat(srv, _content(data_url(pic), "low")).choices[0].finish_reason


def test_limit_zero_serves_the_checkpoint_as_text(files: dict[str, Path]) -> None:
    with ServerProcess.serving(files["model"], "--limit-mm-per-prompt", '{"image": 0}') as s:
        with pytest.raises(openai.BadRequestError, match="takes no image input"):
            _chat(s, _content(data_url(picture(64, 64, 1))))
        assert _chat(s, QUESTION).choices[0].finish_reason


def test_a_gguf_file_with_its_mmproj_sees_the_picture(files: dict[str, Path]) -> None:
    """``linserve serve model.gguf --mmproj mmproj.gguf``, both written by llama.cpp's own
    converter from the checkpoint, answers as transformers does; a file that is no mmproj
    is one line at startup."""
    from tests.model.gguf_fixtures import Conversion, convert_many

    model, proj = files["model"].parent / "vl.gguf", files["model"].parent / "vl-mmproj.gguf"
    convert_many([Conversion(files["model"], model, "f32", None, ("--no-mtp",)),
                  Conversion(files["model"], proj, "f32", None, ("--mmproj",))])
    pic = picture(100, 180, 1)
    with ServerProcess.serving(model, "--mmproj", str(proj), "--mm-processor-kwargs",
                               '{"min_pixels": 4096, "max_pixels": 65536}') as s:
        reply = _chat(s, _content(data_url(pic)))
        assert reply.choices[0].message.content == _reference_text(files["model"], [pic])
    bad = subprocess.run([sys.executable, "-m", "linserve", "serve", str(model), "--mmproj",
                          str(model), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "not an mmproj file" in bad.stderr
    assert "Traceback" not in bad.stderr


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width × height`` pixels, with almost no data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_fuzzed_images_are_400s_never_500s(srv: ServerProcess) -> None:
    """Random bytes, truncations and bit flips of PNG, JPEG, WebP and GIF files, and a
    header that claims a vast image: each a 200 (a flip the decoder tolerates) or a 400 in
    the error envelope, never a 500; the server answers after them."""
    rng = np.random.default_rng(0)
    cases = [_bomb_png(100_000, 100_000), _bomb_png(1, 1), b"", bytes(rng.integers(0, 256, 64,
                                                                         dtype=np.uint8))]
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        good = picture(48, 64, 3, fmt)
        for _ in range(4):
            flipped = bytearray(good)
            for at in rng.integers(0, len(good), 3):
                flipped[at] ^= 1 << int(rng.integers(0, 8))
            cases += [bytes(flipped), good[: int(rng.integers(1, len(good)))]]
    statuses = []
    for data in cases:
        reply = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": _content(
                data_url(data))}]})
        statuses.append(reply.status_code)
        assert reply.status_code in (200, 400), reply.text[:300]
        if reply.status_code == 400:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert statuses[0] == 400 and statuses.count(400) >= len(cases) // 2
    assert _chat(srv, QUESTION).choices[0].finish_reason


def test_the_next_turn_of_a_chat_about_a_picture_resumes_after_the_reply(
        srv: ServerProcess) -> None:
    """A client that resends the whole conversation (the picture in its first message)
    finds it prefilled up to the new message: the picture is never encoded or prefilled
    again, and the reply is what the conversation sent fresh gets."""
    pic = data_url(picture(96, 160, 11))
    first = _chat(srv, _content(pic))
    history = [{"role": "user", "content": _content(pic)},
               {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And the colours?"}]
    second = _client(srv).chat.completions.create(model="vl", messages=history,  # type: ignore[arg-type]
                                                  max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens  # past the first reply, not just the picture
    assert second.usage.prompt_tokens - cached < 20  # only the new message's tokens
