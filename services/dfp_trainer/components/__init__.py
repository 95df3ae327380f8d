"""What the training loop is built from, each part on its own: the loop (:mod:`dfp_trainer.loop`) wires them.

* :mod:`.checkpoint` - checkpoints in object storage (written atomically, the last K kept), the trainer state in
  them as data only (:mod:`.state_codec`);
* :mod:`.optimizer` - the optimiser (AdamW, or Muon beside AdamW) and the LR schedule;
* :mod:`.loss` - the loss recipe: a train spec's objective settings as one typed object
  (:class:`~.loss.LossRecipe`);
* :mod:`.data` - the data: the token dataset and its sampler, collation into the drafter's batches, the
  concurrent input stages, the hidden-state cache, and the draft vocabulary chosen from the training data;
* :mod:`.metrics` - the figures: the live metrics log (TensorBoard, MLflow, the job's history), the Prometheus
  gauges, the held-out objective metrics;
* :mod:`.distributed` - torchrun / DDP: process groups, timed gradient sync, cross-rank figures.

Above :mod:`dfp_trainer.drafter`; the metrics log's mid-training evaluation uses :mod:`dfp_trainer.evaluate`.
Nothing here imports the loop, the jobs or the trainer's top-level modules.
"""
