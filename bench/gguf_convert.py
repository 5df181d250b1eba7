"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on a tierserve checkpoint (the llama-server peer's model).

Run as a script with llama.cpp's source directory first on ``sys.path``:

    python bench/gguf_convert.py LLAMA_CPP_DIR CHECKPOINT --outfile F --outtype f32|bf16|q8_0

Two things of the converter are steered, nothing else: its vocabulary reader
tries sentencepiece first (our checkpoints have no ``tokenizer.model``), and
it identifies a BPE pre-tokenizer by hashing the ids of a probe text, which
knows published tokenizers only. Ours is a byte-level BPE with Qwen2's
pre-tokenizer regex (``models/builtin_tokenizer.py``), so it is named ``qwen2``.
The bench sends token ids, never text, so tokenization does not enter the
comparison either way.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "qwen2"


def main() -> None:
    source = Path(sys.argv[1])
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base

    def no_sentencepiece(self, *args, **kwargs):
        raise FileNotFoundError("no tokenizer.model: the checkpoint has a byte-level BPE tokenizer.json")

    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
