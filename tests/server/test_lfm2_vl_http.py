"""An LFM2-VL checkpoint served with its chat template: a picture sent through the openai
SDK (small, and one large enough to be tiled with a thumbnail) answers as transformers'
``Lfm2VlForConditionalGeneration`` does on the same prompt; the usage counts the picture's
tokens, markers included; the same picture again is served from the cache."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from bench.serverproc import ServerProcess
from linserve.model.vision import images, lfm2_prep
from tests.model import lfm2_vl_fixtures as F

pytest.importorskip("transformers")
pytestmark = pytest.mark.integration
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return F.make(tmp_path_factory.mktemp("lfm2-vl"), "s1")


@pytest.fixture(scope="module")
def srv(model: Path) -> Iterator[ServerProcess]:
    with ServerProcess.serving(model, "--served-model-name", "lfm") as s:
        yield s


def _reference(model: Path, pic: bytes) -> tuple[str, int]:
    """transformers' greedy reply to QUESTION and the picture, and its prompt's length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    spec = lfm2_prep.Lfm2ImageSpec.from_checkpoint(model, {"image_token_id": tok.token_to_id(
        "<image>")})
    text = f"<|im_start|>user\n{QUESTION}<image><|im_end|>\n<|im_start|>assistant\n"
    rgb = images.decode(pic)
    ids: list[int] = []
    for t in tok.encode(text, add_special_tokens=False).ids:
        if t != spec.placeholder:
            ids.append(t)
            continue
        for s in lfm2_prep.layout(spec, rgb.height, rgb.width).sequence:
            ids += [spec.placeholder] * -s if s < 0 else [s]
    with torch.no_grad():
        out = F.reference(model).generate(input_ids=torch.tensor([ids]), max_new_tokens=6,
                                          do_sample=False, **F.hf_inputs(spec, [pic]))
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=False), len(ids)


@pytest.mark.parametrize("size", [(50, 60), (300, 250)], ids=["small", "tiled"])
def test_a_picture_answers_as_transformers(srv: ServerProcess, model: Path,
                                           size: tuple[int, int]) -> None:
    pic = F.picture(*size, seed=sum(size))
    url = "data:image/png;base64," + base64.b64encode(pic).decode()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}]
    def reply() -> tuple[str, object]:
        """The reply's tokens' text, whole (the message's content is trimmed)."""
        out = client.chat.completions.create(
            model="lfm", messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            logprobs=True, extra_body={"ignore_eos": True})
        got = out.choices[0].logprobs.content or []  # type: ignore[union-attr]
        return "".join(t.token for t in got), out.usage

    want, prompt = _reference(model, pic)
    first, usage = reply()
    assert first == want
    assert usage.prompt_tokens == prompt  # type: ignore[attr-defined]
    again, usage = reply()
    assert again == want
    cached = usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]
    assert cached >= prompt - 16  # the picture and the text before it, at least
