"""The live Label Studio connection against a fake SDK client: push is idempotent, pull goes through the importer,
a re-pull imports nothing, and the token never reaches artifacts. The real server: tests/test_label_studio_live.py."""

import json

import pytest

from pipeline.annotation.export import export_dir, export_selection
from pipeline.annotation.label_studio import LabelStudioProject, pull_labels, push_batch
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import parse_config
from pipeline.errors import ConfigError

DIGITS = [str(i) for i in range(10)]
TOKEN = "s3cret-token-value-123"


class Obj(dict):
    __getattr__ = dict.get

    def model_dump(self, mode="json"):
        return json.loads(json.dumps(self))


class FakeLS:
    def __init__(self):
        self.projects_ = {}
        self.tasks_ = []
        self.storages = []
        ls = self

        class Projects:
            def list(self):
                return list(ls.projects_.values())

            def get(self, id):
                return ls.projects_[id]

            def create(self, title, label_config):
                p = Obj(id=len(ls.projects_) + 1, title=title, label_config=label_config)
                ls.projects_[p.id] = p
                return p

            def update(self, id, label_config):
                ls.projects_[id]["label_config"] = label_config

            def import_tasks(self, id, request):
                for t in request:
                    ls.tasks_.append(Obj(id=len(ls.tasks_) + 100, project=id, annotations=[], **t))

        class Tasks:
            def list(self, project, fields):
                assert fields == "all"
                return [t for t in ls.tasks_ if t.project == project]

        class Local:
            def list(self, project):
                return [s for s in ls.storages if s.project == project]

            def create(self, project, path, title, use_blob_urls):
                ls.storages.append(Obj(project=project, path=path, title=title))

        class Storage:
            local = Local()

        self.projects, self.tasks, self.import_storage = Projects(), Tasks(), Storage()

    def annotate(self, sample_id, label, ann_id, who=1, lead_time=None):
        task = next(t for t in self.tasks_ if t["data"]["sample_id"] == sample_id)
        task["annotations"].append({"id": ann_id, "completed_by": who, "was_cancelled": False, "lead_time": lead_time,
                                    "result": [
            {"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": [label]}}]})


@pytest.fixture
def project(tmp_path, make_vqa, monkeypatch):
    monkeypatch.setenv("TAMIS_TEST_LS_TOKEN", TOKEN)
    ds, _ = make_vqa(n=6)
    cfg = parse_config({"paths": {"artifacts": str(tmp_path / "art")}, "data": {"answers": DIGITS},
                        "annotate": {"label_studio": {"url": "http://127.0.0.1:9", "project": "digits",
                                                      "token_env": "TAMIS_TEST_LS_TOKEN"}}})
    sel = [{"sample_id": f"s00{i}", "rank": i, "score": 1.0, "scores": {}, "prediction": "1", "confidence": 0.5}
           for i in range(4)]
    export_selection(sel, ds, cfg, export_dir(cfg.artifacts, 0), round_index=0)
    return cfg, set(ds["sample_id"])


def test_token_only_from_the_environment(project, monkeypatch):
    cfg, _ = project
    monkeypatch.delenv("TAMIS_TEST_LS_TOKEN")
    with pytest.raises(ConfigError, match="TAMIS_TEST_LS_TOKEN is not set"):
        LabelStudioProject(cfg, client=FakeLS())
    with pytest.raises(ConfigError, match="token does not belong in the config file"):
        parse_config({"annotate": {"label_studio": {"token": TOKEN}}})  # no place for a secret in the config


def test_push_pull_round_trip_is_idempotent_and_keeps_no_secret(project):
    cfg, known = project
    fake = FakeLS()
    first = push_batch(cfg, export_dir(cfg.artifacts, 0), client=fake)
    assert first == {"project": 1, "pushed": 4, "already": 0}
    assert push_batch(cfg, export_dir(cfg.artifacts, 0), client=fake)["pushed"] == 0
    assert "<Choices" in fake.projects_[1]["label_config"] and fake.storages
    assert fake.tasks_[0]["predictions"][0]["result"][0]["value"] == {"choices": ["1"]}

    assert pull_labels(cfg, known_ids=known, round_index=1, client=fake) == []  # nothing annotated yet
    fake.annotate("s000", "3", 1, lead_time=14.0)
    fake.annotate("s001", "4", 2, lead_time=9.5)
    fake.annotate("s001", "4", 3, who=2)
    [rec] = pull_labels(cfg, known_ids=known, round_index=1, client=fake)
    ledger = Ledger(ledger_path(cfg.artifacts))
    assert rec["accepted"] == 2 and ledger.labels() == {"s000": "3", "s001": "4"}
    # Label Studio's lead_time survives the pull into the annotation-time log (the untimed vote records none).
    assert sorted((t["sample_id"], t["seconds"]) for t in ledger.times()) == [("s000", 14.0), ("s001", 9.5)]
    assert pull_labels(cfg, known_ids=known, round_index=1, client=fake) == []  # a re-pull adds nothing
    assert len(ledger.times()) == 2
    # A label corrected in tamis is not reverted by a later pull of other tasks.
    ledger.append([{**ledger.current()["s000"], "label": "8", "kind": "correction"}])
    fake.annotate("s002", "5", 4)
    [rec] = pull_labels(cfg, known_ids=known, round_index=2, client=fake)
    assert rec["accepted"] == 1 and ledger.labels() == {"s000": "8", "s001": "4", "s002": "5"}

    for p in cfg.artifacts.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


def test_unreachable_label_studio_is_recorded_not_fatal(project):
    cfg, known = project

    class Down(FakeLS):
        def __init__(self):
            super().__init__()

            class Projects:
                def list(self):
                    raise ConnectionError(f"refused (Authorization: Token {TOKEN})")

            self.projects = Projects()

    [rec] = pull_labels(cfg, known_ids=known, round_index=1, client=Down())
    assert "listing projects failed" in rec["error"] and TOKEN not in rec["error"] and "***" in rec["error"]
    res = push_batch(cfg, export_dir(cfg.artifacts, 0), client=Down())
    assert "error" in res and TOKEN not in res["error"]


def test_inline_images_need_no_file_serving(project):
    cfg, _ = project
    cfg = cfg.model_copy(update={"annotate": cfg.annotate.model_copy(update={
        "label_studio": cfg.annotate.label_studio.model_copy(update={"images": "inline"})})})
    fake = FakeLS()
    assert push_batch(cfg, export_dir(cfg.artifacts, 0), client=fake)["pushed"] == 4
    assert fake.tasks_[0]["data"]["image"].startswith("data:image/png;base64,iVBORw0KGgo")
    assert not fake.storages  # nothing to serve


def test_a_relabel_task_set_is_pushed_beside_the_batch_and_its_answers_are_corrections(project):
    import shutil

    cfg, known = project
    fake = FakeLS()
    push_batch(cfg, export_dir(cfg.artifacts, 0), client=fake)
    fake.annotate("s000", "3", 1)
    pull_labels(cfg, known_ids=known, round_index=1, client=fake)
    relabel = cfg.artifacts / "rounds" / "001" / "relabel"
    shutil.copytree(export_dir(cfg.artifacts, 0), relabel)
    assert push_batch(cfg, relabel, client=fake) == {"project": 1, "pushed": 4, "already": 0}
    assert push_batch(cfg, relabel, client=fake)["pushed"] == 0
    assert {t["data"]["tamis_set"] for t in fake.tasks_} == {"000/export", "001/relabel"}
    task = next(t for t in fake.tasks_ if t["data"]["tamis_set"] == "001/relabel" and t["data"]["sample_id"] == "s000")
    task["annotations"].append({"id": 9, "completed_by": 2, "was_cancelled": False, "result": [
        {"from_name": "answer", "to_name": "image", "type": "choices", "value": {"choices": ["6"]}}]})
    [rec] = pull_labels(cfg, known_ids=known, round_index=2, client=fake)
    ledger = Ledger(ledger_path(cfg.artifacts))
    assert rec["accepted"] == 1 and [e["kind"] for e in ledger.history("s000")] == ["label", "correction"]
