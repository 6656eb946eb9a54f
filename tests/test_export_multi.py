"""`tamis export-data` of samples with several images and turns (issue 51 items 4-5): a TRL-format project of
one-image, two-image and multi-turn samples (and a system prompt) exported in all four formats as a user runs it, and
each output loaded back with the real libraries (datasets; TRL's VLM collator on a tiny model's processor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image, ImageDraw

from tests.test_use_model import said, tamis_cli


def scene(name: str, i: int) -> Image.Image:
    """A generated picture: a warm or cool bar at a place depending on i."""
    im = Image.new("RGB", (56 + 6 * i, 40), (230, 225, 215))
    colour = (210, 60, 30) if "warm" in name else (30, 90, 210)
    ImageDraw.Draw(im).rectangle((4 + 3 * i, 6, 20 + 3 * i, 34), fill=colour)
    return im


# (images, turns [(user, assistant)], system, split): every record's images go in its first user turn
RECORDS = [
    (["pics/warm_0.png", "pics/cool_1.png"], [("Which picture is warmer?", "left")], "", "train"),
    (["pics/cool_2.png", "pics/warm_3.png"], [("Which picture is warmer?", "right")], "", "train"),
    (["pics/warm_4.png", "pics/cool_5.png"], [("Describe both.", "a red bar, then a blue bar"),
                                              ("Which picture is warmer?", "left")], "Answer briefly.", "train"),
    (["pics/warm_6.png"], [("What colour is the bar?", "red")], "", "train"),
    (["pics/cool_7.png", "pics/warm_0.png"], [("Which picture is warmer?", "right")], "", "test"),
    (["pics/cool_1.png", "pics/cool_2.png"], [("Which picture is warmer?", None)], "", None),
]


def trl_record(images, turns, system, split):
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    for k, (q, a) in enumerate(turns):
        messages.append({"role": "user", "content": [{"type": "image"}] * (len(images) if k == 0 else 0)
                         + [{"type": "text", "text": q}]})
        if a is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return {"messages": messages, "images": images, **({"split": split} if split else {})}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from pipeline.config import load_config
    from pipeline.data.ingest import ingest, record_latest

    root = tmp_path_factory.mktemp("pairs")
    (root / "pics").mkdir()
    for i, name in enumerate(["warm_0", "cool_1", "cool_2", "warm_3", "warm_4", "cool_5", "warm_6", "cool_7"]):
        scene(name, i).save(root / "pics" / f"{name}.png")
    (root / "pairs.jsonl").write_text("".join(json.dumps(trl_record(*r)) + "\n" for r in RECORDS))
    config = root / "tamis.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "trl", "path": str(root / "pairs.jsonl")}]},
        "model": {"name_or_path": str(root / "no-model"), "family": "idefics3"}}))
    c = load_config(config)
    m = ingest(c.data, c.artifacts, c.artifacts / "ingest" / "run")
    record_latest(c.artifacts, {"dir": str(c.artifacts / "ingest" / "run"), "digest": m.config_digest, "counts": {}})
    return root, config


def export(config: Path, out: Path, fmt: str) -> None:
    res = tamis_cli("export-data", "-c", config, "--format", fmt, "--out", out, "--include-test")
    assert res.returncode == 0, said(res)
    assert f"exported 4 labeled training samples, 1 test as {fmt}" in said(res)


def want(split: str) -> dict[tuple[str, ...], list[tuple[str, str]]]:
    """images under the export → the (question, answer) turns, for the records of `split`."""
    return {tuple(f"images/{Path(i).name}" for i in r[0]): list(r[1]) for r in RECORDS if r[3] == split}


def test_trl_export_of_two_image_and_multi_turn_samples_loads_and_trls_collator_batches_it(project, tmp_path,
                                                                                           tiny_models):
    from datasets import Image as ImageFeature
    from datasets import List, load_dataset
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    root, config = project
    out = tmp_path / "trl"
    export(config, out, "trl")
    ds = load_dataset("json", data_files={"train": str(out / "train.jsonl"), "test": str(out / "test.jsonl")})
    for split in ("train", "test"):
        got = {}
        for r in ds[split]:
            msgs = [m for m in r["messages"] if m["role"] != "system"]
            first = [c["type"] for c in msgs[0]["content"]]
            assert first == ["image"] * len(r["images"]) + ["text"]  # every image, in order, before the text
            texts = [next(c["text"] for c in m["content"] if c["type"] == "text") for m in msgs]
            got[tuple(r["images"])] = list(zip(texts[::2], texts[1::2], strict=True))
            for f in r["images"]:
                assert (out / f).read_bytes() == (root / "pics" / Path(f).name).read_bytes()
        assert got == want(split)
    system = [r for r in ds["train"] if r["messages"][0]["role"] == "system"]
    assert [m["content"][0]["text"] for r in system for m in r["messages"][:1]] == ["Answer briefly."]

    processor = AutoProcessor.from_pretrained(tiny_models["idefics3"])
    train = ds["train"].map(lambda r: {"images": [str(out / p) for p in r["images"]]}).cast_column(
        "images", List(ImageFeature()))
    rows = sorted((train[i] for i in range(len(train))), key=lambda r: -len(r["messages"]))
    batch = DataCollatorForVisionLanguageModeling(processor)(rows)
    assert batch["input_ids"].shape == batch["labels"].shape and batch["input_ids"].shape[0] == 4
    text = processor.tokenizer.decode(batch["input_ids"][0])  # the multi-turn, two-image sample
    assert "Describe both." in text and "a red bar, then a blue bar" in text and "Which picture is warmer?" in text


@pytest.mark.parametrize("fmt,file", [("llamafactory", "train.json"), ("swift", "train.jsonl")])
def test_tagged_exports_carry_one_image_tag_per_image_and_every_turn(project, tmp_path, fmt, file):
    from datasets import load_dataset

    root, config = project
    out = tmp_path / fmt
    export(config, out, fmt)
    ds = load_dataset("json", data_files=str(out / file))["train"]
    got = {}
    for r in ds:
        if fmt == "llamafactory":
            turns = [m["value"] for m in r["conversations"]]
        else:
            turns = [m["content"] for m in r["messages"] if m["role"] != "system"]
        assert turns[0].count("<image>") == len(r["images"]) and "<image>" not in "".join(turns[1:])
        turns[0] = turns[0].replace("<image>", "")
        got[tuple(r["images"])] = list(zip(turns[::2], turns[1::2], strict=True))
        for f in r["images"]:
            with Image.open(out / f) as im:
                im.load()
    assert got == want("train")
    if fmt == "llamafactory":
        info = json.loads((out / "dataset_info.json").read_text())
        assert info["tamis_train"]["columns"] == {"messages": "conversations", "images": "images", "system": "system"}
        assert info["tamis_test"]["columns"] == {"messages": "conversations", "images": "images"}
        assert [r["system"] for r in ds if r["system"]] == ["Answer briefly."]
    lineage = json.loads((out / "lineage.json").read_text())
    assert sorted(len(r["files"]) for r in lineage["labels"]) == [1, 2, 2, 2, 2]
    assert {r["label"] for r in lineage["labels"]} == {"left", "right", "red"}


def test_hf_export_of_several_images_loads_from_disk_with_every_image_and_feeds_trls_collator(project, tmp_path,
                                                                                             tiny_models):
    from datasets import load_from_disk
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    root, config = project
    out = tmp_path / "hf"
    export(config, out, "hf")
    dd = load_from_disk(str(out / "dataset"))
    assert sorted(dd) == ["test", "train"] and len(dd["train"]) == 4
    assert set(dd["train"].column_names) == {"id", "images", "files", "messages", "question", "answer"}
    got = {}
    for r in dd["train"]:
        assert [im.size for im in r["images"]] == [Image.open(out / f).size for f in r["files"]]
        got[tuple(r["files"])] = r["answer"]
    assert got == {k: v[-1][1] for k, v in want("train").items()}
    batch = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(tiny_models["idefics3"]))(
        [dd["train"][i] for i in range(4)])
    assert batch["input_ids"].shape[0] == 4
