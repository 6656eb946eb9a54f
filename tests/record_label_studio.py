"""Re-record tests/data/label_studio_exchange.json from the real SDK against the pinned Label Studio.

    python tests/record_label_studio.py            # from the repository root, in tamis's environment

It installs Label Studio (LS_VERSION in tests/test_label_studio_live.py) into its own cached virtual environment if
missing, starts it on 127.0.0.1 in a temporary folder, runs every scenario of tests/label_studio_exchange.py through
the connector with a recording SDK client, and writes the recording. Review the diff before committing it: it must
hold no token (the script refuses to write one) and no path outside the placeholder. Run it after changing the
connector's SDK calls or bumping LS_VERSION; the slow test test_recorded_exchange_is_what_the_pinned_sdk_and_server_do
fails until the recording matches.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for p in (HERE.parent, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def record_exchange(server: Any, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the recording, each scenario's results) of the scenarios run against `server` in folders under `root` (inside
    the server's local-files document root)."""
    import label_studio_sdk
    from label_studio_exchange import TOKEN_ENV, Recorder, run_scenarios, signature_record
    from label_studio_sdk.client import LabelStudio
    from test_label_studio_live import LS_VERSION, TOKEN

    before = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN  # the scenarios' configs name this variable; put back below
    calls: dict[str, list[dict[str, Any]]] = {}
    sigs: dict[str, Any] = {"LabelStudio": signature_record(LabelStudio, "__init__")}

    def client_for(name: str, folder: Path) -> Recorder:
        calls[name] = []
        return Recorder(LabelStudio(base_url=server.url, api_key=TOKEN), folder, calls[name], sigs)

    def annotate(pid: int, task_set: str, labels: dict[str, tuple[str, float | None]]) -> None:
        tasks = server.api("GET", f"/api/tasks?project={pid}&page_size=1000")
        tasks = tasks["tasks"] if isinstance(tasks, dict) else tasks
        for t in tasks:
            if t["data"].get("tamis_set") == task_set and t["data"]["sample_id"] in labels:
                label, seconds = labels[t["data"]["sample_id"]]
                body: dict[str, Any] = {"result": [{"from_name": "answer", "to_name": "image", "type": "choices",
                                                    "value": {"choices": [label]}}], "was_cancelled": False}
                if seconds is not None:
                    body["lead_time"] = seconds
                server.api("POST", f"/api/tasks/{t['id']}/annotations/", body)

    try:
        results = run_scenarios(root, client_for, annotate)
    finally:
        if before is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = before
    exchange = {"label_studio": LS_VERSION, "label_studio_sdk": label_studio_sdk.__version__,
                "signatures": dict(sorted(sigs.items())), "scenarios": calls}
    text = json.dumps(exchange)
    if TOKEN in text or str(root) in text:
        raise RuntimeError("the recording holds the API token or a machine path; not writing it")
    return exchange, results


def main() -> None:
    from label_studio_exchange import EXCHANGE
    from test_label_studio_live import ls_site_packages, start_server

    with tempfile.TemporaryDirectory(prefix="tamis-ls-record-") as tmp:
        root = Path(tmp) / "artifacts"
        root.mkdir()
        server = start_server(Path(tmp) / "server", root)  # installs Label Studio first when missing
        try:
            try:
                import label_studio_sdk  # noqa: F401
            except ImportError:
                sys.path.append(str(ls_site_packages()))  # the SDK Label Studio itself ships
            exchange, _ = record_exchange(server, root)
        finally:
            server.stop()
    EXCHANGE.parent.mkdir(parents=True, exist_ok=True)
    EXCHANGE.write_text(json.dumps(exchange, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    n = sum(len(c) for c in exchange["scenarios"].values())
    print(f"{EXCHANGE}: {n} calls in {len(exchange['scenarios'])} scenarios, label-studio "
          f"{exchange['label_studio']}, label-studio-sdk {exchange['label_studio_sdk']}")


if __name__ == "__main__":
    main()
