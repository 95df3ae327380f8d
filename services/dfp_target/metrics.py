"""Prometheus metrics of the target service (tokens/s via ``rate(dflash_target_tokens_total[1m])``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("dflash_target_tokens_total", "Tokens whose hidden states were computed.")
SEQUENCES = Counter("dflash_target_sequences_total", "Sequences whose hidden states were computed.")
PADDED_TOKENS = Counter("dflash_target_padded_tokens_total", "Tokens run through the model including padding.")
BATCHES = Counter("dflash_target_batches_total", "Forward passes run.")
BATCH_SEQUENCES = Histogram("dflash_target_batch_sequences", "Sequences per forward pass.",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_TOKENS = Histogram("dflash_target_batch_tokens", "Real tokens per forward pass.",
                         buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536))
FORWARD_SECONDS = Histogram("dflash_target_forward_seconds", "Seconds per forward pass.")
QUEUE_WAIT = Histogram("dflash_target_queue_wait_seconds", "Seconds a sequence waited before its forward pass.",
                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30))
QUEUE_TOKENS = Gauge("dflash_target_queue_tokens", "Tokens waiting in the batching queue.")
TOKENS_PER_SECOND = Gauge("dflash_target_tokens_per_second", "Tokens per second of the last forward pass.")
REJECTED = Counter("dflash_target_rejected_total", "Calls refused because the queue was full.")
INVALID = Counter("dflash_target_invalid_requests_total", "Calls refused as INVALID_ARGUMENT.")
SENT_BYTES = Counter("dflash_target_sent_bytes_total", "Hidden-state bytes delivered.", ["transport"])
GPU_MEMORY = Gauge("dflash_target_gpu_memory_bytes", "CUDA memory allocated by the model process.")
GPU_MEMORY_PEAK = Gauge("dflash_target_gpu_memory_peak_bytes", "Peak CUDA memory allocated.")


def observe_batch(sequences: int, tokens: int, padded: int, seconds: float) -> None:
    TOKENS.inc(tokens)
    SEQUENCES.inc(sequences)
    PADDED_TOKENS.inc(padded)
    BATCHES.inc()
    BATCH_SEQUENCES.observe(sequences)
    BATCH_TOKENS.observe(tokens)
    FORWARD_SECONDS.observe(seconds)
    if seconds > 0:
        TOKENS_PER_SECOND.set(tokens / seconds)


def observe_gpu_memory() -> None:
    import torch

    if torch.cuda.is_available():
        GPU_MEMORY.set(torch.cuda.memory_allocated())
        GPU_MEMORY_PEAK.set(torch.cuda.max_memory_allocated())
