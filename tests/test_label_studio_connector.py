"""The live Label Studio connection against a strict replay of the real SDK talking to the real server
(tests/data/label_studio_exchange.json, see tests/label_studio_exchange.py): push is idempotent, an interrupted
push resumes with the rest, pull goes through the importer and keeps lead_time, a re-pull imports nothing, the token
never reaches artifacts, and SDK drift fails here. The real server: tests/test_label_studio_live.py."""

import copy
import json
from pathlib import Path

import pytest
from label_studio_exchange import (
    EXCHANGE,
    ExchangeMismatch,
    RecordedLS,
    by_id,
    inline,
    interrupted_push,
    make_project,
    round_trip,
)

from pipeline.annotation.export import export_dir
from pipeline.annotation.label_studio import LabelStudioProject, pull_labels, push_batch
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import parse_config
from pipeline.errors import ConfigError

TOKEN = "s3cret-token-value-123"


def no_annotator(pid, task_set, labels):
    """On replay the recorded responses already hold the annotations the recording posted."""


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("TAMIS_TEST_LS_TOKEN", TOKEN)


def assert_round_trip(out, token=TOKEN):
    """What the round-trip scenario must leave, replayed here and run against the real server in the live test
    (whose API token is `token`)."""
    cfg = out["cfg"]
    pid = out["push"]["project"]
    assert out["push"] == {"project": pid, "pushed": 4, "already": 0}
    assert out["push_again"] == {"project": pid, "pushed": 0, "already": 4}
    assert out["pull_before"] == []  # nothing annotated yet
    [rec] = out["pull"]
    assert rec["accepted"] == 3 and rec["rejected"] == 0
    assert out["repull"] == []  # a re-pull adds nothing
    [rec] = out["pull_later"]
    assert rec["accepted"] == 1
    # The label corrected in tamis (s000: 3 → 8) was not reverted by the later pull of another task.
    assert out["labels_after_later"] == {"s000": "8", "s001": "4", "s002": "5", "s003": "6"}
    assert out["push_relabel"] == {"project": pid, "pushed": 4, "already": 0}
    assert out["push_relabel_again"] == {"project": pid, "pushed": 0, "already": 4}
    [rec] = out["pull_relabel"]
    assert rec["accepted"] == 1
    ledger = Ledger(ledger_path(cfg.artifacts))
    assert ledger.labels() == {"s000": "6", "s001": "4", "s002": "5", "s003": "6"}
    assert [e["kind"] for e in ledger.history("s000")] == ["label", "correction", "correction"]
    # Label Studio's lead_time came through every pull into the annotation-time log; the untimed s002 has none.
    assert sorted((t["sample_id"], t["seconds"]) for t in ledger.times()) == [
        ("s000", 7.0), ("s000", 14.0), ("s001", 9.5), ("s003", 3.25)]
    for p in cfg.artifacts.rglob("*"):
        if p.is_file():
            assert token.encode() not in p.read_bytes(), p


def recorded_project_id(scenario):
    create = next(c for c in json.loads(EXCHANGE.read_text())["scenarios"][scenario]
                  if c["method"] == "projects.create")
    return create["response"]["id"]


def test_token_only_from_the_environment(tmp_path, monkeypatch):
    cfg, _ = make_project(tmp_path, "digits")
    monkeypatch.delenv("TAMIS_TEST_LS_TOKEN")
    with pytest.raises(ConfigError, match="TAMIS_TEST_LS_TOKEN is not set"):
        LabelStudioProject(cfg.annotate, cfg.artifacts, client=RecordedLS("round_trip", tmp_path))
    with pytest.raises(ConfigError, match="a token in plain text is refused") as exc:
        parse_config({"annotate": {"label_studio": {"token": TOKEN}}})  # no place for a secret in the config
    assert TOKEN not in str(exc.value)


def test_push_pull_round_trip_is_idempotent_keeps_lead_time_and_no_secret(tmp_path):
    fake = RecordedLS("round_trip", tmp_path)
    out = round_trip(tmp_path, fake, no_annotator)
    assert_round_trip(out)
    assert fake.unused() == []  # every recorded call was made, in order, with the recorded arguments
    [storage] = fake.sent("import_storage.local.create")
    assert storage["path"] == str((tmp_path / "art" / "rounds").resolve())  # a strict sub-folder of the root
    first = fake.sent("projects.import_tasks")[0]["request"][0]
    assert first["predictions"][0]["result"][0]["value"] == {"choices": ["1"]}
    assert first["data"]["tamis_set"] == "000/export"


def test_a_push_interrupted_after_its_first_chunk_sends_only_the_rest(tmp_path):
    fake = RecordedLS("interrupted_push", tmp_path)
    out = interrupted_push(tmp_path, fake, no_annotator)
    assert "connection reset" in out["failed"]["error"] and "tasks 3-4 of 4" in out["failed"]["error"]
    pid = out["resumed"]["project"]
    assert out["resumed"] == {"project": pid, "pushed": 2, "already": 2}
    assert out["again"] == {"project": pid, "pushed": 0, "already": 4}
    sent = [[t["data"]["sample_id"] for t in c["request"]] for c in fake.sent("projects.import_tasks")]
    assert sent == [["s000", "s001"], ["s002", "s003"]]  # in export order, each task once
    assert fake.unused() == []


def test_a_project_given_by_id_is_read_not_listed(tmp_path):
    pid = recorded_project_id("round_trip")
    fake = RecordedLS("by_id", tmp_path)
    out = by_id(tmp_path, fake, no_annotator, pid)
    [rec] = out["pull"]
    assert fake.unused() == []
    # A fresh project folder pulls the whole project: s000's batch answer (3) is its label and its re-label task's
    # answer (6) corrects it (issue 36: they were one annotator's two conflicting votes, both rejected).
    assert (rec["accepted"], rec["rejected"]) == (5, 0)
    led = Ledger(ledger_path(out["cfg"].artifacts))
    assert led.labels() == {"s000": "6", "s001": "4", "s002": "5", "s003": "6"}
    assert [(e["kind"], e["label"]) for e in led.history("s000")] == [("label", "3"), ("correction", "6")]
    assert fake.sent("projects.get") == [{"id": pid}]


def test_inline_images_need_no_file_serving(tmp_path):
    fake = RecordedLS("inline", tmp_path)
    out = inline(tmp_path, fake, no_annotator)
    assert out["push"]["pushed"] == 2 and fake.unused() == []
    [req] = fake.sent("projects.import_tasks")
    assert all(t["data"]["image"].startswith("data:image/png;base64,iVBORw0KGgo") for t in req["request"])
    assert fake.sent("import_storage.local.create") == []  # nothing to serve


def test_unreachable_label_studio_is_recorded_not_fatal(tmp_path):
    cfg, known = make_project(tmp_path, "digits")
    down = RecordedLS("round_trip", tmp_path, fail=ConnectionError(f"refused (Authorization: Token {TOKEN})"))
    [rec] = pull_labels(cfg.annotate, cfg.data, cfg.artifacts, known_ids=known, round_index=1, client=down)
    assert "listing projects failed" in rec["error"] and TOKEN not in rec["error"] and "***" in rec["error"]
    res = push_batch(cfg.annotate, cfg.artifacts, export_dir(cfg.artifacts, 0), client=down)
    assert "error" in res and TOKEN not in res["error"]


# ------------------------------------------------------------------------------------- the fake catches drift
def test_the_replay_refuses_what_the_real_sdk_would_not_do(tmp_path):
    fake = RecordedLS("round_trip", tmp_path)
    with pytest.raises(AttributeError, match="no 'projects.delete'"):
        fake.projects.delete  # noqa: B018 - not a method the connector's recording has
    with pytest.raises(AttributeError, match="no 'annotations'"):
        fake.annotations  # noqa: B018
    with pytest.raises(TypeError, match="unexpected keyword argument.*field"):
        fake.tasks.list(project=1, field="all")  # the real TasksClient.list has `fields`
    with pytest.raises(TypeError, match="missing required argument.*project"):
        fake.import_storage.local.list()
    with pytest.raises(ExchangeMismatch, match="call 1"):
        fake.projects.create(title="other", label_config="<View/>")  # the recording listed projects first
    assert fake.projects.list() == []  # call 1 as recorded: the server had no project yet
    project = fake.projects.create(title="tamis recorded round trip", label_config=_label_config(tmp_path))
    assert project.id == recorded_project_id("round_trip")
    with pytest.raises(AttributeError, match="no field 'name'"):
        project.name  # noqa: B018 - the server's project has `title`, not `name`


def _label_config(tmp_path: Path) -> str:
    cfg, _ = make_project(tmp_path / "cfg", "digits")
    return (export_dir(cfg.artifacts, 0) / "label_config.xml").read_text(encoding="utf-8")


def test_a_renamed_sdk_argument_fails_the_connector_here(tmp_path):
    """SDK drift as a re-recording would show it: `import_tasks(request=…)` renamed `tasks=`."""
    exchange = json.loads(EXCHANGE.read_text())
    drifted = copy.deepcopy(exchange)
    for p in drifted["signatures"]["projects.import_tasks"]["params"]:
        if p["name"] == "request":
            p["name"] = "tasks"
    cfg, _ = make_project(tmp_path, "tamis recorded round trip")
    res = push_batch(cfg.annotate, cfg.artifacts, export_dir(cfg.artifacts, 0), client=RecordedLS("round_trip", tmp_path, exchange=drifted))
    assert "unexpected keyword argument(s) request" in res["error"]
