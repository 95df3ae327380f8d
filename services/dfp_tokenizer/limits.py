"""The operator's limits on what one record may cost, and where chat templates may come from.

* ``max_line_bytes``: a longer input line is a bad line (``line_too_long``), rejected before it is
  parsed or tokenized (and before it is even copied out of the file); a tokenizer batch is also cut
  at twice that many characters, so one batch's memory stays bounded too.
* ``template_timeout_s`` / ``template_memory_bytes``: the budget of one record's rendering (and of
  each probe of a template), enforced in the render process (:mod:`.render_process`) by
  :mod:`dfp_shared.chat_template.budget`, and by killing that process or capping its address space
  where one call escapes it; a rendered text longer than ``max_rendered_chars`` is over budget too.
* ``chat_templates_dir``: templates the operator registered; a spec picks one by name
  (``chat_template: <name>`` reads ``<dir>/<name>.jinja``). ``allow_inline_templates=False`` refuses
  a spec's own Jinja text, so that only the tokenizer's template or a registered one is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class TemplateUnavailable(ValueError):
    """The spec's chat template cannot be used (unknown name, inline templates refused, budget)."""


@dataclass(frozen=True)
class EncodeLimits:
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    template_timeout_s: float = 2.0
    template_memory_bytes: int = 512 * 1024 * 1024
    chat_templates_dir: str | None = None
    allow_inline_templates: bool = True

    @classmethod
    def from_settings(cls, settings) -> EncodeLimits:
        return cls(max_line_bytes=settings.max_line_bytes, template_timeout_s=settings.template_timeout_s,
                   template_memory_bytes=settings.template_memory_mb * 1024 * 1024,
                   chat_templates_dir=settings.chat_templates_dir,
                   allow_inline_templates=settings.allow_inline_templates)

    @property
    def max_rendered_chars(self) -> int:
        """A rendered conversation is its line's texts plus the template's own few pieces."""
        return 2 * self.max_line_bytes + 256 * 1024

    @property
    def max_batch_chars(self) -> int:
        """A tokenizer batch is flushed once its texts reach this size (its memory is ~100 bytes a character)."""
        return 2 * self.max_line_bytes

    def registered_templates(self) -> list[str]:
        root = Path(self.chat_templates_dir) if self.chat_templates_dir else None
        if root is None or not root.is_dir():
            return []
        return sorted(p.stem for p in root.glob("*.jinja") if TEMPLATE_NAME.fullmatch(p.stem))

    def resolve_template(self, value: str | None) -> str | None:
        """The Jinja text of a spec's ``chat_template``: a registered name, or (if allowed) the text
        itself; None = the tokenizer's own."""
        if not value:
            return None
        if TEMPLATE_NAME.fullmatch(value):
            names = self.registered_templates()
            if value not in names:
                where = f"in {self.chat_templates_dir}" if self.chat_templates_dir else \
                    "(no DFLASH_CHAT_TEMPLATES_DIR is configured)"
                raise TemplateUnavailable(f"chat_template: no registered template named {value!r} {where}; "
                                          f"registered: {', '.join(names) or 'none'}")
            path = Path(self.chat_templates_dir) / f"{value}.jinja"
            if path.is_symlink() and not path.resolve().is_relative_to(Path(self.chat_templates_dir).resolve()):
                raise TemplateUnavailable(f"chat_template: {value!r} links outside {self.chat_templates_dir}")
            return path.read_text(encoding="utf-8")
        if not self.allow_inline_templates:
            raise TemplateUnavailable("chat_template: this deployment accepts only registered template names "
                                      f"({', '.join(self.registered_templates()) or 'none registered'}), "
                                      "not Jinja text")
        return value
