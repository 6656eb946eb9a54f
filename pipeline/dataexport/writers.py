"""One writer per training framework's dataset format, in WRITERS (name → class). docs/formats.md shows a record of
each. A writer gets the samples per split (train, and test with --include-test) with their images already beside
the export (images/), and writes its files into the export folder; `files` names them (what --force replaces).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pipeline.dataexport.records import Sample, conversation
from pipeline.errors import DataError
from pipeline.store import atomic_dir, atomic_write_json, atomic_write_jsonl

IMAGE_TAG = "<image>"  # LLaMA-Factory's and ms-swift's placeholder: one per image, where the image goes


class DataWriter:
    name: ClassVar[str]
    files: ClassVar[tuple[str, ...]]

    def write(self, splits: Mapping[str, Sequence[Sample]], out: Path) -> list[Path]:
        raise NotImplementedError


def _tagged(sample: Sample, text: str, n_images: int, fmt: str) -> str:
    if IMAGE_TAG in text:  # the trainer would count one image too many and fail on (or misplace) every image
        raise DataError(f"sample {sample.id}: its text {text!r} holds {IMAGE_TAG}, which {fmt} reads as an image "
                        "placeholder; reword the question (data.question or the source's question) or export "
                        "--format trl / hf, whose records keep images apart from the text")
    return IMAGE_TAG * n_images + text


def _remove_stale(out: Path, files: Sequence[str], written: Sequence[Path]) -> None:
    """An earlier export's file this one does not write (test.jsonl without --include-test): it would be read as
    this export's."""
    for name in files:
        p = out / name
        if p not in written and p.is_file():
            p.unlink()


class JsonLinesWriter(DataWriter):
    """One JSONL file per split (train.jsonl, test.jsonl), one `record` per line."""

    files = ("train.jsonl", "test.jsonl")

    def record(self, s: Sample) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, splits: Mapping[str, Sequence[Sample]], out: Path) -> list[Path]:
        written = [atomic_write_jsonl(out / f"{split}.jsonl", [self.record(s) for s in rows])
                   for split, rows in splits.items()]
        _remove_stale(out, self.files, written)
        return written


def trl_messages(s: Sample) -> list[dict[str, Any]]:
    """TRL's conversational messages: typed content, one `{"type": "image"}` entry per image."""
    return [{"role": role, "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}
            for role, text, n in conversation(s)]


class TrlWriter(JsonLinesWriter):
    """TRL's SFTTrainer for vision-language models: conversational `messages` (typed content, the image as a
    `{"type": "image"}` entry, as tamis's own prompt builds it: pipeline/model/families.py Family.messages) and an
    `images` list."""

    name = "trl"

    def record(self, s: Sample) -> dict[str, Any]:
        return {"id": s.id, "messages": trl_messages(s), "images": list(s.images)}


class SwiftWriter(JsonLinesWriter):
    """ms-swift's standard format: `messages` with string content, an `<image>` tag per image in the text, and an
    `images` list (`swift sft --dataset train.jsonl --val_dataset test.jsonl`)."""

    name = "swift"

    def record(self, s: Sample) -> dict[str, Any]:
        return {"id": s.id, "messages": [{"role": role, "content": _tagged(s, text, n, "ms-swift")}
                                         for role, text, n in conversation(s)], "images": list(s.images)}


class LlamaFactoryWriter(DataWriter):
    """LLaMA-Factory's sharegpt format: a JSON list of `conversations` (`from` human/gpt, `value` with an `<image>`
    tag per image) and `images`, registered in dataset_info.json as `tamis_train` (and `tamis_test`), so
    `dataset_dir: DIR` with `dataset: tamis_train` trains on it."""

    name = "llamafactory"
    files = ("train.json", "test.json", "dataset_info.json")
    ROLES: ClassVar[dict[str, str]] = {"user": "human", "assistant": "gpt"}

    def record(self, s: Sample) -> dict[str, Any]:
        # sharegpt keeps a system prompt in its own column, not as a turn.
        turns = [{"from": self.ROLES[role], "value": _tagged(s, text, n, "LLaMA-Factory")}
                 for role, text, n in conversation(s) if role != "system"]
        return {"id": s.id, "conversations": turns, "images": list(s.images), **({"system": s.system} if s.system
                                                                                  else {})}

    @staticmethod
    def entry(file: str, system: bool = False) -> dict[str, Any]:
        return {"file_name": file, "formatting": "sharegpt",
                "columns": {"messages": "conversations", "images": "images", **({"system": "system"} if system else {})},
                "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}}

    def write(self, splits: Mapping[str, Sequence[Sample]], out: Path) -> list[Path]:
        written = [atomic_write_json(out / f"{split}.json", [self.record(s) for s in rows])
                   for split, rows in splits.items()]
        written.append(atomic_write_json(out / "dataset_info.json", {
            f"tamis_{split}": self.entry(f"{split}.json", any(s.system for s in rows)) for split, rows in splits.items()}))
        _remove_stale(out, self.files, written)
        return written


class HfWriter(DataWriter):
    """A `datasets.DatasetDict` saved with save_to_disk (DIR/dataset: `load_from_disk` → {"train", "test"}), whose
    images are bytes inside it (the folder stands alone, wherever it is moved). One image and one turn per sample:
    `id`, `image` (a datasets.Image), `question`, `answer`, `file` (the copy under images/). A project with a sample of
    several images or turns: `id`, `images` (a list of datasets.Image, in order), `files`, `messages` (TRL's
    conversational column, one `{"type": "image"}` entry per image: SFTTrainer-ready), `question` and `answer` (the
    last turn's). Chosen over an imagefolder with metadata.jsonl because imagefolder takes its splits from folder names
    (train/, test/), which would re-arrange the user's own layout."""

    name = "hf"
    files = ("dataset",)

    @staticmethod
    def features(several: bool) -> Any:
        import datasets

        s = datasets.Value("string")
        if not several:
            return datasets.Features({"id": s, "image": datasets.Image(), "question": s, "answer": s, "file": s})
        return datasets.Features({"id": s, "images": datasets.List(datasets.Image()), "files": datasets.List(s),
                                  "messages": datasets.List({"role": s, "content": datasets.List({"type": s, "text": s})}),
                                  "question": s, "answer": s})

    @staticmethod
    def row(s: Sample, out: Path, several: bool) -> dict[str, Any]:
        if not several:
            return {"id": s.id, "image": {"bytes": (out / s.images[0]).read_bytes(), "path": s.images[0]},
                    "question": s.turns[0].question, "answer": s.answer, "file": s.images[0]}
        return {"id": s.id, "images": [{"bytes": (out / f).read_bytes(), "path": f} for f in s.images],
                "files": list(s.images), "messages": [{"role": m["role"], "content": [{"text": None, **c} for c in
                                                                                      m["content"]]}
                                                      for m in trl_messages(s)],
                "question": s.turns[-1].question, "answer": s.answer}

    def write(self, splits: Mapping[str, Sequence[Sample]], out: Path) -> list[Path]:
        import datasets

        several = any(len(s.images) != 1 or len(s.turns) != 1 or s.system for rows in splits.values() for s in rows)
        parts = {split: datasets.Dataset.from_list([self.row(s, out, several) for s in rows],
                                                   features=self.features(several))
                 for split, rows in splits.items()}
        with atomic_dir(out / "dataset") as tmp:
            datasets.DatasetDict(parts).save_to_disk(str(tmp))
        return [out / "dataset"]


WRITERS: dict[str, type[DataWriter]] = {w.name: w for w in (TrlWriter, LlamaFactoryWriter, SwiftWriter, HfWriter)}


def get_writer(name: str) -> DataWriter:
    if name not in WRITERS:
        raise DataError(f"--format {name!r}: choose one of {', '.join(WRITERS)} (docs/formats.md shows each)")
    return WRITERS[name]()
