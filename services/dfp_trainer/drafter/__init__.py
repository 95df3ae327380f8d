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
  speak, :func:`~.batch.collate` and :func:`~.batch.fetch_hidden`;
* :mod:`.load` - an exported drafter loaded back; :mod:`.wrappers` - the drafter inside DDP / compile.

* :mod:`.dspark` - :class:`~.dspark.DSparkDrafter`, the DFlash drafter plus a sequential Markov head and a
  confidence head (vLLM's method ``dspark``); :mod:`.dflash2` - :class:`~.dflash2.DFlash2Drafter`, the DFlash
  drafter plus in-block grouped convolutions and a top-k candidate selector (vLLM's ``DFlash2DraftModel``);
  :mod:`.families` - the module of each family (:func:`~.families.build_drafter`).

Further drafter families go here as small modules of their own sharing the backbone
(the draft layers of :mod:`.modeling_dflash`), the masks of :mod:`.attention` and the objective of
:mod:`.objective`.

This is the lowest floor of the trainer: nothing here imports the training loop, the evaluation, the
export or the trainer's top-level modules.
"""
