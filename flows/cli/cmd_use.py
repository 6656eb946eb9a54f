"""`tamis predict`, `tamis export-model` and `tamis export-data`: use what the rounds made (docs/use-your-model.md,
docs/formats.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, config_file, load, out_console
from pipeline.errors import ConfigError

RoundOpt = Annotated[int | None, typer.Option("--round", min=0, help="Use this round's adapter (default: the latest "
                                              "round that trained one).")]


def predict_cmd(
    path: Annotated[Path, typer.Argument(help="A folder of images, a JSONL / CSV manifest (`image`, optionally "
                                         "`question`), a dataset saved with save_to_disk, or in a project of "
                                         "several images a file in its trl / sharegpt / swift format.")],
    config: ConfigOpt = None,
    out: Annotated[Path, typer.Option("--out", help="The CSV to write; the JSONL (with every answer's probability) "
                                      "goes beside it.")] = Path("predictions.csv"),
    round_index: RoundOpt = None,
    adapter: Annotated[Path | None, typer.Option("--adapter", help="An adapter folder to use instead of a round's.")] = None,
    question: Annotated[str | None, typer.Option("--question", help="Ask this of every image (default: the "
                                                 "project's question, or each manifest row's).")] = None,
) -> None:
    """Answer new images with a round's adapter: one CSV row per image (answer, probability, adapter used)."""
    config = config_file(config)
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
    files = write_predictions(preds, out, boxes=cfg.data.task == "boxes")
    err = Console(stderr=True)
    bad = [p for p in preds if p.error]
    for p in bad:
        err.print(f"skipped {p.file}: {p.error}", highlight=False, markup=False)
    boxes = "" if cfg.data.task != "boxes" else f" ({sum(len(p.boxes or ()) for p in preds)} boxes)"
    out_console().print(f"{len(preds) - len(bad)} images answered{boxes}, {len(bad)} skipped (reason in the `error` column "
                        f"and in {files.rejected}) with {choice.why} ({choice.dir}): {files.csv} and {files.jsonl}",
                        highlight=False)


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
                                     "measured on the test split; or gguf: merged/ as llama.cpp GGUF (text model "
                                     "f16/q8_0, Q4_K_M with a built llama-quantize, and the mmproj projector), an "
                                     "Ollama Modelfile and an LM Studio folder.")] = "hf",
    check: Annotated[bool, typer.Option("--check", help="Only say which runtimes (transformers, vLLM, llama.cpp / "
                                        "LM Studio / Ollama) can take this project's model, and why not; writes "
                                        "nothing.")] = False,
) -> None:
    """Export a round's model with its model card, lineage (the labels and config behind it) and a standalone
    predict.py to a new or empty folder; --check says which runtimes can serve it."""
    config = config_file(config)
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
    from pipeline.export_model import ExportSpec, export_model

    spec = ExportSpec(data=cfg.data, preprocess=cfg.preprocess, model=cfg.model, train=cfg.train,
                      annotate=cfg.annotate, select=cfg.select, seed=cfg.seed)
    res = export_model(out, artifacts=cfg.artifacts, spec=spec, round_index=round_index, merge=merge, dtype=dtype,
                       force=force, fmt=fmt)
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
    if res.gguf:
        lines += [f"  GGUF ({res.gguf.seconds:.0f} s): {', '.join(p.name for p in res.gguf.models.values())} and "
                  f"{res.gguf.mmproj.name} in {res.gguf.dir}", f"  Ollama: {res.gguf.modelfile}",
                  f"  LM Studio: {res.gguf.lmstudio}", *(f"note: {n}" for n in res.gguf.notes)]
    out_console().print("\n".join(lines), highlight=False, markup=False)


def export_data_cmd(
    out: Annotated[Path, typer.Option("--out", help="A new or empty folder to write (images/, the format's files, "
                                      "lineage.json).")],
    fmt: Annotated[str, typer.Option("--format", help="trl (TRL SFTTrainer JSONL), llamafactory (sharegpt JSON + "
                                     "dataset_info.json), swift (ms-swift JSONL) or hf (a DatasetDict saved with "
                                     "save_to_disk); docs/formats.md shows a record of each.")],
    config: ConfigOpt = None,
    include_test: Annotated[bool, typer.Option("--include-test", help="Also write the labeled test split (what the "
                                               "rounds evaluate on), in its own file / split.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Write into a folder that is not empty, replacing the files "
                                        "this format writes, images/ and lineage.json (other files are kept). Never "
                                        "allowed inside the project's artifacts folder.")] = False,
) -> None:
    """Export the labeled set (the labels the next round trains on, with the images under their own names) in a
    training framework's format, with its lineage."""
    config = config_file(config)
    from pipeline.dataexport import export_data

    cfg = load(config)
    res = export_data(out, artifacts=cfg.artifacts, data=cfg.data, annotate=cfg.annotate, fmt=fmt,
                      include_test=include_test, force=force)
    c = res.counts
    test = f", {c['test']} test" if "test" in c else ""
    lines = [f"exported {c['train']} labeled training samples{test} as {res.format} to {res.dir}",
             *(f"  {p}" for p in res.files),
             f"  images: {res.dir / 'images'} ({c['linked']} hard-linked, {c['copied']} copied, {c['written']} "
             "written from the ingested bytes)", f"  lineage: {res.lineage}"]
    out_console().print("\n".join(lines), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_cmd)
    app.command("export-model")(export_model_cmd)
    app.command("export-data")(export_data_cmd)
