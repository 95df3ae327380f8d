"""The training loop's own modules (the parts it is built from: :mod:`dfp_trainer.components`).

* :mod:`.train` - the loop: :class:`~.train.Training` built once (:mod:`.state`: set-up and resume), each
  micro-batch through :mod:`.step` (the loss recipe: :class:`~dfp_trainer.components.loss.LossRecipe`), each
  step's figures recorded by :mod:`.figures` (metrics, gauges, progress), checkpoints every N steps;
* :mod:`.prepare` - the run's checked inputs: dataset, target parts, tokenizer, hidden-state source;
* :mod:`.inputs` - the run's micro-batches through the input stages;
* :mod:`.progress` - the run's hooks to its job record (progress, metric points, stop checks).

Above :mod:`dfp_trainer.components` and :mod:`dfp_trainer.drafter`; the mid-training evaluation uses
:mod:`dfp_trainer.evaluate`. What follows a completed run (export, evaluation, report) is the top level's
(:func:`dfp_trainer.run.train`).
"""
