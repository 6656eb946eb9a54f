"""Model families on the tiny checkpoints: detection, prompts, answer-token masking, aspect-keeping image settings."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from pipeline.errors import ModelError
from pipeline.model.families import FAMILIES, IGNORE_INDEX, detect_family, get_family

QUESTION = "Which digit is shown in the image?"
FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def processors(tiny_models):
    return {f: AutoProcessor.from_pretrained(p) for f, p in tiny_models.items()}


def _images():
    # A square and a wide image: the batch needs padding and (for Qwen) different image-token counts.
    return [Image.new("RGB", (32, 32), (200, 30, 30)), Image.new("RGB", (32, 16), (30, 200, 30))]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_detect_family_from_checkpoint(tiny_models, family):
    assert detect_family(tiny_models[family]) == family


def test_detect_family_smolvlm_and_errors(tmp_path):
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text(json.dumps({"model_type": "smolvlm"}))
    assert detect_family(tmp_path / "smol") == "idefics3"

    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ModelError, match=r"'llava' is not a supported family; supported: idefics3.*qwen2_vl.*qwen2_5_vl"):
        detect_family(tmp_path / "llava")

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        detect_family(tmp_path / "empty")
    with pytest.raises(ModelError, match="unknown model family 'llama'"):
        get_family("llama")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_answer_tokens_are_the_only_labels(processors, family):
    fam, proc = get_family(family), processors[family]
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


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generation_prompt_is_left_padded_without_labels(processors, family):
    fam, proc = get_family(family), processors[family]
    images = _images() if family != "idefics3" else _images()[:1] * 2
    questions = [QUESTION, "What?"]
    enc = fam.encode(proc, images, questions)
    assert "labels" not in enc and "answer_start" not in enc
    mask = enc["attention_mask"]
    assert mask[:, -1].all(), "every row must end on a real token (left padding)"
    assert not mask[:, 0].all(), "rows of different lengths must be padded on the left"
    cue = fam.prompt(proc, QUESTION)[-6:]
    for i in range(2):
        text = proc.tokenizer.decode(enc["input_ids"][i][mask[i].bool()])
        assert text.endswith(cue)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_digit_answers_are_single_distinct_tokens(processors, family):
    fam, proc = get_family(family), processors[family]
    ids = [fam.answer_token_ids(proc, QUESTION, str(d)) for d in range(10)]
    assert all(len(t) == 1 for t in ids), ids
    assert len({t[0] for t in ids}) == 10
    assert fam.end_token_id(proc) in fam.stop_token_ids(proc)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_keeps_aspect_ratio(processors, family):
    fam, proc = get_family(family), processors[family]
    enc = fam.encode(proc, [Image.new("RGB", (32, 16))], [QUESTION])  # width 32, height 16
    t, h, w = enc["image_grid_thw"][0].tolist()
    assert (t, w / h) == (1, 2.0)
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((enc["input_ids"] == image_id).sum()) == h * w // 4


def test_idefics3_one_tile_for_small_images_split_for_large(processors):
    fam, proc = get_family("idefics3"), processors["idefics3"]
    tile = fam.tile_size(proc)
    assert fam.processor_kwargs(tile, tile=tile)["do_image_splitting"] is False
    assert fam.processor_kwargs(4 * tile, tile=tile)["do_image_splitting"] is True
    enc = fam.encode(proc, [Image.new("RGB", (tile, tile))], [QUESTION])
    assert enc["pixel_values"].shape[1] == 1  # the global tile only
    assert fam.square_tiles


def test_lora_target_is_scoped_to_the_language_model():
    import re

    fam = get_family("qwen2_5_vl")
    pattern = fam.lora_target()
    assert re.fullmatch(pattern, "model.language_model.layers.0.mlp.down_proj")
    assert re.fullmatch(pattern, "model.language_model.layers.1.self_attn.q_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.mlp.down_proj")
    assert not re.fullmatch(pattern, "lm_head")
    assert re.fullmatch(get_family("idefics3").lora_target(["q_proj"]), "model.text_model.layers.0.self_attn.q_proj")


def test_encode_rejects_mismatched_batches(processors):
    fam, proc = get_family("idefics3"), processors["idefics3"]
    with pytest.raises(ModelError, match="2 images, 1 questions and no answers"):
        fam.encode(proc, _images(), [QUESTION])
    with pytest.raises(ModelError, match="row 0: answer is .*non-empty"):
        fam.encode(proc, _images()[:1], [QUESTION], [""])
