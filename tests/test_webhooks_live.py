"""Rounds started by Label Studio's webhooks, against a real Label Studio 1.23.2 in its own venv (as
tests/test_label_studio_live.py runs it; under CI=true a server that cannot start fails the test).

The scenario is tests/webhook_scenario.py: round 0's batch in a Label Studio project, the webhook registered through
the API by `tamis setup-webhook`, `tamis listen` in its own process, annotations posted through the API for the whole
batch, with a correction, a stale and duplicated delivery and a SIGKILLed receiver in the middle. The next round must
start by itself within NEXT_BATCH_WITHIN_S, import exactly the batch's labels (the corrected one as corrected),
push the next batch to the same project, and start once.
"""

from __future__ import annotations

import pytest
from test_label_studio_live import TOKEN, TOKEN_ENV, ls_site_packages, start_server
from test_label_studio_live import label_studio_sdk as _sdk_fixture  # noqa: F401 (registers the fixture)
from webhook_scenario import LS_ENV, NEXT_BATCH_WITHIN_S, SECRET, round_trip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def webhook_label_studio(tmp_path_factory):
    root = tmp_path_factory.mktemp("ls-webhooks")
    (root / "artifacts").mkdir()
    server = start_server(tmp_path_factory.mktemp("ls-webhook-server"), root / "artifacts", env=LS_ENV)
    yield server, root
    server.stop()


@pytest.mark.usefixtures("_sdk_fixture")
def test_annotations_arriving_start_the_next_round_which_pushes_the_next_batch(
        webhook_label_studio, tiny_models, prefect_harness, monkeypatch):
    import sys

    from prefect.settings import PREFECT_API_URL

    from pipeline.annotation.ledger import Ledger, ledger_path
    from pipeline.annotation.webhooks import EventQueue, current_batch, pending, pulled_keys
    from pipeline.config import load_config

    server, root = webhook_label_studio
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    site = ls_site_packages()
    out = round_trip(server, root, tiny_models, token=TOKEN, token_env=TOKEN_ENV, prefect_api=PREFECT_API_URL.value(),
                     extra_path=[p for p in sys.path if p] + ([str(site)] if site else []))

    # the webhook, registered through the API, carries the secret as a header and the three annotation actions
    [hook] = [h for h in out["hooks"] if h["url"] == out["url"]]
    assert hook["headers"] == {"X-Tamis-Secret": SECRET} and hook["is_active"] and hook["send_payload"]
    assert "created" in out["setup"]
    assert out["refused"] == [401, 401]  # no secret, a wrong secret
    assert out["replays"] == [200, 200]  # acknowledged; what they change is checked below: nothing

    # the next batch appeared by itself, within the stated time
    assert out["next_batch_s"] < NEXT_BATCH_WITHIN_S, out["next_batch_s"]
    assert out["log"].count("starting the next round") == 1, out["log"]  # one round, however many triggers
    first, second = out["rounds"]
    assert (first.round, second.round) == (0, 1)
    assert second.labeled == out["batch"] and second.label_studio["pushed"] == second.selected > 0

    # it imported exactly the batch's labels, the correction as corrected (not the stale replay)
    cfg = load_config(root / "tamis.yaml")
    ledger = Ledger(ledger_path(cfg.artifacts))
    assert ledger.labels() == out["truth"]
    assert len(ledger.entries()) == out["batch"] and {e["round"] for e in ledger.entries()} == {1}

    # and nothing is left pending: the events' keys are the pull's keys (the restart and the replays counted nothing)
    events = EventQueue(cfg.artifacts).events()
    # half the batch created, one correction; the two stale replays were Label Studio's own first delivery again
    assert out["events_before_last"] == out["batch"] // 2 + 1
    assert len(events) == out["events_before_last"] + out["batch"] - out["batch"] // 2
    left = pending(events, pulled_keys(cfg.artifacts, {out["project"]}), current_batch(cfg.artifacts, second))
    assert not left.new and left.batch == second.selected and left.batch_left == left.batch

    for p in cfg.artifacts.rglob("*"):  # neither the webhook secret nor the API token is written anywhere
        if p.is_file() and p.stat().st_size < 50_000_000:
            assert SECRET.encode() not in p.read_bytes() and TOKEN.encode() not in p.read_bytes(), p

    # the round is a flow run on the Prefect server, as `tamis round`'s are
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["labeling-round"])))
    assert sum(r.state_type.value == "COMPLETED" for r in runs) >= 2
