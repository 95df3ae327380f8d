"""Importing GGUF checkpoints: the same model out as in, under the storage roots and owners, bad files refused."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from dfp_shared.models.gguf_import import GGUFError, check_gguf, import_gguf
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.storage.ownership import OutputOwned
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import open_store
from dfp_shared.storage.uris import OutsideRoots

from tests.support.gguf_file import write_tiny_llama_gguf

PROMPT = [{"role": "user", "content": "Hello! The quick brown fox."}]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    model = write_tiny_llama_gguf(path)
    return path, model


def _logits(model, tokenizer):
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def test_import_gives_the_same_model_as_written(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    path, original = tiny_gguf
    roots = StorageRoots([f"file://{tmp_path}", f"file://{path.parent}"])
    keys = import_gguf(f"file://{path}", f"file://{tmp_path}/models/tiny", roots, "alice")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(keys)
    assert not any(k.endswith((".py", ".bin", ".pt")) for k in keys)
    out = tmp_path / "models" / "tiny"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    tokenizer = AutoTokenizer.from_pretrained(out)
    rendered = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nHello! The quick brown fox.<|im_end|>\n<|im_start|>assistant\n"
    imported = load_causal_lm(str(out), device="cpu")
    assert torch.equal(_logits(imported, tokenizer), _logits(original, tokenizer))


def test_import_on_s3_works_like_on_disk(tiny_gguf, s3_server, s3_bucket):
    path, original = tiny_gguf
    endpoint = s3_server.endpoint_url
    open_store(s3_bucket, endpoint_url=endpoint).put_file("incoming/tiny.gguf", path)
    roots = StorageRoots([s3_bucket])
    keys = import_gguf(f"{s3_bucket}/incoming/tiny.gguf", f"{s3_bucket}/models/tiny", roots, "alice",
                       endpoint_url=endpoint)
    assert "model.safetensors" in keys
    model = load_causal_lm(f"{s3_bucket}/models/tiny", device="cpu", endpoint_url=endpoint)
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_import_stays_inside_the_roots_and_owners(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    roots = StorageRoots([f"file://{tmp_path}"])
    with pytest.raises(OutsideRoots, match="source"):  # the GGUF file lies outside the roots
        import_gguf(f"file://{path}", f"file://{tmp_path}/models/a", roots, "alice")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.gguf").write_bytes(path.read_bytes())
    with pytest.raises(OutsideRoots, match="output"):
        import_gguf(f"file://{tmp_path}/in/t.gguf", "file:///etc/models", roots, "alice")
    import_gguf(f"file://{tmp_path}/in/t.gguf", f"file://{tmp_path}/models/a", roots, "alice")
    with pytest.raises(OutputOwned, match="alice"):  # bob cannot replace alice's model
        import_gguf(f"file://{tmp_path}/in/t.gguf", f"file://{tmp_path}/models/a", roots, "bob")


def test_bad_files_are_refused_with_the_reason(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = path.read_bytes()
    with pytest.raises(GGUFError, match="over the import limit"):
        check_gguf(path, max_bytes=len(data) - 1)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:100])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        check_gguf(not_gguf)
    huge_counts = tmp_path / "counts.gguf"
    huge_counts.write_bytes(data[:8] + (10**12).to_bytes(8, "little") + data[16:])
    with pytest.raises(GGUFError, match="header claims"):
        check_gguf(huge_counts)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:200])
    with pytest.raises(GGUFError, match="malformed GGUF"):
        check_gguf(truncated)
    version = tmp_path / "version.gguf"
    version.write_bytes(data[:4] + (99).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFError, match="version 99"):
        check_gguf(version)


def test_metadata_describing_more_weights_than_the_file_holds_is_refused(tmp_path):
    """A file of a few hundred kilobytes whose metadata states a 64-layer model of hidden size 8,192 is refused
    from its metadata, before transformers allocates that model."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "liar.gguf"
    write_tiny_llama_gguf(path, claimed_shape=(8192, 64))
    roots = StorageRoots([f"file://{tmp_path}"])
    with pytest.raises(GGUFError, match=r"liar.gguf: its metadata describes [0-9,]+ parameters, more than"):
        import_gguf(f"file://{path}", f"file://{tmp_path}/models/liar", roots, "alice")
    assert list((tmp_path / "models" / "liar").iterdir()) == [tmp_path / "models" / "liar" / ".dflash-owner.json"]


def test_files_beside_a_local_gguf_are_never_read(tiny_gguf, tmp_path):
    """transformers reads tokenizer and template files beside a GGUF (following links): a link planted there to
    a file outside the roots, or a planted template, must not reach the imported model."""
    from transformers import AutoTokenizer

    path, _ = tiny_gguf
    secret = tmp_path / "outside" / "token"
    secret.parent.mkdir()
    secret.write_text("SECRET-TOKEN-123")
    src = tmp_path / "store" / "in"
    (src / "additional_chat_templates").mkdir(parents=True)
    (src / "t.gguf").write_bytes(path.read_bytes())
    (src / "additional_chat_templates" / "leak.jinja").symlink_to(secret)
    (src / "chat_template.jinja").write_text("{{ 'PLANTED' }}")
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'PLANTED' }}"}))
    roots = StorageRoots([f"file://{tmp_path}/store"])
    import_gguf(f"file://{src}/t.gguf", f"file://{tmp_path}/store/models/t", roots, "alice")
    written = "".join(f.read_text(errors="replace") for f in (tmp_path / "store" / "models" / "t").rglob("*")
                      if f.is_file())
    assert "SECRET-TOKEN-123" not in written and "PLANTED" not in written
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "store" / "models" / "t")  # the file's own template
    assert tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False).startswith("<|im_start|>")


def test_an_architecture_without_a_builtin_model_is_refused(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "notanarch")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'notanarch' has no built-in transformers model"):
        check_gguf(path)


def test_cli_imports_and_names_a_bad_file(tiny_gguf, tmp_path, monkeypatch):
    from dfp_cli.main import cli

    path, _ = tiny_gguf
    (tmp_path / "t.gguf").write_bytes(path.read_bytes())
    monkeypatch.setenv("DFLASH_STORAGE_URL", f"file://{tmp_path}")
    runner = CliRunner()
    ok = runner.invoke(cli, ["models", "import-gguf", "--source", f"file://{tmp_path}/t.gguf", "--output",
                             f"file://{tmp_path}/m"])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "m" / "model.safetensors").is_file()
    small = runner.invoke(cli, ["models", "import-gguf", "--gguf-max-bytes", "1000", "--source",
                                f"file://{tmp_path}/t.gguf", "--output", f"file://{tmp_path}/m2"])
    assert small.exit_code != 0 and "over the import limit" in small.output
