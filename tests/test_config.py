from pathlib import Path

import pytest

from pipeline.config import DEFAULT_CONFIG, load_config, parse_config
from pipeline.errors import ConfigError


def test_embedded_default_loads_and_resolves_paths(tmp_path):
    cfg = load_config(None, root=tmp_path)
    assert cfg.paths.artifacts == (tmp_path / "artifacts").resolve()
    assert cfg.data.sources[0].path.is_absolute()
    assert cfg.data.answers == [str(d) for d in range(10)]
    assert DEFAULT_CONFIG.name == "demo.yaml"


def test_error_names_field_value_and_bound():
    with pytest.raises(ConfigError) as e:
        parse_config({"select": {"batch_size": -3}})
    assert "select.batch_size: -3 is not allowed; must be ≥ 1" in str(e.value)


def test_unknown_key_and_bad_literal_are_named():
    with pytest.raises(ConfigError) as e:
        parse_config({"model": {"mode": "int8", "lora_rank": 4}})
    msg = str(e.value)
    assert "model.mode: 'int8' is not allowed; must be one of" in msg
    assert "model.lora_rank: unknown key" in msg


def test_wrong_type_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="train.learning_rate"):
        parse_config({"train": {"learning_rate": "fast"}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("select: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_answers_must_be_unique():
    with pytest.raises(ConfigError, match="data.answers"):
        parse_config({"data": {"answers": ["a", "a"]}})


def test_section_and_yaml_roundtrip(tmp_path):
    cfg = parse_config({"seed": 7}, root=tmp_path)
    assert cfg.section("seed") == {"seed": 7}
    assert cfg.section("select")["batch_size"] == 32
    again = tmp_path / "c.yaml"
    again.write_text(cfg.to_yaml())
    assert load_config(again, root=tmp_path) == cfg
    assert isinstance(cfg.artifacts, Path)


def test_labelcheck_section_is_validated_and_old_train_keys_are_refused():
    with pytest.raises(ConfigError) as e:
        parse_config({"labelcheck": {"method": "loo", "kfold": 1}, "train": {"oos_method": "kfold"},
                      "rounds": {"simulate_noise": 1.5}})
    msg = str(e.value)
    assert "labelcheck.method: 'loo' is not allowed; must be one of" in msg
    assert "labelcheck.kfold: 1 is not allowed; must be ≥ 2" in msg
    assert "train.oos_method: unknown key" in msg and "rounds.simulate_noise: 1.5" in msg


SECRET = "ls-9f8e7d6c5b4a39281706"  # as a Label Studio access token looks


@pytest.mark.parametrize("section, field", [
    ({"token": SECRET}, "annotate.label_studio.token"),  # a token in plain text
    ({"api_key": SECRET, "url": "ftp://x"}, "annotate.label_studio.api_key"),  # with another error beside it
    ({"token_env": SECRET + "!"}, "annotate.label_studio.token_env"),  # the token pasted where its variable goes
    ({"url": f"https://admin:{SECRET}@ls.example.org"}, "annotate.label_studio.url"),  # credentials in a URL
    ({"url": f"ftp://admin:{SECRET}@ls.example.org"}, "annotate.label_studio.url"),
])
def test_config_errors_never_echo_a_secret(tmp_path, section, field):
    """`tamis config show` (as a user runs it) on a config holding a token: the error names the field and the fix,
    never the value; it reaches the terminal and, in a deployed run, Prefect's logs."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"paths": {"artifacts": str(tmp_path / "a")},
                                    "annotate": {"label_studio": section}}))
    res = subprocess.run([str(Path(sys.executable).parent / "tamis"), "config", "show", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert SECRET not in res.stdout + res.stderr
    assert res.returncode == 2, res.stdout + res.stderr
    assert field in res.stderr
    if "token_env" not in field and "url" not in field:
        assert "environment variable" in res.stderr


def test_a_token_is_named_by_its_environment_variable():
    cfg = parse_config({"annotate": {"label_studio": {"token": "${TEAM_LS_TOKEN}"}}})
    assert cfg.annotate.label_studio.token_env == "TEAM_LS_TOKEN"
    assert "    token_env: TEAM_LS_TOKEN" in cfg.to_yaml().splitlines()


# --- combinations a round would refuse later, refused at load (pipeline/config/combinations.py) ---
CLOSED = ["cat", "dog"]
REFUSED = [
    ({"answers": None}, {"strategy": "margin"},
     "select.strategy: 'margin' reads class probabilities, and data.answers is null", "use token_entropy"),
    ({"answers": None}, {"strategy": "bald", "mc_dropout_passes": 4},
     "select.strategy: 'bald' reads class probabilities, and data.answers is null", "or list data.answers"),
    ({"answers": CLOSED}, {"strategy": "semantic_entropy", "mc_dropout_passes": 4},
     "select.strategy: 'semantic_entropy' reads generated free-text answers, and data.answers is a closed set of 2",
     "or set data.answers: null"),
    ({"answers": CLOSED}, {"strategy": "token_entropy"}, "'token_entropy' reads generated free-text answers",
     "use least_confidence, margin or entropy"),
    ({"answers": None}, {"strategy": "semantic_entropy"},
     "select.strategy: 'semantic_entropy' compares answers sampled under MC dropout, and select.mc_dropout_passes "
     "is 0", "set select.mc_dropout_passes: 4 (at least 2), or use token_entropy"),
    ({"answers": None}, {"strategy": "answer_disagreement", "mc_dropout_passes": 1}, "mc_dropout_passes is 1",
     "set select.mc_dropout_passes: 4"),
    ({"answers": CLOSED}, {"strategy": "bald", "mc_dropout_passes": 1}, "'bald' compares answers sampled",
     "or use margin, which needs none"),
    ({"answers": None}, {"strategy": "token_entropy", "diversity": "stratified"},
     "select.diversity: 'stratified' spreads a batch over predicted classes", "use cluster_margin"),
]


@pytest.mark.parametrize(("data", "select", "what", "fix"), REFUSED, ids=[f"{s['strategy']}-{d['answers'] is None}"
                                                                           for d, s, *_ in REFUSED])
def test_load_refuses_what_a_round_would_refuse(tmp_path, data, select, what, fix):
    path = tmp_path / "c.yaml"
    path.write_text(__import__("yaml").safe_dump({"data": data, "select": select}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: invalid config\n  select.") and what in msg and fix in msg
    assert "<top level>" not in msg and "is not allowed" not in msg  # the sentence, not the whole input quoted


def test_what_a_round_runs_still_loads():
    for data, select in [({"answers": CLOSED}, {"strategy": "margin"}),
                         ({"answers": CLOSED}, {"strategy": "bald", "mc_dropout_passes": 2}),
                         ({"answers": None}, {"strategy": "semantic_entropy", "mc_dropout_passes": 4}),
                         ({"answers": None}, {"strategy": "random", "diversity": "k_center"}),
                         ({"answers": CLOSED}, {"diversity": "stratified"})]:
        parse_config({"data": data, "select": select})
    # Open answers that name no strategy get token_entropy: the default (entropy) reads class probabilities.
    assert parse_config({}).select.strategy == "token_entropy"
    assert parse_config({"data": {"answers": CLOSED}}).select.strategy == "entropy"
    for shipped in sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")):
        if not shipped.name.startswith("label_efficiency"):  # benchmark files: a project section inside
            load_config(shipped)


def test_combination_table_mirrors_the_heuristics():
    from pipeline.config.combinations import STRATEGY_READS
    from pipeline.strategies import HEURISTICS

    assert STRATEGY_READS == {name: h.input for name, h in HEURISTICS.items()}


# --- data.task: boxes (issue 50) ---
BOX_REFUSED = [
    ({"strategy": "margin"}, "select.strategy: 'margin' reads class probabilities, and data.task: boxes",
     "use token_entropy, or answer_disagreement"),
    ({"strategy": "semantic_entropy", "mc_dropout_passes": 4}, "'semantic_entropy' reads meanings", "or random"),
    ({"strategy": "answer_disagreement"}, "compares box answers sampled under MC dropout, and "
     "select.mc_dropout_passes is 0", "set select.mc_dropout_passes: 4"),
    ({"strategy": "token_entropy", "diversity": "stratified"}, "'stratified' spreads a batch over one predicted "
     "class per image", "use top_k"),
]


@pytest.mark.parametrize(("select", "what", "fix"), BOX_REFUSED, ids=[s["strategy"] for s, *_ in BOX_REFUSED])
def test_a_box_project_refuses_what_box_answers_cannot_feed(select, what, fix):
    from pipeline.config import DataConfig, SelectConfig
    from pipeline.config.combinations import combination_errors

    (msg,) = combination_errors(DataConfig(task="boxes", answers=["cat"]), SelectConfig(**select))
    assert what in msg and fix in msg


def test_box_answers_feed_token_entropy_and_sample_agreement():
    from pipeline.config import DataConfig, SelectConfig
    from pipeline.config.combinations import combination_errors

    data = DataConfig(task="boxes", answers=["cat", "dog"])
    for select in [{"strategy": "token_entropy"}, {"strategy": "random", "diversity": "k_center"},
                   {"strategy": "answer_disagreement", "mc_dropout_passes": 4}]:
        assert combination_errors(data, SelectConfig(**select)) == []


def test_a_box_project_needs_its_class_list_and_may_have_one_class():
    from pipeline.config import DataConfig

    with pytest.raises(ValueError, match="data.task: boxes needs its class list in data.answers"):
        DataConfig(task="boxes")
    assert DataConfig(task="boxes", answers=["person"]).answers == ["person"]
    with pytest.raises(ValueError, match="a closed answer set needs at least 2 answers"):
        DataConfig(answers=["person"])  # one class is a detector's project, not a classifier's
    assert "task" in DataConfig(task="boxes", answers=["a"]).model_dump()


def test_a_one_answer_project_dumps_no_task():
    # The data section keys ingest's cache: a project that never names a task keeps the key it had before the field.
    assert "task" not in parse_config({"data": {"answers": CLOSED}}).section("data")
    assert "task" not in parse_config({"data": {"task": "answer"}}).section("data")


def test_a_box_project_loads_with_the_defaults_box_answers_need(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  task: boxes\n  answers: [circle, square]\n")
    cfg = load_config(path)
    # Generated box text, scored as open answers: token entropy, room for a few boxes, the box label check (heldout),
    # class-balanced batches and box_iou consensus.
    assert cfg.select.strategy == "token_entropy" and cfg.model.max_new_tokens == 256
    assert cfg.select.diversity == "class_balanced" and cfg.annotate.consensus == "box_iou"
    assert cfg.labelcheck.method == "heldout" and cfg.data.scored_answers is None and cfg.data.box_labels == ["circle", "square"]
    path.write_text("data:\n  task: boxes\n  answers: [circle]\nmodel:\n  max_new_tokens: 64\naugment:\n  copies: 2\n"
                    "labelcheck:\n  method: kfold\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "augment.copies: 2" in str(e.value) and "labelcheck.method: 'kfold'" in str(e.value)
