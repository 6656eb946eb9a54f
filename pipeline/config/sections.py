"""The config sections of the data and model stages: sources, preprocess, quality, augment, model, train,
embeddings and select."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from pipeline.config.answers import ClosedAnswers
from pipeline.config.base import Section
from pipeline.fields.schema import AnswerSchema, load_answer_schema

# trl / sharegpt / swift: conversations with several images and turns (pipeline/data/conversations.py).
# coco: a COCO detection file, for box projects (data.task: boxes; pipeline/data/readers.py CocoReader).
SourceKind = Literal["folder", "jsonl", "csv", "hf", "label_studio", "trl", "sharegpt", "swift", "coco", "yolo"]
Split = Literal["train", "pool", "test"]


class SourceConfig(Section):
    """One place samples come from. Paths inside a manifest are relative to the manifest's folder."""

    kind: SourceKind
    path: Path
    image_column: str = "image"
    question_column: str = "question"
    answer_column: str = "answer"
    split_column: str = "split"
    # The source's own sample ID (kept in the dataset as `external_id`): label files may name samples by it.
    id_column: str = "id"
    # Split given to rows that do not name one. Labeled rows default to train, unlabeled ones to pool.
    default_split: Split | None = None
    # Image folders: the question asked of every image, and the sidecar text file extension (if any).
    question: str | None = None
    sidecar_ext: str = ".txt"
    # Label Studio exports: the task data keys.
    data_image_key: str = "image"
    data_text_key: str = "text"
    hf_split: str | None = None


Task = Literal["answer", "boxes"]


@functools.lru_cache(maxsize=8)
def _schema_at(path: str, stamp: int) -> AnswerSchema:
    """load_answer_schema, read once per file version (`stamp`: its mtime): ingest asks for every row."""
    return load_answer_schema(path)


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=list)
    task: Task = Field(
        default="answer",
        description="What a label is. 'answer' (default): one answer per image, closed (data.answers) or open. "
        "'boxes': a list of (class, box) in the image's own pixels, the classes listed in data.answers "
        "(docs/boxes.md); a box label is stored as canonical JSON text (pipeline/boxes/answer.py).")
    # Closed answer set (classification / multiple-choice VQA). None means open answers (captions, free-form VQA).
    # Under data.task: boxes, the class list (one class is enough).
    answers: list[str] | None = None
    answer_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Other spellings annotators use for a closed answer → the answer of data.answers they mean, e.g. "
        "{'hotdog': 'hot dog'}. Labels match an answer ignoring case, character width and repeated spaces without "
        "an alias (pipeline/config/answers.py); each import reports the labels it mapped.")
    question: str = "What is shown in the image?"
    answer_schema: Path | None = Field(
        default=None,
        description="A JSON Schema file (relative to the config's folder) for answers that are JSON objects of fields: "
        "an object whose properties are enums, strings or numbers (docs/structured.md). Answers are validated against "
        "it, evaluated per field and labeled with one control per field. Not with data.answers (each enum field is its "
        "own closed set).")
    # Decompression-bomb guard: images with more pixels than this are quarantined, not decoded.
    max_image_pixels: int = Field(default=64_000_000, ge=1)
    # Extra roots a manifest may point into besides its own folder (absolute image paths are checked against these).
    allowed_roots: list[Path] = Field(default_factory=list)
    # Simulated annotator: a JSONL of held-back answers (sample_id / image → answer).
    ground_truth: Path | None = None
    verify: Literal["listing", "stat", "content"] = Field(
        default="listing",
        description="How ingest learns which image files changed. 'listing' (default) compares each source folder's "
        "modification time with the one recorded in artifacts/ingest/listing.json (one stat per folder, not per file): "
        "it sees files added, removed or renamed, not a file rewritten in place under the same name, so every "
        "data.sweep_every-th run stats every file instead. 'stat' stats every file each run, trusting its size, mtime "
        "and inode as recorded in artifacts/ingest/file_index.npz. 'content' re-reads every file: the only mode that "
        "sees a same-size rewrite whose old timestamp was put back (touch -d), and the one for filesystems whose "
        "mtimes cannot be trusted. All three give the same cache key.")
    sweep_every: int = Field(
        default=10, ge=1,
        description="Under data.verify: listing, after this many checks answered by the folders' listings the next "
        "one stats every image file (as verify: stat), so a file rewritten in place is seen within that many checks "
        "(tamis ingest checks once, tamis round once or twice).")

    @field_validator("answers")
    @classmethod
    def _answers_unique(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is not None:
            boxes = info.data.get("task") == "boxes"  # a detector of one class is a real project; a classifier is not
            if len(v) < (1 if boxes else 2):
                raise ValueError("a box project's class list needs at least 1 class" if boxes
                                 else "a closed answer set needs at least 2 answers")
            if len(set(v)) != len(v):
                raise ValueError("answers must be unique")
        return v

    @model_validator(mode="after")
    def _answers_distinct_as_labels(self) -> DataConfig:
        if self.answers is not None:
            ClosedAnswers.of(self.answers, self.answer_aliases)  # ValueError naming both colliding spellings
        elif self.answer_aliases:
            raise ValueError("data.answer_aliases maps labels to a closed answer set, but data.answers is not set "
                             "(open answers); declare data.answers or remove the aliases")
        if self.answer_schema is not None and self.answers is not None:
            raise ValueError("data.answer_schema and data.answers are both set: answers under a schema are JSON "
                             "objects, each enum field its own closed set; remove data.answers (or the schema)")
        if self.task == "boxes" and self.answers is None:
            raise ValueError("data.task: boxes needs its class list in data.answers (e.g. answers: [cat, dog]); "
                             "boxes have no open-answer form")
        if self.task == "boxes" and self.answer_schema is not None:
            raise ValueError("data.task: boxes and data.answer_schema are both set: a box label is a list of "
                             "(class, box), not a JSON object of fields; remove data.answer_schema")
        return self

    @property
    def scored_answers(self) -> list[str] | None:
        """The closed answer set the model is scored and evaluated against: data.answers, except under data.task:
        boxes, whose model writes its boxes as generated text (open answers; data.answers is the class list)."""
        return None if self.task == "boxes" else self.answers

    @property
    def schema(self) -> AnswerSchema | None:
        """The answer schema of data.answer_schema, read and checked (pipeline/fields/schema.py); None without one."""
        if self.answer_schema is None:
            return None
        p = Path(self.answer_schema)
        try:
            stamp = p.stat().st_mtime_ns
        except OSError:
            stamp = 0
        return _schema_at(str(p), stamp)

    @property
    def box_labels(self) -> list[str] | None:
        """The class list of a box project (data.task: boxes); None for one-answer projects."""
        return self.answers if self.task == "boxes" else None

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        # Without aliases the section dumps as before the field existed: the ingest key of a project is unchanged.
        data = handler(self)
        if isinstance(data, dict) and not self.answer_aliases:
            data.pop("answer_aliases", None)
        if isinstance(data, dict) and self.answer_schema is None:  # the same for the schema (issue 51)
            data.pop("answer_schema", None)
        if isinstance(data, dict) and self.task == "answer":  # and for the task (issue 50)
            data.pop("task", None)
        return data


class PreprocessConfig(Section):
    # Longest side in pixels; None picks the model family's default so its processor never stretches.
    size: int | None = Field(default=None, ge=1)
    pad: Literal["none", "square"] = "none"
    pad_color: tuple[int, int, int] = (0, 0, 0)
    # Transparent pixels are composited on this colour.
    background: tuple[int, int, int] = (255, 255, 255)
    num_proc: int = Field(default=1, ge=1)


QualityFlag = Literal["blurry", "exact_duplicate", "near_duplicate", "low_information"]


class QualityConfig(Section):
    blur_threshold: float = Field(default=10.0, ge=0)
    low_information_std: float = Field(default=2.0, ge=0)
    near_duplicate_distance: int = Field(default=4, ge=0)
    # Flags that keep a sample out of the pool (nothing is ever deleted).
    exclude: list[QualityFlag] = Field(default_factory=lambda: ["exact_duplicate", "low_information"])


class ImageAugmentConfig(Section):
    brightness_contrast_p: float = Field(default=0.5, ge=0, le=1)
    brightness_limit: float = Field(default=0.2, ge=0, le=1)
    contrast_limit: float = Field(default=0.2, ge=0, le=1)
    affine_p: float = Field(default=0.5, ge=0, le=1)
    rotate_limit: float = Field(default=10.0, ge=0, le=180)
    scale_limit: float = Field(default=0.1, ge=0, le=0.5)
    translate_limit: float = Field(default=0.05, ge=0, le=0.5)
    blur_p: float = Field(default=0.1, ge=0, le=1)
    blur_limit: int = Field(default=3, ge=3)
    noise_p: float = Field(default=0.1, ge=0, le=1)
    horizontal_flip_p: float = Field(default=0.0, ge=0, le=1)


class TextAugmentConfig(Section):
    keyboard_p: float = Field(default=0.0, ge=0, le=1)
    ocr_p: float = Field(default=0.0, ge=0, le=1)
    random_char_p: float = Field(default=0.0, ge=0, le=1)
    word_swap_p: float = Field(default=0.0, ge=0, le=1)
    word_delete_p: float = Field(default=0.0, ge=0, le=1)
    word_crop_p: float = Field(default=0.0, ge=0, le=1)
    synonym_p: float = Field(default=0.0, ge=0, le=1)


class AugmentConfig(Section):
    copies: int = Field(default=0, ge=0)
    image: ImageAugmentConfig = Field(default_factory=ImageAugmentConfig)
    text: TextAugmentConfig = Field(default_factory=TextAugmentConfig)
    num_proc: int = Field(default=1, ge=1)


# The registered families (pipeline/model/families.py) and auto: a registered family when the checkpoint's model_type
# has one, else the generic fallback for any image-text-to-text checkpoint with a chat template.
Family = Literal["idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava_onevision", "internvl",
                 "auto"]


class ModelConfig(Section):
    # Hub ID or local directory. Offline machines must use a local directory.
    name_or_path: str = "artifacts/models/tiny-idefics3"
    # Detected from the checkpoint's config when not given.
    family: Family | None = None
    # The token that ends an answer, for model.family: auto when the chat template writes no special token after
    # an answer and the tokenizer has no EOS (the registered families know theirs).
    end_token: str | None = None
    # When the model directory is missing, build a tiny random-weight model of this family there (tests, demo).
    build_tiny_if_missing: bool = False
    mode: Literal["qlora", "lora", "full"] = "qlora"
    lora_r: int = Field(default=8, ge=1)
    lora_alpha: int = Field(default=16, ge=1)
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    # None uses the family's default target modules.
    target_modules: list[str] | None = None
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto"
    # auto = bf16 where the GPU supports it, else fp16 on GPU, fp32 on CPU.
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_new_tokens: int = Field(default=16, ge=1)
    # Which parts get LoRA adapters (derived from the family, like the language-model default): `language`, or also
    # the vision→text projector, or also the vision tower. Ignored in full mode (everything trains); an explicit
    # `target_modules` list replaces it.
    train: Literal["language", "language+projector", "all"] = "language"
    # Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): auto = on when the `liger`
    # extra is installed and training runs on CUDA. Never applied on the CPU (Triton GPU kernels).
    liger: bool | Literal["auto"] = "auto"
    # Set by tamis, never in a config file: the checkpoint's content and the library versions (pipeline/model/
    # identity.py), filled into the section the train, evaluate, score and label-check stages are keyed on.
    identity: dict[str, Any] | None = None
    # (name_or_path as the config file spells it, the absolute folder loading made of it): what an export names as
    # its base (an absolute path would tell whoever receives it the user's name and the host's layout). Private, so
    # no dump and no cache key sees it.
    _as_written: tuple[str, str] | None = PrivateAttr(default=None)

    @property
    def name_as_written(self) -> str:
        """name_or_path as the config wrote it; name_or_path itself once something else has replaced it."""
        if self._as_written is not None and self._as_written[1] == self.name_or_path:
            return self._as_written[0]
        return self.name_or_path

    @model_serializer(mode="wrap")
    def _identity_when_known(self, handler: Any) -> Any:
        # Left out of the dump when unset: stages not keyed on the model's content keep their keys.
        data = handler(self)
        if isinstance(data, dict) and data.get("identity", ...) is None:
            del data["identity"]
        return data

    @model_validator(mode="after")
    def _one_way_to_pick_targets(self) -> ModelConfig:
        if self.target_modules and self.train != "language":
            raise ValueError(f"model.target_modules ({self.target_modules}) and model.train ({self.train!r}) both "
                             "choose the LoRA targets; remove target_modules or set model.train: language")
        return self


class TrainConfig(Section):
    # "auto" lets the memory planner choose micro-batch / accumulation / checkpointing for the hardware.
    batch_size: int | Literal["auto"] = "auto"
    effective_batch_size: int = Field(default=16, ge=1)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    epochs: float = Field(default=1.0, gt=0)
    max_steps: int | None = Field(default=None, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_ratio: float = Field(default=0.05, ge=0, lt=1)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    checkpoint_every: int = Field(default=50, ge=1)
    init: Literal["fresh", "warm"] = "fresh"
    max_grad_norm: float = Field(default=1.0, gt=0)
    # auto: adamw_8bit for model.mode full (fp32 AdamW keeps 8 bytes per parameter, more than bf16 weights; 8-bit
    # state keeps ~2), paged_adamw for qlora on CUDA (the QLoRA recipe: pages state to host memory to absorb the
    # spikes of checkpointed steps), adamw otherwise (LoRA state is a few MB; paging is a CUDA feature).
    optimizer: Literal["auto", "adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"] = "auto"
    # Move the activations autograd saves outside checkpointed layers to pinned host memory on CUDA (fetched back
    # in backward). A no-op on the CPU, where activations already live in host memory (logged once).
    activation_offload: bool = False
    # Data-parallel training processes, one per device (auto: every visible GPU, 1 on a CPU-only machine). The
    # effective batch is kept: per-device micro-batch × accumulation × processes = effective_batch_size.
    num_processes: Annotated[int, Field(ge=1)] | Literal["auto"] = 1


class PoolEncoderConfig(Section):
    """A small SimCLR-style encoder trained on the unlabeled pool's images (`select.embeddings: pool`)."""

    dim: int = Field(default=128, ge=2)  # embedding width (the projection head's input)
    image_size: int = Field(default=32, ge=8)  # images are resized (aspect kept, padded) to this side first
    epochs: int = Field(default=30, ge=1)
    batch_size: int = Field(default=256, ge=2)
    learning_rate: float = Field(default=1e-3, gt=0)
    temperature: float = Field(default=0.5, gt=0)
    # Fitting reads at most this many pool images (a seeded sample); every sample is embedded afterwards.
    max_fit_images: int = Field(default=20_000, ge=2)


class EmbeddingsConfig(Section):
    """The space diversity, coverage and outlier selection work in, independent of the adapter being trained.

    model: pooled hidden states of the current model (its scoring pass); pool: a self-supervised encoder fitted on
    the unlabeled pool only; pixels: downsampled pixels → PCA with whitening (fitted on the pool only); vision_tower:
    the frozen vision encoder of the configured base model; file: embeddings you bring (.npy + ids, or Parquet).
    """

    source: Literal["model", "pool", "pixels", "vision_tower", "file"] = "model"
    pixels_side: int = Field(default=16, ge=2)
    pca_dim: int = Field(default=32, ge=1)
    encoder: PoolEncoderConfig = Field(default_factory=PoolEncoderConfig)
    # source: file — a .npy with a sidecar <name>.ids.json (list of keys, row order), or a .parquet with a key column
    # and an embedding column (list of floats). Keys are sample IDs or image paths as given in the sources.
    path: Path | None = None
    key: Literal["sample_id", "image"] = "sample_id"
    parquet_key_column: str = "sample_id"
    parquet_embedding_column: str = "embedding"

    @model_validator(mode="after")
    def _file_needs_path(self) -> EmbeddingsConfig:
        if self.source == "file" and self.path is None:
            raise ValueError("select.embeddings.path: is required with source 'file'; point it at your .npy or "
                             ".parquet embeddings")
        return self


class ScheduleConfig(Section):
    """Budget-aware selection: coverage while labels are scarce, then select.strategy × select.diversity.

    The switch rule: `labels_per_class` switches once the labeled set holds that many labels per answer (closed
    sets) or in total × 10 (open answers); `newest_accuracy` switches once the model's accuracy on its newest
    labels (scored before they were trained on) stops rising for `patience` rounds.
    """

    coverage: Literal["none", "typiclust", "probcover", "maxherding"] = "none"
    switch: Literal["labels_per_class", "newest_accuracy"] = "labels_per_class"
    labels_per_class: int = Field(default=10, ge=1)
    patience: int = Field(default=1, ge=1)


# The protocols a Dask scheduler address can name (distributed.comm's registry).
DASK_PROTOCOLS = ("tcp", "tls", "ws", "wss", "ucx", "inproc")

Diversity = Literal["top_k", "k_center", "cluster_margin", "stratified", "typiclust", "probcover", "maxherding",
                    "uncertainty_herding", "class_balanced"]


class CandidatesConfig(Section):
    """Candidate restriction before scoring (pipeline.strategies.candidates): which eligible samples a round scores.

    all: every eligible sample (the cost of a round's scoring is the pool × a forward); restrict: at most `size`
    samples chosen without the model from the selection embeddings: the nearest unlabeled neighbours of the labeled
    set (SEALS, Coleman et al. 2022), representatives of k-means clusters no label covers yet, and a seeded random
    fill, in the proportions of `shares`. Needs select.embeddings other than `model` (the model's embeddings only
    exist once the pool is scored).
    """

    method: Literal["auto", "all", "restrict"] = Field(
        default="auto", description="auto = all up to auto_above eligible samples, restrict above (when "
        "select.embeddings gives a space to restrict in); all = score every eligible sample; restrict = score only "
        "the candidates")
    auto_above: int = Field(default=10_000, ge=1, description="method auto restricts a round whose eligible pool is "
                            "larger than this (pipeline.strategies.candidates.candidates_choice says why this size)")
    size: int | None = Field(default=None, ge=1, description="candidates per round; None = per_batch × "
                             "select.batch_size")
    per_batch: int = Field(default=10, ge=1, description="the default size as a multiple of select.batch_size")
    shares: dict[Literal["neighbors", "clusters", "random"], float] | None = Field(
        default=None,
        description="fraction of the candidates from each source; what a source cannot fill goes to the random fill. "
        "None = the round's selector's own (Selector.candidate_shares): a uniform sample (random 1.0) for MaxHerding "
        "and Uncertainty Herding, whose gain averages over their candidates; neighbors 0.5, clusters 0.3, random 0.2 "
        "for the others")
    clusters: int = Field(default=100, ge=2, description="k-means clusters on the selection embeddings (fitted once "
                          "per embeddings, cached)")

    @field_validator("shares")
    @classmethod
    def _shares(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (any(x < 0 for x in v.values()) or not 0.999 <= sum(v.values()) <= 1.001):
            raise ValueError(f"shares must be ≥ 0 and sum to 1, got {v} (sum {sum(v.values()):g}); e.g. "
                             "{neighbors: 0.5, clusters: 0.3, random: 0.2}")
        return v

    def size_for(self, batch_size: int) -> int:
        return self.size if self.size is not None else self.per_batch * batch_size


class SelectConfig(Section):
    batch_size: int = Field(default=32, ge=1)
    # Heuristic name, one of pipeline.strategies.HEURISTICS.
    strategy: Literal[
        "random", "least_confidence", "margin", "entropy", "bald", "token_entropy", "answer_disagreement",
        "semantic_entropy",
    ] = "entropy"
    diversity: Diversity = "top_k"
    # The first batch, before any model exists: typical (the legacy TypiClust-style pick), random, or a coverage
    # selector on the selection embeddings.
    cold_start: Literal["typical", "random", "typiclust", "probcover", "maxherding"] = "typical"
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    shard_size: int = Field(default=256, ge=1)
    # At most this many score-shard tasks per round: a pool above shard_size × max_tasks gets shards of the next
    # power of two ≥ pool / max_tasks (a Dask scheduler keeps ~16 KiB per task), smaller pools keep shard_size.
    max_tasks: int = Field(default=2000, ge=1)
    score_batch_size: int = Field(default=16, ge=1)
    mc_dropout_passes: int = Field(default=0, ge=0)
    length_normalize: bool = True
    runner: Literal["local", "dask"] = "local"
    # An existing Dask scheduler (tcp://host:port, or tls://… with Dask's distributed.comm.tls.* settings), used
    # when runner is dask; None starts a local cluster on 127.0.0.1 for the round.
    dask_address: str | None = None
    # The local Dask cluster (no dask_address): on a GPU machine one worker process per visible GPU, each pinned to
    # its device (auto), or this many over the GPUs in turn; on a CPU-only machine this many CPU workers (auto: 2).
    dask_workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    outliers: Literal["keep", "downweight", "exclude"] = "keep"
    # Outlier flags: robust z of the mean distance to this many nearest neighbours (labeled ∪ pool) above outlier_z,
    # or in the top 10 % of uncertainty for uncertain_rounds rounds despite labeled neighbours.
    outlier_neighbors: int = Field(default=10, ge=1)
    outlier_z: float = Field(default=3.5, gt=0)
    outlier_weight: float = Field(default=0.5, ge=0, le=1)
    uncertain_rounds: int = Field(default=3, ge=2)
    # Annotation cost (pipeline/strategies/cost.py): predicted = rank by expected gain per predicted second, with a
    # cost model refitted each round on the labeled samples' recorded seconds; none = by gain alone.
    cost: Literal["none", "predicted"] = "none"
    cost_min_timed: int = Field(default=20, ge=5, description="timed labels the cost model needs; fewer = cost-blind")
    cost_min_r2: float = Field(default=0.05, le=1, description="cross-validated R² of log-seconds the cost model "
                               "needs to be used; below it the seconds are taken as unpredictable (cost-blind)")
    candidates: CandidatesConfig = Field(default_factory=CandidatesConfig)

    @field_validator("candidates", mode="before")
    @classmethod
    def _candidates_shorthand(cls, v: Any) -> Any:
        # `select.candidates: restrict` is short for `select.candidates: {method: restrict}`.
        return {"method": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _candidates_need_a_space(self) -> SelectConfig:
        if self.candidates.method == "restrict" and self.embeddings.source == "model":
            raise ValueError("select.candidates: restrict picks candidates before any forward, from the selection "
                             "embeddings, and select.embeddings.source 'model' has none before scoring; set "
                             "select.embeddings to pool, pixels, vision_tower or file, or select.candidates: all")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        # A config that does not restrict candidates, or leaves them all at their defaults (auto), dumps as it did
        # before the field existed, so every stage keyed on the select section keeps its cache key; what auto chose
        # for a round is in the select stage's own parameters (pipeline.selection.plan_selection).
        data = handler(self)
        if isinstance(data, dict) and (self.candidates.method == "all" or self.candidates == CandidatesConfig()):
            data.pop("candidates", None)
        return data

    @field_validator("embeddings", mode="before")
    @classmethod
    def _embeddings_shorthand(cls, v: Any) -> Any:
        # `select.embeddings: pool` is short for `select.embeddings: {source: pool}`.
        return {"source": v} if isinstance(v, str) else v

    @field_validator("dask_address")
    @classmethod
    def _dask_address(cls, v: str | None) -> str | None:
        # A bare host:port would reach Dask as tcp://, silently unencrypted where tls:// was meant: name the protocol.
        if v is not None and v.split("://", 1)[0] not in DASK_PROTOCOLS:
            raise ValueError(f"dask_address {v!r} names no Dask protocol; write tcp://host:8786 (a scheduler on a "
                             f"private address) or tls://host:8786 (with distributed.comm.tls.* set)")
        return v

    @model_validator(mode="after")
    def _address_needs_dask(self) -> SelectConfig:
        if self.dask_address and self.runner != "dask":
            raise ValueError(f"select.dask_address is {self.dask_address!r} but select.runner is {self.runner!r}: "
                             f"set runner: dask to score on that cluster, or drop dask_address")
        return self


