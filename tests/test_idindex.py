"""IdIndex: row numbers of IDs among a long column, checked against a plain dict."""

import datasets
import numpy as np
import pyarrow as pa

from pipeline.idindex import IdIndex
from pipeline.schema import sample_id_for


def test_rows_match_a_dict_for_lists_arrow_columns_and_datasets():
    ids = [sample_id_for(bytes([i % 256, i // 256]), "q") for i in range(3000)]
    ids[17] = ids[5]  # a repeated ID: its first row is the one found
    first = {}
    for i, s in enumerate(ids):
        first.setdefault(s, i)
    wanted = [ids[2999], "not-an-id", ids[5], ids[0], "", ids[1234]]
    expect = [first.get(s, -1) for s in wanted]
    ds = datasets.Dataset.from_dict({"sample_id": ids})
    for built in (IdIndex(ids), IdIndex(pa.chunked_array([ids[:1000], ids[1000:]])), IdIndex.of_dataset(ds)):
        assert built.rows(wanted).tolist() == expect
        assert ids[42] in built and "zzz" not in built
    # A dataset seen through an indices mapping (after select) answers with its own row numbers.
    sub = ds.select([10, 3, 2999])
    assert IdIndex.of_dataset(sub).rows([ids[2999], ids[10], ids[11]]).tolist() == [2, 0, -1]


def test_ids_of_unequal_length_and_beyond_ascii():
    ids = ["a", "ab", "é-1", "abc", "a"]
    index = IdIndex(pa.array(ids))
    assert index.rows(["abc", "é-1", "a", "abcd", "ab"]).tolist() == [3, 2, 0, -1, 1]
    assert IdIndex([]).rows(["a"]).tolist() == [-1] and len(IdIndex(ids)) == 5
    assert IdIndex(ids).rows([]).dtype == np.int64


def test_many_ids_looked_up_at_once_match_a_dict():
    # Above a few thousand wanted IDs the index searches them in sorted order (a pool's every eligible sample);
    # equal-length ASCII lists take the joined-buffer path. Both must answer as a dict does, in the asked order.
    rng = np.random.default_rng(0)
    ids = [sample_id_for(int(i).to_bytes(4, "little"), "q") for i in range(20_000)]
    ids[19_999] = ids[7]  # repeated: the first row wins
    first = {}
    for i, s in enumerate(ids):
        first.setdefault(s, i)
    absent = [f"{i:020x}" for i in range(3000)]  # same width, never an ID
    wanted = [ids[i] for i in rng.integers(0, len(ids), 9000)] + absent + [ids[7]] * 3
    wanted = [wanted[i] for i in rng.permutation(len(wanted))]
    expect = [first.get(s, -1) for s in wanted]
    for built in (IdIndex(ids), IdIndex(pa.array(ids))):
        assert built.rows(wanted).tolist() == expect
    # Lists the joined buffer cannot hold (a wider character of the same length, a NUL, unequal widths) still match.
    odd = ["é" * 20, "e" * 20, "a\0" * 10, "x" * 19] + ids[:5000]
    assert IdIndex(odd).rows(odd[::-1] + ["é" * 20]).tolist() == [*range(len(odd) - 1, -1, -1), 0]


def test_argsort_bytes_is_numpys_stable_sort():
    # By 8-byte prefix, then whole keys within tied prefixes: the same order as numpy's stable string sort, for
    # random hex IDs (a few tied prefixes), IDs sharing long prefixes (every prefix tied), short keys and NUL padding.
    from pipeline.idindex import argsort_bytes

    rng = np.random.default_rng(3)
    cases = [
        np.array([sample_id_for(int(i).to_bytes(4, "little"), "q") for i in range(30_000)], dtype="S20"),
        np.array([f"img_{i % 700:08d}" for i in rng.permutation(20_000)], dtype="S12"),
        np.array([b"ab", b"a", b"", b"abcdefghij", b"abcdefghi", b"abcdefgh", b"abcdefghij", b"a\x00"], dtype="S10"),
        np.array([f"{i % 97:03d}".encode() for i in range(5000)], dtype="S3"),
    ]
    for keys in cases:
        assert argsort_bytes(keys).tolist() == np.argsort(keys, kind="stable").tolist()

