"""The learnable target: the standard-library corpus, its prompt sets, the folded-vocabulary loss,
and a deterministic build cached by content hash."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from dfp_dev.targets import learnable as lt
from dfp_dev.targets.stdlib_corpus import (
    held_out_prompts,
    module_functions,
    sample_prompts,
    stdlib_functions,
    train_prompts,
    write_prompt_set,
)
from dfp_shared.records.prompts import read_prompt_set

QUICK = lt.TrainSettings(steps=12, batch_tokens=1024, warmup_steps=3)


def test_folded_logsumexp_loss_is_the_full_vocabulary_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, n = 50, 8, 13
    used = torch.tensor([0, 3, 4, 9, 17, 18, 30, 41, 49])
    head = torch.zeros(vocab, hidden)
    head[used] = torch.randn(len(used), hidden, generator=gen)
    h = torch.randn(n, hidden, generator=gen)
    targets_u = torch.randint(0, len(used), (n,), generator=gen)
    full = F.cross_entropy(h @ head.T, used[targets_u], reduction="mean")
    folded = lt.folded_cross_entropy(h @ head[used].T, targets_u, vocab - len(used))
    assert torch.allclose(folded, full, atol=1e-6), (folded, full)
    # nothing outside U: the plain cross-entropy over U
    assert torch.allclose(lt.folded_cross_entropy(h @ head[used].T, targets_u, 0),
                          F.cross_entropy(h @ head[used].T, targets_u), atol=1e-6)


def test_functions_become_conversations():
    source = '''
class Box:
    """A box."""

    @property
    def size(self):
        """The size of the box.

        More words.
        """
        return 3

    def _undocumented(self):
        return 1


def top(x):
    "Return x."
    return x

def broken(:
'''
    assert module_functions(source, "m") == []  # unparsable: skipped
    records = module_functions(source.replace("def broken(:\n", ""), "pkg.m")
    assert [r.qualname for r in records] == ["Box.size", "top"]
    size = records[0]
    assert size.id == "pkg.m:Box.size" and size.summary == "The size of the box."
    assert size.source.startswith("@property\ndef size(self):\n") and size.source.endswith("return 3")
    assert size.request() == "Write the Python method `def size` of class `Box` in module `pkg.m`: The size of the box."
    assert records[1].request() == "Write the Python function `def top` of module `pkg.m`: Return x."
    assert size.messages()[1] == {"role": "assistant", "content": size.source}


def test_train_and_held_out_prompt_sets_are_disjoint_prompt_files(tmp_path):
    records = stdlib_functions()
    assert len(records) > 1000 and records == stdlib_functions()  # deterministic
    assert not any(".test." in r.module or r.module.startswith(("test.", "idlelib", "lib2to3")) for r in records)
    train, held = train_prompts(records), held_out_prompts(records)
    assert train and held and len(train) + len(held) == len(records)
    assert not {p["id"] for p in train} & {p["id"] for p in held}
    train_modules = {p["id"].split(":")[0] for p in train}
    assert not train_modules & {p["id"].split(":")[0] for p in held}  # split by module
    demo = sample_prompts(records, 32)
    assert len(demo) == 32 and demo == sample_prompts(records, 32) and all(p in train for p in demo)
    for name, prompts in (("train", train), ("held-out", held), ("demo", demo)):
        path = write_prompt_set(tmp_path / f"{name}.jsonl", prompts)
        read, errors = read_prompt_set(str(path))
        assert not errors and [p.id for p in read] == [p["id"] for p in prompts]
        assert all(p.messages == [{"role": "user", "content": p.messages[0]["content"]}] for p in read)


def test_the_build_is_deterministic_and_cached(tmp_path, qwen3_tokenizer_dir, monkeypatch):
    first = lt.build_learnable_target(tmp_path / "a", qwen3_tokenizer_dir, settings=QUICK, max_records=300)
    second = lt.build_learnable_target(tmp_path / "b", qwen3_tokenizer_dir, settings=QUICK, max_records=300)
    assert not first.hit and not second.hit
    assert first.path.name == second.path.name == f"learnable-qwen3-{first.info['hash'][:12]}"
    weights = sorted(p.name for p in first.path.glob("*.safetensors"))
    assert weights
    for name in weights:
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes()

    monkeypatch.setattr(lt, "train", lambda *a, **k: pytest.fail("a cache hit trained again"))
    again = lt.build_learnable_target(tmp_path / "a", qwen3_tokenizer_dir, settings=QUICK, max_records=300)
    assert again.hit and again.path == first.path and again.info == first.info
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.path.name]  # no temporary directory left

    info = json.loads((first.path / lt.INFO_FILE).read_text())
    assert info["records"] > 0 and info["train"]["steps"] == QUICK.steps and info["final_loss"] > 0
    config = json.loads((first.path / "config.json").read_text())
    assert config["head_dim"] == 32 and config["num_hidden_layers"] >= 6 and not config["tie_word_embeddings"]

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(first.path))
    assert config["vocab_size"] == len(tok) and "<|MASK|>" in tok.get_vocab()
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    state = {k: v for name in weights for k, v in load_file(str(first.path / name)).items()}
    head = state["lm_head.weight"]
    assert int((head.abs().sum(dim=1) != 0).sum()) == info["used_vocab"]  # rows outside U are exactly zero
    read, errors = read_prompt_set(str(first.train_prompts))
    assert not errors and read

    # the saved model's full-vocabulary loss is the folded loss over its non-zero head rows
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(first.path), dtype=torch.float32).eval()
    record = next(r for r in lt._stdlib_records(300) if r.id == read[0].id)
    prompt, answer = lt.render_texts(tok, record)
    p_ids, a_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, answer))
    assert a_ids[-1] == config["eos_token_id"]
    ids = torch.tensor([p_ids + a_ids])
    labels = ids.clone()
    labels[0, :len(p_ids)] = -100
    used = torch.nonzero(head.abs().sum(dim=1)).squeeze(1)
    index = torch.full((len(tok),), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    with torch.no_grad():
        full = model(input_ids=ids, labels=labels).loss
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(p_ids) - 1:-1]
        folded = lt.folded_cross_entropy(hidden @ head[used].T, index[torch.tensor(a_ids)], len(tok) - len(used))
    assert torch.allclose(full, folded, atol=1e-5), (full, folded)

    monkeypatch.undo()
    changed = lt.build_learnable_target(tmp_path / "a", qwen3_tokenizer_dir, max_records=300,
                                        settings=lt.TrainSettings(steps=1, batch_tokens=1024, warmup_steps=1))
    assert not changed.hit and changed.path != first.path  # other settings, other hash
