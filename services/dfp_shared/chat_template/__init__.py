"""Chat templates rendered in a sized Jinja sandbox, optionally under a time and memory budget.

* :mod:`.render`: :func:`render_chat` (the text ``apply_chat_template`` makes) and :func:`chat_prompt_ids`;
* :mod:`.sandbox`: the environment that refuses single oversized operations before they run;
* :mod:`.budget`: the watchdog that stops a render past its time or memory budget.
"""

from dfp_shared.chat_template.budget import BudgetExceeded, run_within
from dfp_shared.chat_template.render import (
    DEFAULT_MAX_CHARS,
    RenderBudget,
    TemplateOverBudget,
    chat_prompt_ids,
    compile_template,
    render_chat,
)

__all__ = ["DEFAULT_MAX_CHARS", "BudgetExceeded", "RenderBudget", "TemplateOverBudget", "chat_prompt_ids",
           "compile_template", "render_chat", "run_within"]
