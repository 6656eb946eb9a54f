import json
import os

import pytest

from pipeline.annotation.ledger import Ledger, ledger_path, make_entry
from pipeline.errors import LabelImportError


def _entry(sid, label, src="a.json", supersedes=None, now=1.0):
    return make_entry(sid, label, annotator="ann", round_index=1, source_file=src, source_digest="d-" + src,
                      supersedes=supersedes, now=now)


def test_newest_wins_history_and_corrections(tmp_path):
    led = Ledger(ledger_path(tmp_path))
    assert led.current() == {} and led.history("x") == [] and led.imported_digests() == set()
    first = [_entry("x", "3"), _entry("y", "5")]
    led.append(first)
    before = led.path.read_bytes()
    # A later clock reading that is *earlier* must not decide: file order does.
    corr = _entry("x", "8", src="b.json", supersedes=led.current()["x"], now=0.5)
    led.append([corr])
    assert led.path.read_bytes().startswith(before)  # appended, never rewritten
    assert led.labels() == {"x": "8", "y": "5"}
    hist = led.history("x")
    assert [e["label"] for e in hist] == ["3", "8"]
    assert [e["kind"] for e in hist] == ["label", "correction"]
    assert hist[1]["supersedes"] == hist[0]["entry_id"] and hist[1]["previous_label"] == "3"
    assert led.imported_digests() == {"d-a.json", "d-b.json"}
    assert len({e["entry_id"] for e in led.entries()}) == 3


def test_torn_last_line_is_skipped_and_next_append_stays_readable(tmp_path):
    led = Ledger(tmp_path / "labels.jsonl")
    led.append([_entry("x", "1")])
    with open(led.path, "ab") as f:
        f.write(b'{"sample_id": "y", "lab')  # a crash mid-append
    assert led.labels() == {"x": "1"}
    led.append([_entry("z", "2")])
    assert led.labels() == {"x": "1", "z": "2"}


@pytest.mark.parametrize(
    "bad, match",
    [({"sample_id": "x"}, "lacks label"), ({"kind": "delete"}, "kind 'delete'"), ({"label": "  "}, "empty label")],
)
def test_append_validates_the_whole_batch_first(tmp_path, bad, match):
    led = Ledger(tmp_path / "labels.jsonl")
    good = _entry("a", "1")
    broken = _entry("b", "2") | bad if "sample_id" not in bad else bad
    with pytest.raises(LabelImportError, match=match):
        led.append([good, broken])
    assert not led.path.exists()


# ------------------------------------------------------------------------------------- committed batches
def _batch(tmp_path, n=3, label="José"):
    return [make_entry(f"s{i}", f"{label} {i}", annotator="ann", round_index=1, source_file="f.csv",
                       source_digest="d-f", now=1.0) for i in range(n)]


def _cuts(path):
    return sorted(path.parent.glob(f"{path.name}.cut-*"))


def test_a_batch_cut_anywhere_counts_as_none_of_it_and_the_next_write_sets_it_aside(tmp_path):
    """Every byte offset inside the second batch (the `é` of José included): readers see the first batch only, the
    file is not imported, and the next write keeps the cut bytes in a file beside the ledger."""
    ref = Ledger(tmp_path / "ref" / "labels.jsonl")
    ref.append([_entry("a", "1")])
    first = ref.path.read_bytes()
    ref.append(_batch(tmp_path))
    full = ref.path.read_bytes()
    offsets = range(len(first) + 1, len(full))
    inside_e = [i for i in offsets if full[i - 1:i + 1] == "é".encode()]  # cuts inside the multi-byte character
    assert inside_e
    for cut in offsets:
        d = tmp_path / str(cut)
        d.mkdir()
        led = Ledger(d / "labels.jsonl")
        led.path.write_bytes(full[:cut])
        read = led.read()
        assert [e["sample_id"] for e in read.rows] == ["a"] and led.imported_digests() == {"d-a.json"}, cut
        assert [p.kind for p in read.problems] in (["torn"], ["uncommitted"], ["torn", "uncommitted"]), cut
        if cut % 9 and cut not in inside_e and cut < len(full) - 3:
            continue  # the repair (three fsyncs) at a ninth of the offsets
        led.append([_entry("z", "2", src="z.json")])
        assert [e["sample_id"] for e in led.entries()] == ["a", "z"] and not led.problems(), cut
        (aside,) = _cuts(led.path)
        assert aside.read_bytes() == full[len(first):cut]  # every cut byte kept, none lost without a trace


def test_torn_utf8_last_line_is_reported_once_and_read_around(tmp_path, caplog):
    led = Ledger(tmp_path / "labels.jsonl")
    led.append(_batch(tmp_path))
    with open(led.path, "ab") as f:  # a write cut after the first byte of é
        f.write(b'{"sample_id": "y", "label": "Jos' + "é".encode()[:1])
    with caplog.at_level("WARNING", logger="pipeline.store"):
        assert len(led.labels()) == 3 and len(led.entries()) == 3
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 1 and f"{led.path}:6: the last line is cut off" in reports[0], reports


def test_a_corrupt_line_in_the_middle_is_reported_with_its_line_number(tmp_path):
    led = Ledger(tmp_path / "labels.jsonl")
    led.path.write_text(json.dumps(_entry("a", "1")) + "\n" + "{not json\n" + json.dumps(_entry("b", "2")) + "\n"
                        + "[1, 2]\n")
    read = led.read()
    assert [e["sample_id"] for e in read.rows] == ["a", "b"]
    assert [(p.line, p.kind) for p in read.problems] == [(2, "corrupt"), (4, "corrupt")]
    assert "labels.jsonl:2: not a JSON object (Expecting property name" in str(read.problems[0])


def test_a_ledger_written_before_commit_records_still_reads_and_takes_new_batches(tmp_path):
    """Today's ledgers hold plain lines, the last one possibly torn by a crash or missing its line end."""
    led = Ledger(tmp_path / "labels.jsonl")
    legacy = [_entry("a", "1"), _entry("b", "2", src="b.json")]
    led.path.write_text("".join(json.dumps(e) + "\n" for e in legacy) + json.dumps(_entry("c", "3", src="c.json")))
    assert led.labels() == {"a": "1", "b": "2", "c": "3"} and not led.problems()  # a whole row without its "\n"
    led.append(_batch(tmp_path, 2))
    assert list(led.labels()) == ["a", "b", "c", "s0", "s1"] and not _cuts(led.path)
    with open(led.path, "ab") as f:  # an old writer's line after the new batches still counts
        f.write((json.dumps(_entry("d", "4", src="d.json")) + "\n").encode())
    assert list(led.labels())[-1] == "d" and led.imported_digests() == {"d-a.json", "d-b.json", "d-c.json", "d-f",
                                                                         "d-d.json"}


def test_a_committed_batch_damaged_afterwards_is_not_counted_and_says_so(tmp_path):
    led = Ledger(tmp_path / "labels.jsonl")
    led.append([_entry("a", "1")])
    led.append(_batch(tmp_path))
    data = led.path.read_bytes()
    led.path.write_bytes(data.replace(b"Jos\xc3\xa9 1", b"Jose! 1"))  # the same length, other bytes
    read = led.read()
    assert [e["sample_id"] for e in read.rows] == ["a"]
    assert [(p.kind, p.line, p.last_line) for p in read.problems] == [("mismatch", 4, 8)]
    assert "does not match its commit record" in str(read.problems[0])


def test_appends_fsync_the_file_and_a_new_files_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    led = Ledger(tmp_path / "labels.jsonl")
    led.append([_entry("a", "1")])
    assert synced == [str(led.path), str(tmp_path)]  # the bytes, then the new name
    synced.clear()
    led.append([_entry("b", "1", src="b.json")])
    assert synced == [str(led.path)]
