"""Every bad input a user can produce, held to one contract.

(a) a clear message naming the file / line / field at fault, (b) nothing written outside the project's artifacts
folder (the user's folders are snapshotted before and after), (c) the books balance: for ingestion
ingested + quarantined + duplicates == rows in the input, for labels accepted + rejected + skipped == label rows.

Finer per-module cases live in test_readers / test_ingest / test_labels / test_config; this module is the one place
that runs all of them through the public entry points and checks the common contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from test_ingest import encode, png, write_manifest
from test_labels import _ann, _task

from pipeline.annotation.labels import import_labels
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.config import ProjectConfig, load_config, parse_config
from pipeline.data.ingest import ingest, load_ingested
from pipeline.errors import ConfigError, DataError, LabelImportError
from pipeline.preprocess import decode_rgb
from pipeline.store import digest_file, read_jsonl

Q = "Which digit is shown?"
DIGITS = [str(i) for i in range(10)]


# ------------------------------------------------------------------------------------------------ harness
def snapshot(root: Path, skip: Path) -> dict[str, str]:
    """Everything under `root` except `skip`: file digests, link targets, folders (links are not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            p = here / name
            rel = p.relative_to(root).as_posix()
            out[rel] = "link:" + os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else digest_file(p)
    return out


@dataclass
class Project:
    """A user's project: data/ and labels/ are theirs, artifacts/ is tamis's; outside/ sits beside the project."""

    tmp: Path
    root: Path
    data: Path
    outside: Path

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def untouched(self) -> Callable[[], None]:
        """Take a snapshot now; the returned check fails if anything outside artifacts/ changed since."""
        before = snapshot(self.tmp, self.artifacts)

        def check() -> None:
            after = snapshot(self.tmp, self.artifacts)
            changed = {k for k in before.keys() & after.keys() if before[k] != after[k]}
            assert (after.keys() - before.keys(), before.keys() - after.keys(), changed) == (set(), set(), set())

        return check


@pytest.fixture
def project(tmp_path, monkeypatch) -> Project:
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "labels").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.png").write_bytes(png(201, (5, 5)))
    monkeypatch.chdir(root)  # a stray relative-path write would land in the project and show in the snapshot
    return Project(tmp_path, root, root / "data", tmp_path / "outside")


# ------------------------------------------------------------------------------------------------ ingestion
@dataclass
class IngestCase:
    sources: list[dict[str, Any]]
    rows: int  # rows (or image files) in the input, counted by the test itself
    quarantined: dict[str, str] = field(default_factory=dict)  # basename of the row's source → words of its reason
    duplicates: int = 0
    error: str | None = None  # a source unusable as a whole: words the DataError must contain
    data: dict[str, Any] = field(default_factory=dict)
    check: Callable[[list[dict[str, Any]], Project], None] | None = None


def jsonl(d: Path, rows: list[dict[str, Any]], name: str = "m.jsonl") -> dict[str, Any]:
    write_manifest(d / name, rows)
    return {"kind": "jsonl", "path": str(d / name)}


def csv_source(d: Path, data: bytes | str, name: str = "m.csv") -> dict[str, Any]:
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return {"kind": "csv", "path": str(d / name)}


def noise_image(fmt: str) -> bytes:
    return encode(Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8)), fmt)


def _corrupt_chunk() -> bytes:
    data = bytearray(noise_image("PNG"))
    data[data.find(b"IDAT") + 20] ^= 0xFF
    return bytes(data)


# Broken images: quarantined with a reason a person can act on.
BROKEN = {
    "zero.png": (lambda: b"", "empty file (0 bytes)"),
    "garbage.png": (lambda: b"this is not an image at all" * 20, "not a decodable image"),
    "truncated.png": (lambda: noise_image("PNG")[:400], "corrupt or truncated image"),
    "truncated.jpg": (lambda: noise_image("JPEG")[:-2], "image file is truncated"),
    "bad_chunk.png": (_corrupt_chunk, "corrupt or truncated image"),
    "bomb.png": (lambda: png(1, (200, 200)), "200×200 = 40,000 pixels exceeds data.max_image_pixels = 10,000"),
}


def _rotated() -> bytes:
    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90° clockwise: red on top, blue below, 20 wide × 40 high
    return encode(im, "JPEG", exif=exif.tobytes(), quality=95)


def _palette() -> bytes:
    im = Image.new("P", (7, 7), 3)
    im.putpalette([i % 256 for i in range(768)])  # index 3 → (9, 10, 11)
    return encode(im)


def _rgba() -> bytes:
    im = Image.new("RGBA", (3, 3), (255, 0, 0, 0))
    im.putpixel((1, 1), (0, 0, 255, 255))
    return encode(im)


# Odd but valid images: ingested with their original bytes, and decoded to the right RGB pixels downstream.
# name → (bytes, mode, (width, height) as displayed, {(y, x): expected RGB after decode_rgb})
ODD = {
    "wrong_ext.jpg": (lambda: png(77, (5, 5)), "L", (5, 5), {(2, 2): (77, 77, 77)}),
    "cmyk.jpg": (lambda: encode(Image.new("CMYK", (6, 6), (0, 255, 255, 0)), "JPEG", quality=95), "CMYK", (6, 6),
                 {(3, 3): (255, 0, 0)}),
    "16bit.png": (lambda: encode(Image.new("I;16", (5, 4), 40000)), "I;16", (5, 4), {(1, 1): (156, 156, 156)}),
    "palette.png": (_palette, "P", (7, 7), {(3, 3): (9, 10, 11)}),
    "rgba.png": (_rgba, "RGBA", (3, 3), {(0, 0): (255, 255, 255), (1, 1): (0, 0, 255)}),
    "exif_rotated.jpg": (_rotated, "RGB", (20, 40), {(2, 10): (255, 0, 0), (37, 10): (0, 0, 255)}),
}


def _image_case(name: str) -> Callable[[Path], IngestCase]:
    def build(d: Path) -> IngestCase:
        (d / "imgs").mkdir()
        make = (BROKEN.get(name) or ODD[name])[0]
        (d / "imgs" / name).write_bytes(make())
        (d / "imgs" / "control.png").write_bytes(png(5))
        src = jsonl(d, [{"image": f"imgs/{name}", "answer": "1"}, {"image": "imgs/control.png", "answer": "2"}])
        if name in BROKEN:
            return IngestCase([src], 2, {"m.jsonl:1": BROKEN[name][1]}, data={"max_image_pixels": 10_000})

        def check(rows: list[dict[str, Any]], p: Project) -> None:
            _, mode, size, pixels = ODD[name]
            row = next(r for r in rows if r["answer"] == "1")
            assert row["image"] == (p.data / "imgs" / name).read_bytes()  # kept as given, not re-encoded
            assert (row["mode"], (row["width"], row["height"])) == (mode, size)
            for longest in (None, 64):  # the full decode and the reduced-size decode preprocessing uses
                rgb = decode_rgb(row["image"], max_pixels=10_000, longest=longest)
                assert rgb.shape == (size[1], size[0], 3)
                for (y, x), want in pixels.items():
                    assert np.abs(rgb[y, x].astype(int) - want).max() <= 3, (name, longest, (y, x), rgb[y, x])

        return IngestCase([src], 2, data={"max_image_pixels": 10_000}, check=check)

    return build


def case_csv_missing_columns(d: Path) -> IngestCase:
    src = csv_source(d, "picture,question\nx.png,q\n")
    return IngestCase([src], 1, error="m.csv: column(s) ['image'] not found; columns found: ['picture', 'question']")


def case_jsonl_missing_field(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    src = jsonl(d, [{"image": "a.png"}, {"picture": "a.png", "question": "Other?"}])
    return IngestCase([src], 2, {"m.jsonl:2": "no image: field 'image' is missing (fields present: "
                                              "['picture', 'question'])"})


def case_csv_bom(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    src = csv_source(d, b"\xef\xbb\xbf" + b"image,question,answer\r\na.png,Which?,3\r\n")

    def check(rows: list[dict[str, Any]], p: Project) -> None:
        assert [(r["question"], r["answer"]) for r in rows] == [("Which?", "3")]

    return IngestCase([src], 1, check=check)


def case_jsonl_bom(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    (d / "m.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"image": "a.png", "answer": "4"}).encode() + b"\n")

    def check(rows: list[dict[str, Any]], p: Project) -> None:
        assert [r["answer"] for r in rows] == ["4"]

    return IngestCase([{"kind": "jsonl", "path": str(d / "m.jsonl")}], 1, check=check)


def case_csv_quoted_newlines(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    src = csv_source(d, 'image,question\na.png,"Which digit\nis shown, here?"\nmissing.png,q\n')

    def check(rows: list[dict[str, Any]], p: Project) -> None:
        assert [(r["question"], r["source"].rsplit("/", 1)[1]) for r in rows] == [
            ("Which digit\nis shown, here?", "m.csv:2")]

    # The second record starts on line 4: the quoted newline does not shift the line it is reported on.
    return IngestCase([src], 2, {"m.csv:4": "file not found"}, check=check)


def case_csv_unclosed_quote(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    src = csv_source(d, 'image,question\na.png,ok\na.png,"never closed\na.png,swallowed?\n')
    return IngestCase([src], 3, error="m.csv:3: not valid CSV (unexpected end of data)")


def case_csv_oversized_cell(d: Path) -> IngestCase:
    """A 200,000-character cell is its row's problem, not the file's (csv's 128 kB field limit used to refuse the
    whole file): that row is quarantined as a question no prompt holds, the other row is read."""
    (d / "a.png").write_bytes(png(2))
    src = csv_source(d, 'image,question\na.png,ok\na.png,"' + "x" * 200_000 + '"\n')
    return IngestCase([src], 2, {"m.csv:3": "question is 200,000 characters, over the 4,000 a prompt holds"})


def case_csv_not_utf8(d: Path) -> IngestCase:
    src = csv_source(d, b"image,question\na.png,ok\nb.png,caf\xe9\n")
    return IngestCase([src], 2, error="m.csv:3: not UTF-8 text (byte 0xe9")


def case_jsonl_not_utf8_and_bad_json(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    lines = [json.dumps({"image": "a.png"}).encode(), b'{"image": "caf\xe9.png"}', b'{"image": "a.png",', b"[1, 2]"]
    (d / "m.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return IngestCase([{"kind": "jsonl", "path": str(d / "m.jsonl")}], 4, {
        "m.jsonl:2": "line is not UTF-8", "m.jsonl:3": "line is not valid JSON", "m.jsonl:4": "expected an object"})


def case_duplicate_ids_and_rows(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    (d / "a_copy.png").write_bytes(png(1))  # same bytes under another name: the same sample ID
    (d / "b.png").write_bytes(png(2))
    src = jsonl(d, [{"image": "a.png", "question": Q, "answer": "1"}, {"image": "a.png", "question": Q, "answer": "1"},
                    {"image": "a_copy.png", "question": Q, "answer": "7"}, {"image": "b.png", "question": Q}])
    other = csv_source(d, f"image,question\nb.png,{Q}\n")

    def check(rows: list[dict[str, Any]], p: Project) -> None:
        assert sorted(len(r["sources"]) for r in rows) == [2, 3]  # every copy is traced to its first row
        dups = read_jsonl(p.artifacts / "ingest" / "duplicates.jsonl")
        assert [d["duplicate"].rsplit("/", 1)[1] for d in dups] == ["m.jsonl:2", "m.jsonl:3", "m.csv:2"]
        assert [d.get("conflict") for d in dups] == [None, "answer '1' kept, '7' dropped", None]

    return IngestCase([src, other], 5, duplicates=3, check=check)


def case_path_escapes_with_dotdot(d: Path) -> IngestCase:
    (d / "sub").mkdir()
    src = jsonl(d, [{"image": "../../outside/secret.png"}, {"image": "sub/../../../outside/secret.png"}])
    return IngestCase([src], 2, {"m.jsonl:1": "image path '../../outside/secret.png' escapes the dataset root",
                                 "m.jsonl:2": "move the image under the root or add its folder to data.allowed_roots"})


def case_absolute_path_outside_allowed_roots(d: Path) -> IngestCase:
    outside, shared = d.parent.parent / "outside", d.parent / "shared"
    shared.mkdir()
    (shared / "ok.png").write_bytes(png(9))
    src = jsonl(d, [{"image": str(outside / "secret.png")}, {"image": "/etc/hostname"}, {"image": str(shared / "ok.png")}])
    # allowed_roots widens what a manifest may reach, and only by the folders it names.
    return IngestCase([src], 3, {"m.jsonl:1": f"image path '{outside / 'secret.png'}' escapes the dataset root",
                                 "m.jsonl:2": "escapes the dataset root"}, data={"allowed_roots": [str(shared)]})


def case_symlinks_out_of_the_root(d: Path) -> IngestCase:
    outside = d.parent.parent / "outside"
    (d / "link.png").symlink_to(outside / "secret.png")
    (d / "ok.png").write_bytes(png(3))
    (d / "cls").mkdir()
    (d / "cls" / "linked.png").symlink_to(outside / "secret.png")
    (d / "cls" / "linked_dir").symlink_to(outside)
    (d / "cls" / "fine.png").write_bytes(png(4))
    man = jsonl(d, [{"image": "link.png"}, {"image": "ok.png"}])
    folder = {"kind": "folder", "path": str(d / "cls")}
    return IngestCase([man, folder], 5, {
        "m.jsonl:1": f"escapes the dataset root (a symlink resolving to {outside / 'secret.png'})",
        "linked.png": "a symlink resolving to", "linked_dir": "symlinked folder is not followed"})


def case_nul_byte_in_path(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    src = jsonl(d, [{"image": "a\u0000.png"}, {"image": "a.png"}])
    return IngestCase([src], 2, {"m.jsonl:1": "contains a NUL byte"})


def case_manifest_path_is_a_folder(d: Path) -> IngestCase:
    (d / "m.jsonl").mkdir()
    return IngestCase([{"kind": "jsonl", "path": str(d / "m.jsonl")}], 0,
                      error="m.jsonl is a folder, not a jsonl file")


def case_label_studio_source_with_malformed_results(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    (d / "b.png").write_bytes(png(2))
    tasks = [{"id": 1, "data": {"image": "a.png"}, "annotations": [{"result": [{"type": "choices", "value": "3"}]}]},
             {"id": 2, "data": {"image": "b.png"}, "annotations": [{"result": [{"type": "choices",
                                                                               "value": {"choices": ["5"]}}]}]},
             {"id": 3, "data": {"img": "b.png"}}]
    (d / "export.json").write_text(json.dumps(tasks))

    def check(rows: list[dict[str, Any]], p: Project) -> None:
        assert sorted((r["answer"] or "-") for r in rows) == ["-", "5"]  # a malformed result is no label

    return IngestCase([{"kind": "label_studio", "path": str(d / "export.json")}], 3,
                      {"export.json:task 3": "task has no data.image"}, check=check)


def case_answer_and_split_out_of_range(d: Path) -> IngestCase:
    (d / "a.png").write_bytes(png(1))
    (d / "b.png").write_bytes(png(2))
    src = jsonl(d, [{"image": "a.png", "answer": "cat"}, {"image": "b.png", "answer": "2", "split": "validation"}])
    return IngestCase([src], 2, {"m.jsonl:1": "answer 'cat' is not in data.answers",
                                 "m.jsonl:2": "split 'validation' is not one of"}, data={"answers": DIGITS})


INGEST_CASES: dict[str, Callable[[Path], IngestCase]] = {
    **{f"image:{n}": _image_case(n) for n in [*BROKEN, *ODD]},
    **{n.removeprefix("case_"): f for n, f in dict(globals()).items() if n.startswith("case_")},
}


@pytest.mark.parametrize("name", list(INGEST_CASES))
def test_ingest_bad_input(project, name):
    case = INGEST_CASES[name](project.data)
    cfg = parse_config({"data": {"sources": case.sources, **case.data}, "paths": {"artifacts": "artifacts"}},
                       root=project.root)
    out = project.artifacts / "ingest"
    untouched = project.untouched()
    if case.error:
        with pytest.raises(DataError) as exc:
            ingest(cfg.data, cfg.artifacts, out)
        assert case.error in str(exc.value), str(exc.value)
        assert not (out / "manifest.json").exists() and not list(out.glob(".rows-*"))
        untouched()
        return
    m = ingest(cfg.data, cfg.artifacts, out)
    untouched()

    quarantine = read_jsonl(out / "quarantine.jsonl")
    reasons = {Path(q["source"]).name: q["reason"] for q in quarantine}
    assert reasons.keys() == case.quarantined.keys(), reasons
    for where, words in case.quarantined.items():
        assert words in reasons[where], (where, reasons[where])
    rows = list(load_ingested(out))
    c = m.info["counts"]
    assert (c["read"], c["quarantined"], c["duplicates"], c["ingested"]) == (
        case.rows, len(quarantine), len(read_jsonl(out / "duplicates.jsonl")), len(rows))
    assert c["ingested"] + c["quarantined"] + c["duplicates"] == case.rows
    assert c["duplicates"] == case.duplicates
    if case.check:
        case.check(rows, project)


def test_csv_needs_only_the_columns_it_uses_also_in_the_flows_copy_of_the_config(project):
    """Regression: flows rebuild the config from its JSON dump (every field then counts as set), which made the
    optional answer/split columns mandatory inside `tamis ingest` though the CLI's own check had passed."""
    (project.data / "a.png").write_bytes(png(1))
    src = csv_source(project.data, "image,question\na.png,Which?\n")
    for i, extra in enumerate([{}, {"answer_column": "label"}]):
        cfg = parse_config({"data": {"sources": [{**src, **extra}]}, "paths": {"artifacts": "artifacts"}},
                           root=project.root)
        copy = ProjectConfig.model_validate({"data": cfg.section("data"), "paths": cfg.section("paths")})
        for c in (cfg, copy):
            if extra:  # a column the user named must exist, in either copy
                with pytest.raises(DataError, match=r"m\.csv: column\(s\) \['label'\] not found"):
                    ingest(c.data, c.artifacts, project.artifacts / "ingest")
            else:
                m = ingest(c.data, c.artifacts, project.artifacts / f"ingest-{i}")
                assert m.info["counts"] == {"read": 1, "ingested": 1, "quarantined": 0, "duplicates": 0}


# ------------------------------------------------------------------------------------------------ configs
CONFIG_CASES = {
    "unknown top-level key": ("sedd: 3\n", ["sedd: unknown key; remove it or check its spelling"]),
    "unknown nested key": ("data:\n  sources:\n    - {kind: csv, path: m.csv, colour: red}\n",
                           ["data.sources.0.colour: unknown key"]),
    "wrong type": ("train:\n  learning_rate: fast\n", ["train.learning_rate: 'fast' is not allowed", "valid number"]),
    "wrong type (fraction)": ("select: {batch_size: 1.5}\n", ["select.batch_size: 1.5 is not allowed"]),
    "out of range": ("select:\n  batch_size: 0\n", ["select.batch_size: 0 is not allowed; must be ≥ 1"]),
    "out of range (upper)": ("model: {lora_dropout: 1.5}\n", ["model.lora_dropout: 1.5 is not allowed; must be < 1"]),
    "not one of": ("model: {mode: int8}\n", ["model.mode: 'int8' is not allowed; must be one of", "'qlora'"]),
    "missing field": ("data: {sources: [{kind: csv}]}\n", ["data.sources.0.path: is required but missing"]),
    "bad list item": ("annotate: {formats: [csv, pdf]}\n", ["annotate.formats.1: 'pdf' is not allowed"]),
    "several errors at once": ("seed: x\ntrain: {max_steps: 0}\n", ["seed: 'x' is not allowed",
                                                                    "train.max_steps: 0 is not allowed"]),
    "duplicate key": ("select: {batch_size: 8}\nseed: 1\nselect: {strategy: margin}\n",
                      ["key 'select' appears twice", "line 3"]),
    "tab indentation": ("data:\n\tanswers: [a, b]\n", ["not valid YAML", "line 2"]),
    "not a mapping": ("- seed\n- 1\n", ["the top level must be a mapping of sections, not list"]),
    "not UTF-8": (b"seed: 1\n# caf\xe9\n", ["not UTF-8 text"]),
}


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_config_bad_input(project, name):
    text, words = CONFIG_CASES[name]
    path = project.root / "tamis.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    untouched = project.untouched()
    with pytest.raises(ConfigError) as exc:
        load_config(path, root=project.root)
    msg = str(exc.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    untouched()
    assert not project.artifacts.exists()


def _tamis(project: Project, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project.root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
                                                       "COLUMNS": "300"})


def test_cli_reports_bad_config_and_bad_manifest_without_a_traceback(project):
    """The user-facing path: one 'error:' paragraph naming the field / file:line, exit code 2, no traceback."""
    (project.root / "bad.yaml").write_text("select:\n  batch_size: -3\n")
    csv_source(project.data, 'image,question\na.png,"unclosed\n')
    (project.root / "good.yaml").write_text(f"data:\n  sources: [{{kind: csv, path: {project.data / 'm.csv'}}}]\n")
    untouched = project.untouched()
    for args, words in [
        (["config", "show", "--config", "bad.yaml"], "select.batch_size: -3 is not allowed; must be ≥ 1"),
        (["ingest", "--config", "good.yaml"], f"{project.data / 'm.csv'}:2: not valid CSV"),
    ]:
        res = _tamis(project, *args)
        err = " ".join(res.stderr.split())  # rich wraps long lines
        assert res.returncode == 2, (res.returncode, res.stderr)
        assert "error:" in err and words in err and "Traceback" not in res.stderr, res.stderr
    untouched()


# ------------------------------------------------------------------------------------------------ labels
KNOWN = {f"s{i:03d}" for i in range(12)}


@dataclass
class LabelCase:
    name: str  # file name under labels/
    text: str
    rows: int  # label rows (one per annotation / CSV row / JSONL line), counted by the test itself
    rejected: dict[int, str] = field(default_factory=dict)  # line → words of the reason
    accepted: dict[str, str] = field(default_factory=dict)  # what the ledger holds afterwards
    skipped: int = 0
    error: str | None = None  # a malformed file: words of the LabelImportError; nothing may be appended


def _json(tasks: list[Any]) -> str:
    return json.dumps(tasks, indent=2)


def _line_of(text: str, needle: str, nth: int = 0) -> int:
    pos = -1
    for _ in range(nth + 1):
        pos = text.index(needle, pos + 1)
    return text.count("\n", 0, pos) + 1


def label_unknown_ids() -> LabelCase:
    return LabelCase("l.csv", "sample_id,label,annotator\ns000,1,ann\ns999,2,ann\ns001,3,ann\n,4,ann\n", 4,
                     {3: "unknown sample_id 's999': not among this project's 12 samples", 5: "no sample_id"},
                     {"s000": "1", "s001": "3"})


def label_outside_answer_set() -> LabelCase:
    text = "\n".join(json.dumps(r) for r in [{"sample_id": "s000", "label": "cat"}, {"sample_id": "s001", "label": "1"},
                                             {"sample_id": "s002", "label": " "}]) + "\n"
    return LabelCase("l.jsonl", text, 3, {1: "label 'cat' is not in the answer set [0, 1, 2", 3: "empty label"},
                     {"s001": "1"})


def label_conflicting_annotators() -> LabelCase:
    tasks = [_task("s000", _ann("3", 1), _ann("5", 2)),                 # tie: neither wins
             _task("s001", _ann("4", 1), _ann("4", 2), _ann("6", 3)),   # majority: 4
             _task("s002", _ann(None, 1, cancelled=True), _ann("2", 2)),
             _task("s003")]                                             # never annotated: no label row
    text = _json(tasks)
    tie = _line_of(text, "\n  {") + 1  # a row is reported on the line its task starts
    return LabelCase("l.json", text, 7, {tie: "annotators tie on s000: {'3': 1, '5': 1}; add a deciding annotation"},
                     {"s001": "4", "s002": "2"}, skipped=1)


def label_non_string_ids() -> LabelCase:
    rows = [{"sample_id": 5, "answer": "1"}, {"sample_id": ["s000"], "answer": "1"}, {"sample_id": "s001", "answer": "1"}]
    text = "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n"
    return LabelCase("min.json", text, 3, {2: "unknown sample_id '5'", 3: "unknown sample_id \"['s000']\""},
                     {"s001": "1"})


def label_truncated_json() -> LabelCase:
    text = _json([_task("s000", _ann("1")), _task("s001", _ann("2"))])
    cut = text[: text.rindex('"choices"') + 5]
    return LabelCase("l.json", cut, 0, error=f"l.json:{cut.count(chr(10)) + 1}:")


def label_truncated_jsonl() -> LabelCase:
    return LabelCase("l.jsonl", '{"sample_id": "s000", "label": "1"}\n{"sample_id": "s001", "label": "2"}\n{"sample_id',
                     0, error="l.jsonl:3:")


def label_other_project() -> LabelCase:
    return LabelCase("l.json", _json([_task("x17", _ann("1")), _task("x18", _ann("2"))]), 0,
                     error="none of its 2 sample IDs (e.g. 'x17') is among this project's 12 samples; is it an "
                           "export from another project?")


def label_not_utf8() -> LabelCase:
    return LabelCase("l.csv", "sample_id,label\ns000,caf\udce9\n", 0, error="l.csv:2: not UTF-8")


LABEL_CASES = {n.removeprefix("label_"): f for n, f in dict(globals()).items() if n.startswith("label_")}


@pytest.mark.parametrize("name", list(LABEL_CASES))
def test_label_bad_input(project, name):
    case = LABEL_CASES[name]()
    path = project.root / "labels" / case.name
    path.write_bytes(case.text.encode("utf-8", "surrogateescape"))
    ledger = Ledger(ledger_path(project.artifacts))
    ledger.append([{"sample_id": "s011", "label": "0", "annotator": "a", "round": 0, "source_file": "seed",
                    "source_digest": "seed", "kind": "label"}])
    before = ledger.path.read_bytes()
    rejections = project.artifacts / "rejections"
    untouched = project.untouched()

    def run():
        return import_labels(path, known_ids=KNOWN, answers=DIGITS, ledger=ledger, round_index=1,
                             rejections_dir=rejections)

    if case.error:
        with pytest.raises(LabelImportError) as exc:
            run()
        assert str(path) in str(exc.value) and case.error in str(exc.value), str(exc.value)
        assert ledger.path.read_bytes() == before and not rejections.exists()
        untouched()
        return
    rep = run()
    untouched()
    assert rep.rows_read == case.rows and rep.accounted
    assert rep.skipped_cancelled == case.skipped
    assert {sid: lab for sid, lab in ledger.labels().items() if sid != "s011"} == case.accepted
    assert len(ledger.entries()) == 1 + len(rep.accepted)  # exactly the accepted labels, appended once
    got = {}
    for r in rep.rejected:
        assert r.where.startswith(f"{path}:{r.line}"), r.where
        got.setdefault(r.line, r.reason)
    assert got.keys() == case.rejected.keys(), got
    for line, words in case.rejected.items():
        assert words in got[line], (line, got[line])
    # The rejection report lives under artifacts/ and lists every rejected row with its file and line.
    assert Path(rep.rejections_file).parent == rejections
    assert [(x["file"], x["line"]) for x in read_jsonl(rep.rejections_file)] == [(str(path), r.line)
                                                                                  for r in rep.rejected]
