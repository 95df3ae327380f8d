"""Running a whole generate job in one process without Redis (``dflash-pipeline generation run``).

Same plan, shards and output files as the distributed workers, so a local run and a cluster run
of the same spec produce the same layout, and a rerun skips the shards already done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from dfp_shared.records.completions import SHARD_COUNTS, build_manifest, shard_entry, write_manifest
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.storage.store import open_store

from .engines import GenResult
from .plan import Plan, plan_shards
from .settings import GenerationSettings
from .shard import ShardOutcome, ShardRunner, prune_stale
from .tasks import build_engine, output_uris


@dataclass
class LocalRun:
    plan: Plan
    outcomes: list[ShardOutcome]
    outputs: dict

    def totals(self) -> dict:
        return {k: sum(getattr(o, k) for o in self.outcomes) for k in SHARD_COUNTS}


def run_local(spec: GenerateSpec, settings: GenerationSettings, *,
              on_plan: Callable[[Plan], None] | None = None,
              on_result: Callable[[GenResult], None] | None = None,
              on_shard: Callable[[ShardOutcome], None] | None = None) -> LocalRun:
    endpoint = settings.s3_endpoint_url
    plan = plan_shards(spec.prompts, spec.shard_size, endpoint_url=endpoint)
    if on_plan:
        on_plan(plan)
    out = open_store(spec.output, endpoint_url=endpoint)
    out.put("plan.json", json.dumps(plan.to_dict()).encode())
    engine = build_engine(spec, settings)
    try:
        runner = ShardRunner(spec, engine, endpoint_url=endpoint, checkpoint_interval_s=settings.checkpoint_interval_s)
        outcomes = []
        for shard in plan.shards:
            outcome = runner.run(plan.source.root, shard, on_result=on_result)
            outcomes.append(outcome)
            if on_shard:
                on_shard(outcome)
    finally:
        engine.close()
    run = LocalRun(plan, outcomes, output_uris(spec))
    shards = [shard_entry(o.key, o.counters()) for o in outcomes]
    prune_stale(out, [shard.key for shard in plan.shards])
    write_manifest(out, build_manifest(spec.model_dump(mode="json"), shards))
    return run
