# The two commands in the README: `make demo` and `make test`. Both work on a fresh machine with Python and make.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tamis-installed
# Keep tests and the demo hermetic: no telemetry, no update checks, no hub look-ups.
export DO_NOT_TRACK=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export NO_ALBUMENTATIONS_UPDATE=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: install demo test test-claims test-all lint clean-artifacts

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and explicitly: a bare `torch` requirement would pull a multi-GB build from the index.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tamis demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" -q

# The slow tests that stand behind the README's claims, run by CI after `make test`: the demo end to end, a round
# SIGKILLed at every stage, the deployment's suspend/resume, Dask against the local runner and on a real cluster,
# data-parallel training, the open-answer kill/resume, the live Label Studio round trip (pinned server, own venv),
# the round's label check at demo size, a code edit recomputing only its stage, cache keys stable across revisions,
# rounds with a crowd of annotators, label imports SIGKILLed mid ledger write (in test_fault_injection.py), a round
# reading a torn ledger, rounds started by Label Studio's webhooks, the listener resuming a deployed round that waits
# for its labels (worker, Prefect server and Label Studio all real), a ten-minute soak of the webhook receiver, new
# users' projects from init to round 2 unedited (test rows last, open answers, lower-case labels), the export's
# predict.py agreeing with tamis predict where tamis cannot be imported, the GGUF export read back and a tiny
# Qwen3-VL's answering in llama.cpp's llama-server (built once from the pinned source into
# ~/.cache/tamis-llama-cpp-<commit>/), a schema project's two rounds with per-field metrics (test_fields_round.py), a
# two-image task with per-field controls in the live Label Studio.
CLAIMS := tests/test_demo.py tests/test_fault_injection.py tests/test_deployment.py tests/test_dask_scoring.py \
	tests/test_dask_cluster.py tests/test_distributed_train.py tests/test_open_round.py tests/test_label_studio_live.py \
	tests/test_round_labelcheck.py tests/test_code_keys.py tests/test_cache_stability.py tests/test_consensus.py \
	tests/test_ledger_readers.py tests/test_webhooks_live.py tests/test_listen_resume_live.py \
	tests/test_webhook_soak.py tests/test_second_hour.py tests/test_serve_export.py \
	tests/test_gguf_export.py::test_an_idefics3_export_writes_gguf_files_that_read_back_as_text_model_and_projector \
	'tests/test_gguf_export.py::test_llama_cpp_built_from_the_pinned_source_answers_as_transformers_on_merged[qwen3_vl]' \
	tests/test_box_label_studio_live.py tests/test_box_round.py::test_cli_a_box_project_runs_from_init_to_round_1_without_hand_edits \
	tests/test_init.py::test_cli_a_new_users_manifest_runs_from_init_to_round_2_without_hand_edits \
	tests/test_several_images_round.py tests/test_fields_round.py tests/test_several_images_label_studio_live.py
test-claims: $(STAMP)
	$(PY) -m pytest -m "slow and not gpu" -q --durations=0 $(CLAIMS)

test-all: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline flows tests benchmarks

clean-artifacts:
	find artifacts -mindepth 1 ! -name .gitkeep -exec rm -rf {} +
