"""Tool-call and reasoning parsing (linserve/server/api/tool_calls.py, reasoning.py, chat_reply.py)
on known model texts, whole and streamed in every split; and Qwen3.5's template rendering tool
conversations exactly as transformers' ``apply_chat_template`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.llamacpp_assets import vendored, write_qwen_tokenizer_files
from linserve.server.api import reasoning, tool_calls
from linserve.server.api.chat_reply import ChatDeltas, ChatShape
from linserve.server.api.chat_template import TemplateChat
from linserve.server.api.protocol import ChatMessage

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "hours": {"type": "array"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
]

XML = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
       "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
       "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n"
       "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=b>\n2\n"
       "</parameter>\n</function>\n</tool_call>")
HERMES = ('Sure <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
          ' and <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
          '</tool_call>')
LFM2 = ('I will look.<|tool_call_start|>[get_weather(city="New York", days=3, metric=True, '
        'hours=[1, 2]), add(a=1.5, b=2)]<|tool_call_end|>Done.')
NEMOTRON = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]</TOOLCALL>')
KIMI = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Oslo", "days": 3}<|tool_call_end|>'
        '<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 1, "b": 2}'
        '<|tool_call_end|><|tool_calls_section_end|>')
GLM45 = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
         "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
         "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1.5</arg_value>\n<arg_key>b"
         "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
MINIMAX = ('Checking.<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
           '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_calls>')
MALFORMED = [
    "<tool_call>\n<function=nope>\n</function>\n</tool_call>",  # an unknown function
    "<tool_call>\n<function=add>\nstray<parameter=a>\n1\n</parameter>\n</function>\n"
    "</tool_call>",  # text between parameters
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n",  # cut off
    "<tool_call>{not json}</tool_call>",
    "</tool_call> <tool_ca",
]


def _whole(parser: str, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    content, calls = tool_calls.extract(parser, text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen3_xml_calls_with_typed_parameters() -> None:
    content, calls = _whole("qwen3_xml", XML)
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                      "hours": [1, 2]}), ("add", {"a": 1.5, "b": 2})]


def test_hermes_calls_with_object_or_string_arguments() -> None:
    content, calls = _whole("hermes", HERMES)
    assert content == "Sure  and "
    assert calls == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]


def test_lfm2_python_calls_and_nemotron_json_arrays() -> None:
    """Several calls in one block, literals read without evaluating anything."""
    content, calls = _whole("lfm2", LFM2)
    assert content == "I will look.Done."
    assert calls == [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                      "hours": [1, 2]}), ("add", {"a": 1.5, "b": 2})]
    assert _whole("pythonic", LFM2) == (content, calls)
    assert _whole("nemotron", NEMOTRON) == ("", [("get_weather", {"city": "Oslo"}),
                                                 ("add", {"a": 1, "b": 2})])


def test_kimi_glm45_and_minimax_calls() -> None:
    """Kimi's sections, Ling's (GLM-4.5's) key/value pairs typed by the schema, MiniMax's
    JSON lines."""
    assert _whole("kimi_k2", KIMI) == ("Checking.", [("get_weather", {"city": "Oslo", "days": 3}),
                                                     ("add", {"a": 1, "b": 2})])
    assert _whole("glm45", GLM45) == ("Checking.", [
        ("get_weather", {"city": "New York", "days": 3}), ("add", {"a": 1.5, "b": 2})])
    assert _whole("minimax", MINIMAX) == ("Checking.", [("get_weather", {"city": "Oslo"}),
                                                        ("add", {"a": 1, "b": 2})])


@pytest.mark.parametrize(("name", "parser"), [
    ("moonshotai-Kimi-K2.jinja", "kimi_k2"), ("Kimi-K2-Instruct.jinja", "kimi_k2"),
    ("inclusionai-ling-3.0-flash.jinja", "glm45"), ("MiniMax-M1.jinja", "minimax")])
def test_the_real_templates_imply_their_parsers(name: str, parser: str) -> None:
    """llama.cpp's copies of the published templates (the llama-cpp-python sdist's)."""
    path = vendored(f"models/templates/{name}")
    assert tool_calls.default_parser(path.read_text()) == parser


LFM2_MALFORMED = [
    "<|tool_call_start|>[nope(a=1)]<|tool_call_end|>",  # an unknown function
    "<|tool_call_start|>[add(1, 2)]<|tool_call_end|>",  # positional arguments
    "<|tool_call_start|>[add(a=__import__('os').getcwd())]<|tool_call_end|>",  # not a literal
    "<|tool_call_start|>[add(a=1, b=2)",  # cut off
    "<|tool_call_start|>add(a=1<|tool_call_end|>",  # not Python
]


@pytest.mark.parametrize(("parser", "text"), [
    *((p, t) for p in ("qwen3_xml", "hermes") for t in MALFORMED
      if (p, t) not in (("qwen3_xml", MALFORMED[1]), ("qwen3_xml", MALFORMED[2]))),
    *(("lfm2", t) for t in LFM2_MALFORMED),
    ("nemotron", '<TOOLCALL>[{"name": "nope", "arguments": {}}]</TOOLCALL>'),
    ("nemotron", "<TOOLCALL>[]</TOOLCALL>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0"
                "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
                "<|tool_call_argument_begin|>{not json}<|tool_call_end|>"
                "<|tool_calls_section_end|>"),
    ("glm45", "<tool_call>nope\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    ("minimax", '<tool_calls>\n{"name": "add", "arguments": [1]}\n</tool_calls>'),
    ("minimax", "<tool_calls>\nnot json\n</tool_calls>")])
def test_malformed_calls_stay_content(parser: str, text: str) -> None:
    """A block that never names a known function stays content, verbatim."""
    content, calls = _whole(parser, text)
    assert calls == [] and content == text


def test_a_named_call_stands_and_a_cut_off_one_ends_as_valid_json() -> None:
    """Once a known function is named the call has been streamed: stray text between its
    parameters is skipped, and a call cut off by the end of the output is closed where it
    stopped (its arguments still JSON), as OpenAI's stream leaves a call cut by max_tokens."""
    assert _whole("qwen3_xml", MALFORMED[1]) == ("", [("add", {"a": 1})])
    assert _whole("qwen3_xml", MALFORMED[2]) == ("", [("add", {"a": 1})])
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo"
    assert _whole("qwen3_xml", cut) == ("", [("get_weather", {"city": "New Yo"})])


def _pieces(parser: str, text: str, step: int = 3) -> list[tuple[str, str]]:
    """(kind, text) of each event when ``text`` arrives ``step`` characters at a time."""
    stream = tool_calls.ToolStream(parser, TOOLS)
    events = [e for i in range(0, len(text), step) for e in stream.feed(text[i:i + step])]
    events += stream.finish()
    return [("call", e.name) if isinstance(e, tool_calls.ToolCall) else
            ("args", e.text) if isinstance(e, tool_calls.ArgsPiece) else ("content", e)
            for e in events]


@pytest.mark.parametrize(("parser", "text"), [("qwen3_xml", XML), ("hermes", HERMES),
                                              ("nemotron", NEMOTRON)])
def test_arguments_stream_as_they_are_generated(parser: str, text: str) -> None:
    """Each call opens as soon as its name is read, and its arguments come in many pieces
    (not whole at the block's end) that join to the whole reply's arguments."""
    events = _pieces(parser, text)
    _, calls = tool_calls.extract(parser, text, TOOLS)
    opened = [i for i, (kind, _) in enumerate(events) if kind == "call"]
    assert len(opened) == len(calls)
    bounds = [*opened, len(events)]
    for call, start, end in zip(calls, bounds, bounds[1:], strict=False):
        pieces = [t for kind, t in events[start:end] if kind == "args"]
        assert "".join(pieces) == call.arguments
        if "Oslo" not in call.arguments or parser != "hermes":  # a string holding JSON
            assert len(pieces) > 2, (call.name, pieces)  # comes whole, once decoded


def test_json_arguments_are_the_models_own_text() -> None:
    """Hermes and Nemotron arguments are passed on as written, so the pieces streamed are
    exactly the final arguments."""
    text = '<tool_call>{"name": "add", "arguments": {"a":1,   "b": 2.50}}</tool_call>'
    _, calls = tool_calls.extract("hermes", text, TOOLS)
    assert [c.arguments for c in calls] == ['{"a":1,   "b": 2.50}']


@pytest.mark.parametrize(("parser", "text"), [("qwen3_xml", XML), ("hermes", HERMES),
                                              ("qwen3_xml", MALFORMED[2]), ("lfm2", LFM2),
                                              ("nemotron", "Sure. " + NEMOTRON),
                                              ("kimi_k2", KIMI), ("glm45", GLM45),
                                              ("minimax", MINIMAX)])
def test_streaming_in_any_split_equals_the_whole(parser: str, text: str) -> None:
    want = _whole(parser, text)
    for cut in range(1, len(text)):
        stream = tool_calls.ToolStream(parser, TOOLS)
        events = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        content, found = tool_calls.assemble(events)
        calls = [(c.name, json.loads(c.arguments)) for c in found]
        assert (content, calls) == want, cut


@pytest.mark.parametrize(("prompt", "text", "want"), [
    ("…<|im_start|>assistant\n<think>\n", "I should add.\n</think>\n\nIt is 3.",
     ("I should add.", "It is 3.")),
    ("…<think>\n\n</think>\n\n", "It is 3.", (None, "It is 3.")),
    ("…assistant\n", "<think>hm</think>It is 3.", ("hm", "It is 3.")),
    ("…<think>\n", "still thinking when cut off", ("still thinking when cut off", "")),
])
def test_reasoning_split_whole_and_streamed(prompt: str, text: str,
                                            want: tuple[str | None, str]) -> None:
    thinking = reasoning.starts_thinking(prompt)
    assert reasoning.split(text, thinking) == want
    for cut in range(1, len(text)):
        stream = reasoning.ReasoningStream(thinking)
        parts = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        think = "".join(t for k, t in parts if k == "reasoning").strip() or None
        assert (think, "".join(t for k, t in parts if k == "content")) == want


def test_chat_deltas_reassemble_to_the_whole_message() -> None:
    """Reasoning, content and two calls, streamed a few characters at a time: the deltas
    put together as an OpenAI client does give the non-streamed message."""
    text = "weighing it\n</think>\n\n" + XML
    shape = ChatShape(TOOLS, "qwen3_xml", thinking=True)
    want, called = shape.message(text)
    stream = ChatDeltas(shape)
    deltas = [d for i in range(0, len(text), 7) for d in stream.feed(text[i : i + 7])]
    deltas += stream.finish()
    got: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": []}
    for d in deltas:
        got["reasoning_content"] += d.get("reasoning_content", "")
        got["content"] += d.get("content", "")
        for call in d.get("tool_calls", []):
            if "id" in call:
                got["tool_calls"].append({"id": call["id"], "type": "function", "function": {
                    "name": call["function"]["name"], "arguments": ""}})
            got["tool_calls"][call["index"]]["function"]["arguments"] += \
                call["function"]["arguments"]
    assert called
    assert got["reasoning_content"].strip() == want["reasoning_content"]
    assert got["content"] == want["content"]
    assert [c["function"] for c in got["tool_calls"]] == \
        [c["function"] for c in want["tool_calls"]]


def test_forced_calls_parse_from_the_grammar_shape() -> None:
    schema = tool_calls.forced_schema(TOOLS, "add", parallel=False)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "add"}
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    content, calls = tool_calls.extract_forced(text, TOOLS)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    assert tool_calls.extract_forced('[{"name": "ad', TOOLS) == ('[{"name": "ad', [])


CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And 1+2?"}], "tools": TOOLS},
    {"messages": [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "add",
                                                         "arguments": '{"a": 1, "b": 2}'}},
            {"id": "b", "type": "function", "function": {"name": "add",
                                                         "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "3"},
        {"role": "tool", "tool_call_id": "b", "content": "7"}], "tools": TOOLS,
     "enable_thinking": False},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                               {"type": "text", "text": "there"}]}]},
]


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-template")
    write_qwen_tokenizer_files(path)
    return path


@pytest.mark.parametrize("case", CONVERSATIONS)
def test_tool_conversations_render_as_transformers_does(qwen_folder: Path,
                                                        case: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(qwen_folder)
    extra = {k: v for k, v in case.items() if k not in ("messages", "tools")}
    hf_messages = json.loads(json.dumps(case["messages"]))
    for m in hf_messages:  # transformers renders what it is given: arguments as objects
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    want = ref.apply_chat_template(hf_messages, tools=case.get("tools"), tokenize=False,
                                   add_generation_prompt=True, **extra)
    source = (qwen_folder / "chat_template.jinja").read_text()
    got = TemplateChat(source).render([ChatMessage.model_validate(m) for m in case["messages"]],
                                      tools=case.get("tools"), **extra)
    assert got == want
