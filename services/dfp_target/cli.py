"""Command-line entry points of the target service."""

import click
from dfp_shared.cli_support import common_options, settings_or_exit


@click.group(name="target")
def group():
    """Target model server: hidden states of the frozen target's layers over gRPC, batched across callers."""


@group.command()
@common_options
@click.option("--model", default=None, help="Checkpoint directory, file:// or s3:// URI [env DFLASH_MODEL].")
@click.option("--model-id", default=None, help="Model id reported to clients [env DFLASH_MODEL_ID].")
@click.option("--device", default=None, help="auto, cpu, cuda, cuda:N [env DFLASH_DEVICE].")
@click.option("--dtype", default=None, help="auto, float32, bfloat16, float16 [env DFLASH_DTYPE].")
@click.option("--layer-ids", default=None, help="Comma-separated layer ids served; empty = all [env DFLASH_LAYER_IDS].")
@click.option("--host", default=None, help="Listen address [env DFLASH_HOST].")
@click.option("--port", type=int, default=None, help="gRPC port [env DFLASH_PORT].")
@click.option("--max-batch-tokens", type=int, default=None, help="Token budget per forward [env DFLASH_MAX_BATCH_TOKENS].")
@click.option("--max-wait-ms", type=float, default=None, help="Batching window in ms [env DFLASH_MAX_WAIT_MS].")
@click.option("--max-queue-tokens", type=int, default=None, help="Queue bound in tokens [env DFLASH_MAX_QUEUE_TOKENS].")
@click.option("--max-tokens-per-request", type=int, default=None, help="Tokens per call [env DFLASH_MAX_TOKENS_PER_REQUEST].")
@click.option("--chunk-bytes", type=int, default=None, help="Data bytes per reply message [env DFLASH_CHUNK_BYTES].")
@click.option("--max-message-bytes", type=int, default=None, help="gRPC message limit [env DFLASH_MAX_MESSAGE_BYTES].")
@click.option("--drain-seconds", type=float, default=None, help="Drain time on SIGTERM [env DFLASH_DRAIN_SECONDS].")
@click.option("--shm-dir", default=None, help="Shared-memory directory; empty disables [env DFLASH_SHM_DIR].")
def serve(**flags):
    """Serve the target's hidden states over gRPC (port 50051 by default)."""
    from .service import serve as run
    from .settings import TargetSettings

    run(settings_or_exit(TargetSettings, "target", **flags))
