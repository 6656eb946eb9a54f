"""`tamis` commands for the model area; `register` adds them to the app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ConfigOpt, config_file, out_console, project_config


def make_tiny_model_cmd(
    family: Annotated[str, typer.Option("--family", "-f", help="A registered family as model.family writes it: "
                                        "idefics3, smolvlm, qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3, llava_onevision, "
                                        "internvl.")],
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
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Project config YAML (default: ./tamis.yaml "
                                                "if there is one, else the defaults).")] = None,
    n: Annotated[int, typer.Option("--n", help="Number of synthetic images in the batch.", min=1)] = 8,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Also write the report here.")] = None,
) -> None:
    """Load the model in 4-bit and in 16-bit (fp32 on CPU), run one batch, report top-1 agreement and mean KL."""
    from pipeline.model.quant_check import check_quant, synthetic_images
    from pipeline.store import atomic_write_json

    cfg = project_config(config, required=model is None)
    model_cfg = cfg.model
    if model is not None:
        local = Path(model).exists()
        model_cfg = model_cfg.model_copy(update={
            "name_or_path": str(Path(model).resolve()) if local else model, "family": None,
            "build_tiny_if_missing": False,
        })
    from pipeline.model.resolve import resolve_configured

    out_console(stderr=True).print(resolve_configured(model_cfg).note, highlight=False, soft_wrap=True)
    size = cfg.preprocess.size or 64
    rows = [(im, cfg.data.question) for im in synthetic_images(n, size, seed=cfg.seed)]
    report = check_quant(model_cfg, rows)
    if json_out is not None:
        atomic_write_json(json_out, report)
    typer.echo(json.dumps(report, indent=2))


def check_model_cmd(
    path: Annotated[str | None, typer.Argument(help="A local checkpoint folder or a hub ID (from the HF cache, else "
                                               "the hub) (default: the config's model).")] = None,
    config: ConfigOpt = None,
    family: Annotated[str | None, typer.Option("--family", "-f", help="model.family to check with (auto: the "
                                               "generic fallback for unregistered architectures).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Also write the report here.")] = None,
) -> None:
    """Load a local checkpoint the way a round would and report what tamis will do with it: family, image tokens,
    prompt/answer boundaries, LoRA targets, 4-bit agreement, one scoring batch, one training step, planned memory.
    Exits 1 when a round would fail, naming the reason."""
    from rich.table import Table

    from pipeline.model.check import check_model
    from pipeline.model.resolve import local_folder, resolve_model
    from pipeline.store import atomic_write_json

    config = config_file(config, required=path is None)
    cfg = project_config(config, required=False)
    # A hub ID is checked from its HF cache snapshot (or downloaded first); offline and not cached: the fixes.
    target = path or cfg.model.name_or_path
    if Path(target).exists():  # a folder: the report's own checkpoint row says what is wrong with it
        folder = str(Path(target).resolve())
    else:
        resolved = resolve_model(target, family=family or cfg.model.family)
        out_console(stderr=True).print(resolved.note, highlight=False, soft_wrap=True)
        folder = str(Path(local_folder(resolved)).resolve())
    update: dict = {"build_tiny_if_missing": False, "name_or_path": folder}
    if path is not None or family is not None:
        update["family"] = family
    sections: dict = {"model": cfg.model.model_copy(update=update)}
    if path is not None and config is None:
        # The demo config's tiny-model settings (image size, LoRA on the vision tower) say nothing about this
        # checkpoint: check it with the defaults and its family's image size.
        from pipeline.config import ModelConfig

        sections["model"] = ModelConfig(name_or_path=folder, family=family)
        sections["preprocess"] = cfg.preprocess.model_copy(update={"size": None})
        sections["train"] = type(cfg.train)()
    checked = cfg.model_copy(update=sections)
    report = check_model(checked.model, preprocess=checked.preprocess, data=checked.data, train=checked.train)
    if json_out is not None:
        atomic_write_json(json_out, report.to_dict())
    t = Table(title=f"check-model: {report.model}")
    t.add_column("check")
    t.add_column("status")
    t.add_column("what tamis will do / found", overflow="fold")
    colour = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    for r in report.rows:
        t.add_row(r.check, f"[{colour[r.status]}]{r.status}[/]", r.found)
    out_console().print(t)
    if not report.ok:
        reason = report.failures[0]
        typer.echo(f"check-model: a round would fail at '{reason.check}': {reason.found}", err=True)
        raise typer.Exit(1)


def hardware_cmd(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Project config YAML (default: ./tamis.yaml "
                                                "if there is one, else the defaults).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show the detected GPU/CPU and the training settings (micro-batch, accumulation, checkpointing) chosen for it."""
    from dataclasses import asdict

    from rich.table import Table

    from pipeline.model.hardware import choose_train_settings, detect_hardware, resolve_num_processes

    cfg = project_config(config, required=False)
    hw = detect_hardware()
    nproc = resolve_num_processes(cfg.train.num_processes, hw)
    s = choose_train_settings(cfg.train, cfg.model, hw, image_size=cfg.preprocess.size, num_processes=nproc)
    if as_json:
        typer.echo(json.dumps({"hardware": hw.describe(), "model": cfg.model.name_or_path, "mode": cfg.model.mode,
                               "settings": asdict(s)}, indent=2))
        return
    console = out_console()
    d = hw.describe()
    t = Table(title="Detected hardware")
    t.add_column("device")
    t.add_column("memory (GiB)", justify="right")
    t.add_column("free (GiB)", justify="right")
    t.add_column("compute capability / cores")
    t.add_column("bf16")
    for g in d["gpus"]:
        t.add_row(g["name"], str(g["total_memory_gib"]), str(g["free_memory_gib"]), g["compute_capability"],
                  "yes" if g["bf16"] else "no")
    t.add_row("CPU (RAM)", str(d["ram_gib"]), str(d["ram_available_gib"]), f"{d['cpu_count']} cores", "-")
    console.print(t)
    c = Table(title=f"Training settings for {cfg.model.name_or_path} ({cfg.model.mode})")
    c.add_column("setting")
    c.add_column("value")
    for k in ("micro_batch", "grad_accum", "num_processes", "gradient_checkpointing", "precision", "quantize", "reason"):
        c.add_row(k, str(getattr(s, k)))
    console.print(c)


def print_knobs(config: Path | None, gpu_memory: str | None, seq_len: int) -> None:
    """`tamis plan --config`: one table of what each training knob saves and costs for this project config."""
    from pipeline.model.hardware import SAFETY, choose_train_settings, detect_hardware, parse_memory
    from pipeline.model.knobs import alternatives, knobs_table, plan_inputs
    from pipeline.model.planner import analyze

    cfg = project_config(config)
    hw = detect_hardware()
    settings = choose_train_settings(cfg.train, cfg.model, hw, seq_len=seq_len, image_size=cfg.preprocess.size)
    shape = analyze(cfg.model.name_or_path)
    base = plan_inputs(cfg.model, settings, seq_len=seq_len, image_size=cfg.preprocess.size, device=hw.device)
    budget = parse_memory(gpu_memory) if gpu_memory else hw.memory_budget_bytes
    console = out_console()
    console.print(knobs_table(alternatives(shape, base), int(SAFETY * budget)))
    console.print(f"settings: {settings.reason}")


def plan_cmd(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Hub ID, local model folder or config.json.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Project config: print what each training "
                                                "knob saves and costs for it instead.")] = None,
    mode: Annotated[str, typer.Option("--mode", help="qlora, lora or full: the mode itemized term by term.")] = "qlora",
    gpu_memory: Annotated[str | None, typer.Option("--gpu-memory", help="e.g. 16GiB, 24GB (default: this GPU's free memory).")] = None,
    batch: Annotated[int | None, typer.Option("--batch", min=1, help="Micro-batch to itemize (the table shows 1-16).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Text tokens per sample (image tokens are added).")] = 128,
    image_size: Annotated[int | None, typer.Option("--image-size", min=1, help="Longest image side in px (default: the model's).")] = None,
    lora_r: Annotated[int, typer.Option("--lora-r", min=1)] = 8,
    precision: Annotated[str, typer.Option("--precision", help="bf16, fp16 or fp32 compute.")] = "bf16",
    processes: Annotated[int, typer.Option("--processes", "-n", min=1, help="Data-parallel processes, one per GPU "
                                           "(train.num_processes): figures are per device.")] = 1,
) -> None:
    """Estimate peak training memory from the model's config alone (no weights loaded) and show what fits.

    With --processes N each GPU holds the whole model and its own micro-batch (plus the gradient all-reduce buffer);
    the effective batch is micro-batch × accumulation × N. Without --gpu-memory the least free of N GPUs is used."""
    from dataclasses import replace

    from pipeline.model.hardware import SAFETY, detect_hardware, parse_memory
    from pipeline.model.planner import PlanInputs, analyze, plan, plan_table, terms_table

    if config is not None or model is None:
        print_knobs(config, gpu_memory, seq_len)
        return
    if gpu_memory is not None:
        memory = parse_memory(gpu_memory)
    else:
        hw = detect_hardware()
        memory = hw.process_budget_bytes(processes) if hw.gpus else None
    shape = analyze(Path(model) if Path(model).exists() else model)
    inputs = PlanInputs(seq_len=seq_len, image_size=image_size, gpu_memory_bytes=memory, lora_r=lora_r,
                        precision=precision, device="cuda", margin=SAFETY, processes=processes)
    console = out_console()
    console.print(terms_table(*(plan(shape, replace(inputs, mode=mode, batch=batch or 1, checkpointing=c))
                                for c in (False, True))))
    batches = sorted({1, 2, 4, 8, 16, *([batch] if batch else [])})
    console.print(plan_table(shape, inputs, batches=batches))
    if processes > 1:
        console.print(f"Per device, each of {processes} GPUs: a micro-batch b there trains b × accumulation × "
                      f"{processes} samples per optimizer step.")
    if memory is None:
        console.print("No GPU detected and no --gpu-memory given: nothing to compare with.")


def train_cmd(
    dataset: Annotated[Path, typer.Option("--dataset", "-d", help="A labeled dataset folder with prepared, question "
                                          "and answer columns, e.g. artifacts/rounds/NNN/labeled/dataset.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Training folder (adapter/, checkpoints/, manifest.json); "
                                      "re-running with the same folder resumes.")],
    config: ConfigOpt = None,
    init_adapter: Annotated[Path | None, typer.Option("--init-adapter", help="Adapter to continue from "
                                                      "(with train.init: warm).")] = None,
) -> None:
    """Train an adapter outside a round: on train.num_processes devices, or as each rank of a launcher
    (`accelerate launch --multi_gpu --num_processes 4 $(which tamis) train …`, torchrun)."""
    config = config_file(config)
    import datasets

    from pipeline.config import load_config
    from pipeline.errors import DataError
    from pipeline.model.distributed import launched_rank
    from pipeline.model.resolve import resolve_configured
    from pipeline.model.train import TrainSpec, train_adapter

    cfg = load_config(config)
    out_console(stderr=True).print(resolve_configured(cfg.model).note, highlight=False, soft_wrap=True)
    if not (dataset / "dataset_info.json").is_file():
        raise DataError(f"--dataset {dataset}: not a saved dataset folder (no dataset_info.json); point it at e.g. "
                        "artifacts/rounds/NNN/labeled/dataset")
    ds = datasets.load_from_disk(str(dataset))
    cols = ["sample_id", "prepared", "question", "answer"]
    missing = [c for c in cols if c not in ds.column_names]
    if missing:
        raise DataError(f"--dataset {dataset}: columns {missing} are missing (it has {ds.column_names}); use a "
                        "prepared, labeled dataset")
    result = train_adapter(TrainSpec.of(cfg), list(ds.select_columns(cols)), out, init_adapter=init_adapter)
    rank = launched_rank()
    if rank is None or rank.is_main:
        typer.echo(json.dumps({"adapter": str(result.adapter_dir), "steps": result.steps,
                               "num_processes": result.info.get("num_processes", 1),
                               "loss": result.losses[-1] if result.losses else None}))


def register(app: typer.Typer) -> None:
    app.command("make-tiny-model")(make_tiny_model_cmd)
    app.command("check-quant")(check_quant_cmd)
    app.command("check-model")(check_model_cmd)
    app.command("hardware")(hardware_cmd)
    app.command("plan")(plan_cmd)
    app.command("train")(train_cmd)
