"""`tamis` commands for the model area; `register` adds them to the app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def make_tiny_model_cmd(
    family: Annotated[str, typer.Option("--family", "-f", help="idefics3, qwen2_vl or qwen2_5_vl.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the checkpoint to (replaced if present).")],
    image_size: Annotated[int, typer.Option("--image-size", help="Image side the model is built for (multiple of 16).")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random-weight model of a real VLM architecture (a few MB) that loads like a hub checkpoint."""
    from pipeline.model.tiny import make_tiny_model

    path = make_tiny_model(family, out.resolve(), image_size=image_size, seed=seed)
    typer.echo(str(path))


def check_quant_cmd(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Hub ID or local folder (default: the config's model).")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Project config YAML.")] = None,
    n: Annotated[int, typer.Option("--n", help="Number of synthetic images in the batch.", min=1)] = 8,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Also write the report here.")] = None,
) -> None:
    """Load the model in 4-bit and in 16-bit (fp32 on CPU), run one batch, report top-1 agreement and mean KL."""
    from pipeline.config import load_config
    from pipeline.model.quant_check import check_quant, synthetic_images
    from pipeline.store import atomic_write_json

    cfg = load_config(config)
    model_cfg = cfg.model
    if model is not None:
        local = Path(model).exists()
        model_cfg = model_cfg.model_copy(update={
            "name_or_path": str(Path(model).resolve()) if local else model, "family": None,
            "build_tiny_if_missing": False,
        })
    size = cfg.preprocess.size or 64
    rows = [(im, cfg.data.question) for im in synthetic_images(n, size, seed=cfg.seed)]
    report = check_quant(model_cfg, rows)
    if json_out is not None:
        atomic_write_json(json_out, report)
    typer.echo(json.dumps(report, indent=2))


def register(app: typer.Typer) -> None:
    app.command("make-tiny-model")(make_tiny_model_cmd)
    app.command("check-quant")(check_quant_cmd)
