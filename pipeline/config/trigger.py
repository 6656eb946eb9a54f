"""rounds.trigger: rounds started by Label Studio's webhooks (`tamis listen`), and the receiver they call."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipeline.config.base import Section

WEBHOOK_PATH = "/label-studio"  # the receiver's one endpoint


class TriggerConfig(Section):
    """When `tamis listen` starts the next round, and where it listens for Label Studio's webhooks.

    A round starts once at least one new label is in and any enabled rule holds; the rules are checked again each time
    an event arrives and when a quiet period ends.
    """

    batch_complete: bool = Field(
        default=True, description="Start when every task of the last round's batch (and its re-label tasks) has an "
                                  "annotation.")
    min_new_labels: int | None = Field(
        default=None, ge=1, description="Start once this many annotations not yet imported have arrived; None = off.")
    debounce_s: float | None = Field(
        default=None, gt=0, description="Start once no annotation event has arrived for this many seconds (and at "
                                        "least one new label is in); None = off.")
    retry_s: float = Field(
        default=300, gt=0, description="After a round that left the new labels unimported (Label Studio down, the "
                                       "round failed), wait this long before the next try.")
    host: str = Field(default="127.0.0.1", description="The address the receiver listens on.")
    port: int = Field(default=8787, ge=1, le=65535, description="The receiver's port.")
    public_url: str | None = Field(
        default=None, description="The URL Label Studio calls (behind a reverse proxy, or when Label Studio runs on "
                                  "another host); None = http://host:port" + WEBHOOK_PATH + ".")
    allow_public_bind: bool = Field(
        default=False, description="Let `host` be an address other than a loopback or private one (0.0.0.0, \"\", "
                                    "::, a public address): the receiver speaks plain HTTP, so this is refused "
                                    "unless set, and warned about when set; prefer a TLS reverse proxy.")
    read_timeout_s: float = Field(
        default=15, gt=0, description="A connection must have sent its whole request (headers and body) within this "
                                      "many seconds, or it is closed.")
    max_connections: int = Field(
        default=256, ge=1, description="Connections handled at once; one more is answered 503 and closed at once.")
    secret_env: str = Field(
        default="TAMIS_WEBHOOK_SECRET", description="The environment variable holding the shared secret Label "
                                                    "Studio sends in the X-Tamis-Secret header (never in the config).")

    @model_validator(mode="after")
    def _some_rule(self) -> TriggerConfig:
        if not self.batch_complete and self.min_new_labels is None and self.debounce_s is None:
            raise ValueError("rounds.trigger: no rule would ever start a round; set batch_complete: true, "
                             "min_new_labels (e.g. 50) or debounce_s (e.g. 600)")
        return self

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}{WEBHOOK_PATH}"
