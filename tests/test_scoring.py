"""Scoring with the real tiny 4-bit model: candidate probabilities, MC dropout, open answers, shards on disk."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import scoring
from pipeline.config import ModelConfig
from pipeline.errors import ArtifactError
from pipeline.model.loading import load_model
from pipeline.model.tiny import make_tiny_model
from pipeline.scoring import (
    ClosedSetScorer,
    OpenAnswerScorer,
    agreement_codes,
    concat_scores,
    decode_rgb,
    load_scores,
    plan_shards,
    save_scores,
)

DIGITS = [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_tiny_model("idefics3", tmp_path_factory.mktemp("tiny") / "idefics3")
    return load_model(ModelConfig(name_or_path=str(path), family="idefics3", mode="qlora"))


def _rows(n, size=32):
    rows = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((np.random.RandomState(i).rand(size, size, 3) * 255).astype("uint8")).save(buf, "PNG")
        rows.append({"sample_id": f"s{i:02d}", "prepared": buf.getvalue(), "question": "Which digit is shown in the image?"})
    return rows


def _naive_loglik(loaded, row, answer):
    """One full forward per candidate over prompt + answer: the reference the batched scorer must match."""
    enc = loaded.family.encode(loaded.processor, [decode_rgb(row["prepared"])], [row["question"]], [answer])
    n_ans = len(loaded.family.answer_token_ids(loaded.processor, row["question"], answer))
    start = int(enc["answer_start"][0])
    with torch.no_grad():
        logits = loaded.model(**{k: v for k, v in enc.items() if k not in ("labels", "answer_start")}).logits
    logp = logits.float().log_softmax(-1)[0]
    ids = enc["input_ids"][0]
    return sum(logp[start + j - 1, ids[start + j]].item() for j in range(n_ans)), n_ans


def test_single_token_candidates_match_one_forward_per_candidate(loaded):
    rows = _rows(5)
    res = ClosedSetScorer(loaded, DIGITS).score(rows, batch_size=4)
    assert res.probs.shape == (5, 10) and res.embeddings.shape[0] == 5
    np.testing.assert_allclose(res.probs.sum(1), 1, atol=1e-5)
    for i in (0, 3):
        ll = np.array([_naive_loglik(loaded, rows[i], a)[0] for a in DIGITS])
        ref = np.exp(ll - ll.max()) / np.exp(ll - ll.max()).sum()
        np.testing.assert_allclose(res.probs[i], ref, atol=1e-4)


# Candidates of 1, 2, 1 and 7 tokens with the tiny tokenizer: different lengths pad the continuation forward.
MIXED = ["cat", "dog house", "seven", "a photo of the big red tree"]


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl", "qwen2_5_vl"])
def family_loaded(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp("tiny") / request.param)
    return load_model(ModelConfig(name_or_path=str(path), family=request.param, mode="qlora"))


def _mixed_rows():
    rows = _rows(3)
    rows[1]["question"] = "What is shown in the image?"  # a shorter prompt: the batch's prompts are left-padded
    return rows


def test_multi_token_batch_equals_one_full_forward_per_candidate(family_loaded):
    # The positions of the tokens continuing a cached prompt are the delicate part (Qwen2-VL's M-RoPE numbers text
    # after the image from the image's grid, not from the token count): any offset moves these log-likelihoods by
    # tenths, far beyond the tolerance.
    ld, rows = family_loaded, _mixed_rows()
    lengths = {len(ld.family.answer_token_ids(ld.processor, rows[0]["question"], a)) for a in MIXED}
    assert len(lengths) >= 3 and max(lengths) >= 3
    ref = np.array([[_naive_loglik(ld, r, a) for a in MIXED] for r in rows])  # [n, c, (total, tokens)]
    for normalize in (False, True):
        scorer = ClosedSetScorer(ld, MIXED, length_normalize=normalize)
        res = scorer.score(rows, batch_size=3)
        ll = ref[..., 0] / ref[..., 1] if normalize else ref[..., 0]
        np.testing.assert_allclose(res.probs, np.exp(ll - ll.max(1, keepdims=True))
                                   / np.exp(ll - ll.max(1, keepdims=True)).sum(1, keepdims=True), atol=1e-4)
        batched_ll, _ = scorer.logprobs([decode_rgb(r["prepared"]) for r in rows], [r["question"] for r in rows])
        np.testing.assert_allclose(batched_ll, ll, atol=1e-4)


def test_multi_token_batch_costs_two_forwards_and_splitting_it_changes_nothing(loaded, monkeypatch):
    rows = _mixed_rows()
    calls = []
    hook = loaded.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        whole = ClosedSetScorer(loaded, MIXED).score(rows, batch_size=3)
    finally:
        hook.remove()
    assert len(calls) == 2  # the prompts' forward, then every candidate of every sample in one
    # A batch whose repeated cache would pass the token budget is scored in groups of samples, with the same result.
    monkeypatch.setattr(scoring, "MAX_CONTINUATION_TOKENS", 64)
    split = ClosedSetScorer(loaded, MIXED).score(rows, batch_size=3)
    np.testing.assert_allclose(split.probs, whole.probs, atol=1e-5)
    np.testing.assert_allclose(split.embeddings, whole.embeddings, atol=1e-4)


def test_multi_token_scoring_passes_the_cache_under_its_current_name(loaded):
    # transformers 5 renamed past_key_values to cache; the old name warns on every call (a FutureWarning per
    # forward, and a logged warning on reading it from the output).
    import logging
    import warnings

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: logged.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ClosedSetScorer(loaded, ["cat", "dog house"]).score(_rows(1), batch_size=1)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in logged if "past_key_values" in m]


def test_batching_and_repeat_runs_do_not_change_scores(loaded):
    rows = _rows(6)
    a = ClosedSetScorer(loaded, DIGITS).score(rows, batch_size=1)
    b = ClosedSetScorer(loaded, DIGITS).score(rows, batch_size=6)
    np.testing.assert_allclose(a.probs, b.probs, atol=1e-4)
    np.testing.assert_allclose(a.embeddings, b.embeddings, atol=1e-3)


def test_mc_dropout_gives_k_distinct_passes(tmp_path_factory):
    path = make_tiny_model("idefics3", tmp_path_factory.mktemp("tiny-mc") / "idefics3")
    ld = load_model(ModelConfig(name_or_path=str(path), family="idefics3", mode="qlora", lora_dropout=0.5),
                    trainable=True)
    torch.manual_seed(0)
    for name, p in ld.model.named_parameters():
        if "lora_B" in name:  # a fresh LoRA has B = 0, so dropout on its input would change nothing
            p.data.normal_(0, 0.5)
    ld.model.eval()
    res = ClosedSetScorer(ld, DIGITS).score(_rows(3), batch_size=3, mc_passes=4, seed=1)
    assert res.mc_probs.shape == (3, 10, 4)
    np.testing.assert_allclose(res.mc_probs.sum(1), 1, atol=1e-5)
    assert np.abs(res.mc_probs[..., 0] - res.mc_probs[..., 1]).max() > 1e-4
    again = ClosedSetScorer(ld, DIGITS).score(_rows(3), batch_size=3, mc_passes=4, seed=1)
    np.testing.assert_allclose(res.mc_probs, again.mc_probs, atol=1e-6)  # seeded: reproducible
    assert not any(m.training for m in ld.model.modules())  # dropout switched off again


def test_open_answers_record_token_entropy_and_logprobs(loaded):
    res = OpenAnswerScorer(loaded, max_new_tokens=4, min_new_tokens=1).score(_rows(3), batch_size=2, mc_passes=2)
    assert len(res.answers) == 3 and res.token_entropy.shape[0] == 3
    assert np.isfinite(res.token_entropy[:, 0]).all() and (res.token_entropy[:, 0] > 0).all()
    assert (res.token_logprobs[np.isfinite(res.token_logprobs)] <= 0).all()
    assert np.array(res.mc_answers).shape == (3, 2)
    codes = agreement_codes([["A cat.", "a cat", "dog"]])
    assert codes.tolist() == [[0, 0, 1]]


def test_shards_roundtrip_and_corruption_is_reported(loaded, tmp_path):
    rows = _rows(4)
    res = ClosedSetScorer(loaded, DIGITS).score(rows, batch_size=4)
    save_scores(res, tmp_path / "s0", version="test", inputs={"shard": "x"}, config={"k": 1})
    back = load_scores(tmp_path / "s0")
    assert back.sample_ids == res.sample_ids
    np.testing.assert_array_equal(back.probs, res.probs)
    both = concat_scores([back, back])
    assert both.probs.shape == (8, 10) and len(both.sample_ids) == 8
    (tmp_path / "s0" / "scores.npz").write_bytes(b"torn")
    with pytest.raises(ArtifactError, match="corrupt"):
        load_scores(tmp_path / "s0")
    assert plan_shards(["c", "a", "b", "d", "e"], 2) == [["a", "b"], ["c", "d"], ["e"]]
