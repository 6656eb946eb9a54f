"""A ledger whose last line a crash cut inside a multi-byte character (the é of José) is readable by every command
that reads it: `tamis labels history`, `tamis status` and a round, each reporting the torn line. Before commit
records every one of them failed with UnicodeDecodeError."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.annotation.ledger import Ledger, ledger_path, make_entry

TAMIS = Path(sys.executable).parent / "tamis"
ROOT = Path(__file__).resolve().parents[1]
TORN = b'{"sample_id": "s2", "label": "Jos' + "é".encode()[:1]  # a write killed after the first byte of é


def torn_ledger(art: Path) -> Ledger:
    ledger = Ledger(ledger_path(art))
    ledger.append([make_entry("s1", "José's café", annotator="ann", round_index=0, source_file="a.csv",
                              source_digest="a", now=1.0)])
    ledger.append([make_entry("s1", "a photo of a dog", annotator="bob", round_index=1, source_file="b.csv",
                              source_digest="b", supersedes=ledger.current()["s1"], now=2.0)])
    with open(ledger.path, "ab") as f:
        f.write(TORN)
    return ledger


def tamis(*args: str, config: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "COLUMNS": "200", "PATH": str(TAMIS.parent) + ":/usr/bin:/bin",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(TAMIS), *args, "--config", str(config)], capture_output=True, text=True, timeout=300,
                          env=env)


def write_config(tmp_path: Path) -> tuple[Path, Path]:
    art = tmp_path / "artifacts"
    config = tmp_path / "tamis.yaml"
    config.write_text(f"paths: {{artifacts: {art}}}\n")
    return config, art


def reported(output: str, ledger: Ledger) -> bool:
    return f"{ledger.path}:7: the last line is cut off" in " ".join(output.split())


def test_labels_history_reads_a_torn_utf8_ledger_and_reports_the_torn_line(tmp_path):
    config, art = write_config(tmp_path)
    ledger = torn_ledger(art)
    res = tamis("labels", "history", "s1", config=config)
    assert res.returncode == 0, res.stderr
    assert "José's café" in res.stdout and "a photo of a dog" in res.stdout and "current" in res.stdout
    assert reported(res.stdout + res.stderr, ledger), res.stdout + res.stderr
    assert (res.stdout + res.stderr).count("the last line is cut off") == 1  # reported once, however often read


def test_status_reads_a_torn_utf8_ledger_and_reports_the_torn_line(tmp_path):
    config, art = write_config(tmp_path)
    ledger = torn_ledger(art)
    res = tamis("status", config=config)
    assert res.returncode == 0, res.stderr
    assert "labeled samples: 1 in the ledger (2 entries, 1 corrections," in res.stdout
    assert reported(res.stdout + res.stderr, ledger), res.stdout + res.stderr
    as_json = json.loads(tamis("status", "--json", config=config).stdout)
    assert as_json["ledger_entries"] == 2 and as_json["ledger_problems"] == [
        f"{ledger.path}:7: the last line is cut off ({len(TORN)} bytes without a line end, e.g. a write killed "
        "midway); it is not counted and the next write sets it aside"]


@pytest.mark.slow  # two rounds of the tiny model: ~80 s here
def test_a_round_reads_a_torn_utf8_ledger_reports_the_torn_line_and_sets_it_aside(tmp_path, tiny_models,
                                                                                  prefect_harness):
    from test_round_flow import write_project

    from flows.round import labeling_round
    from pipeline.config import load_config

    config = write_project(tmp_path, tiny_models, limit=24, select={"batch_size": 4})
    ledger = torn_ledger(load_config(config).artifacts)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # Prefect's logging setup keeps records from pytest's root-logger capture
    logging.getLogger("pipeline.store").addHandler(handler)
    try:
        first = labeling_round(str(config))  # reads the ledger: the inbox import, the round's labels
    finally:
        logging.getLogger("pipeline.store").removeHandler(handler)
    assert first["round"] == 0 and first["selected"] == 4
    torn = [r.getMessage() for r in records if "the last line is cut off" in r.getMessage()]
    assert torn == [f"{ledger.path}:7: the last line is cut off ({len(TORN)} bytes without a line end, e.g. a "
                    "write killed midway); it is not counted and the next write sets it aside"]  # once per process
    second = labeling_round(str(config), simulate=False)  # imports the simulated answers: the write sets it aside
    assert second["round"] == 1 and [i["accepted"] for i in second["imports"]] == [4]
    (aside,) = ledger.path.parent.glob("labels.jsonl.cut-*")
    assert aside.read_bytes() == TORN and not ledger.problems()
    assert len(ledger.labels()) == 5 and ledger.labels()["s1"] == "a photo of a dog"
