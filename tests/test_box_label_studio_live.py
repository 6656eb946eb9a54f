"""A box batch through a real Label Studio 1.23.2 and back (issue 50 item 10).

Generated scenes on canvases of mixed aspect ratio go out as `export_box_batch` writes them (the RectangleLabels
config, tasks with scored box predictions, images served by a Local Files storage); Label Studio shows the
predictions; annotations posted through its API correct them as an annotator would (a box moved, a class changed,
a box deleted, a box added, the rest accepted); the project's JSON and COCO exports are read back by the library
into box labels matched to the original files, within 1 px of what was annotated. A headless Chromium screenshot of
the labeling page shows the predicted boxes drawn over the image (TAMIS_SCREENSHOT_DIR=docs writes docs/label_studio_boxes.jpg).

The server, its cached virtual environment and database are test_label_studio_live.py's.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from test_label_studio_live import PASSWORD, USER, start_server

from pipeline.boxes.answer import parse_box_label
from pipeline.boxes.batch import BatchImage, export_box_batch, labels_by_sample, read_names
from pipeline.boxes.box import Box
from pipeline.boxes.readers import read_coco, read_label_studio
from pipeline.boxes.scenes import SHAPES, make_scenes, write_scenes

pytestmark = pytest.mark.slow

SCENES = (0, 1, 3, 5, 6, 7)  # 640×480, 300×600 (×2), 512×512, 720×405, 640×480: wide, tall and square


def _predicted(boxes: list[Box], k: int) -> tuple[Box, ...]:
    """The model's boxes: the truth a few pixels off, scored (the least sure last)."""
    return tuple(Box(b.label, b.x + 3 + k, b.y - 2, b.w - 4, b.h + 3, round(0.95 - 0.1 * j - 0.02 * k, 3))
                 for j, b in enumerate(boxes))


@pytest.fixture(scope="module")
def box_project(tmp_path_factory):
    """A running server with one project: the box labeling config, the batch's tasks imported with predictions."""
    root = tmp_path_factory.mktemp("ls-boxes")
    docroot = root / "docroot"
    scenes = [s for i, s in enumerate(make_scenes(8, seed=3)) if i in SCENES]
    truth = write_scenes(root / "pool", scenes)
    batch = docroot / "batch"
    images = [BatchImage(f"s{i}", s.name, root / "pool" / s.name, s.width, s.height,
                         _predicted(truth.images[s.name], i), confidence=0.5 + 0.05 * i, question="Find the shapes.")
              for i, s in enumerate(scenes)]
    export_box_batch(batch, images, SHAPES, image_url=lambda name: f"/data/local-files/?d=batch/images/{name}",
                     model_version="tamis-r0")
    server = start_server(tmp_path_factory.mktemp("ls-server"), docroot)
    project = server.api("POST", "/api/projects", {"title": "tamis boxes live test",
                                                    "label_config": (batch / "label_config.xml").read_text()})
    server.api("POST", "/api/storages/localfiles", {"project": project["id"], "path": str(batch / "images"),
                                                    "title": "batch images", "use_blob_urls": False})
    server.api("POST", f"/api/projects/{project['id']}/import",
               json.loads((batch / "label_studio_tasks.json").read_text()))
    yield server, project["id"], batch, images, root
    server.stop()


def _tasks(server, pid: int) -> list[dict]:
    tasks = server.api("GET", f"/api/tasks?project={pid}&page_size=100&fields=all")
    return sorted(tasks["tasks"] if isinstance(tasks, dict) else tasks, key=lambda t: t["id"])


def _pixels(region: dict) -> Box:
    """What an annotated region means in the image's pixels (Label Studio's rule: percent of the original size)."""
    v, ow, oh = region["value"], region["original_width"], region["original_height"]
    return Box(v["rectanglelabels"][0], v["x"] * ow / 100, v["y"] * oh / 100, v["width"] * ow / 100,
               v["height"] * oh / 100)


def _correct(k: int, result: list[dict]) -> list[dict]:
    """Annotator k's edit of the prediction's regions: 0 moves a box, 1 changes a class, 2 deletes a box, 3 adds
    one; the others accept the prediction as it is."""
    regions = [{key: r[key] for key in ("id", "type", "from_name", "to_name", "original_width", "original_height",
                                        "image_rotation", "value")} for r in result]
    if k == 0:
        regions[0]["value"] = {**regions[0]["value"], "x": regions[0]["value"]["x"] + 6.25,
                               "y": regions[0]["value"]["y"] - 3.5}
    elif k == 1:
        regions[1]["value"] = {**regions[1]["value"], "rectanglelabels": ["square"]
                               if regions[1]["value"]["rectanglelabels"] != ["square"] else ["disc"]}
    elif k == 2:
        del regions[-1]
    elif k == 3:
        regions.append({**regions[0], "id": "added", "value": {"x": 80.0, "y": 81.5, "width": 12.5, "height": 9.75,
                                                               "rotation": 0, "rectanglelabels": ["disc"]}})
    return regions


def _close(got: list[Box], want: list[Box], what: str) -> None:
    key = lambda b: (b.label, round(b.x), round(b.y))  # noqa: E731
    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [b.label for b in got] == [b.label for b in want], what
    for g, w in zip(got, want, strict=True):
        err = max(abs(g.x - w.x), abs(g.y - w.y), abs(g.x2 - w.x2), abs(g.y2 - w.y2))
        assert err <= 1.0, f"{what}: {g} is {err:.2f} px from the annotated {w}"


def test_a_box_batch_goes_through_label_studio_and_its_corrections_come_back(box_project):
    server, pid, batch, images, root = box_project
    by_name = {im.name: im for im in images}
    assert {im.width > im.height for im in images} == {True, False}  # wide and tall canvases in one batch
    tasks = _tasks(server, pid)
    assert len(tasks) == len(images)
    image = server.api("GET", tasks[0]["data"]["image"])  # served from the batch folder
    assert isinstance(image, bytes) and image[:8] == b"\x89PNG\r\n\x1a\n"

    # Label Studio holds the model's boxes as predictions: scored, versioned, in pixels where they were.
    annotated: dict[str, list[Box]] = {}
    for k, t in enumerate(tasks):
        im = by_name[t["data"]["original_image"]]
        [pred] = t["predictions"]
        assert pred["model_version"] == "tamis-r0" and pred["score"] == pytest.approx(im.confidence)
        _close([_pixels(r) for r in pred["result"]], list(im.predicted), f"prediction of {im.name}")
        assert [r["score"] for r in pred["result"]] == pytest.approx([b.score for b in im.predicted])
        regions = _correct(k, pred["result"])
        server.api("POST", f"/api/tasks/{t['id']}/annotations/", {"result": regions, "was_cancelled": False,
                                                                  "lead_time": 12.5})
        annotated[im.sample_id] = [_pixels(r) for r in regions]
    changed = [sid for sid, boxes in annotated.items()
               if [(b.label, round(b.x), round(b.y)) for b in boxes] !=
               [(b.label, round(b.x), round(b.y)) for b in next(i for i in images if i.sample_id == sid).predicted]]
    assert len(changed) == 4  # moved, re-classed, deleted, added

    # The JSON export, read back by the library, matched to the samples by the original file names.
    export = root / "export.json"
    export.write_bytes(server.api("GET", f"/api/projects/{pid}/export?exportType=JSON&download_all_tasks=true"))
    names = read_names(batch)
    labels, problems = labels_by_sample(read_label_studio(export, image_key="image"), names, SHAPES)
    assert problems == [] and set(labels) == set(annotated)
    for sid, text in labels.items():
        _close(parse_box_label(text), annotated[sid], f"JSON export, sample {sid}")

    # Label Studio's COCO export (a zip: result.json, file names as Label Studio writes them) reads back the same.
    raw = server.api("GET", f"/api/projects/{pid}/export?exportType=COCO&download_all_tasks=true")
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        z.extract("result.json", root / "coco")
    coco = read_coco(root / "coco" / "result.json")
    labels, problems = labels_by_sample(coco, names, SHAPES)
    assert problems == [] and set(labels) == set(annotated), (problems, sorted(coco.images))
    for sid, text in labels.items():
        _close(parse_box_label(text), annotated[sid], f"COCO export, sample {sid}")


# ------------------------------------------------------------------------------------------------- the picture
def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (Debian: `apt-get install chromium`): the labeling page is unseen")
    return exe


class Page:
    """One headless Chromium tab driven over the DevTools protocol (websockets' sync client)."""

    def __init__(self, profile: Path, width: int, height: int):
        from websockets.sync.client import connect

        self.proc = subprocess.Popen(
            [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            [tab] = [t for t in json.loads(r.read()) if t["type"] == "page"]
        self.ws, self.n = connect(tab["webSocketDebuggerUrl"], max_size=2 ** 26), 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self.n:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    def js(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")

    def wait(self, expr: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not self.js(expr):
            assert time.monotonic() < deadline, f"the page never satisfied {expr}"
            time.sleep(0.5)

    def log_in(self, url: str) -> None:
        """Log in to the Label Studio at `url` as the test user."""
        self.call("Page.navigate", url=f"{url}/user/login")
        self.wait("!!document.querySelector('input[name=email]')")
        self.js(f"document.querySelector('input[name=email]').value = {json.dumps(USER)};"
                f"document.querySelector('input[name=password]').value = {json.dumps(PASSWORD)};"
                "document.querySelector('form').submit()")
        self.wait("!location.pathname.startsWith('/user/login')")

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(30)


def test_the_labeling_page_draws_the_predicted_boxes(box_project, tmp_path):
    server, pid, _batch, images, _root = box_project
    [task] = [t for t in _tasks(server, pid) if t["data"]["original_image"] == images[4].name]  # 720×405, 3 boxes
    page = Page(tmp_path / "profile", 1500, 900)
    try:
        page.log_in(server.url)
        page.call("Page.navigate", url=f"{server.url}/projects/{pid}/data?task={task['id']}")
        page.wait("!!(window.Htx && Htx.annotationStore.selected && Htx.annotationStore.selected.regions.length) "
                  "&& document.querySelectorAll('canvas').length > 0")
        time.sleep(3)  # let the image and the boxes paint
        # the editor's own store (window.Htx): the regions it drew, in percent of the image
        drawn = page.js("JSON.stringify(Htx.annotationStore.selected.regions.map("
                        "r => [r.labels.join(), r.x, r.y, r.width, r.height]))")
        shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    finally:
        page.close()
    out = tmp_path / "label_studio_boxes.png"
    out.write_bytes(shot)
    from PIL import Image

    with Image.open(out) as im:
        assert im.size == (1500, 900)
        if os.environ.get("TAMIS_SCREENSHOT_DIR"):  # docs/label_studio_boxes.jpg
            im.convert("RGB").save(Path(os.environ["TAMIS_SCREENSHOT_DIR"]) / "label_studio_boxes.jpg", quality=82)
    im4 = images[4]
    _close([Box(lab, x * im4.width / 100, y * im4.height / 100, w * im4.width / 100, h * im4.height / 100)
            for lab, x, y, w, h in json.loads(drawn)], list(im4.predicted), "boxes the labeling page drew")
