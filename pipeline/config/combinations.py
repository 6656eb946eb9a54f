"""Settings that are each valid alone but that a round would refuse together, refused when the config loads.

A selection heuristic reads one kind of score (`pipeline.strategies.heuristics`, each class's `input`); which kinds a
round's scoring produces depends on the answers and on select.mc_dropout_passes:

| answers | scoring produces (the second with mc_dropout_passes ≥ 2) | heuristics that read it |
|---|---|---|
| closed (data.answers) | class probabilities; their MC-dropout samples | least_confidence, margin, entropy; bald |
| open (data.answers: null) | per-token entropies; sampled answers | token_entropy; answer_disagreement, semantic_entropy |

| boxes (data.task: boxes) | the answer's per-token entropies; sampled answers | token_entropy; answer_disagreement |

Under data.task: boxes, `answer_disagreement` is box sample agreement (Hungarian-matched IoU × same class among
sampled answers, `pipeline.boxes.uncertainty.sample_agreement`) and `token_entropy` the answer's mean token entropy;
box answers have no class probabilities and no one meaning to cluster (semantic_entropy).

`random` reads nothing. The `stratified` selector spreads a batch over predicted classes, which open answers have
not. Without this check a round found out at its first selection, after preparing, training and scoring
(`pipeline.selection.round_pair`: "select.strategy … needs …"). `STRATEGY_READS` mirrors each heuristic's `input`
(tests/test_config.py checks that they agree), so the config needs no import of the strategies package.
"""

from __future__ import annotations

from typing import Any

# heuristic → the score it reads (pipeline.strategies.heuristics: each class's `input`)
STRATEGY_READS = {"random": "none", "least_confidence": "probs", "margin": "probs", "entropy": "probs",
                  "bald": "mc_probs", "token_entropy": "token_entropy", "answer_disagreement": "agreement",
                  "semantic_entropy": "meanings"}
CLOSED_READS = frozenset({"probs", "mc_probs"})
OPEN_READS = frozenset({"token_entropy", "agreement", "meanings"})
SAMPLED_READS = frozenset({"mc_probs", "agreement", "meanings"})  # need select.mc_dropout_passes >= 2
OPEN_DEFAULT_STRATEGY = "token_entropy"  # the default select.strategy (entropy) reads class probabilities
BOX_MAX_NEW_TOKENS = 256  # a box answer is ~30 tokens a box: the default 16 cuts off the first one
CLOSED_ONLY_DIVERSITY = frozenset({"stratified"})
BOX_ONLY_DIVERSITY = "class_balanced"  # reads the classes of each answer's boxes
BOX_READS = frozenset({"none", "token_entropy", "agreement"})  # what a box answer's scoring can give
BOX_FIX = "token_entropy, or answer_disagreement (box sample agreement) with select.mc_dropout_passes: 4"

CLOSED_FIX = "least_confidence, margin or entropy (or bald with select.mc_dropout_passes: 4)"
OPEN_FIX = "token_entropy, or semantic_entropy / answer_disagreement with select.mc_dropout_passes: 4"


def box_section_errors(data: Any, augment: Any, labelcheck: Any, annotate: Any = None) -> list[str]:
    """What other sections of a box project cannot do yet: augmented copies (their flips and crops would not move
    the boxes) and the k-fold label check (its fold adapters would train on the label JSON, not the codec's text);
    and a consensus that compares votes as text (box_iou matches boxes), or box_iou on one-answer labels."""
    consensus = getattr(annotate, "consensus", None)
    if data.task != "boxes":
        return [] if consensus != "box_iou" else [
            "annotate.consensus: 'box_iou' matches boxes across annotators, and this project's labels are one "
            "answer per image (data.task is not boxes); use majority, dawid_skene or one_coin"]
    errors = []
    if consensus not in (None, "box_iou"):
        errors.append(f"annotate.consensus: {consensus!r} compares annotators' labels as whole answers, and two "
                      "annotators never draw the same box pixels (data.task: boxes); use box_iou (the default "
                      "there: boxes matched by IoU, kept where most annotators drew one)")
    if augment.copies:
        errors.append(f"augment.copies: {augment.copies} makes flipped and cropped copies of the labeled images, and "
                      "the boxes of data.task: boxes would not follow them; set augment.copies: 0")
    if labelcheck.method == "kfold":
        errors.append("labelcheck.method: 'kfold' trains fold adapters on the labels as they are, and data.task: "
                      "boxes trains on the family codec's text of each label's boxes, which only the train stage "
                      "writes; use heldout (a box project's default: the previous round's adapter judges the labels "
                      "it did not train on) or off")
    return errors


def _box_errors(data: Any, select: Any) -> list[str]:
    """What a box project (data.task: boxes) refuses: strategies that read class probabilities or meanings, and the
    stratified selector (its classes are an image's one predicted answer; a box image has several)."""
    errors = []
    if STRATEGY_READS[select.strategy] not in BOX_READS:
        errors.append(f"select.strategy: {select.strategy!r} reads "
                      f"{'meanings of free-text answers' if select.strategy == 'semantic_entropy' else 'class probabilities'}"
                      f", and data.task: boxes scores box answers (no class probabilities, no one meaning); use "
                      f"{BOX_FIX}, or random")
    if select.diversity in CLOSED_ONLY_DIVERSITY:
        errors.append(f"select.diversity: {select.diversity!r} spreads a batch over one predicted class per image, "
                      "and data.task: boxes predicts several boxes per image; use top_k, cluster_margin, k_center or "
                      "uncertainty_herding")
    if STRATEGY_READS[select.strategy] in SAMPLED_READS and select.mc_dropout_passes < 2:
        errors.append(f"select.strategy: {select.strategy!r} compares box answers sampled under MC dropout, and "
                      f"select.mc_dropout_passes is {select.mc_dropout_passes}; set select.mc_dropout_passes: 4 "
                      "(at least 2), or use token_entropy, which needs none")
    return errors


def combination_errors(data: Any, select: Any) -> list[str]:
    """One sentence per combination of `data` (DataConfig) and `select` (SelectConfig) a round would refuse, each
    naming the fields and the fix; [] when there is none."""
    if data.task == "boxes":
        return _box_errors(data, select)
    errors = []
    if select.diversity == BOX_ONLY_DIVERSITY:
        errors.append(f"select.diversity: {BOX_ONLY_DIVERSITY!r} balances a batch over the classes of predicted boxes, "
                      "and this project's answers are one per image (data.task is not boxes); use stratified for "
                      "class balance over closed answers")
    reads = STRATEGY_READS[select.strategy]
    closed = data.answers is not None
    if closed and reads in OPEN_READS:
        errors.append(f"select.strategy: {select.strategy!r} reads generated free-text answers, and data.answers "
                      f"is a closed set of {len(data.answers)} (scored as class probabilities); use {CLOSED_FIX}, "
                      "or set data.answers: null for open answers")
    if not closed and reads in CLOSED_READS:
        errors.append(f"select.strategy: {select.strategy!r} reads class probabilities, and data.answers is null "
                      f"(open answers, generated as free text); use {OPEN_FIX}, or list data.answers for a closed set")
    if reads in SAMPLED_READS and select.mc_dropout_passes < 2:
        errors.append(f"select.strategy: {select.strategy!r} compares answers sampled under MC dropout, and "
                      f"select.mc_dropout_passes is {select.mc_dropout_passes}; set select.mc_dropout_passes: 4 "
                      f"(at least 2), or use {'margin' if closed else 'token_entropy'}, which needs none")
    if not closed and select.diversity in CLOSED_ONLY_DIVERSITY:
        errors.append(f"select.diversity: {select.diversity!r} spreads a batch over predicted classes, and open "
                      "answers (data.answers: null) have none; use cluster_margin, k_center or uncertainty_herding, "
                      "or list data.answers")
    return errors
