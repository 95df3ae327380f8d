"""Shared core of dflash-pipeline: config, storage, queue, job records, wire codec, logs, metrics, models."""
