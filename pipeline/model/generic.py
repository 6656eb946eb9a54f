"""The generic fallback (`model.family: auto`): a family read off a checkpoint tamis has no class for.

For any checkpoint that `AutoModelForImageTextToText` builds and whose processor has a chat template:

- the answer starts where the generation prompt ends: the template rendered with and without
  `add_generation_prompt` must differ (that difference is the assistant cue);
- the end-of-turn token is the first special token the template writes after an answer (else the tokenizer's EOS);
- LoRA goes on the Linear layers inside the module `model.get_decoder()` returns (the language model);
- the vision tower is the module `model.get_encoder(modality="image")` returns, the projector the first module
  named like one (multi_modal_projector, connector, merger, mm_projector); embeddings come from the model's own
  `get_image_features`.

Each guess is logged; what cannot be determined is a `ModelError` that names the missing piece and the config key
(or the file in the checkpoint) that supplies it. A checkpoint whose model_type has a registered family gets that
family instead: `auto` never replaces a tested class with guesses.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar

from pipeline.errors import ModelError
from pipeline.model.families import Family, family_of_model_type, get_family, read_model_type

log = logging.getLogger(__name__)
PROBE_QUESTION = "What is shown in the image?"
PROBE_ANSWER = "a small red square"
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "mm_projector", "merger", "projector", "mlp1")
NO_MATCH = r"(?!)"  # a regex fragment that matches no module path


class GenericFamily(Family):
    """A family whose declarations were read off one checkpoint (`from_checkpoint`), not written by hand."""

    name = "auto"
    model_types: ClassVar[tuple[str, ...]] = ()
    square_tiles = False

    def __init__(self, **found: Any) -> None:
        # Instance attributes shadow the ClassVars the base class reads.
        self.guesses: dict[str, str] = found.pop("guesses")
        for key, value in found.items():
            setattr(self, key, value)

    def tile_size(self, processor: Any) -> int:
        try:
            return super().tile_size(processor)
        except (AttributeError, ModelError, TypeError):
            return self.default_image_size

    @classmethod
    def from_checkpoint(cls, source: str | Path, *, end_token: str | None = None, processor: Any = None,
                        config: Any = None) -> GenericFamily:
        from transformers import AutoConfig, AutoProcessor

        src = str(source)
        try:
            config = config or AutoConfig.from_pretrained(src)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{src}: cannot read its config.json ({exc}); point model.name_or_path at a saved "
                             "checkpoint folder") from None
        if getattr(config, "vision_config", None) is None:
            raise ModelError(f"{src}: model_type {config.model_type!r} has no vision_config: a text-only checkpoint. "
                             "tamis trains vision-language models; point model.name_or_path at one")
        meta = _meta_model(config, src)
        try:
            processor = processor or AutoProcessor.from_pretrained(src)
        except (OSError, ValueError, TypeError) as exc:
            raise ModelError(f"{src}: cannot load its processor ({type(exc).__name__}: {exc}); the folder needs the "
                             "processor's files (preprocessor_config.json, tokenizer files, processor_config.json) "
                             "as saved by `processor.save_pretrained`") from None
        if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
            raise ModelError(f"{src}: its processor is a {type(processor).__name__}, with no image processor and "
                             "tokenizer; save the model's multimodal processor (AutoProcessor) into the folder")
        guesses: dict[str, str] = {}
        lm_scope, leaves = _language_model(meta, src)
        guesses["language model"] = f"{lm_scope} (model.get_decoder()); LoRA on {', '.join(leaves)}"
        vision_scope = _vision_tower(meta)
        guesses["vision tower"] = vision_scope or "none found (model.get_encoder('image') returned the model)"
        projector = next((n for n, _ in meta.named_modules() if n.rsplit(".", 1)[-1] in PROJECTOR_NAMES), None)
        guesses["projector"] = projector or "none found"
        if not getattr(processor, "chat_template", None):
            raise ModelError(f"{src}: no chat template (neither chat_template.jinja nor a chat_template in the "
                             "processor or tokenizer config). The generic fallback builds prompts only from the "
                             "checkpoint's own template: use the instruct/chat variant of the model, or add its "
                             "chat_template.jinja to the folder")
        size = _image_size(processor, config)
        if size is None:
            raise ModelError(f"{src}: cannot tell the image size from the image processor or vision_config; set "
                             "preprocess.size")
        fam = cls(
            model_types=(config.model_type,), language_model_scope=lm_scope, default_target_modules=tuple(leaves),
            vision_scope=vision_scope or NO_MATCH, projector_scope=re.escape(projector) if projector else NO_MATCH,
            default_image_size=size, end_token=end_token or "", image_token=_image_token(processor),
            special_tokens=(), chat_template="", guesses=guesses,
        )
        cue = fam._render(processor, PROBE_QUESTION, None)
        bare = processor.apply_chat_template(fam.messages(PROBE_QUESTION), add_generation_prompt=False, tokenize=False)
        if cue == bare or not cue.startswith(bare):
            raise ModelError(f"{src}: its chat template writes no assistant cue for add_generation_prompt=True, so "
                             "where an answer starts cannot be found; use the chat/instruct variant of the model")
        guesses["answer start"] = f"after the generation prompt {cue[len(bare):]!r}"
        if not end_token:
            fam.end_token, how = _end_token(fam, processor, src)
            guesses["end of turn"] = f"{fam.end_token!r} ({how})"
        else:
            guesses["end of turn"] = f"{end_token!r} (model.end_token)"
        fam.end_token_id(processor)  # the tokenizer must know it
        guesses["answer rendering"] = fam.answer_rendering(processor, PROBE_QUESTION, PROBE_ANSWER)
        guesses["image size"] = f"{size} px (image processor / vision_config)"
        for what, guess in guesses.items():
            log.info("generic family for %s (%s): %s: %s", src, config.model_type, what, guess)
        return fam


def _meta_model(config: Any, src: str) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config)
    except ValueError:
        raise ModelError(f"{src}: model_type {config.model_type!r} is not an image-text-to-text architecture in "
                         "this transformers (AutoModelForImageTextToText cannot build it); tamis needs one") from None


def _language_model(meta: Any, src: str) -> tuple[str, list[str]]:
    import torch

    decoder = meta.get_decoder()
    name = next((n for n, m in meta.named_modules() if m is decoder and n), None)
    if decoder is meta or name is None:
        raise ModelError(f"{src}: model.get_decoder() does not name a language-model module, so LoRA targets cannot "
                         "be chosen; set model.target_modules to the leaf names to adapt (e.g. [q_proj, v_proj])")
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)})
    if not leaves:
        raise ModelError(f"{src}: the language model ({name}) has no Linear layers; set model.target_modules")
    return re.escape(name), leaves


def _vision_tower(meta: Any) -> str | None:
    try:
        tower = meta.get_encoder(modality="image")
    except (ValueError, AttributeError):
        return None
    name = next((n for n, m in meta.named_modules() if m is tower and n), None)
    return re.escape(name) if tower is not meta and name else None


def _image_size(processor: Any, config: Any) -> int | None:
    size = getattr(processor.image_processor, "size", None) or {}
    size = size if isinstance(size, dict) else {}
    side = size.get("height") or size.get("longest_edge")
    if side is None:
        side = getattr(config.vision_config, "image_size", None)
        side = side[0] if isinstance(side, (list, tuple)) else side
    return int(side) if side else None


def _image_token(processor: Any) -> str:
    for owner in (processor, processor.tokenizer):
        token = getattr(owner, "image_token", None)
        if isinstance(token, str) and token:
            return token
    return ""


def _end_token(fam: GenericFamily, processor: Any, src: str) -> tuple[str, str]:
    tok = processor.tokenizer
    full = fam._render(processor, PROBE_QUESTION, PROBE_ANSWER)
    at = full.rfind(PROBE_ANSWER)
    if at >= 0:
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        for tid in tok(full[at + len(PROBE_ANSWER):], add_special_tokens=False)["input_ids"]:
            if tid in special:
                return tok.convert_ids_to_tokens(tid), "the first special token the template writes after an answer"
    if tok.eos_token:
        return tok.eos_token, "the tokenizer's EOS: the template writes no special token after an answer"
    raise ModelError(f"{src}: cannot find the token that ends an answer (the chat template writes no special token "
                     "after it and the tokenizer has no EOS); set model.end_token")


def resolve_auto(source: str | Path, *, end_token: str | None = None) -> Family:
    """`model.family: auto`: the registered family of the checkpoint's model_type, else the generic fallback."""
    known = family_of_model_type(read_model_type(source))
    if known is not None:
        log.info("model.family auto: %s is a %s checkpoint (registered family)", source, known)
        return get_family(known)
    return GenericFamily.from_checkpoint(source, end_token=end_token)
