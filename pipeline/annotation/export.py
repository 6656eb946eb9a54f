"""Export a round's selection for annotators: Label Studio tasks + labeling interface, CSV, JSONL and the images.

Every file is a pure function of the selection, the dataset rows and the config (sorted keys, no timestamps), so
re-exporting the same selection gives byte-identical files and the same digests.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from pipeline.codeversion import stage_version
from pipeline.config import AnnotateConfig, ModelConfig
from pipeline.csvcells import csv_text
from pipeline.errors import TamisError
from pipeline.fields.answers import label_columns
from pipeline.fields.labelstudio import image_keys, labeling_config, prediction_results
from pipeline.fields.schema import AnswerSchema, schema_of
from pipeline.idindex import IdIndex
from pipeline.round_state import ROUNDS_DIR, round_dir
from pipeline.stage_ref import StageRef
from pipeline.store import (
    Manifest,
    atomic_dir,
    atomic_write_text,
    digest_bytes,
    digest_json,
    write_manifest,
)

log = logging.getLogger(__name__)

EXPORT_VERSION = stage_version("1", "pipeline.annotation.export")
TASKS_FILE = "label_studio_tasks.json"
LABEL_CONFIG_FILE = "label_config.xml"
CSV_FILE = "annotate.csv"
JSONL_FILE = "annotate.jsonl"
IMAGES_DIR = "images"
# Names used in the labeling interface; the importer and the simulated annotator read results by these.
FROM_NAME, TO_NAME = "answer", "image"
# original_image: the file name the image had in its source, so an annotator (and the team) can find it there.
TABLE_COLUMNS = ("sample_id", "image", "original_image", "text", "model_answer", "confidence", "label")

# A file name on every OS: no separators, no leading dot (hidden files, "." and ".."), bounded length.
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ExportError(TamisError):
    pass


def export_dir(artifacts: Path, round_index: int) -> Path:
    return round_dir(artifacts, round_index, "export")


def check_sample_id(sample_id: Any, where: str = "") -> str:
    if not isinstance(sample_id, str) or not _SAFE_ID.fullmatch(sample_id):
        raise ExportError(
            f"{where}sample_id {sample_id!r} is not a safe file name (letters, digits, '.', '_', '-'; not starting "
            "with '.'; at most 128 characters); fix the sample IDs in the dataset"
        )
    return sample_id


@dataclass(frozen=True)
class ExportItem:
    sample_id: str
    rank: int
    score: float
    question: str
    image_bytes: bytes
    image_ext: str
    prediction: str | None = None
    confidence: float | None = None
    scores: Mapping[str, float] = field(default_factory=dict)
    original_name: str = ""
    # A sample of several pictures (a conversation source's): its 2nd..Nth as (bytes, extension, original file name),
    # and its earlier turns (role, text); empty on a one-image sample, whose files are what they always were.
    more: tuple[tuple[bytes, str, str], ...] = ()
    context: tuple[tuple[str, str], ...] = ()

    @property
    def image_name(self) -> str:
        return f"{self.sample_id}.{self.image_ext}"

    def more_names(self) -> list[str]:
        """The file names of its later pictures in images/: `<sample_id>_2.<ext>`, `_3`, …"""
        return [f"{self.sample_id}_{i}.{ext}" for i, (_, ext, _) in enumerate(self.more, 2)]

    def images(self) -> list[tuple[str, bytes]]:
        """(file name in images/, bytes) of every picture, the first first."""
        return [(self.image_name, self.image_bytes),
                *zip(self.more_names(), (b for b, _, _ in self.more), strict=True)]


@dataclass(frozen=True)
class ExportContext:
    round_index: int
    answers: list[str] | None
    image_url_prefix: str
    # Relative path from Label Studio's document root to the export folder (posix).
    export_relpath: str
    model_version: str = "tamis"
    schema: AnswerSchema | None = None  # data.answer_schema: one Label Studio control and one table column per field


class Exporter:
    """One output format. `write` returns the paths it wrote (files or folders), relative to out_dir."""

    name: ClassVar[str]

    def __init__(self, ctx: ExportContext):
        self.ctx = ctx

    def write(self, items: Sequence[ExportItem], out_dir: Path) -> list[str]:
        raise NotImplementedError


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def label_config_xml(answers: list[str] | None) -> str:
    """Label Studio labeling interface: Choices for a closed answer set, a TextArea for open answers."""
    view = ET.Element("View")
    ET.SubElement(view, "Image", name=TO_NAME, value="$image")
    ET.SubElement(view, "Text", name="question", value="$text")
    if answers:
        choices = ET.SubElement(
            view, "Choices", name=FROM_NAME, toName=TO_NAME, choice="single", showInLine="true", required="true"
        )
        for a in answers:
            ET.SubElement(choices, "Choice", value=a)
    else:
        ET.SubElement(
            view, "TextArea", name=FROM_NAME, toName=TO_NAME, maxSubmissions="1", editable="true", required="true"
        )
    ET.indent(view)
    return ET.tostring(view, encoding="unicode") + "\n"


class LabelStudioExporter(Exporter):
    name = "label_studio"

    def _prediction(self, item: ExportItem) -> list[dict[str, Any]]:
        if item.prediction is None:
            return []
        answers = self.ctx.answers
        if self.ctx.schema is not None:
            fields = prediction_results(item.prediction, self.ctx.schema, TO_NAME)
            return [{"model_version": self.ctx.model_version, "result": fields,
                     **({"score": float(item.confidence)} if item.confidence is not None else {})}] if fields else []
        if answers:
            # Label Studio rejects a pre-annotation that is not one of the interface's choices.
            if item.prediction not in answers:
                return []
            result = {"type": "choices", "value": {"choices": [item.prediction]}}
        else:
            if not item.prediction.strip():
                return []  # an empty generated answer is no pre-annotation: the annotator starts from a blank box
            result = {"type": "textarea", "value": {"text": [item.prediction]}}
        result |= {"from_name": FROM_NAME, "to_name": TO_NAME}
        pred: dict[str, Any] = {"model_version": self.ctx.model_version, "result": [result]}
        if item.confidence is not None:
            pred["score"] = float(item.confidence)
        return [pred]

    def write(self, items: Sequence[ExportItem], out_dir: Path) -> list[str]:
        prefix, rel = self.ctx.image_url_prefix, self.ctx.export_relpath
        tasks = [
            {
                "data": {
                    "image": f"{prefix}{rel}/{IMAGES_DIR}/{it.image_name}",
                    "text": it.question,
                    # JSON_MIN exports drop `meta`; the ID must also travel in `data`.
                    "sample_id": it.sample_id,
                    **({"original_image": it.original_name} if it.original_name else {}),
                    **_more_task_data(it, f"{prefix}{rel}/{IMAGES_DIR}/"),
                },
                "meta": {
                    "sample_id": it.sample_id,
                    "round": self.ctx.round_index,
                    "rank": it.rank,
                    "score": it.score,
                    "scores": dict(it.scores),
                },
                "predictions": self._prediction(it),
            }
            for it in items
        ]
        atomic_write_text(out_dir / TASKS_FILE, _dumps(tasks))
        n_images = max((1 + len(it.more) for it in items), default=1)
        context = any(it.context for it in items)
        # One <Image> per picture where some sample has several (or earlier turns): pipeline/fields/labelstudio.py,
        # whose answer control keeps the names the label import reads; a one-image project's config is unchanged.
        xml = label_config_xml(self.ctx.answers) if n_images == 1 and not context and self.ctx.schema is None else \
            labeling_config(n_images, self.ctx.schema, answers=self.ctx.answers, context=context)
        atomic_write_text(out_dir / LABEL_CONFIG_FILE, xml)
        return [TASKS_FILE, LABEL_CONFIG_FILE]


def _more_task_data(it: ExportItem, url: str) -> dict[str, Any]:
    """A task's data for a sample's later pictures (`image_2`, … as `labeling_config` names them, each with its
    `original_image_2`, …) and its earlier turns (`context`); nothing for a one-image sample."""
    if not it.more and not it.context:
        return {}
    keys = image_keys(1 + len(it.more))[1:]
    data: dict[str, Any] = {k: url + name for k, name in zip(keys, it.more_names(), strict=True)}
    data |= {f"original_{k}": orig for k, (_, _, orig) in zip(keys, it.more, strict=True) if orig}
    if it.context:
        data["context"] = "\n".join(f"{role}: {text}" for role, text in it.context)
    return data


def _table_rows(items: Sequence[ExportItem], schema: AnswerSchema | None = None) -> list[dict[str, Any]]:
    """One row per sample; under an answer schema one empty column per field instead of `label` (the label import
    rebuilds the answer from them)."""
    rows = _plain_rows(items)
    if schema is not None:
        for r in rows:
            del r["label"]
            r.update(dict.fromkeys(label_columns(schema), ""))
    return rows


def _plain_rows(items: Sequence[ExportItem]) -> list[dict[str, Any]]:
    return [
        {
            "sample_id": it.sample_id,
            "image": it.image_name,
            "original_image": it.original_name,
            "text": it.question,
            "model_answer": it.prediction,
            "confidence": it.confidence,
            "label": "",
            **_more_cells(it),
        }
        for it in items
    ]


def _more_cells(it: ExportItem) -> dict[str, Any]:
    """The table cells of a sample's later pictures (`image_2` and `original_image_2`, …) and earlier turns."""
    cells: dict[str, Any] = {}
    for k, name, (_, _, orig) in zip(image_keys(1 + len(it.more))[1:], it.more_names(), it.more, strict=True):
        cells |= {k: name, f"original_{k}": orig}
    if it.context:
        cells["context"] = "\n".join(f"{role}: {text}" for role, text in it.context)
    return cells


def table_columns(items: Sequence[ExportItem], schema: AnswerSchema | None = None) -> list[str]:
    """TABLE_COLUMNS, then one image and original_image column per later picture and a context column where some
    sample has them (before `label`, which stays last: the column a person fills; under an answer schema, one
    column per field in its place)."""
    n = max((1 + len(it.more) for it in items), default=1)
    more = [c for k in image_keys(n)[1:] for c in (k, f"original_{k}")]
    more += ["context"] if any(it.context for it in items) else []
    return [*TABLE_COLUMNS[:-1], *more, *(label_columns(schema) if schema is not None else TABLE_COLUMNS[-1:])]


class CsvExporter(Exporter):
    name = "csv"

    def write(self, items: Sequence[ExportItem], out_dir: Path) -> list[str]:
        # Formula-like cells (a file named =HYPERLINK(…), an open answer starting with -) get a leading ' so a
        # spreadsheet shows them as text; the label import takes it off again (pipeline/csvcells.py).
        atomic_write_text(out_dir / CSV_FILE, csv_text(table_columns(items, self.ctx.schema),
                                                      _table_rows(items, self.ctx.schema)))
        return [CSV_FILE]


class JsonlExporter(Exporter):
    name = "jsonl"

    def write(self, items: Sequence[ExportItem], out_dir: Path) -> list[str]:
        text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in _table_rows(items, self.ctx.schema))
        atomic_write_text(out_dir / JSONL_FILE, text)
        return [JSONL_FILE]


class ImagesExporter(Exporter):
    name = "images"

    def write(self, items: Sequence[ExportItem], out_dir: Path) -> list[str]:
        # Swapped in as a whole so images of an earlier, different selection never linger beside the new ones.
        with atomic_dir(out_dir / IMAGES_DIR) as tmp:
            for name, data in (pic for it in items for pic in it.images()):
                target = (tmp / name).resolve()
                if target.parent != tmp.resolve():
                    raise ExportError(f"{name!r} would be written outside {out_dir / IMAGES_DIR}")
                target.write_bytes(data)
        return [IMAGES_DIR]


EXPORTERS: dict[str, type[Exporter]] = {
    c.name: c for c in (LabelStudioExporter, CsvExporter, JsonlExporter, ImagesExporter)
}

_EXT = {"JPEG": "jpg", "PNG": "png", "GIF": "gif", "BMP": "bmp", "TIFF": "tif", "WEBP": "webp"}
LEGIBLE_MAX_SIDE = 2048  # annotate.export_images: legible re-encodes only originals larger than this


def legible_image(data: bytes, sample_id: str) -> tuple[bytes, str]:
    """(bytes, extension) of an original image for people: the file as it came when its long side is at most
    LEGIBLE_MAX_SIDE (a 4000-px photo would make Label Studio slow), else downscaled to that side (JPEG quality 90,
    PNG when it has transparency or was a PNG), EXIF rotation applied. Never upscaled: a small original stays its size."""
    from PIL import ImageOps

    ext = _image_ext(data, sample_id)
    with Image.open(io.BytesIO(data)) as im:
        if max(im.size) <= LEGIBLE_MAX_SIDE:
            return data, ext
        img = ImageOps.exif_transpose(im)
        img.thumbnail((LEGIBLE_MAX_SIDE, LEGIBLE_MAX_SIDE), Image.Resampling.LANCZOS)
        png = im.format == "PNG" or img.mode in ("RGBA", "LA", "P")
        buf = io.BytesIO()
        if png:
            img.save(buf, format="PNG")
        else:
            img.convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue(), "png" if png else "jpg"


def _image_ext(data: bytes, sample_id: str) -> str:
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format or ""
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the same user-facing fault
        raise ExportError(f"sample {sample_id}: image bytes are not a readable image ({exc}); re-run prepare") from None
    return _EXT.get(fmt, fmt.lower() or "bin")


def _document_relpath(out_dir: Path, annotate: AnnotateConfig, artifacts: Path) -> str:
    root = annotate.document_root
    out = out_dir.resolve()
    if root is None:
        artifacts = Path(artifacts).resolve()
        root = artifacts if out.is_relative_to(artifacts) and out != artifacts else out.parent
    root = Path(root).resolve()
    # Label Studio serves only from a strict sub-folder of its document root.
    if not out.is_relative_to(root) or out == root:
        raise ExportError(
            f"export folder {out} is not inside annotate.document_root {root}; Label Studio can serve local files "
            "only from a sub-folder of LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT: set annotate.document_root to a "
            "folder above the export"
        )
    return out.relative_to(root).as_posix()


def build_items(
    selection_rows: Sequence[Mapping[str, Any]], dataset: Any, *, image_source: str
) -> list[ExportItem]:
    """Join selection rows with their dataset rows (by sample_id), in rank order."""
    rows = sorted(selection_rows, key=lambda r: (r.get("rank", 0), str(r.get("sample_id"))))
    seen: set[str] = set()
    for i, r in enumerate(rows):
        sid = check_sample_id(r.get("sample_id"), f"selection row {i}: ")
        if sid in seen:
            raise ExportError(f"selection row {i}: sample_id {sid} appears twice; re-run the select stage")
        seen.add(sid)
    image_col = "prepared" if image_source == "prepared" else "image"
    if image_col not in dataset.column_names:
        other = "original" if image_col == "prepared" else "prepared"
        raise ExportError(
            f"dataset has no {image_col!r} column (columns: {', '.join(dataset.column_names)}); run prepare first or "
            f"set annotate.export_images: {other}"
        )
    wanted = [r["sample_id"] for r in rows]
    at = IdIndex.of_dataset(dataset).rows(wanted)
    missing = [sid for sid, i in zip(wanted, at, strict=True) if i < 0]
    if missing:
        raise ExportError(
            f"{len(missing)} of {len(rows)} selected samples are not in the dataset (first: {sorted(missing)[0]}); "
            "the selection is from another dataset version: re-run the select stage"
        )
    cols = ["sample_id", "question", image_col] + (["image_path"] if "image_path" in dataset.column_names else [])
    cols += [c for c in ("more_images", "more_prepared", "context") if c in dataset.column_names]
    sub = dataset.select_columns(cols).select(at.tolist())
    items = []
    for r, d in zip(rows, sub, strict=True):
        data, ext = _exported_image(d[image_col], r["sample_id"], image_source)
        items.append(
            ExportItem(
                sample_id=r["sample_id"],
                rank=int(r.get("rank", 0)),
                score=float(r.get("score") or 0.0),
                question=d["question"] or "",
                image_bytes=data,
                image_ext=ext,
                prediction=r.get("prediction"),
                confidence=None if r.get("confidence") is None else float(r["confidence"]),
                scores={k: float(v) for k, v in sorted((r.get("scores") or {}).items())},
                original_name=os.path.basename(d.get("image_path") or ""),
                more=_more_images(d, image_source),
                context=tuple((c["role"], c["text"]) for c in d.get("context") or []),
            )
        )
    return items


def _exported_image(data: bytes, sample_id: str, image_source: str) -> tuple[bytes, str]:
    """(bytes, extension) of a picture as annotate.export_images asks: prepared PNG, legible, or the original."""
    if image_source == "legible":
        return legible_image(data, sample_id)
    return data, _image_ext(data, sample_id) if image_source == "original" else "png"


def _more_images(d: Mapping[str, Any], image_source: str) -> tuple[tuple[bytes, str, str], ...]:
    """A dataset row's later pictures as the first is exported (prepared or original), with their file names."""
    originals = d.get("more_images") or []
    sources = d.get("more_prepared") if image_source == "prepared" else [m["image"] for m in originals]
    return tuple((*_exported_image(data, d["sample_id"], image_source), os.path.basename(m["image_path"] or ""))
                 for data, m in zip(sources or [], originals, strict=True))


def export_selection(
    selection_rows: Sequence[Mapping[str, Any]],
    dataset: Any,
    annotate: AnnotateConfig,
    answers: Sequence[str] | None,
    artifacts: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    round_index: int,
    schema: AnswerSchema | None = None,
) -> Manifest:
    """Write every format in annotate.formats into out_dir, then the manifest (last, so it marks completion).
    `answers`: data.answers (None for open answers); `artifacts`: where the document root defaults to; `schema`:
    data.answer_schema's (one control and one column per field)."""
    out_dir = Path(out_dir)
    answers = list(answers) if answers is not None else None
    formats = list(dict.fromkeys(annotate.formats))
    if "label_studio" in formats and "images" not in formats:
        log.warning("Label Studio tasks point at %s/, but annotate.formats does not export the images", IMAGES_DIR)
    items = build_items(selection_rows, dataset, image_source=annotate.export_images)
    adapters = {r.get("adapter_digest") for r in selection_rows} - {None}
    ctx = ExportContext(
        round_index=round_index,
        answers=answers,
        image_url_prefix=annotate.image_url_prefix,
        export_relpath=_document_relpath(out_dir, annotate, Path(artifacts)),
        model_version=f"adapter-{sorted(adapters)[0][:12]}" if len(adapters) == 1 else "tamis",
        schema=schema,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, str] = {}
    for name in formats:
        for rel in EXPORTERS[name](ctx).write(items, out_dir):
            outputs[rel] = rel
    config = {"annotate": annotate.model_dump(mode="json"), "answers": answers,
              **({"answer_schema": schema.raw} if schema is not None else {})}
    strategies = sorted({str(r.get("strategy")) for r in selection_rows if r.get("strategy")})
    log.info("Exported %d samples of round %d to %s (%s)", len(items), round_index, out_dir, ", ".join(formats))
    return write_manifest(
        out_dir,
        stage="export",
        stage_version=EXPORT_VERSION,
        inputs={"selection": digest_json([dict(r) for r in selection_rows]),
                "images": digest_json([(name, digest_bytes(data)) for it in items for name, data in it.images()])},
        config=config,
        outputs=outputs,
        info={"round": round_index, "count": len(items), "strategies": strategies},
    )


def exported_sample_ids(artifacts: str | os.PathLike[str], *, before_round: int | None = None,
                        since_round: int = 0) -> set[str]:
    """Every sample_id tamis has sent out for labeling (any round, any task set under rounds/), or with
    `before_round` only the round exports (rounds/NNN/export/) of the rounds before it (from `since_round` on)."""
    rounds = Path(artifacts) / ROUNDS_DIR
    if before_round is None:
        files = sorted(rounds.rglob(TASKS_FILE)) if rounds.is_dir() else []
    else:
        files = [round_dir(artifacts, r, "export", TASKS_FILE) for r in range(since_round, before_round)]
    ids: set[str] = set()
    for p in files:
        if not p.is_file():
            continue
        try:
            tasks = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ExportError(f"{p}: unreadable export ({exc}); re-run the export of that round") from None
        ids.update(t["data"]["sample_id"] for t in tasks if isinstance(t, dict) and "sample_id" in t.get("data", {}))
    return ids


@dataclass(frozen=True)
class ExportParams:
    """The export stage's parameters, built by export_params; its cache key is their `key_fields()`."""

    artifacts: str
    selection: StageRef  # the select stage's output
    prepared: StageRef  # the prepared data (the images exported)
    annotate: dict[str, Any]  # the annotate section as JSON data
    answers: list[str] | None
    round_index: int
    out_dir: str
    # A box project (data.task: boxes): its class list, and the model section whose family's codec reads the boxes
    box_labels: list[str] | None = None
    model: dict[str, Any] | None = None
    answer_schema: dict[str, Any] | None = None  # data.answer_schema as written (its content keys the export)


def export_params(annotate: AnnotateConfig, answers: Sequence[str] | None, *, artifacts: str | os.PathLike[str],
                  selection: Mapping[str, Any], prepared: StageRef | Mapping[str, Any], round_index: int,
                  box_labels: Sequence[str] | None = None, model: ModelConfig | None = None,
                  schema: AnswerSchema | None = None) -> ExportParams:
    """The export stage's parameters for round `round_index`'s selection (the select and prepare stages' results),
    written into the round's export folder; a box project passes its class list and model section (ModelConfig), a
    project of structured answers its schema (data.schema)."""
    boxes = {} if box_labels is None or model is None else {"box_labels": list(box_labels),
                                                             "model": model.model_dump(mode="json")}
    return ExportParams(artifacts=str(artifacts), selection=StageRef.of(selection), prepared=StageRef.of(prepared),
                        annotate=annotate.model_dump(mode="json"), answers=None if answers is None else list(answers),
                        round_index=round_index, out_dir=str(export_dir(Path(artifacts), round_index)), **boxes,
                        answer_schema=None if schema is None else schema.raw)


def export_stage(params: ExportParams) -> dict[str, Any]:
    """The export stage: the round's selection written for annotators into `params.out_dir`, in every configured
    format."""
    from pipeline.preprocess import load_prepared
    from pipeline.store import read_jsonl

    rows = read_jsonl(Path(params.selection.dir) / "selection.jsonl")
    if params.box_labels is not None:
        m = _export_boxes(params, rows)
        return {"dir": params.out_dir, "digest": m.key, "count": m.info["count"]}
    m = export_selection(rows, load_prepared(params.prepared.dir), AnnotateConfig.model_validate(params.annotate),
                         params.answers, params.artifacts, params.out_dir, round_index=params.round_index,
                         schema=None if params.answer_schema is None else schema_of(params.answer_schema))
    return {"dir": params.out_dir, "digest": m.key, "count": m.info["count"]}


def _export_boxes(params: ExportParams, rows: list[dict[str, Any]]) -> Manifest:
    """A box project's export (pipeline/annotation/box_export.py); the family's codec is resolved only when the
    selection carries the model's answers (none at the cold start)."""
    from pipeline.annotation.box_export import export_box_selection
    from pipeline.model.box_frames import training_codec
    from pipeline.preprocess import load_prepared

    for i, r in enumerate(rows):
        check_sample_id(r.get("sample_id"), f"selection row {i}: ")
    codec, frame = training_codec(ModelConfig.model_validate(params.model)) if any(
        r.get("prediction") for r in rows) else (None, None)
    annotate = AnnotateConfig.model_validate(params.annotate)
    relpath = _document_relpath(Path(params.out_dir), annotate, Path(params.artifacts))
    return export_box_selection(rows, load_prepared(params.prepared.dir), annotate, params.box_labels or [],
                                params.out_dir, round_index=params.round_index, codec=codec, frame=frame,
                                relpath=relpath, stage_version=EXPORT_VERSION)
