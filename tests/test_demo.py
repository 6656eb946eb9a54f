"""The demo as users run it (`make demo`): several rounds on all 1,797 digits; accuracy must rise. Slow."""

import pytest
import yaml

from pipeline.config import DEFAULT_CONFIG
from pipeline.data.demo import write_digits


@pytest.mark.slow
def test_demo_accuracy_rises_over_rounds(tmp_path, prefect_harness):
    from flows.round import labeling_round

    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    digits = write_digits(tmp_path / "digits")
    cfg["paths"]["artifacts"] = str(tmp_path / "artifacts")
    cfg["data"]["sources"][0]["path"] = str(digits / "manifest.jsonl")
    cfg["data"]["ground_truth"] = str(digits / "ground_truth.jsonl")
    cfg["model"]["name_or_path"] = str(tmp_path / "model")
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(cfg))

    states = []
    for _ in range(cfg["rounds"]["max_rounds"]):
        states.append(labeling_round(str(config), simulate=True))
        if states[-1]["stopped"]:
            break
    acc = [s["metrics"]["accuracy"] for s in states if s["metrics"]]
    assert len(acc) == cfg["rounds"]["max_rounds"] - 1
    assert acc[0] > 0.2  # well above chance (0.1) after the first labeled round
    assert acc[-1] > acc[0]
    assert all(b >= a - 0.03 for a, b in zip(acc, acc[1:], strict=False)), acc
    assert (tmp_path / "artifacts" / "learning_curve.png").is_file()
    # The demo's label check (heldout): from round 2 on, the previous adapter scores the 40 labels that came since.
    checks = [s["labelcheck"] for s in states if s.get("labelcheck")]
    assert len(checks) == len(acc) - 1 and all(c["method"] == "heldout" and c["checked"] == 40 for c in checks)
    # The simulated annotator makes no errors: at most 2 alarms a round, or the check says it cannot judge yet.
    assert all(c["abstained"] or c["issues"] <= 2 for c in checks), checks
    assert all((tmp_path / "artifacts" / "rounds" / f"{s['round']:03d}" / "summary.md").is_file() for s in states)
    # Every round's report (docs/report.md): the batch as a contact sheet, the pool map, and once a round is
    # evaluated, the confusion matrix and the learning curve.
    for s in states:
        html = (tmp_path / "artifacts" / "rounds" / f"{s['round']:03d}" / "report.html").read_text()
        assert html.count('<img class="thumb"') == s.get("selected", 0) and 'alt="pool map"' in html
        assert ('alt="confusion matrix"' in html and 'alt="learning curve"' in html) == bool(s["metrics"])
