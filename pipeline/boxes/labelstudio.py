"""Boxes out to annotators in Label Studio and back: the labeling config with RectangleLabels, and an annotation's
result turned into the ledger's box label (a prediction the annotator corrected comes back as the label)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.boxes.answer import box_label
from pipeline.boxes.readers import rectangle_boxes
from pipeline.errors import DataError

# The tag names of tamis's labeling configs (pipeline/annotation/export.py uses the same for choices and text).
FROM_NAME, TO_NAME = "answer", "image"


def box_label_config(labels: Sequence[str], *, question: bool = True) -> str:
    """The labeling interface for box labels: the image, the question (when the tasks carry one), and
    RectangleLabels with one Label per class. Rotation is switched off: tamis reads axis-aligned boxes only."""
    if not labels or len(set(labels)) != len(labels):
        raise DataError(f"box labeling config: the class list must be non-empty with no repeats, got {list(labels)}; "
                        "set data.answers to the class names")
    view = ET.Element("View")
    ET.SubElement(view, "Image", name=TO_NAME, value="$image", zoom="true")
    if question:
        ET.SubElement(view, "Text", name="question", value="$text")
    rect = ET.SubElement(view, "RectangleLabels", name=FROM_NAME, toName=TO_NAME, canRotate="false")
    for label in labels:
        ET.SubElement(rect, "Label", value=label)
    ET.indent(view)
    return ET.tostring(view, encoding="unicode") + "\n"


def label_from_annotation(annotation: Mapping[str, Any], labels: Sequence[str], *, where: str = "annotation") -> str:
    """The ledger's box label for one Label Studio annotation (its RectangleLabels regions: the boxes the annotator
    drew, or the model's predicted boxes as the annotator left or corrected them). An annotation with no region is
    the label "[]" (the image holds none of the classes). A region that cannot be read, or a class outside
    `labels`, refuses the whole annotation: a label with a box silently dropped would be a wrong label."""
    result = annotation.get("result")
    if not isinstance(result, list):
        raise DataError(f"{where}: no result list; export the project as JSON")
    boxes, problems = rectangle_boxes(result)
    if problems:
        raise DataError(f"{where}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    unknown = sorted({b.label for b in boxes} - set(labels))
    if unknown:
        raise DataError(f"{where}: classes {unknown} are not in the class list {list(labels)}; fix the labeling "
                        "config or add them to data.answers")
    return box_label(boxes)
