"""Storage confinement and output ownership: the URIs a job may name, and whose prefixes it may write."""

from __future__ import annotations

import json
import os

import pytest
from dfp_shared.storage.ownership import MARKER, OutputClaims, OutputOwned
from dfp_shared.storage.roots import OutsideRoots, StorageRoots
from dfp_shared.storage.store import AccessRefused, LocalStore, open_store, split_uri
from dfp_shared.storage.uris import canonical_uri


@pytest.mark.parametrize("bad", [
    "", "file:/etc/passwd", "file://host/etc/passwd", "file://./rel", "relative/path", "s3://bkt/a\x00b",
    "s3://bucket/a/%2e%2e/b", "s3://bucket/a/%2E%2e/b", "file:///data/%2f/x", "s3://bucket/a\\..\\b",
    "s3://bucket/a/../b", "file:///a/./b", "s3://bucket/a//b", "s3://user@bucket/x", "s3://bucket:9000/x",
    "s3://Bucket/x", "http://169.254.169.254/latest", "gs://bucket/x", "s3://bucket/x?versionId=1",
    "file:////etc/passwd", "//etc/passwd", "s3://bucket/a\u202e/b", "s3://bucket/a\u200b/b", "/data/a\u2028b",
    "s3://bucket/a\x85b",
])
def test_non_canonical_uris_are_refused(bad):
    with pytest.raises(OutsideRoots):
        canonical_uri(bad)


def test_canonical_forms():
    assert canonical_uri("/data/x/") == "file:///data/x/"
    assert canonical_uri("file:///data/x") == "file:///data/x"
    assert canonical_uri("s3://bucket/a/b.jsonl") == "s3://bucket/a/b.jsonl"
    assert canonical_uri("s3://bucket") == "s3://bucket"


def test_containment_is_by_whole_segments(tmp_path):
    roots = StorageRoots([f"file://{tmp_path}/root", "s3://shared/team-a"])
    assert roots.check(f"{tmp_path}/root/x.jsonl", "spec.input") == f"file://{tmp_path}/root/x.jsonl"
    assert roots.check("s3://shared/team-a/in/", "spec.input") == "s3://shared/team-a/in/"
    for outside in (f"file://{tmp_path}/root-other/x", f"file://{tmp_path}/other", "s3://shared/team-ab/x",
                    "s3://other-bucket/team-a/x", "s3://shared/team-b/x"):
        with pytest.raises(OutsideRoots, match=r"spec\.input: .* is outside the allowed storage"):
            roots.check(outside, "spec.input")


def test_a_symlink_out_of_the_root_is_outside(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "data.jsonl").write_text('{"messages": []}\n')
    os.symlink(tmp_path / "secret", tmp_path / "root" / "link")
    os.symlink(tmp_path / "secret" / "data.jsonl", tmp_path / "root" / "data.jsonl")
    roots = StorageRoots([f"file://{tmp_path}/root"])
    for uri in (f"file://{tmp_path}/root/link/", f"file://{tmp_path}/root/link/data.jsonl",
                f"file://{tmp_path}/root/data.jsonl"):
        with pytest.raises(OutsideRoots):
            roots.check(uri, "spec.input")


def test_local_store_never_follows_a_symlink_out(tmp_path):
    (tmp_path / "root" / "in").mkdir(parents=True)
    (tmp_path / "secret.jsonl").write_text("secret\n")
    (tmp_path / "root" / "in" / "ok.jsonl").write_text("ok\n")
    os.symlink(tmp_path / "secret.jsonl", tmp_path / "root" / "in" / "leak.jsonl")
    store = LocalStore(tmp_path / "root")
    assert list(store.list("in/")) == ["in/ok.jsonl"]  # listing skips the link
    with pytest.raises(AccessRefused):
        store.get("in/leak.jsonl")
    with pytest.raises(AccessRefused):
        store.put("in/leak.jsonl", b"overwrite")
    assert (tmp_path / "secret.jsonl").read_text() == "secret\n"
    # a file URI is split as written: the store that holds the link refuses it
    root, key = split_uri(f"file://{tmp_path}/root/in/leak.jsonl")
    with pytest.raises(AccessRefused):
        open_store(root).get(key)


@pytest.fixture(params=["file", "s3"])
def claims(request, tmp_path):
    if request.param == "file":
        root = f"file://{tmp_path}/root"
        return OutputClaims(StorageRoots([root])), root, None
    bucket = request.getfixturevalue("s3_bucket")
    server = request.getfixturevalue("s3_server")
    return OutputClaims(StorageRoots([f"{bucket}/root"]), server.endpoint_url), f"{bucket}/root", server.endpoint_url


def test_an_output_prefix_belongs_to_its_first_writer(claims):
    claim, root, endpoint = claims
    claim.claim(f"{root}/runs/a/", "alice", "job1")
    claim.claim(f"{root}/runs/a/", "alice", "job2")  # the same principal may write (resume) there again
    marker = json.loads(open_store(f"{root}/runs/a", endpoint_url=endpoint).get(MARKER))
    assert marker["owner"] == "alice" and marker["job_id"] == "job1"
    other = OutputClaims(claim.roots, endpoint)  # another worker process: nothing cached
    with pytest.raises(OutputOwned, match="belongs to 'alice'"):
        other.claim(f"{root}/runs/a/", "bob", "job3")
    with pytest.raises(OutputOwned, match="inside .* which belongs to 'alice'"):
        other.claim(f"{root}/runs/a/checkpoints/", "bob", "job3")


def test_data_no_job_wrote_and_the_root_itself_are_refused(claims):
    claim, root, endpoint = claims
    open_store(f"{root}/datasets/public", endpoint_url=endpoint).put("manifest.json", b"{}")
    with pytest.raises(OutputOwned, match="already holds data"):
        claim.claim(f"{root}/datasets/public/", "bob", "job1")
    with pytest.raises(OutputOwned, match="storage root"):
        claim.claim(root, "bob", "job1")


def test_of_two_racing_claims_one_wins(tmp_path):
    roots = StorageRoots([f"file://{tmp_path}"])
    store = open_store(f"file://{tmp_path}/new")
    assert store.put_if_absent(MARKER, b'{"owner": "alice"}')
    assert not store.put_if_absent(MARKER, b'{"owner": "bob"}')
    with pytest.raises(OutputOwned):
        OutputClaims(roots).claim(f"file://{tmp_path}/new/", "bob", "j")


def test_s3_conditional_create(s3_bucket, s3_server):
    store = open_store(f"{s3_bucket}/p", endpoint_url=s3_server.endpoint_url)
    assert store.put_if_absent("k", b"first")
    assert not store.put_if_absent("k", b"second")
    assert store.get("k") == b"first"


def test_the_per_job_area_and_every_root_are_unclaimable(tmp_path):
    roots = StorageRoots([f"file://{tmp_path}/data", f"file://{tmp_path}/data/shared"])
    claims = OutputClaims(roots)
    for prefix in (f"file://{tmp_path}/data/jobs/", f"file://{tmp_path}/data/jobs/someone-elses-id/",
                   f"file://{tmp_path}/data/jobs/x/y/z/"):
        with pytest.raises(OutputOwned, match="reserved"):
            claims.claim(prefix, "mallory", "j-mallory")
    with pytest.raises(OutputOwned, match="storage root"):
        claims.claim(f"file://{tmp_path}/data/shared/", "mallory", "j-mallory")
    claims.claim(roots.job_prefix("j-alice"), "alice", "j-alice")  # a job's own per-job prefix
    claims.claim(roots.job_prefix("p1", "train"), "alice", "j-stage", parent_id="p1")  # a pipeline stage's
    with pytest.raises(OutsideRoots, match="reserved"):
        from dfp_shared.jobs.submit import with_default_outputs

        with_default_outputs("tokenize", {"output": f"file://{tmp_path}/data/jobs/"}, roots, "j")


def test_a_prefix_above_another_principals_output_is_not_new(tmp_path):
    claims = OutputClaims(StorageRoots([f"file://{tmp_path}"]))
    claims.claim(f"file://{tmp_path}/team/runs/qwen/", "alice", "j1")  # only a marker so far
    with pytest.raises(OutputOwned, match="already holds data"):
        OutputClaims(claims.roots).claim(f"file://{tmp_path}/team/", "mallory", "j2")


def test_a_symlink_inside_the_root_does_not_dodge_the_owner_walk(tmp_path):
    claims = OutputClaims(StorageRoots([f"file://{tmp_path}"]))
    claims.claim(f"file://{tmp_path}/alice/", "alice", "j1")
    (tmp_path / "alice" / "sub").mkdir()
    os.symlink(tmp_path / "alice" / "sub", tmp_path / "mine")
    with pytest.raises(OutputOwned, match="belongs to 'alice'"):
        OutputClaims(claims.roots).claim(f"file://{tmp_path}/mine/", "mallory", "j2")
    assert not (tmp_path / "alice" / "sub" / MARKER).exists()


def test_model_and_tokenizer_directories_with_links_out_are_not_read(tmp_path):
    from dfp_shared.models.loading import local_model_dir
    from dfp_shared.storage.store import local_dir_confined

    (tmp_path / "outside.txt").write_text("TOP SECRET")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    os.symlink(tmp_path / "outside.txt", tmp_path / "tok" / "chat_template.jinja")
    with pytest.raises(AccessRefused, match="chat_template.jinja links out"):
        local_dir_confined(tmp_path / "tok", f"file://{tmp_path}/tok")
    with pytest.raises(AccessRefused, match="links out"):
        local_model_dir(f"file://{tmp_path}/tok")
    os.unlink(tmp_path / "tok" / "chat_template.jinja")
    os.mkfifo(tmp_path / "tok" / "tokenizer.json")
    with pytest.raises(AccessRefused, match="not a regular file"):
        local_dir_confined(tmp_path / "tok", "tok")
    os.unlink(tmp_path / "tok" / "tokenizer.json")
    assert local_dir_confined(tmp_path / "tok", "tok") == tmp_path / "tok"
