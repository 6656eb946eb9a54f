"""What an export's standalone predict.py needs to ask the model as the rounds did (predict_config.json), and the
script itself, copied into the export (pipeline/serving/predict_script.py: it imports nothing of tamis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import DataConfig, ModelConfig, PreprocessConfig, SelectConfig

SCRIPT = Path(__file__).with_name("predict_script.py")
CONFIG_NAME, SCRIPT_NAME = "predict_config.json", "predict.py"


def predict_config(*, loaded: Any, processor: Any, data: DataConfig, preprocess: PreprocessConfig, model: ModelConfig,
                   select: SelectConfig | None, size: int) -> dict[str, Any]:
    """predict_config.json: the question and answers, the chat template tamis rendered prompts with (and how it
    appends an answer the template renders differently), the processor keywords every tamis call passes for prepared
    images of `size`, and the image preparation (preprocess stage) that makes them."""
    family = loaded.family
    question = next((s.question for s in data.sources if s.question), None) or data.question
    return {
        "format": 1,
        "family": family.name,
        "question": question,
        "answers": list(data.answers) if data.answers else None,
        "length_normalize": True if select is None else bool(select.length_normalize),
        "max_new_tokens": model.max_new_tokens,
        "chat_template": getattr(processor, "chat_template", None) or family.chat_template,
        "answer_prefix": family.answer_prefix,
        "end_token": family.end_token,
        "processor_kwargs": family.processor_kwargs(size, tile=family.tile_size(processor)),
        # The base a qlora adapter was trained against (pipeline.model.loading.build_bnb_config's settings).
        "base_quantization": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
        if model.mode == "qlora" else None,
        "image": {"size": size, "pad": preprocess.pad, "pad_color": list(preprocess.pad_color),
                  "background": list(preprocess.background)},
    }
