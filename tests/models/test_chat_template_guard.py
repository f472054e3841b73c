"""A hostile chat template (it ships with the model directory) is one KvcInputError line, with bounded work.

Before (kvcodec.models.chatguard): a template that raised (``raise_exception``) or did not parse escaped from
``kvc ask`` and onboarding as a jinja2 traceback, nested loops over ``range(100000)`` ran for hours, and
``'x' * 2000000000`` was folded into one 2 GB constant while the template compiled (MemoryError). The
templates here are sized so the old code finished them in seconds (and failed these tests) instead of hanging,
and render no user message (the old code then refused them, in the wrong words, before tokenizing megabytes).
"""

from __future__ import annotations

import copy
import time

import pytest

from kvcodec.errors import KvcInputError
from kvcodec.models.chat import ChatFormat
from kvcodec.models.chatguard import TemplateBudgetError

from cliutil import run_kvc  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from tests._support.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


def _with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [
    # 3,000,000 loop iterations (range(100000) nested in itself: 10^10, hours)
    "{% for i in range(100000) %}{% for j in range(30) %}x{% endfor %}{% endfor %}",
    # one constant of 120 MB (2 GB: a MemoryError), folded while compiling
    "{{ 'x' * 120000000 }}",
    # past 1 MiB by replace, by doubling, by a width, by repetition in the output
    "{% set s = 'x' * 200 %}{{ s|replace('x', s)|replace('x', s) }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(22) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'x'.center(120000000) }}",
    "{% set s = 'x' * 1000 %}{% for i in range(2000) %}{{ s }}{% endfor %}",
])
def test_a_template_doing_unbounded_work_is_refused_quickly(tokenizer, template):
    tok = _with_template(tokenizer, template)
    t0 = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="more work than rendering a prompt takes"):
        ChatFormat.for_tokenizer(tok)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("template, words", [
    ("{{ raise_exception('no chat here') }}", "cannot be rendered: TemplateError: no chat here"),
    ("{% for %}", "cannot be rendered: TemplateSyntaxError"),
])
def test_a_template_that_raises_or_does_not_parse_is_one_line(tokenizer, template, words):
    with pytest.raises(KvcInputError, match=words) as e:
        ChatFormat.for_tokenizer(_with_template(tokenizer, template))
    assert "\n" not in str(e.value)


def test_a_template_refusing_the_system_turn_still_renders_with_it_in_the_user_turn(tokenizer):
    """Gemma's templates raise on a system message: the fallback (system text at the head of the user turn) stays."""
    tpl = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
           "{% for m in messages %}<u>{{ m.content }}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    fmt = ChatFormat.for_tokenizer(_with_template(tokenizer, tpl))
    assert fmt.templated and fmt.question_tail == "</u><a>"


def test_the_real_templates_render_as_transformers_renders_them(tokenizer):
    from kvcodec.models.chatguard import render_chat_template

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat_template(tokenizer, msgs) == tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                                   tokenize=False)


def test_kvc_ask_on_a_model_with_a_raising_template_is_one_line(tmp_path, monkeypatch, capsys):
    from tests._support.tiny_models import make_tiny_model

    d = make_tiny_model(tmp_path / "m", "dense")
    (d / "chat_template.jinja").write_text("{{ raise_exception('nope') }}")
    (tmp_path / "doc.txt").write_text("a short document")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()  # what saving the model printed
    code, _, err = run_kvc(["ask", "--doc", "doc.txt", "what?", "--preset", "lossless", "--max-new-tokens", "2",
                            "--store", str(tmp_path / "st"), "-m", str(d)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == KvcInputError.exit_code and len(lines) == 1 and "TemplateError: nope" in lines[0], err


def test_named_templates_are_each_checked_before_transformers_renders_one(tokenizer):
    """A tokenizer may carry a dict of named templates: the dry run skipped it, so the constant was built (120 MB
    here; any size) by transformers' own compile before the output's size was looked at."""
    tok = _with_template(tokenizer, {"default": "{{ 'x' * 120000000 }}", "tool_use": "{{ messages }}"})
    with pytest.raises(TemplateBudgetError, match="more work than rendering a prompt takes"):
        ChatFormat.for_tokenizer(tok)
