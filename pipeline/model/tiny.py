"""Tiny random-weight models of the real architectures, built offline, for tests, the demo and CI.

Each is a real checkpoint folder (config, safetensors weights, tokenizer, the family's processor, chat template) that
`AutoProcessor` / `AutoModelForImageTextToText` load exactly like a hub download, in 4-bit too. The tokenizer is a
byte-level BPE trained here on a few hundred words; every digit answer ("3", and " 3" as it follows SmolVLM's
"Assistant:") is one token, so scoring can read candidates from one next-token distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import ModelError
from pipeline.model.families import Family, get_family
from pipeline.store import atomic_dir, atomic_write_json

log = logging.getLogger(__name__)

DEFAULT_IMAGE_SIZE = 32
# Vision patch size per family: a 32-px image gives 16 patches → 4 image tokens after the 2x2 merge / pixel shuffle.
PATCH = 8
MERGE = 2
VOCAB_SIZE = 1024
HEAD_GAIN = 3.0
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
# Context length: room for one image's tokens plus the prompt, the answer and the chat template's markers, and never
# below 1,024. A 512-px image alone is 1,024 image tokens, so a fixed 1,024 made the tokenizer warn (1046 > 1024).
MIN_CONTEXT = 1024
TEXT_TOKENS = 512
# bitsandbytes' CPU inference kernel packs 4-bit weights in blocks: every quantized layer needs in_features % 64 == 0
# and out_features % 32 == 0, so no width below 64.
VISION = {"hidden_size": 64, "intermediate_size": 128}
# Tokenizer roles per family where they differ from the Qwen/SmolLM markup; named extras become tokenizer attributes.
TOKEN_ROLES: dict[str, dict[str, str]] = {
    "gemma3": {"bos_token": "<bos>", "pad_token": "<pad>", "boi_token": "<start_of_image>",
               "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "internvl": {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                 "video_token": "<video>"},
}
VOCAB_WORDS: tuple[str, ...] = (
    "the", "a", "an", "is", "are", "was", "of", "in", "on", "at", "to", "and", "or", "not", "no", "yes", "it", "this",
    "that", "what", "which", "who", "where", "how", "many", "much", "there", "here", "image", "picture", "photo",
    "shown", "show", "digit", "number", "letter", "word", "text", "color", "colour", "red", "green", "blue", "black",
    "white", "yellow", "gray", "left", "right", "top", "bottom", "small", "large", "big", "one", "two", "three",
    "four", "five", "six", "seven", "eight", "nine", "zero", "ten", "cat", "dog", "car", "person", "man", "woman",
    "tree", "house", "sky", "water", "object", "animal", "describe", "caption", "answer", "question", "with", "from",
    "by", "for", "do", "does", "you", "see", "can", "has", "have", "be", "in the image", "a photo of",
    "helpful", "assistant", "user", "system", "You are a helpful assistant.",
)
QUESTIONS: tuple[str, ...] = (
    "Which digit is shown in the image?", "What is shown in the image?", "Describe the image.",
    "What number is in the picture?", "Is there a digit in this image?", "What color is the digit?",
)
DIGITS = tuple(str(d) for d in range(10))


def _corpus(words: Sequence[str]) -> list[str]:
    lines = list(words) + list(QUESTIONS)
    lines += [" ".join(words[i:i + 8]) for i in range(0, len(words), 4)]
    # Repeated so BPE learns " 0".." 9" as merges: SmolVLM answers follow "Assistant:" with a space.
    lines += [" ".join(DIGITS)] * 50 + [f"Assistant: {d}" for d in DIGITS] * 20
    return lines


def image_tokens(image_size: int) -> int:
    """Tokens one `image_size`-px square image becomes: (side / PATCH)² patches, MERGE² of them per token (Idefics3's
    pixel shuffle and Qwen2-VL's patch merger alike)."""
    return (image_size // PATCH) ** 2 // MERGE**2


def context_length(image_size: int) -> int:
    """The text model's positions and the tokenizer's model_max_length for a tiny model built for `image_size`."""
    return max(MIN_CONTEXT, image_tokens(image_size) + TEXT_TOKENS)


def build_tokenizer(family: Family, words: Sequence[str] = VOCAB_WORDS, *, max_length: int = MIN_CONTEXT) -> Any:
    """A byte-level BPE trained on `words`, wrapped with the family's special tokens and chat template; prompts of up
    to `max_length` tokens (image tokens included) pass without the tokenizer's too-long warning."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(_corpus(words), trainer)
    roles = TOKEN_ROLES.get(family.name, {})
    specials = {"bos_token": roles.get("bos_token", "<|im_start|>"), "eos_token": family.end_token,
                "pad_token": roles.get("pad_token", "<|endoftext|>"), "unk_token": None}
    named = {k: v for k, v in roles.items() if k not in specials}
    extra = [t for t in family.special_tokens if t not in specials.values() and t not in named.values()]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, model_max_length=max_length, **specials,
        # Named extras become tokenizer attributes the processors read (Gemma 3's boi_token, InternVL's
        # context_image_token), as the real checkpoints' tokenizer configs declare them.
        extra_special_tokens=named or extra,
    )
    if named:
        tok.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=False)
    tok.chat_template = family.chat_template
    for prefix in ("", " "):
        for d in DIGITS:
            if len(tok(prefix + d, add_special_tokens=False)["input_ids"]) != 1:
                raise ModelError(f"tiny tokenizer: answer {prefix + d!r} is not one token; add it to the corpus")
    return tok


def _ids(tok: Any, *tokens: str) -> list[int]:
    return [int(tok.convert_tokens_to_ids(t)) for t in tokens]


def _text_config(tok: Any) -> dict[str, Any]:
    return {**TEXT, "max_position_embeddings": tok.model_max_length, "vocab_size": len(tok),
            "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "tie_word_embeddings": False}


def _idefics3(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    scale = MERGE
    (image_id,) = _ids(tok, "<image>")
    config = Idefics3Config(
        text_config={"model_type": "llama", **_text_config(tok), "rms_norm_eps": 1e-5},
        vision_config={**VISION, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": PATCH},
        scale_factor=scale, image_token_id=image_id, pad_token_id=tok.pad_token_id,
    )
    ip = Idefics3ImageProcessor(size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                                do_image_splitting=False)
    return config, Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=image_tokens(image_size),
                                     chat_template=tok.chat_template)


def _qwen_processor(tok: Any, image_size: int, cls: Any, video_cls: Any = None) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    video_cls = video_cls or Qwen2VLVideoProcessor
    unit = PATCH * MERGE
    geometry = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2}
    size = {"shortest_edge": unit * unit, "longest_edge": image_size * image_size}
    return cls(image_processor=Qwen2VLImageProcessor(size=size, **geometry),
               video_processor=video_cls(size=size, **geometry),
               tokenizer=tok, chat_template=tok.chat_template)


def _qwen_ids(tok: Any) -> dict[str, int]:
    image, video, start, end = _ids(tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    return {"image_token_id": image, "video_token_id": video, "vision_start_token_id": start,
            "vision_end_token_id": end}


def _rope() -> dict[str, Any]:
    # M-RoPE splits the rotary half-dimension into (time, height, width): it must sum to head_dim / 2.
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    return {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, head_dim // 2 - 5]}


def _qwen2_vl(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLProcessor

    config = Qwen2VLConfig(
        text_config={**_text_config(tok), "rope_parameters": _rope()},
        vision_config={"depth": 2, "embed_dim": VISION["hidden_size"], "hidden_size": TEXT["hidden_size"], "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2},
        **_qwen_ids(tok),
    )
    return config, _qwen_processor(tok, image_size, Qwen2VLProcessor)


def _qwen2_5_vl(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    config = Qwen2_5_VLConfig(
        text_config={**_text_config(tok), "rope_parameters": _rope()},
        vision_config={**VISION, "depth": 2, "num_heads": 2,
                       "out_hidden_size": TEXT["hidden_size"], "patch_size": PATCH, "spatial_merge_size": MERGE,
                       "temporal_patch_size": 2, "window_size": PATCH * MERGE * 2, "fullatt_block_indexes": [1]},
        **_qwen_ids(tok),
    )
    return config, _qwen_processor(tok, image_size, Qwen2_5_VLProcessor)


def _smolvlm(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor
    from transformers.utils import is_num2words_available

    if not is_num2words_available():
        raise ModelError("smolvlm: SmolVLM2's processor needs the num2words package (LGPL-2.1); "
                         "pip install 'tamis[smolvlm2]'")

    (image_id,) = _ids(tok, "<image>")
    config = SmolVLMConfig(
        text_config={"model_type": "llama", **_text_config(tok), "rms_norm_eps": 1e-5},
        vision_config={**VISION, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": PATCH},
        scale_factor=MERGE, image_token_id=image_id, pad_token_id=tok.pad_token_id,
    )
    size = {"longest_edge": image_size}
    ip = SmolVLMImageProcessor(size=size, max_image_size=size, do_image_splitting=False)
    vp = SmolVLMVideoProcessor(size=size, max_image_size=size)
    return config, SmolVLMProcessor(image_processor=ip, video_processor=vp, tokenizer=tok,
                                    image_seq_len=image_tokens(image_size), chat_template=tok.chat_template)


def _qwen3_vl(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLProcessor, Qwen3VLVideoProcessor

    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    # Interleaved M-RoPE over (time, height, width): the sections sum to head_dim / 2, as [24, 20, 20] does at 128.
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**_text_config(tok), "head_dim": head_dim, "rope_parameters": rope},
        vision_config={**VISION, "depth": 2, "num_heads": 2, "out_hidden_size": TEXT["hidden_size"],
                       "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2,
                       "num_position_embeddings": (image_size // PATCH) ** 2, "deepstack_visual_indexes": [0]},
        **_qwen_ids(tok),
    )
    processor = _qwen_processor(tok, image_size, Qwen3VLProcessor, video_cls=Qwen3VLVideoProcessor)
    return config, processor


def _siglip(image_size: int) -> dict[str, Any]:
    return {"model_type": "siglip_vision_model", **VISION, "num_hidden_layers": 2, "num_attention_heads": 2,
            "image_size": image_size, "patch_size": PATCH}


def _gemma3(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    boi, eoi, image_id = _ids(tok, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    # The projector average-pools the patch grid to mm_tokens_per_image tokens (a square): 256 of 4,096 at 896 px.
    n_tokens = image_tokens(image_size)
    config = Gemma3Config(
        text_config={**_text_config(tok), "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
                     "sliding_window": 64},
        vision_config=_siglip(image_size), mm_tokens_per_image=n_tokens,
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image_id,
    )
    ip = Gemma3ImageProcessor(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    return config, Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=n_tokens,
                                   chat_template=tok.chat_template)


def _llava_onevision(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    (image_id,) = _ids(tok, "<image>")
    (video_id,) = _ids(tok, "<video>")
    # Any-resolution grids of up to 2×2 tiles (the real checkpoints go to 6×6 of 384 px).
    pinpoints = [[image_size * h, image_size * w] for h in (1, 2) for w in (1, 2)]
    config = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **_text_config(tok)}, vision_config=_siglip(image_size),
        image_token_index=image_id, video_token_index=video_id, image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    )
    size = {"height": image_size, "width": image_size}
    ip = LlavaOnevisionImageProcessor(size=size, crop_size=size, image_grid_pinpoints=pinpoints)
    vp = LlavaOnevisionVideoProcessor(size=size, crop_size=size)
    return config, LlavaOnevisionProcessor(image_processor=ip, video_processor=vp, tokenizer=tok,
                                           num_image_tokens=(image_size // PATCH) ** 2,
                                           vision_feature_select_strategy="full", chat_template=tok.chat_template)


def _internvl(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    (image_id,) = _ids(tok, "<IMG_CONTEXT>")
    config = InternVLConfig(
        text_config={"model_type": "qwen2", **_text_config(tok)},
        vision_config={**VISION, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": [image_size, image_size], "patch_size": [PATCH, PATCH]},
        image_token_id=image_id, downsample_ratio=1 / MERGE, image_seq_length=image_tokens(image_size),
    )
    size = {"height": image_size, "width": image_size}
    ip = GotOcr2ImageProcessor(size=size, crop_to_patches=False, min_patches=1, max_patches=12)
    vp = InternVLVideoProcessor(size=size)
    return config, InternVLProcessor(image_processor=ip, video_processor=vp, tokenizer=tok,
                                     image_seq_length=image_tokens(image_size), chat_template=tok.chat_template)


def _llava(tok: Any, image_size: int) -> tuple[Any, Any]:
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaProcessor

    (image_id,) = _ids(tok, "<image>")
    config = LlavaConfig(
        text_config={"model_type": "qwen2", **_text_config(tok)}, vision_config=_siglip(image_size),
        image_token_index=image_id, vision_feature_select_strategy="full", vision_feature_layer=-1,
    )
    size = {"height": image_size, "width": image_size}
    ip = CLIPImageProcessor(size=size, crop_size=size, do_center_crop=False)
    return config, LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH,
                                  vision_feature_select_strategy="full", chat_template=tok.chat_template)


class _ChatMLLlava(Family):
    """The tokens and template of a tiny LLaVA (model_type `llava`) with ChatML markup, as many LLaVA fine-tunes
    use: an architecture with no family class, for testing `model.family: auto`."""

    name = "llava"
    model_types = ("llava",)
    end_token = "<|im_end|>"
    special_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>")
    chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
        "{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Architectures without a family class, built only to test the generic fallback: name → (token spec, builder).
UNREGISTERED: dict[str, tuple[type[Family], Any]] = {"llava": (_ChatMLLlava, _llava)}


def _fan_in_init(model: Any) -> None:
    """Re-draw weights with std 1/sqrt(fan_in): at width 64 the default std 0.02 leaves logits nearly flat and image
    signals faint, so no adapter could fit anything. This keeps activations at unit scale through every layer."""
    import torch

    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)):
                fan_in = m.weight[0].numel()
                # A wider output head lets logits reach the range a trained model has (an adapter cannot scale it).
                m.weight.normal_(0.0, (HEAD_GAIN if m is head else 1.0) * fan_in ** -0.5)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.Embedding):
                m.weight.normal_(0.0, 1.0)


BUILDERS = {"idefics3": _idefics3, "smolvlm": _smolvlm, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl,
            "qwen3_vl": _qwen3_vl, "gemma3": _gemma3, "llava_onevision": _llava_onevision, "internvl": _internvl}


def make_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    vocab_words: Sequence[str] = VOCAB_WORDS,
    seed: int = 0,
    vision_depth: int | None = None,
) -> Path:
    """Build a random-weight `family` model (a few MB) with its tokenizer and processor into `out_dir`.
    `vision_depth` overrides a Qwen-VL vision tower's blocks (2): llama.cpp's converter names Qwen2-VL's merger tensors
    by block index and needs 3 (tests/test_gguf_export.py)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    fam = UNREGISTERED[family][0]() if family in UNREGISTERED else get_family(family)
    unit = PATCH * MERGE
    if image_size < unit or image_size % unit:
        raise ModelError(f"tiny model image_size {image_size} must be a positive multiple of {unit} "
                         f"(patch {PATCH} × merge {MERGE}), e.g. 32")
    tok = build_tokenizer(fam, vocab_words, max_length=context_length(image_size))
    config, processor = (UNREGISTERED[family][1] if family in UNREGISTERED else BUILDERS[family])(tok, image_size)
    if vision_depth is not None:
        if not hasattr(config.vision_config, "depth"):
            raise ModelError(f"tiny {family}: its vision config has no `depth` to set to {vision_depth}; "
                             "vision_depth applies to the Qwen-VL families")
        config.vision_config.depth = vision_depth
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _fan_in_init(model)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        atomic_write_json(tmp / "tamis_tiny.json", {"family": family, "image_size": image_size, "seed": seed,
                                                    "vocab_size": len(tok),
                                                    **({"vision_depth": vision_depth} if vision_depth else {})})
    n = sum(p.numel() for p in model.parameters())
    log.info("built tiny %s model in %s: %.2fM parameters, %d-px images, vocab %d", family, out, n / 1e6,
             image_size, len(tok))
    return out


