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
