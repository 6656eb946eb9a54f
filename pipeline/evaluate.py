"""Per-round metrics: accuracy / exact match (closed answer sets), SQuAD-style exact match, token F1 and normalized
edit similarity (open answers), the metrics log, the learning curve and the status summary."""

from __future__ import annotations

import io
import os
import re
import string
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.annotation.labels import inbox_files
from pipeline.annotation.ledger import Ledger, ledger_path
from pipeline.errors import DataError
from pipeline.store import MANIFEST_NAME, append_jsonl, atomic_write_bytes, digest_file, read_jsonl

METRICS_NAME = "metrics.jsonl"
METRIC_KEYS = ("round", "labels", "metric", "value", "strategy")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str | None) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = (s or "").lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _pairs(preds: Sequence[str | None], refs: Sequence[str]) -> None:
    if len(preds) != len(refs):
        raise DataError(f"{len(preds)} predictions for {len(refs)} references; score the whole test split")
    if not refs:
        raise DataError("no references to score against: the test split is empty")


def accuracy(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Fraction of predictions equal to the reference after stripping whitespace (closed answer sets)."""
    _pairs(preds, refs)
    return sum((p or "").strip() == r.strip() for p, r in zip(preds, refs, strict=True)) / len(refs)


def exact_match(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _f1(pred: str | None, ref: str) -> float:
    p, r = normalize_answer(pred).split(), normalize_answer(ref).split()
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def token_f1(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    _pairs(preds, refs)
    return sum(_f1(p, r) for p, r in zip(preds, refs, strict=True)) / len(refs)


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert / delete / substitute, each 1); two rows of the table at a time."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(preds: Sequence[str | None], refs: Sequence[str]) -> float:
    """Mean 1 − Levenshtein(pred, ref) / max(len) over characters of the normalised strings (ANLS without its
    threshold): partial credit for a near-miss spelling ("sevn" for "seven") that token F1 scores 0."""
    _pairs(preds, refs)
    total = 0.0
    for p, r in zip(preds, refs, strict=True):
        a, b = normalize_answer(p), normalize_answer(r)
        total += 1.0 if a == b else 1.0 - _edit_distance(a, b) / max(len(a), len(b))
    return total / len(refs)


def score_answers(preds: Sequence[str | None], refs: Sequence[str], *, closed: bool) -> dict[str, float]:
    """The metrics a round reports: accuracy + exact match for closed sets; exact match, token F1 and edit
    similarity for open ones (exact match first: it is the learning curve's default metric)."""
    if closed:
        return {"accuracy": accuracy(preds, refs), "exact_match": exact_match(preds, refs)}
    return {"exact_match": exact_match(preds, refs), "token_f1": token_f1(preds, refs),
            "edit_similarity": edit_similarity(preds, refs)}


# ------------------------------------------------------------------------------------------- metrics log
def append_metrics(artifacts: str | os.PathLike[str], row: Mapping[str, Any]) -> dict[str, Any]:
    """Append one metric value of one round to artifacts/metrics.jsonl (append-only, fsync'd)."""
    missing = [k for k in METRIC_KEYS if k not in row]
    if missing:
        raise DataError(f"metrics row lacks {', '.join(missing)} (needs {', '.join(METRIC_KEYS)}): {dict(row)}")
    out = dict(row)
    out["value"] = float(out["value"])
    out.setdefault("time", time.time())
    append_jsonl(Path(artifacts) / METRICS_NAME, [out])
    return out


def read_metrics(artifacts: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return read_jsonl(Path(artifacts) / METRICS_NAME)


def merge_equal_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics with the same value under one joined name, in first-seen order: on a closed answer set accuracy and
    exact match are usually the same number, shown once as `accuracy = exact_match`."""
    groups: dict[float, list[str]] = {}
    for name, value in metrics.items():
        groups.setdefault(float(value), []).append(name)
    return {" = ".join(names): value for value, names in groups.items()}


def plot_learning_curve(
    rows: Sequence[Mapping[str, Any]], out_png: str | os.PathLike[str], *, metric: str | None = None
) -> Path:
    """Metric vs number of labels, one line per strategy; `metric` defaults to the first one logged."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    if not rows:
        raise DataError(f"no metrics to plot into {out_png}: no round has been evaluated yet")
    metric = metric or rows[0]["metric"]
    lines: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["metric"] == metric:
            # A re-evaluated round replaces its earlier value (the log is append-only, newest wins).
            lines.setdefault(str(r.get("strategy") or "?"), {})[int(r["labels"])] = float(r["value"])
    if not lines:
        raise DataError(f"no rows for metric {metric!r}; logged: {', '.join(sorted({r['metric'] for r in rows}))}")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for strategy, pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=strategy)
        ax.set_xlabel("labeled samples")
        ax.set_ylabel(metric)
        ax.set_title(f"Learning curve ({metric})")
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        buf = io.BytesIO()
        # No timestamp / software metadata, so the same metrics give the same bytes.
        fig.savefig(buf, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return atomic_write_bytes(out_png, buf.getvalue())


def status_summary(artifacts: str | os.PathLike[str]) -> dict[str, Any]:
    """What `tamis status` shows from the annotation side: rounds exported, labels, pending inbox, last metrics."""
    from pipeline.rounds import completed_rounds

    artifacts = Path(artifacts)
    rounds_dir = artifacts / "rounds"
    exported = sorted(
        int(p.name) for p in rounds_dir.glob("[0-9][0-9][0-9]") if (p / "export" / MANIFEST_NAME).is_file()
    ) if rounds_dir.is_dir() else []
    ledger = Ledger(ledger_path(artifacts))
    entries = ledger.entries()
    done = {e.get("source_digest") for e in entries}
    metrics = read_metrics(artifacts)
    last_round = max((int(m["round"]) for m in metrics), default=None)
    return {
        "rounds_exported": exported,
        # Finished rounds (round.json written), as `tamis status` lists them; a round that stopped exports nothing.
        "rounds_done": len(completed_rounds(artifacts)),
        "labeled": len({e["sample_id"] for e in entries if "sample_id" in e}),
        "ledger_entries": len(entries),
        "corrections": sum(e.get("kind") == "correction" for e in entries),
        # Inbox files no ledger entry came from yet (a file whose rows were all rejected stays listed).
        "inbox_pending": [str(p) for p in inbox_files(artifacts / "inbox") if digest_file(p) not in done],
        "last_round_evaluated": last_round,
        "last_metrics": {m["metric"]: m["value"] for m in metrics if last_round is not None and m["round"] == last_round},
        "metrics_rows": len(metrics),
    }


def predict_answers(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                    batch_size: int = 16, max_new_tokens: int = 16) -> list[str]:
    """The model's answer per row: the most likely candidate for closed sets, greedy generation for open answers."""
    from pipeline.scoring import make_scorer

    scorer = make_scorer(loaded, answers, max_new_tokens=max_new_tokens)
    res = scorer.score(list(rows), batch_size=batch_size)
    if answers:
        return [answers[i] for i in res.probs.argmax(1)]
    return list(res.answers or [])


def evaluate_model(loaded: Any, rows: Sequence[Mapping[str, Any]], answers: Sequence[str] | None, *,
                   batch_size: int = 16, max_new_tokens: int = 16) -> dict[str, Any]:
    """Metrics of `loaded` on labeled rows (`prepared`, `question`, `answer`) and the per-row predictions."""
    if not rows:
        raise ValueError("evaluation needs at least one test row with an answer (split: test)")
    preds = predict_answers(loaded, rows, answers, batch_size=batch_size, max_new_tokens=max_new_tokens)
    refs = [r["answer"] for r in rows]
    return {
        "metrics": score_answers(preds, refs, closed=bool(answers)),
        "n": len(rows),
        "predictions": [{"sample_id": r["sample_id"], "prediction": p, "answer": a}
                        for r, p, a in zip(rows, preds, refs, strict=True)],
    }
