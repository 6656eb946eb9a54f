"""Score pool samples with the current model: class probabilities, token entropies, embeddings.

Closed answer sets: the image + question prefix runs once per sample and every candidate answer is scored from it.
When every candidate is a single token (digits, letters, yes/no) one next-token distribution gives all candidates;
otherwise the prefix's KV cache is repeated once per candidate and the candidate tokens of the whole batch run on top
of it in one padded forward.
Open answers: greedy generation (prompts left-padded, so batched answers equal one-at-a-time ones) with the log-prob
and the entropy of every generated token up to the first stop token (NaN after it).
MC dropout: k extra passes with only the LoRA dropout layers switched to training mode.
Embeddings come from the same prefix forward (mean of the last hidden state over the prefix tokens).

The scorers take a loaded model; the pool's shard stage that loads it lives one floor up, in pipeline/score_stage.py.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pipeline.schema import Question, sample_chat
from pipeline.store import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    read_manifest,
    write_manifest,
)

log = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    """Per-shard scores; every array's first axis is the shard's samples, in `sample_ids` order."""

    sample_ids: list[str]
    embeddings: np.ndarray  # [n, d] float32
    probs: np.ndarray | None = None  # [n, c] candidate probabilities (closed sets)
    mc_probs: np.ndarray | None = None  # [n, c, k] MC-dropout candidate probabilities
    token_logprobs: np.ndarray | None = None  # [n, t] generated-token log-probs, NaN-padded (open answers)
    token_entropy: np.ndarray | None = None  # [n, t] per-token entropies, NaN-padded (open answers)
    answers: list[str] | None = None  # greedy answer per sample (open answers)
    mc_answers: list[list[str]] | None = None  # [n][k] answers under MC dropout (open answers)
    extra: dict[str, Any] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"embeddings": self.embeddings}
        for name in ("probs", "mc_probs", "token_logprobs", "token_entropy"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def predictions(scores: ScoreResult, answers: list[str] | None) -> tuple[list[str | None], list[float | None]]:
    """The model's current answer and its confidence per sample: the most likely candidate and its probability for
    closed sets, the greedy answer and exp(mean token log-prob) for open ones (the annotators' pre-annotations,
    the evaluation's answers, the stop set's predictions)."""
    if scores.probs is not None and answers:
        best = scores.probs.argmax(1)
        return [answers[i] for i in best], [float(p) for p in scores.probs.max(1)]
    if scores.answers is not None:
        mean_lp = np.nanmean(np.where(np.isfinite(scores.token_logprobs), scores.token_logprobs, np.nan), axis=1)
        return list(scores.answers), [float(np.exp(x)) if np.isfinite(x) else None for x in mean_lp]
    return [None] * len(scores.sample_ids), [None] * len(scores.sample_ids)


def decode_rgb(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def row_inputs(rows: Sequence[Mapping[str, Any]]) -> tuple[list[Image.Image | list[Image.Image]],
                                                            list[str | Question]]:
    """Each prepared row's pictures (one image, or the list of a sample of several) and what it asks, as the family's
    encode takes them (pipeline.schema.sample_chat: a one-image row gives what it always gave)."""
    images: list[Image.Image | list[Image.Image]] = []
    questions: list[str | Question] = []
    for r in rows:
        pngs, q = sample_chat(r)
        images.append(decode_rgb(pngs[0]) if len(pngs) == 1 else [decode_rgb(p) for p in pngs])
        questions.append(q)
    return images, questions


@contextmanager
def lora_dropout_active(model: torch.nn.Module):
    """Switch on dropout inside LoRA layers only (MC dropout); everything else stays in eval mode."""
    switched = [m for name, m in model.named_modules() if "lora_dropout" in name and isinstance(m, torch.nn.Dropout)]
    if not switched:
        log.warning("MC dropout requested but the model has no LoRA dropout layers (lora_dropout = 0?)")
    for m in switched:
        m.train()
    try:
        yield len(switched)
    finally:
        for m in switched:
            m.eval()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(p for p in model.parameters()).device


def _last_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token per row, for either padding side."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask * positions).argmax(dim=1)


def _kv_cache(out: Any) -> tuple[str, Any]:
    """(the keyword a model's forward takes its KV cache by, the cache in `out`, that model's output).

    transformers 5 renamed `past_key_values` to `cache` (the old names still work but warn on every call); 4.57 only
    knows `past_key_values`. A model whose output declares a `cache` field takes `cache` as well.
    """
    if "cache" in getattr(out, "__dataclass_fields__", {}):
        return "cache", out.cache
    return "past_key_values", out.past_key_values


# Continuation forwards of multi-token candidates hold the prompt's KV cache once per (sample, candidate) row: a
# batch whose rows × tokens would exceed this is scored in smaller groups of samples. For a 2B Qwen2-VL (28 layers,
# 2 KV heads of 128, bf16: 28 KiB per token) 2**17 tokens are ~3.7 GB of cache; the tiny model never comes near it.
MAX_CONTINUATION_TOKENS = 1 << 17


class ClosedSetScorer:
    """Candidate probabilities for a closed answer set, computed from one prefix pass per sample batch.

    Multi-token candidates: the prefix's KV cache is repeated once per candidate (rows `i * c + j`: sample i,
    candidate j) and every candidate's tokens but its last run in one padded forward on top of it, so a batch costs
    two forwards whatever the number of candidates. The first answer token is read from the prefix's last position;
    the others from the continuation. Right-padding the shorter candidates needs no mask: attention is causal, so a
    real token never sees the padding after it, and padded positions are dropped from the sums.
    """

    def __init__(self, loaded: Any, answers: Sequence[str], *, length_normalize: bool = True):
        self.model, self.processor, self.family = loaded.model, loaded.processor, loaded.family
        self.answers = list(answers)
        self.length_normalize = length_normalize
        self._cand: list[list[int]] | None = None
        # M-RoPE models (Qwen2-VL, Qwen2.5-VL) keep the offset between a row's text positions and its token count
        # in `rope_deltas`, set by every forward that starts from an empty cache: what transformers' own generation
        # reads to place the tokens that follow a cached prompt.
        self._mrope = next((m for m in self.model.modules() if hasattr(m, "rope_deltas")), None)

    def _candidates(self, question: str) -> list[list[int]]:
        if self._cand is None:
            self._cand = [self.family.answer_token_ids(self.processor, question, a) for a in self.answers]
            if len({tuple(c) for c in self._cand}) != len(self._cand):
                raise ValueError("two answers in data.answers tokenize identically; they cannot be told apart")
        return self._cand

    @property
    def single_token(self) -> bool:
        return self._cand is not None and all(len(c) == 1 for c in self._cand)

    @torch.no_grad()
    def logprobs(self, images: list[Any], questions: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(candidate log-likelihoods [n, c], pooled prefix embeddings [n, d]) for one batch."""
        cand = self._candidates(questions[0])
        enc = self.family.encode(self.processor, images, questions).to(_device_of(self.model))
        width = max(len(t) for t in cand)
        rows_tokens = len(images) * len(cand) * (enc["attention_mask"].shape[1] + width)
        if not self.single_token and len(images) > 1 and rows_tokens > MAX_CONTINUATION_TOKENS:
            half = len(images) // 2
            (ll_a, emb_a), (ll_b, emb_b) = (self.logprobs(images[s], questions[s])
                                            for s in (slice(0, half), slice(half, None)))
            return np.concatenate([ll_a, ll_b]), np.concatenate([emb_a, emb_b])
        out = self.model(**enc, output_hidden_states=True, use_cache=not self.single_token)
        hidden = out.hidden_states[-1]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu().numpy()
        last = _last_index(enc["attention_mask"])
        rows = torch.arange(len(images), device=last.device)
        first = torch.log_softmax(out.logits[rows, last].float(), dim=-1)  # [n, vocab]
        if self.single_token:
            ll = first[:, [c[0] for c in cand]]
        else:
            ll = self._multi_token(out, enc["attention_mask"], first, cand)
        return ll.cpu().numpy(), emb

    def _next_positions(self, prefix_mask: torch.Tensor) -> torch.Tensor:
        """[n] the position id of the token that follows each row's prompt (prompts are left-padded).

        1-D RoPE models number every column, padding included (padding is masked and RoPE sees only differences), so
        the next token sits at the prefix length. M-RoPE models number a row's real tokens from 0 with the image's
        3-D positions in between: the next text token sits at its token count plus the row's `rope_deltas`.
        """
        n, length = prefix_mask.shape
        deltas = None if self._mrope is None else self._mrope.rope_deltas
        if deltas is None:
            return torch.full((n,), length, dtype=torch.long, device=prefix_mask.device)
        if deltas.shape[0] != n:
            raise RuntimeError(f"{type(self._mrope).__name__}.rope_deltas holds {deltas.shape[0]} rows after a prompt "
                               f"pass of {n}: this transformers version places cached continuations differently; "
                               "use the transformers version tamis is tested with (5.24)")
        return prefix_mask.long().sum(1) + deltas.reshape(n).to(prefix_mask.device)

    def _multi_token(self, out: Any, prefix_mask: torch.Tensor, first: torch.Tensor,
                     cand: list[list[int]]) -> torch.Tensor:
        """[n, c] log-likelihoods of multi-token candidates from one forward over the repeated prefix cache."""
        n, c, dev = first.shape[0], len(cand), first.device
        lengths = torch.tensor([len(t) for t in cand], device=dev)
        width = int(lengths.max())
        toks = torch.zeros(c, width, dtype=torch.long, device=dev)
        for j, t in enumerate(cand):
            toks[j, : len(t)] = torch.tensor(t, device=dev)
        valid = torch.arange(width, device=dev)[None, :] < lengths[:, None]  # [c, width]
        cache_kw, cache = _kv_cache(out)
        cache.batch_repeat_interleave(c)  # row i * c + j: sample i, candidate j
        steps = width - 1  # the last token's next-token distribution is never read
        inputs = toks[:, :steps].repeat(n, 1)  # [n * c, steps], candidate j at row i * c + j
        attn = torch.cat([prefix_mask.repeat_interleave(c, dim=0),
                          torch.ones(n * c, steps, dtype=prefix_mask.dtype, device=dev)], dim=1)
        positions = self._next_positions(prefix_mask).repeat_interleave(c)[:, None] + torch.arange(steps, device=dev)
        cont = self.model(input_ids=inputs, attention_mask=attn, position_ids=positions, **{cache_kw: cache},
                          use_cache=True)
        logits = cont.logits.float()  # [n * c, steps, vocab]: token t + 1 given the prompt and tokens ≤ t
        target = toks[:, 1:].repeat(n, 1).unsqueeze(-1)
        later = (logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)).view(n, c, steps)
        tok_ll = torch.cat([first[:, toks[:, 0]].unsqueeze(-1), later], dim=2) * valid  # [n, c, width]
        total = tok_ll.sum(2)
        return total / lengths if self.length_normalize else total

    def score(self, rows: Sequence[dict], *, batch_size: int, mc_passes: int = 0, seed: int = 0) -> ScoreResult:
        images, questions = row_inputs(rows)
        self._candidates(questions[0])
        lls, embs, mc = [], [], []
        for i in range(0, len(rows), batch_size):
            ims, qs = images[i : i + batch_size], questions[i : i + batch_size]
            ll, emb = self.logprobs(ims, qs)
            lls.append(ll)
            embs.append(emb)
            if mc_passes:
                torch.manual_seed(seed + i)
                with lora_dropout_active(self.model):
                    mc.append(np.stack([self.logprobs(ims, qs)[0] for _ in range(mc_passes)], axis=-1))
        ll = np.concatenate(lls)
        result = ScoreResult(
            sample_ids=[r["sample_id"] for r in rows],
            embeddings=np.concatenate(embs).astype(np.float32),
            probs=_softmax(ll, axis=1),
        )
        if mc:
            result.mc_probs = _softmax(np.concatenate(mc), axis=1)
        return result


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def agreement_key(text: str) -> str:
    """How sampled answers are compared for agreement: case, outer spaces and end punctuation ignored (lighter than
    pipeline.meaning.normalize_answer, which also drops articles and inner punctuation for the SQuAD metrics)."""
    return " ".join(text.lower().strip().strip(".!?").split())


REPLACEMENT = "\ufffd"  # what a tokenizer's decode writes for bytes that are not (yet) a whole UTF-8 character


def decode_whole(tok: Any, ids: Any) -> str:
    """Generated tokens as text of whole characters only. A byte-level BPE splits a multi-byte character (é, ß, an
    emoji, CJK) over several tokens, so generation stopped by max_new_tokens can end inside one; decoding those bytes
    gives U+FFFD ("Sma\ufffd\ufffd\ufffd" in a pre-annotation: one per byte with byte-fallback tokenizers). The
    incomplete character at the cut is dropped: the trailing U+FFFD. One inside the text is left: there the model
    itself wrote bytes that are no character, and hiding them would hide that."""
    return tok.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT)


class OpenAnswerScorer:
    """Greedy answers with per-token log-probs and entropies; MC dropout gives answer agreement."""

    def __init__(self, loaded: Any, *, max_new_tokens: int = 16, min_new_tokens: int = 0):
        self.model, self.processor, self.family = loaded.model, loaded.processor, loaded.family
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens

    @torch.no_grad()
    def _generate(self, images: list[Any], questions: list[Any]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """(answers, token log-probs [n, t], token entropies [n, t], prefix embeddings [n, d]) of one batch.

        The family's encode left-pads generation prompts whatever the tokenizer's own padding side, so every row's
        prompt ends at the same position and batched greedy answers equal one-at-a-time ones.
        """
        tok = self.processor.tokenizer
        stop = self.family.stop_token_ids(self.processor)
        enc = self.family.encode(self.processor, images, questions).to(_device_of(self.model))
        out = self.model.generate(
            **enc,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0],
            output_logits=True,  # raw logits: scores are post-processed (min_new_tokens puts -inf in them)
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, enc["input_ids"].shape[1] :]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.logits], dim=1)  # [n, t, vocab]
        chosen = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        entropy = -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)
        # The answer is every token before the first stop token; what follows is batch padding.
        is_stop = torch.isin(new, torch.tensor(stop, device=new.device))
        keep = (torch.cumsum(is_stop, dim=1) - is_stop.long()) == 0
        keep &= ~is_stop
        # A stop token as the very first token (min_new_tokens 0) leaves no tokens: keep that one so every row has a
        # score (the entropy of deciding to say nothing).
        keep[:, 0] |= ~keep.any(dim=1)
        chosen = torch.where(keep, chosen, torch.nan)
        entropy = torch.where(keep, entropy, torch.nan)
        hidden = out.hidden_states[0][-1]  # prefix pass, last layer
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu().numpy()
        texts = [decode_whole(tok, row[k]) for row, k in zip(new, keep & ~is_stop, strict=True)]
        return [t.strip() for t in texts], chosen.cpu().numpy(), entropy.cpu().numpy(), emb

    def score(self, rows: Sequence[dict], *, batch_size: int, mc_passes: int = 0, seed: int = 0) -> ScoreResult:
        answers, lps, ents, embs, mc = [], [], [], [], []
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            ims, qs = row_inputs(chunk)
            a, lp, ent, emb = self._generate(ims, qs)
            answers += a
            lps.append(lp)
            ents.append(ent)
            embs.append(emb)
            if mc_passes:
                torch.manual_seed(seed + i)
                with lora_dropout_active(self.model):
                    runs = [self._generate(ims, qs)[0] for _ in range(mc_passes)]
                mc += [list(x) for x in zip(*runs, strict=True)]
        width = max(x.shape[1] for x in lps)
        pad = lambda xs: np.concatenate(  # noqa: E731
            [np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=np.nan) for x in xs]
        ).astype(np.float32)
        result = ScoreResult(
            sample_ids=[r["sample_id"] for r in rows],
            embeddings=np.concatenate(embs).astype(np.float32),
            token_logprobs=pad(lps),
            token_entropy=pad(ents),
            answers=answers,
        )
        if mc:
            result.mc_answers = mc
        return result


def agreement_codes(mc_answers: list[list[str]]) -> np.ndarray:
    """[n, k] integer codes of normalised answers, so answer agreement is a pure array function."""
    codes = np.zeros((len(mc_answers), len(mc_answers[0]) if mc_answers else 0), dtype=np.int64)
    for i, runs in enumerate(mc_answers):
        vocab: dict[str, int] = {}
        codes[i] = [vocab.setdefault(agreement_key(a), len(vocab)) for a in runs]
    return codes


def make_scorer(loaded: Any, answers: Sequence[str] | None, *, length_normalize: bool = True, max_new_tokens: int = 16):
    if answers:
        return ClosedSetScorer(loaded, answers, length_normalize=length_normalize)
    return OpenAnswerScorer(loaded, max_new_tokens=max_new_tokens, min_new_tokens=1)


# ------------------------------------------------------------------------------------------- shards on disk
SCORES_FILE = "scores.npz"
IDS_FILE = "scores.json"


def save_scores(result: ScoreResult, out_dir: str | Path, *, version: str, inputs: dict[str, str],
                config: dict) -> Manifest:
    """Write one shard's scores atomically (npz of plain arrays, never pickled) and its manifest last, keyed by the
    `version` of the stage that scored them (the score stage's SCORE_VERSION, the label check's LABELCHECK_VERSION
    for its fold scores: each closure holds these scorers)."""
    out_dir = Path(out_dir)
    buf = io.BytesIO()
    np.savez(buf, **result.arrays())
    atomic_write_bytes(out_dir / SCORES_FILE, buf.getvalue())
    atomic_write_json(
        out_dir / IDS_FILE,
        {"sample_ids": result.sample_ids, "answers": result.answers, "mc_answers": result.mc_answers,
         "extra": result.extra},
    )
    return write_manifest(
        out_dir, stage="score", stage_version=version, inputs=inputs, config=config,
        outputs={"scores": SCORES_FILE, "ids": IDS_FILE}, info={"n": len(result.sample_ids)},
    )


def load_scores(out_dir: str | Path) -> ScoreResult:
    out_dir = Path(out_dir)
    read_manifest(out_dir)  # verifies digests: a torn or tampered shard is reported, not used
    meta = json.loads((out_dir / IDS_FILE).read_text(encoding="utf-8"))
    with np.load(out_dir / SCORES_FILE, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return ScoreResult(sample_ids=meta["sample_ids"], answers=meta.get("answers"), mc_answers=meta.get("mc_answers"),
                       extra=meta.get("extra") or {}, **arrays)


def concat_scores(parts: Sequence[ScoreResult]) -> ScoreResult:
    def cat(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        if any(v is None for v in values):
            return None
        if values[0].ndim == 2 and name.startswith("token_"):
            width = max(v.shape[1] for v in values)
            values = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=np.nan) for v in values]
        return np.concatenate(values)

    answers = None if any(p.answers is None for p in parts) else [a for p in parts for a in p.answers]
    mc_answers = None if any(p.mc_answers is None for p in parts) else [a for p in parts for a in p.mc_answers]
    return ScoreResult(
        sample_ids=[s for p in parts for s in p.sample_ids], embeddings=cat("embeddings"), probs=cat("probs"),
        mc_probs=cat("mc_probs"), token_logprobs=cat("token_logprobs"), token_entropy=cat("token_entropy"),
        answers=answers, mc_answers=mc_answers,
    )


def pool_shard_size(pool_size: int, shard_size: int, max_tasks: int) -> int:
    """The shard size for a pool of `pool_size`: `shard_size` while the pool fits in `max_tasks` shards of it (so
    every shard and its cache key stay as they were), else the next power of two ≥ pool / max_tasks.

    A power of two, not the exact quotient, so the size steps only when the pool doubles (a growing pool does not
    re-shard on every round) and any pool stays within max_tasks: 10⁷ with max_tasks 2000 is 1,221 shards of 8,192."""
    if pool_size <= shard_size * max_tasks:
        return shard_size
    need = -(-pool_size // max_tasks)  # ceil
    return 1 << (need - 1).bit_length()


def plan_shards(sample_ids: Sequence[str], shard_size: int) -> list[list[str]]:
    """Fixed-size shards in sorted-ID order, so the same pool always gives the same shards (and cache keys)."""
    ids = sorted(sample_ids)
    return [ids[i : i + shard_size] for i in range(0, len(ids), shard_size)]
