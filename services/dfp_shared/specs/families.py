"""What a train spec says of each drafter family: the spec fields only that family has, the export layouts
vLLM reads it from, and its further checks. One row per family; the trainer's family registry
(``dfp_trainer/drafter/families/``) declares the rest (module, drafter config, export, serving), and a test checks
that the two name the same families with the same fields. A family trainable from a job spec adds its name to
:data:`~.train.DrafterFamily` and its row here; the shared package cannot import the trainer, so the row is the
spec's whole view of a family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LAYOUTS = ("zlab", "speculators")  # the order the export layouts are written in (see ExportLayout)

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The spec fields of a DFlash2 drafter, named as vLLM reads them from ``dflash_config``."""


@dataclass(frozen=True)
class FamilyFields:
    """A drafter family as a train spec sees it."""

    fields: tuple[str, ...] = ()  # spec fields only this family has (others must leave them at their default)
    heads: str = ""  # what those fields shape, for the error naming them: "only `<family>` drafters have <heads>"
    layouts: tuple[str, ...] = LAYOUTS  # export layouts vLLM reads this family from
    check: Callable[[Any], None] | None = None  # further checks of a spec of this family (ValueError)


def _dflash2_check(spec: Any) -> None:
    if spec.conv_kernel_size > spec.block_size:
        raise ValueError(f"conv_kernel_size {spec.conv_kernel_size} is more taps than a block has tokens "
                         f"(block_size {spec.block_size})")
    if spec.draft_vocab_size is not None:
        raise ValueError("draft_vocab_size with family 'dflash2': vLLM's DFlash2 drafts its LM head's row ids "
                         "without mapping them to target ids, so a pruned vocabulary would be served wrongly")


FAMILY_FIELDS: dict[str, FamilyFields] = {
    "dflash": FamilyFields(),
    "dspark": FamilyFields(("markov_rank", "confidence_head", "confidence_loss_weight"),
                           "a Markov or confidence head", ("zlab",)),
    "dflash2": FamilyFields(DFLASH2_FIELDS, "convolutions and a candidate selector", ("zlab",), _dflash2_check),
}
