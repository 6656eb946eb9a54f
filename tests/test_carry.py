"""Labels follow their images (issue 36): a labeled photo re-saved in place with another compression, or re-saved
under another folder, keeps its label under its new sample ID; a removed one is listed as an orphan, never lost."""

import json

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from flows.cli.main import app
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import load_config
from pipeline.preprocess import load_prepared
from pipeline.round.plan import PoolData, labels_now

runner = CliRunner()
PHOTOS = {"astronaut": "person", "chelsea": "cat", "coffee": "cup", "rocket": "rocket", "camera": "person"}


def _photo(name):
    import skimage.data

    img = getattr(skimage.data, name)()
    img = np.stack([img] * 3, -1) if img.ndim == 2 else img[..., :3]
    h, w = img.shape[:2]
    return Image.fromarray(img[h // 4: h // 4 + 96, w // 4: w // 4 + 128])  # a crop: small, and not the digits


def _prepared(config):
    res = runner.invoke(app, ["prepare", "--config", str(config)])
    assert res.exit_code == 0, res.output
    refs = json.loads((load_config(config).artifacts / "prepare" / "latest.json").read_text())
    return refs["prepare"]["dir"]


@pytest.fixture
def project(tmp_path):
    photos, more = tmp_path / "photos", tmp_path / "more"
    photos.mkdir()
    more.mkdir()
    for name in PHOTOS:
        _photo(name).save(photos / f"{name}.png", compress_level=9)
    config = tmp_path / "tamis.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(tmp_path / "artifacts")},
        "data": {"sources": [{"kind": "folder", "path": str(photos)}, {"kind": "folder", "path": str(more)}],
                 "answers": sorted(set(PHOTOS.values())), "question": "What is in the photo?"},
        "preprocess": {"size": 32}}))
    return config, photos, more


def test_a_re_saved_or_moved_photo_keeps_its_label_and_a_removed_one_is_an_orphan(project, tmp_path, prefect_harness):
    config, photos, more = project
    art = load_config(config).artifacts
    _prepared(config)
    labels = tmp_path / "labels.csv"
    labels.write_text("image,label\nchelsea.png,cat\ncoffee.png,cup\nrocket.png,rocket\n")
    res = runner.invoke(app, ["labels", "import", str(labels), "--config", str(config)])
    assert res.exit_code == 0 and "3 labels appended" in res.output, res.output
    old = Ledger(ledger_path(art)).labels()

    # The same pixels in other bytes: chelsea re-saved in place, coffee re-saved into the other folder; rocket gone.
    Image.open(photos / "chelsea.png").save(photos / "chelsea.png", compress_level=0)
    Image.open(photos / "coffee.png").save(more / "coffee.png", compress_level=1)
    (photos / "coffee.png").unlink()
    (photos / "rocket.png").unlink()
    prep = _prepared(config)
    pool = PoolData.load(prep)
    assert not any(pool.index.knows(sorted(old)))  # every labeled sample has a new ID (or none) now

    labels_after = labels_now(art, pool, round_index=1)  # the round's import step
    by_path = dict(zip(pool.ids.to_pylist(), load_prepared(prep)["image_path"], strict=True))
    carried = {by_path[s].replace(str(tmp_path) + "/", ""): label for s, label in labels_after.items()}
    assert carried == {"photos/chelsea.png": "cat", "more/coffee.png": "cup"}
    entries = [e for e in Ledger(ledger_path(art)).entries() if e["kind"] == "carry"]
    assert sorted(e["reason"].split(" (")[0] for e in entries) == ["same pixels at the same path", "same pixels moved"]
    assert {e["carried_from"] for e in entries} == {s for s, label in old.items() if label in ("cat", "cup")}
    assert labels_now(art, pool, round_index=1) == labels_after  # a re-run carries nothing twice
    assert sum(e["kind"] == "carry" for e in Ledger(ledger_path(art)).entries()) == 2

    # The removed photo's label is an orphan: counted by `tamis status`, listed by `tamis labels orphans`.
    res = runner.invoke(app, ["labels", "orphans", "--config", str(config)])
    assert res.exit_code == 0 and "1 labels matching no sample" in res.output and "rocket" in res.output, res.output
    res = runner.invoke(app, ["labels", "orphans", "--json", "--config", str(config)])
    [orphan] = json.loads(res.output)
    assert orphan["label"] == "rocket" and orphan["image_path"] == str(photos / "rocket.png")
    res = runner.invoke(app, ["status", "--json", "--config", str(config)])
    status = json.loads(res.output)
    assert status["orphan_labels"] == 1 and status["carried"] == 2 and status["labeled"] == 3


def test_other_pixels_at_the_same_path_do_not_take_the_label(project, tmp_path, prefect_harness):
    """A different photo saved over a labeled one is another image: its label does not carry, it is an orphan."""
    config, photos, _ = project
    art = load_config(config).artifacts
    _prepared(config)
    (tmp_path / "l.csv").write_text("image,label\nchelsea.png,cat\n")
    assert runner.invoke(app, ["labels", "import", str(tmp_path / "l.csv"), "--config", str(config)]).exit_code == 0
    _photo("coffee").save(photos / "chelsea.png")
    prep = _prepared(config)
    assert labels_now(art, PoolData.load(prep), round_index=1) == {}
    assert [o["label"] for o in json.loads(runner.invoke(
        app, ["labels", "orphans", "--json", "--config", str(config)]).output)] == ["cat"]


def _jpeg_smaller(src, dest, quality=70, scale=0.8):
    im = Image.open(src).convert("RGB")
    im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.LANCZOS).save(
        dest, "JPEG", quality=quality)


def test_a_photo_re_encoded_with_loss_renamed_or_not_keeps_its_label_a_changed_one_does_not(project, tmp_path,
                                                                                             prefect_harness):
    """Issue 46, row 21: a PNG re-saved as a JPEG (quality 70, resized by 0.8) in place or under another name is the
    same picture; a photo with a patch painted over is not, and stays an orphan."""
    config, photos, more = project
    art = load_config(config).artifacts
    _prepared(config)
    (tmp_path / "l.csv").write_text("image,label\nchelsea.png,cat\ncoffee.png,cup\nastronaut.png,person\n")
    assert runner.invoke(app, ["labels", "import", str(tmp_path / "l.csv"), "--config", str(config)]).exit_code == 0
    old = Ledger(ledger_path(art)).labels()
    # A project whose labeled images were recorded before looks were: the next round records them while it can.
    prep = _prepared(config)
    labels_now(art, PoolData.load(prep), round_index=0)
    record = art / "labeled_images.jsonl"
    record.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "look"}) + "\n"
                              for line in record.read_text().splitlines()))
    labels_now(art, PoolData.load(prep), round_index=0)
    assert {json.loads(line)["sample_id"] for line in record.read_text().splitlines() if json.loads(line).get("look")
            } == set(old)

    _jpeg_smaller(photos / "chelsea.png", photos / "chelsea.jpg")  # another format in place
    _jpeg_smaller(photos / "coffee.png", more / "mug-0001.jpg")  # renamed and moved by a photo tool
    patched = np.asarray(Image.open(photos / "astronaut.png")).copy()
    patched[40:52, 60:72] = 255  # a few pixels changed in one place: another picture
    Image.fromarray(patched).save(photos / "astronaut-edited.png")
    for name in ("chelsea", "coffee", "astronaut"):
        (photos / f"{name}.png").unlink()
    prep = _prepared(config)
    pool = PoolData.load(prep)
    labels_after = labels_now(art, pool, round_index=1)
    by_path = dict(zip(pool.ids.to_pylist(), load_prepared(prep)["image_path"], strict=True))
    carried = {by_path[s].replace(str(tmp_path) + "/", ""): label for s, label in labels_after.items()}
    assert carried == {"photos/chelsea.jpg": "cat", "more/mug-0001.jpg": "cup"}
    entries = [e for e in Ledger(ledger_path(art)).entries() if e["kind"] == "carry"]
    assert all(e["reason"].startswith("same picture re-encoded") for e in entries) and len(entries) == 2
    assert labels_now(art, pool, round_index=1) == labels_after  # a re-run carries nothing twice
    res = runner.invoke(app, ["labels", "orphans", "--json", "--config", str(config)])
    assert [o["sample_id"] for o in json.loads(res.output)] == [s for s, lab in old.items() if lab == "person"]


def test_a_re_encoded_photo_with_a_look_alike_in_the_pool_stays_an_orphan(project, tmp_path, prefect_harness):
    """Unique and mutual: two images of the pool look like the orphan (the re-encoded photo and a copy of it), so
    neither gets its label."""
    config, photos, more = project
    art = load_config(config).artifacts
    _prepared(config)
    (tmp_path / "l.csv").write_text("image,label\nchelsea.png,cat\n")
    assert runner.invoke(app, ["labels", "import", str(tmp_path / "l.csv"), "--config", str(config)]).exit_code == 0
    _jpeg_smaller(photos / "chelsea.png", photos / "chelsea.jpg")
    _jpeg_smaller(photos / "chelsea.png", more / "chelsea-copy.jpg", quality=80)
    (photos / "chelsea.png").unlink()
    prep = _prepared(config)
    assert labels_now(art, PoolData.load(prep), round_index=1) == {}
