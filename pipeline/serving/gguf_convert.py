"""Run llama.cpp's convert_hf_to_gguf.py (the pinned copy) with two narrow adjustments; a script, not a module tamis
imports: `python gguf_convert.py LLAMA_CPP_DIR CONVERTER_ARGS...` runs the converter's own `main()`.

1. The converter names a BPE pre-tokenizer by hashing the token ids of a test string against the checkpoints it
   knows. A tokenizer whose tokenizer.json pre-tokenizer is exactly GPT-2's (a lone ByteLevel with its regex, as
   tamis's tiny models and some fine-tunes carry) but whose vocabulary is new has an unknown hash: it is named
   "gpt2", which is what that pre-tokenizer is. Any other unknown tokenizer still fails as upstream.
2. Its sentencepiece path imports `sentencepiece` before it checks for tokenizer.model, so a checkpoint without one
   (Qwen2-VL's) fails where sentencepiece is not installed instead of falling back to tokenizer.json: the file is
   checked first, which is the converter's own fallback order.
3. transformers 5 saves a SigLIP vision tower without its `vision_model.` level (`vision_tower.embeddings…`, where
   the hub's Gemma 3 has `vision_tower.vision_model.embeddings…`): a name the converter cannot map is tried again
   with that level back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gpt2_pretokenizer(model_dir: Path) -> bool:
    """Whether `model_dir`'s tokenizer.json splits text exactly as GPT-2 does (ByteLevel with its regex, alone)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)


def patch(base: object) -> None:
    model_base = base.ModelBase  # type: ignore[attr-defined]
    map_name = model_base.map_tensor_name

    def map_tensor_name(self: object, name: str, try_suffixes: tuple[str, ...] = (".weight", ".bias")) -> str:
        try:
            return map_name(self, name, try_suffixes)
        except ValueError:
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                return map_name(self, "vision_tower.vision_model." + name.removeprefix("vision_tower."), try_suffixes)
            raise

    model_base.map_tensor_name = map_tensor_name
    text_model = base.TextModel  # type: ignore[attr-defined]
    known = text_model.get_vocab_base_pre
    spm = text_model._create_vocab_sentencepiece

    def get_vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if gpt2_pretokenizer(self.dir_model):  # type: ignore[attr-defined]
                return "gpt-2"
            raise

    def create_vocab_sentencepiece(self: object) -> object:
        if not (self.dir_model / "tokenizer.model").is_file():  # type: ignore[attr-defined]
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")  # type: ignore[attr-defined]
        return spm(self)

    text_model.get_vocab_base_pre = get_vocab_base_pre
    text_model._create_vocab_sentencepiece = create_vocab_sentencepiece


def main(argv: list[str]) -> None:
    root = Path(argv[1]).resolve()
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *argv[2:]]
    import runpy

    from conversion import base

    patch(base)
    runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
