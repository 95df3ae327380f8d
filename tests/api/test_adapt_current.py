"""``dflash-pipeline adapt current``: what serving loads, resolved through the served store's pointer: the served
version's drafter directory, the ``--speculative-config`` vLLM takes for it, or a copy of it made for a pod."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dfp_adapt.served_store import ServedDrafters
from dfp_cli.main import cli
from dfp_shared.storage.store import open_store

from tests.shared.test_promotion import write_export


def export(uri: str, seed: int, block_size: int, architecture: str = "DFlashDraftModel",
           endpoint: str | None = None) -> None:
    write_export(uri, seed, endpoint)
    config = {"architectures": [architecture], "block_size": block_size,
              "dflash_config": {"block_size": block_size, "mask_token_id": 5, "target_layer_ids": [1]}}
    open_store(uri, endpoint_url=endpoint).put("config.json", json.dumps(config).encode())


def invoke(root: str, *args: str, endpoint: str | None = None):
    env = {"DFLASH_STORAGE_URL": root, "DFLASH_ADAPT_NAME": "qwen3", "DFLASH_LOG_JSON": "false"}
    if endpoint:
        env["DFLASH_S3_ENDPOINT_URL"] = endpoint
    return CliRunner().invoke(cli, ["adapt", "current", *args], env=env)


def test_current_prints_the_served_version_and_follows_a_rollback(tmp_path):
    root = f"file://{tmp_path}"
    export(f"{root}/c1", 1, 16)
    export(f"{root}/c2", 2, 8)
    served = ServedDrafters(f"{root}/served", "qwen3")
    out = invoke(root)
    assert out.exit_code == 1 and "nothing is served" in out.stderr
    served.promote(f"{root}/c1/", {})
    served.promote(f"{root}/c2/", {})
    out = invoke(root)
    assert out.exit_code == 0, out.stderr
    assert out.stdout == f"{tmp_path}/served/qwen3/versions/2\n"
    out = invoke(root, "--speculative-config")
    assert json.loads(out.stdout) == {"method": "dflash", "model": f"{tmp_path}/served/qwen3/versions/2",
                                      "num_speculative_tokens": 7}
    served.rollback()
    out = invoke(root, "--speculative-config", "--attention-backend", "FLASH_ATTN")
    assert json.loads(out.stdout) == {"method": "dflash", "model": f"{tmp_path}/served/qwen3/versions/1",
                                      "num_speculative_tokens": 15, "attention_backend": "FLASH_ATTN"}


def test_a_name_as_argument_and_a_dspark_drafter(tmp_path):
    root = f"file://{tmp_path}"
    export(f"{root}/c1", 1, 4, architecture="Qwen3DSparkModel")
    ServedDrafters(f"{root}/served", "other").promote(f"{root}/c1/", {})
    out = invoke(root, "other", "--speculative-config")
    assert out.exit_code == 0, out.stderr
    assert json.loads(out.stdout)["method"] == "dspark" and json.loads(out.stdout)["num_speculative_tokens"] == 3
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in out.stderr
    assert invoke(root, "../x").exit_code == 2


def test_a_copy_for_a_pod_from_s3(tmp_path, s3_server, s3_bucket):
    """On S3 the pod copies the served version down, whole, and serves the copy."""
    root, endpoint = s3_bucket, s3_server.endpoint_url
    export(f"{root}/c1", 1, 16, endpoint=endpoint)
    served = ServedDrafters(f"{root}/served", "qwen3", endpoint)
    served.promote(f"{root}/c1/", {})
    out = invoke(root, endpoint=endpoint)
    assert out.stdout == f"{root}/served/qwen3/versions/1\n"
    target = tmp_path / "drafter"
    out = invoke(root, "--download", str(target), "--speculative-config", endpoint=endpoint)
    assert out.exit_code == 0, out.stderr
    assert json.loads(out.stdout)["model"] == str(target)
    copied = {p.name: p.read_bytes() for p in target.iterdir()}
    assert copied == {k.rpartition("/")[2]: served.store.get(k) for k in served.store.list("versions/1/")}
    again = invoke(root, "--download", str(target), endpoint=endpoint)  # never a mix of two versions' files
    assert again.exit_code == 1 and "not empty" in again.stderr


@pytest.mark.parametrize("config, reason", [(b"{", "not JSON"), (b'{"block_size": 1}', "block_size"),
                                            (b'{"block_size": "16"}', "block_size"), (b"[]", "not a drafter")])
def test_a_served_config_that_is_no_drafter_s_is_refused_with_its_reason(tmp_path, config, reason):
    root = f"file://{tmp_path}"
    export(f"{root}/c1", 1, 16)
    open_store(f"{root}/c1").put("config.json", config)
    ServedDrafters(f"{root}/served", "qwen3").promote(f"{root}/c1/", {})
    out = invoke(root, "--speculative-config")
    assert out.exit_code == 1 and reason in out.stderr and not out.stdout


def test_what_the_store_holds_reaches_the_terminal_without_escapes(tmp_path):
    root = f"file://{tmp_path}"
    served = ServedDrafters(f"{root}/served", "qwen3")
    served.store.put("current.json", json.dumps({"version": "\x1b]0;x\x07\x1b[2J"}).encode())
    out = invoke(root)
    assert out.exit_code == 1 and "no version number" in out.stderr
    assert not any(c in out.stderr for c in "\x1b\x07"), repr(out.stderr)


def test_the_architectures_named_are_the_trainer_s():
    from dfp_adapt.cli import V2_RUNNER
    from dfp_trainer.drafter.families import dflash2, dspark

    assert V2_RUNNER == (dspark.ARCHITECTURE, dflash2.ARCHITECTURE)
