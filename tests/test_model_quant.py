"""The 4-bit vs 16-bit agreement check, and the model commands of the CLI."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from flows.cli.main import app
from pipeline.config import ModelConfig
from pipeline.errors import DataError
from pipeline.model.quant_check import check_quant, synthetic_images

QUESTION = "Which digit is shown in the image?"


def test_check_quant_reports_agreement_and_kl(tiny_models):
    rows = [(im, QUESTION) for im in synthetic_images(3, 32)]
    report = check_quant(ModelConfig(name_or_path=str(tiny_models["idefics3"])), rows)
    assert report["family"] == "idefics3" and report["n_samples"] == 3
    assert report["positions"] >= 3 * 10
    for key in ("top1_agreement", "top1_agreement_last"):
        assert 0.0 <= report[key] <= 1.0
    assert 0.0 <= report["mean_kl"] <= report["max_kl"]
    assert report["mean_kl_last"] >= 0.0
    # NF4 keeps a random tiny model's next-token predictions mostly intact, and its weights take less memory.
    assert report["top1_agreement"] > 0.5 and report["mean_kl"] < 0.5
    assert report["reference_dtype"] == "float32" and report["footprint_ratio"] < 1.0


def test_check_quant_accepts_rows_and_rejects_empty(tiny_models):
    im = synthetic_images(1, 32)[0]
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    report = check_quant(ModelConfig(name_or_path=str(tiny_models["qwen2_vl"])),
                         [{"prepared": buf.getvalue(), "question": QUESTION}])
    assert report["n_samples"] == 1 and report["family"] == "qwen2_vl"
    with pytest.raises(DataError, match="at least one row"):
        check_quant(ModelConfig(name_or_path=str(tiny_models["qwen2_vl"])), [])


def test_cli_make_tiny_model_then_check_quant(tmp_path):
    runner = CliRunner()
    out = tmp_path / "tiny-q25"
    res = runner.invoke(app, ["make-tiny-model", "--family", "qwen2_5_vl", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_vl"

    report_file = tmp_path / "quant.json"
    res = runner.invoke(app, ["check-quant", "--model", str(out), "--n", "2", "--json-out", str(report_file)])
    assert res.exit_code == 0, res.output
    report = json.loads(report_file.read_text())
    assert report["family"] == "qwen2_5_vl" and report["n_samples"] == 2
    assert 0.0 <= report["top1_agreement"] <= 1.0
