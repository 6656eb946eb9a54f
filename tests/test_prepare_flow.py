import io
import json
import shutil
from collections import Counter

import numpy as np
import yaml
from PIL import Image
from typer.testing import CliRunner

from pipeline.augment import load_augmented
from pipeline.preprocess import load_prepared
from pipeline.quality import load_quality
from pipeline.store import executions


def write_project(tmp_path, copies: int = 1):
    """A JSONL source: 4 labeled train rows, 3 pool rows (one an exact pixel duplicate in another format)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(7):
        im = Image.fromarray(rng.integers(0, 256, (12 + i, 20, 3), dtype=np.uint8))
        if i == 6:
            im = Image.open(src / "5.png").convert("RGB")
        buf = io.BytesIO()
        im.save(buf, "BMP" if i == 6 else "PNG")
        name = f"{i}.{'bmp' if i == 6 else 'png'}"
        (src / name).write_bytes(buf.getvalue())
        rows.append({"image": name, "answer": str(i) if i < 4 else None, "split": "train" if i < 4 else "pool"})
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"artifacts": str(tmp_path / "art")},
        "data": {"sources": [{"kind": "jsonl", "path": str(src / "m.jsonl")}]},
        "preprocess": {"size": 16, "pad": "square"},
        "augment": {"copies": copies, "image": {"brightness_contrast_p": 1.0}},
        "model": {"family": "idefics3"},
    }))
    return config


def runs(art) -> Counter:
    return Counter(e["stage"] for e in executions(art))


def test_stages_cached_and_only_augment_reruns_when_only_augment_changes(tmp_path, prefect_harness):
    from prefect import flow

    from flows.ingest import ingest_ref
    from flows.prepare import augment_ref, prepare_flow, prepare_refs
    from pipeline.config import load_config

    @flow(name="round-like")
    def round_like(config_path: str) -> dict:
        cfg = load_config(config_path)
        refs = prepare_refs(cfg, ingest_ref(cfg)).as_dict()
        return {**refs, "augment": augment_ref(cfg, refs["prepare"])}

    config = write_project(tmp_path)
    art = tmp_path / "art"
    first = round_like(str(config))
    assert runs(art) == {"ingest": 1, "preprocess": 1, "quality": 1, "augment": 1}
    prepared = load_prepared(first["prepare"]["dir"])
    assert len(prepared) == 7 and set(prepared["prep_width"][:]) == {16}
    table = {r["sample_id"]: r for r in load_quality(first["quality"]["dir"])}
    assert sum("exact_duplicate" in r["flags"] for r in table.values()) == 1
    assert len(load_augmented(first["augment"]["dir"])) == 4

    assert round_like(str(config)) == first  # nothing changed: no stage body ran
    assert prepare_flow(str(config))["quality"] == first["quality"]
    assert runs(art) == {"ingest": 1, "preprocess": 1, "quality": 1, "augment": 1}

    write_project(tmp_path, copies=2)  # only the augment section changes
    second = round_like(str(config))
    assert runs(art) == {"ingest": 1, "preprocess": 1, "quality": 1, "augment": 2}
    assert second["prepare"] == first["prepare"] and second["augment"]["dir"] != first["augment"]["dir"]
    assert len(load_augmented(second["augment"]["dir"])) == 8

    shutil.rmtree(first["quality"]["dir"])  # outputs deleted behind the cache's back: rebuilt, not trusted
    assert round_like(str(config))["quality"]["digest"] == first["quality"]["digest"]
    assert runs(art)["quality"] == 2


def test_cli_prepare_and_quality_report(tmp_path, prefect_harness):
    from flows.cli.main import app

    runner = CliRunner()
    config = write_project(tmp_path)
    res = runner.invoke(app, ["quality", "report", "--config", str(config)])
    assert res.exit_code != 0 and "run `tamis prepare" in str(res.exception)

    res = runner.invoke(app, ["prepare", "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "7 rows at 16 px, 0 quarantined" in res.output and "1 excluded from the pool" in res.output
    assert "no flow started" not in res.output
    # Nothing changed: the same table from the verified stage folders, no flow, no stage body.
    executions = (tmp_path / "art" / "executions.jsonl").read_text()
    res = runner.invoke(app, ["prepare", "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "7 rows at 16 px, 0 quarantined" in res.output and "nothing changed since the last prepare" in res.output
    assert (tmp_path / "art" / "executions.jsonl").read_text() == executions

    res = runner.invoke(app, ["quality", "report", "--config", str(config), "--top", "3"])
    assert res.exit_code == 0, res.output
    assert "worst exact_duplicate" in res.output and "6.bmp" in res.output and "same prepared pixels" in res.output
