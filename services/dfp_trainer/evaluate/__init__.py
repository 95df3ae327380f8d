"""Evaluating a drafter by real speculative decoding.

* :mod:`.decode` - speculative decoding and verification (greedy, as the reference), one prompt at a time;
* :mod:`.batched` - the same decoding of several prompts at once, with the same outputs and counts;
* :mod:`.acceptance` - τ of a drafter over prompts (the train report's);
* :mod:`.tau` - counting τ (acceptance length), and τ of a drafter with a run's decoding settings;
* :mod:`.prediction` - the τ held-out per-position accuracies predict, and the train/serve verdict;
* :mod:`.ngram` - n-gram (prompt-lookup) speculation, the baseline without a drafter;
* :mod:`.prompts` - which prompts a training run evaluates on;
* :mod:`.job` - the ``evaluate`` job (its worker handler: :mod:`dfp_trainer.jobs.evaluate`);
* :mod:`.serve_reference` - the plain greedy reference decode a served drafter is checked against.

Above :mod:`dfp_trainer.drafter` only.
"""
