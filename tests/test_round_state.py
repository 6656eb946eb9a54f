"""RoundState: round.json as one typed object, readable from files any tamis wrote."""

import json

import pytest

from pipeline.errors import ConfigError
from pipeline.round_state import ROUND_FILE, RoundState, completed_rounds, round_dir, trained_round


def test_round_json_keeps_its_shape_and_unknown_keys():
    # A stopped round as the rounds before RoundState wrote it, with a key this tamis does not know.
    old = {"round": 3, "labeled": 40, "labeled_digest": "d", "imports": [], "metrics": {"accuracy": 0.5},
           "annotation_time": None, "strategy": "margin", "quality_flags": [], "pool": 10, "labels_spent": 42,
           "tasks_out": 0, "stopped": "plateau", "adapter": {"adapter_dir": "a", "adapter_digest": "x"},
           "seconds": 1.5}
    state = RoundState.from_json(old)
    assert state.round == 3 and state.stopped == "plateau" and state.selected is None and state.selected_count == 0
    assert state.to_json() == old  # unknown keys kept, no key added
    assert "selected" not in state.to_json() and "consensus" not in state.to_json()
    state.selected, state.export_dir = 6, "e"
    out = state.to_json()
    assert out["selected"] == 6 and "phase" in out and out["phase"] is None  # a selection writes its keys, null or not


def test_missing_keys_take_their_defaults():
    state = RoundState.from_json({"round": 1})
    assert (state.labeled, state.imports, state.metrics, state.strategy, state.tasks_out) == (0, [], None, "", 0)
    state.update({"consensus_dir": "c", "consensus_requeued": 2, "later": True})
    assert state.consensus_dir == "c" and state.extra == {"later": True}


def test_one_layout_for_round_folders(tmp_path):
    assert round_dir(tmp_path, 7) == tmp_path / "rounds" / "007"
    assert round_dir(tmp_path, 12, "export") == tmp_path / "rounds" / "012" / "export"


def _finished(art, index, **fields):
    """A finished round as any tamis left it: its round.json object (an older one lacks most keys)."""
    path = round_dir(art, index, ROUND_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"round": index, **fields}))


def test_completed_rounds_are_round_states_in_round_order_and_an_unfinished_round_is_none(tmp_path):
    _finished(tmp_path, 1, labeled=4, adapter={"dir": "t1", "adapter_dir": "a1", "adapter_digest": "x1"}, old=True)
    _finished(tmp_path, 0, labeled=0)
    round_dir(tmp_path, 2).mkdir()  # started, not finished: no round.json yet
    round_dir(tmp_path, 3, ROUND_FILE).parent.mkdir()
    round_dir(tmp_path, 3, ROUND_FILE).write_text("{trunc")  # a torn write reads as unfinished
    states = completed_rounds(tmp_path)
    assert [type(s) for s in states] == [RoundState, RoundState] and [s.round for s in states] == [0, 1]
    assert states[1].adapter["adapter_dir"] == "a1" and states[1].extra == {"old": True}


def test_trained_round_is_the_asked_or_the_latest_round_with_an_adapter_and_says_which_have_one(tmp_path):
    with pytest.raises(ConfigError, match=r"no finished round in .* trained an adapter yet; rounds with an adapter: "
                                          r"none yet"):
        trained_round(tmp_path)
    _finished(tmp_path, 0)
    for r in (1, 2):
        _finished(tmp_path, r, adapter={"dir": f"t{r}", "adapter_dir": f"a{r}", "adapter_digest": f"x{r}"})
    _finished(tmp_path, 3, stopped="plateau")  # a round that stopped before training: not the latest with one
    assert trained_round(tmp_path).round == 2 and trained_round(tmp_path, 1).adapter["adapter_dir"] == "a1"
    with pytest.raises(ConfigError, match=r"round 0 trained no adapter .*; rounds with an adapter: 1, 2\. Pick"):
        trained_round(tmp_path, 0)
    with pytest.raises(ConfigError, match=r"round 7 is not a finished round in .*; rounds with an adapter: 1, 2"):
        trained_round(tmp_path, 7)
