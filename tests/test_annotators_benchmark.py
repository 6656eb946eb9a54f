"""benchmarks/annotators.py --quick: the results JSON carries the keys the docs and the README read, and the
unpredictable time model buys no gain."""

import json

import pytest


@pytest.mark.slow
def test_quick_annotators_benchmark_writes_its_keys(tmp_path):
    from benchmarks.annotators import main

    out = tmp_path / "annotators.json"
    main(["--quick", "--json-out", str(out)])
    d = json.loads(out.read_text())
    assert d["commit"] and (tmp_path / "annotators.png").stat().st_size > 10_000
    cost = d["cost"]
    lo, hi = cost["hours_ratio_95_ci"]
    assert lo <= cost["hours_ratio_95"] <= hi
    # Seconds no feature explains: the cost model says so every round, and the two arms pick the same samples.
    assert cost["unpredictable"]["margin"]["rounds_ranked_by_cost"].startswith("0 of")
    assert cost["unpredictable"]["hours_ratio_95"] == pytest.approx(1.0)
    assert cost["predictable"]["margin"]["cost_model_cv_r2_median"] > 0.5
    assert d["consensus"] == {"status": "not run"} or "dawid_skene_minus_majority" in d["consensus"]
    rap = d["stopping"]["rounds_after_plateau"]
    assert {"digits.stop_when_stable", "digits.plateau_rounds", "open_answers.plateau_rounds"} <= set(rap)
