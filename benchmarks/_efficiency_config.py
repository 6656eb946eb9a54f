"""The label-efficiency benchmark's parameters: the strategies, the protocol, and the YAML that holds them beside an
ordinary project config (`project` + `benchmark`), validated with messages that name the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.config import ProjectConfig, ScheduleConfig, parse_config
from pipeline.errors import ConfigError
from pipeline.strategies import HEURISTICS, get_heuristic

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "label_efficiency.yaml"


class StrategySpec(BaseModel):
    """One strategy: its own cold start, then per round `strategy` × `diversity`, or a budget-aware schedule."""

    model_config = ConfigDict(extra="forbid")
    cold_start: Literal["random", "typical", "typiclust", "probcover", "maxherding"] = "random"
    strategy: str = "random"
    diversity: str = "top_k"
    options: dict[str, Any] = Field(default_factory=dict)
    schedule: ScheduleConfig | None = None

    @model_validator(mode="after")
    def _known(self) -> StrategySpec:
        from pipeline.strategies import HEURISTICS, SELECTORS

        if self.strategy not in HEURISTICS:
            raise ValueError(f"strategy {self.strategy!r} is not one of {sorted(HEURISTICS)}")
        if self.diversity not in SELECTORS:
            raise ValueError(f"diversity {self.diversity!r} is not one of {sorted(SELECTORS)}")
        return self

    @property
    def is_random_baseline(self) -> bool:
        return (self.strategy, self.diversity, self.cold_start, self.schedule) == ("random", "top_k", "random", None)


class LongTail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    imbalance: float = Field(default=20.0, ge=1)


class Bench(BaseModel):
    model_config = ConfigDict(extra="forbid")
    build_demo_digits: bool = False
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4], min_length=1)
    initial: int = Field(default=20, ge=1)
    batch: int = Field(default=20, ge=1)
    rounds: int = Field(default=9, ge=1)
    train_steps: int | None = Field(default=None, ge=1)
    test_size: int | None = Field(default=None, ge=1)
    pool_size: int | None = Field(default=None, ge=2)
    annotator_noise: float = Field(default=0.0, ge=0, le=1)
    strategies: dict[str, StrategySpec]
    longtail: LongTail | None = Field(default_factory=LongTail)
    reference_learner: bool = True
    bootstrap: int = Field(default=2000, ge=100)
    # The curve's metric: accuracy (closed answer sets) or one of the open-answer metrics of pipeline.evaluate.
    metric: Literal["accuracy", "exact_match", "token_f1", "edit_similarity"] | None = None
    quick: dict[str, Any] = Field(default_factory=dict)

    @field_validator("strategies")
    @classmethod
    def _has_random(cls, v: dict[str, StrategySpec]) -> dict[str, StrategySpec]:
        if not any(s.is_random_baseline for s in v.values()):
            raise ValueError("needs the baseline {cold_start: random, strategy: random, diversity: top_k}: ratios are "
                             "measured against it")
        return v

    @property
    def baseline(self) -> str:
        return next(n for n, s in self.strategies.items() if s.is_random_baseline)


def load_bench_config(path: str | os.PathLike[str], *, quick: bool = False,
                      strategies: list[str] | None = None) -> tuple[ProjectConfig, Bench]:
    """(project config, benchmark parameters) from the YAML; `quick` applies its `benchmark.quick` overrides;
    `strategies` keeps only those of benchmark.strategies (and the baseline, which every ratio needs)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: benchmark config not found; pass an existing YAML file with --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"project", "benchmark"}:
        extra = sorted(set(data) - {"project", "benchmark"}) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: the top level must hold only 'project' and 'benchmark', got {extra}")
    project = parse_config(data.get("project"), origin=f"{path} (project)", root=ROOT)
    raw = dict(data.get("benchmark") or {})
    if quick:
        over = dict(raw.get("quick") or {})
        keep = over.pop("strategies", None)
        if keep is not None:
            missing = sorted(set(keep) - set(raw.get("strategies") or {}))
            if missing:
                raise ConfigError(f"{path}: benchmark.quick.strategies names {missing}, which benchmark.strategies "
                                  "does not define")
            raw["strategies"] = {k: v for k, v in raw["strategies"].items() if k in keep}
        raw.update(over)
    if strategies:
        missing = sorted(set(strategies) - set(raw.get("strategies") or {}))
        if missing:
            raise ConfigError(f"--strategies {missing}: not in {path}'s benchmark.strategies "
                              f"{sorted(raw.get('strategies') or {})}")
        base = {"cold_start": "random", "strategy": "random", "diversity": "top_k"}
        raw["strategies"] = {k: v for k, v in raw["strategies"].items()
                             if k in strategies or all((v or {}).get(f) == x for f, x in base.items())}
    try:
        bench = Bench.model_validate(raw)
    except ValidationError as exc:
        lines = "\n".join(f"  benchmark.{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')} "
                          f"(got {e.get('input')!r})" for e in exc.errors())
        raise ConfigError(f"{path}: invalid benchmark parameters\n{lines}") from None
    if bench.train_steps is not None:
        project.train.max_steps = bench.train_steps
    if project.train.max_steps is None:
        raise ConfigError(f"{path}: project.train.max_steps is not set; the benchmark compares strategies at a fixed "
                          "step budget per round (e.g. 80)")
    if bench.metric is None:
        bench.metric = "accuracy" if project.data.answers else "token_f1"
    if not project.data.answers:
        if bench.metric == "accuracy":
            raise ConfigError(f"{path}: benchmark.metric accuracy needs a closed answer set (project.data.answers); "
                              "open answers are measured by exact_match, token_f1 or edit_similarity")
        if bench.longtail is not None or bench.reference_learner:
            raise ConfigError(f"{path}: open answers (project.data.answers: null) have no classes: set "
                              "benchmark.longtail: null and benchmark.reference_learner: false")
        bad = [n for n, sp in bench.strategies.items() if get_heuristic(sp.strategy).input in ("probs", "mc_probs")]
        if bad:
            ok = sorted(h for h, cls in HEURISTICS.items() if cls.input not in ("probs", "mc_probs"))
            raise ConfigError(f"{path}: strategies {bad} read class probabilities, which open answers do not have; "
                              f"use one of {ok}")
    elif bench.metric != "accuracy":
        raise ConfigError(f"{path}: benchmark.metric {bench.metric!r} is for open answers; a closed answer set "
                          "(project.data.answers) is measured by accuracy")
    if project.data.ground_truth is None:
        raise ConfigError(f"{path}: project.data.ground_truth is not set; the simulated annotator answers from it")
    if not project.data.sources:
        raise ConfigError(f"{path}: project.data.sources is empty; point it at the data set's manifest")
    return project, bench


def seeded(cfg: ProjectConfig, seed: int, artifacts: Path | None = None) -> ProjectConfig:
    out = cfg.model_copy(deep=True)
    out.seed = seed
    if artifacts is not None:
        out.paths.artifacts = artifacts
    return out
