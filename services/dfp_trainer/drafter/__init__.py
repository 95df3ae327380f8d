"""The drafter: what is trained and shipped, with nothing of the training run around it.

* :mod:`.config` - :class:`~.config.DrafterConfig`, sized to a target, written as and read back from the
  exported ``config.json``;
* :mod:`.model` - :class:`~.model.DFlashDrafter`, Qwen3 draft layers over the target's frozen embedding and
  LM head (:mod:`.target_parts` reads those two tensors from the target's checkpoint);
* :mod:`.attention` - the attention masks of training and decoding, after the one visibility rule of
  :mod:`.modeling_dflash`;
* :mod:`.modeling_dflash` - the self-contained modeling file the z-lab export ships beside the weights
  (``AutoModel`` with ``trust_remote_code``); it imports torch and transformers only, never this package;
* :mod:`.objective` - the training objective (anchors, block targets, the loss and its metrics);
* :mod:`.batch` - the :class:`~.batch.Batch` the model, the objective, the training loop and the evaluations
  speak (collated from the token dataset by :mod:`dfp_trainer.components.data.collate`);
* :mod:`.load` - an exported drafter loaded back; :mod:`.wrappers` - the drafter inside DDP / compile;
* :mod:`.stored` - a stored drafter's ``config.json`` read for every loader (export loading, ``init_from``),
  bounded by :mod:`.bounds` on the file's dict before anything is built from it.

* :mod:`.family` - the family registry (:class:`~.family.DrafterFamily`: one spec per family);
  :mod:`.families` - the families, one folder each: ``dflash`` (the backbone itself), ``dspark`` (plus a
  sequential Markov head and a confidence head, vLLM's method ``dspark``), ``dflash2`` (plus in-block grouped
  convolutions and a top-k candidate selector, vLLM's ``DFlash2DraftModel``), and
  :func:`~.families.build_drafter`.

Further drafter families go in :mod:`.families` as folders of their own sharing the backbone
(the draft layers of :mod:`.modeling_dflash`), the masks of :mod:`.attention` and the objective of
:mod:`.objective`, and register there in one line.

This is the lowest floor of the trainer: nothing here imports the training loop, the evaluation, the
export or the trainer's top-level modules.
"""

from . import families  # noqa: E402,F401  the families register before any config names one
