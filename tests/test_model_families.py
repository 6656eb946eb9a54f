"""Model families on the tiny checkpoints: one contract class run for every registered family.

A new family is tested by being registered (and given a tiny builder in pipeline/model/tiny.py): detection, prompts,
answer-token masking, the real 4-bit QLoRA path (load, one training step where the loss falls, closed-set scoring
equal to the naive loop, open-answer generation), the vision-tower embeddings and the memory planner's estimate.
A whole tiny round per family is `slow`.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from transformers import AutoProcessor

from pipeline.config import ModelConfig
from pipeline.errors import ModelError
from pipeline.model.families import FAMILIES, IGNORE_INDEX, detect_family, get_family
from pipeline.model.hardware import Hardware
from pipeline.model.loading import load_model

QUESTION = "Which digit is shown in the image?"
DIGITS = [str(d) for d in range(10)]
CPU = Hardware("cpu", [], 2, 8 << 30)
# SmolVLM2's processor imports num2words (for its video prompts) and refuses to build without it.
NEEDS = {"smolvlm": "num2words"}


def _family_params():
    out = []
    for name in FAMILIES:
        marks = []
        if name in NEEDS:
            try:
                __import__(NEEDS[name])
            except ImportError:
                marks = [pytest.mark.skip(reason=f"{name}: the processor needs `pip install {NEEDS[name]}`")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


FAMILY_PARAMS = _family_params()


def _images():
    # A square and a wide image: the batch needs padding and (for grid families) different image-token counts.
    return [Image.new("RGB", (32, 32), (200, 30, 30)), Image.new("RGB", (32, 16), (30, 200, 30))]


def _png(i: int, size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(i).rand(size, size, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _rows(n: int) -> list[dict]:
    return [{"sample_id": f"s{i:02d}", "prepared": _png(i), "question": QUESTION} for i in range(n)]


@pytest.fixture(scope="module")
def processors(tiny_models):
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = AutoProcessor.from_pretrained(tiny_models[family])
        return cache[family]

    return get


@pytest.fixture(scope="module")
def inference(tiny_models):
    """family → the tiny model loaded frozen in 4-bit (NF4), as scoring loads it; once per family."""
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = load_model(ModelConfig(name_or_path=str(tiny_models[family]), mode="qlora"), hw=CPU)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILY_PARAMS)
class TestFamilyContract:
    def test_detected_from_its_checkpoint(self, tiny_models, family):
        assert detect_family(tiny_models[family]) == family
        fam = get_family(family)
        assert fam.name == family and fam.model_types
        for scope in (fam.language_model_scope, fam.projector_scope, fam.vision_scope):
            re.compile(scope)

    def test_answer_tokens_are_the_only_labels(self, processors, family):
        fam, proc = get_family(family), processors(family)
        answers = ["3", "seven"]
        enc = fam.encode(proc, _images(), [QUESTION, QUESTION], answers)
        tok = proc.tokenizer
        end_id = fam.end_token_id(proc)
        for i, answer in enumerate(answers):
            labels, start = enc["labels"][i], int(enc["answer_start"][i])
            kept = (labels != IGNORE_INDEX).nonzero().flatten()
            # Contiguous run from answer_start, ending on the end-of-turn token.
            assert kept.tolist() == list(range(start, start + len(kept)))
            assert int(labels[kept[-1]]) == end_id
            assert tok.decode(labels[kept[:-1]]).strip() == answer
            assert tok.decode(labels[kept]).endswith(fam.end_token)
            # The labels copy the input tokens, and everything before the answer is the prompt alone.
            assert torch.equal(labels[kept], enc["input_ids"][i, kept])
            prompt = fam.prompt(proc, QUESTION)
            assert tok.decode(enc["input_ids"][i, :start]).endswith(prompt[-8:])
        assert (enc["attention_mask"].sum(1) > 0).all()
        assert (enc["labels"][enc["attention_mask"] == 0] == IGNORE_INDEX).all()
        # Every row carries its image's placeholder tokens.
        image_id = tok.convert_tokens_to_ids(fam.image_token)
        assert ((enc["input_ids"] == image_id).sum(1) > 0).all()

    def test_generation_prompt_is_left_padded_without_labels(self, processors, family):
        fam, proc = get_family(family), processors(family)
        enc = fam.encode(proc, _images()[:1] * 2, [QUESTION, "What?"])
        assert "labels" not in enc and "answer_start" not in enc
        mask = enc["attention_mask"]
        assert mask[:, -1].all(), "every row must end on a real token (left padding)"
        assert not mask[:, 0].all(), "rows of different lengths must be padded on the left"
        cue = fam.prompt(proc, QUESTION)[-6:]
        for i in range(2):
            text = proc.tokenizer.decode(enc["input_ids"][i][mask[i].bool()])
            assert text.endswith(cue)

    def test_digit_answers_are_single_distinct_tokens(self, processors, family):
        fam, proc = get_family(family), processors(family)
        ids = [fam.answer_token_ids(proc, QUESTION, d) for d in DIGITS]
        assert all(len(t) == 1 for t in ids), ids
        assert len({t[0] for t in ids}) == 10
        assert fam.end_token_id(proc) in fam.stop_token_ids(proc)

    def test_lora_targets_only_the_language_model(self, inference, family):
        fam = get_family(family)
        names = [n for n, m in inference(family).model.named_modules() if type(m).__name__ == "Linear4bit"]
        pattern = re.compile(fam.lora_target())
        hit = [n for n in names if pattern.fullmatch(n)]
        assert hit and all(re.search(rf"(?:^|\.){fam.language_model_scope}\.", n) for n in hit)
        assert not [n for n in hit if re.search(rf"(?:^|\.){fam.vision_scope}\.", n)]
        # The vision tower is where its scope says (so `model.train` can reach it).
        assert any(re.search(rf"(?:^|\.){fam.vision_scope}\.", n) for n, _ in inference(family).model.named_modules())

    def test_one_4bit_qlora_step_lowers_the_loss(self, tiny_models, family):
        from pipeline.scoring import decode_rgb

        ld = load_model(ModelConfig(name_or_path=str(tiny_models[family]), mode="qlora"), trainable=True, hw=CPU)
        assert ld.info["quantized"] and ld.info["family"] == family
        assert 0 < ld.info["trainable_params"] < ld.info["total_params"]
        rows = _rows(2)
        enc = ld.family.encode(ld.processor, [decode_rgb(r["prepared"]) for r in rows], [QUESTION] * 2, ["3", "7"])
        inputs = {k: v for k, v in enc.items() if k != "answer_start"}
        params = [p for p in ld.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        ld.model.train()
        before = ld.model(**inputs).loss
        before.backward()
        opt.step()
        with torch.no_grad():
            after = ld.model(**inputs).loss
        assert torch.isfinite(before) and float(after) < float(before), (float(before), float(after))

    def test_closed_set_scores_equal_the_naive_loop(self, inference, family):
        from pipeline.scoring import ClosedSetScorer, decode_rgb

        ld = inference(family)
        rows = _rows(3)
        res = ClosedSetScorer(ld, DIGITS).score(rows, batch_size=2)
        assert res.probs.shape == (3, 10)
        np.testing.assert_allclose(res.probs.sum(1), 1, atol=1e-5)
        for i in (2,):
            ll = []
            for a in DIGITS:  # one full forward per candidate over prompt + answer
                enc = ld.family.encode(ld.processor, [decode_rgb(rows[i]["prepared"])], [QUESTION], [a])
                start = int(enc["answer_start"][0])
                with torch.no_grad():
                    logits = ld.model(**{k: v for k, v in enc.items() if k not in ("labels", "answer_start")}).logits
                ll.append(logits.float().log_softmax(-1)[0, start - 1, enc["input_ids"][0, start]].item())
            ll = np.array(ll)
            ref = np.exp(ll - ll.max()) / np.exp(ll - ll.max()).sum()
            np.testing.assert_allclose(res.probs[i], ref, atol=1e-4)

    def test_open_answers_are_generated(self, inference, family):
        from pipeline.scoring import OpenAnswerScorer

        res = OpenAnswerScorer(inference(family), max_new_tokens=3, min_new_tokens=1).score(_rows(2), batch_size=2)
        assert len(res.answers) == 2 and all(isinstance(a, str) for a in res.answers)
        assert np.isfinite(res.token_logprobs[:, 0]).all()  # at least one token generated per row

    def test_vision_tower_gives_one_row_per_image(self, inference, family):
        ld = inference(family)
        ims = [Image.open(io.BytesIO(_png(i))).convert("RGB") for i in range(3)]
        x = ld.family.image_features(ld.model, ld.processor, ims)
        assert x.shape == (3, ld.model.config.vision_config.hidden_size) and torch.isfinite(x).all()
        assert not torch.allclose(x[0], x[1])
        torch.testing.assert_close(ld.family.image_features(ld.model, ld.processor, ims[2:])[0], x[2],
                                   atol=1e-4, rtol=1e-4)

    def test_planner_weights_match_the_4bit_footprint(self, tiny_models, inference, family):
        from pipeline.model.planner import PlanInputs, analyze, plan

        shape = analyze(tiny_models[family])
        assert shape.family == family
        p = plan(shape, PlanInputs(mode="qlora", precision="fp32", device="cpu", image_size=32, seq_len=32))
        footprint = inference(family).model.get_memory_footprint()
        stored = p.terms["weights_nf4"] + p.terms["weights_other"]
        assert abs(stored - footprint) / footprint < 0.10, (stored, footprint)
        assert p.trainable_params > 0 and p.total > p.weights

    def test_planned_image_tokens_match_the_processor(self, tiny_models, processors, family):
        from pipeline.model.planner import analyze, image_token_counts

        fam, proc = get_family(family), processors(family)
        shape = analyze(tiny_models[family])
        image_id = proc.tokenizer.convert_tokens_to_ids(fam.image_token)
        for size in (32, 64):
            enc = fam.encode(proc, [Image.new("RGB", (size, size))], [QUESTION])
            actual = int((enc["input_ids"] == image_id).sum())
            planned, patches = image_token_counts(shape, size)
            # The planner also counts the markers around each tile or image (at most 3 per tile, 5 tiles at 64 px).
            assert actual <= planned <= actual + 15, (size, planned, actual)
            assert patches > 0


def test_smolvlm_and_idefics3_are_told_apart(tmp_path):
    for model_type, family in (("smolvlm", "smolvlm"), ("idefics3", "idefics3")):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert detect_family(tmp_path / model_type) == family


def test_detect_family_errors(tmp_path):
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ModelError, match=r"'llava' is not a supported family; supported: idefics3.*qwen3_vl.*"
                                         r"model.family: auto"):
        detect_family(tmp_path / "llava")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        detect_family(tmp_path / "empty")
    with pytest.raises(ModelError, match="unknown model family 'llama'"):
        get_family("llama")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_grid_families_keep_aspect_ratio(processors, family):
    fam, proc = get_family(family), processors(family)
    enc = fam.encode(proc, [Image.new("RGB", (32, 16))], [QUESTION])  # width 32, height 16
    t, h, w = enc["image_grid_thw"][0].tolist()
    assert (t, w / h) == (1, 2.0)
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((enc["input_ids"] == image_id).sum()) == h * w // 4


def test_idefics3_one_tile_for_small_images_split_for_large(processors):
    fam, proc = get_family("idefics3"), processors("idefics3")
    tile = fam.tile_size(proc)
    assert fam.processor_kwargs(tile, tile=tile)["do_image_splitting"] is False
    assert fam.processor_kwargs(4 * tile, tile=tile)["do_image_splitting"] is True
    enc = fam.encode(proc, [Image.new("RGB", (tile, tile))], [QUESTION])
    assert enc["pixel_values"].shape[1] == 1  # the global tile only
    assert fam.square_tiles


def test_llava_onevision_answer_follows_the_generation_prompt(processors):
    # Its template renders the answered turn as "assistant \n…", the generation prompt as "assistant\n": the answer
    # is appended to the generation prompt, which is what the model sees when it generates.
    fam, proc = get_family("llava_onevision"), processors("llava_onevision")
    assert fam.answer_rendering(proc, QUESTION, "3") == "appended"
    assert fam.prompt(proc, QUESTION, "3") == fam.prompt(proc, QUESTION) + "3" + fam.end_token
    assert get_family("qwen2_vl").answer_rendering(processors("qwen2_vl"), QUESTION, "3") == "template"


def test_lora_target_is_scoped_to_the_language_model():
    fam = get_family("qwen2_5_vl")
    pattern = fam.lora_target()
    assert re.fullmatch(pattern, "model.language_model.layers.0.mlp.down_proj")
    assert re.fullmatch(pattern, "model.language_model.layers.1.self_attn.q_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.mlp.down_proj")
    assert not re.fullmatch(pattern, "lm_head")
    assert re.fullmatch(get_family("idefics3").lora_target(["q_proj"]), "model.text_model.layers.0.self_attn.q_proj")


def test_encode_rejects_mismatched_batches(processors):
    fam, proc = get_family("idefics3"), processors("idefics3")
    with pytest.raises(ModelError, match="2 images, 1 questions and no answers"):
        fam.encode(proc, _images(), [QUESTION])
    with pytest.raises(ModelError, match="row 0: answer is .*non-empty"):
        fam.encode(proc, _images()[:1], [QUESTION], [""])


# ------------------------------------------------------------------------------------------------ whole rounds
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_two_tiny_rounds_per_family(tmp_path, tiny_models, prefect_harness, family):
    """Round 0 (cold start, simulated labels) then round 1: train the 4-bit adapter, score the pool, select."""
    from flows.round import labeling_round
    from pipeline.data.demo import write_digits

    digits = write_digits(tmp_path / "digits", limit=40)
    shutil.copytree(tiny_models[family], tmp_path / "model")
    cfg = {
        "seed": 0,
        "paths": {"artifacts": str(tmp_path / "artifacts")},
        "data": {"sources": [{"kind": "jsonl", "path": str(digits / "manifest.jsonl")}], "answers": DIGITS,
                 "question": QUESTION, "ground_truth": str(digits / "ground_truth.jsonl")},
        "preprocess": {"size": 32, "pad": "square"},
        "model": {"name_or_path": str(tmp_path / "model"), "family": family, "mode": "qlora"},
        "train": {"batch_size": 2, "effective_batch_size": 2, "max_steps": 2, "learning_rate": 0.002},
        "select": {"batch_size": 6, "strategy": "margin", "diversity": "cluster_margin", "shard_size": 16,
                   "embeddings": "vision_tower"},
        "rounds": {"max_rounds": 3, "simulate_annotator": True},
    }
    (tmp_path / "tamis.yaml").write_text(yaml.safe_dump(cfg))
    first = labeling_round(str(tmp_path / "tamis.yaml"))
    assert first["round"] == 0 and first["selected"] == 6
    second = labeling_round(str(tmp_path / "tamis.yaml"))
    assert second["round"] == 1 and second["labeled"] == 6 and second["selected"] == 6
    assert set(second["metrics"]) >= {"accuracy"}
