"""A test-only sandbox with two calls no in-process check can stop (the sandbox offers none any more).

``c_sleep(seconds)`` blocks in one C call (``time.sleep``: an asynchronous exception lands only after it
returns) and ``c_alloc(n)`` builds an ``n``-character string in one C call. :func:`install` adds them to
the sized sandbox of this process; run as a module (``python -m tests.tokenizer.blocking_sandbox``), it
installs them and then serves as the tokenizer's render process.
"""

from __future__ import annotations

import time

from dfp_shared.chat_template import render


def _alloc(n) -> int:
    return len("x" * int(n))


def _with_blocking_calls(sized_copy):
    def sized_copy_with_blocking_calls(env, cap):
        new = sized_copy(env, cap)
        new.globals = {**new.globals, "c_sleep": time.sleep, "c_alloc": _alloc}
        return new

    return sized_copy_with_blocking_calls


def install(monkeypatch=None) -> None:
    patched = _with_blocking_calls(render.sized_copy)
    if monkeypatch is not None:
        monkeypatch.setattr(render, "sized_copy", patched)
    else:
        render.sized_copy = patched


if __name__ == "__main__":
    from dfp_tokenizer.render_child import main

    install()
    main()
