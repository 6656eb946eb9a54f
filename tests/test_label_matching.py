"""Bring your own labels (issue 15): rows keyed by the user's own IDs, image paths or Label Studio image URLs, and
the import edge cases (CSV conflicts, empty exports, dry runs, Label Studio task IDs in messages)."""

import json

import pytest

from pipeline.annotation.labels import LabelKeys, import_labels
from pipeline.annotation.ledger import Ledger
from pipeline.annotation.matching import SampleIndex, image_key
from pipeline.errors import LabelImportError

DIGITS = [str(i) for i in range(10)]
ROOT = "/data/project"
SAMPLES = [  # sample_id, the user's id, image path
    ("a" * 20, "zoo-001", f"{ROOT}/imgs/cats/tabby.jpg"),
    ("b" * 20, "zoo-002", f"{ROOT}/imgs/dogs/rex.png"),
    ("c" * 20, None, f"{ROOT}/imgs/cats/same.jpg"),
    ("d" * 20, None, f"{ROOT}/imgs/dogs/same.jpg"),
    ("e" * 20, "zoo-005", f"{ROOT}/other/zoo-cmyk.jpg"),
]
A, B, C, D, E = (s[0] for s in SAMPLES)


@pytest.fixture(params=["lists", "dataset"])
def env(tmp_path, request):
    # Built from plain lists, or as a round builds it: from a saved dataset's Arrow columns, indexed lazily.
    columns = ([s[0] for s in SAMPLES], [s[1] for s in SAMPLES], [s[2] for s in SAMPLES])
    if request.param == "lists":
        index = SampleIndex(*columns)
    else:
        import datasets

        index = SampleIndex.from_dataset(datasets.Dataset.from_dict(dict(zip(
            ("sample_id", "external_id", "image_path"), columns, strict=True))))
    led = Ledger(tmp_path / "art" / "labels.jsonl")

    def run(name, content, **kw):
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content, indent=1), encoding="utf-8")
        return import_labels(path, known_ids=index, answers=DIGITS, ledger=led, round_index=1,
                             rejections_dir=tmp_path / "art" / "rejections", **kw)

    return led, run


def _task(image, label, tid=1, aid=10, **data):
    return {"id": tid, "data": {"image": image, **data},
            "annotations": [{"id": aid, "completed_by": 1,
                             "result": [{"from_name": "choice", "to_name": "img", "type": "choices",
                                         "value": {"choices": [label]}}]}]}


def test_csv_two_different_answers_for_one_sample_is_a_conflict(env):
    led, run = env
    rep = run("c.csv", f"sample_id,label\n{A},1\n{A},2\n{B},3\n{B},3\n")
    assert [(c.sample_id, c.outcome) for c in rep.conflicts] == [(A, "tie")]
    assert led.labels() == {B: "3"}
    reasons = {r.line: r.reason for r in rep.rejected}
    assert set(reasons) == {2, 3, 5} and "conflicting answers for" in reasons[2] and "duplicate row" in reasons[5]
    assert "1 annotator conflicts" in rep.summary()


def test_empty_label_studio_export_is_zero_labels(env):
    led, run = env
    for name, text in [("empty.json", "[]\n"), ("header.csv", "sample_id,label\n"), ("none.jsonl", "\n")]:
        rep = run(name, text)
        assert rep.rows_read == 0 and rep.accepted == [] and not rep.rejected, name
        assert "nothing to do" in rep.summary()
    assert not led.path.exists()


def test_csv_keyed_by_image_paths_and_user_ids(env):
    led, run = env
    rep = run("mine.csv", "image,label\nimgs/cats/tabby.jpg,1\n./imgs/dogs/rex.png,2\nsame.jpg,3\nmissing.jpg,4\n"
                          "cats/same.jpg,5\n")
    assert led.labels() == {A: "1", B: "2", C: "5"}
    by = {e["sample_id"]: (e["matched_by"], e["matched_key"]) for e in led.entries()}
    assert by[A] == ("image_path", "imgs/cats/tabby.jpg")
    assert by[C] == ("image_path", "cats/same.jpg")
    reasons = {r.line: r.reason for r in rep.rejected}
    assert set(reasons) == {4, 5}
    assert "'same.jpg' matches 2 samples" in reasons[4] and C in reasons[4] and D in reasons[4]
    assert f"{ROOT}/imgs/cats/same.jpg" in reasons[4] and f"{ROOT}/imgs/dogs/same.jpg" in reasons[4]
    assert "tried image 'missing.jpg'" in reasons[5] and "this project's 5 samples" in reasons[5]
    assert rep.rejected[1].where.endswith("mine.csv:5")

    rep = run("ids.jsonl", json.dumps({"id": "zoo-005", "label": "7"}) + "\n"
                           + json.dumps({"sample_id": "zoo-002", "label": "8"}) + "\n")
    assert led.labels()[E] == "7" and led.labels()[B] == "8"
    assert {e["sample_id"]: e["matched_by"] for e in led.entries()[-2:]} == {E: "id", B: "id"}
    assert rep.matched_by == {"id": 2} and "rows matched: 2 by id" in rep.summary()


def test_label_studio_export_of_a_foreign_project_keyed_by_image_urls(env):
    led, run = env
    tasks = [
        _task("/data/local-files/?d=project/imgs/cats/tabby.jpg", "1", tid=101, aid=1),
        _task("/data/upload/3/5e1c2d3a-rex.png", "2", tid=102, aid=2),
        _task("https://bucket.example.com/x/zoo-cmyk.jpg?sig=abc", "3", tid=103, aid=3),
        _task("https://bucket.example.com/x/same.jpg", "4", tid=104, aid=4),
        _task("/data/upload/3/aaaaaaaa-nowhere.png", "5", tid=105, aid=5),
    ]
    rep = run("ls.json", tasks)
    assert led.labels() == {A: "1", B: "2", E: "3"}
    assert [e["matched_by"] for e in led.entries()] == ["image_path", "image_name", "image_name"]
    reasons = {r.where.split(" (", 1)[1]: r.reason for r in rep.rejected}
    assert set(reasons) == {"task 104, annotation 4)", "task 105, annotation 5)"}
    assert "matches 2 samples" in reasons["task 104, annotation 4)"]
    assert "nowhere.png" in reasons["task 105, annotation 5)"]

    rep = run("min.json", [{"id": 7, "image": "/data/local-files/?d=imgs%2Fdogs%2Fsame.jpg", "choice": "6",
                            "answer": "6"}])
    assert rep.format == "label_studio_min" and led.labels()[D] == "6"


def test_foreign_file_with_nothing_matching_is_refused_with_the_keys_tried(env):
    led, run = env
    with pytest.raises(LabelImportError, match=r"none of its 2 label rows matches one of this project's 5 samples "
                                               r"\(e.g. .*mine.csv:2: image 'x/1.png'\)"):
        run("mine.csv", "image,label\nx/1.png,1\nx/2.png,2\n")
    assert not led.path.exists()


def test_dry_run_writes_nothing(env, tmp_path):
    led, run = env
    rep = run("d.csv", "image,label\nimgs/cats/tabby.jpg,1\nnope.jpg,2\n", dry_run=True)
    assert rep.dry_run and len(rep.accepted) == 1 and len(rep.rejected) == 1
    assert "would be appended (dry run)" in rep.summary()
    assert not led.path.exists() and not (tmp_path / "art" / "rejections").exists()


def test_image_key_forms():
    assert image_key("/data/local-files/?d=a%2Fb/c.png") == (("a", "b", "c.png"), "path")
    assert image_key("/data/upload/12/0a1b2c3d-cat.png") == (("cat.png",), "name")
    assert image_key("http://h/x/y/cat.png?x=1") == (("cat.png",), "name")
    assert image_key("file:///abs/a.png") == (("abs", "a.png"), "path")
    assert image_key("..\\imgs\\a.png") == (("imgs", "a.png"), "path")


def test_label_keys_from_config():
    from pipeline.config import parse_config

    cfg = parse_config({"data": {"sources": [{"kind": "csv", "path": "m.csv", "id_column": "uid",
                                              "image_column": "file"}]}})
    keys = LabelKeys.from_config(cfg.data)
    assert keys.id_columns == ("id", "uid") and "file" in keys.image_columns


def test_cli_dry_run_project_scope_round_and_brackets(tmp_path, monkeypatch):
    """`tamis labels import --dry-run` on the project's prepared dataset: keys the user brought, the answer set in
    brackets survives the terminal, and the default round is the one an inbox import records."""
    import datasets
    from typer.testing import CliRunner

    from flows.cli.main import app
    from pipeline.round.plan import import_round
    from pipeline.store import atomic_write_json

    monkeypatch.setenv("COLUMNS", "250")
    art = tmp_path / "art"
    prep = art / "prepare" / "k1"
    datasets.Dataset.from_dict({"sample_id": [s[0] for s in SAMPLES], "external_id": [s[1] for s in SAMPLES],
                                "image_path": [s[2] for s in SAMPLES]}).save_to_disk(str(prep / "dataset"))
    atomic_write_json(art / "prepare" / "latest.json", {"prepare": {"dir": str(prep)}})
    atomic_write_json(art / "rounds" / "000" / "round.json", {"round": 0, "labeled": 0})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"paths: {{artifacts: {art}}}\ndata: {{answers: {DIGITS}}}\n")
    f = tmp_path / "mine.csv"
    f.write_text("id,label\nzoo-001,1\nzoo-002,cat\nzoo-404,2\n")
    runner = CliRunner()
    res = runner.invoke(app, ["labels", "import", str(f), "-c", str(cfg), "--dry-run"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "1 labels would be appended (dry run)" in out
    # The user's file name first, the sample ID second.
    assert f"would label tabby.jpg = '1' (sample {A}, by id 'zoo-001')" in out
    assert "is not in the answer set [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]; use one of these" in out
    assert "tried id 'zoo-404'; not among this project's 5 samples" in out
    assert not (art / "labels.jsonl").exists() and not (art / "rejections").exists()

    assert runner.invoke(app, ["labels", "import", str(f), "-c", str(cfg)]).exit_code == 0
    [entry] = Ledger(art / "labels.jsonl").entries()
    assert entry["round"] == import_round(art) == 1 and entry["matched_by"] == "id"


def test_cli_without_a_prepared_dataset_says_so(tmp_path):
    from typer.testing import CliRunner

    from flows.cli.main import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"paths: {{artifacts: {tmp_path / 'art'}}}\ndata: {{answers: {DIGITS}}}\n")
    f = tmp_path / "mine.csv"
    f.write_text("image,label\nimgs/a.png,1\n")
    res = CliRunner().invoke(app, ["labels", "import", str(f), "-c", str(cfg)])
    assert res.exit_code != 0
    msg = " ".join((res.output + str(res.exception)).split())
    assert "the 0 samples exported for labeling (no ingested dataset" in msg and "--dataset" in msg


def test_labels_for_an_ingested_manifest_by_relative_path_id_and_url(tmp_path):
    """End to end: ingest a manifest with the team's own IDs, then land their labels keyed three ways."""
    import io

    from PIL import Image

    from pipeline.annotation.labels import project_index
    from pipeline.config import parse_config
    from pipeline.data.ingest import ingest

    src = tmp_path / "team"
    (src / "imgs" / "a").mkdir(parents=True)
    (src / "imgs" / "b").mkdir(parents=True)
    rows = []
    for i, rel in enumerate(["imgs/a/x.png", "imgs/b/x.png", "imgs/a/y.png", "imgs/b/z.png"]):
        buf = io.BytesIO()
        Image.new("L", (4, 4), 40 * i).save(buf, format="PNG")
        (src / rel).write_bytes(buf.getvalue())
        rows.append({"image": rel, "id": f"T{i}"})
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config({"data": {"sources": [{"kind": "jsonl", "path": str(src / "m.jsonl")}], "answers": DIGITS},
                        "paths": {"artifacts": str(tmp_path / "art")}})
    ingest(cfg.data, cfg.artifacts, tmp_path / "art" / "ingest")
    index = project_index(cfg.artifacts, tmp_path / "art" / "ingest" / "dataset")
    led = Ledger(tmp_path / "art" / "labels.jsonl")
    kw = dict(known_ids=index, answers=DIGITS, ledger=led, round_index=0, rejections_dir=tmp_path / "rej",
              keys=LabelKeys.from_config(cfg.data))
    csv = tmp_path / "l.csv"
    csv.write_text("image,label\nimgs/a/x.png,1\nimgs/b/x.png,2\nx.png,3\n")
    rep = import_labels(csv, **kw)
    assert len(rep.accepted) == 2 and "'x.png' matches 2 samples" in rep.rejected[0].reason
    ls = tmp_path / "ls.json"
    ls.write_text(json.dumps([_task("/data/local-files/?d=team/imgs/a/y.png", "4", tid=1),
                              _task("http://files/x/z.png", "5", tid=2), _task("/data/upload/1/0badc0de-q.png", "6",
                                                                               tid=3, id="T1")]))
    rep = import_labels(ls, **kw)
    assert len(rep.accepted) == 3 and rep.corrections == 1 and not rep.rejected  # T1 is imgs/b/x.png, labeled 2
    assert rep.matched_by == {"image_path": 1, "image_name": 1, "id": 1}
    labels = led.labels()
    by_path = dict(zip(index.paths.values(), index.paths.keys(), strict=True))
    assert labels[by_path[str(src / "imgs/a/y.png")]] == "4" and labels[by_path[str(src / "imgs/b/z.png")]] == "5"
    assert {e["matched_by"] for e in led.entries()} >= {"image_path", "image_name"}


def test_labels_keyed_by_the_users_ids_import_right_after_ingest_and_say_so_once(tmp_path, prefect_harness):
    """A team brings labels before any round: `tamis ingest`, then `tamis labels import` of a file keyed by their
    own IDs. The import must read the ingested dataset (no prepare, no round), and its summary appears once; no
    third-party progress bar reaches piped output."""
    import io
    import os
    import subprocess
    import sys

    from PIL import Image
    from prefect.settings import PREFECT_API_URL

    src = tmp_path / "team"
    (src / "imgs").mkdir(parents=True)
    rows = []
    for i in range(6):
        buf = io.BytesIO()
        Image.new("L", (8, 8), 40 * i).save(buf, format="PNG")
        (src / "imgs" / f"{i}.png").write_bytes(buf.getvalue())
        rows.append({"image": f"imgs/{i}.png", "id": f"team-{i}"})
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"paths": {"artifacts": str(tmp_path / "art")}, "data": {
        "answers": DIGITS, "sources": [{"kind": "jsonl", "path": str(src / "m.jsonl")}]}}))
    labels = tmp_path / "labels.csv"
    labels.write_text("id,label\nteam-0,1\nteam-3,4\nteam-9,2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), COLUMNS="200")
    tamis = [sys.executable, "-c", "import sys; from flows.cli import run; sys.argv = ['tamis', *sys.argv[1:]]; run()"]

    def run(*args):
        done = subprocess.run([*tamis, *args, "-c", str(cfg)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        return done.returncode, done.stdout + done.stderr

    rc, out = run("ingest")
    assert rc == 0, out
    rc, out = run("labels", "import", str(labels))
    assert rc == 0, out
    assert out.count("label rows → 2 labels appended") == 1, out
    assert "rejected" in out and "team-9" in out
    assert "\r" not in out, "a progress bar reached piped output"
    from pipeline.annotation.ledger import Ledger, ledger_path

    assert set(Ledger(ledger_path(tmp_path / "art")).labels().values()) == {"1", "4"}
