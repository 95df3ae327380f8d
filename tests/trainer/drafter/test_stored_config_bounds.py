"""A stored drafter's config.json written as an attack: every field that sizes something out of its bound (a
1 KB file stating 200000000 draft layers and no layer_types, lists of 100000 entries, widths and family sizes
beyond a train spec's) is refused naming the file, the field, its value and the bound, on the dict read from
the file, before the config object or any list is built; the memory the refusal takes is measured (and the
address space held, so a regression fails here instead of taking the machine's memory). A valid config of
each family still loads, and each loader (export loading, init_from's warm start, both layouts) refuses it."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import tracemalloc
from pathlib import Path

import pytest
import torch
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.stored import read_drafter_config
from dfp_trainer.drafter.warm_start import warm_start
from torch import nn

from tests.trainer.drafter_support import small_config, small_drafter

ATTACK_LAYERS = 200_000_000
FEW_MB = 4 << 20
FAMILY_FIELDS = {"dflash": {}, "dspark": {"markov_rank": 4, "confidence_head": True},
                 "dflash2": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}}


@contextlib.contextmanager
def bounded_memory(extra: int = 256 << 20):
    """Trace Python's allocations (the peak is the yielded list's one entry, set on exit) with the address space
    held to what is mapped now plus ``extra``: building a list of 200000000 entries fails with MemoryError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    peak = [0]
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# each family's valid config.json (written before any test makes DrafterConfig unbuildable)
CONFIGS = {family: json.dumps(small_config(family=family, **fields).to_config_dict())
           for family, fields in FAMILY_FIELDS.items()}


def config_dict(family: str = "dflash") -> dict:
    return json.loads(CONFIGS[family])


def write(directory: Path, data: dict | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(data if isinstance(data, str) else json.dumps(data))
    return directory


def attack(directory: Path) -> Path:
    """The 1 KB drafter config of 200000000 draft layers with no layer list (a valid one otherwise)."""
    data = config_dict()
    del data["layer_types"], data["max_window_layers"]
    write(directory, {**data, "num_hidden_layers": ATTACK_LAYERS})
    assert (directory / "config.json").stat().st_size < 1200
    return directory


def refused_promptly(call, *fragments: str) -> str:
    """``call()`` raises ValueError naming every fragment, taking under a few MB to do so."""
    with bounded_memory() as peak, pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert peak[0] < FEW_MB, f"refusing took {peak[0]:,} bytes"
    return message


@pytest.fixture
def nothing_built(monkeypatch):
    """A DrafterConfig made at all fails the test: the refusal must come from the raw config."""
    def built(self):
        raise AssertionError("a DrafterConfig was built from a config that is out of bounds")
    monkeypatch.setattr(DrafterConfig, "__post_init__", built)


def test_a_1kb_config_of_200000000_layers_is_refused_without_allocating(tmp_path):
    directory = attack(tmp_path / "attack")
    refused_promptly(lambda: read_drafter_config(directory, "missing"), f"{directory}/config.json: ",
                     f"num_hidden_layers must be 1..64, got {ATTACK_LAYERS}")


def test_a_config_object_of_200000000_layers_builds_no_layer_list():
    refused_promptly(lambda: small_config(num_hidden_layers=ATTACK_LAYERS),
                     f"num_hidden_layers must be 1..64, got {ATTACK_LAYERS}")
    ids = list(range(1_000_000))
    refused_promptly(lambda: small_config(target_layer_ids=ids), "target_layer_ids has 1,000,000 entries",
                     "the limit of 64")


def _set(data: dict, path: str, value) -> dict:
    where, _, name = path.rpartition(".")
    (data[where] if where else data)[name] = value
    return data


LONG = 1000  # a per-layer list far longer than its bound (the file stays small: parsing it takes little)
OVER = [  # family, field (dflash_config.<name> for one of dflash_config), value, what the refusal says
    ("dflash", "num_hidden_layers", 65, "num_hidden_layers must be 1..64, got 65"),
    ("dflash", "num_hidden_layers", True, "num_hidden_layers must be 1..64, got True"),
    ("dflash", "layer_types", ["full_attention"] * LONG, "layer_types has 1,000 entries, more than the limit of 64"),
    ("dflash", "layer_types", ["full_attention"] * 3, "layer_types has 3 entries for 2 layers"),
    ("dflash", "layer_types", ["full_attention", "linear_attention"], "unknown layer_types ['linear_attention']"),
    ("dflash", "layer_types", ["full_attention", {"a": 1}], "unknown layer_types [{'a': 1}]"),
    ("dflash", "layer_types", "full_attention", "layer_types must be a list, got 'full_attention'"),
    ("dflash", "num_attention_heads", 4096, "num_attention_heads 4096 is outside 1..1,024"),
    ("dflash", "num_key_value_heads", 8, "num_key_value_heads 8 is outside 1..4 (the limit: num_attention_heads = 4)"),
    ("dflash", "head_dim", 1 << 20, "head_dim 1048576 is outside 1..1,024"),
    ("dflash", "hidden_size", 1 << 20, "hidden_size 1048576 is outside 1..65,536"),
    ("dflash", "hidden_size", "32", "hidden_size '32' is outside 1..65,536"),
    ("dflash", "hidden_size", 32.0, "hidden_size 32.0 is outside"),
    ("dflash", "intermediate_size", 4_000_000,
     "intermediate_size 4000000 is outside 1..512 (the limit: 16 x hidden_size = 512)"),
    ("dflash", "vocab_size", 1 << 30, "vocab_size 1073741824 is outside 1..1,048,576"),
    ("dflash", "draft_vocab_size", 1 << 30, "draft_vocab_size 1073741824 is outside 1..100 (the limit: vocab_size"),
    ("dflash", "max_position_embeddings", 1 << 40, "max_position_embeddings 1099511627776 is outside 1..16,777,216"),
    ("dflash", "num_target_layers", 10 ** 9, "num_target_layers 1000000000 is outside 1..1,024"),
    ("dflash", "sliding_window", 1 << 40, "sliding_window 1099511627776 is outside 1..1,048,576"),
    ("dflash", "block_size", 10 ** 6, "block_size must be 2..64 (anchor + at least one draft), got 1000000"),
    ("dflash", "dflash_config.block_size", 10 ** 6, "dflash_config.block_size must be 2..64"),
    ("dflash", "dflash_config.target_layer_ids", list(range(LONG)),
     "target_layer_ids has 1,000 entries, more than the limit of 64"),
    ("dflash", "dflash_config.target_layer_ids", [1, 5000],
     "target_layer_ids [5000] do not exist in a target with 8 layers (valid ids: 0..7)"),
    ("dflash", "dflash_config.target_layer_ids", [1, "2"], "target_layer_ids ['2'] are not layer ids"),
    ("dflash", "dflash_config", [1, 2], "field dflash_config must be an object, got [1, 2]"),
    ("dflash", "dflash_config.mask_token_id", 1 << 40, "dflash_config.mask_token_id 1099511627776 is outside 0..99"),
    ("dspark", "markov_rank", 1 << 20, "markov_rank must be 1..1024, got 1048576"),
    ("dflash2", "dflash_config.conv_kernel_size", 10 ** 6, "dflash_config.conv_kernel_size must be 1..64, got 1000000"),
    ("dflash2", "dflash_config.conv_group_size", 1 << 20, "dflash_config.conv_group_size must be 1..65536, got"),
    ("dflash2", "dflash_config.selector_rank", 1 << 20, "dflash_config.selector_rank must be 1..1024, got 1048576"),
    ("dflash2", "dflash_config.selector_top_k", 10 ** 6, "dflash_config.selector_top_k must be 1..256, got 1000000"),
]


@pytest.mark.parametrize("family, field, value, says", OVER, ids=[f"{f}-{n}-{i}" for i, (f, n, *_) in enumerate(OVER)])
def test_each_bounded_field_over_its_bound_is_refused_by_name(family, field, value, says, tmp_path, nothing_built):
    directory = write(tmp_path / "over", _set(config_dict(family), field, value))
    refused_promptly(lambda: read_drafter_config(directory, "missing"), f"{directory}/config.json: {says}")


def test_a_field_of_the_wrong_kind_is_refused_naming_the_file(tmp_path):
    directory = write(tmp_path / "kind", {**config_dict(), "rms_norm_eps": [1e-6]})
    with pytest.raises(ValueError, match=f"{directory}/config.json: not a drafter config this loader reads "
                                         r"\(TypeError"):
        read_drafter_config(directory, "missing")


def test_a_config_file_too_long_or_too_deep_is_refused_before_it_is_parsed(tmp_path, nothing_built):
    padded = json.dumps(config_dict()) + " " * (4 << 20)
    long = write(tmp_path / "long", padded)
    refused_promptly(lambda: read_drafter_config(long, "missing"), f"{long}/config.json: longer than 4,194,304 bytes")
    deep = write(tmp_path / "deep", "[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=f"{deep}/config.json: not a JSON file this reader takes"):
        read_drafter_config(deep, "missing")


@pytest.mark.parametrize("family", sorted(FAMILY_FIELDS))
def test_a_valid_config_of_each_family_still_loads(family, tmp_path):
    config = small_config(family=family, **FAMILY_FIELDS[family])
    directory = write(tmp_path / family, config.to_config_dict())
    assert read_drafter_config(directory, "missing") == (config, "zlab")


class _Dims:  # the small config's embedding (a DrafterConfig cannot be built while nothing_built holds)
    vocab_size, hidden_size = 100, 32


def _embedding(config):
    return nn.Embedding(config.vocab_size, config.hidden_size), nn.Linear(config.hidden_size, config.vocab_size)


def test_export_loading_refuses_the_attack(tmp_path, nothing_built):
    directory = attack(tmp_path / "attack")
    (directory / "model.safetensors").write_bytes(b"")
    embed, head = _embedding(_Dims)
    refused_promptly(lambda: load_exported(directory, embed, head), f"{directory}/config.json: ",
                     f"num_hidden_layers must be 1..64, got {ATTACK_LAYERS}")


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_warm_start_refuses_the_attack_in_either_layout(layout, tmp_path):
    drafter = small_drafter()
    directory = attack(tmp_path / "attack")
    if layout == "speculators":
        zlab = json.loads((directory / "config.json").read_text())
        write(directory, {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
                          "transformer_layer_config": {k: v for k, v in zlab.items() if k != "dflash_config"},
                          "aux_hidden_state_layer_ids": [2, 5], "mask_token_id": 99, "block_size": 4})
    with torch.no_grad():
        refused_promptly(lambda: warm_start(drafter, directory), f"{directory}/config.json: ",
                         f"num_hidden_layers must be 1..64, got {ATTACK_LAYERS}")


def test_warm_start_refuses_a_speculators_layer_list_before_rewriting_it(tmp_path):
    drafter = small_drafter()
    data = drafter.config.to_config_dict()
    directory = write(tmp_path / "aux", {"speculators_model_type": "dflash", "transformer_layer_config": data,
                                         "aux_hidden_state_layer_ids": list(range(LONG)), "mask_token_id": 99,
                                         "block_size": 4})
    refused_promptly(lambda: warm_start(drafter, directory), f"{directory}/config.json: aux_hidden_state_layer_ids "
                     "has 1,000 entries, more than the limit of 64")


def test_export_loading_takes_no_speculators_layout(tmp_path):
    directory = write(tmp_path / "spec", {"speculators_model_type": "dflash"})
    embed, head = _embedding(_Dims)
    with pytest.raises(ValueError, match="a drafter in the speculators layout; this loader reads zlab"):
        load_exported(directory, embed, head)
