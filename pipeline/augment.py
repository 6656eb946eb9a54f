"""Seeded multimodal augmentation of labeled training rows: albumentations on the prepared image, nlpaug on the question.

Answers are never touched (they are the labels), and only rows with an answer are augmented, so the unlabeled pool
and the test split are always scored / evaluated on the prepared, unaugmented image. Every copy is seeded from a
digest of (seed, sample_id, copy), so its pixels and text are the same whichever process or batch produces it.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import random
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from pipeline.boxes.box import GEOMETRY_COLUMNS
from pipeline.codeversion import stage_version
from pipeline.config import AugmentConfig, ImageAugmentConfig, TextAugmentConfig
from pipeline.errors import DataError
from pipeline.preprocess import decode_prepared, encode_png
from pipeline.store import (
    Manifest,
    atomic_dir,
    digest_json,
    find_valid_manifest,
    load_stage_dataset,
    stage_dataset,
    stage_key,
    stage_ref,
    write_manifest,
)

if TYPE_CHECKING:
    import albumentations as A
    import datasets

    from pipeline.stage_ref import StageRef

log = logging.getLogger(__name__)

STAGE = "augment"
AUGMENT_VERSION = stage_version("1", "pipeline.augment")
# Where a system WordNet lives when it is not in an nltk_data folder (Debian/Ubuntu: apt-get install wordnet-base).
WORDNET_DIRS = (Path("/usr/share/wordnet"),)
WORDNET_HELP = (
    "synonym augmentation needs nltk and the WordNet data: `pip install nltk`, then either "
    "`apt-get install wordnet-base` (Debian/Ubuntu) or `python -m nltk.downloader wordnet` on a machine with network "
    "access (copy ~/nltk_data along for offline machines); or set augment.text.synonym_p: 0"
)


# --------------------------------------------------------------------------------------------------- image
def build_image_pipeline(cfg: ImageAugmentConfig, seed: int) -> A.Compose:
    # Imported here: albumentations pulls in torch (~10 s on a loaded 2-core machine), which a round whose stages all
    # come from the cache never needs.
    import albumentations as A

    """Photometric + small geometric changes that keep the label true (no crops that could cut the object out)."""
    blur_max = cfg.blur_limit if cfg.blur_limit % 2 else cfg.blur_limit + 1  # Gaussian kernels are odd
    return A.Compose(
        [
            A.RandomBrightnessContrast(brightness_limit=cfg.brightness_limit, contrast_limit=cfg.contrast_limit,
                                       p=cfg.brightness_contrast_p),
            A.Affine(rotate=(-cfg.rotate_limit, cfg.rotate_limit), scale=(1 - cfg.scale_limit, 1 + cfg.scale_limit),
                     translate_percent=(-cfg.translate_limit, cfg.translate_limit),
                     border_mode=cv2.BORDER_REFLECT_101, p=cfg.affine_p),
            A.GaussianBlur(blur_limit=(3, blur_max), p=cfg.blur_p),
            A.GaussNoise(std_range=(0.02, 0.08), p=cfg.noise_p),
            A.HorizontalFlip(p=cfg.horizontal_flip_p),
        ],
        seed=seed,
    )


# ---------------------------------------------------------------------------------------------------- text
@functools.cache  # loading WordNet's indexes takes seconds: once per process, not once per batch
def _find_wordnet() -> Any | None:
    """A WordNet corpus reader from nltk_data or a system folder; None if nltk or the data is missing (no download)."""
    try:
        import nltk
        from nltk.corpus.reader.wordnet import WordNetCorpusReader
    except ImportError:
        return None
    try:
        nltk.data.find("corpora/wordnet")
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
        return wordnet
    except LookupError:
        pass
    class SystemWordNet(WordNetCorpusReader):
        # Debian's wordnet-base ships the WordNet 3.0 database without `lexnames`, which nltk reads first.
        def open(self, file: str) -> Any:
            if file == "lexnames" and not (Path(str(self.root)) / file).is_file():
                return io.StringIO(_LEXNAMES)
            return super().open(file)

        def map_wn(self, version: str = "wordnet") -> None:
            return None  # the WordNet-3.0 sense map only serves multilingual lookups, and needs nltk's own copy

    for root in WORDNET_DIRS:
        if (root / "data.noun").is_file() and (root / "index.noun").is_file():
            # nltk ≥ 3.10 reads corpora only below its data path entries.
            if str(root) not in nltk.data.path:
                nltk.data.path.append(str(root))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The multilingual functions")
                return SystemWordNet(str(root), None)
    return None


# WordNet 3.0's lexicographer files (lexnames(5WN)): number, name, syntactic category (1 n, 2 v, 3 adj, 4 adv).
_LEXNAMES = "".join(
    f"{i:02d}\t{name}\t{ {'noun': 1, 'verb': 2, 'adj': 3, 'adv': 4}[name.split('.')[0]] }\n"
    for i, name in enumerate(
        "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
        "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive "
        "noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity "
        "noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change verb.cognition "
        "verb.communication verb.competition verb.consumption verb.contact verb.creation verb.emotion verb.motion "
        "verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl".split()
    )
)


def wordnet_available() -> bool:
    return _find_wordnet() is not None


def _synonym_aug(**kw: Any) -> Any:
    import nlpaug.augmenter.word as naw
    import nlpaug.model.word_dict as nmw
    from nlpaug.model.word_dict.word_dictionary import WordDictionary

    reader = _find_wordnet()
    if reader is None:
        return None
    import nltk

    try:
        # nltk ≥ 3.9 renamed the tagger data; nlpaug asks for the old name and would try to download it.
        nltk.data.find("taggers/averaged_perceptron_tagger_eng/")
        tagger = True
    except LookupError:
        tagger = False
        log.info("augment: no nltk POS tagger data; synonyms are drawn from every part of speech")

    class LocalWordNet(nmw.WordNet):
        def __init__(self) -> None:
            WordDictionary.__init__(self, cache=True)
            self.lang, self.is_synonym, self.model = "eng", True, reader

        def pos_tag(self, tokens: list[str]) -> list[tuple[str, str]]:
            return nltk.pos_tag(tokens) if tagger else [(t, "") for t in tokens]

    class LocalSynonymAug(naw.SynonymAug):
        def get_model(self, *_args: Any) -> Any:
            return LocalWordNet()

    return LocalSynonymAug(aug_src="wordnet", **kw)


def _nac() -> Any:
    import nlpaug.augmenter.char as nac

    return nac


def _naw() -> Any:
    import nlpaug.augmenter.word as naw

    return naw


# Light settings: a question must stay readable. The config's *_p is the chance an augmenter touches a copy.
_CHAR = {"aug_char_p": 0.1, "aug_char_max": 2, "aug_word_p": 0.1, "aug_word_max": 2}
_WORD = {"aug_p": 0.1, "aug_max": 2}
TEXT_AUGMENTERS: dict[str, Callable[[], Any]] = {
    "keyboard": lambda: _nac().KeyboardAug(**_CHAR),
    "ocr": lambda: _nac().OcrAug(**_CHAR),
    "random_char": lambda: _nac().RandomCharAug(action="substitute", **_CHAR),
    "word_swap": lambda: _naw().RandomWordAug(action="swap", **_WORD),
    "word_delete": lambda: _naw().RandomWordAug(action="delete", **_WORD),
    "word_crop": lambda: _naw().RandomWordAug(action="crop", **_WORD),
    "synonym": lambda: _synonym_aug(**_WORD),
}


def build_text_augmenters(cfg: TextAugmentConfig) -> list[tuple[str, float, Any]]:
    """(name, probability, nlpaug augmenter) for every augmenter with probability > 0, in a fixed order.

    Synonym replacement without WordNet data is skipped with a warning saying how to get it (never a download).
    """
    out = []
    for name, make in TEXT_AUGMENTERS.items():
        p = getattr(cfg, f"{name}_p")
        if p <= 0:
            continue
        aug = make()
        if aug is None:
            log.warning("augment: augment.text.%s_p = %s ignored: %s", name, p, WORDNET_HELP)
            continue
        out.append((name, p, aug))
    return out


def augment_text(text: str, augmenters: list[tuple[str, float, Any]], seed: int) -> str:
    """Apply each augmenter with its probability; nlpaug draws from the global random/numpy generators, so they are
    seeded for this call and restored afterwards (other code in the process keeps its own random stream)."""
    if not augmenters or not text.strip():
        return text
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        coin = random.Random(seed ^ 0x5EED)
        for _name, p, aug in augmenters:
            if coin.random() < p:
                res = aug.augment(text)
                text = (res[0] if res else text) if isinstance(res, list) else res
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return text


# ----------------------------------------------------------------------------------------------- dataset
def copy_seed(seed: int, sample_id: str, copy: int) -> int:
    return int(digest_json([seed, sample_id, copy])[:8], 16)


def augmented_id(sample_id: str, copy: int) -> str:
    return f"{sample_id}~aug{copy}"


def is_labeled(answer: Any, split: str) -> bool:
    # Test rows are evaluation data: augmenting them would leak into training if anything concatenated them.
    return answer is not None and str(answer).strip() != "" and split != "test"


def _augment_batch(batch: dict[str, list[Any]], *, cfg: dict[str, Any], seed: int) -> dict[str, list[Any]]:
    acfg = AugmentConfig(**cfg)
    pipe = build_image_pipeline(acfg.image, seed)
    texts = build_text_augmenters(acfg.text)
    out: dict[str, list[Any]] = {k: [] for k in [*batch, "augmented_from"]}
    for i, sid in enumerate(batch["sample_id"]):
        rgb = decode_prepared(batch["prepared"][i])
        for k in range(acfg.copies):
            s = copy_seed(seed, sid, k)
            pipe.set_random_seed(s)
            for col in batch:
                out[col].append(batch[col][i])
            out["sample_id"][-1] = augmented_id(sid, k)
            out["prepared"][-1] = encode_png(pipe(image=rgb)["image"])
            if batch.get("more_prepared") and batch["more_prepared"][i]:
                out["more_prepared"][-1] = _augment_more(pipe, batch["more_prepared"][i], s)
            out["question"][-1] = augment_text(batch["question"][i], texts, s)
            out["augmented_from"].append(sid)
    return out


def _augment_more(pipe: A.Compose, pngs: list[bytes], seed: int) -> list[bytes]:
    """A sample's later pictures augmented as its first was: the pipeline re-seeded with the copy's seed before each,
    so every picture draws the same transform (a flip flips them all, a before / after pair stays comparable)."""
    out = []
    for png in pngs:
        pipe.set_random_seed(seed)
        out.append(encode_png(pipe(image=decode_prepared(png))["image"]))
    return out


def augment_labeled(
    ds: datasets.Dataset, cfg: AugmentConfig, seed: int, out_dir: str | os.PathLike[str], *,
    inputs: Mapping[str, str] | None = None,
) -> Manifest:
    """`cfg.copies` augmented rows per labeled row of a prepared dataset → `out_dir` (dataset/, manifest.json).

    Output rows keep every column of their source row (answer unchanged) with a new `sample_id`
    (`<id>~aug<k>`), augmented `prepared` / `question`, and `augmented_from` = the source sample_id.
    Unlabeled (pool) and test rows are never augmented; the input dataset is not modified.
    """
    from datasets import Dataset, Features, Value

    missing = {"sample_id", "prepared", "question", "answer", "split"} - set(ds.column_names)
    if missing:
        raise DataError(f"dataset lacks column(s) {sorted(missing)}; pass the prepared labeled set (run preprocess)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = ds.select_columns(["answer", "split"])
    labeled = [i for i, r in enumerate(labels) if is_labeled(r["answer"], r["split"])]
    features = Features({**ds.features, "augmented_from": Value("string")})
    skipped: list[str] = []
    if cfg.text.synonym_p > 0 and not wordnet_available():
        log.warning("augment: augment.text.synonym_p = %s ignored: %s", cfg.text.synonym_p, WORDNET_HELP)
        skipped.append("synonym")
    run_cfg = cfg.model_dump(mode="json")
    if skipped:
        run_cfg["text"]["synonym_p"] = 0.0
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".work-") as work:
        if cfg.copies and labeled:
            src = ds.select(labeled)
            result = src.map(
                _augment_batch,
                fn_kwargs={"cfg": run_cfg, "seed": seed},
                batched=True,
                batch_size=32,
                num_proc=cfg.num_proc if cfg.num_proc > 1 and len(src) > 1 else None,
                remove_columns=src.column_names,
                features=features,
                cache_file_name=str(Path(work) / "augmented.arrow"),
                desc="augment",
            )
        else:
            result = Dataset.from_dict({k: [] for k in features}, features=features)
        with atomic_dir(out_dir / "dataset") as tmp:
            result.save_to_disk(str(tmp), num_shards=1)  # an empty dataset would otherwise get 0 shards, unloadable
        n_out = len(result)
        del result
    log.info("augment: %d labeled rows × %d copies → %d rows (pool and test rows untouched)", len(labeled),
             cfg.copies, n_out)
    return write_manifest(
        out_dir, stage=STAGE, stage_version=AUGMENT_VERSION, inputs=inputs or {},
        config={**cfg.model_dump(mode="json"), "seed": seed}, outputs={"dataset": "dataset"},
        info={"labeled_rows": len(labeled), "rows": n_out, "skipped_text_augmenters": skipped},
    )


def load_augmented(folder: str | os.PathLike[str]) -> datasets.Dataset:
    return load_stage_dataset(folder, STAGE)


TRAIN_COLUMNS = ["sample_id", "prepared", "question", "answer"]
MORE_TRAIN_COLUMNS = ["more_prepared", "context"]  # a sample's later pictures and earlier turns, where a project has them


def _train_columns(ds: datasets.Dataset, extra: Sequence[str] = ()) -> datasets.Dataset:
    more = [c for c in MORE_TRAIN_COLUMNS if c in ds.column_names]
    return ds.select_columns([*TRAIN_COLUMNS, *more, *extra])


def training_rows(labeled: Mapping[str, Any], augmented: StageRef | None, *,
                  geometry: bool = False) -> list[dict[str, Any]]:
    """The train stage's rows (pipeline.model.train_stage): the labeled set (its ref, rounds.labeled_set) and, when
    the round augments, the augment stage's copies (its ref), in the columns training reads; with `geometry` (a box
    project) also the columns (pipeline.boxes.box.GEOMETRY_COLUMNS) its labels are placed by."""
    import datasets

    extra = GEOMETRY_COLUMNS if geometry else ()  # a box label is placed by them
    rows = list(_train_columns(datasets.load_from_disk(labeled["dataset"]), extra))
    if augmented is not None:
        rows += list(_train_columns(load_augmented(augmented.dir), extra))
    return rows


@dataclass(frozen=True)
class AugmentParams:
    """The augment stage's parameters, built by augment_params; its cache key is their `asdict()`. `wordnet` (is
    WordNet installed?) is in the key: installing it later re-runs a synonym-enabled config."""

    artifacts: str
    dataset: str  # the labeled prepared set's folder
    dataset_digest: str
    augment: dict[str, Any]  # the augment section as JSON data
    seed: int
    wordnet: bool


def augment_stage(params: AugmentParams) -> dict[str, Any]:
    """The augment stage: copies of the labeled dataset in artifacts/augment/<key>/ (or the verified folder
    already there). An output made without WordNet is redone once `params.wordnet` says it is installed."""
    import datasets

    inputs = {"dataset": params.dataset_digest}
    key = stage_key(STAGE, AUGMENT_VERSION, inputs, {**params.augment, "seed": params.seed})
    out = Path(params.artifacts) / "augment" / key[:16]
    m = find_valid_manifest(out, key)
    if m is not None and params.wordnet and "synonym" in m.info.get("skipped_text_augmenters", []):
        m = None
    m = m or augment_labeled(datasets.load_from_disk(params.dataset), AugmentConfig(**params.augment), params.seed,
                             out, inputs=inputs)
    return stage_ref(out, m, "dataset")


def wants_wordnet(cfg: AugmentConfig) -> bool:
    """Whether this augmentation would use WordNet synonyms and WordNet is installed (part of the stage's key)."""
    return cfg.copies > 0 and cfg.text.synonym_p > 0 and wordnet_available()


def augment_params(artifacts: str | os.PathLike[str], labeled_ref: dict[str, Any], augment: AugmentConfig,
                   seed: int) -> AugmentParams:
    """The augment stage's parameters (its cache key) for a labeled set's ref (a stage folder or a saved dataset)."""
    dataset, digest = stage_dataset(labeled_ref)
    return AugmentParams(artifacts=str(artifacts), dataset=dataset, dataset_digest=digest,
                         augment=augment.model_dump(mode="json"), seed=seed, wordnet=wants_wordnet(augment))
