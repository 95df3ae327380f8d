"""Single template operations that would build an oversized result, refused before they run.

The watchdog (:mod:`.budget`) stops a render between bytecodes, never inside one C-level
operation (``'a' * 10**9``, ``7 ** 10**8``, ``'x'.ljust(10**9)``, ``'%*s' % (10**9, '')``, a width
in a format spec or filter, printing a list that holds one long string a million times).
:func:`sized_copy` checks each such operation from its operands and raises
:class:`~.budget.BudgetExceeded` naming it (a ``template_budget`` bad line) if its result
would be over ``size_cap`` characters (items for lists, :data:`MAX_INT_BITS` for integers): ``*``
``**`` ``%``, the str methods and filters that lengthen, and every place a value is printed whole
(``{{ }}``, ``~``, text filters, ``raise_exception``, the rendered text), a container measured as it
prints. Strings joined by ``+`` or ``~`` only add up what is held: that growth is the watchdog's.
"""

from __future__ import annotations

import itertools
import math
import re
from functools import cache, update_wrapper

from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.filters import make_attrgetter
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, pass_context
from markupsafe import Markup

from dfp_shared.chat_template.budget import BudgetExceeded

MAX_INT_BITS = 10_000
"""The largest integer ``*`` or ``**`` may make (about 3,000 digits)."""

_VIEWS = (type({}.keys()), type({}.values()))
_PRINTS_LONG = (list, tuple, dict, Namespace, *_VIEWS, type({}.items()))
# %[(key)][flags][width][.precision][length]type
_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)
_NUMBER = re.compile(r"\d+")


def check(operation: str, size: float, cap: int, unit: str = "characters") -> None:
    if size > cap:
        raise BudgetExceeded(f"refused {operation} before it ran: it would make at least {size:.0f} {unit}, over the "
                             f"limit of {cap}")


def weight(value, limit: int, indent: int = 0, per_item: int = 2) -> int:
    """About how many characters ``value`` prints as (``str``, ``repr`` or JSON indented by ``indent``),
    nested containers included; counting stops past ``limit``."""
    if isinstance(value, (str, bytes)):
        return len(value)
    memo: dict[tuple[int, int], int] = {}

    def walk(v, depth: int) -> int:
        if isinstance(v, (str, bytes)):
            return len(v) + 2
        if isinstance(v, Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")
        if isinstance(v, (list, tuple, *_VIEWS)):
            items = v
        elif isinstance(v, dict):  # keys and values, never the (temporary) pairs
            items = itertools.chain.from_iterable(v.items())
        elif isinstance(v, _PRINTS_LONG):  # an items view
            items = itertools.chain.from_iterable(v)
        else:
            return v.bit_length() // 3 + 2 if isinstance(v, int) else 24
        key = (id(v), depth)
        if key not in memo:
            total = 2
            for item in items:
                total += walk(item, depth + 1) + per_item + indent * depth
                if total > limit:
                    break
            memo[key] = total
        return memo[key]

    return walk(value, 1)


def check_printed(operation: str, value, cap: int) -> None:
    if not isinstance(value, str):
        check(operation, weight(value, cap), cap)


def _text(operation: str, value, cap: int) -> str:
    check_printed(operation, value, cap)
    return value if isinstance(value, str) else str(value)


# operators and str methods


def _check_binop(op: str, left, right, cap: int) -> None:
    if op == "%":
        if isinstance(left, (str, bytes)):
            check_percent("'%' formatting", left, right, cap)
    elif isinstance(left, int) and isinstance(right, int):
        if op == "*":
            check("'*' on integers", left.bit_length() + right.bit_length(), MAX_INT_BITS, "bits")
        elif right > 0 and abs(left) > 1:
            check("'**'", right * math.log2(abs(left)), MAX_INT_BITS, "bits")
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
            check(f"'*' on a {type(seq).__name__}", len(seq) * n, cap,
                  "characters" if isinstance(seq, (str, bytes)) else "items")


def check_percent(operation: str, fmt, args, cap: int) -> None:
    """``fmt % args``: the literal text plus each conversion's width, precision and printed value."""
    fmt = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    if "%" not in fmt:
        return
    seq = args if isinstance(args, tuple) else (args,)
    taken = iter(seq)
    total = len(fmt)
    for m in _PERCENT.finditer(fmt):
        key, width, precision, kind = m.groups()
        if kind == "%":
            continue
        for spec in (width, precision):
            n = next(taken, 0) if spec == "*" else int(spec or 0)
            total += n if isinstance(n, int) and n > 0 else 0
        if key is None:
            value = next(taken, None)
        else:
            try:
                value = args[key]
            except Exception:  # noqa: BLE001 - the operation itself reports it
                value = None
        total += weight(value, cap)
        check(operation, total, cap)


def _check_replace(operation: str, text, old, new, count, cap: int) -> None:
    if not (isinstance(old, (str, bytes)) and isinstance(new, (str, bytes))) or len(new) <= len(old):
        return
    grow = len(new) - len(old)
    if len(text) + (len(text) + 1) * grow > cap:
        n = text.count(old)  # len + 1 for an empty ``old``
        check(operation, len(text) + (min(n, count) if isinstance(count, int) and count >= 0 else n) * grow, cap)


_LENGTHENING = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "replace", "join", "translate"})


def _check_method(name: str, text, args: tuple, kwargs: dict, cap: int) -> tuple:
    """``text.name(*args, **kwargs)``; returns the arguments (an iterator given to ``join`` read into a list)."""
    operation = f"{type(text).__name__}.{name}"
    first = args[0] if args else None
    if name in ("ljust", "rjust", "center", "zfill"):
        if isinstance(first, int):
            check(operation, first, cap)
    elif name == "expandtabs":
        tab = first if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int) and tab > 1 and len(text) * tab > cap:
            check(operation, len(text) + text.count(b"\t" if isinstance(text, bytes) else "\t") * tab, cap)
    elif name == "replace" and len(args) >= 2:
        _check_replace(operation, text, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1),
                       cap)
    elif name == "join" and args:
        items = first if isinstance(first, (list, tuple, str, bytes)) else list(first)
        check(operation, len(text) * max(len(items) - 1, 0)
              + sum(len(x) for x in items if isinstance(x, (str, bytes))), cap)
        return (items, *args[1:])
    elif name == "translate" and isinstance(text, str):
        values = first.values() if isinstance(first, dict) else first if isinstance(first, (list, tuple)) else ()
        longest = max((len(v) for v in values if isinstance(v, str)), default=1)
        if longest > 1:
            check(operation, len(text) * longest, cap)
    return args


class _SizedFormatting:
    """``str.format``: the literal text plus each field's printed value, width and precision."""

    def __init__(self, env, **kwargs):
        super().__init__(env, **kwargs)
        self.cap, self.total = env.size_cap, 0

    def vformat(self, format_string, args, kwargs):
        self.total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value, format_spec):
        self.total += weight(value, self.cap) + sum(int(n) for n in _NUMBER.findall(format_spec))
        check("str.format", self.total, self.cap)
        return super().format_field(value, format_spec)


class _SizedFormatter(_SizedFormatting, SandboxedFormatter):
    pass


class _SizedEscapeFormatter(_SizedFormatting, SandboxedEscapeFormatter):
    pass


# filters: each check takes the filter's own arguments and returns the value to filter


def _f_center(env, value, width=80):
    if isinstance(width, int):
        check("the center filter", width, env.size_cap)
    return value


def _f_indent(env, s, width=4, first=False, blank=False):
    width = len(_text("the indent filter", width, env.size_cap)) if not isinstance(width, int) else width
    if width > 0:
        lines = s.count("\n") + 1 if isinstance(s, str) else weight(s, env.size_cap) + 1
        check("the indent filter", weight(s, env.size_cap) + lines * width, env.size_cap)
    return s


def _f_format(env, value, *args, **kwargs):
    check_percent("the format filter", _text("the format filter", value, env.size_cap), kwargs or args, env.size_cap)
    return value


def _f_replace(env, s, old, new, count=None):
    cap = env.size_cap
    _check_replace("the replace filter", _text("the replace filter", s, cap), _text("the replace filter", old, cap),
                   _text("the replace filter", new, cap), -1 if count is None else count, cap)
    return s


def _f_wordwrap(env, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = _text("the wordwrap filter", s, env.size_cap)
    wrap = len(_text("the wordwrap filter", wrapstring, env.size_cap)) if wrapstring is not None else 1
    if wrap > 1:  # at most one line per character
        check("the wordwrap filter", len(text) + (len(text) + 1) * wrap, env.size_cap)
    return s


def _f_join(env, value, d="", attribute=None):
    items = list(value)
    total = len(_text("the join filter", d, env.size_cap)) * max(len(items) - 1, 0)
    for item in map(make_attrgetter(env, attribute), items) if attribute is not None else items:
        total += weight(item, env.size_cap)
        check("the join filter", total, env.size_cap)
    return items


def _f_batch(env, value, linecount, fill_with=None):
    if fill_with is not None and isinstance(linecount, int):
        check("the batch filter", linecount, env.size_cap, "items")
    return value


def _f_sum(env, iterable, attribute=None, start=0):
    if not isinstance(start, (list, tuple)):
        return iterable
    items = list(iterable)
    size = copied = len(start)
    for x in map(make_attrgetter(env, attribute), items) if attribute is not None else items:
        size += len(x) if isinstance(x, (list, tuple)) else 0
        copied += size  # each step copies the sum so far
    check("the sum filter", copied, env.size_cap, "items copied")
    return items


def _f_tojson(env, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) and indent > 0 else 0
    seps = sum(len(p) for p in separators if isinstance(p, str)) if isinstance(separators, (list, tuple)) else 2
    check("the tojson filter", weight(x, env.size_cap, width, seps + (indent is not None)), env.size_cap)
    return x


def _f_round(env, value, precision=0, method="common"):
    if isinstance(precision, int) and method in ("ceil", "floor"):  # it computes 10 ** precision
        check("the round filter", abs(precision) * math.log2(10), MAX_INT_BITS, "bits")
    return value


def _f_escape(env, s):  # one character becomes at most six (``&#34;``)
    check("the escape filter", 6 * weight(s, env.size_cap), env.size_cap)
    return s


def _f_urlencode(env, value):  # one character becomes at most twelve (four UTF-8 bytes, each %XX)
    check("the urlencode filter", 12 * weight(value, env.size_cap), env.size_cap)
    return value


_FILTER_CHECKS = {"round": _f_round, "e": _f_escape, "escape": _f_escape, "forceescape": _f_escape,
                  "urlencode": _f_urlencode, "center": _f_center, "indent": _f_indent, "format": _f_format, "replace": _f_replace,
                  "wordwrap": _f_wordwrap, "join": _f_join, "batch": _f_batch, "sum": _f_sum, "tojson": _f_tojson}
# filters that print their value whole first
_PRINTING_FILTERS = frozenset({"string", "e", "escape", "forceescape", "safe", "upper", "lower", "capitalize",
                               "title", "trim", "center", "indent", "wordwrap", "wordcount", "truncate", "replace",
                               "striptags", "format", "urlize", "urlencode", "xmlattr", "pprint"})


def _sized_filter(name: str, original):
    checks = _FILTER_CHECKS.get(name)
    prints = name in _PRINTING_FILTERS

    @pass_context  # never run at compile time: constant arguments are checked at render time too
    def sized(context, value, *args, **kwargs):
        if prints:
            check_printed(f"the {name} filter", value, context.environment.size_cap)
        if checks is not None:
            value = checks(context.environment, value, *args, **kwargs)
        return context.call(original, value, *args, **kwargs)

    sized.__name__ = sized.__qualname__ = f"sized_{name}"
    return sized


# the environment


class _SizedCodeGenerator(CodeGenerator):
    @optimizeconst
    def visit_Concat(self, node, frame):
        """``a ~ b`` as jinja compiles it, its parts sized before they are joined."""
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.sized_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class SizedSandbox:
    """Mixed into a sandboxed environment by :func:`sized_copy`."""

    intercepted_binops = frozenset({"*", "**", "%"})
    code_generator_class = _SizedCodeGenerator
    size_cap: int

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right, self.size_cap)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's signature: any keyword may be passed on
        text = getattr(__obj, "__self__", None)
        if isinstance(text, (str, bytes)) and getattr(__obj, "__name__", None) in _LENGTHENING:
            args = _check_method(__obj.__name__, text, args, kwargs, __self.size_cap)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """Jinja's own wrapper of ``str.format`` / ``format_map``, with a sized formatter."""
        if super().wrap_str_format(value) is None:
            return None
        text, is_format_map = value.__self__, value.__name__ == "format_map"
        formatter = _SizedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) \
            else _SizedFormatter(self)

        def wrapper(*args, **kwargs):
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return type(text)(formatter.vformat(text, args, kwargs))

        return update_wrapper(wrapper, value)

    def sized_output(self, value):
        """``{{ value }}`` (the environment's ``finalize``)."""
        if type(value) is not str and isinstance(value, _PRINTS_LONG):
            check(f"printing a {type(value).__name__}", weight(value, self.size_cap), self.size_cap)
        return value

    def sized_parts(self, parts: tuple) -> tuple:
        """``a ~ b``: what it prints of values that are not strings (strings only add up, as with ``+``)."""
        check("'~' (concatenation)", sum(weight(p, self.size_cap) for p in parts if not isinstance(p, str)),
              self.size_cap)
        return parts

    def concat(self, parts) -> str:
        """The rendered text (and that of a block, ``set`` block or macro) from its pieces."""
        parts = parts if isinstance(parts, list) else list(parts)
        check("joining the rendered text", sum(map(len, parts)), self.size_cap)
        return "".join(parts)


@cache
def _sized_class(base: type) -> type:
    return type(f"Sized{base.__name__}", (SizedSandbox, base), {})


# strftime directives whose output is a few characters; no flags, no widths (``%1000000000d``)
_STRFTIME = re.compile(r"%(.)", re.S)
_STRFTIME_SAFE = frozenset("aAbBcdDeFgGhHIjmMnpStTuUVwWxXyYzZ%")
STRFTIME_DIRECTIVE_CHARS = 64
"""The most characters one allowed directive prints (``%c`` in a long locale is the longest)."""


def _refused(operation: str, why: str) -> BudgetExceeded:
    return BudgetExceeded(f"refused {operation} before it ran: {why}")


def sized_strftime_now(cap: int):
    """transformers' ``strftime_now(format)``, with the format checked first: only plain directives (a
    flag or a width makes the C library pad to any size in one call), and a result under ``cap``."""
    from datetime import datetime

    def strftime_now(format):
        text = _text("strftime_now", format, cap)
        directives = _STRFTIME.findall(text)
        bad = sorted({d for d in directives if d not in _STRFTIME_SAFE})
        if bad or text.count("%") != len(directives):
            raise _refused("strftime_now", f"only plain directives (%Y, %d, ...) are allowed, no flags or widths "
                                           f"(got {', '.join('%' + d for d in bad) or 'a trailing %'})")
        check("strftime_now", len(text) + len(directives) * STRFTIME_DIRECTIVE_CHARS, cap)
        return datetime.now().strftime(text)

    return strftime_now


def _unavailable(operation: str, why: str, filter: bool = False):
    def refuse(*args, **kwargs):
        raise _refused(operation, why)

    # a filter: never run at compile time (with constant arguments jinja would fold it)
    return pass_context(lambda context, *args, **kwargs: refuse()) if filter else refuse


UNAVAILABLE_FILTERS = {"urlize": "it is not available in this sandbox (its regular expressions can run for "
                                 "seconds in one call on a crafted word)"}
UNAVAILABLE_GLOBALS = {"lipsum": "it is not available in this sandbox (placeholder text has no place in a chat "
                                 "template)"}


def sized_copy(env, cap: int):
    """A copy of the sandboxed environment ``env`` that refuses any single operation whose result would be
    over ``cap`` characters; templates compiled from it afterwards are checked (operators are intercepted,
    and nothing checked is folded at compile time)."""
    new = env.overlay()
    new.__class__ = _sized_class(type(env))
    new.size_cap = cap
    new.finalize = new.sized_output
    new.filters = {**env.filters, **{name: _sized_filter(name, env.filters[name])
                                     for name in _FILTER_CHECKS.keys() | _PRINTING_FILTERS if name in env.filters}}
    for name, why in UNAVAILABLE_FILTERS.items():
        new.filters[name] = _unavailable(f"the {name} filter", why, filter=True)
    new.globals = {**env.globals, **{name: _unavailable(name, why) for name, why in UNAVAILABLE_GLOBALS.items()}}
    raise_exception = env.globals.get("raise_exception")
    if raise_exception is not None:  # its message is printed when the record's error is written

        def sized_raise_exception(message):
            check_printed("raise_exception", message, cap)
            return raise_exception(message)

        new.globals["raise_exception"] = sized_raise_exception
    if "strftime_now" in env.globals:
        new.globals["strftime_now"] = sized_strftime_now(cap)
    return new
