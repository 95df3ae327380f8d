"""DFlash: the backbone itself (:class:`~dfp_trainer.drafter.model.DFlashDrafter`), exported with the
self-contained modeling file (``auto_map``: transformers' ``AutoModel``), served by vLLM (method ``dflash``, V1 or
V2 runner) and SGLang, in the z-lab and the speculators layouts."""

from __future__ import annotations

from ...config import ARCHITECTURE
from ...family import DrafterFamily
from ...model import DFlashDrafter

AUTO_MODEL = "modeling_dflash.DFlashDraftModel"  # the modeling file's class, for AutoModel with trust_remote_code


def _config_json(config) -> tuple[dict, dict]:
    return {"auto_map": {"AutoModel": AUTO_MODEL}}, {}


FAMILY = DrafterFamily(name="dflash", module=DFlashDrafter, architecture=ARCHITECTURE, serving_method="dflash",
                       config_json=_config_json, reference_route=True)
