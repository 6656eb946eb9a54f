"""Samples of several images, the library parts of issue 51 item 2 done so far: every image of a sample prepared as
the first is (aspect kept), a sample's embedding from its images' as stated, and a Label Studio task and config with
one Image per picture (and the earlier turns shown)."""

import io
import xml.etree.ElementTree as ET

import numpy as np
from PIL import Image

from pipeline.config import PreprocessConfig
from pipeline.fields.labelstudio import labeling_config, sample_task
from pipeline.preprocess import MORE_PREPARED, decode_prepared, prepare_image, prepare_more_batch
from pipeline.several_images import sample_embedding


def png(size, colour=(200, 80, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_every_later_image_is_prepared_as_the_first_is_with_its_aspect_kept_and_a_bad_one_keeps_its_reason():
    wide, tall = png((120, 40)), png((30, 90), (10, 10, 200))
    batch = {"more_images": [[{"image": wide}, {"image": tall}], [], [{"image": b"not an image"}]]}
    out = prepare_more_batch(batch, cfg=PreprocessConfig(), size=48, max_pixels=10**7)
    assert set(out) == set(MORE_PREPARED) and [len(v) for v in out["more_prepared"]] == [2, 0, 1]
    assert (out["more_prep_width"][0], out["more_prep_height"][0]) == ([48, 16], [16, 48])
    first = decode_prepared(out["more_prepared"][0][0])
    assert np.array_equal(first, prepare_image(wide, PreprocessConfig(), size=48, max_pixels=10**7))
    assert out["more_prepared"][2] == [None] and "not a decodable image" in out["more_prep_error"][2][0]
    padded = prepare_more_batch({"more_images": [[{"image": wide}]]}, cfg=PreprocessConfig(pad="square"), size=48,
                                max_pixels=10**7)
    assert padded["more_prep_box"][0] == [[0, 16, 48, 16]] and padded["more_prep_height"][0] == [48]


def test_a_samples_embedding_is_the_normalised_mean_of_its_images_and_a_single_image_keeps_its_own():
    a, b = np.array([3.0, 4.0]), np.array([0.0, 2.0])
    assert np.allclose(sample_embedding([a]), a / 5)
    both = sample_embedding([a, b])
    assert np.allclose(both, sample_embedding([b, a])) and np.isclose(np.linalg.norm(both), 1)
    assert np.allclose(both, (a / 5 + b / 2) / np.linalg.norm(a / 5 + b / 2))


def test_a_label_studio_task_shows_every_picture_and_the_earlier_turns():
    task = sample_task("s1", ["/data/local-files/?d=a.png", "/data/local-files/?d=b.png"], "Which is warmer?",
                       [("user", "Describe both."), ("assistant", "a red bar, a blue bar")])
    assert task["data"] == {"image": "/data/local-files/?d=a.png", "image_2": "/data/local-files/?d=b.png",
                            "text": "Which is warmer?", "sample_id": "s1",
                            "context": "user: Describe both.\nassistant: a red bar, a blue bar"}
    view = ET.fromstring(labeling_config(2, answers=["left", "right"], context=True))
    keys = [e.get("value")[1:] for e in view.iter("Image")] + [e.get("value")[1:] for e in view.iter("Text")]
    assert set(keys) == set(task["data"]) - {"sample_id"}
    assert [c.get("value") for c in view.find("Choices[@name='answer']")] == ["left", "right"]
    assert ET.fromstring(labeling_config(1)).find("TextArea[@name='answer']") is not None


# ------------------------------------------------------------------ the family's chat with several pictures
import pytest  # noqa: E402

from pipeline.model.families import FAMILIES, get_family  # noqa: E402


def _pictures(n: int) -> list[Image.Image]:
    return [Image.fromarray(np.full((32, 32, 3), 40 * (i + 1), np.uint8)) for i in range(n)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_pictures_give_two_image_items_and_placeholders_and_one_picture_the_one_image_chat(tiny_models, family):
    """Scoring and training build a sample's chat from its pictures and context (issue 51 item 2): two pictures put
    two image items in the chat, which the real processor expands into twice the image tokens of one; a one-image
    sample without context renders byte for byte what a plain question did (the cache keys of one-image projects)."""
    from transformers import AutoProcessor

    from pipeline.schema import Question

    fam, proc = get_family(family), AutoProcessor.from_pretrained(tiny_models[family])
    one = fam.prompt(proc, "What changed?", "flipped")
    assert fam.prompt(proc, Question("What changed?"), "flipped") == one
    assert fam.messages("What changed?") == [{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "What changed?"}]}]
    two = Question("What changed?", context=(("user", "Look at both."), ("assistant", "I see them.")), images=2)
    msgs = fam.messages(two, "flipped")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert [c["type"] for c in msgs[0]["content"]] == ["image", "image", "text"]
    assert "Look at both." in fam.prompt(proc, two) and "I see them." in fam.prompt(proc, two)
    pic = _pictures(2)
    image_id = proc.tokenizer.convert_tokens_to_ids(fam.image_token)
    n1 = int((fam.encode(proc, [pic[0]], ["What changed?"])["input_ids"] == image_id).sum())
    enc = fam.encode(proc, [pic], [two], ["flipped"])
    two_tokens = int((enc["input_ids"] == image_id).sum())
    if family == "llava_onevision":  # a picture among several gets its base features only (no anyres grid): fewer
        assert fam.prompt(proc, two).count("<image>") == 2 and two_tokens % 2 == 0 and 0 < two_tokens
    else:
        assert n1 > 0 and two_tokens == 2 * n1
    assert (enc["labels"] != -100).sum() > 0  # the answer is still located after the longer prompt
    with pytest.raises(Exception, match="row 0 has 2 image"):
        fam.encode(proc, [pic], [Question("What changed?")])


def test_the_reports_picture_of_a_two_picture_sample_shows_both_side_by_side(tmp_path):
    """The round report's thumbnails and contact sheet read gather.Images.png: a sample of several pictures gets them
    all, left to right; a one-picture sample its prepared PNG as it is."""
    import datasets

    from pipeline.roundreport.gather import Images
    from pipeline.store import write_manifest

    a, b = png((30, 20)), png((10, 20), (0, 0, 250))
    ds = datasets.Dataset.from_dict({"sample_id": ["two", "one"], "prepared": [a, a], "more_prepared": [[b], []]})
    ds.save_to_disk(str(tmp_path / "dataset"))
    write_manifest(tmp_path, stage="preprocess", stage_version="1", inputs={}, config={},
                   outputs={"dataset": "dataset"})
    got = Images(str(tmp_path)).png(["two", "one"])
    assert got["one"] == a
    both = Image.open(io.BytesIO(got["two"])).convert("RGB")
    assert both.size == (30 + 4 + 10, 20)
    assert both.getpixel((5, 5)) == (200, 80, 20) and both.getpixel((40, 5)) == (0, 0, 250)


def _two_picture_rows(bad_second: bool = False):
    """An ingested table of a conversation project: two two-picture samples (a before / after pair each, the second
    sample's after-picture broken when `bad_second`) and one one-picture sample with an earlier turn."""
    import datasets

    from pipeline.data.multi import more_features

    wide, tall = png((60, 30)), png((20, 40), (10, 10, 200))
    more = [[{"image": tall, "image_path": "/data/after_a.png", "width": 20, "height": 40, "mode": "RGB"}],
            [{"image": b"broken" if bad_second else wide, "image_path": "/data/after_b.png", "width": 60,
              "height": 30, "mode": "RGB"}], []]
    feats = datasets.Features({"sample_id": datasets.Value("string"), "image": datasets.Value("binary"),
                               "image_path": datasets.Value("string"), "question": datasets.Value("string"),
                               **more_features()})
    return datasets.Dataset.from_dict({
        "sample_id": ["pa", "pb", "pc"], "image": [wide, tall, wide],
        "image_path": ["/data/before_a.png", "/data/before_b.png", "/data/single.png"],
        "question": ["What changed?"] * 3, "more_images": more,
        "context": [[], [], [{"role": "user", "text": "Look closely."}]]}, features=feats)


def test_the_preprocess_stage_prepares_every_picture_and_quarantines_a_sample_whose_later_picture_fails(tmp_path):
    from pipeline.preprocess import load_prepared, preprocess_dataset

    m = preprocess_dataset(_two_picture_rows(bad_second=True), PreprocessConfig(), tmp_path, size=32,
                           max_pixels=10**7)
    assert m.info["rows"] == 2 and m.info["quarantined"] == 1
    from pipeline.store import read_jsonl

    (q,) = read_jsonl(tmp_path / "quarantine.jsonl")
    assert q["sample_id"] == "pb" and q["reason"].startswith("image 2 of 2: ")
    ds = load_prepared(tmp_path)
    assert "more_prep_error" not in ds.column_names and "prep_error" not in ds.column_names
    first = ds[0]
    assert (first["more_prep_width"], first["more_prep_height"]) == ([16], [32])  # the tall picture, aspect kept
    assert decode_prepared(first["more_prepared"][0]).shape[:2] == (32, 16)  # not stretched (no pad by default)
    assert ds[1]["more_prepared"] == []


def test_the_round_export_shows_every_picture_with_its_original_name_and_the_earlier_turns(tmp_path):
    import csv
    import json

    from pipeline.annotation.export import export_selection
    from pipeline.config import AnnotateConfig
    from pipeline.preprocess import load_prepared, preprocess_dataset

    preprocess_dataset(_two_picture_rows(), PreprocessConfig(), tmp_path / "prep", size=32, max_pixels=10**7)
    out = tmp_path / "artifacts" / "rounds" / "000" / "export"
    sel = [{"sample_id": s, "rank": k, "score": 1.0} for k, s in enumerate(["pa", "pb", "pc"])]
    export_selection(sel, load_prepared(tmp_path / "prep"), AnnotateConfig(export_images="original"),
                     ["same", "flipped"], tmp_path / "artifacts", out, round_index=0)
    tasks = {t["data"]["sample_id"]: t["data"] for t in json.loads((out / "label_studio_tasks.json").read_text())}
    assert tasks["pa"]["image_2"].endswith("/images/pa_2.png") and tasks["pa"]["original_image_2"] == "after_a.png"
    assert "image_2" not in tasks["pc"] and tasks["pc"]["context"] == "user: Look closely."
    assert (out / "images" / "pa_2.png").read_bytes() == png((20, 40), (10, 10, 200))  # the original, as it was
    view = ET.fromstring((out / "label_config.xml").read_text())
    assert [i.get("value") for i in view.iter("Image")] == ["$image", "$image_2"]
    assert [c.get("value") for c in view.iter("Choice")] == ["same", "flipped"]
    with (out / "annotate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["sample_id", "image", "original_image", "text", "model_answer", "confidence",
                             "image_2", "original_image_2", "context", "label"]
    assert [(r["original_image"], r["original_image_2"]) for r in rows] == [
        ("before_a.png", "after_a.png"), ("before_b.png", "after_b.png"), ("single.png", "")]


def test_augmentation_draws_one_transform_per_copy_for_every_picture_of_a_sample(tmp_path):
    """Two identical pictures stay identical in every augmented copy (the same flip, rotation and brightness), and
    the copies differ from the original: a before / after pair stays comparable."""
    import datasets

    from pipeline.augment import augment_labeled, load_augmented
    from pipeline.config import AugmentConfig

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
    pic = buf.getvalue()
    ds = datasets.Dataset.from_dict({"sample_id": ["s"], "prepared": [pic], "more_prepared": [[pic]],
                                     "question": ["Same?"], "answer": ["same"], "split": ["train"]})
    cfg = AugmentConfig(copies=3, image={"affine_p": 1.0, "horizontal_flip_p": 0.5, "brightness_contrast_p": 1.0})
    augment_labeled(ds, cfg, 7, tmp_path)
    out = load_augmented(tmp_path)
    assert len(out) == 3
    for row in out:
        assert row["more_prepared"] == [row["prepared"]] and row["prepared"] != pic


def test_a_two_picture_samples_selection_vector_is_the_normalised_mean_of_its_pictures():
    """The selection space (pixels embedder, fitted on first pictures): a two-picture sample's vector is
    sample_embedding of its two pictures' vectors; a sample whose pictures are the same is that picture's direction."""
    import datasets

    from pipeline.embedders import PixelsEmbedder
    from pipeline.embeddings import _embed

    rng = np.random.default_rng(1)

    def pic():
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    a, b, c = pic(), pic(), pic()
    emb = PixelsEmbedder(side=8, dim=2).fit([decode_prepared(p) for p in (a, b, c)])
    table = datasets.Dataset.from_dict({"sample_id": ["ab", "aa"], "prepared": [a, a], "more_prepared": [[b], [a]]})
    got = _embed(emb, table)
    one = emb.embed([decode_prepared(a), decode_prepared(b)])
    assert np.allclose(got[0], sample_embedding([one[0], one[1]]), atol=1e-6)
    assert np.allclose(got[1], one[0] / np.linalg.norm(one[0]), atol=1e-6)
