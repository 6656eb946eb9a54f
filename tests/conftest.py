"""Shared test set-up. Environment first: Prefect and albumentations read it when they are imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="tamis-prefect-"))
os.environ.update(
    {
        "PREFECT_HOME": str(_PREFECT_HOME),
        "PREFECT_LOCAL_STORAGE_PATH": str(_PREFECT_HOME / "results"),
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",  # as flows/settings.py sets it for a project
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (it takes 20-36 s to start here)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# --- shared fixtures below; each area appends its own under a heading ---


# --- annotation: a small prepared dataset with generated images and its held-back ground truth ---
def make_tiny_vqa(root: Path, n: int = 12, *, open_answers: bool = False):
    """(datasets.Dataset with the prepared-schema columns, ground-truth JSONL path). IDs s000…, answers i % 10."""
    import io
    import json

    from datasets import Dataset
    from PIL import Image

    rows, gt = [], []
    for i in range(n):
        im = Image.new("RGB", (10 + i, 12), ((37 * i) % 256, (91 * i) % 256, 128))
        jpg, png = io.BytesIO(), io.BytesIO()
        im.save(jpg, format="JPEG")
        im.resize((12, 12)).save(png, format="PNG")
        answer = f"a photo of {i % 10}" if open_answers else str(i % 10)
        name = f"img_{i:03d}.jpg"
        rows.append({
            "sample_id": f"s{i:03d}", "image": jpg.getvalue(), "image_path": str(root / "src" / name),
            "question": "Which digit is shown?", "answer": None, "split": "pool", "prepared": png.getvalue(),
        })
        gt.append({"sample_id": f"s{i:03d}", "image": name, "answer": answer})
    gt_path = root / "ground_truth.jsonl"
    gt_path.parent.mkdir(parents=True, exist_ok=True)
    gt_path.write_text("".join(json.dumps(r) + "\n" for r in gt), encoding="utf-8")
    return Dataset.from_list(rows), gt_path


@pytest.fixture
def make_vqa(tmp_path):
    """Factory: make_vqa(n=12, open_answers=False) → (dataset, ground-truth path) under tmp_path/vqa."""
    return lambda n=12, open_answers=False: make_tiny_vqa(tmp_path / "vqa", n, open_answers=open_answers)


# --- prepare stage (preprocess / quality / augment) ---
@pytest.fixture
def image_dataset():
    """Build an ingested-schema `datasets.Dataset` from images (PIL images or encoded bytes).

    `image_dataset(images, answers=None, splits=None, questions=None)`; answers default to None (pool rows).
    """
    import io

    import datasets
    from PIL import Image

    from pipeline.schema import sample_id_for

    def build(images, answers=None, splits=None, questions=None):
        rows = []
        for i, im in enumerate(images):
            if isinstance(im, Image.Image):
                buf = io.BytesIO()
                im.save(buf, "PNG")
                data, (w, h), mode = buf.getvalue(), im.size, im.mode
            else:
                data, w, h, mode = im, 0, 0, ""
            q = questions[i] if questions else "What is shown in the image?"
            a = answers[i] if answers else None
            rows.append({
                "sample_id": sample_id_for(data, q), "image": data, "image_path": f"/data/img{i}.png", "question": q,
                "answer": a, "split": splits[i] if splits else ("train" if a else "pool"), "source": f"test:{i}",
                "sources": [f"test:{i}"], "width": w, "height": h, "mode": mode,
            })
        features = datasets.Features({
            "sample_id": datasets.Value("string"), "image": datasets.Value("binary"),
            "image_path": datasets.Value("string"), "question": datasets.Value("string"),
            "answer": datasets.Value("string"), "split": datasets.Value("string"), "source": datasets.Value("string"),
            "sources": datasets.List(datasets.Value("string")), "width": datasets.Value("int32"),
            "height": datasets.Value("int32"), "mode": datasets.Value("string"),
        })
        return datasets.Dataset.from_list(rows, features=features)

    return build


# --- model: one tiny random-weight checkpoint per family, built on first use per session (about a second each) ---
class _TinyModels(dict):
    """{family: checkpoint folder} for every registered family (32-px images, 4 image tokens); a family's model is
    built the first time a test asks for it, so a test of one family does not pay for the others."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        from pipeline.model.families import FAMILIES
        from pipeline.model.tiny import make_tiny_model

        if family not in FAMILIES:
            raise KeyError(family)
        self[family] = path = make_tiny_model(family, self.root / family)
        return path

    def _all(self) -> _TinyModels:
        from pipeline.model.families import FAMILIES

        for family in FAMILIES:
            self[family]  # noqa: B018 - builds it
        return self

    # Iterating means every family: build the rest first.
    def __iter__(self):
        return dict.__iter__(self._all())

    def items(self):
        return dict.items(self._all())

    def values(self):
        return dict.values(self._all())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return _TinyModels(tmp_path_factory.mktemp("tiny-models"))


# --- every slow test has a time limit (pytest-timeout); a test that hangs fails instead of holding up a run ---
SLOW_TIMEOUT_S = 3600  # the demo test took 1,847 s on this 2-core machine under load 11-17; a hang is far longer


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
