"""Open answers on the real tiny 4-bit model: batched greedy generation against `model.generate()` one sample at a
time, per-token log-probs against a teacher-forced forward pass, MC-dropout answers, ragged shards on disk, the
open-answer metrics and heuristics, and the demo data."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.annotation.ledger import Ledger
from pipeline.answer_metrics import edit_similarity, exact_match, score_answers, token_f1
from pipeline.config import ModelConfig
from pipeline.model.loading import load_model
from pipeline.scoring import (
    REPLACEMENT,
    OpenAnswerScorer,
    agreement_codes,
    concat_scores,
    decode_rgb,
    decode_whole,
    load_scores,
    make_scorer,
    predictions,
    save_scores,
)
from pipeline.selection import heuristic_input, pool_uncertainty
from pipeline.strategies import get_heuristic

QUESTIONS = ["Write the digit shown in words.", "Is the digit even or odd?", "What is the digit plus one, in words?"]


def _load(tiny_models, mode):
    """The tiny model with a LoRA whose B matrices are non-zero (a fresh LoRA is a no-op, and MC dropout on it would
    change nothing), in eval mode: what scoring sees after a round's training."""
    ld = load_model(ModelConfig(name_or_path=str(tiny_models["idefics3"]), family="idefics3", mode=mode,
                                lora_dropout=0.3), trainable=True)
    torch.manual_seed(0)
    for name, p in ld.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)
    ld.model.eval()
    return ld


@pytest.fixture(scope="module")
def loaded(tiny_models):
    """4-bit QLoRA, as rounds score. Its CPU 4-bit matmul rounds differently for different row counts (a decoding
    step vs a full forward, batch 1 vs 3): measured up to ~0.01 nats on a log-prob, never a different answer here."""
    return _load(tiny_models, "qlora")


@pytest.fixture(scope="module")
def precise(tiny_models):
    """The same LoRA on unquantized fp32 weights: scores equal to float noise, so exact comparisons are possible."""
    return _load(tiny_models, "lora")


def _rows(n):
    rows = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((np.random.RandomState(i).rand(32, 32, 3) * 255).astype("uint8")).save(buf, "PNG")
        # Questions of different lengths: a batch's prompts are padded to the longest one.
        rows.append({"sample_id": f"s{i:02d}", "prepared": buf.getvalue(), "question": QUESTIONS[i % 3]})
    return rows


def _generate_one(loaded, row, max_new_tokens):
    """`model.generate()` on one sample (no padding at all): the reference for batched greedy answers."""
    fam, proc = loaded.family, loaded.processor
    enc = fam.encode(proc, [decode_rgb(row["prepared"])], [row["question"]])
    stop = fam.stop_token_ids(proc)
    with torch.no_grad():
        out = loaded.model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=1, do_sample=False,
                                    eos_token_id=stop, pad_token_id=proc.tokenizer.pad_token_id)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    ids = new[: next((i for i, t in enumerate(new) if t in stop), len(new))]
    # Whole characters: the tiny model's byte-level answers cut at max_new_tokens can end inside one (row 2 here
    # generated 'sky\ufffd$' + the first byte of a character), which the scorer drops (decode_whole).
    return enc, ids, decode_whole(proc.tokenizer, ids).strip()


@pytest.mark.parametrize(("model", "tol"), [("loaded", 1e-2), ("precise", 1e-4)])
def test_batched_greedy_answers_equal_generate_one_at_a_time(model, tol, request):
    ld = request.getfixturevalue(model)
    rows = _rows(6)
    ref = [_generate_one(ld, r, 5)[2] for r in rows]
    assert len(set(ref)) > 1  # the LoRA makes answers depend on the image / question
    tok = ld.processor.tokenizer
    results = []
    old = tok.padding_side
    try:
        # encode pads generation prompts on the left whatever the tokenizer's own side; batch 4 leaves a ragged
        # last batch of 2.
        for side, bs in (("left", 1), ("left", 4), ("right", 6)):
            tok.padding_side = side
            results.append(OpenAnswerScorer(ld, max_new_tokens=5, min_new_tokens=1).score(rows, batch_size=bs))
    finally:
        tok.padding_side = old
    for res in results:
        assert res.answers == ref
        assert not any(a.endswith(REPLACEMENT) for a in res.answers)  # no broken character at the cut
    for res in results[1:]:
        assert (np.isnan(res.token_entropy) == np.isnan(results[0].token_entropy)).all()
        np.testing.assert_allclose(res.token_entropy, results[0].token_entropy, atol=tol, equal_nan=True)
        np.testing.assert_allclose(res.token_logprobs, results[0].token_logprobs, atol=tol, equal_nan=True)
        np.testing.assert_allclose(res.embeddings, results[0].embeddings, atol=1e-3)


def test_token_logprobs_and_entropies_equal_a_teacher_forced_forward(precise):
    loaded, rows = precise, _rows(4)
    res = OpenAnswerScorer(loaded, max_new_tokens=5, min_new_tokens=1).score(rows, batch_size=4)
    for i, row in enumerate(rows):
        enc, ids, text = _generate_one(loaded, row, 5)
        assert text == res.answers[i]
        n = len(ids)
        if n == 0:  # a first token that stops generation is kept as the row's one score
            n = 1
            ids = [int(loaded.family.stop_token_ids(loaded.processor)[0])]
        forced = dict(enc)
        forced["input_ids"] = torch.cat([enc["input_ids"], torch.tensor([ids])], dim=1)
        forced["attention_mask"] = torch.ones_like(forced["input_ids"])
        with torch.no_grad():
            logits = loaded.model(**forced).logits[0].float()
        start = enc["input_ids"].shape[1]
        logp = torch.log_softmax(logits[start - 1 : start - 1 + n], -1)  # position t predicts token t + 1
        lp = logp.gather(-1, torch.tensor(ids[:n])[:, None])[:, 0].numpy()
        ent = (-(logp.exp() * logp).sum(-1)).numpy()
        np.testing.assert_allclose(res.token_logprobs[i, :n], lp, atol=1e-4)
        np.testing.assert_allclose(res.token_entropy[i, :n], ent, atol=1e-4)
        assert np.isnan(res.token_logprobs[i, n:]).all() and np.isnan(res.token_entropy[i, n:]).all()
        assert (ent > 0).all() and (lp <= 0).all()


def test_mc_dropout_answers_are_seeded_and_leave_the_model_in_eval_mode(loaded):
    rows = _rows(6)
    scorer = OpenAnswerScorer(loaded, max_new_tokens=4, min_new_tokens=1)
    a = scorer.score(rows, batch_size=3, mc_passes=4, seed=5)
    b = scorer.score(rows, batch_size=3, mc_passes=4, seed=5)
    assert a.mc_answers == b.mc_answers and np.array(a.mc_answers).shape == (6, 4)
    assert not any(m.training for m in loaded.model.modules())
    greedy = scorer.score(rows, batch_size=3)
    assert greedy.answers == a.answers  # MC passes leave the greedy answers alone
    # Dropout 0.3 on a LoRA with large B changes some answers: the disagreement heuristic sees it.
    codes = agreement_codes(a.mc_answers)
    dis = get_heuristic("answer_disagreement").score(codes)
    assert dis.shape == (6,) and (dis >= 0).all() and (dis <= 0.75).all() and dis.max() > 0
    assert np.array_equal(heuristic_input(a, "answer_disagreement"), codes)


def test_open_shards_save_reload_and_concatenate_with_ragged_token_lengths(loaded, tmp_path):
    rows = _rows(6)
    short = OpenAnswerScorer(loaded, max_new_tokens=2, min_new_tokens=1).score(rows[:3], batch_size=3, mc_passes=2)
    long = OpenAnswerScorer(loaded, max_new_tokens=5, min_new_tokens=1).score(rows[3:], batch_size=3, mc_passes=2)
    assert short.token_entropy.shape[1] == 2 and long.token_entropy.shape[1] > 2
    for name, res in (("a", short), ("b", long)):
        save_scores(res, tmp_path / name, version="test", inputs={"shard": name}, config={"k": 1})
    back = [load_scores(tmp_path / n) for n in ("a", "b")]
    assert back[0].answers == short.answers and back[1].mc_answers == long.mc_answers
    np.testing.assert_array_equal(back[1].token_logprobs, long.token_logprobs)  # NaN padding survives the npz
    both = concat_scores(back)
    width = long.token_entropy.shape[1]
    assert both.sample_ids == [r["sample_id"] for r in rows]
    assert both.token_entropy.shape == (6, width) and both.token_logprobs.shape == (6, width)
    assert both.answers == short.answers + long.answers and both.mc_answers == short.mc_answers + long.mc_answers
    assert np.isnan(both.token_entropy[:3, 2:]).all()
    np.testing.assert_array_equal(both.token_entropy[3:], long.token_entropy)
    # Padding changes nothing a heuristic reads: the concatenated shards score as the shards did one by one.
    h = get_heuristic("token_entropy")
    np.testing.assert_allclose(h.score(both.token_entropy),
                               np.concatenate([h.score(short.token_entropy), h.score(long.token_entropy)]))
    np.testing.assert_allclose(pool_uncertainty(both), h.score(both.token_entropy))
    preds, conf = predictions(both, None)
    assert preds == both.answers and all(c is None or 0 < c <= 1 for c in conf)


def test_make_scorer_generates_for_open_answers_and_the_evaluation_matches_the_scorer(loaded):
    from pipeline.evaluate import evaluate_model

    rows = _rows(5)
    scorer = make_scorer(loaded, None, max_new_tokens=4)
    assert isinstance(scorer, OpenAnswerScorer)
    greedy = scorer.score(rows, batch_size=2).answers
    refs = ["seven", "odd", "eight", "zero", "even"]
    res = evaluate_model(loaded, [{**r, "answer": a} for r, a in zip(rows, refs, strict=True)], None,
                         batch_size=3, max_new_tokens=4)
    assert [p["prediction"] for p in res["predictions"]] == greedy
    assert res["metrics"] == score_answers(greedy, refs, closed=False)
    # Per question (these rows ask several), each metric with its bootstrap interval.
    assert len({r["question"] for r in rows}) > 1 and res["report"]["by"] == "question"
    assert sum(g["n"] for g in res["report"]["groups"]) == 5
    assert set(res["intervals"]) == set(res["metrics"])
    assert all(lo <= res["metrics"][m] <= hi for m, (lo, hi) in res["intervals"].items())


def test_open_answer_metrics():
    preds, refs = ["Seven.", "sevn", "the odd one", None], ["seven", "seven", "odd", "eight"]
    assert exact_match(preds, refs) == 0.25
    assert token_f1(preds, refs) == pytest.approx((1 + 0 + 2 * (1 / 2) * 1 / (1 / 2 + 1) + 0) / 4)
    # "sevn" is one deletion from "seven": 1 - 1/5; "odd one" vs "odd": 1 - 4/7; "" vs "eight": 0.
    assert edit_similarity(preds, refs) == pytest.approx((1 + 0.8 + (1 - 4 / 7) + 0) / 4)
    assert edit_similarity(["", "abc"], ["", "abc"]) == 1.0


def test_open_demo_data_asks_three_questions_with_free_text_answers(tmp_path):
    from pipeline.data.demo import NUMBER_WORDS, OPEN_QUESTIONS, write_digits
    from pipeline.schema import sample_id_for

    out = write_digits(tmp_path / "open", limit=60, open_answers=True)
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    truth = [json.loads(x) for x in (out / "ground_truth.jsonl").read_text().splitlines()]
    assert {r["question"] for r in manifest} == set(OPEN_QUESTIONS)
    assert all((r["answer"] == t["answer"]) for r, t in zip(manifest, truth, strict=True) if r["split"] == "test")
    assert not any("answer" in r for r in manifest if r["split"] == "pool")
    answers = {t["answer"] for t in truth}
    assert {"even", "odd"} <= answers and answers <= set(NUMBER_WORDS) | {"even", "odd"}
    for r, t in zip(manifest, truth, strict=True):
        assert t["sample_id"] == sample_id_for((out / r["image"]).read_bytes(), r["question"])
    # The same images as the closed demo, and the same split; a re-run writes the same bytes.
    closed = write_digits(tmp_path / "closed", limit=60)
    closed_rows = [json.loads(x) for x in (closed / "manifest.jsonl").read_text().splitlines()]
    assert [(r["image"], r["split"]) for r in closed_rows] == [(r["image"], r["split"]) for r in manifest]
    before = (out / "manifest.jsonl").read_bytes()
    write_digits(tmp_path / "open", limit=60, open_answers=True)
    assert (out / "manifest.jsonl").read_bytes() == before


def test_open_label_check_flags_consistent_disagreement_and_abstains_when_the_model_is_weak():
    from pipeline.labelcheck import detect_open_label_issues

    truth = ["seven", "odd", "eight", "two", "even", "nine", "one", "three", "zero", "six"] * 2
    given = list(truth)
    given[3], given[10] = "three", "Seven"  # one wrong label, one right label typed differently
    ids = [f"s{i:02d}" for i in range(len(truth))]
    # A strong model: its greedy and 3 MC answers are right (formatted its own way), but unsure on two samples.
    answers = [[t.upper() + ".", t, t, t] for t in truth]
    answers[5] = ["nine", "one", "seven", "nine"]  # inconsistent: never judged against its label
    answers[3] = ["two", "two", "two", "tow"]  # consistent (3/4) on "two": the label "three" is flagged
    det, cols = detect_open_label_issues(answers, given, sample_ids=ids, min_oos_accuracy=0.75)
    assert det.abstained is None and det.oos_accuracy >= 0.9
    assert [(i.sample_id, i.given_label, i.suggested_label) for i in det.issues] == [("s03", "three", "two")]
    assert det.issues[0].suggested_prob == 0.75 and det.issues[0].given_prob == 0.0
    assert 0.3 <= det.issues[0].confidence <= 0.75  # capped by the model's own consistency
    assert cols.shape == (20, 2) and cols[10].tolist() == [1.0, 1.0]  # "Seven" equals "seven" after normalising
    assert det.ranking[0] == "s03"
    # A weak model (greedy answers mostly wrong): the check abstains and reports nothing, whatever it thinks.
    weak = [["four"] * 4 for _ in truth]
    det, _ = detect_open_label_issues(weak, given, sample_ids=ids, min_oos_accuracy=0.75)
    assert det.issues == [] and det.abstained.startswith("model not yet accurate enough to judge labels (OOS accuracy")


def test_typed_answers_import_verbatim_and_compare_normalised(tmp_path):
    from pipeline.annotation.labels import import_labels
    from pipeline.annotation.ledger import Ledger

    def task(i, sid, *typed):
        anns = [{"id": 10 * i + j, "completed_by": who, "was_cancelled": False,
                 "result": [{"from_name": "answer", "to_name": "image", "type": "textarea",
                             "value": {"text": [text]}}]} for j, (who, text) in enumerate(typed)]
        return {"id": i, "data": {"sample_id": sid, "image": f"/data/{sid}.png"}, "annotations": anns}

    ledger = Ledger(tmp_path / "labels.jsonl")
    first = tmp_path / "export-1.json"
    first.write_text(json.dumps([task(1, "a", ("ann", "Seven."), ("bob", "seven")),
                                 task(2, "b", ("ann", "  The odd one "))]))
    rep = import_labels(first, known_ids={"a", "b"}, answers=None, ledger=ledger, round_index=1,
                        rejections_dir=tmp_path / "rej")
    # Two spellings of one answer are no conflict; the ledger keeps what people typed (one of their spellings).
    assert not rep.conflicts and not rep.rejected and len(rep.accepted) == 2
    assert ledger.labels() == {"a": "seven", "b": "The odd one"}
    again = tmp_path / "export-2.json"
    again.write_text(json.dumps([task(3, "a", ("cid", "SEVEN"))]))
    rep = import_labels(again, known_ids={"a", "b"}, answers=None, ledger=ledger, round_index=2,
                        rejections_dir=tmp_path / "rej")
    assert rep.unchanged == ["a"] and not rep.accepted  # the same answer typed another way changes nothing
    fix = tmp_path / "export-3.json"
    fix.write_text(json.dumps([task(4, "a", ("cid", "eight"))]))
    rep = import_labels(fix, known_ids={"a", "b"}, answers=None, ledger=ledger, round_index=2,
                        rejections_dir=tmp_path / "rej")
    assert [e["label"] for e in rep.accepted] == ["eight"] and ledger.labels()["a"] == "eight"


# ------------------------------------------------------------------------------- the open-answer benchmark
def _bench():
    from pathlib import Path

    from benchmarks import label_efficiency

    return label_efficiency, Path(__file__).resolve().parent.parent / "configs" / "label_efficiency_open.yaml"


def _open_bench_config(tmp_path, mutate):
    import yaml

    _, path = _bench()
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    mutate(data)
    out = tmp_path / "bench-open.yaml"
    out.write_text(yaml.safe_dump(data), encoding="utf-8")
    return out


def test_open_benchmark_config_loads_and_rejects_what_open_answers_cannot_do(tmp_path):
    from pipeline.errors import ConfigError

    le, path = _bench()
    cfg, bench = le.load_bench_config(path)
    assert cfg.data.answers is None and bench.metric == "token_f1" and len(bench.seeds) >= 3
    assert bench.baseline == "random" and {"token_entropy", "answer_disagreement"} <= {
        s.strategy for s in bench.strategies.values()}
    assert {"cluster_margin"} <= {s.diversity for s in bench.strategies.values()}
    for mutate, fragment in [
        (lambda d: d["benchmark"].update(longtail={"imbalance": 20}), "benchmark.longtail: null"),
        (lambda d: d["benchmark"].update(reference_learner=True), "reference_learner: false"),
        (lambda d: d["benchmark"]["strategies"].update(m={"strategy": "margin"}),
         "use one of ['answer_disagreement', 'random', 'semantic_entropy', 'token_entropy']"),
        (lambda d: d["benchmark"].update(metric="accuracy"), "needs a closed answer set"),
    ]:
        with pytest.raises(ConfigError) as err:
            le.load_bench_config(_open_bench_config(tmp_path, mutate))
        assert fragment in str(err.value)


@pytest.mark.slow
def test_tiny_open_benchmark_run_goes_through_text_export_typed_answers_and_the_ledger(tmp_path):
    le, _ = _bench()

    def tiny(d):
        d["project"]["paths"]["artifacts"] = str(tmp_path / "work")
        d["project"]["model"]["name_or_path"] = str(tmp_path / "tiny-idefics3")
        d["project"]["select"]["embeddings"] = {"source": "pool", "encoder": {"epochs": 1, "batch_size": 32}}
        d["benchmark"]["quick"] = {"seeds": [0, 1], "rounds": 1, "initial": 8, "batch": 6, "test_size": 20,
                                   "pool_size": 60, "train_steps": 2, "bootstrap": 100,
                                   "strategies": ["random", "token_entropy", "answer_disagreement_cluster"]}

    out = tmp_path / "res.json"
    result = le.main(["--config", str(_open_bench_config(tmp_path, tiny)), "--quick", "--json-out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["metric"] == "token_f1" and result["answers"] == "open" and result["chance_accuracy"] is None
    assert {"best_ratio_95", "best_ratio_95_ci", "baseline_cold_start", "full_data_accuracy"} <= set(result)
    assert "longtail" not in result and "reference_learner" not in result
    for name in ("random", "token_entropy", "answer_disagreement_cluster"):
        assert result["strategies"][name]["labels"] == [8, 14]
    runs = sorted((tmp_path / "work" / "runs").iterdir())
    assert len(runs) == 2 * 4  # seeds × (full data + 3 strategies)
    truth = {}
    for run in runs:
        ledger = Ledger(run / "labels.jsonl").entries()  # committed entries, not the batch records
        tasks = [t for f in sorted(run.glob("rounds/*/export/label_studio_tasks.json"))
                 for t in json.loads(f.read_text())]
        assert sorted(e["sample_id"] for e in ledger) == sorted(t["data"]["sample_id"] for t in tasks)
        assert "<TextArea" in next(run.glob("rounds/000/export/label_config.xml")).read_text()
        truth.update({e["sample_id"]: e["label"] for e in ledger})
    assert set(truth.values()) - {"even", "odd"}
    # Round 1 of the uncertainty strategies was picked from generated answers: their pre-annotations are text.
    sel = [t for run in runs if "token_entropy" in run.name
           for t in json.loads((run / "rounds/001/export/label_studio_tasks.json").read_text())]
    assert sel and all(p["result"][0]["type"] == "textarea" for t in sel for p in t["predictions"])


def test_cli_demo_data_open_writes_the_open_variant(tmp_path):
    from typer.testing import CliRunner

    from flows.cli.main import app
    from pipeline.data.demo import OPEN_QUESTIONS

    res = CliRunner().invoke(app, ["demo-data", "--open", "--out", str(tmp_path / "d"), "--limit", "12"])
    assert res.exit_code == 0, res.output
    assert "wrote 12 open-answer digit images" in res.output
    rows = [json.loads(x) for x in (tmp_path / "d" / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["question"] for r in rows} <= set(OPEN_QUESTIONS)
