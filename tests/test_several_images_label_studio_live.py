"""A two-image sample with a structured answer through a real Label Studio 1.23.2 (issue 51: "each exported task
shows both images"; the per-field controls of data.answer_schema).

Before / after pairs of scikit-image pictures (not the digits) in TRL's format are ingested and exported by tamis's
own export (`export_selection`, with the model's answer as a pre-annotation), the export's label_config.xml and
tasks imported into a pinned Label Studio; a headless Chromium opens the labeling page, the editor's own store
(window.Htx) is asked which object tags and controls it built, the page which pictures it decoded (both, each at its
natural size, on screen) and which text it shows (the question and the choices), and the page is screenshot (TAMIS_SCREENSHOT_DIR=docs writes docs/label_studio_two_images.jpg). An annotation posted
through the API with one value per control comes back through Label Studio's JSON export as the answer's JSON.

The server, its cached virtual environment and database are test_label_studio_live.py's; the page driver is
test_box_label_studio_live.py's.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from test_box_label_studio_live import Page
from test_label_studio_live import start_server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"change": {"enum": ["flipped", "darker", "same"]},
                                           "note": {"type": "string"}}}
CHANGES = ("flipped", "darker", "same")


def _pairs(root: Path, n: int) -> Path:
    from skimage import data

    pics = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    (root / "pics").mkdir(parents=True)
    rows = []
    for i in range(n):
        base = np.asarray(Image.fromarray(pics[i % len(pics)]).resize((320, 240)))
        after = base[:, ::-1] if CHANGES[i % 3] == "flipped" else base // 3 if CHANGES[i % 3] == "darker" else base
        names = [f"pics/before{i}.png", f"pics/after{i}.png"]
        Image.fromarray(base).save(root / names[0])
        Image.fromarray(np.ascontiguousarray(after)).save(root / names[1])
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {
            "type": "text", "text": "What changed from the first picture to the second?"}]}], "images": names})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "pairs.jsonl"


@pytest.fixture(scope="module")
def pair_project(tmp_path_factory):
    """tamis's export of 3 two-image samples under a document root, imported into a fresh Label Studio project."""
    from pipeline.annotation.export import export_selection
    from pipeline.config import load_config
    from pipeline.data.ingest import ingest, load_ingested

    root = tmp_path_factory.mktemp("ls-pairs")
    source = _pairs(root, 3)
    (root / "answer.schema.json").write_text(json.dumps(SCHEMA))
    docroot = root / "docroot"
    (root / "tamis.yaml").write_text(yaml.safe_dump({
        "paths": {"artifacts": str(root / "artifacts")},
        "data": {"sources": [{"kind": "trl", "path": str(source)}], "answer_schema": str(root / "answer.schema.json")},
        "annotate": {"export_images": "original", "document_root": str(docroot)}}))
    cfg = load_config(root / "tamis.yaml")
    ingest(cfg.data, cfg.artifacts, root / "ingested")
    ds = load_ingested(root / "ingested")
    sel = [{"sample_id": sid, "rank": k, "score": 0.5, "strategy": "token_entropy", "adapter_digest": "ab" * 32,
            "prediction": json.dumps({"change": CHANGES[k % 3], "note": "the model's guess"}), "confidence": 0.4,
            "scores": {}} for k, sid in enumerate(ds["sample_id"])]
    export = docroot / "export"
    export_selection(sel, ds, cfg.annotate, None, cfg.artifacts, export, round_index=0, schema=cfg.data.schema)
    server = start_server(tmp_path_factory.mktemp("ls-server"), docroot)
    project = server.api("POST", "/api/projects", {"title": "tamis two images",
                                                    "label_config": (export / "label_config.xml").read_text()})
    server.api("POST", "/api/storages/localfiles", {"project": project["id"], "path": str(export / "images"),
                                                    "title": "export images", "use_blob_urls": False})
    server.api("POST", f"/api/projects/{project['id']}/import",
               json.loads((export / "label_studio_tasks.json").read_text()))
    yield server, project["id"], cfg
    server.stop()


def test_the_labeling_page_shows_both_images_of_a_task_and_one_control_per_field(pair_project, tmp_path):
    server, pid, _cfg = pair_project
    tasks = server.api("GET", f"/api/tasks?project={pid}")
    tasks = tasks["tasks"] if isinstance(tasks, dict) else tasks
    task = tasks[0]
    assert task["data"]["original_image"].startswith("before") and task["data"]["original_image_2"].startswith(
        "after")
    page = Page(tmp_path / "profile", 1400, 1000)
    try:
        page.log_in(server.url)
        page.call("Page.navigate", url=f"{server.url}/projects/{pid}/data?task={task['id']}")
        # the editor loads each <Image>'s picture as a blob: both decoded (their natural size known) and on screen
        loaded = ("(() => { const ims = Array.from(document.querySelectorAll('img')).filter(i => "
                  "i.src.startsWith('blob:') && i.naturalWidth > 0); if (ims.length < 2) return null;"
                  " return JSON.stringify(ims.map(i => { const r = i.getBoundingClientRect();"
                  " return [i.naturalWidth, i.naturalHeight, r.width > 100 && r.bottom <= innerHeight]; })); })()")
        page.wait(loaded, timeout=120)
        time.sleep(3)  # let both pictures paint
        sizes = json.loads(page.js(loaded))
        controls = json.loads(page.js("JSON.stringify(Array.from(Htx.annotationStore.names.keys()))"))
        shown = page.js("document.body.innerText")
        shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    finally:
        page.close()
    assert sizes == [[320, 240, True], [320, 240, True]], sizes
    assert controls == ["image", "image_2", "question", "change", "note"], controls
    assert all(w in shown for w in ("What changed from the first picture", "flipped", "darker", "note")), shown
    out = tmp_path / "label_studio_two_images.png"
    out.write_bytes(shot)
    with Image.open(out) as im:
        assert im.size == (1400, 1000)
        if os.environ.get("TAMIS_SCREENSHOT_DIR"):  # docs/label_studio_two_images.jpg
            im.convert("RGB").save(Path(os.environ["TAMIS_SCREENSHOT_DIR"]) / "label_studio_two_images.jpg",
                                   quality=82)


def test_an_annotation_of_each_field_comes_back_as_the_json_answer(pair_project, tmp_path):
    from pipeline.annotation.label_files import LabelKeys, read_label_file

    server, pid, cfg = pair_project
    tasks = server.api("GET", f"/api/tasks?project={pid}")
    tasks = tasks["tasks"] if isinstance(tasks, dict) else tasks
    result = [{"from_name": "change", "to_name": "image", "type": "choices", "value": {"choices": ["darker"]}},
              {"from_name": "note", "to_name": "image", "type": "textarea", "value": {"text": ["much darker"]}}]
    server.api("POST", f"/api/tasks/{tasks[0]['id']}/annotations", {"result": result})
    export = server.api("GET", f"/api/projects/{pid}/export?exportType=JSON")
    path = tmp_path / "export.json"
    path.write_bytes(export if isinstance(export, bytes) else json.dumps(export).encode())
    rows = read_label_file(path, LabelKeys.from_config(cfg.data)).rows
    assert [(r.sample_id, r.label, r.problem) for r in rows] == [
        (tasks[0]["data"]["sample_id"], '{"change":"darker","note":"much darker"}', None)]
