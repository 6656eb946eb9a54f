"""`tamis predict` and `tamis export-model`: use what the rounds made (docs/use-your-model.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli_common import ConfigOpt, load, out_console
from pipeline.errors import ConfigError

RoundOpt = Annotated[int | None, typer.Option("--round", min=0, help="Use this round's adapter (default: the latest "
                                              "round that trained one).")]


def predict_cmd(
    path: Annotated[Path, typer.Argument(help="A folder of images, a JSONL / CSV manifest (`image`, optionally "
                                         "`question`) or a dataset saved with save_to_disk.")],
    config: ConfigOpt = None,
    out: Annotated[Path, typer.Option("--out", help="The CSV to write; the JSONL (with every answer's probability) "
                                      "goes beside it.")] = Path("predictions.csv"),
    round_index: RoundOpt = None,
    adapter: Annotated[Path | None, typer.Option("--adapter", help="An adapter folder to use instead of a round's.")] = None,
    question: Annotated[str | None, typer.Option("--question", help="Ask this of every image (default: the "
                                                 "project's question, or each manifest row's).")] = None,
) -> None:
    """Answer new images with a round's adapter: one CSV row per image (answer, probability, adapter used)."""
    from rich.console import Console

    from pipeline.model.loading import load_model
    from pipeline.predict import find_adapter, predict_path, write_predictions

    if round_index is not None and adapter is not None:
        raise typer.BadParameter("give --round or --adapter, not both")
    cfg = load(config)
    choice = find_adapter(cfg.artifacts, round_index=round_index, adapter=adapter)
    loaded = load_model(cfg.model, adapter=choice.dir)
    preds = predict_path(path, loaded, choice=choice, data=cfg.data, preprocess=cfg.preprocess, model=cfg.model,
                         select=cfg.select, question=question)
    csv_path, jsonl = write_predictions(preds, out)
    err = Console(stderr=True)
    bad = [p for p in preds if p.error]
    for p in bad:
        err.print(f"skipped {p.file}: {p.error}", highlight=False, markup=False)
    out_console().print(f"{len(preds) - len(bad)} images answered, {len(bad)} skipped (reason in the `error` column) "
                        f"with {choice.why} ({choice.dir}): {csv_path} and {jsonl}", highlight=False)


def export_model_cmd(
    out: Annotated[Path | None, typer.Option("--out", help="A new or empty folder to write (adapter/, README.md, "
                                             "lineage.json, predict.py, merged/).")] = None,
    config: ConfigOpt = None,
    merge: Annotated[bool, typer.Option("--merge", help="Also write merged/: the base (4-bit weights dequantized) "
                                        "with the adapter merged in, for plain transformers.")] = False,
    round_index: RoundOpt = None,
    dtype: Annotated[str, typer.Option("--dtype", help="The merged weights' dtype: auto (what tamis computes in "
                                       "here: bfloat16 on a bf16 GPU, float32 on a CPU), bfloat16, float16, "
                                       "float32.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Write into a folder that is not empty, replacing what an "
                                        "export writes there (other files are kept). Never allowed inside the "
                                        "project's artifacts folder.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="hf (default), or vllm: also serve.sh (`vllm serve` with the "
                                     "adapter), and adapter-vllm/ without LoRA vLLM does not take, its cost "
                                     "measured on the test split.")] = "hf",
    check: Annotated[bool, typer.Option("--check", help="Only say which runtimes (transformers, vLLM, llama.cpp / "
                                        "LM Studio / Ollama) can take this project's model, and why not; writes "
                                        "nothing.")] = False,
) -> None:
    """Export a round's model with its model card, lineage (the labels and config behind it) and a standalone
    predict.py to a new or empty folder; --check says which runtimes can serve it."""
    cfg = load(config)
    if check:
        from pipeline.serving.runtimes import check_model

        family, verdicts = check_model(cfg.model)
        out_console().print("\n".join([f"{family.name} model ({cfg.model.name_as_written}, mode {cfg.model.mode}, "
                                        f"train {cfg.model.train}):", *(f"  {v.line()}" for v in verdicts)]),
                            highlight=False, markup=False)
        return
    if out is None:
        raise ConfigError("--out is required: a new or empty folder to export to (or pass --check to only see "
                          "which runtimes can take the model)")
    from pipeline.export_model import export_model

    res = export_model(out, artifacts=cfg.artifacts, round_index=round_index, merge=merge, dtype=dtype,
                       force=force, fmt=fmt, sections={"data": cfg.data, "preprocess": cfg.preprocess,
                                                       "model": cfg.model, "train": cfg.train,
                                                       "annotate": cfg.annotate, "select": cfg.select,
                                                       "seed": cfg.seed})
    lines = [f"exported round {res.round}'s model ({res.labels} training labels) to {res.dir}",
             f"  adapter: {res.adapter}", f"  model card: {res.card}", f"  lineage: {res.lineage}",
             f"  predict.py: {res.dir / 'predict.py'} (transformers, peft, torch, Pillow; no tamis)"]
    if res.merged:
        lines.append(f"  merged ({res.merged_dtype}): {res.merged}")
    if res.vllm:
        lines.append(f"  vLLM: {res.vllm.serve}" + (f" (serves {res.vllm.adapter.name}/ on the base)"
                                                    if res.vllm.adapter else " (serves merged/)"))
        if res.vllm.warning():
            lines.append(f"warning: {res.vllm.warning()}")
    out_console().print("\n".join(lines), highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_cmd)
    app.command("export-model")(export_model_cmd)
