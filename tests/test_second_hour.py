"""Issue 47's "done when": a team's second hour, as a user runs it. `tamis init` on a flat folder of letter tiles with
a test CSV `file,letter`, then three rounds; between them the team labels each batch in a table of its own
(`file,letter`, lower case, as typed) and drops it into artifacts/inbox/. No config or label file is edited by hand
for tamis: the answer column and the case are read as the team wrote them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from pipeline.annotation.ledger import Ledger, ledger_path

TAMIS = Path(sys.executable).parent / "tamis"
LETTERS = "ABCDEF"


def _tile(letter: str, rng: np.random.Generator) -> Image.Image:
    """A 48×48 tile: the letter in black at a random place on a random light background, with noise (no two alike)."""
    bg = tuple(int(c) for c in rng.integers(150, 255, 3))
    im = Image.new("RGB", (48, 48), bg)
    ImageDraw.Draw(im).text((int(rng.integers(4, 28)), int(rng.integers(4, 28))), letter, fill=(0, 0, 0),
                            font=ImageFont.load_default(size=18))
    noisy = np.asarray(im, dtype=np.int16) + rng.integers(-12, 13, (48, 48, 3))
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def letter_project(root: Path, per_class: int = 5, test_per_class: int = 2) -> tuple[Path, Path, dict[str, str]]:
    """(pool folder, test CSV `file,letter`, each pool file's letter: the team's knowledge, not tamis's)."""
    rng = np.random.default_rng(47)
    pool, test = root / "tiles", root / "test"
    pool.mkdir(parents=True)
    test.mkdir()
    truth, rows = {}, [["file", "letter"]]
    for letter in LETTERS:
        for i in range(per_class):
            name = f"tile_{letter.lower()}{i:02d}.png"
            _tile(letter, rng).save(pool / name)
            truth[name] = letter
        for i in range(test_per_class):
            _tile(letter, rng).save(test / f"test_{letter.lower()}{i}.png")
            rows.append([f"test_{letter.lower()}{i}.png", letter])
    with (test / "labels.csv").open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    return pool, test / "labels.csv", truth


def _round(tmp_path: Path, env: dict[str, str]) -> str:
    run = subprocess.run([str(TAMIS), "round", "-c", "tamis.yaml"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _label_batch(art: Path, round_index: int, truth: dict[str, str]) -> Path:
    """The team's answers for a round's batch, in its own table: the file name and the letter, lower case."""
    with (art / "rounds" / f"{round_index:03d}" / "export" / "annotate.csv").open(newline="") as f:
        names = [r["original_image"] for r in csv.DictReader(f)]
    assert names, f"round {round_index} exported nothing"
    out = art / "inbox" / f"letters-round-{round_index}.csv"
    out.write_text("file,letter\n" + "".join(f"{n},{truth[n].lower()}\n" for n in names))
    return out


@pytest.mark.slow
def test_init_then_three_rounds_with_lower_case_labels_in_a_letter_column(tmp_path, tiny_models, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    pool, test, truth = letter_project(tmp_path / "data")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    init = subprocess.run([str(TAMIS), "init", str(pool), "--test", str(test), "--model", str(tiny_models["idefics3"])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert init.returncode == 0, init.stdout + init.stderr
    art = tmp_path / "artifacts"

    _round(tmp_path, env)  # round 0: the first batch, before any model
    labeled = set()
    for r in (1, 2):
        sent = _label_batch(art, r - 1, truth)
        if r == 1:  # a teammate's typo in a file of their own: named, with its line and where the full list is
            spare = next(n for n in sorted(truth) if n not in sent.read_text())
            (art / "inbox" / "typos.csv").write_text(f"file,letter\n{spare},q\n")
        out = _round(tmp_path, env)
        state = json.loads((art / "rounds" / f"{r:03d}" / "round.json").read_text())
        [imp] = [i for i in state["imports"] if i["file"] == str(sent)]
        # Every row landed: the letter column read as the answers, 'a' as 'A', nothing rejected.
        assert imp["rejected"] == 0 and imp["accepted"] == len(sent.read_text().splitlines()) - 1
        assert "answers read from column 'letter'" in imp["summary"] and "mapped" in imp["summary"]
        assert f"typos.csv:2: label 'q' is not in the answer set [{', '.join(LETTERS)}]" in " ".join(out.split())
        assert f"full list: {art / 'rejections'}" in " ".join(out.split())
        labeled |= {line.split(",")[0] for line in sent.read_text().splitlines()[1:]}
        assert state["round"] == r and state["labeled"] == len(labeled) and state["metrics"]
    assert set(Ledger(ledger_path(art)).labels().values()) <= set(LETTERS)  # stored as declared: upper case
    assert (art / "rounds" / "002" / "round.json").is_file()
    status = subprocess.run([str(TAMIS), "status", "-c", "tamis.yaml"], cwd=tmp_path, env={**env, "COLUMNS": "400"},
                            capture_output=True, text=True, timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"1 rejected label rows, see {art / 'rejections'}" in status.stdout
