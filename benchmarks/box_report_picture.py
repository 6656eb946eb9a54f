"""docs/box_contact_sheet.png: the round report's contact sheet of a box project, drawn by the report's own code
(pipeline/roundreport/box_pictures.py: overlay, then pictures.contact_sheet) on generated scenes of mixed aspect
ratio prepared as a round prepares them (letterboxed into a 384 px square).

The green boxes are the scenes' labels; the orange ones are a *simulated* answer (each labeled box jittered by up to
8 % of its size, one box dropped on every third scene, written as the json_1000 codec's text and read back through
the geometry), not a trained model's: the picture shows how the report draws boxes, not what a model learns.

    python benchmarks/box_report_picture.py [docs/box_contact_sheet.png]
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

from pipeline.boxes.answer import box_label
from pipeline.boxes.box import Box
from pipeline.boxes.codecs import get_codec
from pipeline.boxes.rows import row_geometry
from pipeline.boxes.scenes import make_scene, render
from pipeline.config import PreprocessConfig
from pipeline.preprocess import ImagePreparer, encode_png
from pipeline.roundreport.box_pictures import overlay
from pipeline.roundreport.gather import BatchItem
from pipeline.roundreport.pictures import contact_sheet

CANVASES = [(640, 320), (300, 600), (512, 512), (720, 405), (400, 600), (600, 400), (480, 480), (360, 640)]


def main(out: Path) -> None:
    rng = random.Random(0)
    codec = get_codec("json_1000")
    prepare = ImagePreparer(PreprocessConfig(pad="square"), size=384, max_pixels=10**8)
    pngs, geos, labels, answers, items = {}, {}, {}, {}, []
    for i, canvas in enumerate(CANVASES):
        scene = make_scene(f"scene_{i:02d}.png", 300 + i, canvases=[canvas])
        buf = io.BytesIO()
        render(scene).save(buf, format="PNG")
        image, content = prepare(buf.getvalue())
        sid = scene.name
        pngs[sid] = encode_png(image)
        geos[sid] = {"width": scene.width, "height": scene.height, "prep_box": list(content),
                     "prep_width": image.shape[1], "prep_height": image.shape[0]}
        labels[sid] = box_label(scene.boxes)
        kept = scene.boxes[1:] if i % 3 == 0 and len(scene.boxes) > 1 else scene.boxes
        moved = [Box(b.label, b.x + rng.uniform(-.08, .08) * b.w, b.y + rng.uniform(-.08, .08) * b.h, b.w, b.h)
                 for b in kept]
        answers[sid] = codec.encode(moved, row_geometry(geos[sid]))
        items.append(BatchItem(sid, i, "uncertainty: token entropy", 0.9 - i / 20, answer=f"{len(moved)} boxes",
                               confidence=0.8, name=sid))
    sheet = contact_sheet(items, overlay(pngs, geos, labels, answers, codec.name))
    out.write_bytes(sheet)
    print(f"{out}: {len(items)} scenes")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/box_contact_sheet.png"))
