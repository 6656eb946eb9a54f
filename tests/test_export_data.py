"""`tamis export-data`: the labeled set in TRL, LLaMA-Factory, ms-swift and Hugging Face datasets formats, loaded back
with the real libraries (datasets; TRL's own VLM collator on a tiny model's processor), images under their own
names, lineage.json, and the same refusals as export-model."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml
from PIL import Image, ImageDraw

from pipeline.config import load_config
from tests.test_use_model import said, tamis_cli

SHAPES = ("circle", "square", "triangle")
COLOURS = {"circle": (200, 40, 40), "square": (40, 160, 60), "triangle": (40, 60, 200)}


def draw(shape: str, i: int) -> Image.Image:
    """A generated shape on a light background, its size and place varying with i."""
    im = Image.new("RGB", (48 + 4 * i, 40 + 3 * i), (235, 230, 220))
    d, s = ImageDraw.Draw(im), 8 + i
    box = (6 + i, 5, 6 + i + 2 * s, 5 + 2 * s)
    if shape == "circle":
        d.ellipse(box, fill=COLOURS[shape])
    elif shape == "square":
        d.rectangle(box, fill=COLOURS[shape])
    else:
        d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[shape])
    return im


def image_name(shape: str, i: int) -> str:
    """Two triangles whose names differ only in case (one name on a macOS or Windows disk): the export must keep
    both, told apart the same way each time."""
    if shape == "triangle" and i in (2, 3):
        return "Tri.png" if i == 2 else "tri.png"
    return f"{shape}_{i}.{'jpg' if i % 2 else 'png'}"


def write_shapes(root: Path, *, open_answers: bool) -> Path:
    """root/photos/<shape>/<name> and a JSONL manifest: per shape a seed-labeled train row (i 0), a test row with
    its answer (i 1) and pool rows without (i 2-4)."""
    rows = []
    for shape in SHAPES:
        folder = root / "photos" / shape
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(5):
            draw(shape, i).save(folder / image_name(shape, i))
            split = "train" if i == 0 else "test" if i == 1 else "pool"
            rows.append({"image": f"photos/{shape}/{image_name(shape, i)}", "split": split,
                         **({"answer": seed_answer(shape, open_answers)} if split != "pool" else {})})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "manifest.jsonl"


def seed_answer(shape: str, open_answers: bool) -> str:
    return f"a shape: {shape}" if open_answers else shape


def labeled_answer(shape: str, open_answers: bool) -> str:
    return f"the {shape}, drawn flat" if open_answers else shape


def ingested(config: Path) -> Path:
    """Ingest the project's sources as `tamis ingest` does (the library call, without a Prefect flow); returns its
    artifacts folder."""
    from pipeline.data.ingest import ingest, record_latest

    c = load_config(config)
    out = c.artifacts / "ingest" / "run"
    m = ingest(c.data, c.artifacts, out)
    record_latest(c.artifacts, {"dir": str(out), "digest": m.config_digest, "counts": {}})
    return c.artifacts


def make_project(root: Path, *, open_answers: bool) -> Path:
    """A project whose dataset is ingested (no round, no model) and whose pool rows were labeled by two annotators
    (`tamis labels import`); returns its config."""
    manifest = write_shapes(root, open_answers=open_answers)
    cfg = {"paths": {"artifacts": str(root / "artifacts")},
           "data": {"sources": [{"kind": "jsonl", "path": str(manifest)}], "question": "Which shape is drawn?",
                    "answers": None if open_answers else list(SHAPES)},
           "model": {"name_or_path": str(root / "no-model"), "family": "idefics3"}}
    config = root / "tamis.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ingested(config)
    labels = root / "labels.csv"
    with open(labels, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "label", "annotator"])
        for shape in SHAPES:
            for i in (2, 3):
                w.writerow([str(root / "photos" / shape / image_name(shape, i)), labeled_answer(shape, open_answers),
                            "ada" if i == 2 else "bo"])
    res = tamis_cli("labels", "import", labels, "-c", config)
    assert res.returncode == 0, said(res)
    return config


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return root, make_project(root, open_answers=False)


@pytest.fixture(scope="module")
def open_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes-open")
    return root, make_project(root, open_answers=True)


def expected(root: Path, split: str, open_answers: bool = False) -> dict[str, str]:
    """The file each exported sample's image must be under DIR/images (the user's layout) → its answer."""
    ids = (0, 2, 3) if split == "train" else (1,)
    out = {}
    for shape in SHAPES:
        for i in ids:
            name = image_name(shape, i)
            out[f"images/{shape}/{name}"] = (labeled_answer if i in (2, 3) else seed_answer)(shape, open_answers)
    return out


def content(message: dict) -> list[dict]:
    """A message's content as written: datasets' JSON loader gives every entry every key (text: None on images)."""
    return [{k: v for k, v in c.items() if v is not None} for c in message["content"]]


def renamed_triangle(out: Path) -> str:
    return next(f"images/triangle/{p.name}" for p in (out / "images" / "triangle").iterdir()
                if p.name.startswith("tri~"))


def test_trl_records_load_with_datasets_and_trls_collator_batches_them_on_a_tiny_models_processor(
        closed, tmp_path, tiny_models):
    from datasets import Image as ImageFeature
    from datasets import List, load_dataset
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from pipeline.model.families import get_family

    root, config = closed
    out = tmp_path / "trl"
    res = tamis_cli("export-data", "-c", config, "--format", "trl", "--out", out, "--include-test")
    assert res.returncode == 0, said(res)
    assert "exported 9 labeled training samples, 3 test as trl" in said(res)
    ds = load_dataset("json", data_files={"train": str(out / "train.jsonl"), "test": str(out / "test.jsonl")})
    family = get_family("idefics3")
    for split in ("train", "test"):
        got = {}
        for r in ds[split]:
            answer = r["messages"][1]["content"][0]["text"]
            # The messages tamis trains with (Family.messages), the image where tamis's prompt puts it.
            assert [{"role": m["role"], "content": content(m)} for m in r["messages"]] == family.messages(
                "Which shape is drawn?", answer)
            assert len(r["images"]) == 1
            got[r["images"][0]] = answer
        want = expected(root, split)
        tri = renamed_triangle(out)
        if split == "train":  # Tri.png keeps its name; tri.png (the same name on a case-blind disk) is renamed
            want[tri] = want.pop("images/triangle/tri.png")
        assert got == want
        for rel in got:  # the originals, byte for byte (never the 32-px prepared images)
            orig = root / "photos" / Path(rel).parent.name / (Path(rel).name if rel != tri else "tri.png")
            assert (out / rel).read_bytes() == orig.read_bytes()
            assert os.stat(out / rel).st_ino == os.stat(orig).st_ino  # hard-linked: same filesystem
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["renamed"] == [{"file": tri, "original": "images/triangle/tri.png"}]

    # TRL consumes them: paths made absolute and cast to images, its VLM collator on a real processor.
    processor = AutoProcessor.from_pretrained(tiny_models["idefics3"])
    train = ds["train"].map(lambda r: {"images": [str(out / p) for p in r["images"]]}).cast_column(
        "images", List(ImageFeature()))
    batch = DataCollatorForVisionLanguageModeling(processor)([train[i] for i in range(3)])
    assert batch["input_ids"].shape == batch["labels"].shape and batch["pixel_values"].shape[0] == 3
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert "Which shape is drawn?" in text and train[0]["messages"][1]["content"][0]["text"] in text

    # The same export again lays the images out the same way.
    res = tamis_cli("export-data", "-c", config, "--format", "trl", "--out", out, "--include-test", "--force")
    assert res.returncode == 0, said(res)
    assert renamed_triangle(out) == tri and json.loads((out / "lineage.json").read_text())["renamed"] == \
        lineage["renamed"]


def test_llamafactory_and_swift_records_of_open_answers_load_with_datasets(open_project, tmp_path):
    from datasets import load_dataset

    root, config = open_project
    for fmt, file in (("llamafactory", "train.json"), ("swift", "train.jsonl")):
        out = tmp_path / fmt
        res = tamis_cli("export-data", "-c", config, "--format", fmt, "--out", out)
        assert res.returncode == 0, said(res)
        ds = load_dataset("json", data_files=str(out / file))["train"]
        got = {}
        for r in ds:
            if fmt == "llamafactory":
                turns = [(m["from"], m["value"]) for m in r["conversations"]]
                assert [t[0] for t in turns] == ["human", "gpt"]
            else:
                turns = [(m["role"], m["content"]) for m in r["messages"]]
                assert [t[0] for t in turns] == ["user", "assistant"]
            assert turns[0][1] == "<image>Which shape is drawn?"  # one tag per image
            assert turns[0][1].count("<image>") == len(r["images"]) == 1
            got[r["images"][0]] = turns[1][1]
            with Image.open(out / r["images"][0]) as im:
                im.load()
        want = expected(root, "train", open_answers=True)
        want[renamed_triangle(out)] = want.pop("images/triangle/tri.png")
        assert got == want
        assert not (out / "test.json").exists() and not (out / "test.jsonl").exists()  # no --include-test
        lineage = json.loads((out / "lineage.json").read_text())
        assert lineage["annotators"] == ["ada", "bo"] and lineage["counts"]["train"] == 9
        assert lineage["counts"]["from_ledger"] == 6 and lineage["counts"]["seed"] == 3
        assert str(root) not in (out / "lineage.json").read_text()  # relative paths only
    info = json.loads((tmp_path / "llamafactory" / "dataset_info.json").read_text())
    assert info == {"tamis_train": {"file_name": "train.json", "formatting": "sharegpt",
                                    "columns": {"messages": "conversations", "images": "images"},
                                    "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                                             "assistant_tag": "gpt"}}}


def test_hf_export_loads_from_disk_as_a_datasetdict_whose_images_decode(closed, tmp_path):
    from datasets import load_from_disk

    root, config = closed
    out = tmp_path / "hf"
    res = tamis_cli("export-data", "-c", config, "--format", "hf", "--out", out, "--include-test")
    assert res.returncode == 0, said(res)
    dd = load_from_disk(str(out / "dataset"))
    assert sorted(dd) == ["test", "train"] and len(dd["train"]) == 9 and len(dd["test"]) == 3
    assert set(dd["train"].column_names) == {"id", "image", "question", "answer", "file"}
    for r in dd["train"]:
        with Image.open(out / r["file"]) as orig:
            assert r["image"].size == orig.size  # the original, not the prepared image
        assert r["question"] == "Which shape is drawn?" and r["answer"] in SHAPES


def test_export_data_refuses_a_full_folder_without_force_and_any_folder_in_the_artifacts(closed, tmp_path):
    root, config = closed
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "test.jsonl").write_text("an earlier export's test split\n")
    res = tamis_cli("export-data", "-c", config, "--format", "swift", "--out", out)
    assert res.returncode == 2, said(res)
    assert f"--out {out}: the folder is not empty (2 entries: notes.txt, test.jsonl)" in said(res)
    assert "export-data --format swift writes train.jsonl, test.jsonl, images, lineage.json there" in said(res)
    res = tamis_cli("export-data", "-c", config, "--format", "swift", "--out", out, "--force")
    assert res.returncode == 0, said(res)
    # Without --include-test the earlier test split would pass for this export's: it goes; the user's file stays.
    assert sorted(p.name for p in out.iterdir()) == ["images", "lineage.json", "notes.txt", "train.jsonl"]

    art = load_config(config).artifacts
    res = tamis_cli("export-data", "-c", config, "--format", "trl", "--out", art / "exports", "--force")
    assert res.returncode == 2, said(res)
    assert "is in the project's artifacts folder" in said(res) and not (art / "exports").exists()


def test_several_images_and_turns_are_tagged_in_order_and_an_image_tag_in_a_question_is_refused():
    from pipeline.dataexport.records import Sample, Turn
    from pipeline.dataexport.writers import LlamaFactoryWriter, SwiftWriter, TrlWriter
    from pipeline.errors import DataError

    s = Sample("x", ("images/a.png", "images/b.png"), (Turn("Same shape?", "yes"), Turn("Which colour?", "red")),
               "train")
    assert [m["content"] for m in SwiftWriter().record(s)["messages"]] == [
        "<image><image>Same shape?", "yes", "Which colour?", "red"]
    trl = TrlWriter().record(s)["messages"]
    assert trl[0]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same shape?"}]
    assert [m["role"] for m in trl] == ["user", "assistant", "user", "assistant"]
    bad = Sample("y", ("images/a.png",), (Turn("What does <image> show?", "a"),), "train")
    with pytest.raises(DataError, match=r"sample y: .*holds <image>.*--format trl / hf"):
        LlamaFactoryWriter().record(bad)


def test_image_names_are_placed_the_same_way_whatever_the_order():
    from pipeline.dataexport.images import place

    named = {"s1": ("images/a/X.png", "d1"), "s2": ("images/a/x.png", "d2"), "s3": ("images/a/X.png", "d1"),
             "s4": ("images/b/x.png", "d3")}
    files, renamed = place(named)
    assert files == {"s1": "images/a/X.png", "s2": "images/a/x~d2.png", "s3": "images/a/X.png",
                     "s4": "images/b/x.png"}
    assert renamed == [{"file": "images/a/x~d2.png", "original": "images/a/x.png"}]
    assert place(dict(reversed(list(named.items())))) == (files, renamed)


def test_a_tie_the_consensus_settles_is_exported_with_its_label_and_the_project_is_left_as_it_was(tmp_path):
    """annotate.consensus dawid_skene: ada and bo agree everywhere, cy never does; on circle_4 only ada and cy voted
    (a tie at import: no ledger label). The export holds the label a round's consensus would settle it on (ada's,
    the reliable one) without writing that consensus into the project."""
    from pipeline.store import digest_dir

    manifest = write_shapes(tmp_path, open_answers=False)
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(tmp_path / "artifacts")}, "annotate": {"consensus": "dawid_skene"},
        "data": {"sources": [{"kind": "jsonl", "path": str(manifest)}], "question": "Which shape is drawn?",
                 "answers": list(SHAPES)},
        "model": {"name_or_path": str(tmp_path / "no-model"), "family": "idefics3"}}))
    art = ingested(config)
    wrong = {"circle": "square", "square": "triangle", "triangle": "circle"}
    votes = [(s, i, s, who) for s in SHAPES for i in (2, 3) for who in ("ada", "bo")]
    votes += [(s, i, wrong[s], "cy") for s in SHAPES for i in (2, 3)]
    votes += [("circle", 4, "circle", "ada"), ("circle", 4, "square", "cy")]
    with open(tmp_path / "votes.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "label", "annotator"])
        for shape, i, label, who in votes:
            w.writerow([str(tmp_path / "photos" / shape / image_name(shape, i)), label, who])
    res = tamis_cli("labels", "import", tmp_path / "votes.csv", "-c", config)
    assert res.returncode == 0 and "tie" in said(res), said(res)
    before = digest_dir(art)

    out = tmp_path / "export"
    res = tamis_cli("export-data", "-c", config, "--format", "trl", "--out", out)
    assert res.returncode == 0, said(res)
    assert digest_dir(art) == before  # nothing written: no ledger entry, no consensus.json
    rows = {json.loads(x)["images"][0]: json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()}
    assert rows["images/circle/circle_4.png"]["messages"][1]["content"][0]["text"] == "circle"
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["counts"]["consensus_not_yet_in_ledger"] == 1 and lineage["counts"]["train"] == 10
    settled = next(r for r in lineage["labels"] if r["files"] == ["images/circle/circle_4.png"])
    assert settled["source_file"] == "consensus.json" and settled["label"] == "circle"
    assert sorted(v["annotator"] for v in settled["votes"]) == ["ada", "cy"]
    assert lineage["annotators"] == ["ada", "bo", "cy"] and lineage["consensus"] == "dawid_skene"


@pytest.mark.parametrize("name", sorted(__import__("pipeline.dataexport", fromlist=["WRITERS"]).WRITERS))
def test_every_writer_writes_only_its_declared_files_and_every_sample_of_every_split(name, tmp_path):
    """The writers' contract: `files` names all it writes (what --force replaces), and each split's samples are in it."""
    from datasets import load_from_disk

    from pipeline.dataexport.records import Sample, Turn
    from pipeline.dataexport.writers import WRITERS

    (tmp_path / "images" / "a").mkdir(parents=True)
    splits = {}
    for split, shapes in (("train", SHAPES), ("test", SHAPES[:1])):
        splits[split] = []
        for i, shape in enumerate(shapes):
            rel = f"images/a/{split}-{shape}.png"
            draw(shape, i).save(tmp_path / rel)
            splits[split].append(Sample(f"{split}{i}", (rel,), (Turn("Which shape is drawn?", shape),), split))
    writer = WRITERS[name]()
    written = writer.write(splits, tmp_path)
    assert {p.name for p in written} <= set(writer.files)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"images", *(p.name for p in written)})
    ids = set()
    for p in written:
        if p.is_dir():
            ids |= {i for part in load_from_disk(str(p)).values() for i in part["id"]}
        elif p.name != "dataset_info.json":
            text = p.read_text()
            ids |= {r["id"] for r in (json.loads(text) if p.suffix == ".json" else map(json.loads, text.splitlines()))}
    assert ids == {s.id for rows in splits.values() for s in rows}


def test_an_image_changed_or_gone_since_ingest_is_exported_as_ingested_so_it_matches_its_label(tmp_path):
    config = make_project(tmp_path, open_answers=False)
    changed, gone = tmp_path / "photos" / "circle" / "circle_2.png", tmp_path / "photos" / "square" / "square_3.jpg"
    was = {changed: changed.read_bytes(), gone: gone.read_bytes()}
    draw("triangle", 9).save(changed)  # the user drew over it after ingest: its label is the circle's
    gone.unlink()
    out = tmp_path / "export"
    res = tamis_cli("export-data", "-c", config, "--format", "swift", "--out", out)
    assert res.returncode == 0, said(res)
    assert "(7 hard-linked, 0 copied, 2 written from the ingested bytes)" in said(res)
    assert (out / "images/circle/circle_2.png").read_bytes() == was[changed]
    assert (out / "images/square/square_3.jpg").read_bytes() == was[gone]
