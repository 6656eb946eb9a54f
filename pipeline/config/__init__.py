"""One project config: a pydantic model loaded once from YAML and validated up front.

Relative paths in a config are resolved against the directory the command runs in (the project root), once, at
load time, so that later stages never depend on the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config.annotate import (  # noqa: F401 (re-exported: callers import sections from pipeline.config)
    AnnotateConfig,
    ConvergedRule,
    LabelCheckConfig,
    LabelStudioConfig,
    RedundancyRule,
    RoundsConfig,
    SecondsModel,
    SimulatedAnnotator,
    StableRule,
)
from pipeline.config.base import Section  # noqa: F401 (re-exported)
from pipeline.config.combinations import (
    BOX_MAX_NEW_TOKENS,
    OPEN_DEFAULT_STRATEGY,
    box_section_errors,
    combination_errors,
)
from pipeline.config.secrets import HIDDEN, is_secret_key, redact
from pipeline.config.sections import (  # noqa: F401 (re-exported: callers import sections from pipeline.config)
    DASK_PROTOCOLS,
    AugmentConfig,
    CandidatesConfig,
    DataConfig,
    Diversity,
    EmbeddingsConfig,
    Family,
    ImageAugmentConfig,
    ModelConfig,
    PoolEncoderConfig,
    PreprocessConfig,
    QualityConfig,
    QualityFlag,
    ScheduleConfig,
    SelectConfig,
    SourceConfig,
    SourceKind,
    Split,
    TextAugmentConfig,
    TrainConfig,
)
from pipeline.config.trigger import TriggerConfig  # noqa: F401 (re-exported)
from pipeline.errors import ConfigError
from pipeline.fields.schema import load_answer_schema

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent.parent / "configs" / "demo.yaml"


class PathsConfig(Section):
    artifacts: Path = Path("artifacts")


class ProjectConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    annotate: AnnotateConfig = Field(default_factory=AnnotateConfig)
    labelcheck: LabelCheckConfig = Field(default_factory=LabelCheckConfig)
    rounds: RoundsConfig = Field(default_factory=RoundsConfig)
    seed: int = 0
    paths: PathsConfig = Field(default_factory=PathsConfig)

    @model_validator(mode="after")
    def _a_round_can_run_this(self) -> ProjectConfig:
        """Refuse, at load (and so in every command, check-model included), each combination of settings a round
        would refuse later (pipeline/config/combinations.py). Open answers that name no strategy get token_entropy:
        the default, entropy, reads class probabilities they do not have; so do box answers (data.task: boxes)."""
        boxes = self.data.task == "boxes"
        if (self.data.answers is None or boxes) and "strategy" not in self.select.model_fields_set:
            self.select.strategy = OPEN_DEFAULT_STRATEGY
        if boxes:
            self._box_defaults()
        errors = [*combination_errors(self.data, self.select),
                  *box_section_errors(self.data, self.augment, self.labelcheck, self.annotate)]
        if errors:
            raise ValueError("\n  ".join(errors))
        return self

    def _box_defaults(self) -> None:
        """A box project's defaults where the one-answer ones cannot work: answers long enough for a few boxes, the
        heldout label check (kfold cannot train on box labels), class-balanced selection and box_iou consensus."""
        if "max_new_tokens" not in self.model.model_fields_set:
            self.model.max_new_tokens = BOX_MAX_NEW_TOKENS
        if "method" not in self.labelcheck.model_fields_set:
            self.labelcheck.method = "heldout"  # box checks (pipeline/labelcheck/boxes.py) with no extra training
        if "diversity" not in self.select.model_fields_set:
            # the recipe benchmarks/results/box_selection.json measured ahead of random (docs/boxes.md)
            self.select.diversity = "class_balanced"
        if "consensus" not in self.annotate.model_fields_set:
            self.annotate.consensus = "box_iou"  # boxes are matched by IoU, never compared as text

    def section(self, name: str) -> dict[str, Any]:
        """A section as plain JSON data: what a stage records next to its outputs and keys its cache on."""
        return getattr(self, name).model_dump(mode="json") if name != "seed" else {"seed": self.seed}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @property
    def artifacts(self) -> Path:
        return self.paths.artifacts


def _describe(err: dict[str, Any]) -> str:
    """One line per error; the input it quotes is redacted (pipeline/config/secrets.py): never a secret's value."""
    loc = ".".join(str(p) for p in err["loc"]) or "<top level>"
    kind, ctx = err["type"], err.get("ctx") or {}
    value = HIDDEN if any(is_secret_key(p) for p in err["loc"]) else redact(err.get("input"))
    if kind == "missing":
        return f"{loc}: is required but missing"
    if kind == "extra_forbidden":
        return f"{loc}: unknown key; remove it or check its spelling"
    bounds = {"greater_than_equal": "≥ {ge}", "greater_than": "> {gt}", "less_than_equal": "≤ {le}",
              "less_than": "< {lt}"}
    if kind in bounds:
        return f"{loc}: {value!r} is not allowed; must be {bounds[kind].format(**ctx)}"
    if kind == "literal_error":
        return f"{loc}: {value!r} is not allowed; must be one of {ctx.get('expected')}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and (not err["loc"] or msg.startswith((f"{loc}:", f"{loc}."))):
        return msg  # a whole-config check names its own fields
    return f"{loc}: {value!r} is not allowed; {msg}"


def _absolutize(cfg: ProjectConfig, root: Path) -> ProjectConfig:
    def fix(p: Path | None) -> Path | None:
        return None if p is None else (p if p.is_absolute() else (root / p)).resolve()

    cfg.paths.artifacts = fix(cfg.paths.artifacts)
    for src in cfg.data.sources:
        src.path = fix(src.path)
    cfg.data.allowed_roots = [fix(p) for p in cfg.data.allowed_roots]
    cfg.data.ground_truth = fix(cfg.data.ground_truth)
    cfg.data.answer_schema = fix(cfg.data.answer_schema)
    cfg.annotate.document_root = fix(cfg.annotate.document_root)
    cfg.rounds.labels_from = fix(cfg.rounds.labels_from)
    cfg.select.embeddings.path = fix(cfg.select.embeddings.path)
    # A local model directory is a path; a hub ID ("org/name") is not, unless such a folder exists here.
    mp = Path(cfg.model.name_or_path)
    if mp.is_absolute() or (root / mp).exists() or cfg.model.build_tiny_if_missing:
        written, cfg.model.name_or_path = cfg.model.name_or_path, str(fix(mp))
        cfg.model._as_written = (written, cfg.model.name_or_path)
    return cfg


def parse_config(data: dict[str, Any] | None, *, origin: str = "<config>", root: Path | None = None) -> ProjectConfig:
    """Validate a config mapping. Every error names the field, the bad value and what is allowed."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, not {type(data).__name__}")
    try:
        cfg = ProjectConfig.model_validate(data or {})
    except ValidationError as exc:
        lines = "\n".join(f"  {_describe(e)}" for e in exc.errors())
        raise ConfigError(f"{origin}: invalid config\n{lines}") from None
    cfg = _absolutize(cfg, (root or Path.cwd()).resolve())
    if cfg.data.answer_schema is not None:  # read once the path is the config's, not the working folder's
        try:
            load_answer_schema(cfg.data.answer_schema)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: invalid config\n  {exc}") from None
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: plain YAML silently keeps the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} appears twice in the same section; keep only one",
                        key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _safe_load(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_config(path: str | os.PathLike[str] | None = None, *, root: Path | None = None) -> ProjectConfig:
    """Load and validate a YAML config; None loads the embedded default (configs/demo.yaml)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass an existing YAML file with --config")
    try:
        data = _safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_config(data, origin=str(path), root=root)
