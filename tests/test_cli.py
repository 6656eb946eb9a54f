import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from flows.cli.main import app
from pipeline.errors import ConfigError, DataError

runner = CliRunner()
TAMIS = Path(sys.executable).parent / "tamis"


def write_config(tmp_path, sources) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "art")}, "data": {"sources": sources}}))
    return path


def test_demo_data_then_ingest(tmp_path, prefect_harness):
    out = tmp_path / "digits"
    res = runner.invoke(app, ["demo-data", "--out", str(out), "--limit", "20"])
    assert res.exit_code == 0, res.output
    assert "wrote 20 digit images" in res.output and (out / "ground_truth.jsonl").is_file()

    config = write_config(tmp_path, [{"kind": "jsonl", "path": str(out / "manifest.jsonl")}])
    res = runner.invoke(app, ["ingest", "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "ingested" in res.output and "quarantine.jsonl (0 rows)" in res.output
    assert any(line.split("│")[1:3] == [" read        ", "    20 "] for line in res.output.splitlines())
    assert "no flow started" not in res.output
    # Nothing changed: `tamis ingest` answers from the verified ingest folder without Prefect or a stage body.
    executions = (tmp_path / "art" / "executions.jsonl").read_text()
    res = runner.invoke(app, ["ingest", "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "nothing changed since the last ingest" in res.output and "quarantine.jsonl (0 rows)" in res.output
    assert (tmp_path / "art" / "executions.jsonl").read_text() == executions


def test_demo_data_rejects_a_bad_limit(tmp_path):
    res = runner.invoke(app, ["demo-data", "--out", str(tmp_path), "--limit", "0"])
    assert res.exit_code != 0 and "--limit" in res.output


def test_ingest_user_errors_name_the_fault(tmp_path):
    res = runner.invoke(app, ["ingest", "--config", str(tmp_path / "missing.yaml")])
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError)
    assert "missing.yaml: config file not found" in str(res.exception)

    bad = tmp_path / "m.csv"
    bad.write_bytes(b"image,question\na.png,caf\xe9\n")
    res = runner.invoke(app, ["ingest", "--config", str(write_config(tmp_path, [{"kind": "csv", "path": str(bad)}]))])
    assert res.exit_code != 0 and isinstance(res.exception, DataError)
    assert f"{bad}:2: not UTF-8" in str(res.exception)


def test_console_script_turns_user_errors_into_exit_2_without_traceback(tmp_path):
    proc = subprocess.run([str(TAMIS), "ingest", "--config", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config file not found" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def _tamis(cwd, *args):
    return subprocess.run([str(TAMIS), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "COLUMNS": "2000"})


def test_without_c_a_command_reads_tamis_yaml_and_never_the_demo(tmp_path):
    """Issue 47: `tamis round` without -c in a project folder ran the demo config inside the user's artifacts/ and
    failed on artifacts/demo/digits/manifest.jsonl. Now: no ./tamis.yaml, a clear error and nothing written."""
    empty = _tamis(tmp_path, "round")
    assert empty.returncode == 2, empty.stdout + empty.stderr
    msg = " ".join(empty.stderr.split())
    assert "no config: -c was not given and there is no ./tamis.yaml" in msg
    assert "pass -c tamis.yaml" in msg and "`tamis init PATH_TO_IMAGES`" in msg and "demo/digits" not in msg
    assert list(tmp_path.iterdir()) == []  # no artifacts/ of the demo's

    (tmp_path / "tamis.yaml").write_text(yaml.safe_dump({"paths": {"artifacts": "project-artifacts"},
                                                         "data": {"answers": ["sky", "sea"]}}))
    shown = _tamis(tmp_path, "config", "show")
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.strip() == "using ./tamis.yaml"
    assert yaml.safe_load(shown.stdout)["paths"]["artifacts"] == str(tmp_path / "project-artifacts")

    demo = _tamis(tmp_path, "config", "show", "-c", "demo")  # the built-in demo, asked for by name
    assert demo.returncode == 0, demo.stderr
    assert yaml.safe_load(demo.stdout)["data"]["answers"] == [str(d) for d in range(10)] and "using" not in demo.stderr
