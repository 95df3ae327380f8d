"""The family registry: a family registered only in its own place (here, a test-only family declared in this
file: DFlash with a trivial extra, a learned scale of the hidden states the LM head reads) is built, trained, exported and loaded
back by the trainer's own code with no other change; and the shared spec's family table
(:mod:`dfp_shared.specs.families`) names the registry's families."""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch
from dfp_shared.specs.families import FAMILY_FIELDS
from dfp_shared.specs.train import DrafterFamily as SpecFamily
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families import FAMILIES, build_drafter
from dfp_trainer.drafter.family import DrafterFamily, register
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.export.serving import serving_commands
from dfp_trainer.export.zlab import export_drafter
from torch import nn

from tests.trainer.drafter.test_dspark import train_on_chains
from tests.trainer.drafter_support import small_config


class ScaledDrafter(DFlashDrafter):
    """DFlash with one more parameter: a learned scale of the hidden states the LM head reads."""

    def __init__(self, config, embed_tokens, lm_head, draft_ids=None) -> None:
        super().__init__(config, embed_tokens, lm_head, draft_ids)
        self.hidden_scale = nn.Parameter(torch.ones(()))

    def logits(self, hidden):
        return super().logits(hidden * self.hidden_scale)

    def head_loss(self, hidden, labels, prev_ids):
        return super().head_loss(hidden * self.hidden_scale, labels, prev_ids)


TOY = DrafterFamily(name="toy-scaled", module=ScaledDrafter, architecture="ToyScaledDraftModel",
                    serving_method="dflash", config_json=lambda config: ({"toy_scaled": True}, {}),
                    read_config=lambda data, dflash, source: {})


@pytest.fixture
def toy_family():
    register(TOY)
    yield TOY
    del FAMILIES[TOY.name]


def test_a_family_registered_in_its_own_place_is_trained_exported_and_reloaded(toy_family, tmp_path):
    torch.manual_seed(0)
    config = small_config(hidden_size=32, family="toy-scaled")
    drafter = build_drafter(config, nn.Embedding(100, 32), nn.Linear(32, 100, bias=False))
    assert type(drafter) is ScaledDrafter
    history = train_on_chains(drafter, 20)
    assert history[-1]["loss"] < history[0]["loss"]
    assert float(drafter.hidden_scale.detach()) != 1.0  # the family's own part was trained
    out = export_drafter(drafter, tmp_path / "drafter")
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["ToyScaledDraftModel"] and data["toy_scaled"] is True
    assert not (out / "modeling_dflash.py").exists()  # not DFlash's reference route
    loaded = load_exported(out, drafter.embed_tokens, drafter.lm_head)
    assert type(loaded) is ScaledDrafter and loaded.config.family == "toy-scaled"
    assert torch.equal(loaded.hidden_scale.detach(), drafter.hidden_scale.detach())
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in serving_commands(loaded.config, "/t", str(out))["vllm"]


def test_the_family_is_stored_not_guessed_and_old_configs_read_as_before():
    assert small_config().family == "dflash"
    assert small_config(markov_rank=4).family == "dspark"  # a config built without a family: its fields tell
    with pytest.raises(ValueError, match="not both"):
        small_config(family="dflash", markov_rank=4)
    with pytest.raises(ValueError, match="unknown drafter family"):
        small_config(family="medusa")
    stored = small_config(markov_rank=4).to_config_dict()
    assert "family" not in stored and DrafterConfig.from_config_dict(stored).family == "dspark"


def test_the_spec_family_table_names_the_registered_families_and_their_fields():
    assert list(FAMILY_FIELDS) == list(get_args(SpecFamily)) == [name for name in FAMILIES if name != TOY.name]
    for name, fields in FAMILY_FIELDS.items():
        # the spec's family fields are the config's, but for the loss recipe's (DSpark's confidence weight)
        assert set(FAMILIES[name].config_fields) <= set(fields.fields)
        assert set(fields.fields) - set(FAMILIES[name].config_fields) <= {"confidence_loss_weight"}
        assert ("speculators" in fields.layouts) == FAMILIES[name].reference_route
