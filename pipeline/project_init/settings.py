"""The settings `tamis init` chooses from the pool, the model and the hardware; each with the reason it writes as
the YAML comment above it.

- Image size: the median longest side of the images (a sample of their headers), rounded up to a multiple of 32,
  never above the model family's native size: upscaling small photos to 512 px only blurs them (every one then
  looks `blurry`) and costs image tokens. A tiny stand-in model is built for one size (its tamis_tiny.json): that.
- Selection space and candidates: a pretrained model's frozen vision tower (tiny random models have none worth
  using: the pool's own SimCLR encoder up to 20,000 images, downsampled pixels above, where the encoder's fit would
  take minutes); `select.candidates: auto` (score all up to 10,000 eligible samples, restrict above).
- Batch per round, shard size: from the pool size. Scoring batch and workers: from the hardware tamis hardware
  detects (pipeline.model.hardware), the training micro-batch left to its planner (`train.batch_size: auto`).
- A tiny stand-in gets the demo's tiny-model settings (configs/demo.yaml says why each is needed).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.model.resolve import ResolvedModel

ENCODER_MAX_POOL = 20_000  # select.embeddings: pool fits its encoder on at most this many images anyway
LARGE_POOL = 50_000  # above it, larger score shards (fewer tasks, same memory per shard)
STOP_SET_MAX = 500  # rounds.stop_set: enough for agreement to resolve 0.2 % changes, cheap to score each round
NATIVE_MAX = 512  # the largest native size of the registered families' one-tile inputs (SmolVLM's SigLIP tile)


@dataclass
class ModelFacts:
    """What init knows of the model: its family, whether it is a tamis tiny stand-in (and the size it was built for),
    and where it resolved to."""

    name: str
    family: str | None
    tiny_size: int | None
    resolved: ResolvedModel | None
    native_size: int | None = None


def model_facts(name: str, resolved: ResolvedModel | None) -> ModelFacts:
    """Family and tiny marker from the checkpoint's files when they are here (folder or HF cache snapshot)."""
    folder = Path(resolved.path) if resolved is not None and resolved.path else None
    family = tiny = native = None
    if folder is not None and (folder / "config.json").is_file():
        from pipeline.model.families import FAMILIES, detect_family

        try:
            family = detect_family(str(folder))
        except Exception:  # noqa: BLE001 - an unregistered architecture: the generic fallback, family auto
            family = "auto"
        marker = folder / "tamis_tiny.json"
        if marker.is_file():
            meta = json.loads(marker.read_text(encoding="utf-8"))
            family, tiny = meta.get("family", family), int(meta.get("image_size", 32))
        if family in FAMILIES:
            native = FAMILIES[family].default_image_size
    return ModelFacts(name, family, tiny, resolved, native)


@dataclass
class Choice:
    value: Any
    why: str


@dataclass
class Settings:
    size: Choice
    embeddings: Choice
    batch_size: Choice
    shard_size: Choice
    score_batch_size: Choice
    num_proc: Choice
    hardware: str
    stop_set: Choice = field(default_factory=lambda: Choice(0, "no stop set"))
    train_plan: str = ""
    notes: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None  # open answers: the generation budget (pipeline.project_init.answers)


def image_size(sizes: list[tuple[int, int]], facts: ModelFacts) -> Choice:
    if facts.tiny_size is not None:
        return Choice(facts.tiny_size, f"the tiny stand-in was built for {facts.tiny_size} px images "
                      "(its tamis_tiny.json)")
    cap = facts.native_size or NATIVE_MAX
    if not sizes:
        return Choice(cap, f"the model's native size ({cap} px); no image size could be read here")
    median = statistics.median(max(w, h) for w, h in sizes)
    size = min(cap, max(64, 32 * math.ceil(median / 32)))
    why = f"the median longest side of {len(sizes)} of your images is {median:g} px"
    if size == cap and median > cap:
        return Choice(size, f"{why}; capped at the model's native {cap} px (larger only costs image tokens)")
    return Choice(size, f"{why}; rounded up to {size} px, below the model's native {cap} px: upscaling small "
                  "images only blurs them")


def stop_set_size(pool: int) -> Choice:
    """The stop set the default label-free stop reads (rounds.stop_when_converged): a tenth of the pool, at most 500
    (Bloodgood & Vijay-Shanker's stabilizing predictions use a few hundred to a few thousand), none under 200."""
    if pool < 200:
        return Choice(0, f"a {pool:,}-image pool cannot spare a stop set (200 or more): the label-free stop is off "
                      "until the pool grows")
    size = min(STOP_SET_MAX, pool // 10)
    return Choice(size, f"a tenth of the {pool:,}-image pool, at most {STOP_SET_MAX}: never selected, its answers "
                  "by successive adapters drive the default stop (rounds.stop_when_converged)")


def selection_space(pool: int, facts: ModelFacts) -> Choice:
    if facts.tiny_size is None:
        return Choice("vision_tower", "a pretrained model's frozen vision encoder is the selection space "
                      "(coverage, diversity, candidates)")
    if pool <= ENCODER_MAX_POOL:
        return Choice("pool", "the tiny stand-in's vision tower is random; a small SimCLR encoder fitted on your "
                      "unlabeled pool is the label-efficiency winner's space (benchmarks/README.md)")
    return Choice("pixels", f"the tiny stand-in's vision tower is random, and at {pool:,} images the pool encoder's "
                  f"fit would take many minutes: downsampled pixels (PCA) instead (pool: above {ENCODER_MAX_POOL:,})")


def choose_settings(pool: int, sizes: list[tuple[int, int]], facts: ModelFacts, hw: Any) -> Settings:
    """Every size-, model- and hardware-dependent setting `tamis init` writes (module docstring)."""
    gpu = bool(getattr(hw, "gpus", None))
    batch = max(1, min(100, pool // 10)) if pool else 10
    shard = 1024 if pool > LARGE_POOL else 256
    described = (f"{len(hw.gpus)} GPU(s): {', '.join(g.name for g in hw.gpus)}" if gpu
                 else f"CPU only ({hw.cpu_count} cores, {hw.ram_bytes / 2**30:.0f} GiB RAM)")
    s = Settings(
        size=image_size(sizes, facts),
        embeddings=selection_space(pool, facts),
        batch_size=Choice(batch, f"a tenth of the {pool:,}-image pool, at most 100 a round" if pool else
                          "no unlabeled images yet: 10 a round once the pool has some"),
        shard_size=Choice(shard, f"{pool:,} images: " + ("1,024 a shard keeps the task count low" if shard > 256
                                                           else "256 a shard (a killed round resumes at its shard)")),
        score_batch_size=Choice(32 if gpu else 8, "scoring runs without gradients: 32 a batch on a GPU" if gpu
                                else "8 a batch on the CPU (no GPU detected)"),
        num_proc=Choice(max(1, min(4, hw.cpu_count // 2)), f"half of the {hw.cpu_count} CPU cores, at most 4"),
        hardware=described,
    )
    s.stop_set = stop_set_size(pool)
    s.train_plan = train_plan(facts, hw, s.size.value)
    if not pool:
        s.notes.append("every image found is labeled: there is no unlabeled pool to select from; add a source of "
                       "unlabeled images (e.g. a flat folder) to data.sources")
    if not gpu and facts.tiny_size is None:
        s.notes.append("no GPU here: a real VLM trains at roughly 13-60 s a step on a CPU (docs/models.md); try the "
                       "loop first with a tiny stand-in (`tamis make-tiny-model`), train on a GPU machine")
    return s


def train_plan(facts: ModelFacts, hw: Any, size: int) -> str:
    """What `tamis hardware` would choose for this model here (micro-batch × accumulation, checkpointing,
    precision), read from the checkpoint's config when it is on this machine; "" when it is not (hub, not cached)."""
    folder = facts.resolved.path if facts.resolved is not None else None
    if not folder or not Path(folder, "config.json").is_file():
        return ""
    from pipeline.config import ModelConfig, TrainConfig
    from pipeline.model.hardware import choose_train_settings

    try:
        t = choose_train_settings(TrainConfig(), ModelConfig(name_or_path=folder, family=facts.family), hw,
                                  image_size=size)
    except Exception as exc:  # noqa: BLE001 - the planner cannot read this checkpoint: the round plans it again
        return f"the memory planner could not read this checkpoint ({type(exc).__name__}); it plans at train time"
    return (f"micro-batch {t.micro_batch} × accumulation {t.grad_accum}, gradient checkpointing "
            f"{'on' if t.gradient_checkpointing else 'off'}, {t.precision} ({t.reason})")
