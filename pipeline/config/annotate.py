"""The config sections of the annotation side and of the loop: Label Studio, annotate (consensus, redundancy),
label check, rounds (stopping rules, simulated annotators)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from pipeline.config.base import Section
from pipeline.config.secrets import ENV_NAME, env_reference, redact
from pipeline.config.trigger import TriggerConfig


class LabelStudioConfig(Section):
    """A live Label Studio project a round pushes its batch to and pulls finished annotations from (label-studio-sdk).

    The API token is read only from the environment variable named by `token_env`; it is never written anywhere.
    """

    url: str = "http://127.0.0.1:8080"
    # A project ID, or a title: the project with that title is used, or created with tamis's labeling interface.
    project: int | str = "tamis"
    token_env: str = "LABEL_STUDIO_API_KEY"
    # How annotators see the images: local_files = /data/local-files/ URLs (Label Studio started with local-file
    # serving and annotate.document_root as its document root; tamis attaches the Local Files storage), inline =
    # the image bytes inside the task (no file access needed; for small images).
    images: Literal["local_files", "inline"] = "local_files"

    @model_validator(mode="before")
    @classmethod
    def _token_by_reference(cls, v: Any) -> Any:
        """A token is named, never written: `token: ${VAR}` is read as token_env: VAR; a token in plain text is
        refused, and the message does not repeat it (it reaches Prefect's logs in a deployed run)."""
        if not isinstance(v, dict) or not {"token", "api_key"} & set(v):
            return v
        v = dict(v)
        for key in ("token", "api_key"):
            if key not in v:
                continue
            name = env_reference(v.pop(key))
            if name is None:
                raise ValueError(
                    f"annotate.label_studio.{key}: a token in plain text is refused (its value is not shown); "
                    f"export it in an environment variable and write `{key}: ${{LABEL_STUDIO_API_KEY}}` (or "
                    "`token_env: LABEL_STUDIO_API_KEY`) with that variable's name, and change the token if this "
                    "file was shared")
            v["token_env"] = name
        return v

    @field_validator("token_env")
    @classmethod
    def _names_a_variable(cls, v: str) -> str:
        if not ENV_NAME.fullmatch(v):
            raise ValueError("annotate.label_studio.token_env: must name an environment variable (letters, digits, "
                             "'_'; its value is not shown: it may be the token itself); put the token in a variable "
                             "and name the variable here")
        return v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"annotate.label_studio.url: {redact(v)!r} is not an http(s) URL of a Label Studio "
                             "server")
        if redact(v) != v:  # `config show` and every round's recorded config would print it
            raise ValueError(f"annotate.label_studio.url: {redact(v)!r} carries a user and password (not shown); "
                             "drop them: tamis authenticates with the token in the variable token_env names")
        return v.rstrip("/")


class RedundancyRule(Section):
    """annotate.redundancy: when a sample needs another annotator's vote."""

    # The consensus confidence (majority: share of votes for the winner, a tie included; dawid_skene: posterior
    # probability) below which a sample goes out again.
    threshold: float = Field(default=0.8, gt=0, le=1)
    # Votes a sample may collect in all; at this count it is not sent again, however unsure.
    max_labels: int = Field(default=3, ge=2)


class AnnotateConfig(Section):
    # Label Studio serves local files as /data/local-files/?d=<path relative to its document root>.
    image_url_prefix: str = "/data/local-files/?d="
    # LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT: image paths in tasks are relative to it. None = the artifacts folder.
    document_root: Path | None = None
    # The images annotators see. legible: the original file as it came, re-encoded smaller only when its long side
    # exceeds 2048 px, never upscaled (a sign or a small word stays readable); original: the file byte for byte;
    # prepared: the model's input (e.g. 32 px: fast, but fine print is lost).
    export_images: Literal["legible", "prepared", "original"] = "legible"
    formats: list[Literal["label_studio", "csv", "jsonl", "images"]] = Field(
        default_factory=lambda: ["label_studio", "csv", "jsonl", "images"]
    )
    # Optional live connection (pip install 'tamis[labelstudio]'); None = files only.
    label_studio: LabelStudioConfig | None = None
    consensus: Literal["majority", "dawid_skene", "one_coin", "box_iou"] = Field(
        default="majority",
        description="How several annotators' votes become one label (pipeline/annotation/consensus.py): majority "
                    "(a tie is rejected), dawid_skene (each annotator's confusion matrix estimated, refit over every "
                    "vote) or one_coin (Dawid–Skene with one accuracy per annotator: better with few votes); "
                    "box_iou for box labels (data.task: boxes, its default there): boxes matched by IoU across "
                    "annotators, kept where most drew one.")
    consensus_model_rater: bool = Field(
        default=False, description="Count each round's exported predictions as one more rater named 'model'.")
    redundancy: RedundancyRule | None = Field(
        default=None, description="Send a sample whose consensus confidence is below `threshold` to another "
                                  "annotator with the next export, up to `max_labels` votes; None = never.")

    @model_serializer(mode="wrap")
    def _consensus_defaults_left_out(self, handler: Any) -> Any:
        # The export and relabel stages key their caches on this whole section, and the consensus fields change
        # neither: at their defaults they stay out of the dump, so an existing project keeps its cache keys.
        data = handler(self)
        if isinstance(data, dict):
            for name in ("consensus", "consensus_model_rater", "redundancy"):
                if name in data and getattr(self, name) == type(self).model_fields[name].default:
                    del data[name]
        return data


class LabelCheckConfig(Section):
    """Label checks after each retrain (pipeline.labelcheck). Its own section: changing it never retrains the round."""

    # Out-of-sample probabilities: kfold trains `kfold` extra adapters on the labeled set (fresh, `max_steps` each);
    # heldout (cheap, for models too big to train k times) scores the labels added since the previous round's adapter
    # was trained with that adapter; off skips the checks.
    method: Literal["kfold", "heldout", "off"] = "kfold"
    kfold: int = Field(default=3, ge=2)
    max_steps: int | None = Field(default=None, ge=1)  # None: train.max_steps
    # The top-N likely label errors go back to annotators with the next batch (rounds/NNN/relabel/); 0 = report only.
    # A cap: only issues at least `min_confidence` likely wrong are sent, however many that leaves.
    relabel_top_n: int = Field(default=0, ge=0)
    # Calibrated probability that a label is wrong an issue needs to go into the re-label queue (reported issues are
    # all more likely wrong than right; this bar keeps the annotators' time for the clear cases).
    min_confidence: float = Field(default=0.9, ge=0, le=1)
    # Abstain rule: labels are judged only when the model's out-of-sample accuracy reaches this floor (estimated
    # against the true labels when the kNN signal is good enough to act as a second rater, else its agreement with
    # the labels it checks). Below it the round reports "model not yet accurate enough" and queues nothing; the kNN
    # signal takes part only when its own accuracy reaches the floor too.
    min_oos_accuracy: float = Field(default=0.75, ge=0, le=1)
    # kNN label consistency: the labels of each checked sample's knn_k nearest labeled neighbours in the
    # select.embeddings space (with `model`, the label check's own scoring embeddings); 0 = model signal only.
    knn_k: int = Field(default=5, ge=0)


class StableRule(Section):
    """Stop when successive adapters agree on the stop set (stabilizing predictions, Bloodgood & Vijay-Shanker 2009)."""

    # Cohen's kappa (closed answers) or normalised-answer agreement (open answers) with the previous round's adapter.
    agreement: float = Field(default=0.99, gt=0, le=1)
    # ... reached this many rounds in a row.
    window: int = Field(default=3, ge=1)


class ConvergedRule(Section):
    """Stop when the adapters' predictions on the stop set have (nearly) stopped changing, judged from their trend
    (pipeline.stopping.converged_reason): no agreement level to choose, so it fits a closed-set probe whose
    disagreement keeps falling and a VLM whose retraining noise leaves a floor."""

    # Stop once the forecast share of stop-set answers that all later rounds would still change is at most this.
    # 0.06: chosen on 20 calibration seeds of the digits probe (seeds 100-119, not the benchmark's) as the value
    # that stops at the accuracy plateau on average (benchmarks/annotators.py reports the benchmark's seeds).
    remaining_change: float = Field(default=0.06, gt=0, le=1)
    # Rounds of agreement the trend is fitted on; a disagreement that has not fallen over them (by more than one
    # standard error) has converged. 6, not 4: over 4 rounds a tiny VLM's disagreement floor (~0.12 on 150 test
    # rows) looked converged 3.6 rounds before its token F1 stopped rising (benchmarks/annotators.py).
    window: int = Field(default=6, ge=3)


class SecondsModel(Section):
    """A simulated annotator's seconds per label: base + scale × the sample's `per` property, times a seeded
    per-sample noise factor exp(noise · z), z ~ N(0, 1). Properties: detail = mean absolute gradient of the
    exported image in grey levels on a 0–1 scale; pixels = megapixels of the exported image; question_length =
    words of the question."""

    base: float = Field(default=10.0, ge=0)
    per: Literal["detail", "pixels", "question_length"] = "detail"
    scale: float = Field(default=0.0, ge=0)
    noise: float = Field(default=0.2, ge=0)


class SimulatedAnnotator(Section):
    """One simulated annotator of rounds.simulate_annotators."""

    name: str = Field(min_length=1)
    accuracy: float = Field(default=1.0, ge=0, le=1)  # chance of the true answer; otherwise a uniform wrong one
    seconds: float | SecondsModel = 30.0  # a fixed number of seconds per label, or a model of the sample


class RoundsConfig(Section):
    max_rounds: int = Field(default=5, ge=1, description="Rounds in all, round 0 included: rounds 0 … max_rounds − 1 "
                            "run; round 0 selects without a model, every later round trains on all labels so far, "
                            "and the last trains and evaluates but selects nothing (max_rounds: 3 = 2 exported "
                            "batches, 2 trained adapters)")
    label_budget: int | None = Field(default=None, ge=1)
    # Stop once the annotators' recorded hours (the ledger's times) reach this; None = never on this rule.
    budget_hours: float | None = Field(default=None, gt=0)
    target_metric: float | None = Field(default=None, gt=0, le=1)
    plateau_rounds: int | None = Field(default=None, ge=1)
    simulate_annotator: bool = False
    # Fraction of the simulated annotator's answers flipped to a wrong answer (to see the label checks at work).
    simulate_noise: float = Field(default=0.0, ge=0, le=1)
    # A simulated crowd instead of the one simulated annotator (used where the round's annotators are simulated):
    # each exported sample gets `simulate_redundancy` of them, chosen per sample (seeded), with their accuracy and
    # time. None = the single annotator above.
    simulate_annotators: list[SimulatedAnnotator] | None = None
    simulate_redundancy: int = Field(default=1, ge=1)  # labels per exported sample from the simulated crowd
    cron: str = "0 6 * * 1"
    # A deployed round suspends after its export until the annotators' labels are in (resumed from the Prefect UI or
    # `tamis resume`), then imports them and runs the next round in the same flow run.
    wait_for_labels: bool = False
    # The folder (on the worker's machine) a resumed round may copy its `labels_file` from, besides the artifacts
    # folder: the form can be filled in by anyone who reaches the Prefect API, so it never names any other file.
    labels_from: Path | None = None
    # How long a suspended round waits; past it Prefect ends the run and the next scheduled run picks up.
    wait_timeout_s: int = Field(default=7 * 24 * 3600, ge=60)
    # A seeded sample of this many pool samples, never selected, that each round's adapter predicts: how much
    # successive adapters agree there tells when training has stopped changing, without a labeled test split.
    # 0 = off.
    stop_set: int = Field(default=0, ge=0)
    # Stop once the adapters agree on the stop set (needs rounds.stop_set); None = never on this rule.
    stop_when_stable: StableRule | None = None
    # The default label-free stop: once the stop set's agreement trend says little is left to change. Acts only
    # with a stop set (rounds.stop_set > 0; `tamis init` sizes one to the pool); None = never on this rule.
    stop_when_converged: ConvergedRule | None = Field(default_factory=ConvergedRule)
    # Rounds started by Label Studio's webhooks (`tamis listen`, docs/webhooks.md); None = cron or by hand only.
    trigger: TriggerConfig | None = None

    @model_validator(mode="after")
    def _stable_needs_a_stop_set(self) -> RoundsConfig:
        if self.stop_when_stable is not None and self.stop_set == 0:
            raise ValueError("rounds.stop_when_stable needs rounds.stop_set > 0 (e.g. 500): a stop set of pool samples "
                             "for the adapters to agree on")
        return self


