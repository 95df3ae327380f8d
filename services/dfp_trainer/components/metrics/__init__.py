"""A run's figures: :mod:`.metrics_log` (the live metrics log: TensorBoard, MLflow, the job's metric history,
with the mid-training evaluations), :mod:`.gauges` (Prometheus), :mod:`.heldout` (held-out objective
metrics, also of the drafter at its initial weights).
"""
