"""Run llama.cpp's ``convert_hf_to_gguf.py`` naming the tokenizer's pre-tokenizer, for the
benchmark checkpoints that carry the project's tokenizer (never run by CI).

The converter recognises a BPE pre-tokenizer by hashing how it splits a test text, and
refuses any it has not seen. The project's ``weights/tokenizer.json`` is a byte-level BPE
with GPT-2's split regex, llama.cpp's ``gpt-2`` pre-tokenizer exactly; its vocabulary is its
own, so no published hash matches (and where a converter expects a Llama-style byte-fallback
BPE, as Jamba's does, it is read as GPT-2's). ``bench/llamacpp.sh convert`` runs this shim, in the
converter's venv, when ``LINSERVE_GGUF_PRE`` names the pre-tokenizer:

    python gguf_pre_shim.py SRC_DIR [converter arguments...]
    python gguf_pre_shim.py --batch JOBS.json SRC_DIR

``--batch``: every conversion of ``JOBS.json`` (a list of ``{"argv": [...], "pre": NAME or
null}``; null: the converter's own recognition, unpatched) in this one process, the
converter imported once (6.8 s a process on two AVX2 cores, most of a tiny model's
conversion); each job's outcome (null, or the error's last lines) is written back to the
file as ``"error"``.
"""

import os
import runpy
import sys
from pathlib import Path
from typing import Any


def _converter(src: str) -> tuple[Any, dict[str, object]]:
    """The converter's ``TextModel`` class and its methods the shim replaces, as they are."""
    sys.path.insert(0, src)
    from conversion import base  # the converter's package, from SRC_DIR

    own = {"get_vocab_base_pre": base.TextModel.get_vocab_base_pre,
           "_set_vocab_llama_hf": base.TextModel._set_vocab_llama_hf}
    return base.TextModel, own


def _named(self: object, tokenizer: object) -> str:
    del self, tokenizer
    return os.environ["LINSERVE_GGUF_PRE"]


def _patch(text_model: Any, own: dict[str, object], pre: str | None) -> None:
    """Name the pre-tokenizer ``pre`` (and read a Llama-style BPE as GPT-2's: the project's
    tokenizer is a byte-level BPE, as Jamba's converter does not expect), or, for None,
    put the converter's own methods back."""
    if pre is None:
        for name, method in own.items():
            setattr(text_model, name, method)
        return
    os.environ["LINSERVE_GGUF_PRE"] = pre
    text_model.get_vocab_base_pre = _named
    text_model._set_vocab_llama_hf = text_model._set_vocab_gpt2


def _run(src: str, argv: list[str]) -> None:
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def batch(jobs_file: str, src: str) -> None:
    """Every job of ``jobs_file`` in turn (see the module doc)."""
    import json
    import traceback

    text_model, own = _converter(src)
    jobs = json.loads(Path(jobs_file).read_text())
    for job in jobs:
        _patch(text_model, own, job["pre"])
        try:
            _run(src, job["argv"])
            job["error"] = None
        except SystemExit as exc:
            job["error"] = None if exc.code in (None, 0) else f"exit status {exc.code}"
        except Exception:  # one job's failure is reported, the others still run
            job["error"] = traceback.format_exc()[-3000:]
    Path(jobs_file).write_text(json.dumps(jobs))


def main() -> None:
    if sys.argv[1] == "--batch":
        batch(sys.argv[2], sys.argv[3])
        return
    src = sys.argv.pop(1)
    text_model, own = _converter(src)
    _patch(text_model, own, os.environ["LINSERVE_GGUF_PRE"])
    _run(src, sys.argv[1:])


if __name__ == "__main__":
    main()
