"""The Qwen-family tokenizer the test checkpoints carry, built from llama.cpp's
``ggml-vocab-qwen35.gguf``, reproduces llama.cpp's own test vectors through the project's
:class:`linserve.model.tokenizer.Tokenizer`; its incremental detokenizer gives the text back; and
the real Qwen3.5 chat template renders as transformers renders it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import llamacpp_assets
from bench.llamacpp_assets import QWEN_EOS, QWEN_TEMPLATE, write_qwen_tokenizer_files
from linserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-tok")
    write_qwen_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(folder / "tokenizer.json", QWEN_EOS)


def vectors() -> list[tuple[str, list[int]]]:
    inp = llamacpp_assets.vendored("models/ggml-vocab-qwen35.gguf.inp")
    out = llamacpp_assets.vendored("models/ggml-vocab-qwen35.gguf.out")
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = [[int(x) for x in line.split()] for line in out.read_text().split("\n")]
    return list(zip(texts, ids[:len(texts)], strict=True))


def test_the_llamacpp_test_vectors_encode_exactly(tok: Tokenizer) -> None:
    cases = vectors()
    assert len(cases) > 40
    assert tok.vocab_size == 151_936
    for text, want in cases:
        assert tok.encode(text) == want, text


def test_the_incremental_detokenizer_gives_each_text_back(tok: Tokenizer) -> None:
    for text, ids in vectors():
        detok = tok.detokenizer()
        pieces = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == text


def test_chat_and_tool_tokens_are_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n")
    assert ids[0] == 151644 and 151667 in ids and 151668 in ids and ids[-2] == 151657
    assert tok.token_id("<|im_end|>") == 151645 and 151645 in tok.eos_ids


CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Bye"}]},
    {"messages": [{"role": "user", "content": "Hi"}],
     "enable_thinking": False},
]


@pytest.mark.parametrize("case", CONVERSATIONS)
def test_the_qwen35_template_renders_as_transformers_does(folder: Path, case: dict[str, Any]
                                                          ) -> None:
    transformers = pytest.importorskip("transformers")
    from linserve.server.api.chat_template import TemplateChat
    from linserve.server.api.protocol import ChatMessage

    source = llamacpp_assets.vendored(QWEN_TEMPLATE).read_text()
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    extra = {k: v for k, v in case.items() if k != "messages"}
    want = ref.apply_chat_template(case["messages"], tokenize=False,
                                   add_generation_prompt=True, **extra)
    got = TemplateChat(source).render([ChatMessage.model_validate(m) for m in case["messages"]],
                                      **extra)
    assert got == want
