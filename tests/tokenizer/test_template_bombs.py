"""Single-step template bombs: one C-level operation that would allocate (or compute) far past the budget,
which the watchdog cannot interrupt, is refused by the sandbox before it runs: the record is a counted
``template_budget`` bad line naming the operation, and the process never allocates it. Ordinary templates
render exactly as in transformers' own sandbox."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.limits import EncodeLimits, TemplateUnavailable
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler
from transformers.utils.chat_template_utils import _cached_compile_jinja_template as stock_compile

from tests.support.cli import ROOT, cli_env

from .conftest import LLAMA_STYLE_TEMPLATE
from .corpus import records

# a list that holds one 1 MB string a million times (1 TB printed, 8 MB held), and a 40-deep tree of pairs
SHARED = ("{% set ns = namespace(l=['x' * 1000000]) %}{% for i in range(20) %}{% set ns.l = ns.l + ns.l %}"
          "{% endfor %}")
TREE = "{% set ns = namespace(l='x' * 1000) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
# (template, the operation its refusal names): each builds (or computes) its whole result in one step
BOMBS = [
    ("{% set s = 'a' * 2000000000 %}{{ s|length }}", "'*' on a str"),
    ("{{ 7 ** 99999999 }}", "'**'"),
    ("{{ (7 ** (messages|length + 30000000)) % 1000 }}", "'**'"),
    ("{{ 10 ** 3000 * 10 ** 3000 }}", "'*' on integers"),
    ("{{ ([0] * 10**9)|length }}", "'*' on a list"),
    ("{{ ((1, 2) * 10**9)|length }}", "'*' on a tuple"),
    ("{{ '%*s' % (10**9, '') }}", "'%' formatting"),
    ("{{ '%0999999999d' % 1 }}", "'%' formatting"),
    ("{{ '%(a)999999999s' % {'a': 1} }}", "'%' formatting"),
    ("{{ '%.999999999f' % 1.5 }}", "'%' formatting"),
    ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    ("{{ 'x'.rjust(10**10) }}", "str.rjust"),
    ("{{ 'x'.center(10**10) }}", "str.center"),
    ("{{ 'x'.zfill(10**10) }}", "str.zfill"),
    ("{{ 'x'.encode().ljust(10**10) }}", "bytes.ljust"),
    ("{{ ('\\t' * 1000000).expandtabs(100000) }}", "str.expandtabs"),
    ("{{ ('a' * 1000000).replace('', 'x' * 1000) }}", "str.replace"),
    ("{{ ('ab' * 1000).translate({97: 'x' * 1000000}) }}", "str.translate"),
    ("{{ ('x' * 10000).join(['ab'] * 1000000) }}", "str.join"),
    ("{{ '{:>1000000000}'.format(1) }}", "str.format"),
    ("{{ '{:{}}'.format(1, 999999999) }}", "str.format"),
    ("{{ '{:.999999999f}'.format(1.5) }}", "str.format"),
    ("{{ '{x:>999999999}'.format_map({'x': 1}) }}", "str.format"),
    ("{{ 'x'|center(10**10) }}", "the center filter"),
    ("{{ 'x'|center(9999999999) }}", "the center filter"),  # constant arguments: not run at compile time
    ("{{ 'x'|indent(10**10) }}", "the indent filter"),
    ("{{ ('a\\n' * 1000000)|indent(10000) }}", "the indent filter"),
    ("{{ ('a\\n' * 1000000)|indent('x' * 10000) }}", "the indent filter"),
    ("{{ '%0999999999d'|format(1) }}", "the format filter"),
    ("{{ ('a' * 1000000)|replace('', 'x' * 1000) }}", "the replace filter"),
    ("{{ (['ab'] * 1000000)|join('x' * 10000) }}", "the join filter"),
    ("{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 10000) }}", "the wordwrap filter"),
    ("{{ [1]|batch(10**9, 0)|list|length }}", "the batch filter"),
    ("{{ ([[1] * 100] * 10000)|sum(start=[])|length }}", "the sum filter"),
    ("{{ (['x' * 100000] * 50)|tojson(indent=100000) }}", "the tojson filter"),
    # filters and globals whose one call can cost far more than it prints
    ("{{ strftime_now('%1000000000d') }}", "strftime_now"),
    ("{{ strftime_now('%-_0^#1000000000Y') }}", "strftime_now"),
    ("{{ strftime_now('%Y' * 1000000) }}", "strftime_now"),
    ("{{ ('http://' ~ 'a.' * 1000000)|urlize }}", "the urlize filter"),
    ("{{ 'x'|urlize }}", "the urlize filter"),
    ("{{ lipsum(1000000000) }}", "lipsum"),
    ("{{ 1.5|round(100000000, 'floor') }}", "the round filter"),
    ("{{ ('\"' * 3000000)|e }}", "the escape filter"),
    ("{{ ('\u00e9' * 2000000)|urlencode }}", "the urlencode filter"),
    # a size that grows in a loop: refused at the first step over the limit
    ("{% set ns = namespace(n=1) %}{% for i in range(60) %}{% set ns.n = ns.n * 4 %}{{ ('x' * ns.n)|length }}"
     "{% endfor %}", "'*' on a str"),
    # printing a shared container
    (SHARED + "{{ ns.l }}", "printing a list"),
    (TREE + "{{ ns.l }}", "printing a list"),
    (SHARED + "{{ ns }}", "printing a TemplateNamespace"),
    (SHARED + "{{ '' ~ ns.l }}", "'~' (concatenation)"),
    (SHARED + "{{ '%s' % (ns.l,) }}", "'%' formatting"),
    (SHARED + "{{ '{}'.format(ns.l) }}", "str.format"),
    (SHARED + "{{ ns.l|string }}", "the string filter"),
    (SHARED + "{{ ns.l|trim }}", "the trim filter"),
    (TREE + "{{ ns.l|tojson }}", "the tojson filter"),
    (TREE + "{{ [ns.l]|join }}", "the join filter"),
    (TREE + "{{ raise_exception(ns.l) }}", "raise_exception"),
    # the rendered text, a macro's, a set block's: one string repeated
    ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "joining the rendered text"),
    ("{% macro m(s) %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}{{ m('x' * 1000000)|length }}",
     "joining the rendered text"),
]
# refused by jinja's own sandbox (a template error, before anything is allocated)
RANGE_BOMB = "{{ range(10**9)|list|length }}"


def bomb_template(bombs: list[str]) -> str:
    """Bomb ``i`` goes off on a conversation whose first message is ``BOMB i``; others render normally."""
    branches = "".join(f"{{%- if messages[0]['content'] == 'BOMB {i}' %}}{b}{{%- endif %}}" for i, b in enumerate(bombs))
    return branches + LLAMA_STYLE_TEMPLATE


def bomb_record(i: int) -> dict:
    return {"id": f"bomb{i}", "messages": [{"role": "user", "content": f"BOMB {i}"},
                                           {"role": "assistant", "content": "never rendered"}]}


MEASURE = textwrap.dedent("""
    import json, resource, sys
    from dfp_shared.specs.tokenize import TokenizeSpec
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_tokenizer.encoder import SampleEncoder
    from dfp_tokenizer.files import tokenize_file
    from dfp_tokenizer.limits import EncodeLimits

    tok_dir, template, n, good = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    enc = SampleEncoder(load_tokenizer(tok_dir), TokenizeSpec(input="/in", output="/out", tokenizer="/tok",
                                                              chat_template=template), limits=EncodeLimits())
    tokenize_file((json.dumps(good[0]) + "\\n").encode(), "file:///w.jsonl", "w", enc, id_prefix="w")  # warm-up
    # a safety net for a regression: a bomb that does run fails here instead of exhausting the machine
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + 3 * 2**30, resource.RLIM_INFINITY))
    out = []
    for i in range(n):
        bomb = {"id": f"bomb{i}", "messages": [{"role": "user", "content": f"BOMB {i}"},
                                               {"role": "assistant", "content": "never rendered"}]}
        data = "".join(json.dumps(r) + "\\n" for r in (good[0], bomb, good[1])).encode()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = tokenize_file(data, "file:///in/b.jsonl", "s", enc, id_prefix="b")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out.append({"i": i, "growth_mb": (peak - base) / 1024, "samples": res.stats.samples,
                    "errors": [(e["line"], e["reason"], e["detail"]) for e in res.errors]})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    print(json.dumps(out))
""")


@pytest.mark.timeout(600)
def test_each_single_step_bomb_is_a_counted_bad_line_with_bounded_memory(qwen3_tokenizer_dir):
    good = records(2, seed=11)
    bombs = [b for b, _ in BOMBS] + [RANGE_BOMB]
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(qwen3_tokenizer_dir), bomb_template(bombs),
                           str(len(bombs)), json.dumps(good)], env=cli_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == len(bombs)
    expected = [("template_budget", f"refused {op} before it ran") for _, op in BOMBS]
    expected.append(("template_error", "Range too big"))
    failed = []
    for r, (bomb, (reason, says)) in zip(got, zip(bombs, expected)):
        errors = r["errors"]
        if not (r["samples"] == 2 and len(errors) == 1 and errors[0][:2] == [2, reason] and says in errors[0][2]
                and r["growth_mb"] < 100):
            failed.append((bomb, r))
    assert not failed, "\n".join(f"{b}: {r}" for b, r in failed)


@pytest.mark.timeout(180)
def test_a_job_with_bombs_succeeds_with_its_good_records(redis_client, tmp_path, llama_style_tokenizer_dir):
    bombs = [BOMBS[i][0] for i in (0, 1, 6, 10, 23, 36)] + [BOMBS[-2][0]]
    good = records(4, seed=12)
    lines = [good[0], bomb_record(0), good[1]] + [bomb_record(i) for i in range(1, len(bombs))] + good[2:]
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": bomb_template(bombs)})
    queue = TaskQueue(redis_client, TOKENIZE.stream, lease_ms=3000, max_deliveries=3)
    Worker(queue, JobStore(redis_client), TokenizeHandler(redis_client, EncoderCache(limits=EncodeLimits())),
           block_ms=100).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["samples"] == 4 and rec.counters["bad_lines"] == len(bombs)
    errors = [json.loads(x) for x in next((tmp_path / "out" / "errors").iterdir()).read_text().splitlines()]
    assert [(e["id"], e["line"], e["reason"]) for e in errors] == [
        (f"bomb{i}", 2 + i + (i > 0), "template_budget") for i in range(len(bombs))]
    assert all(e["file"].endswith("f.jsonl") for e in errors)
    assert "refused '*' on a str before it ran" in errors[0]["detail"] and "over the limit" in errors[0]["detail"]


def test_a_template_that_always_goes_off_fails_the_job_clearly(llama_style_tokenizer):
    spec = TokenizeSpec(input="/in", output="/out", tokenizer="/tok",
                        chat_template="{{ 'x'.ljust(10**10) }}" + LLAMA_STYLE_TEMPLATE)
    with pytest.raises(TemplateUnavailable, match="over its render budget.*refused str.ljust before it ran"):
        SampleEncoder(llama_style_tokenizer, spec, EncodeLimits())


ORDINARY = [
    "{{ loop }}{% for m in messages %}{{ loop.index0 % 2 }}|{{ (loop.index0 % 2 == 0) }}|{{ 7 % 3 }}|{{ 7.5 % 2 }}"
    "{{ m.content|center(20) }}|{{ '%05d|%s|%-4s|%.2f|%%'|format(3, m.role, 'a', 1.5) }}"
    "|{{ '%(r)s:%(c)s' % {'r': m.role, 'c': m.content} }}|{{ '%s-%d' % ('a', 2) }}|{{ '%s' % m.content }}"
    "|{{ '%s' % {'a': 1} }}|{{ '%*d|%.*f' % (4, 2, 1, 2.25) }}|{{ '%r' % [m.role] }}"
    "|{{ '{:>5}|{}|{r}|{!r}'.format(2, 'x', 'y', r=m.role) }}|{{ '{a}'.format_map({'a': 1}) }}|{{ '{:.3f}'.format(2) }}"
    "|{{ m.content.replace(' ', '--') }}|{{ m.content.ljust(12, '.') }}|{{ m.content.rjust(3) }}"
    "|{{ '7'.zfill(3) }}|{{ 'a\\tb'.expandtabs(4) }}|{{ ', '.join(['a', m.role]) }}|{{ '-'.join('abc') }}"
    "|{{ ['a', 'b']|join(', ') }}|{{ messages|join('/', attribute='role') }}|{{ [1, 2]|sum }}"
    "|{{ [[1], [2]]|sum(start=[]) }}|{{ messages|map(attribute='content')|map('length')|sum }}"
    "|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 2 ** 0.5 }}|{{ 10 ** 3000 % 7 }}|{{ 'ab' * 3 }}|{{ 3 * 'ab' }}|{{ [0] * 3 }}"
    "|{{ (1, 2) * 2 }}|{{ 6 * 7 }}|{{ 1.5 * 2 }}|{{ 'x' * -1 }}|{{ m|tojson }}|{{ m|tojson(indent=2) }}"
    "|{{ messages|tojson(separators=(',', ':')) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\nb'|indent('> ') }}"
    "|{{ 'aaa'|replace('a', 'bb', 2) }}|{{ 'foo bar baz'|wordwrap(5) }}|{{ 'foo bar baz'|wordwrap(5, wrapstring='<br>') }}"
    "|{{ 'foo bar baz qux'|truncate(9) }}|{{ [1, 2, 3]|batch(2, 0)|list }}|{{ 'ab'.translate({97: 'xy'}) }}"
    "|{{ -3 }}|{{ [1, 'a', none] }}|{{ {'a': [1, 2]} }}|{{ {'a': 1}.items() }}|{{ (m.role, 2) }}|{{ none }}"
    "|{{ 'x' ~ 1 ~ [2] ~ m.role }}|{{ m.role|upper }}|{{ [1, 2]|string }}|{{ '  a '|trim }}|{{ m|length }}"
    "{% endfor %}{% set ns = namespace(a=[1, 'b']) %}{{ ns }}{% set x %}ab{{ 1 }}{% endset %}{{ x|title }}"
    "{% macro m(a) %}<{{ a }}>{% endmacro %}{{ m(1) }}{% filter upper %}up{% endfilter %}",
    LLAMA_STYLE_TEMPLATE,
]


def test_ordinary_operations_render_exactly_as_in_the_stock_sandbox():
    from dfp_tokenizer.template_spans import _compile

    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    for template in ORDINARY:
        expected = stock_compile(template).render(messages=messages, bos_token="<s>")
        assert _compile(template, 1 << 20).render(messages=messages, bos_token="<s>") == expected


def test_the_qwen3_template_renders_exactly_as_in_the_stock_sandbox(qwen3_tokenizer):
    from dfp_tokenizer.template_spans import _compile

    template = qwen3_tokenizer.chat_template
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    convs = [r["messages"] for r in records(20, seed=5)]
    convs.append([{"role": "user", "content": "call it"},
                  {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                  {"role": "tool", "content": "42"}])
    for messages in convs:
        for kwargs in ({}, {"add_generation_prompt": True, "enable_thinking": False}, {"tools": tools}):
            expected = stock_compile(template).render(messages=messages, **kwargs)
            assert _compile(template).render(messages=messages, **kwargs) == expected
