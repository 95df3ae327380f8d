"""The cached environments (vLLM's, the peer trainer's): installed once, found by their stamp, an install that
failed part-way removed and done again, its failure naming the step."""

from __future__ import annotations

import pytest
from dfp_dev import cached_env


def test_an_environment_is_installed_once_and_a_failed_install_is_redone(tmp_path):
    root, calls = tmp_path / "tool-abc123", []

    def failing(python, run):
        calls.append("failing")
        (root / "half-written").write_text("x")
        run([str(python), "-c", "raise SystemExit(3)"], "installing the tool")

    with pytest.raises(cached_env.EnvInstallError, match=r"installing the tool failed \(exit 3\).*install\.log"):
        cached_env.ensure(root, failing, "tool==1", what="tool", echo=lambda _: None)
    assert cached_env.ready_python(root) is None and (root / "half-written").exists()

    def working(python, run):
        calls.append("working")
        run([str(python), "-c", "print('ok')"], "checking the interpreter")

    python = cached_env.ensure(root, working, "tool==1", what="tool", echo=lambda _: None)
    assert python == root / "bin" / "python" and cached_env.ready_python(root) == python
    assert not (root / "half-written").exists()  # the unfinished install was removed first
    assert (root / cached_env.STAMP).read_text().startswith("tool==1\n")
    assert "$ " + str(python) in (tmp_path / "tool-abc123.install.log").read_text()
    assert cached_env.ensure(root, working, "tool==1", what="tool", echo=lambda _: None) == python
    assert calls == ["failing", "working"]  # found by its stamp: not installed again
