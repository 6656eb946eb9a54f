"""Model families: how each VLM wants its chat prompt, its images and its LoRA targets.

One small class per family and a plain name → class dict. Everything family-specific that training and scoring need
lives here: the prompt (via the processor's chat template), where the answer tokens start (label masking, scoring),
the end-of-turn token, the processor settings that keep an image's aspect ratio, the default LoRA targets, and how
to run the vision encoder alone (selection embeddings).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from pipeline.errors import ModelError

log = logging.getLogger(__name__)
IGNORE_INDEX = -100

# The chat templates the real checkpoints ship (SmolVLM-Instruct; Qwen2-VL-Instruct, which Qwen2.5-VL shares). They
# are written into tiny models and used as a fallback for a checkpoint whose processor has none.
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Family:
    """What one model family needs beyond the generic transformers classes."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json `model_type` values of this family
    default_target_modules: ClassVar[tuple[str, ...]] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
    # LoRA goes on the language model only by default: the vision encoder stays frozen (and some vision blocks reuse
    # the same leaf names, e.g. Qwen2.5-VL's MLP).
    language_model_scope: ClassVar[str]
    # model.train: language+projector / all add these: regex fragments that match the full module path (after any
    # prefix) of each Linear of the vision→text projector / the vision tower's blocks, and nothing else (PEFT
    # refuses a match on a non-Linear module such as an activation).
    projector_scope: ClassVar[str]
    vision_scope: ClassVar[str]
    default_image_size: ClassVar[int]
    end_token: ClassVar[str]  # closes the assistant turn; the label's EOS
    special_tokens: ClassVar[tuple[str, ...]]
    chat_template: ClassVar[str]
    # The processor squares every tile: pad images to a square first (preprocess.pad) to keep their aspect ratio.
    square_tiles: ClassVar[bool] = False

    def tile_size(self, processor: Any) -> int:
        """The processor's native image unit in pixels (a tile, or one merged patch)."""
        raise NotImplementedError

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        """Image settings for a processor call on images whose longest side is `image_size` (aspect kept)."""
        raise NotImplementedError

    def lora_target(self, names: Sequence[str] | None = None, train: str = "language") -> str:
        """A PEFT `target_modules` regex: these leaf module names inside the language model, plus the projector's
        Linears (`train` language+projector) and the vision tower's too (`train` all)."""
        leaves = "|".join(names or self.default_target_modules)
        language = rf"{self.language_model_scope}\..*\.(?:{leaves})"
        scopes = {"language": [], "language+projector": [self.projector_scope],
                  "all": [self.projector_scope, self.vision_scope]}
        if train not in scopes:
            raise ModelError(f"model.train is {train!r}; use one of {', '.join(scopes)}")
        if not scopes[train]:
            return rf"^(?:.*\.)?{language}$"
        return rf"^(?:.*\.)?(?:{'|'.join([language, *scopes[train]])})$"

    # --------------------------------------------------------------------------------------------- prompts
    def messages(self, question: str, answer: str | None = None) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        ]
        if answer is not None:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        return msgs

    def prompt(self, processor: Any, question: str, answer: str | None = None) -> str:
        """The chat-formatted text: the user turn (image + question), then the assistant's answer or its cue."""
        template = getattr(processor, "chat_template", None) or self.chat_template
        return processor.apply_chat_template(
            self.messages(question, answer), chat_template=template, add_generation_prompt=answer is None,
            tokenize=False,
        )

    def end_token_id(self, processor: Any) -> int:
        tok = processor.tokenizer
        tid = tok.convert_tokens_to_ids(self.end_token)
        if tid is None or tid == tok.unk_token_id:
            raise ModelError(f"the tokenizer has no {self.end_token!r} token, which ends an answer in the "
                             f"{self.name} chat format; is this checkpoint really a {self.name} model?")
        return int(tid)

    def stop_token_ids(self, processor: Any) -> list[int]:
        """Tokens that end generation: the end-of-turn token and the tokenizer's EOS."""
        ids = [self.end_token_id(processor)]
        eos = processor.tokenizer.eos_token_id
        return ids + ([int(eos)] if eos is not None and eos not in ids else [])

    def answer_token_ids(self, processor: Any, question: str, answer: str) -> list[int]:
        """The tokens of `answer` as they follow the prompt (no end-of-turn token): what scoring compares."""
        tok = processor.tokenizer
        prompt = tok(self.prompt(processor, question), add_special_tokens=False)["input_ids"]
        full = tok(self.prompt(processor, question, answer), add_special_tokens=False)["input_ids"]
        if full[: len(prompt)] != prompt:
            raise ModelError(f"{self.name}: the prompt's tokens change when the answer {answer!r} follows it; "
                             "answer tokens cannot be located")
        rest = full[len(prompt):]
        end = self.end_token_id(processor)
        return rest[: rest.index(end)] if end in rest else rest

    # --------------------------------------------------------------------------------------------- encoding
    def _call(self, processor: Any, images: list[Image.Image], texts: list[str], image_size: int,
              padding_side: str) -> Any:
        kwargs = self.processor_kwargs(image_size, tile=self.tile_size(processor))
        return processor(images=[[im] for im in images], text=texts, padding=True, padding_side=padding_side,
                         return_tensors="pt", **kwargs)

    def encode(
        self,
        processor: Any,
        images: Sequence[Image.Image],
        questions: Sequence[str],
        answers: Sequence[str] | None = None,
        *,
        image_size: int | None = None,
    ) -> Any:
        """Model inputs for a batch: prompts built, tokenized with their images.

        Without answers: a generation prompt per row, left-padded (batched generation, last-token scoring).
        With answers: prompt + answer, right-padded, plus `labels` (-100 everywhere but the answer tokens and the
        end-of-turn token) and `answer_start` (index of each row's first answer token). The prompt's length is
        measured by tokenizing the prompt alone with the same images, so nothing depends on a marker string.
        `image_size` defaults to the longest image side in the batch (prepared images already have the right size).
        """
        images = [im.convert("RGB") for im in images]
        if len(images) != len(questions) or (answers is not None and len(answers) != len(questions)):
            raise ModelError(f"encode: {len(images)} images, {len(questions)} questions and "
                             f"{'no' if answers is None else len(answers)} answers; one of each per row is needed")
        size = image_size or max(max(im.size) for im in images)
        prompts = [self.prompt(processor, q) for q in questions]
        if answers is None:
            return self._call(processor, images, prompts, size, "left")

        for i, a in enumerate(answers):
            if not isinstance(a, str) or not a.strip():
                raise ModelError(f"encode: row {i}: answer is {a!r}; training needs a non-empty answer string")
        full = [self.prompt(processor, q, a) for q, a in zip(questions, answers, strict=True)]
        for i, (p, f) in enumerate(zip(prompts, full, strict=True)):
            if not f.startswith(p):
                raise ModelError(f"{self.name}: row {i}: the chat template renders the answered conversation "
                                 "differently from the question alone; answer tokens cannot be located")
        enc = self._call(processor, images, full, size, "right")
        pe = self._call(processor, images, prompts, size, "right")
        prompt_ids, prompt_lens = pe["input_ids"], pe["attention_mask"].sum(1)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        end = self.end_token_id(processor)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for i in range(ids.shape[0]):
            start, stop = int(prompt_lens[i]), int(mask[i].sum())
            if ids[i, :start].tolist() != prompt_ids[i, :start].tolist():
                raise ModelError(f"{self.name}: row {i}: the prompt tokenizes differently when answer {answers[i]!r} "
                                 "follows it; answer tokens cannot be located")
            row = ids[i, start:stop].tolist()
            # Answer tokens and the end-of-turn token; the template's trailing newline is not the model's to say.
            n = row.index(end) if end in row else len(row)
            if n == 0:
                raise ModelError(f"{self.name}: row {i}: answer {answers[i]!r} produced no tokens after the prompt")
            n += end in row
            labels[i, start:start + n] = ids[i, start:start + n]
        enc["labels"] = labels
        enc["answer_start"] = prompt_lens.to(torch.long)
        return enc

    # ------------------------------------------------------------------------------------------ vision encoder
    def _image_kwargs(self, processor: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
        # The same image settings `encode` uses: the batch's longest side (prepared images have the right size).
        return self.processor_kwargs(max(max(im.size) for im in images), tile=self.tile_size(processor))

    def image_features(self, model: Any, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        """[n, d]: the vision encoder's last hidden state (before any projection into the language model), mean-pooled
        over an image's patches, and over its tiles where the processor splits it. The language model never runs."""
        raise NotImplementedError


class Idefics3Family(Family):
    """SmolVLM (v1) and Idefics3: SigLIP tiles + pixel shuffle into a Llama/SmolLM2 language model."""

    name = "idefics3"
    model_types = ("idefics3", "smolvlm")
    language_model_scope = "text_model"
    projector_scope = r"connector\.modality_projection\.proj"
    vision_scope = r"vision_model\.encoder\.layers\.\d+\.(?:self_attn\.(?:q|k|v|out)_proj|mlp\.fc[12])"
    default_image_size = 512
    end_token = "<end_of_utterance>"
    special_tokens = (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
        "<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
    )
    chat_template = IDEFICS3_CHAT_TEMPLATE
    square_tiles = True

    def tile_size(self, processor: Any) -> int:
        return int(processor.image_processor.max_image_size["longest_edge"])

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        # Up to one tile: the image is the global tile alone (no splitting). Larger: split into tiles of the
        # processor's size after scaling the longest side to `image_size`, never up to the processor's 4x default.
        split = tile is not None and image_size > tile
        return {"do_image_splitting": split, "size": {"longest_edge": image_size}}

    def image_features(self, model: Any, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        images = [im.convert("RGB") for im in images]
        enc = processor.image_processor([[im] for im in images], return_tensors="pt",
                                        **self._image_kwargs(processor, images))
        pixels = enc["pixel_values"]  # [n, tiles, 3, H, W]; tiles padded with all-zero images
        n, tiles, _, h, w = pixels.shape
        mask = enc.get("pixel_attention_mask")  # [n, tiles, H, W]: real pixels vs padding
        mask = torch.ones(n, tiles, h, w, dtype=torch.bool) if mask is None else mask.bool()
        device = next(model.parameters()).device
        out = model.get_image_features(pixel_values=pixels.to(device), pixel_attention_mask=mask.to(device))
        hidden = out.last_hidden_state.float().cpu()  # [real tiles, patches, d]
        # The model drops all-zero padding tiles and masks patches of padding pixels: redo both to pool the rest.
        real = (pixels != 0).flatten(2).any(-1)  # [n, tiles]
        p = int(model.config.vision_config.patch_size)
        m = mask.flatten(0, 1)[real.flatten()]
        patches = (m.unfold(1, p, p).unfold(2, p, p).sum((-1, -2)) > 0).flatten(1).float()  # [real tiles, patches]
        per_tile = (hidden * patches[..., None]).sum(1) / patches.sum(1, keepdim=True).clamp(min=1)
        return torch.stack([t.mean(0) for t in per_tile.split(real.sum(1).tolist())])


class Qwen2VLFamily(Family):
    """Qwen2-VL: native-resolution ViT (patches merged 2x2) into a Qwen2 language model with M-RoPE."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    language_model_scope = "language_model"
    projector_scope = r"visual\.merger\.mlp\.[02]"  # mlp.1 is the GELU between the two Linears
    vision_scope = r"visual\.blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.fc[12])"
    default_image_size = 448
    end_token = "<|im_end|>"
    special_tokens = (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
        "<|image_pad|>", "<|video_pad|>",
    )
    chat_template = QWEN2_VL_CHAT_TEMPLATE

    def tile_size(self, processor: Any) -> int:
        ip = processor.image_processor
        return int(ip.patch_size * ip.merge_size)

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        # smart_resize keeps the aspect ratio and rounds sides to the merged-patch size; capping the pixel count at
        # image_size² keeps prepared images at their own resolution instead of the 1280-token default.
        unit = tile or 28
        return {"size": {"shortest_edge": unit * unit, "longest_edge": max(image_size * image_size, unit * unit)}}

    def image_features(self, model: Any, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        images = [im.convert("RGB") for im in images]
        enc = processor.image_processor(images=images, return_tensors="pt", **self._image_kwargs(processor, images))
        grid = enc["image_grid_thw"]  # [n, 3]: (t, h, w) patches per image; pixel_values holds them all, in order
        device = next(model.parameters()).device
        out = model.get_image_features(pixel_values=enc["pixel_values"].to(device), image_grid_thw=grid.to(device))
        # Patches before the 2×2 merger, grouped by image (Qwen2.5-VL's window order permutes them within an image).
        hidden = out.last_hidden_state.float()
        return torch.stack([h.mean(0) for h in hidden.split(grid.prod(-1).tolist())])


class Qwen25VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: Qwen2-VL's prompt format with a windowed-attention ViT."""

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    vision_scope = r"visual\.blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.(?:gate|up|down)_proj)"  # SwiGLU blocks


FAMILIES: dict[str, type[Family]] = {
    "idefics3": Idefics3Family,
    "qwen2_vl": Qwen2VLFamily,
    "qwen2_5_vl": Qwen25VLFamily,
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]()


def detect_family(name_or_path: str | Path) -> str:
    """The family of a checkpoint from its config.json `model_type` (a local folder, or a hub ID via the cache)."""
    path = Path(name_or_path)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{path}: no config.json; is this a saved model folder? Set model.family explicitly "
                             f"or point model.name_or_path at a checkpoint folder")
        try:
            model_type = json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
        except json.JSONDecodeError as exc:
            raise ModelError(f"{cfg_file}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
    else:
        from transformers import AutoConfig

        try:
            model_type = AutoConfig.from_pretrained(str(name_or_path)).model_type
        except OSError as exc:
            raise ModelError(f"{name_or_path}: cannot read its config ({exc}); offline, use a local folder") from None
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam.name
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values())
    raise ModelError(f"{name_or_path}: model_type {model_type!r} is not a supported family; supported: {supported}")
