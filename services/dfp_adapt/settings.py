"""Settings of ``dflash-pipeline adapt`` (``DFLASH_ADAPT_*``, or the matching ``--adapt-*`` flag)."""

from __future__ import annotations

from dfp_shared.config import CommonSettings
from pydantic import Field, SecretStr

from dfp_adapt.rule import MAX_ALPHA, MAX_MIN_PROMPTS, MIN_ALPHA, MIN_PROMPTS_FLOOR
from dfp_adapt.serving import MAX_MIN_GAIN, StepCosts
from dfp_adapt.source import MAX_HELDOUT_SHARE, MAX_WINDOW_HOURS

MAX_RETENTION_HOURS = 24 * 366


class AdaptSettings(CommonSettings):
    api_url: str = Field("http://127.0.0.1:8000", pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$",
                         description="Base URL of the API the run's jobs are submitted to.")
    api_key: SecretStr | None = Field(None, description="API key the jobs are submitted with (environment only).")
    adapt_name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                            description="Name of the served drafter: its folder under the served location.")
    adapt_served: str = Field("", description="Served location (inside the storage roots): <served>/<name>/current.json "
                                              "names the version serving reads (dflash-pipeline adapt current); empty: "
                                              "<storage_url>/served.")
    adapt_capture_prefix: str = Field("", description="Capture prefix the traffic is read from; empty: "
                                                      "<storage_url>/capture.")
    adapt_runs: str = Field("", description="Prefix each run's data, jobs' outputs and evaluations go under "
                                            "(<runs>/<name>/<time>/); empty: <storage_url>/adapt.")
    adapt_window_hours: float = Field(24.0, gt=0, le=MAX_WINDOW_HOURS,
                                      description=f"Hours of traffic, ending now, a run trains on (0..{MAX_WINDOW_HOURS}).")
    adapt_heldout_share: float = Field(0.1, gt=0, le=MAX_HELDOUT_SHARE,
                                       description="Share of the window's newest records held out for evaluation "
                                                   f"(0..{MAX_HELDOUT_SHARE}).")
    adapt_regenerate: bool = Field(True, description="Regenerate the sampled (non-greedy) records' answers greedily "
                                                     "with a generate job; off: train on them as they are.")
    adapt_min_gain: float = Field(0.02, ge=0, le=MAX_MIN_GAIN,
                                  description="Least mean gain in output tokens per second over the served configuration "
                                              "a candidate must show, as a share of the served one's (0.02: 2 %).")
    adapt_alpha: float = Field(0.025, ge=MIN_ALPHA, le=MAX_ALPHA,
                               description="One-sided level of the paired t test the gain must pass (the share of equal "
                                           f"candidates promoted on noise; {MIN_ALPHA}..{MAX_ALPHA}).")
    adapt_min_prompts: int = Field(8, ge=MIN_PROMPTS_FLOOR, le=MAX_MIN_PROMPTS,
                                   description="Fewest paired held-out prompts a decision is made on; fewer: refused "
                                               f"({MIN_PROMPTS_FLOOR}..{MAX_MIN_PROMPTS}).")
    adapt_step_costs: StepCosts = Field(default_factory=StepCosts,
                                        description="Seconds of one target verify step, one drafter forward and one "
                                                    "n-gram lookup, measured with the serving engine on the serving "
                                                    "hardware (JSON: target_step_s, draft_step_s, ngram_step_s).")
    adapt_spec: str = Field("", description="YAML/JSON file of the stages' spec fields: generate, tokenize, train, "
                                            "evaluate (target, tokenizer, steps, ...); the run sets inputs and outputs.")
    adapt_retention_hours: float = Field(168.0, gt=0, le=MAX_RETENTION_HOURS,
                                         description="Hours a run's prefix (copies of captured traffic among its data) "
                                                     "is kept from the run's start; the next run deletes older ones. "
                                                     "Set it to the capture's retention.")
    adapt_poll_s: float = Field(5.0, gt=0, le=600, description="Seconds between looks at a running job.")
    adapt_timeout_s: float = Field(86_400.0, gt=0, le=7 * 86_400,
                                   description="Seconds a run waits for one of its jobs before it gives up.")

    def served(self) -> str:
        return self.adapt_served or self.storage_url.rstrip("/") + "/served"

    def capture(self) -> str:
        return self.adapt_capture_prefix or self.storage_url.rstrip("/") + "/capture"

    def runs(self) -> str:
        return self.adapt_runs or self.storage_url.rstrip("/") + "/adapt"
