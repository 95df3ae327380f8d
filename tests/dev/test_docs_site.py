"""The docs site builds strictly (a broken link, a missing page or anchor fails it), its REST API reference is
what the app's own OpenAPI document gives, and the README stays a short front page whose links all land."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dfp_dev.api_reference import api_reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_README_LINES = 300


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api-reference" / "index.html").is_file()
    assert (tmp_path / "site" / "services" / "trainer" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is a real check: a page linking an anchor no page has is refused."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [nowhere](other.md#missing).\n")
    (docs / "other.md").write_text("# Other\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[0] + "\nnav:\n  - index.md\n  - other.md\n"
    (tmp_path / "mkdocs.yml").write_text(config)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode != 0 and "missing" in done.stdout + done.stderr


def test_the_api_reference_is_the_apps_own_document():
    committed = (DOCS / "api-reference.md").read_text()
    assert committed == api_reference(), "docs/api-reference.md is stale: python -m dfp_dev.api_reference docs/api-reference.md"


def test_the_readme_is_a_short_front_page_whose_links_land():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    assert "## Submit a job" in readme[:4000], "submitting a job is on the README's first screen"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links {target}, which does not exist"


def test_each_service_folder_points_at_its_page():
    for name in ("api", "generation", "tokenizer", "target", "trainer", "capture"):
        text = (ROOT / "services" / f"dfp_{name}" / "README.md").read_text()
        assert len(text.splitlines()) <= 10, f"dfp_{name}/README.md keeps a few lines pointing at its page"
        page = "capture.md" if name == "capture" else f"services/{name}.md"
        assert f"docs/{page}" in text and (DOCS / page).is_file()
