"""The training data.

* :mod:`.dataset` - the token dataset in memory, length-bucketed batches, a resumable sampler, each rank's
  share and micro-batches;
* :mod:`.collate` - the drafter's :class:`~dfp_trainer.drafter.batch.Batch` collated from the dataset and
  given the target's features;
* :mod:`.stages` - the concurrent input stages: build -> fetch hidden states -> host-to-device copy;
* :mod:`.hidden_cache` - the run's hidden-state cache: opened for its key, sized, completed;
* :mod:`.draft_vocab` - the pruned draft vocabulary chosen from the training data's token counts, and its
  coverage.
"""
