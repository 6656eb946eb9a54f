"""Conversation sources (issue 51 item 1): TRL, LLaMA-Factory sharegpt and ms-swift records read into samples of
several images and turns, a placeholder / image-list mismatch quarantined with both counts, and a project's ingested
rows carrying every image and the context, while one-image rows keep their IDs."""

import io
import json

import pytest
from PIL import Image

from pipeline.config import parse_config
from pipeline.data.conversations import ShareGptColumns, parse
from pipeline.data.ingest import ingest, load_ingested
from pipeline.data.readers import READERS, RawRow, Rejected
from pipeline.schema import INGEST_COLUMNS, MORE_COLUMNS, sample_id_for, sample_id_of
from pipeline.store import read_jsonl


def picture(seed: int, size=(24, 16)) -> bytes:
    """A generated picture (not the digits): a gradient whose colours depend on `seed`."""
    img = Image.new("RGB", size)
    img.putdata([((x * 9 + seed * 40) % 256, (y * 13 + seed * 70) % 256, (seed * 90) % 256)
                 for y in range(size[1]) for x in range(size[0])])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def trl(images, turns):
    """A TRL record: `turns` is [(user text, answer or None), ...]; every image in the first user turn."""
    messages = []
    for i, (q, a) in enumerate(turns):
        messages.append({"role": "user", "content": [{"type": "image"}] * (len(images) if i == 0 else 0)
                         + [{"type": "text", "text": q}]})
        if a is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return {"messages": messages, "images": images}


def test_each_kind_parses_into_images_question_answer_and_context():
    t = parse(trl(["a.png", "b.png"], [("Same shape?", "yes"), ("Which is bigger?", "left")]), "trl")
    assert (t.images, t.question, t.answer) == (("a.png", "b.png"), "Which is bigger?", "left")
    assert t.context == (("user", "Same shape?"), ("assistant", "yes"))
    s = parse({"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "<image><image>Compare."},
                            {"role": "assistant", "content": "same"}], "images": ["a.png", "b.png"]}, "swift")
    assert (s.question, s.answer, s.context) == ("Compare.", "same", (("system", "Be brief."),))
    g = parse({"conversations": [{"from": "human", "value": "<image>What?"}], "images": ["a.png"]}, "sharegpt")
    assert (g.question, g.answer, g.context) == ("What?", None, ())  # ends on a user turn: unlabeled


@pytest.mark.parametrize("kind,rec,counts", [
    ("trl", trl(["a.png", "b.png"], [("Q", "A")]) | {"images": ["a.png"]}, "2 {'type': 'image'} item(s) in its "
     "turns but 1 image(s)"),
    ("swift", {"messages": [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}],
               "images": ["a.png", "b.png"]}, "1 <image> tag(s) in its turns but 2 image(s)"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
                  "images": ["a.png"]}, "0 <image> tag(s) in its turns but 1 image(s)"),
])
def test_a_placeholder_count_that_is_not_the_image_count_is_refused_with_both_counts_and_the_fix(kind, rec, counts):
    reason = parse(rec, kind)
    assert isinstance(reason, str) and counts in reason and "put one" in reason


def test_turns_out_of_order_are_refused():
    rec = {"messages": [{"role": "assistant", "content": "<image>hi"}], "images": ["a.png"]}
    assert "alternating" in parse(rec, "swift")


def test_sharegpt_reads_the_column_names_of_the_dataset_info_json_beside_its_file(tmp_path):
    (tmp_path / "p.png").write_bytes(picture(1))
    (tmp_path / "chats.json").write_text(json.dumps([
        {"dialog": [{"speaker": "client", "text": "<image>Colour?"}, {"speaker": "bot", "text": "teal"}],
         "pics": ["p.png"], "sys": "Answer in one word."}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {
        "file_name": "chats.json", "formatting": "sharegpt",
        "columns": {"messages": "dialog", "images": "pics", "system": "sys"},
        "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "client", "assistant_tag": "bot"}}}))
    from pipeline.config import DataConfig, SourceConfig

    source = SourceConfig(kind="sharegpt", path=tmp_path / "chats.json")
    [row] = READERS["sharegpt"]().rows(source, DataConfig(sources=[source]))
    assert isinstance(row, RawRow)
    assert (row.question, row.answer, row.context, row.source) == (
        "Colour?", "teal", (("system", "Answer in one word."),), f"{tmp_path / 'chats.json'}:record 1")
    assert ShareGptColumns().messages == "conversations"  # without the file, LLaMA-Factory's defaults


def project(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(4):
        (root / f"shot{i}.png").write_bytes(picture(i))
    rows = [trl(["shot0.png", "shot1.png"], [("Which one is warmer?", "left")]),
            trl(["shot2.png", "shot3.png"], [("Describe both.", "two gradients"), ("Which is warmer?", "right")]),
            trl(["shot0.png", "shot2.png"], [("Which one is warmer?", None)]),
            trl(["shot3.png"], [("What colour?", "green")]),
            trl(["shot0.png", "shot1.png"], [("Q", "A")]) | {"images": ["shot0.png"]}]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_config({"data": {"sources": [{"kind": "trl", "path": str(root / "pairs.jsonl")}]},
                         "paths": {"artifacts": str(tmp_path / "art")}}), root


def test_a_trl_project_ingests_every_image_and_turn_and_quarantines_a_mismatch_with_file_line_and_counts(tmp_path):
    cfg, root = project(tmp_path)
    m = ingest(cfg.data, cfg.artifacts, tmp_path / "out")
    assert m.info["counts"] == {"read": 5, "ingested": 4, "quarantined": 1, "duplicates": 0}
    [q] = read_jsonl(tmp_path / "out" / "quarantine.jsonl")
    assert q["source"] == f"{root / 'pairs.jsonl'}:5"
    assert "2 {'type': 'image'} item(s) in its turns but 1 image(s) in 'images'" in q["reason"]
    ds = load_ingested(tmp_path / "out")
    assert tuple(ds.column_names) == (*INGEST_COLUMNS, *MORE_COLUMNS)
    rows = {r["source"].rsplit(":", 1)[1]: r for r in ds}
    two = rows["2"]
    assert [m["image"] for m in two["more_images"]] == [picture(3)] and two["image"] == picture(2)
    assert two["more_images"][0]["image_path"] == str((root / "shot3.png").resolve())
    assert two["context"] == [{"role": "user", "text": "Describe both."}, {"role": "assistant", "text": "two gradients"}]
    assert (two["question"], two["answer"], two["split"]) == ("Which is warmer?", "right", "train")
    assert two["sample_id"] == sample_id_of([picture(2), picture(3)], "Which is warmer?",
                                            [("user", "Describe both."), ("assistant", "two gradients")])
    assert rows["3"]["split"] == "pool" and rows["3"]["answer"] is None
    # A one-image row keeps the ID a one-image manifest gives the same picture and question.
    assert rows["4"]["sample_id"] == sample_id_for(picture(3), "What colour?") and rows["4"]["more_images"] == []


def test_reingest_reuses_the_shards_and_a_changed_second_image_changes_the_sample(tmp_path):
    cfg, root = project(tmp_path)
    ingest(cfg.data, cfg.artifacts, tmp_path / "out1")
    again = ingest(cfg.data, cfg.artifacts, tmp_path / "out2")
    assert again.info["rows_read"] == 0
    before = {r["source"]: r["sample_id"] for r in load_ingested(tmp_path / "out1")}
    (root / "shot1.png").write_bytes(picture(7))
    ingest(cfg.data, cfg.artifacts, tmp_path / "out3")
    after = {r["source"]: r["sample_id"] for r in load_ingested(tmp_path / "out3")}
    changed = {s for s in before if before[s] != after.get(s)}
    assert changed == {f"{root / 'pairs.jsonl'}:1"}


def test_a_bad_second_image_is_rejected_naming_which_image(tmp_path):
    from pipeline.config import DataConfig, SourceConfig

    (tmp_path / "a.png").write_bytes(picture(1))
    (tmp_path / "c.jsonl").write_text(json.dumps(trl(["a.png", "gone.png"], [("Q", "A")])) + "\n")
    source = SourceConfig(kind="trl", path=tmp_path / "c.jsonl")
    [row] = READERS["trl"]().rows(source, DataConfig(sources=[source]))
    assert isinstance(row, Rejected) and row.reason.startswith("image 2 of 2: file not found")


# --- tamis init detects each format, in a file or in the folder that holds it ---

def formats_folder(root, kind):
    """A folder of generated pictures and one conversation file of `kind` (two-image, multi-turn and unlabeled rows),
    written as its framework writes it."""
    root.mkdir(parents=True)
    for i in range(4):
        (root / f"shot{i}.png").write_bytes(picture(i, (40 + 8 * i, 30)))
    pairs = [(["shot0.png", "shot1.png"], "left"), (["shot2.png", "shot3.png"], "right"), (["shot1.png"], None)]
    if kind == "trl":
        recs = [trl(im, [("Which is warmer?", a)]) for im, a in pairs]
    elif kind == "swift":
        recs = [{"messages": [{"role": "user", "content": "<image>" * len(im) + "Which is warmer?"}]
                 + ([{"role": "assistant", "content": a}] if a else []), "images": im} for im, a in pairs]
    else:
        recs = [{"conversations": [{"from": "human", "value": "<image>" * len(im) + "Which is warmer?"}]
                 + ([{"from": "gpt", "value": a}] if a else []), "images": im} for im, a in pairs]
        (root / "dataset_info.json").write_text(json.dumps({"pairs": {"file_name": "data.json",
                                                                      "formatting": "sharegpt"}}))
    name = "data.json" if kind == "sharegpt" else "data.jsonl"
    (root / name).write_text(json.dumps(recs) if name.endswith(".json") else
                             "".join(json.dumps(r) + "\n" for r in recs))
    return root / name


@pytest.mark.parametrize("kind", ["trl", "sharegpt", "swift"])
def test_init_detects_each_conversation_format_in_its_file_and_its_folder(kind, tmp_path):
    from pipeline.project_init.detect import detect_source

    file = formats_folder(tmp_path / "d", kind)
    for path in (file, file.parent):
        found = detect_source(path)
        assert found.source == {"kind": kind, "path": str(file)}
        assert (found.images, found.labeled, found.answers) == (3, 2, ["left", "right"])
        assert "1 with several images" not in found.what and "2 with several images" in found.what
        assert ("(columns from dataset_info.json:pairs)" in found.what) == (kind == "sharegpt")


def test_cli_init_on_a_folder_with_a_trl_jsonl_writes_a_config_that_ingests_both_images(tmp_path, tiny_models):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.config import load_config

    file = formats_folder(tmp_path / "pairs", "trl")
    tamis = Path(sys.executable).parent / "tamis"
    done = subprocess.run([str(tamis), "init", str(file.parent), "--model", str(tiny_models["idefics3"])],
                          cwd=tmp_path, env={**os.environ, "COLUMNS": "2000"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "trl conversations: 3 records" in done.stdout
    cfg = load_config(tmp_path / "tamis.yaml")
    assert [(s.kind, s.path) for s in cfg.data.sources] == [("trl", file)]
    ingest(cfg.data, tmp_path / "art", tmp_path / "out")
    ds = load_ingested(tmp_path / "out")
    assert sorted(len(r["more_images"]) for r in ds) == [0, 1, 1]
