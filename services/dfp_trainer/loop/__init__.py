"""The training loop and what feeds it.

* :mod:`.train` - the loop: :class:`~.train.Training` built once (:mod:`.state`: set-up and resume; the
  optimiser and its schedule: :mod:`.optimizer`), each micro-batch through :mod:`.step` (the loss recipe:
  :class:`~dfp_trainer.drafter.objective.LossRecipe`), each step's figures recorded by :mod:`.figures` (metrics, gauges,
  progress), checkpoints (:mod:`.checkpoint`, :mod:`.state_codec`);
* :mod:`.prepare` - the run's checked inputs: dataset, target parts, tokenizer, hidden-state source;
* the input pipeline: :mod:`.data` (dataset, sampler), :mod:`.inputs` (the run's micro-batches) and
  :mod:`.stages` (build -> fetch -> copy on threads);
* :mod:`.distributed` (torchrun / DDP), :mod:`.metrics_log` (TensorBoard, MLflow), :mod:`.gauges`
  (Prometheus), :mod:`.progress` (the job record), :mod:`.heldout` (held-out objective metrics).

Above :mod:`dfp_trainer.drafter`; the mid-training evaluation uses :mod:`dfp_trainer.evaluate`. What follows a
completed run (export, evaluation, report) is the top level's (:func:`dfp_trainer.run.train`).
"""
