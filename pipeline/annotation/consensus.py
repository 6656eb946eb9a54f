"""Consensus: many annotators' raw votes → one label per sample, with a confidence and each annotator's quality.

The raw votes are kept, not the consensus: every accepted vote of every import goes to an append-only log beside
the ledger (annotation_votes.jsonl, written by the importer), whatever later decides between them. A consensus is
derived from that log and recorded with the method that made it (artifacts/consensus.json; with a fitted method, a
ledger entry per changed sample carrying `consensus: {method, confidence}`).

Methods (`annotate.consensus`), one small class each in CONSENSUS:

| name          | decides                                                  | when                                       |
|---------------|----------------------------------------------------------|--------------------------------------------|
| `majority`    | most votes wins, a tie is no label (today's rule)        | per import file, as the votes arrive       |
| `dawid_skene` | Dawid–Skene (1979) EM via crowd-kit: each annotator's     | refit over every raw vote of the project    |
|               | confusion matrix and the class priors → a posterior      | after each import                          |
| `one_coin`    | Dawid–Skene with one accuracy per annotator (crowd-kit's  | as dawid_skene                             |
|               | OneCoinDawidSkene): few parameters, for few votes        |                                            |
| `box_iou`     | box labels: boxes matched by IoU across annotators, kept | per import file (box projects only)        |
|               | where most drew one, class by majority                   |                                            |

The confidence of a decision is the share of votes for the winner (majority), its posterior probability
(Dawid–Skene) or the annotators' mean pairwise box agreement (box_iou); a sample below `annotate.redundancy.threshold` goes to another annotator in the next export.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pipeline.annotation.counted import count_once
from pipeline.boxes.answer import box_label, parse_box_label
from pipeline.boxes.consensus import box_consensus
from pipeline.boxes.matching import agreement
from pipeline.config import AnnotateConfig
from pipeline.store import read_jsonl

VOTES_NAME = "annotation_votes.jsonl"  # beside the ledger: every accepted raw vote, one line each
CONSENSUS_FILE = "consensus.json"
MODEL_RATER = "model"


@dataclass(frozen=True)
class Vote:
    sample_id: str
    annotator: str
    label: str


@dataclass
class Decision:
    """One sample's consensus: `label` None when the method cannot decide (a majority tie)."""

    label: str | None
    confidence: float
    votes: dict[str, int]  # label → how many votes it got, most first (ties by label)
    outcome: str  # "agreed" (one answer), "majority", "tie", "fitted"

    @property
    def n(self) -> int:
        return sum(self.votes.values())


@dataclass
class AnnotatorQuality:
    """An annotator's record: `agreement` with the consensus on samples someone else also labeled; `accuracy` and
    `confusion` (given label → true label → P(given | true), Dawid–Skene's) only from a method that estimates them."""

    name: str
    votes: int
    shared: int  # votes on samples with at least one other vote
    agreement: float | None
    accuracy: float | None = None
    confusion: dict[str, dict[str, float]] | None = None


def ranked_votes(labels: Sequence[str]) -> list[tuple[str, int]]:
    return sorted(Counter(labels).items(), key=lambda kv: (-kv[1], kv[0]))


class Consensus:
    """One way to turn votes into labels. `per_file`: decided inside each import as the file's votes arrive (the
    ledger entries are already the consensus); otherwise fitted over every raw vote after the imports, which may
    change earlier samples' labels too."""

    name: ClassVar[str]
    per_file: ClassVar[bool] = False

    def decide(self, votes: Mapping[str, Sequence[Vote]]) -> dict[str, Decision]:
        raise NotImplementedError

    def annotators(self, votes: Mapping[str, Sequence[Vote]],
                   decisions: Mapping[str, Decision]) -> dict[str, AnnotatorQuality]:
        """Agreement with the consensus, counted on samples someone else labeled too (on a sample only one person
        labeled, agreeing with yourself says nothing)."""
        tally: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for sid, vs in votes.items():
            d = decisions.get(sid)
            for v in vs:
                t = tally[v.annotator]
                t[0] += 1
                if len(vs) > 1 and d is not None and d.label is not None:
                    t[1] += 1
                    t[2] += self.agree(v.label, d.label)
        return {name: AnnotatorQuality(name, int(n), int(shared), agree / shared if shared else None)
                for name, (n, shared, agree) in sorted(tally.items())}

    @staticmethod
    def agree(vote: str, decided: str) -> float:
        """How much one vote agrees with the decided label, in [0, 1]: equality for one-answer labels."""
        return float(vote == decided)


class Majority(Consensus):
    """Most votes wins; a tie is rejected, never first-row-wins (the importer's rule since the ledger began)."""

    name = "majority"
    per_file = True

    @staticmethod
    def decide_one(labels: Sequence[str]) -> Decision:
        ranked = ranked_votes(labels)
        total = sum(n for _, n in ranked)
        if len(ranked) == 1:
            return Decision(ranked[0][0], 1.0, dict(ranked), "agreed")
        tie = ranked[0][1] == ranked[1][1]
        return Decision(None if tie else ranked[0][0], ranked[0][1] / total, dict(ranked), "tie" if tie else "majority")

    def decide(self, votes: Mapping[str, Sequence[Vote]]) -> dict[str, Decision]:
        return {sid: self.decide_one([v.label for v in vs]) for sid, vs in votes.items() if vs}


class DawidSkene(Consensus):
    """Dawid & Skene (1979): EM over each annotator's confusion matrix and the class priors (crowd-kit's
    implementation, Apache-2.0). A careless annotator's vote then weighs what their estimated confusion says it is
    worth, and a two-vote disagreement goes to the more reliable one instead of being rejected."""

    name = "dawid_skene"
    n_iter: ClassVar[int] = 100

    def __init__(self) -> None:
        self._fit: Any = None

    def _model(self) -> Any:
        from crowdkit.aggregation import DawidSkene as _DS

        return _DS(n_iter=self.n_iter)

    def decide(self, votes: Mapping[str, Sequence[Vote]]) -> dict[str, Decision]:
        import pandas as pd

        rows = [(v.sample_id, v.annotator, v.label) for vs in votes.values() for v in vs]
        if not rows:
            return {}
        df = pd.DataFrame(rows, columns=["task", "worker", "label"])
        self._fit = self._model().fit(df)
        probas = self._fit.probas_
        out = {}
        for sid, vs in votes.items():
            if not vs:
                continue
            p = probas.loc[sid]
            # argmax with ties broken by label order, as majority ranks: the same votes give the same label always
            best = max(sorted(p.index), key=lambda lab: p[lab])
            out[sid] = Decision(str(best), float(p[best]), dict(ranked_votes([v.label for v in vs])), "fitted")
        return out

    def annotators(self, votes: Mapping[str, Sequence[Vote]],
                   decisions: Mapping[str, Decision]) -> dict[str, AnnotatorQuality]:
        out = super().annotators(votes, decisions)
        if self._fit is None:
            return out
        errors, priors = self._fit.errors_, self._fit.priors_
        for name, q in out.items():
            m = errors.loc[name]  # rows: the label given, columns: the true label; each column sums to 1
            q.confusion = {str(given): {str(t): round(float(m.loc[given, t]), 4) for t in m.columns}
                           for given in m.index}
            q.accuracy = self._accuracy(name, m, priors)
        return out

    def _accuracy(self, name: str, confusion: Any, priors: Any) -> float:
        """P(the annotator gives the true label) = Σ_k prior_k · P(gives k | true k)."""
        return float(sum(priors[t] * (confusion.loc[t, t] if t in confusion.index else 0.0)
                         for t in confusion.columns))


class OneCoinDawidSkene(DawidSkene):
    """Dawid–Skene with one accuracy per annotator and wrong answers spread evenly (crowd-kit's OneCoinDawidSkene):
    one parameter per annotator instead of a K×K matrix, so it estimates well from few votes per annotator and
    class, where the full model overfits (two labels per sample, ten classes)."""

    name = "one_coin"

    def _model(self) -> Any:
        from crowdkit.aggregation import OneCoinDawidSkene as _OneCoin

        return _OneCoin(n_iter=self.n_iter)

    def _accuracy(self, name: str, confusion: Any, priors: Any) -> float:
        return float(self._fit.skills_[name])


class BoxIoU(Consensus):
    """Box labels (canonical JSON text, pipeline/boxes/answer.py): boxes matched by IoU across annotators, a box
    kept where most annotators drew one, its class by majority (pipeline/boxes/consensus.py). The confidence is the
    annotators' mean pairwise box agreement; an annotator's agreement is their mean box agreement with the
    consensus (string equality would call two near-identical drawings a disagreement)."""

    name = "box_iou"
    per_file = True

    def decide_one(self, labels: Sequence[str]) -> Decision:
        """One image's decision from its labels (the importer's per-file rule, as Majority.decide_one)."""
        return self.decide({"": [Vote("", f"annotator-{i}", label) for i, label in enumerate(labels)]})[""]

    def decide(self, votes: Mapping[str, Sequence[Vote]]) -> dict[str, Decision]:
        out = {}
        for sid, vs in votes.items():
            if not vs:
                continue
            answers = {f"{v.annotator}#{i}": parse_box_label(v.label, where=f"sample {sid}, {v.annotator}'s label")
                       for i, v in enumerate(vs)}
            d = box_consensus(answers)
            label = None if d.boxes is None else box_label(d.boxes)
            out[sid] = Decision(label, round(d.confidence, 6), dict(ranked_votes([v.label for v in vs])),
                                d.outcome if len(vs) > 1 else "agreed")
        return out

    @staticmethod
    def agree(vote: str, decided: str) -> float:
        return agreement(parse_box_label(vote), parse_box_label(decided))


# box_iou is a box project's annotate.consensus (its default; pipeline/config/combinations.py refuses the others there).
CONSENSUS: dict[str, type[Consensus]] = {"majority": Majority, "dawid_skene": DawidSkene,
                                          "one_coin": OneCoinDawidSkene, "box_iou": BoxIoU}


# ------------------------------------------------------------------------------------------------ the votes
def votes_path(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / VOTES_NAME


def read_votes(artifacts: str | os.PathLike[str]) -> dict[str, list[Vote]]:
    """sample_id → its raw votes, oldest first. An annotation two files carried (a CSV imported half-written then
    whole, cumulative exports, a crash between the votes and the ledger write, then the import again) is one vote,
    its newest version (pipeline/annotation/counted.py)."""
    out: dict[str, list[Vote]] = defaultdict(list)
    for r in count_once(read_jsonl(votes_path(artifacts))):
        out[str(r["sample_id"])].append(Vote(str(r["sample_id"]), str(r["annotator"]), str(r["label"])))
    return dict(out)


def model_votes(artifacts: str | os.PathLike[str]) -> dict[str, Vote]:
    """The model as one more rater: each exported round's predictions (the pre-annotations of rounds/NNN/export/),
    the newest round's for a sample exported twice."""
    from pipeline.annotation.export import TASKS_FILE

    out: dict[str, Vote] = {}
    for p in sorted(Path(artifacts).glob(f"rounds/[0-9][0-9][0-9]/export/{TASKS_FILE}")):
        try:
            tasks = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # an export being written: its predictions come with the next consensus
        for t in tasks if isinstance(tasks, list) else []:
            sid = (t.get("data") or {}).get("sample_id")
            for pred in (t.get("predictions") or [])[:1]:
                for res in pred.get("result") or []:
                    value = res.get("value") or {}
                    answer = (value.get("choices") or value.get("text") or [None])[0]
                    if sid and isinstance(answer, str) and answer.strip():
                        out[sid] = Vote(sid, MODEL_RATER, answer)
    return out


def with_model(votes: Mapping[str, Sequence[Vote]], model: Mapping[str, Vote]) -> dict[str, list[Vote]]:
    """Add the model's vote to every sample that has at least one human vote (the model alone labels nothing)."""
    return {sid: [*vs, model[sid]] if sid in model else list(vs) for sid, vs in votes.items()}


@dataclass
class ConsensusRecord:
    """What consensus.json holds: the method, each sample's decision and each annotator's quality."""

    method: str
    model_rater: bool
    samples: dict[str, Decision] = field(default_factory=dict)
    annotators: dict[str, AnnotatorQuality] = field(default_factory=dict)

    @property
    def multi_annotator(self) -> bool:
        """Whether agreement means anything: some sample has votes from two raters."""
        return any(d.n > 1 for d in self.samples.values())

    def low_confidence(self, threshold: float, max_labels: int) -> list[tuple[str, Decision]]:
        """Samples below the threshold (ties included) that may still get another label, least confident first."""
        rows = [(s, d) for s, d in self.samples.items() if d.confidence < threshold and d.n < max_labels]
        return sorted(rows, key=lambda kv: (kv[1].confidence, kv[0]))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "model_rater": self.model_rater,
                "samples": {s: {"label": d.label, "confidence": round(d.confidence, 6), "votes": d.votes,
                                "outcome": d.outcome} for s, d in sorted(self.samples.items())},
                "annotators": {n: asdict(q) for n, q in sorted(self.annotators.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConsensusRecord:
        return cls(d["method"], bool(d.get("model_rater")),
                   {s: Decision(r["label"], float(r["confidence"]), dict(r["votes"]), r["outcome"])
                    for s, r in d.get("samples", {}).items()},
                   {n: AnnotatorQuality(**q) for n, q in d.get("annotators", {}).items()})


# ------------------------------------------------------------------------------------------------ derive
def _spelled(votes: Mapping[str, Sequence[Vote]], same: Any) -> dict[str, list[Vote]]:
    """Open answers vote by their normalised form ("Seven." and "seven" agree), each spelled as its sample's most
    common spelling, as the importer does."""
    out = {}
    for sid, vs in votes.items():
        spelled = Counter(v.label for v in vs)
        out[sid] = [Vote(v.sample_id, v.annotator,
                         max((a for a in spelled if same(a) == same(v.label)), key=lambda a: (spelled[a], a)))
                    for v in vs]
    return out


def consensus_path(artifacts: str | os.PathLike[str]) -> Path:
    return Path(artifacts) / CONSENSUS_FILE


def read_consensus(artifacts: str | os.PathLike[str]) -> ConsensusRecord | None:
    p = consensus_path(artifacts)
    return ConsensusRecord.from_dict(json.loads(p.read_text(encoding="utf-8"))) if p.is_file() else None


def derive_consensus(artifacts: str | os.PathLike[str], annotate: AnnotateConfig, *, answers: Sequence[str] | None,
                     round_index: int, requeued: set[str] = frozenset()
                     ) -> tuple[ConsensusRecord | None, list[dict[str, Any]]]:
    """(the consensus of every raw vote, the ledger entries it would append), writing nothing; (None, []) without
    votes. See apply_consensus."""
    from pipeline.annotation.ledger import Ledger, ledger_path, make_entry
    from pipeline.meaning import normalize_answer
    from pipeline.store import digest_json

    votes = read_votes(artifacts)
    if not votes:
        return None, []
    same = (lambda x: x) if answers else normalize_answer
    if not answers:
        votes = _spelled(votes, same)
    if annotate.consensus_model_rater:
        votes = with_model(votes, model_votes(artifacts))
    part = CONSENSUS[annotate.consensus]()
    decisions = part.decide(votes)
    ledger = Ledger(ledger_path(artifacts))
    current = ledger.current()
    record = ConsensusRecord(part.name, bool(annotate.consensus_model_rater))
    decide_again = set(decisions) if not part.per_file else set(requeued)
    entries, now, source = [], None, digest_json([part.name, {s: [asdict(v) for v in vs] for s, vs in votes.items()}])
    for sid, d in sorted(decisions.items()):
        prev = current.get(sid)
        if sid not in decide_again and prev is not None:
            # The ledger holds the import's decision: record it, with the share of the votes behind it.
            d = Decision(prev["label"], sum(n for lab, n in d.votes.items() if same(lab) == same(prev["label"])) / d.n,
                         d.votes, d.outcome)
        record.samples[sid] = d
        if sid not in decide_again or d.label is None or (prev is not None and same(prev["label"]) == same(d.label)):
            continue
        humans = [v for v in votes[sid] if v.annotator != MODEL_RATER]
        e = make_entry(sid, d.label, annotator=",".join(sorted({v.annotator for v in humans if v.label == d.label}))
                       or MODEL_RATER, round_index=round_index, source_file=CONSENSUS_FILE,
                       source_digest=source, supersedes=prev,
                       votes=[{"annotator": v.annotator, "label": v.label} for v in votes[sid]], now=now)
        now = e["time"]
        e.pop("entry_id")
        e["consensus"] = {"method": part.name, "confidence": round(d.confidence, 6)}
        e["entry_id"] = digest_json(e)[:16]
        entries.append(e)
    record.annotators = part.annotators(votes, record.samples)
    return record, entries


def apply_consensus(artifacts: str | os.PathLike[str], annotate: Any, *, answers: Sequence[str] | None,
                    round_index: int, requeued: set[str] = frozenset()) -> ConsensusRecord | None:
    """Derive the consensus from every raw vote, record it in consensus.json, and append a ledger entry for each
    sample whose label it changes (kind label/correction, `consensus: {method, confidence}`); None without votes.

    A per-file method (majority) already wrote its labels at import: only samples sent out for another vote
    (`requeued`, the redundancy queue) are decided again over all their votes, so a third opinion settles a tie
    instead of the newest vote winning. A fitted method (dawid_skene) may change any sample. Reads
    annotate.consensus and annotate.consensus_model_rater. Idempotent: with no new vote it appends nothing.
    """
    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.store import atomic_write_json

    record, entries = derive_consensus(artifacts, annotate, answers=answers, round_index=round_index,
                                       requeued=requeued)
    if record is None:
        return None
    if entries:
        Ledger(ledger_path(artifacts)).append(entries)
    atomic_write_json(consensus_path(artifacts), record.to_dict())
    return record


def annotator_rows(record: ConsensusRecord) -> list[dict[str, Any]]:
    """One row per annotator for tables: votes, agreement with the consensus, estimated accuracy."""
    return [{"annotator": q.name, "votes": q.votes, "shared": q.shared, "agreement": q.agreement,
             "accuracy": q.accuracy} for q in record.annotators.values()]


def round_record(record: ConsensusRecord | None) -> dict[str, Any] | None:
    """What round.json keeps of the consensus: method, counts and the annotator table; None while no sample has two
    votes (one annotator per sample: there is no agreement to report, and the round's files stay as they were)."""
    if record is None or not record.multi_annotator:
        return None
    return {"method": record.method, "model_rater": record.model_rater, "samples": len(record.samples),
            "undecided": sum(d.label is None for d in record.samples.values()),
            "mean_confidence": round(sum(d.confidence for d in record.samples.values()) / len(record.samples), 4),
            "annotators": annotator_rows(record)}
