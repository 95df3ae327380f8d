"""Progress of a shard while it runs, in the job record's counters, still counted exactly once.

The job's counters hold the final counts of the shards done (added once when a shard completes)
plus what each running shard has done so far. A running shard's live contribution is remembered
per shard in ``dfp:job:<id>:live`` (fields ``<shard>|<unit>``, and ``<shard>|attempt`` naming the
attempt that owns it), and every change goes through one Redis script:

* an update adds to the counters only the difference from what the shard contributed before;
* a new attempt at a shard (a redelivery after a worker died, or a released shard taken up again)
  first withdraws the previous attempt's contribution; from then on only the newest attempt's
  updates count, so a stale worker still running the shard cannot add to it;
* completing the shard withdraws its live contribution and adds its final counts, under the same
  exactly-once check as :meth:`dfp_shared.jobs.store.JobStore.complete_task`; updates that arrive after
  that are ignored.

So the counters never count a result twice, and once every shard is done they equal the sum of the
shards' final counts.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

import redis
from dfp_shared.jobs.store import JobStore

from .engines import GenResult

log = logging.getLogger(__name__)

# KEYS: done set, counters, live hash. ARGV: shard, attempt, then unit/value pairs.
_WITHDRAW = """
local function withdraw(shard)
  local prefix = shard .. '|'
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    local f = flat[i]
    if string.sub(f, 1, #prefix) == prefix then
      local unit = string.sub(f, #prefix + 1)
      if unit ~= 'attempt' and tonumber(flat[i + 1]) ~= 0 then
        redis.call('HINCRBYFLOAT', KEYS[2], unit, -tonumber(flat[i + 1]))
      end
      redis.call('HDEL', KEYS[3], f)
    end
  end
end
"""

_UPDATE = _WITHDRAW + """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
local owner = redis.call('HGET', KEYS[3], ARGV[1] .. '|attempt')
if owner ~= ARGV[2] then
  if ARGV[3] ~= '1' then return 0 end
  withdraw(ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1] .. '|attempt', ARGV[2])
end
for i = 4, #ARGV, 2 do
  local field = ARGV[1] .. '|' .. ARGV[i]
  local delta = tonumber(ARGV[i + 1]) - tonumber(redis.call('HGET', KEYS[3], field) or '0')
  if delta ~= 0 then redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], delta) end
  redis.call('HSET', KEYS[3], field, ARGV[i + 1])
end
return 1
"""

_COMPLETE = _WITHDRAW + """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
withdraw(ARGV[1])
for i = 3, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HINCRBYFLOAT', KEYS[2], 'tasks', 1)
return 1
"""


class ShardProgress:
    """Live counts of one attempt at one shard, published to the job record at most every ``every_s``.

    Units: ``prompts`` (prompts with every sample finished), ``completions``, ``errors`` (requests
    that failed for good), ``truncated`` and ``output_tokens`` (of the completions).
    """

    def __init__(self, r: redis.Redis, job_id: str, shard_key: str, samples_per_prompt: int, *, every_s: float = 1.0,
                 attempt: str | None = None):
        self.r = r
        self.shard_key = shard_key
        self.samples = samples_per_prompt
        self.every_s = every_s
        self.attempt = attempt or uuid.uuid4().hex
        keys = JobStore.keys(job_id)
        self.keys = [keys.done, keys.counters, keys.live]
        self.counts = {"prompts": 0, "completions": 0, "errors": 0, "truncated": 0, "output_tokens": 0}
        self._samples_done: Counter[str] = Counter()
        self._published_at: float | None = None
        self._owner = False
        self._update = r.register_script(_UPDATE)
        self._complete = r.register_script(_COMPLETE)

    def add(self, res: GenResult) -> None:
        """Count one finished request (generated now or restored from a checkpoint)."""
        if res.ok:
            self.counts["completions"] += 1
            self.counts["output_tokens"] += res.completion_tokens
            self.counts["truncated"] += int(res.truncated)
        else:
            self.counts["errors"] += 1
        prompt = res.id if self.samples == 1 else res.id.rsplit("#", 1)[0]
        self._samples_done[prompt] += 1
        if self._samples_done[prompt] == self.samples:
            self.counts["prompts"] += 1

    def maybe_publish(self) -> None:
        now = time.monotonic()
        if self._published_at is None or now - self._published_at >= self.every_s:
            self.publish(now)

    def publish(self, now: float | None = None) -> bool:
        """Write this attempt's counts now (the first call takes the shard over). False when the shard
        is already counted or a newer attempt owns it. Redis errors are logged, not raised: live
        progress is best effort, the final counts are not."""
        self._published_at = time.monotonic() if now is None else now
        args = [self.shard_key, self.attempt, "0" if self._owner else "1"]
        for unit, value in self.counts.items():
            args += [unit, value]
        try:
            ok = bool(self._update(keys=self.keys, args=args))
        except redis.RedisError as exc:
            log.warning("live progress not written", extra={"shard": self.shard_key, "error": str(exc)})
            return False
        self._owner = self._owner or ok
        return ok

    def complete(self, **final: float) -> bool:
        """Count the shard exactly once with its final counts, replacing its live contribution.
        False if it was already counted."""
        args = [self.shard_key, self.attempt]
        for unit, value in final.items():
            args += [unit, float(value)]
        return bool(self._complete(keys=self.keys, args=args))
