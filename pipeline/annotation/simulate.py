"""A simulated annotator: answers an exported round from held-back ground truth and drops a *Label Studio export*
into the inbox, so benchmarks and the demo go through the same import path as people do. A simulated crowd
(`simulate_annotators`, rounds.simulate_annotators) does the same with several annotators, each with an accuracy
and a time model, several of them per sample: their lead_time is what the ledger's time log records.

Deterministic (seeded, no timestamps): simulating the same round twice writes the same bytes, which the importer
then recognises as already imported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from pipeline.annotation.export import FROM_NAME, LABEL_CONFIG_FILE, TASKS_FILE, TO_NAME
from pipeline.errors import ArtifactError, DataError
from pipeline.store import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

SIDECAR_DIR = "sidecars"  # a sub-folder: the inbox import reads only top-level files


def simulated_file(inbox_dir: str | os.PathLike[str], round_index: int, kind: str = "round") -> Path:
    return Path(inbox_dir) / f"simulated-{kind}-{round_index:03d}.json"


def sidecar_path(label_file: str | os.PathLike[str]) -> Path:
    p = Path(label_file)
    return p.parent / SIDECAR_DIR / f"{p.stem}.flips.json"


def load_ground_truth(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(sample_id → answer, image file name → answer) from a JSONL of {"sample_id", "image", "answer"}."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: ground-truth file not found; set data.ground_truth to the held-back answers JSONL")
    by_id: dict[str, str] = {}
    by_image: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{n}:{exc.colno}: not valid JSON ({exc.msg})") from None
        if not isinstance(d, dict) or d.get("answer") in (None, ""):
            raise DataError(f"{path}:{n}: expected an object with a non-empty 'answer', got {line[:80]!r}")
        if d.get("sample_id"):
            by_id[str(d["sample_id"])] = str(d["answer"])
        if d.get("image"):
            by_image[PurePosixPath(str(d["image"]).replace("\\", "/")).name] = str(d["answer"])
    return by_id, by_image


def _choices(export_dir: Path) -> list[str] | None:
    p = export_dir / LABEL_CONFIG_FILE
    if not p.is_file():
        return None
    root = ET.fromstring(p.read_text(encoding="utf-8"))
    values = [c.get("value") for c in root.iter("Choice")]
    return [v for v in values if v is not None] or None


def _image_name(url: Any) -> str:
    if not isinstance(url, str):
        return ""
    parsed = urlparse(url)
    return PurePosixPath(unquote(parse_qs(parsed.query).get("d", [parsed.path])[0])).name


def _export_to_answer(export_dir: Path, ground_truth_path: str | os.PathLike[str],
                      round_index: int) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, str], list[str] | None]:
    """An export's Label Studio tasks, the ground truth by sample ID and by image, and the export's answer choices."""
    tasks_path = export_dir / TASKS_FILE
    if not tasks_path.is_file():
        raise ArtifactError(f"{tasks_path}: no Label Studio tasks for round {round_index}; export the round first")
    tasks = json.loads(tasks_path.read_text(encoding="utf-8"))
    by_id, by_image = load_ground_truth(ground_truth_path)
    return tasks, by_id, by_image, _choices(export_dir)


def simulate_annotator(
    export_dir: str | os.PathLike[str],
    ground_truth_path: str | os.PathLike[str],
    inbox_dir: str | os.PathLike[str],
    *,
    round_index: int,
    noise: float = 0.0,
    seed: int = 0,
    annotator: str = "simulated",
    kind: str = "round",
) -> Path:
    """Answer every task of a round's export and write a Label Studio JSON export into inbox_dir.

    A fraction `noise` of the answers (rounded) is flipped to another answer; which ones goes to a sidecar JSON.
    Tasks with no ground truth come back skipped (was_cancelled), as a person would skip them. `kind` names the
    task set in the file name (simulated-round-NNN.json, simulated-relabel-NNN.json).
    """
    if not 0.0 <= noise <= 1.0:
        raise DataError(f"noise {noise} is not a fraction; use a value between 0 and 1")
    export_dir = Path(export_dir)
    tasks, by_id, by_image, choices = _export_to_answer(export_dir, ground_truth_path, round_index)
    truth = _true_answers(tasks, by_id, by_image)
    answered = [i for i, a in enumerate(truth) if a is not None]
    pool = choices or sorted({a for a in by_id.values()} | {a for a in by_image.values()})
    given, flipped = _with_noise(truth, answered, pool, noise=noise, rng=random.Random(
        f"tamis-simulate:{seed}:{round_index}"))
    out_tasks = [_answered_task(i, t, ans, choices, annotator)
                 for i, (t, ans) in enumerate(zip(tasks, given, strict=True))]

    out = simulated_file(inbox_dir, round_index, kind)
    atomic_write_json(sidecar_path(out), {
        "round": round_index,
        "noise": noise,
        "seed": seed,
        "tasks": len(tasks),
        "answered": len(answered),
        "missing": [tasks[i].get("data", {}).get("sample_id") for i, a in enumerate(truth) if a is None],
        "flipped": [{"sample_id": tasks[i].get("data", {}).get("sample_id"), "true": truth[i], "given": given[i]}
                    for i in flipped],
    })
    atomic_write_text(out, json.dumps(out_tasks, sort_keys=True, indent=2, ensure_ascii=False) + "\n")
    if len(answered) < len(tasks):
        log.warning("Simulated annotator: no ground truth for %d of %d tasks; they come back skipped",
                    len(tasks) - len(answered), len(tasks))
    log.info("Simulated annotator answered %d tasks of round %d (%d flipped) → %s",
             len(answered), round_index, len(flipped), out)
    return out


def _true_answers(tasks: list[dict[str, Any]], by_id: dict[str, str],
                  by_image: dict[str, str]) -> list[str | None]:
    """Each task's ground truth, by its sample ID, else its original image or image file name; None if unknown."""
    truth: list[str | None] = []
    for t in tasks:
        data, meta = t.get("data", {}), t.get("meta", {})
        sid = data.get("sample_id") or meta.get("sample_id")
        ans = by_id.get(sid) if sid else None
        if ans is None:
            ans = by_image.get(data.get("original_image", "")) or by_image.get(_image_name(data.get("image")))
        truth.append(ans)
    return truth


def _with_noise(truth: list[str | None], answered: list[int], pool: list[str], *, noise: float,
                rng: random.Random) -> tuple[list[str | None], list[int]]:
    """(the given answers, the indices flipped): round(noise × answered) answers flipped to another of `pool`."""
    n_flip = round(noise * len(answered))
    if n_flip and len(pool) < 2:
        raise DataError(f"cannot flip answers with noise {noise}: only {len(pool)} distinct answer(s) known")
    flipped = sorted(rng.sample(answered, n_flip))
    given = list(truth)
    for i in flipped:
        given[i] = rng.choice([a for a in pool if a != truth[i]])
    return given, flipped


def _answered_task(i: int, t: dict[str, Any], ans: str | None, choices: list[str] | None,
                   annotator: str) -> dict[str, Any]:
    """Task `t` as a Label Studio JSON export holds it, with one annotation: `ans`, or skipped when None."""
    if ans is None:
        result: list[dict[str, Any]] = []
    elif choices:
        result = [{"from_name": FROM_NAME, "to_name": TO_NAME, "type": "choices", "value": {"choices": [ans]},
                   "origin": "manual", "id": f"sim{i}"}]
    else:
        result = [{"from_name": FROM_NAME, "to_name": TO_NAME, "type": "textarea", "value": {"text": [ans]},
                   "origin": "manual", "id": f"sim{i}"}]
    return {
        "id": i + 1,
        "data": t.get("data", {}),
        "meta": t.get("meta", {}),
        "annotations": [{
            "id": i + 1,
            "completed_by": annotator,
            "result": result,
            "was_cancelled": ans is None,
            "ground_truth": False,
            # No lead_time: the simulated annotator spends no time, and a recorded 0 s would count as data.
        }],
        # A real JSON export lists prediction IDs here, not the predictions themselves.
        "predictions": [],
    }


# ------------------------------------------------------------------------------------------------ a crowd
def sample_property(per: str, *, image: Path | None, question: str) -> float:
    """The sample property a SecondsModel reads (see pipeline.config.SecondsModel): detail (mean absolute grey-level
    gradient, 0–1), pixels (megapixels) or question_length (words)."""
    if per == "question_length":
        return float(len(question.split()))
    if image is None or not image.is_file():
        raise ArtifactError(f"{image}: the exported image a simulated annotator's time depends on ({per}) is missing; "
                            "export with annotate.formats including images, or use per: question_length")
    import numpy as np
    from PIL import Image

    with Image.open(image) as im:
        if per == "pixels":
            return im.width * im.height / 1e6
        g = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    dx = np.abs(np.diff(g, axis=1)).mean() if g.shape[1] > 1 else 0.0
    dy = np.abs(np.diff(g, axis=0)).mean() if g.shape[0] > 1 else 0.0
    return float((dx + dy) / 2)


def annotator_seconds(spec: Any, *, sample_id: str, seed: int, image: Path | None, question: str) -> float:
    """Seconds one simulated annotator spends on one sample: a fixed number, or base + scale × property times
    exp(noise · z), z a standard normal seeded by (seed, annotator, sample), so reruns give the same times."""
    seconds = spec.seconds
    if isinstance(seconds, (int, float)):
        return float(seconds)
    z = random.Random(f"tamis-seconds:{seed}:{spec.name}:{sample_id}").gauss(0.0, 1.0)
    value = sample_property(seconds.per, image=image, question=question) if seconds.scale else 0.0
    return round((seconds.base + seconds.scale * value) * math.exp(seconds.noise * z), 3)


def simulate_annotators(
    export_dir: str | os.PathLike[str],
    ground_truth_path: str | os.PathLike[str],
    inbox_dir: str | os.PathLike[str],
    *,
    annotators: Sequence[Any],
    round_index: int,
    redundancy: int = 1,
    seed: int = 0,
    kind: str = "round",
    exclude: Mapping[str, set[str]] | None = None,
) -> Path:
    """A simulated crowd answers every task of an export: each task gets `redundancy` distinct annotators (chosen per
    sample, seeded; never one named in `exclude[sample_id]`, who labeled it before), each answering right with their
    `accuracy` (else a uniformly drawn wrong answer) and taking `annotator_seconds`. Written as one Label Studio JSON
    export with one annotation per annotator (their name in completed_by, their time in lead_time), so the votes
    and times go through the real import. Deterministic: the same inputs write the same bytes.
    """
    names = [a.name for a in annotators]
    if not annotators or len(set(names)) != len(names):
        raise DataError(f"rounds.simulate_annotators: needs at least one annotator with distinct names, got {names}")
    if redundancy > len(annotators):
        raise DataError(f"rounds.simulate_redundancy = {redundancy} labels per sample, but only {len(annotators)} "
                        f"simulated annotators ({', '.join(names)}); add annotators or lower it")
    export_dir = Path(export_dir)
    tasks, by_id, by_image, choices = _export_to_answer(export_dir, ground_truth_path, round_index)
    pool = choices or sorted(set(by_id.values()) | set(by_image.values()))
    exclude = exclude or {}
    out_tasks, given_rows = [], []
    for i, t in enumerate(tasks):
        data = t.get("data", {})
        sid = data.get("sample_id") or t.get("meta", {}).get("sample_id")
        truth = by_id.get(sid) if sid else None
        if truth is None:
            truth = by_image.get(data.get("original_image", "")) or by_image.get(_image_name(data.get("image")))
        rng = random.Random(f"tamis-crowd:{seed}:{round_index}:{kind}:{sid}")
        free = [a for a in annotators if a.name not in exclude.get(sid or "", set())]
        chosen = sorted(rng.sample(free, min(redundancy, len(free))), key=lambda a: names.index(a.name))
        image = export_dir / "images" / _image_name(data.get("image")) if data.get("image") else None
        anns = []
        for j, a in enumerate(chosen):
            arng = random.Random(f"tamis-crowd:{seed}:{round_index}:{kind}:{sid}:{a.name}")
            if truth is None:
                ans = None
            elif arng.random() < a.accuracy or len(pool) < 2:
                ans = truth
            else:
                ans = arng.choice([x for x in pool if x != truth])
            value = {"choices": [ans]} if choices else {"text": [ans]}
            anns.append({
                "id": i * len(annotators) + j + 1,
                "completed_by": a.name,
                "result": [] if ans is None else [{"from_name": FROM_NAME, "to_name": TO_NAME,
                                                   "type": "choices" if choices else "textarea", "value": value,
                                                   "origin": "manual", "id": f"sim{i}-{j}"}],
                "was_cancelled": ans is None,
                "ground_truth": False,
                "lead_time": annotator_seconds(a, sample_id=sid or str(i), seed=seed, image=image,
                                               question=str(data.get("text") or "")),
            })
            given_rows.append({"sample_id": sid, "annotator": a.name, "true": truth, "given": ans})
        out_tasks.append({"id": i + 1, "data": data, "meta": t.get("meta", {}), "annotations": anns,
                          "predictions": []})
    out = simulated_file(inbox_dir, round_index, kind)
    atomic_write_json(sidecar_path(out), {"round": round_index, "seed": seed, "tasks": len(tasks),
                                          "annotators": [a.model_dump(mode="json") for a in annotators],
                                          "redundancy": redundancy, "given": given_rows})
    atomic_write_text(out, json.dumps(out_tasks, sort_keys=True, indent=2, ensure_ascii=False) + "\n")
    wrong = sum(r["given"] is not None and r["given"] != r["true"] for r in given_rows)
    log.info("Simulated crowd (%s) answered %d tasks of round %d with %d labels (%d wrong) → %s",
             ", ".join(names), len(tasks), round_index, len(given_rows), wrong, out)
    return out
