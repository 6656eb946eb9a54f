"""The label check's report: the issue table with who gave each label, annotator agreement, the files of a report
(issues.jsonl, oos_probs.npz, agreement.json, verdict.json) and the round summary's "Label quality" section."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.labelcheck.base import LABELCHECK_VERSION
from pipeline.labelcheck.detection import Issue, false_alarm_text
from pipeline.labelcheck.out_of_sample import OOSResult
from pipeline.mdtext import escape_md
from pipeline.schema import display_name
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    digest_json,
    find_valid_manifest,
    read_jsonl,
    stage_key,
    write_manifest,
)

VERDICT_FILE = "verdict.json"


def _entries(ledger: Any) -> list[dict[str, Any]]:
    return ledger.entries() if hasattr(ledger, "entries") else [dict(e) for e in ledger]


def issue_files(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Sample ID -> the image's file name, for the rows that carry their image_path."""
    return {r["sample_id"]: display_name(r["image_path"], None, r["sample_id"]) for r in rows if r.get("image_path")}


def label_issue_table(issues: Sequence[Issue], ledger: Any,
                      files: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per issue, with who gave the label and from which file (from the ledger; `ledger` is a Ledger or
    its entries). Labels that never went through the ledger (the dataset's train split) show origin "dataset".
    `files`: sample ID -> the name a person knows the image by (schema.display_name), listed first."""
    files = files or {}
    current: dict[str, dict[str, Any]] = {}
    for e in _entries(ledger):
        if "sample_id" in e:
            current[e["sample_id"]] = e
    table = []
    for rank, iss in enumerate(issues, 1):
        e = current.get(iss.sample_id)
        row: dict[str, Any] = {
            "rank": rank, "file": files.get(iss.sample_id, iss.sample_id), "sample_id": iss.sample_id,
            "given_label": iss.given_label,
            "suggested_label": iss.suggested_label, "score": round(iss.margin, 6),
            "given_prob": round(iss.given_prob, 6), "suggested_prob": round(iss.suggested_prob, 6),
            "threshold": round(iss.threshold, 6), "confidence": round(iss.confidence, 6),
            "signals": list(iss.signals),
        }
        if e is None:
            row |= {"annotators": [], "source_file": "", "round": None, "origin": "dataset", "entry_id": None}
        else:
            voters = [v["annotator"] for v in e.get("votes") or []] or [a for a in e["annotator"].split(",") if a]
            row |= {"annotators": sorted(set(voters)), "source_file": e["source_file"], "round": e["round"],
                    "origin": e["kind"], "entry_id": e.get("entry_id")}
            if e["label"] != iss.given_label:
                # The ledger moved on since the probabilities were computed: the issue may already be fixed.
                row["ledger_label"] = e["label"]
        table.append(row)
    return table


def annotator_agreement(ledger_entries: Any, oos_suggestions: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per annotator: n votes on samples several people labeled, the share agreeing with the majority, and the
    share of all their labels agreeing with the out-of-sample model (n_model of them had a model suggestion).

    A confused annotator shows up low on both; one low only against the model may be right where the model is not.
    """
    stats: dict[str, dict[str, float]] = {}

    def s(who: str) -> dict[str, float]:
        return stats.setdefault(who, {"n": 0, "majority": 0, "n_model": 0, "model": 0})

    for e in _entries(ledger_entries):
        sid = e.get("sample_id")
        votes = e.get("votes") or [{"annotator": a, "label": e["label"]} for a in e["annotator"].split(",") if a]
        for v in votes:
            st = s(v["annotator"])
            if e.get("votes"):
                st["n"] += 1
                st["majority"] += v["label"] == e["label"]
            if sid in oos_suggestions:
                st["n_model"] += 1
                st["model"] += v["label"] == oos_suggestions[sid]
    return {
        who: {"n": int(st["n"]), "agree_majority": st["majority"] / st["n"] if st["n"] else None,
              "n_model": int(st["n_model"]), "agree_model": st["model"] / st["n_model"] if st["n_model"] else None}
        for who, st in sorted(stats.items())
    }


def write_label_report(
    out_dir: str | os.PathLike[str],
    *,
    oos: OOSResult,
    table: Sequence[Mapping[str, Any]],
    agreement: Mapping[str, Mapping[str, Any]],
    answers: Sequence[str],
    verdict: Mapping[str, Any] | None = None,
) -> Manifest:
    """issues.jsonl (the table), oos_probs.npz, agreement.json, verdict.json (Detection.info: abstained or not and
    why, the signals, the expected false alarms) and a manifest (stage "labelcheck") in out_dir; an identical report
    already there is left as it is (a re-run never rewrites a finished stage's outputs)."""
    import io

    out_dir = Path(out_dir)
    verdict = dict(verdict or {})
    inputs = {"oos": digest_json({"ids": oos.sample_ids, "probs": np.round(oos.probs, 6).tolist()}),
              "table": digest_json([dict(r) for r in table]),
              "agreement": digest_json({k: dict(v) for k, v in agreement.items()}),
              "verdict": digest_json(verdict)}
    config = {"answers": list(answers), "method": oos.method}
    if (m := find_valid_manifest(out_dir, stage_key("labelcheck", LABELCHECK_VERSION, inputs, config))) is not None:
        return m
    atomic_write_jsonl(out_dir / "issues.jsonl", [dict(r) for r in table])
    buf = io.BytesIO()
    np.savez(buf, probs=oos.probs, folds=oos.folds, sample_ids=np.asarray(oos.sample_ids, dtype=str))
    atomic_write_bytes(out_dir / "oos_probs.npz", buf.getvalue())
    atomic_write_json(out_dir / "agreement.json", {k: dict(v) for k, v in agreement.items()})
    atomic_write_json(out_dir / VERDICT_FILE, verdict)
    summary = {k: verdict[k] for k in ("abstained", "oos_accuracy", "expected_false_alarms", "message")
               if k in verdict}
    return write_manifest(
        out_dir, stage="labelcheck", stage_version=LABELCHECK_VERSION, inputs=inputs, config=config,
        outputs={"issues": "issues.jsonl", "oos_probs": "oos_probs.npz", "agreement": "agreement.json",
                 "verdict": VERDICT_FILE},
        info={"method": oos.method, "checked": len(oos.sample_ids), "issues": len(table), **oos.info, **summary},
    )


def verdict_headline(verdict: Mapping[str, Any], n_issues: int, checked: int, how: str = "") -> str:
    """What the check concluded, in one sentence: the abstain message, or the count with its false-alarm estimate."""
    if verdict.get("abstained"):
        return (f"label check: {verdict['abstain_reason']}. No label is judged or queued for re-labeling this "
                "round.")
    text = f"{n_issues} likely label errors among {checked} labeled samples" + (f" ({how})" if how else "") + "."
    if n_issues and "expected_false_alarms" in verdict:
        text += f" {false_alarm_text(verdict['expected_false_alarms']).capitalize()}."
    return text


def verdict_signals(verdict: Mapping[str, Any]) -> list[str]:
    """One line per signal: how accurate it is and whether it took part (shared with `tamis labels issues`)."""
    sig = verdict.get("signals") or {}
    lines = []
    model, knn = sig.get("model") or {}, sig.get("knn") or {}
    if model:
        est = (f"estimated {model['estimated_accuracy']:.2f} against the true labels with the kNN signal as a second "
               "rater; " if knn.get("used") else "")
        lines.append(f"Model signal: out-of-sample accuracy {model['accuracy']:.2f} on these labels ({est}"
                     f"labelcheck.min_oos_accuracy {verdict.get('min_oos_accuracy', 0):.2f}), calibrated at "
                     f"temperature {model['temperature']:.2f}.")
    if knn.get("used"):
        lines.append(f"kNN signal: the labels of the {knn['k']} nearest labeled neighbours in "
                     f"{knn['source']} agree with {knn['accuracy']:.2f} of these labels.")
    elif knn:
        lines.append(f"kNN signal not used: {knn.get('note') or 'unavailable'}.")
    if nb := sig.get("neighbours"):  # the model abstained: the neighbours judged alone, or were too weak to
        lines.append(f"Neighbours alone ({nb['k']} nearest labeled neighbours in {nb['source']}, leave-one-out "
                     f"agreement {nb['accuracy']:.2f} with these labels): {nb['note']}.")
    return lines


def label_report_markdown(table: Sequence[Mapping[str, Any]], agreement: Mapping[str, Mapping[str, Any]], *,
                          method: str, checked: int, top: int = 10, verdict: Mapping[str, Any] | None = None) -> str:
    """The round summary's "Label quality" section."""
    how = ("out-of-sample probabilities from k-fold adapters" if method == "kfold" else
           "out-of-sample probabilities from the round's adapter on samples it did not train on")
    verdict = verdict or {}
    if ((verdict.get("signals") or {}).get("neighbours") or {}).get("used"):
        how = "judged by their neighbours: the model cannot judge labels yet"
    lines = ["## Label quality", "", verdict_headline(verdict, len(table), checked, how), ""]
    if signals := verdict_signals(verdict):
        lines += ["- " + s for s in signals] + [""]
    if table:
        lines += ["| rank | image | sample | given | suggested | P(wrong) | signals | annotators | label file |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rank']} | {escape_md(r.get('file', r['sample_id']))} | {escape_md(r['sample_id'])} | "
                  f"{escape_md(r['given_label'])} | "
                  f"{escape_md(r['suggested_label'])} | {r.get('confidence', 1.0):.2f} | "
                  f"{', '.join(r.get('signals', []))} | {escape_md(', '.join(r['annotators']) or r['origin'])} | "
                  f"{escape_md(Path(r['source_file']).name)} |"
                  for r in table[:top]]
    if agreement:
        def pct(x: Any) -> str:
            return "–" if x is None else f"{100 * x:.0f}%"

        lines += ["", "| annotator | votes on shared samples | agree with majority | labels checked | "
                  "agree with model |", "|---|---|---|---|---|"]
        lines += [f"| {escape_md(who)} | {a['n']} | {pct(a['agree_majority'])} | {a['n_model']} | {pct(a['agree_model'])} |"
                  for who, a in agreement.items()]
    return "\n".join(lines)


def report_table(ref: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue table of a label check (`ref`, the labelcheck stage's ref)."""
    return read_jsonl(Path(ref["dir"]) / "issues.jsonl")


def report_agreement(ref: Mapping[str, Any]) -> dict[str, Any]:
    """Annotator agreement of a label check (its agreement.json)."""
    return json.loads((Path(ref["dir"]) / "agreement.json").read_text(encoding="utf-8"))


def report_verdict(ref: Mapping[str, Any]) -> dict[str, Any]:
    """The check's verdict.json ({} for a report written before verdicts existed)."""
    path = Path(ref["dir"]) / VERDICT_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def check_report_markdown(ref: Mapping[str, Any] | None) -> str:
    """The round summary's label-quality section for a finished check (`ref`, the labelcheck stage's ref)."""
    if ref is None:
        return ""
    return label_report_markdown(report_table(ref), report_agreement(ref), method=ref["method"],
                                 checked=ref["checked"], verdict=report_verdict(ref))
