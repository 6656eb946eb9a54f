"""RoundState: round.json as one typed object, readable from files any tamis wrote."""

from pipeline.round_state import RoundState, round_dir


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


def test_missing_keys_take_their_defaults_and_readers_accept_either():
    state = RoundState.of({"round": 1})
    assert (state.labeled, state.imports, state.metrics, state.strategy, state.tasks_out) == (0, [], None, "", 0)
    assert RoundState.of(state) is state
    state.update({"consensus_dir": "c", "consensus_requeued": 2, "later": True})
    assert state.consensus_dir == "c" and state.extra == {"later": True}


def test_one_layout_for_round_folders(tmp_path):
    assert round_dir(tmp_path, 7) == tmp_path / "rounds" / "007"
    assert round_dir(tmp_path, 12, "export") == tmp_path / "rounds" / "012" / "export"
