import io
import json
import shutil

import yaml
from PIL import Image

from pipeline.data.ingest import load_ingested
from pipeline.store import executions


def png(color: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (4, 4), color).save(buf, format="PNG")
    return buf.getvalue()


def ingest_runs(artifacts) -> int:
    return sum(e["stage"] == "ingest" for e in executions(artifacts))


def test_ingest_flow_is_cached_on_source_content(tmp_path, prefect_harness):
    from flows.ingest import ingest_flow

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.png").write_bytes(png(i))
    (src / "m.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "answer": "a"}) + "\n" for i in range(3)))
    art = tmp_path / "artifacts"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"artifacts": str(art)},
                                      "data": {"sources": [{"kind": "jsonl", "path": str(src / "m.jsonl")}]}}))

    ref = ingest_flow(str(config))
    assert ingest_runs(art) == 1
    assert ref["counts"] == {"read": 3, "ingested": 3, "quarantined": 0, "duplicates": 0}
    assert len(load_ingested(ref["dir"])) == 3

    assert ingest_flow(str(config)) == ref  # unchanged sources: cached, the body did not run
    assert ingest_runs(art) == 1

    (src / "1.png").write_bytes(png(200))  # one source image changes content
    changed = ingest_flow(str(config))
    assert ingest_runs(art) == 2 and changed["dir"] != ref["dir"] and changed["digest"] != ref["digest"]

    shutil.rmtree(changed["dir"])  # outputs deleted behind the cache's back: rebuilt, not trusted
    assert ingest_flow(str(config))["digest"] == changed["digest"]
    assert ingest_runs(art) == 3 and len(load_ingested(changed["dir"])) == 3
