"""The trained drafter in the layouts serving engines load: :mod:`.zlab` (the DFlash reference's, with the
modeling file beside it), :mod:`.speculators` (vLLM's), their common files (:mod:`.files`), and the serving
command lines for an export (:mod:`.serving`). Reading an export back is :mod:`dfp_trainer.drafter.load`.

Above :mod:`dfp_trainer.drafter` only.
"""
