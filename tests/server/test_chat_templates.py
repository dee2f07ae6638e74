"""Checkpoint chat templates (linserve/server/api/chat_template.py) render exactly as transformers'
``apply_chat_template`` does, and chat requests use them through HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.serverproc import ROOT, ServerProcess
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.protocol import ChatMessage
from tests.model.qwen_fixtures import make_checkpoint

transformers = pytest.importorskip("transformers")

# A ChatML template in the style of Qwen's: system first, content-part arrays flattened,
# a generation prompt on request.
CHATML = """{%- for message in messages %}
{%- if message['content'] is string %}{% set content = message['content'] %}
{%- else %}{% set content = message['content'] | selectattr('type', 'equalto', 'text')
   | map(attribute='text') | join('') %}{% endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Who is there?"}],
    [{"role": "system", "content": "You are Horatio."},
     {"role": "user", "content": "Who is there?"},
     {"role": "assistant", "content": "Nay, answer me."},
     {"role": "user", "content": [{"type": "text", "text": "Long live "},
                                  {"type": "text", "text": "the king!"}]}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rendering_equals_transformers_apply_chat_template(messages: list[dict[str, Any]]
                                                           ) -> None:
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "weights" / "tokenizer.json"), chat_template=CHATML)
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    got = TemplateChat(CHATML).render([ChatMessage.model_validate(m) for m in messages])
    assert got == want


def test_a_template_that_refuses_gives_a_clear_error() -> None:
    strict = "{{ raise_exception('only user messages') if messages[0].role != 'user' }}"
    with pytest.raises(ValueError, match="only user messages"):
        TemplateChat(strict).render([ChatMessage(role="system", content="x")])


def test_the_sandbox_refuses_python_internals() -> None:
    sneaky = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match=r"unsafe|not safely|access"):
        TemplateChat(sneaky).render([ChatMessage(role="user", content="x")])


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen-chat"), "i4-tied")
    (path / "chat_template.jinja").write_text(CHATML)
    with ServerProcess.serving(path) as srv:
        yield srv


@pytest.mark.integration
def test_chat_requests_use_the_checkpoint_template(chat_server: ServerProcess) -> None:
    """The chat reply equals a completion of the rendered prompt (greedy), with the openai
    SDK; the same conversation through a session gives the same reply."""
    from openai import OpenAI

    client = OpenAI(base_url=chat_server.url + "/v1", api_key="none")
    messages: list[Any] = CONVERSATIONS[1]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                          temperature=0)
    prompt = TemplateChat(CHATML).render([ChatMessage.model_validate(m) for m in messages])
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text.strip()
    sess = httpx.post(chat_server.url + "/v1/sessions", json={}).json()
    via = httpx.post(chat_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "session_id": sess["id"], "max_tokens": 16, "temperature": 0})
    assert via.status_code == 200
    assert via.json()["choices"][0]["message"]["content"] == chat.choices[0].message.content
