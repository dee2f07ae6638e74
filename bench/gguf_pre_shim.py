"""Run llama.cpp's ``convert_hf_to_gguf.py`` naming the tokenizer's pre-tokenizer, for the
benchmark checkpoints that carry the project's tokenizer (never run by CI).

The converter recognises a BPE pre-tokenizer by hashing how it splits a test text, and
refuses any it has not seen. The project's ``weights/tokenizer.json`` is a byte-level BPE
with GPT-2's split regex, llama.cpp's ``gpt-2`` pre-tokenizer exactly; its vocabulary is its
own, so no published hash matches (and where a converter expects a Llama-style byte-fallback
BPE, as Jamba's does, it is read as GPT-2's). ``bench/llamacpp.sh convert`` runs this shim, in the
converter's venv, when ``LINSERVE_GGUF_PRE`` names the pre-tokenizer:

    python gguf_pre_shim.py SRC_DIR [converter arguments...]
"""

import os
import runpy
import sys


def main() -> None:
    src = sys.argv.pop(1)
    sys.path.insert(0, src)
    from conversion import base  # the converter's package, from SRC_DIR

    def named(self: object, tokenizer: object) -> str:
        del self, tokenizer
        return os.environ["LINSERVE_GGUF_PRE"]

    base.TextModel.get_vocab_base_pre = named
    # the project's tokenizer is a byte-level BPE: where a converter reads a Llama-style
    # (byte-fallback) one, as Jamba's does, it is read as GPT-2's
    base.TextModel._set_vocab_llama_hf = base.TextModel._set_vocab_gpt2
    sys.argv[0] = os.path.join(src, "convert_hf_to_gguf.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
