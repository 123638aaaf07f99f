"""A model's own chat template, rendered as transformers renders it, inside a sandbox.

    text = render(template, [{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>"})

A chat template is Jinja code that comes with a model's files: untrusted input. It runs in
jinja2's `ImmutableSandboxedEnvironment` (no attribute access to Python internals, no
mutation of the inputs), with the globals and filters transformers gives templates
(`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, `namespace`,
loop controls, the `{% generation %}` tag), so a template renders here to the string
transformers' `apply_chat_template` renders. On top of the sandbox, every render is bounded:

- the template's text: at most `MAX_TEMPLATE_CHARS` characters;
- time: `time_limit_s` seconds, checked on every line of template code the render executes
  (a trace on the template's frames) and on every call it makes;
- size: the output and every string or list that `~`, `+`, `*` or a call builds stay under
  `max_chars`, integer arguments of calls and `**` stay small, and products and powers stay
  under `MAX_INT_BITS` bits, so a template cannot allocate gigabytes, or compute for minutes,
  in one operation before a check sees it.

A template that breaks a bound, fails to compile or raises stops with `ChatTemplateError`,
one line naming what went wrong; nothing falls back to another format silently.

Named formats (`FORMATS`) are small templates of this project's own for a model that has no
usable template of its own: the user names one (`run.chat_format`, `grpo-evaluate
--chat-format`), and it is rendered and exported like a model's own.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

from grpo_jax.errors import PretrainedError

MAX_TEMPLATE_CHARS = 200_000
MAX_OUTPUT_CHARS = 1_000_000
TIME_LIMIT_S = 2.0
# Integer arguments above this (a width, a count, an exponent) are refused: chat templates
# indent by a few spaces and truncate at a few thousand characters.
MAX_INT_ARG = 100_000
MAX_INT_BITS = 100_000  # a product or power the template computes
_TEMPLATE_FILE = "<template>"  # the filename jinja compiles a from_string template under

# The formats a user can name for a model without a usable template of its own. "plain" is
# no chat format at all: grpo_jax.tasks.prompts writes its "Question: ...\nAnswer:" text.
FORMATS: dict[str, str | None] = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
               " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
    # DeepSeek-LLM's format (DeepSeekMath-Instruct/RL): "User: ...\n\nAssistant:".
    "deepseek": ("{% for message in messages %}{% if message['role'] == 'user' %}"
                 "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
                 "{{ 'Assistant: ' + message['content'] + eos_token }}{% else %}{{ message['content'] + '\\n\\n' }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"),
    "plain": None,
}


class ChatTemplateError(PretrainedError):
    """A chat template that cannot be used: too large, does not compile, raises, or breaks a bound."""


class _Timeout(Exception):
    pass


def _bounded_size(value: Any, limit: int) -> Any:
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > limit:
        raise ChatTemplateError(f"the chat template built a value of {len(value)} items (limit {limit})")
    return value


def _check_ints(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise ChatTemplateError(f"the chat template passed the integer {a} to a call (limit {MAX_INT_ARG})")


@functools.lru_cache(maxsize=1)
def _environment_class():
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """`a ~ b` compiles to a join; wrap it so the joined string's size is checked."""

        def visit_Concat(self, node, frame):
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"+", "*", "**"})
        # The bounds of the render in progress, per thread: one compiled template (and its
        # environment) serves every thread that renders it.
        _bounds = threading.local()

        @property
        def max_chars(self):
            return getattr(self._bounds, "max_chars", MAX_OUTPUT_CHARS)

        @property
        def deadline(self):
            return getattr(self._bounds, "deadline", float("inf"))

        def set_bounds(self, max_chars: int, deadline: float) -> None:
            self._bounds.max_chars, self._bounds.deadline = max_chars, deadline

        def bounded(self, value):
            return _bounded_size(value, self.max_chars)

        def check_time(self):
            if time.monotonic() > self.deadline:
                raise _Timeout()

        def call_binop(self, context, operator, left, right):
            self.check_time()
            if operator == "**":
                _check_ints((right,), {})
            ints = isinstance(left, int) and isinstance(right, int)
            # Big-integer arithmetic is one C call the time check cannot interrupt: bound the
            # size of its result before computing it.
            if ints and operator == "**" and abs(left) > 1 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
                raise ChatTemplateError(
                    f"the chat template raised a number to the power {right} (over {MAX_INT_BITS} bits)")
            if ints and operator == "*" and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateError(f"the chat template multiplied numbers of over {MAX_INT_BITS} bits")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > self.max_chars:
                        raise ChatTemplateError(
                            f"the chat template repeated a value {n} times (limit {self.max_chars} items)")
            return self.bounded(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            __self.check_time()
            _check_ints(args, kwargs)
            return __self.bounded(super().call(__context, __obj, *args, **kwargs))

    return jinja2, BoundedEnvironment


@functools.lru_cache(maxsize=32)
def _compiled(template: str):
    jinja2, env_class = _environment_class()
    from jinja2.ext import Extension, loopcontrols

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens
        for training masks); rendering keeps the body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        # As transformers: no underscore names on a namespace (a way towards Python internals).
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the name {name!r}")

    env = env_class(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace)
    # Filters are called directly by compiled code, not through `call`: bound them too.
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(env, fn)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None


def _bounded_filter(env, fn):
    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        env.check_time()
        _check_ints(args[1:], kwargs)
        return env.bounded(fn(*args, **kwargs))
    return bounded


def render(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str | None] | None = None, time_limit_s: float = TIME_LIMIT_S,
           max_chars: int = MAX_OUTPUT_CHARS, **extra: Any) -> str:
    """`template` rendered for `messages` as transformers' `apply_chat_template(...,
    tokenize=False)` renders it: the variables are `messages`, `add_generation_prompt`, the
    special tokens' strings (bos_token, eos_token, ...) and `extra` (tools, documents, ...)."""
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the chat template is empty")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"the chat template has {len(template)} characters (limit {MAX_TEMPLATE_CHARS})")
    import jinja2

    compiled = _compiled(template)
    env = compiled.environment
    variables = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt,
                 "tools": None, "documents": None,
                 **{k: v for k, v in (special_tokens or {}).items() if v is not None}, **extra}
    env.set_bounds(max_chars, time.monotonic() + time_limit_s)

    # Loops of template code that call nothing (`{% for i in range(n) %}{% endfor %}`) are
    # seen by a line trace on the template's own frames; other frames run untraced.
    def line_check(frame, event, arg):
        if event == "line":
            env.check_time()
        return line_check

    def trace(frame, event, arg):
        return line_check if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    # Under a debugger or coverage tracer, keep theirs: calls and filters are still timed.
    if previous is None:
        sys.settrace(trace)
    chunks, size = [], 0
    try:
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > max_chars:
                raise ChatTemplateError(f"the chat template's output passed {max_chars} characters")
            chunks.append(chunk)
    except _Timeout:
        raise ChatTemplateError(f"the chat template took more than {time_limit_s:g} s to render") from None
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template raised: {' '.join(str(e).split())}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, RecursionError,
            OverflowError, MemoryError) as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    finally:
        if previous is None:
            sys.settrace(None)
        env.set_bounds(MAX_OUTPUT_CHARS, float("inf"))
    return "".join(chunks)


def template_of(name: str) -> str | None:
    """The template of a named format (None for "plain"); unknown names are refused."""
    if name not in FORMATS:
        raise ChatTemplateError(f"unknown chat format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]
