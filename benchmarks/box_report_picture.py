"""docs/box_round_*.png: a REAL box round's report, run as a user runs it (tests/test_box_round.py's path).

1. generated scenes (pipeline/boxes/scenes.py: shapes on canvases 2:1 wide to 1:2 tall, not the digits): a flat
   folder of 60 for the pool and a COCO test file of 8;
2. the tiny random-weight idefics3 stand-in (pipeline/model/tiny.py: a few MB, 32-px images, trained for seconds on
   the CPU) — it learns the answer's JSON form, not where the shapes are, so its boxes are poor;
3. `tamis init POOL --test test.json --model TINY`, `tamis round` (round 0: the batch goes out), a COCO JSON of the
   batch's true boxes under the original file names into the inbox, `tamis round` (round 1 trains, evaluates,
   scores, selects and writes its report);
4. round 1's own artifacts are copied out: its contact sheet (`batch.png`: the next batch with the model's boxes in
   orange; these images have no label yet) and a headless-Chromium screenshot of its `report.html` (top of the page
   and the error gallery: test images with labeled boxes in green and the model's in orange).

    nice python benchmarks/box_report_picture.py [--out docs] [--work /tmp/box-report-picture]

Nothing is drawn here: every picture is the round's own. Takes ~5-10 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.boxes.scenes import SHAPES, make_scene, make_scenes, scene_labels, write_scenes  # noqa: E402
from pipeline.boxes.writers import write_coco  # noqa: E402
from pipeline.model.tiny import make_tiny_model  # noqa: E402

TAMIS = Path(sys.executable).parent / "tamis"
POOL = make_scenes(60, seed=1)  # init's batch: a tenth of the pool


def _tamis(project: Path, *args: str) -> str:
    proc = subprocess.run([str(TAMIS), *args], cwd=project, env={**os.environ, "COLUMNS": "2000"},
                          capture_output=True, text=True, timeout=3000)
    if proc.returncode:
        raise SystemExit(f"tamis {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _label_batch(art: Path, round_index: int) -> None:
    """The annotator's answer: the batch's true boxes as a COCO JSON naming the original files (names.json)."""
    names = json.loads((art / "rounds" / f"{round_index:03d}" / "export" / "names.json").read_text())
    labels = scene_labels(POOL, names)
    (art / "inbox").mkdir(exist_ok=True)
    write_coco(art / "inbox" / f"labels-{round_index:03d}.json", labels)


def _screenshot(page: Path, out: Path, *, width: int, height: int, only: str | None = None) -> None:
    """Chromium's headless screenshot of `page`; `only` (a section id): a copy of the page with every other section
    hidden by one CSS rule (headless Chromium screenshots the top of a page, whatever its URL's fragment)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("chromium is not installed (Debian: `apt-get install chromium`)")
    if only:
        html = page.read_text(encoding="utf-8").replace(
            "</style>", f"section:not(#{only}),nav,body>p,h1{{display:none}}</style>", 1)
        page = out.parent / f".{out.stem}.html"
        page.write_text(html, encoding="utf-8")
    url = page.resolve().as_uri()
    cmd = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
           f"--window-size={width},{height}", "--virtual-time-budget=3000",
           f"--user-data-dir={out.parent / '.chromium-profile'}", f"--screenshot={out}", url]
    subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, check=False)
    shutil.rmtree(out.parent / ".chromium-profile", ignore_errors=True)
    if only:
        page.unlink()
    if not out.is_file():
        raise SystemExit(f"chromium wrote no screenshot of {url}")


def run_round(work: Path) -> Path:
    """Round 0 and round 1 of a box project made by `tamis init`; returns round 1's folder."""
    if work.exists():
        shutil.rmtree(work)
    write_scenes(work / "data" / "pool", POOL)
    test = [make_scene(f"test_{i:03d}.png", 10_000 + i) for i in range(8)]
    boxes = write_scenes(work / "data" / "test", test)
    boxes.labels = SHAPES
    write_coco(work / "data" / "test" / "test.json", boxes)
    model = make_tiny_model("idefics3", work / "tiny-idefics3")
    project = work / "project"
    project.mkdir()
    print(_tamis(project, "init", str(work / "data" / "pool"), "--test", str(work / "data" / "test" / "test.json"),
                 "--model", str(model)))
    print(_tamis(project, "round")[-1500:])
    _label_batch(project / "artifacts", 0)
    print(_tamis(project, "round")[-3000:])
    return project / "artifacts" / "rounds" / "001"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/box-report-picture"))
    args = ap.parse_args()
    rd = run_round(args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(rd / "batch.png", args.out / "box_round_batch.png")
    _screenshot(rd / "report.html", args.out / "box_round_report.png", width=1300, height=1500)
    _screenshot(rd / "report.html", args.out / "box_round_errors.png", width=1300, height=760, only="errors")
    metrics = json.loads((rd / "round.json").read_text())["metrics"]
    print(f"round 1 metrics: {metrics}\nwrote {args.out}/box_round_batch.png, box_round_report.png, "
          f"box_round_errors.png (from {rd})")


if __name__ == "__main__":
    main()
