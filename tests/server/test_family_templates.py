"""The chat templates of the new families, as published (llama.cpp vendors them): rendered
string for string as transformers' ``apply_chat_template`` renders them, the tool-call
parser each implies, and the calls a template writes into an assistant turn read back by
that parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.llamacpp_assets import vendored, write_qwen_tokenizer_files
from linserve.server.api import tool_calls
from linserve.server.api.chat_template import TemplateChat, string_content
from linserve.server.api.protocol import ChatMessage
from tests.server.test_tool_parsing import CONVERSATIONS, TOOLS

# template -> (the parser it implies, whether it writes assistant tool calls). Granite-4.0-H
# with experts uses Granite's template; Qwen3-Next uses Qwen3's; Qwen3.5-MoE uses Qwen3.5's
# (tests/server/test_chat_templates.py); Nemotron-3-Nano (Nemotron-H with experts) writes
# Qwen3.5's XML calls.
TEMPLATES = {
    "LFM2.5-Instruct.jinja": ("lfm2", False),
    "LFM2-8B-A1B.jinja": ("lfm2", False),
    "ibm-granite-granite-4.0.jinja": ("hermes", True),
    "NVIDIA-Nemotron-Nano-v2.jinja": ("nemotron", True),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": ("qwen3_xml", True),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", True),
}


def _source(name: str) -> str:
    return vendored(f"models/templates/{name}").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A transformers tokenizer to render any template with (its own is replaced)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tokenizer")
    write_qwen_tokenizer_files(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def _hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers is given them: tool-call arguments as objects."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers_does(reference: Any, name: str, case: int) -> None:
    conv = CONVERSATIONS[case]
    source = _source(name)
    extra = {k: v for k, v in conv.items() if k not in ("messages", "tools")}
    given = _hf_messages(conv["messages"])
    if string_content(source):  # text parts joined, as vLLM gives such a template
        for m in given:
            if isinstance(m.get("content"), list):
                m["content"] = "".join(p["text"] for p in m["content"])
    want = reference.apply_chat_template(given, tools=conv.get("tools"), chat_template=source,
                                         tokenize=False, add_generation_prompt=True, **extra)
    chat = TemplateChat(source, bos_token=reference.bos_token or "")
    got = chat.render([ChatMessage.model_validate(m) for m in conv["messages"]],
                      tools=conv.get("tools"), **extra)
    assert got == want


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_template_implies_its_parser_and_its_calls_read_back(name: str) -> None:
    parser, writes_calls = TEMPLATES[name]
    source = _source(name)
    assert tool_calls.default_parser(source) == parser
    if not writes_calls:
        return  # LFM2's templates show a call as the model wrote it, in the content
    calls = [{"id": "a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
             {"id": "b", "type": "function", "function": {
                 "name": "add", "arguments": '{"a": 1, "b": 2.5}'}}]
    messages = [{"role": "user", "content": "Weather in Paris, and 1+2.5?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
    text = TemplateChat(source).render([ChatMessage.model_validate(m) for m in messages],
                                       tools=TOOLS)
    _, found = tool_calls.extract(parser, text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_an_lfm2_call_in_content_reads_back(tmp_path: Path) -> None:
    """LFM2 writes ``<|tool_call_start|>[f(k=v)]<|tool_call_end|>`` itself; the parser the
    template implies reads it from a reply."""
    del tmp_path
    reply = '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>'
    parser = tool_calls.default_parser(_source("LFM2.5-Instruct.jinja"))
    content, found = tool_calls.extract(parser, reply, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in found] == \
        [("get_weather", {"city": "Paris", "days": 2})]
