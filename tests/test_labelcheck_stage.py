"""The label-check stages' parameters are their Prefect cache keys: planned by the library, they must equal what the
flow built before the plan moved into pipeline/labelcheck/stage.py, or every cached check and relabel queue reruns.

EXPECTED was computed once from the code at commit `main` before the move (84cbd58, when flows/labelcheck.py built
the parameters itself): the scenarios below were run through the old `label_check_ref` / `relabel_ref` with
`run_stage` replaced by a function returning its keyword arguments and `flows.select.embeddings_ref` by one
returning SPACE_REF, then `flows.stages.stage_cache_key(stage, LABELCHECK_VERSION, params)` was recorded with the
folders. The artifacts folder is the relative path "art" (the test runs in tmp_path), so the digests are fixed.

Those literals held through the move. Issues 25 and 26 then added fields on purpose to the sections every label
check is keyed on (model.end_token, model.train, model.liger, train.optimizer, train.activation_offload), so each
key moved once: the literals were recomputed from the plan at that merge (5197e7d). Move them again only with a
change that means to recompute label checks, and say so in its message.

Issue 24 made the version code-aware (`"1+<digest of the labelcheck package's code closure>"`, which moves with every
code edit), so the literals now pin the parameters' digest, the part of the key that held them at 5197e7d (the
key's tail then, the same hex); the key is checked to be stage, version and that digest, and the version to be the
hand-kept marker "1" plus the closure digest, recomputed independently from the files in tests/test_code_keys.py.
"""

import dataclasses
from pathlib import Path

import pytest

import flows.labelcheck
from flows.stages import stage_cache_key
from pipeline.codeversion import code_digest
from pipeline.config import ProjectConfig
from pipeline.labelcheck import LABELCHECK_VERSION, CheckSpec, plan_label_check, plan_relabel
from pipeline.round_state import RoundState
from pipeline.stage_ref import key_fields
from pipeline.store import digest_json

DIGITS = [str(d) for d in range(10)]
LABELED = {"dir": "art/rounds/002/labeled", "dataset": "art/rounds/002/labeled/dataset", "digest": "d" * 64}
PREVIOUS = RoundState(round=0, adapter={"adapter_dir": "art/rounds/000/adapter", "adapter_digest": "a" * 64})
PREPARED = {"dir": "art/prepared/x", "digest": "p" * 64}
SPACE_REF = {"dir": "art/embeddings/e", "digest": "e" * 64, "extra": 1}
CHECK = {"dir": "art/labelcheck/abc", "digest": "c" * 64, "checked": 5, "issues": 2}
# name -> (config overrides, previous round's state, prepared ref)
CASES = {
    "kfold-model": ({}, None, PREPARED),
    "kfold-pixels-space": ({"select": {"embeddings": "pixels"}}, PREVIOUS, PREPARED),
    "kfold-pixels-no-prepared": ({"select": {"embeddings": "pixels"}}, None, None),
    "kfold-pixels-knn0": ({"select": {"embeddings": "pixels"}, "labelcheck": {"knn_k": 0}}, None, PREPARED),
    "heldout-pixels": ({"labelcheck": {"method": "heldout", "max_steps": 1}, "select": {"embeddings": "pixels"}},
                       PREVIOUS, PREPARED),
    "open-kfold-pixels": ({"data": {"answers": None}, "select": {"embeddings": "pixels"}}, None, PREPARED),
    "off": ({"labelcheck": {"method": "off"}}, PREVIOUS, PREPARED),
    "heldout-first": ({"labelcheck": {"method": "heldout"}}, None, PREPARED),
    "heldout-no-adapter": ({"labelcheck": {"method": "heldout"}}, RoundState(round=0, adapter=None), PREPARED),
}
RELABEL_CASES = {"relabel": {}, "relabel-open": {"data": {"answers": None}}}
TRAINED_IDS = '{"sample_id": "s0"}\n{"sample_id": "s1"}\n{"sample_id": "s2"}\n'
EXPECTED = {
    "kfold-model": {
        "params": "0563eda5a8010832b34a3e1c0ead3397dd17c0498e638dcc1ccbdb793d27f32e",
        "oos_dir": "art/labelcheck/oos/6e3413c202fe313f",
        "out_dir": "art/labelcheck/3dee06ad82fc1aeb",
        "trained_ids_path": None
    },
    "kfold-pixels-space": {
        "params": "9b5042aec38da655d30b3668ceceb1792e9ab5b2954ca0f3d6630fee2af20d41",
        "oos_dir": "art/labelcheck/oos/6e3413c202fe313f",
        "out_dir": "art/labelcheck/94e151d084866f03",
        "trained_ids_path": None
    },
    "kfold-pixels-no-prepared": {
        "params": "097791cd5b61746abe0754115d9b4a4d103a5e79751a5e7643391c085b6d4312",
        "oos_dir": "art/labelcheck/oos/6e3413c202fe313f",
        "out_dir": "art/labelcheck/96c7706b4597663f",
        "trained_ids_path": None
    },
    "kfold-pixels-knn0": {
        "params": "6de6e899d911364cc3789892f5b682b5c3608fd428d46ba69d5259400faae9f0",
        "oos_dir": "art/labelcheck/oos/6e3413c202fe313f",
        "out_dir": "art/labelcheck/c7ba863cb05ea956",
        "trained_ids_path": None
    },
    "heldout-pixels": {
        "params": "2cdff5467da460922a682f6a3869dc34da174f47f9e415e32b23faadbd6b881c",
        "oos_dir": "art/labelcheck/oos/43a3a3d7057a1109",
        "out_dir": "art/labelcheck/064d4464885d7187",
        "trained_ids_path": "art/rounds/002/labelcheck_trained_ids.jsonl"
    },
    "open-kfold-pixels": {
        "params": "845132fe959c378f22a9cd803f006ed94f7820fd2b368978a690ef7c322abadb",
        "oos_dir": "art/labelcheck/oos/ea48a950fc33a2a2",
        "out_dir": "art/labelcheck/a041e657ab98f241",
        "trained_ids_path": None
    },
    "off": None,
    "heldout-first": None,
    "heldout-no-adapter": None,
    # The relabel key holds the annotate section: annotate.export_images' default became legible (issue 47, the
    # images people label from), the one change in these two keys since they were recorded.
    "relabel": {
        "params": "f50e808adc81c044ca059242ecbed322ea24d0a9211786244c9e5e28d83d470c",
        "out_dir": "art/rounds/003/relabel",
        "already_queued": [
            "s4",
            "s9"
        ]
    },
    "relabel-open": {
        "params": "8191f2a0690291cc913f96e81e827950bf23e9fdea0050a12978b7f0d0941372",
        "out_dir": "art/rounds/003/relabel",
        "already_queued": [
            "s4",
            "s9"
        ]
    }
}


def _cfg(**over) -> ProjectConfig:
    base = {"paths": {"artifacts": "art"}, "data": {"answers": DIGITS}, "seed": 3,
            "model": {"name_or_path": "models/tiny", "family": "idefics3"},
            "train": {"max_steps": 2, "batch_size": 4},
            "select": {"score_batch_size": 8, "mc_dropout_passes": 2, "batch_size": 7},
            "labelcheck": {"method": "kfold", "kfold": 2, "relabel_top_n": 3, "min_confidence": 0.8, "knn_k": 4},
            "annotate": {"formats": ["csv", "jsonl"]}}
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return ProjectConfig.model_validate(base)


@pytest.fixture
def art(tmp_path, monkeypatch):
    """A relative artifacts folder "art": a previous round's labeled set, a ledger, one finished relabel queue
    (round 1) and one whose write never finished (round 2: not counted as sent)."""
    import datasets

    from pipeline.annotation.ledger import ledger_path
    from pipeline.store import atomic_write_jsonl, write_manifest

    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict({"sample_id": ["s2", "s0", "s1"]}).save_to_disk("art/rounds/000/labeled/dataset")
    ledger_path("art").write_text('{"sample_id": "s0", "label": "1"}\n')
    q = Path("art/rounds/001/relabel")
    atomic_write_jsonl(q / "relabel.jsonl", [{"sample_id": "s9"}, {"sample_id": "s4"}])
    write_manifest(q, stage="relabel", stage_version="1", inputs={}, config={},
                   outputs={"relabel.jsonl": "relabel.jsonl"})
    atomic_write_jsonl(Path("art/rounds/002/relabel/relabel.jsonl"), [{"sample_id": "s7"}])
    return Path("art")


def _plan(cfg: ProjectConfig, previous, prepared, calls: list) -> dict | None:
    def space():
        calls.append(1)
        return SPACE_REF

    spec = CheckSpec.of(model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck,
                        answers=cfg.data.answers, seed=cfg.seed)
    return plan_label_check(spec, artifacts=cfg.artifacts, labeled=LABELED,
                            previous=previous, round_dir=Path("art/rounds/002"),
                            selection_space=None if prepared is None else space)


def _seen(stage: str, planned) -> dict | None:
    """What the stage is keyed on and writes where, from the planned parameters dataclass (or the task's keyword
    `params=` holding it, as the flow passes it)."""
    if planned is None:
        return None
    task_params = planned if isinstance(planned, dict) else {"params": planned}
    params = key_fields(task_params["params"])
    # The key is the stage, its version and these parameters' digest, and nothing else.
    assert stage_cache_key(stage, LABELCHECK_VERSION, task_params) == \
        f"{stage}-{LABELCHECK_VERSION}-{digest_json(params)}"
    if stage == "relabel":
        return {"params": digest_json(params), "out_dir": params["out_dir"], "already_queued": params["already_queued"]}
    return {"params": digest_json(params), "oos_dir": params["oos_dir"], "out_dir": params["out_dir"],
            "trained_ids_path": params["trained_ids_path"]}


def test_the_version_in_every_label_check_key_is_the_marker_and_the_package_code():
    # Both label-check stages (and the fold scores) version the whole package: a change to any part reruns them.
    assert LABELCHECK_VERSION == f"1+{code_digest('pipeline.labelcheck')}"


@pytest.mark.parametrize("name", list(CASES))
def test_label_check_plan_gives_the_old_cache_key_and_folders(art, name):
    over, previous, prepared = CASES[name]
    calls: list = []
    params = _plan(_cfg(**over), previous, prepared, calls)
    assert _seen("labelcheck", params) == EXPECTED[name]
    # The selection space is asked for only when the kNN signal reads it (no embeddings stage run for nothing).
    assert len(calls) == (name in ("kfold-pixels-space", "heldout-pixels"))
    if params and params.trained_ids_path:
        assert Path(params.trained_ids_path).read_text() == TRAINED_IDS


@pytest.mark.parametrize("name", list(RELABEL_CASES))
def test_relabel_plan_gives_the_old_cache_key_and_folder(art, name):
    cfg = _cfg(**RELABEL_CASES[name])
    params = plan_relabel(artifacts=cfg.artifacts, annotate=cfg.annotate, labelcheck=cfg.labelcheck,
                          answers=cfg.data.answers, check=CHECK, prepared=PREPARED, round_index=3)
    assert _seen("relabel", params) == EXPECTED[name]


def test_the_flow_passes_the_plan_to_its_tasks_unchanged(art, monkeypatch):
    """flows/labelcheck.py's refs hand the planned parameters to the stage tasks as they are (no server needed:
    run_stage is replaced by a recorder, the selection space by SPACE_REF)."""
    seen: list[tuple[str, dict]] = []
    monkeypatch.setattr(flows.labelcheck, "run_stage", lambda task, **p: seen.append((task.name, p)) or p)
    monkeypatch.setattr(flows.labelcheck, "embeddings_ref", lambda cfg, prepared: SPACE_REF)
    # The flow fills in the model's identity (issue 36: its weights and library versions are in the key): that part
    # is checked in tests/test_rounds.py; here it stays out, so the plan is compared with the recorded literals.
    identified = []
    monkeypatch.setattr(flows.labelcheck, "with_identity", lambda model, art: identified.append(model) or model)
    for name, (over, previous, prepared) in CASES.items():
        seen.clear()
        flows.labelcheck.label_check_ref(_cfg(**over), labeled=LABELED, previous=previous,
                                         round_dir=Path("art/rounds/002"), prepared=prepared)
        assert (_seen(*seen[0]) if seen else None) == EXPECTED[name], name
    assert len(identified) == len(CASES)
    for name, over in RELABEL_CASES.items():
        seen.clear()
        flows.labelcheck.relabel_ref(_cfg(**over), check=CHECK, prepared=PREPARED, round_index=3)
        assert _seen(*seen[0]) == EXPECTED[name], name


def test_the_tasks_take_exactly_the_planned_parameters(art):
    """Each task takes its stage's one parameters dataclass, as plan_* builds it: nothing restated between the plan,
    the task and the body (issue 39)."""
    import inspect

    from pipeline.labelcheck.stage import LabelCheckParams, RelabelParams

    cfg = _cfg(labelcheck={"method": "heldout"})
    assert isinstance(_plan(cfg, PREVIOUS, PREPARED, []), LabelCheckParams)
    rel = plan_relabel(artifacts=cfg.artifacts, annotate=cfg.annotate, labelcheck=cfg.labelcheck,
                       answers=cfg.data.answers, check=CHECK, prepared=PREPARED, round_index=3)
    assert isinstance(rel, RelabelParams)
    for task, kind in ((flows.labelcheck.labelcheck_task, "LabelCheckParams"),
                       (flows.labelcheck.relabel_task, "RelabelParams")):
        sig = inspect.signature(task.fn)
        assert list(sig.parameters) == ["params"] and kind in str(sig.parameters["params"].annotation)


@pytest.mark.parametrize(("over", "digest"), [
    ({}, "fa52cdf86ea06992d74fd78094639937646fdb336b527c50ede5ede81f4169de"),
    ({"labelcheck": {"max_steps": 1}}, "797520089500418ea2db241cf2d15fde60c14ca1992b180b7d00e54ab0296a6a"),
])
def test_fold_scores_keep_their_manifest_config(over, digest):
    """Inside the task, fold scores under oos_dir are reused when their manifest's config matches: it must not move
    either (digests computed from main's `_score_config(cfg, answers)`, for the same configs; recomputed with the
    keys above when issues 25 and 26 added model and train fields). Its version field is the code-aware version
    since issue 24 (it moves with the package's code); the digests hold with the marker "1" it had then."""
    from pipeline.labelcheck.out_of_sample import _score_config

    cfg = _cfg(**over)
    spec = CheckSpec.of(model=cfg.model, train=cfg.train, select=cfg.select, labelcheck=cfg.labelcheck,
                        answers=cfg.data.answers, seed=cfg.seed)
    config = _score_config(spec, list(cfg.data.answers))
    assert config["labelcheck_version"] == LABELCHECK_VERSION
    assert digest_json({**config, "labelcheck_version": "1"}) == digest


@pytest.mark.parametrize("name", ["kfold-pixels-space", "heldout-pixels", "open-kfold-pixels"])
def test_the_task_runs_the_spec_it_was_planned_with(art, name):
    """The labelcheck task rebuilds its CheckSpec from its keyed parameters alone (StageConfig's job before): every
    field the check reads equals the config's, the heldout adapter and the IDs it trained on come from the previous
    round, and the queue's settings (not in the key) are the only labelcheck fields that fall back to defaults."""
    from pipeline.labelcheck import CheckScoring
    from pipeline.labelcheck.stage import QUEUE_KEYS, check_spec

    over, previous, prepared = CASES[name]
    cfg = _cfg(**over)
    spec = check_spec(_plan(cfg, previous, prepared, []))
    assert (spec.model, spec.train, spec.seed) == (cfg.model, cfg.train, cfg.seed)
    assert spec.answers == (None if cfg.data.answers is None else tuple(cfg.data.answers))
    planned = CheckScoring.of(cfg.select)
    assert spec.scoring == (planned if spec.answers is None else
                            dataclasses.replace(planned, mc_dropout_passes=None))  # a closed check does not read it
    assert {k: v for k, v in spec.labelcheck.model_dump().items() if k not in QUEUE_KEYS} == \
        {k: v for k, v in cfg.labelcheck.model_dump().items() if k not in QUEUE_KEYS}
    if name.startswith("heldout"):
        assert spec.held_out.adapter == PREVIOUS.adapter["adapter_dir"]
        assert spec.held_out.trained_ids == {"s0", "s1", "s2"}
    else:
        assert spec.held_out is None


def test_a_relabel_queue_goes_to_label_studio_beside_the_batch(art, monkeypatch):
    """relabel_ref pushes a non-empty queue to annotate.label_studio as export_ref pushes the batch, and the round's
    state records what the push said; an empty queue pushes nothing (the state's record of its stages only records:
    it used to push from there)."""
    from pipeline.round.records import record_relabel

    pushed: list[tuple[str, str]] = []
    monkeypatch.setattr(flows.labelcheck, "push_batch",
                        lambda annotate, artifacts, folder: pushed.append((annotate.label_studio.project, folder))
                        or {"project": 7, "pushed": 2, "already": 0})
    cfg = _cfg(annotate={"label_studio": {"project": "errors"}})
    for count, expected in ((2, [("errors", "art/rounds/003/relabel")]), (0, [])):
        pushed.clear()
        monkeypatch.setattr(flows.labelcheck, "run_stage",
                            lambda task, params, n=count: {"count": n, "dir": "art/rounds/003/relabel"})
        state = RoundState(round=3)
        record_relabel(state, flows.labelcheck.relabel_ref(cfg, check=CHECK, prepared=PREPARED, round_index=3))
        assert pushed == expected
        assert state.relabel == count
        assert state.label_studio_relabel == ({"project": 7, "pushed": 2, "already": 0} if count else None)
        assert state.relabel_dir == ("art/rounds/003/relabel" if count else None)
