"""The prepare flow: ingest → preprocess → quality, each a cached stage task; augmentation is a task the round flow
calls on its labeled set. Tasks take references (dataset folder + content digest) and config sections, never data.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from prefect import flow

from flows.stages import run_stage, stage_task
from pipeline import augment as aug
from pipeline import preprocess as prep
from pipeline import quality as qual
from pipeline.config import AugmentConfig, PreprocessConfig, ProjectConfig, QualityConfig, load_config
from pipeline.errors import ArtifactError
from pipeline.store import atomic_write_json, digest_dir, find_valid_manifest, read_manifest, stage_key

log = logging.getLogger(__name__)
LATEST = "latest.json"


def dataset_of(ref: dict[str, Any]) -> tuple[str, str]:
    """(dataset folder, content digest) of a reference: a stage folder ({"dir"}) whose manifest has a "dataset"
    output, or a plain saved dataset ({"dataset", optional "digest"})."""
    if "dataset" in ref:
        return str(ref["dataset"]), ref.get("digest") or digest_dir(ref["dataset"])
    folder = Path(ref["dir"])
    m = read_manifest(folder, verify=False)  # run_stage already verified the producing stage's outputs
    if "dataset" not in m.outputs:
        raise ArtifactError(f"{folder}: stage {m.stage!r} has no 'dataset' output; pass an ingest or prepare folder")
    return str(m.path_of("dataset", folder)), m.outputs["dataset"].digest


def _ref(out: Path, m: Any, output: str) -> dict[str, Any]:
    return {"dir": str(out), "digest": m.outputs[output].digest, "info": m.info}


@stage_task(prep.STAGE, prep.PREPROCESS_VERSION)
def preprocess_task(
    artifacts: str, dataset: str, dataset_digest: str, preprocess: dict[str, Any], size: int, max_pixels: int
) -> dict[str, Any]:
    import datasets

    inputs = {"dataset": dataset_digest}
    key = stage_key(prep.STAGE, prep.PREPROCESS_VERSION, inputs, {**preprocess, "size": size, "max_pixels": max_pixels})
    out = Path(artifacts) / "prepare" / key[:16]
    # Prefect's cache may be gone (new PREFECT_HOME) while verified outputs are still on disk: reuse them.
    m = find_valid_manifest(out, key) or prep.preprocess_dataset(
        datasets.load_from_disk(dataset), PreprocessConfig(**preprocess), out, size=size, max_pixels=max_pixels,
        inputs=inputs,
    )
    return _ref(out, m, "dataset")


@stage_task(qual.STAGE, qual.QUALITY_VERSION)
def quality_task(artifacts: str, dataset: str, dataset_digest: str, quality: dict[str, Any]) -> dict[str, Any]:
    import datasets

    inputs = {"dataset": dataset_digest}
    key = stage_key(qual.STAGE, qual.QUALITY_VERSION, inputs, quality)
    out = Path(artifacts) / "quality" / key[:16]
    m = find_valid_manifest(out, key) or qual.assess_quality(
        datasets.load_from_disk(dataset), QualityConfig(**quality), out, inputs=inputs
    )
    return _ref(out, m, "table")


@stage_task(aug.STAGE, aug.AUGMENT_VERSION)
def augment_task(
    artifacts: str, dataset: str, dataset_digest: str, augment: dict[str, Any], seed: int, wordnet: bool
) -> dict[str, Any]:
    """`wordnet` (is WordNet installed?) is in the cache key: installing it later re-runs a synonym-enabled config."""
    import datasets

    inputs = {"dataset": dataset_digest}
    key = stage_key(aug.STAGE, aug.AUGMENT_VERSION, inputs, {**augment, "seed": seed})
    out = Path(artifacts) / "augment" / key[:16]
    m = find_valid_manifest(out, key)
    if m is not None and wordnet and "synonym" in m.info.get("skipped_text_augmenters", []):
        m = None
    m = m or aug.augment_labeled(datasets.load_from_disk(dataset), AugmentConfig(**augment), seed, out, inputs=inputs)
    return _ref(out, m, "dataset")


def prepare_refs(cfg: ProjectConfig, ingest_ref: dict[str, Any]) -> dict[str, Any]:
    """Preprocess + quality for an ingested dataset; call it inside a flow. Returns {"prepare": ref, "quality": ref},
    each ref {"dir", "digest", "info"}; load with pipeline.preprocess.load_prepared / pipeline.quality.load_quality."""
    dataset, digest = dataset_of(ingest_ref)
    artifacts = str(cfg.artifacts)
    prepared = run_stage(
        preprocess_task, artifacts=artifacts, dataset=dataset, dataset_digest=digest,
        preprocess=cfg.section("preprocess"), size=prep.resolve_size(cfg.preprocess, cfg.model),
        max_pixels=cfg.data.max_image_pixels,
    )
    p_dataset, p_digest = dataset_of(prepared)
    quality = run_stage(quality_task, artifacts=artifacts, dataset=p_dataset, dataset_digest=p_digest,
                        quality=cfg.section("quality"))
    refs = {"prepare": prepared, "quality": quality}
    # What `tamis quality report` and later commands read without re-running the flow.
    atomic_write_json(Path(artifacts) / "prepare" / LATEST, refs)
    return refs


def augment_ref(cfg: ProjectConfig, labeled_ref: dict[str, Any], *, seed: int | None = None) -> dict[str, Any]:
    """Augment a labeled prepared set (a stage folder ref or {"dataset", "digest"}); call it inside a flow.

    Returns {"dir", "digest", "info"}; load with pipeline.augment.load_augmented. `seed` defaults to cfg.seed.
    """
    dataset, digest = dataset_of(labeled_ref)
    wordnet = cfg.augment.copies > 0 and cfg.augment.text.synonym_p > 0 and aug.wordnet_available()
    return run_stage(augment_task, artifacts=str(cfg.artifacts), dataset=dataset, dataset_digest=digest,
                     augment=cfg.section("augment"), seed=cfg.seed if seed is None else seed, wordnet=wordnet)


def latest_refs(cfg: ProjectConfig) -> dict[str, Any]:
    """The refs the last `prepare` run of this project wrote; a clear error if there was none."""
    path = Path(cfg.artifacts) / "prepare" / LATEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no prepared data yet; run `tamis prepare --config <your config>` first")
    return json.loads(path.read_text(encoding="utf-8"))


@flow(name="prepare")
def prepare_flow(
    config_path: str | None = None, ingest_dir: str | None = None, source_digest: str | None = None
) -> dict[str, Any]:
    """Ingest (or take an already ingested stage folder) → preprocess → quality. Returns prepare_refs' dict plus
    "ingest". `source_digest` is the ingest cache input when the caller computed it already."""
    cfg = load_config(config_path)
    if ingest_dir is not None:
        ingest = {"dir": ingest_dir}
    else:
        from flows.ingest import ingest_ref

        ingest = ingest_ref(cfg, source_digest)
    return {"ingest": ingest, **prepare_refs(cfg, ingest)}
