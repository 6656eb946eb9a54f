"""Model families: how each VLM wants its chat prompt, its images and its LoRA targets.

One small class per family and a plain name → class dict. Everything family-specific that training and scoring need
lives here: the prompt (via the processor's chat template), where the answer tokens start (label masking, scoring),
the end-of-turn token, the processor settings that keep an image's aspect ratio, the default LoRA targets, and how
to run the vision encoder alone (selection embeddings).

The base class does the work; a family is mostly declarations (docs/models.md lists them). Three image geometries
cover today's families, one mixin each: a fixed square (Gemma 3, LLaVA-OneVision's tiles, InternVL's tiles: the
processor decides), a grid of merged patches at the image's own resolution (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), and
SigLIP tiles with splitting (Idefics3, SmolVLM2). `pipeline.model.generic` builds a family for any other checkpoint
with a chat template (`model.family: auto`).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from pipeline.boxes.box import smart_resize
from pipeline.errors import ModelError
from pipeline.model import templates
from pipeline.model.runtimes import UNCHECKED, Runtimes
from pipeline.schema import Question

log = logging.getLogger(__name__)
IGNORE_INDEX = -100

# Kept importable under their old names (tests and benchmarks use them).
IDEFICS3_CHAT_TEMPLATE = templates.IDEFICS3
QWEN2_VL_CHAT_TEMPLATE = templates.QWEN2_VL


class Family:
    """What one model family needs beyond the generic transformers classes.

    Declarations (ClassVars): `name` (as `model.family` writes it), `model_types` (config.json values), the three
    module scopes (regex fragments of module paths: the language model, the projector, the vision tower),
    `default_image_size`, `end_token` (closes the assistant turn; the label's EOS), `image_token` (the placeholder
    the processor repeats once per image token), `special_tokens` (the tiny tokenizer's), `chat_template` (fallback
    when a checkpoint has none), `square_tiles`, and `answer_prefix`.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json `model_type` values of this family
    default_target_modules: ClassVar[tuple[str, ...]] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
    # LoRA goes on the language model only by default: the vision encoder stays frozen (and some vision blocks reuse
    # the same leaf names, e.g. Qwen2.5-VL's MLP). The projector and vision scopes say where the other parts sit.
    language_model_scope: ClassVar[str]
    # Where the vision→text projector and the vision tower sit (module path prefixes). model.train:
    # language+projector / all adapt every Linear under them (found in the model itself: PEFT refuses a match on a
    # non-Linear module such as an activation).
    projector_scope: ClassVar[str]
    vision_scope: ClassVar[str]
    default_image_size: ClassVar[int]
    end_token: ClassVar[str]
    image_token: ClassVar[str]
    special_tokens: ClassVar[tuple[str, ...]]
    chat_template: ClassVar[str]
    # The processor squares every tile: pad images to a square first (preprocess.pad) to keep their aspect ratio.
    square_tiles: ClassVar[bool] = False
    # Between the generation prompt and the answer, used only where the template renders the answered turn so that
    # it does not start with the generation prompt (the answer is then appended to the prompt the model generates
    # from: what it will see at inference).
    answer_prefix: ClassVar[str] = ""
    # Keyword arguments of the image processor call that take the images as one list per sample ([[im], [im]]).
    nested_images: ClassVar[bool] = False
    # How this family writes boxes in an answer: a name in pipeline/boxes/codecs.py's CODECS. Families without a
    # grounding format of their own learn tamis's JSON with 0-1000 coordinates (docs/boxes.md).
    box_codec: ClassVar[str] = "json_1000"
    # Which serving runtimes take this family's model (pipeline/model/runtimes.py; `tamis export-model --check`).
    runtimes: ClassVar[Runtimes] = UNCHECKED

    # ------------------------------------------------------------------------------------------ image geometry
    def tile_size(self, processor: Any) -> int:
        """The processor's native image unit in pixels (a tile, or one merged patch)."""
        size = processor.image_processor.size
        size = size if isinstance(size, dict) else dict(size)
        side = size.get("height") or size.get("longest_edge") or size.get("shortest_edge")
        if not side:
            raise ModelError(f"{self.name}: the image processor's size {size} names no height or edge")
        return int(side)

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        """Image settings for a processor call on images whose longest side is `image_size` (aspect kept)."""
        return {}

    def box_frame(self, processor: Any, width: int, height: int, image_size: int | None = None) -> tuple[int, int]:
        """(width, height) of the pixel grid absolute box coordinates would count for a `width` × `height` prepared
        image (pipeline.boxes.Geometry.frame). A fixed square or tiles: the image itself, since this family's codec
        is relative (0-1000) and no stretch of the image changes relative coordinates."""
        return width, height

    def planned_image_tokens(self, vc: dict[str, Any], image_size: int) -> tuple[int, int]:
        """(tokens in the text sequence, patches through the vision encoder) for one square `image_size`-px image,
        from the config alone (`vc`: the vision config's image_size / patch_size / spatial_merge_size and the model
        config's geometry keys, as the planner reads them). Default: a grid of patches merged `spatial_merge_size`²."""
        patch, merge = vc.get("patch_size", 14), vc.get("spatial_merge_size", 2)
        unit = patch * merge
        side = max(unit, round(image_size / unit) * unit)
        patches = (side // patch) ** 2
        return patches // merge**2 + 2, patches  # + vision start/end tokens

    def lora_target(self, names: Sequence[str] | None = None, train: str = "language",
                    linears: Iterable[str] | None = None) -> str:
        """A PEFT `target_modules` regex: these leaf module names inside the language model, plus every Linear under
        the projector (`train` language+projector) and the vision tower too (`train` all). Those are found in the
        model: `linears` are the names of its Linear modules (nn.Linear, 4-bit ones included)."""
        leaves = "|".join(names or self.default_target_modules)
        language = rf"{self.language_model_scope}\..*\.(?:{leaves})"
        scopes = {"language": [], "language+projector": [self.projector_scope],
                  "all": [self.projector_scope, self.vision_scope]}
        if train not in scopes:
            raise ModelError(f"model.train is {train!r}; use one of {', '.join(scopes)}")
        if not scopes[train]:
            return rf"^(?:.*\.)?{language}$"
        if linears is None:
            raise ModelError(f"{self.name}: model.train = {train} adapts the Linears under "
                             f"{', '.join(scopes[train])}; pass the model's Linear module names (linears=)")
        lang = re.compile(rf"(?:.*\.)?{language}")
        picked = []
        for scope in scopes[train]:
            under = re.compile(rf"(?:.*\.)?{scope}\.")
            found = [n for n in linears if under.match(n) and not lang.fullmatch(n) and n not in picked]
            if not found and scope == self.projector_scope and train == "language+projector":
                # Gemma 3's projector is a plain weight matrix, no Linear: LoRA has nothing to wrap there.
                raise ModelError(f"{self.name}: its projector ({scope}) has no Linear layer for LoRA to adapt; use "
                                 "model.train: language, or all (which adapts the vision tower)")
            picked += found
        if not picked:
            raise ModelError(f"{self.name}: model.train = {train}: no Linear module under {', '.join(scopes[train])} "
                             f"in this checkpoint; check model.family (is it a {self.name} model?)")
        return rf"^(?:.*\.)?(?:{language}|{'|'.join(map(re.escape, picked))})$"

    # --------------------------------------------------------------------------------------------- prompts
    def messages(self, question: str | Question, answer: str | None = None) -> list[dict[str, Any]]:
        """The chat of one sample: its context turns (a system prompt, earlier user / assistant turns), then the
        question; one image item per picture at the start of the first user turn (a one-image, no-context sample: the
        one user turn [image, question], as ever)."""
        q = question if isinstance(question, Question) else Question(question)
        msgs: list[dict[str, Any]] = [{"role": role, "content": [{"type": "text", "text": text}]}
                                      for role, text in q.context]
        msgs.append({"role": "user", "content": [{"type": "text", "text": q.text}]})
        first = next(m for m in msgs if m["role"] == "user")
        first["content"] = [{"type": "image"}] * q.images + first["content"]
        if answer is not None:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        return msgs

    def _render(self, processor: Any, question: str | Question, answer: str | None) -> str:
        template = getattr(processor, "chat_template", None) or self.chat_template
        return processor.apply_chat_template(
            self.messages(question, answer), chat_template=template, add_generation_prompt=answer is None,
            tokenize=False,
        )

    def answer_rendering(self, processor: Any, question: str, answer: str) -> str:
        """'template' when the chat template renders the answered turn as the generation prompt followed by the
        answer; 'appended' when it does not, and the answer is appended to the generation prompt instead."""
        return "template" if self._render(processor, question, answer).startswith(
            self._render(processor, question, None)) else "appended"

    def prompt(self, processor: Any, question: str | Question, answer: str | None = None) -> str:
        """The chat-formatted text: the context turns and the user turn (images + question), then the assistant's
        answer or its cue."""
        cue = self._render(processor, question, None)
        if answer is None:
            return cue
        full = self._render(processor, question, answer)
        return full if full.startswith(cue) else cue + self.answer_prefix + answer + self.end_token

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
    def _call(self, processor: Any, images: list[list[Image.Image]], texts: list[str], image_size: int,
              padding_side: str) -> Any:
        kwargs = self.processor_kwargs(image_size, tile=self.tile_size(processor))
        return processor(images=images, text=texts, padding=True, padding_side=padding_side,
                         return_tensors="pt", **kwargs)

    def encode(
        self,
        processor: Any,
        images: Sequence[Image.Image | Sequence[Image.Image]],
        questions: Sequence[str | Question],
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
        A row of several pictures gives its images as a list and its question as a `Question` (context turns, the
        image count): one image item per picture in the chat, the processor given the row's images in order.
        """
        if len(images) != len(questions) or (answers is not None and len(answers) != len(questions)):
            raise ModelError(f"encode: {len(images)} images, {len(questions)} questions and "
                             f"{'no' if answers is None else len(answers)} answers; one of each per row is needed")
        rows = [[im.convert("RGB")] if isinstance(im, Image.Image) else [m.convert("RGB") for m in im]
                for im in images]
        questions = [q if isinstance(q, Question) else Question(q, images=len(r))
                     for q, r in zip(questions, rows, strict=True)]
        for i, (q, r) in enumerate(zip(questions, rows, strict=True)):
            if q.images != len(r):
                raise ModelError(f"encode: row {i} has {len(r)} image(s) but its question shows {q.images}; give a "
                                 "Question(images=…) that matches the row's pictures")
        size = image_size or max(max(im.size) for r in rows for im in r)
        prompts = [self.prompt(processor, q) for q in questions]
        if answers is None:
            return self._call(processor, rows, prompts, size, "left")

        for i, a in enumerate(answers):
            if not isinstance(a, str) or not a.strip():
                raise ModelError(f"encode: row {i}: answer is {a!r}; training needs a non-empty answer string")
        full = [self.prompt(processor, q, a) for q, a in zip(questions, answers, strict=True)]
        enc = self._call(processor, rows, full, size, "right")
        pe = self._call(processor, rows, prompts, size, "right")
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
    def image_inputs(self, processor: Any, images: Sequence[Image.Image]) -> Any:
        """The image processor's output for `images`, with the settings `encode` uses: the batch's longest side
        (prepared images have the right size)."""
        images = [im.convert("RGB") for im in images]
        kwargs = self.processor_kwargs(max(max(im.size) for im in images), tile=self.tile_size(processor))
        batch = [[im] for im in images] if self.nested_images else images
        return processor.image_processor(images=batch, return_tensors="pt", **kwargs)

    def image_features(self, model: Any, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        """[n, d]: the vision encoder's last hidden state (before any projection into the language model), mean-pooled
        over an image's patches, and over its tiles where the processor splits it. The language model never runs.

        The model's own `get_image_features` runs the tower; its `last_hidden_state` comes grouped one of three ways,
        told apart by what the image processor returned: `image_grid_thw` (rows of patches, one run per image),
        `num_patches` (tiles per image, InternVL), or one unit per image or per real tile (stacked pixel_values)."""
        enc = self.image_inputs(processor, images)
        n = len(images)
        device = next(model.parameters()).device
        accepted = inspect.signature(model.get_image_features).parameters
        args = {k: v.to(device) for k, v in enc.items() if k in accepted and isinstance(v, torch.Tensor)}
        out = model.get_image_features(**args)
        hidden = out.last_hidden_state.float().cpu()
        if "image_grid_thw" in enc:  # [all patches, d]
            return torch.stack([h.mean(0) for h in hidden.split(enc["image_grid_thw"].prod(-1).tolist())])
        per_unit = hidden.mean(1) if hidden.dim() == 3 else hidden  # [units, d]
        if "num_patches" in enc:
            counts = torch.as_tensor(enc["num_patches"]).flatten().tolist()
        elif per_unit.shape[0] == n:
            counts = [1] * n
        else:
            pixels = enc["pixel_values"]  # [n, tiles, 3, H, W]; tiles padded with all-zero images
            counts = (pixels != 0).flatten(2).any(-1).sum(1).tolist() if pixels.dim() == 5 else []
        if sum(counts) != per_unit.shape[0] or len(counts) != n:
            raise ModelError(f"{self.name}: the vision tower returned {tuple(hidden.shape)} for {n} images and the "
                             f"processor's {sorted(enc)}; cannot tell which rows belong to which image")
        return torch.stack([u.mean(0) for u in per_unit.split(counts)])


class GridFamily(Family):
    """Native resolution: the image keeps its aspect ratio and becomes a grid of patches merged `merge_size`²."""

    def tile_size(self, processor: Any) -> int:
        ip = processor.image_processor
        return int(ip.patch_size * ip.merge_size)

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        # smart_resize keeps the aspect ratio and rounds sides to the merged-patch size; capping the pixel count at
        # image_size² keeps prepared images at their own resolution instead of the 1280-token default.
        unit = tile or 28
        return {"size": {"shortest_edge": unit * unit, "longest_edge": max(image_size * image_size, unit * unit)}}

    def box_frame(self, processor: Any, width: int, height: int, image_size: int | None = None) -> tuple[int, int]:
        # The image the processor feeds the model: smart_resize with the settings `encode` passes (Qwen2.5-VL's
        # absolute box coordinates count its pixels).
        tile = self.tile_size(processor)
        size = self.processor_kwargs(image_size or max(width, height), tile=tile)["size"]
        h, w = smart_resize(height, width, factor=tile, min_pixels=size["shortest_edge"],
                            max_pixels=size["longest_edge"])
        return w, h


class TiledFamily(Family):
    """SigLIP tiles of the processor's size: one global tile for small images, split into tiles beyond it."""

    square_tiles = True
    nested_images = True

    def tile_size(self, processor: Any) -> int:
        return int(processor.image_processor.max_image_size["longest_edge"])

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        # Up to one tile: the image is the global tile alone (no splitting). Larger: split into tiles of the
        # processor's size after scaling the longest side to `image_size`, never up to the processor's 4x default.
        split = tile is not None and image_size > tile
        return {"do_image_splitting": split, "size": {"longest_edge": image_size}}

    def planned_image_tokens(self, vc: dict[str, Any], image_size: int) -> tuple[int, int]:
        tile, patch = vc.get("image_size", 512), vc.get("patch_size", 16)
        # Up to one tile the image is the global tile alone; larger ones are split plus one global tile.
        tiles = 1 if image_size <= tile else math.ceil(image_size / tile) ** 2 + 1
        patches = (tile // patch) ** 2
        per_tile = patches // vc.get("scale_factor", 1) ** 2 + 3  # + row/col and fake-image marker tokens
        return tiles * per_tile, tiles * patches

    def image_features(self, model: Any, processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
        enc = self.image_inputs(processor, images)
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


_QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                "<|image_pad|>", "<|video_pad|>")
_SMOL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>",
                "<image>", "<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


class Idefics3Family(TiledFamily):
    """SmolVLM (v1) and Idefics3: SigLIP tiles + pixel shuffle into a Llama/SmolLM2 language model."""

    name = "idefics3"
    model_types = ("idefics3",)
    language_model_scope = "text_model"
    projector_scope = "connector"
    vision_scope = "vision_model"
    default_image_size = 512
    end_token = "<end_of_utterance>"
    image_token = "<image>"
    special_tokens = _SMOL_TOKENS
    chat_template = templates.IDEFICS3
    runtimes = Runtimes(True, True, vllm_note="Idefics3ForConditionalGeneration: LoRA on the language model",
                        gguf_note="SmolVLM / Idefics3: text model + --mmproj vision tower",
                        gguf_text="VLlama3ForCausalLM", gguf_vision="Idefics3ForConditionalGeneration")


class SmolVLMFamily(Idefics3Family):
    """SmolVLM2 (`smolvlm` model type): Idefics3's tiles and prompt format, SmolVLM classes with video support."""

    name = "smolvlm"
    model_types = ("smolvlm",)
    special_tokens = (*_SMOL_TOKENS, "<video>")
    chat_template = templates.SMOLVLM2
    runtimes = Runtimes(True, True, vllm_note="SmolVLMForConditionalGeneration: LoRA on the language model",
                        gguf_note="SmolVLM2: text model + --mmproj vision tower",
                        gguf_text="VLlama3ForCausalLM", gguf_vision="SmolVLMForConditionalGeneration")


class Qwen2VLFamily(GridFamily):
    """Qwen2-VL: native-resolution ViT (patches merged 2x2) into a Qwen2 language model with M-RoPE."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    language_model_scope = "language_model"
    projector_scope = r"visual\.merger"  # the 2×2 patch merger sits inside the vision module
    vision_scope = "visual"
    default_image_size = 448
    end_token = "<|im_end|>"
    image_token = "<|image_pad|>"
    special_tokens = _QWEN_TOKENS
    chat_template = templates.QWEN2_VL
    box_codec = "qwen2_vl_tokens"
    runtimes = Runtimes(True, True, vllm_note="Qwen2VLForConditionalGeneration: LoRA on the language model",
                        gguf_note="Qwen2-VL: text model + --mmproj vision tower",
                        gguf_text="Qwen2VLForConditionalGeneration", gguf_vision="Qwen2VLForConditionalGeneration")


class Qwen25VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: Qwen2-VL's prompt format with a windowed-attention ViT."""

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    box_codec = "qwen2_5_vl_json"  # pixels of the smart-resized image, not Qwen2-VL's 0-1000 tokens
    runtimes = Runtimes(True, True, vllm_note="Qwen2_5_VLForConditionalGeneration: LoRA on the language model",
                        gguf_note="Qwen2.5-VL: text model + --mmproj vision tower",
                        gguf_text="Qwen2_5_VLForConditionalGeneration",
                        gguf_vision="Qwen2_5_VLForConditionalGeneration")


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: 16-px patches merged 2x2 (32-px units), DeepStack mergers feeding early language layers."""

    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    projector_scope = r"visual\.(?:merger|deepstack_merger_list)"
    default_image_size = 448  # 14 × 32-px units
    chat_template = templates.QWEN3_VL
    box_codec = "json_1000"  # Qwen2.5-VL's JSON, back to 0-1000 relative coordinates
    runtimes = Runtimes(True, True, vllm_note="Qwen3VLForConditionalGeneration: LoRA on the language model",
                        gguf_note="Qwen3-VL: text model + --mmproj vision tower (registered in llama.cpp's conversion/ "
                        "since late 2026, e.g. llama.cpp@0c1e57098)",
                        gguf_text="Qwen3VLForConditionalGeneration", gguf_vision="Qwen3VLForConditionalGeneration")


class Gemma3Family(Family):
    """Gemma 3: SigLIP at a fixed square (896 px; 256 pooled tokens) into a Gemma 3 language model."""

    name = "gemma3"
    model_types = ("gemma3",)
    language_model_scope = "language_model"
    projector_scope = "multi_modal_projector"
    vision_scope = "vision_tower"
    default_image_size = 896
    end_token = "<end_of_turn>"
    image_token = "<image_soft_token>"
    special_tokens = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                      "<end_of_image>", "<image_soft_token>")
    chat_template = templates.GEMMA3
    runtimes = Runtimes(True, True, vllm_note="Gemma3ForConditionalGeneration: LoRA on the language model",
                        gguf_note="Gemma 3: text model + --mmproj vision tower",
                        gguf_text="Gemma3ForConditionalGeneration", gguf_vision="Gemma3ForConditionalGeneration")
    square_tiles = True  # resized to the square without keeping the aspect ratio (pan-and-scan off)
    nested_images = True

    def planned_image_tokens(self, vc: dict[str, Any], image_size: int) -> tuple[int, int]:
        # Every image is resized to the tower's square and pooled to mm_tokens_per_image, whatever its size.
        side, patch = vc.get("image_size", 896), vc.get("patch_size", 14)
        return vc.get("mm_tokens_per_image", 256) + 2, (side // patch) ** 2  # + start/end-of-image tokens


class LlavaOnevisionFamily(Family):
    """LLaVA-OneVision: SigLIP 384-px tiles in an any-resolution grid (aspect kept) into a Qwen2 language model."""

    name = "llava_onevision"
    model_types = ("llava_onevision",)
    language_model_scope = "language_model"
    projector_scope = "multi_modal_projector"
    vision_scope = "vision_tower"
    default_image_size = 384
    end_token = "<|im_end|>"
    image_token = "<image>"
    special_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
    chat_template = templates.LLAVA_ONEVISION
    runtimes = Runtimes(False, False, vllm_note="vLLM serves LlavaOnevisionForConditionalGeneration but takes no "
                        "LoRA for it: serve the merged checkpoint (`export-model --merge`, `vllm serve merged`)",
                        gguf_note="convert_hf_to_gguf.py has no LLaVA-OneVision conversion (no --mmproj for its "
                        "any-resolution tiles)")

    def planned_image_tokens(self, vc: dict[str, Any], image_size: int) -> tuple[int, int]:
        # A base tile plus the any-resolution grid the pinpoints allow (a square image: n×n tiles), one newline
        # token per row of grid features, scaled down past `anyres_max_N` tiles' worth (the processor's rule).
        tile, patch = vc.get("image_size", 384), vc.get("patch_size", 14)
        side = tile // patch
        largest = max((max(p) for p in vc.get("image_grid_pinpoints") or [[tile, tile]]), default=tile)
        n = max(1, min(math.ceil(image_size / tile), largest // tile))
        rows = cols = n * side
        cap = int(str(vc.get("vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_") or 9)
        ratio = math.sqrt(rows * cols / (cap * side * side))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return side * side + rows * cols + rows, (1 + n * n) * side * side


class InternVLFamily(Family):
    """InternVL 3 (-hf checkpoints): InternViT 448-px tiles + pixel shuffle into a Qwen2 language model."""

    name = "internvl"
    model_types = ("internvl",)
    language_model_scope = "language_model"
    projector_scope = "multi_modal_projector"
    vision_scope = "vision_tower"
    default_image_size = 448
    end_token = "<|im_end|>"
    image_token = "<IMG_CONTEXT>"
    special_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    chat_template = templates.INTERNVL
    runtimes = Runtimes(True, False, vllm_note="InternVLForConditionalGeneration (-hf): LoRA on the language "
                        "model", gguf_note="llama.cpp's converter (at 0c1e57098) registers InternVL's original "
                        "InternVLChatModel layout (InternVisionModel) only, not the -hf "
                        "InternVLForConditionalGeneration tamis trains: it answers 'Model "
                        "InternVLForConditionalGeneration is not supported'")
    square_tiles = True
    box_codec = "internvl_ref"

    def processor_kwargs(self, image_size: int, *, tile: int | None = None) -> dict[str, Any]:
        # Up to one tile the image is that tile alone; larger ones are cropped into tiles plus a thumbnail.
        return {"crop_to_patches": tile is not None and image_size > tile}

    def planned_image_tokens(self, vc: dict[str, Any], image_size: int) -> tuple[int, int]:
        tile, patch = vc.get("image_size", 448), vc.get("patch_size", 14)
        tiles = 1 if image_size <= tile else math.ceil(image_size / tile) ** 2 + 1
        patches = (tile // patch) ** 2
        per_tile = int(patches * vc.get("downsample_ratio", 0.5) ** 2)
        return tiles * per_tile + 2, tiles * patches  # + <img> and </img>


FAMILIES: dict[str, type[Family]] = {
    "idefics3": Idefics3Family,
    "smolvlm": SmolVLMFamily,
    "qwen2_vl": Qwen2VLFamily,
    "qwen2_5_vl": Qwen25VLFamily,
    "qwen3_vl": Qwen3VLFamily,
    "gemma3": Gemma3Family,
    "llava_onevision": LlavaOnevisionFamily,
    "internvl": InternVLFamily,
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)} (or auto, for the generic "
                         "fallback)")
    return FAMILIES[name]()


def family_of_model_type(model_type: str | None) -> str | None:
    """The registered family whose `model_types` include `model_type`, or None."""
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam.name
    return None


def read_model_type(name_or_path: str | Path) -> str | None:
    """config.json's `model_type` of a local folder, or of a hub ID through the cache."""
    path = Path(name_or_path)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{path}: no config.json; is this a saved model folder? Set model.family explicitly "
                             f"or point model.name_or_path at a checkpoint folder")
        try:
            return json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
        except json.JSONDecodeError as exc:
            raise ModelError(f"{cfg_file}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(name_or_path)).model_type
    except OSError as exc:
        raise ModelError(f"{name_or_path}: cannot read its config ({exc}); offline, use a local folder") from None


def detect_family(name_or_path: str | Path) -> str:
    """The family of a checkpoint from its config.json `model_type` (a local folder, or a hub ID via the cache)."""
    model_type = read_model_type(name_or_path)
    found = family_of_model_type(model_type)
    if found is not None:
        return found
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values())
    raise ModelError(f"{name_or_path}: model_type {model_type!r} is not a supported family; supported: {supported}; "
                     "set model.family: auto to try the generic fallback")
