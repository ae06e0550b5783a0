"""A Hugging Face checkpoint of the peer comparison as GGUF, with llama.cpp's own converter.

    python benchmarks/peers/gguf_convert.py LLAMA_CPP_DIR CHECKPOINT OUT.gguf bf16|q8_0

Runs the vendored convert_hf_to_gguf.py (bf16, from which llama-quantize makes Q4_0, or q8_0)
with one change: the benchmark's checkpoint carries a toy word-level tokenizer that the
converter's BPE vocabulary code cannot read, so the vocabulary is written as llama.cpp's
"none" type. Token ids go into both engines directly (llama_driver.cpp, strata_driver.py), so
no text is ever tokenized; the tensors are converted by the converter's own code.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    llama_dir, checkpoint, out = (Path(a) for a in sys.argv[1:4])
    outtype = sys.argv[4]
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    import conversion.qwen  # type: ignore[import-not-found]

    def no_vocab(self: object) -> None:  # llama.cpp sizes a "none" vocabulary by vocab_size
        self.gguf_writer.add_tokenizer_model("none")  # type: ignore[attr-defined]
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])  # type: ignore[attr-defined]

    conversion.qwen.Qwen3MoeModel.set_vocab = no_vocab
    import convert_hf_to_gguf  # type: ignore[import-not-found]

    sys.argv = [
        "convert_hf_to_gguf.py",
        str(checkpoint),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
    ]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
