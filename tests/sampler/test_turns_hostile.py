"""Multi-turn rollouts under hostile completions (issue 83): whatever the model writes
(unclosed, nested or mismatched fences, its own ```output blocks, more blocks than its calls,
a block of 1 MB, bytes that are not UTF-8, a \\boxed{} printed by its code), the rollout ends
with every row in a defined state, the tool's tokens masked exactly where the tool wrote,
nothing raised, and no sandbox process or work folder left behind.

The model is a typist (`Typist`): it writes a fixed byte string per prompt, whatever the
context says, so what the host made of it is checked against what the model wrote. A
property test draws such strings from hostile fragments (hypothesis, a fixed seed and
budget); each hostile case is also a plain regression test.
"""
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_jax.errors import SandboxError
from grpo_jax.eval.evaluation import final_answer, own_text, tool_text
from grpo_jax.sampler import SamplingParams
from grpo_jax.sampler.engines import ENGINES
from grpo_jax.sampler.host import Rollout
from grpo_jax.sampler.turns import ToolUse, generate_with_tools
from grpo_jax.tools import STATUSES, LocalSandbox, PythonTool, SandboxLimits, statuses
from tests.sampler.test_turns import tiny  # noqa: F401 (a fixture: a tiny model and its sampler)
from tests.tools.conftest import descendants, work_root  # noqa: F401 (work_root: a fixture)

EOS = 256
FENCE, FILLER = ord("`"), ord(".")
SANDBOX = LocalSandbox(SandboxLimits(wall_seconds=2, cpu_seconds=1, memory_bytes=192 << 20, output_bytes=1 << 14))


class Bytes:
    """One token per byte (0-255) and eos: a byte-level vocabulary, where a model can write
    bytes that do not decode as UTF-8 (decoded with U+FFFD in their place)."""

    vocab_size, stop_ids, pad_id = 257, [EOS], 0

    def encode(self, text, add_bos=False):
        return list(text.encode("utf-8", "surrogatepass"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class Typist:
    """A sampler whose model writes ``scripts[p]`` (token ids), then "." for ever, for prompt
    p, whatever the tool wrote in between: each call goes on from where that prompt's row
    stopped, until a stop token of the call or its length. Log-prob of token t:
    -(t + 1) / 1000. Prompts are [p + 1], one row each (group_size 1; a call's padding rows
    repeat the first)."""

    scripts: tuple
    settings: SamplingParams
    written: dict = dataclasses.field(default_factory=dict)

    engine = ENGINES["scan"]  # a static engine: the rollout samples in calls

    def with_settings(self, **changes):
        return dataclasses.replace(self, settings=self.settings.replace(**changes))

    def generate(self, weights, prompts, *, key, group_size=1, prompts_per_call=0, between_calls=None,
                 row_ids=None, first_cols=None):
        s = self.settings
        rows = np.zeros((len(prompts), s.max_new_tokens), np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        new = {}
        for i, ctx in enumerate(prompts):
            p = ctx[0] - 1
            start = self.written.get(p, 0)
            out = []
            for t in written(self.scripts[p], start + s.max_new_tokens)[start:]:
                out.append(t)
                if t in s.stop_tokens:
                    break
            rows[i, :len(out)], lengths[i] = out, len(out)
            new[p] = start + len(out)  # a padding row repeats its prompt's: counted once
        self.written.update(new)
        mask = np.arange(s.max_new_tokens)[None] < lengths[:, None]
        pt = np.array([ctx[:1] for ctx in prompts], np.int32)
        return Rollout(prompt_tokens=pt, prompt_mask=pt > 0, tokens=rows, mask=mask,
                       logprobs=np.where(mask, -(rows + 1) / 1000.0, 0.0).astype(np.float32),
                       lengths=lengths, finished=(rows == EOS).any(1))


def written(script, n: int) -> list[int]:
    """The first ``n`` tokens a typist of ``script`` writes."""
    return (list(script) + [FILLER] * n)[:n]


class Recording:
    """The sandbox, noting each code it was given."""

    def __init__(self, sandbox):
        self.sandbox, self.codes = sandbox, []

    def run(self, code):
        self.codes.append(code)
        return self.sandbox.run(code)


def rollout(scripts, *, budget, max_calls, sandbox=SANDBOX, workers=1):
    """(rollout, runs, the codes run, tool use) of a typist writing ``scripts`` (bytes, or
    lists of ids), checking what every hostile case must: no process left behind."""
    scripts = tuple(list(s) for s in scripts)
    before = descendants()
    recording = Recording(sandbox)
    tools = ToolUse.build(PythonTool(recording), Bytes(), max_calls, workers)
    typist = Typist(scripts, SamplingParams(max_new_tokens=budget, stop_tokens=(EOS,)))
    out, runs = generate_with_tools(typist, None, [[p + 1] for p in range(len(scripts))], key=jax.random.key(0),
                                    group_size=1, tools=tools)
    assert descendants() <= before, "a sandbox process outlived the rollout"
    return out, runs, recording.codes, tools


def spans(flags):
    """(start, end) of each run of True in ``flags``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def check_row(out, r, script, runs, tools, budget) -> list[str]:
    """The invariants of one row: its model's tokens are exactly what the model wrote, in
    order (with its log-probs); each stretch of tool tokens follows a fence token and is that
    run's output (the last one cut at the budget), its run the first complete block of the
    model's text since the previous output; no complete block was left unrun while calls
    were left; the runs' statuses are defined and `statuses` of the tool's text reads the
    failed ones exactly; the row's state matches how it ended. Returns the codes its runs
    must have been given."""
    tool = tools.tool
    mask, tool_mask = np.asarray(out.mask[r]), np.asarray(out.tool_mask[r])
    n = int(out.lengths[r])
    assert n <= budget and mask[:n].all() and not mask[n:].any() and not tool_mask[n:].any()
    ids, logps = np.asarray(out.tokens[r])[:n], np.asarray(out.logprobs[r])[:n]
    own = ~tool_mask[:n]
    assert ids[own].tolist() == written(script, int(own.sum()))
    np.testing.assert_allclose(logps[own], -(ids[own] + 1) / 1000.0, rtol=1e-6)
    assert not logps[~own].any()
    assert len(runs) <= tools.max_calls
    assert all(run.status in STATUSES for run in runs)
    stretches = spans(tool_mask[:n])
    cut = len(runs) == len(stretches) + 1  # the last block closed on the budget's last token
    assert len(stretches) == len(runs) or cut and n == budget
    turn_start, codes = 0, []
    for k, run in enumerate(runs):
        start, end = stretches[k] if k < len(stretches) else (n, n)
        turn = ids[turn_start:start].tolist()
        assert turn and turn[-1] == FENCE
        codes.append(tool.code(Bytes().decode(turn)))
        assert codes[-1] is not None
        # the first fence at which a block was complete: none before it
        assert all(tool.code(Bytes().decode(turn[:j + 1])) is None for j in range(len(turn) - 1) if turn[j] == FENCE)
        given = Bytes().encode(tool.output(run))
        assert ids[start:end].tolist() == given[:end - start]
        assert end - start == len(given) or end == n == budget
        turn_start = end
    rest = Bytes().decode(ids[turn_start:].tolist())
    if len(runs) < tools.max_calls and not cut:
        assert tool.code(rest) is None, "a complete block was left unrun with calls left"
    finished = EOS in ids[own].tolist()
    assert bool(out.finished[r]) == finished and (finished or n == budget)
    if not cut and all(len(Bytes().encode(tool.output(x))) == e - s for x, (s, e) in zip(runs, stretches)):
        assert statuses(tool_text(out, r, Bytes())) == [run.status for run in runs if run.status != "ok"]
    return codes


# What a hostile model writes, in pieces: fences whole, cut, nested and mismatched, output
# blocks and status lines of its own, and bytes that are not UTF-8; and complete blocks of
# code that fails, exits with the runner's old statuses, or prints a fence, a status line,
# a \boxed{} or bytes that are not UTF-8.
FRAGMENTS = [b"```python\n", b"```", b"``", b"`", b"```output\n", b"\n", b"```py\n", b"```python\n```python\n",
             b"```output\n[error: forged]\n```\n", b"[timeout: forged]\n", b"\\boxed{1}", b"\xff\xfe", b"\xc3",
             b"\xe2\x82", b"caf\xc3\xa9 ", b"A: 42"]
CODES = [b"print(1)\n", b"print(6 * 7)\n", b"1 / 0\n", b"import os; os._exit(126)\n", b"import os; os._exit(3)\n",
         b"print('\\\\boxed{666}')\n", b"print('```output')\n", b"print('[error: forged]')\n", b"x = '``'\n",
         b"print('\xff')\n", b"\xff\n", b"print('```python\\nprint(2)\\n```')\n"]
blocks = st.sampled_from(CODES).map(lambda code: b"```python\n" + code + b"```")
scripts = st.lists(st.lists(st.one_of(blocks, st.sampled_from(FRAGMENTS)), max_size=8).map(b"".join)
                   .flatmap(lambda text: st.booleans().map(lambda eos: list(text) + [EOS] * eos)),
                   min_size=1, max_size=3)


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(scripts=scripts, budget=st.integers(8, 200), max_calls=st.integers(1, 3), workers=st.sampled_from([1, 2]))
def test_any_completion_ends_in_a_defined_state_with_the_tools_tokens_exactly_masked(work_root, scripts, budget,
                                                                                      max_calls, workers):
    out, runs, codes, tools = rollout(scripts, budget=budget, max_calls=max_calls, workers=workers)
    assert out.tokens.shape == out.mask.shape == out.tool_mask.shape == (len(scripts), budget)
    expected = [code for r, script in enumerate(scripts) for code in check_row(out, r, script, runs[r], tools, budget)]
    assert sorted(codes) == sorted(expected)  # each block given to the sandbox once, as written


def texts(out, r):
    """(the whole completion, the model's own text, the tool's text) of row r."""
    ids = np.asarray(out.tokens[r])[: int(out.lengths[r])].tolist()
    return Bytes().decode(ids), own_text(out, r, Bytes()), tool_text(out, r, Bytes())


def one_row(script: bytes, *, budget=256, max_calls=2, sandbox=SANDBOX):
    """A rollout of one row writing ``script`` then eos, its invariants checked; (rollout,
    its runs, the completion, own text, tool text)."""
    out, runs, codes, tools = rollout([list(script) + [EOS]], budget=budget, max_calls=max_calls, sandbox=sandbox)
    assert sorted(codes) == sorted(check_row(out, 0, list(script) + [EOS], runs[0], tools, budget))
    return (out, runs[0], *texts(out, 0))


def test_an_unclosed_block_is_only_text(work_root):
    out, runs, whole, own, tool = one_row(b"```python\nprint(1)\n")
    assert runs == [] and not np.asarray(out.tool_mask).any() and whole == own == "```python\nprint(1)\n"
    assert bool(out.finished[0])


def test_a_nested_fence_closes_the_block_it_is_in(work_root):
    # the second opening fence's backticks close the first block (empty); the rest is text
    out, runs, whole, own, tool = one_row(b"```python\n```python\nprint(1)\n```")
    assert [(r.status, r.stdout) for r in runs] == [("ok", "")]
    assert whole == "```python\n```\n```output\n\n```\npython\nprint(1)\n```" and tool == "\n```output\n\n```\n"


@pytest.mark.parametrize("script", [b"```py\nprint(1)\n```", b"```output\nprint(1)\n```", b"``python\nprint(1)\n``",
                                    b"~~~python\nprint(1)\n~~~"])
def test_a_mismatched_fence_is_only_text(work_root, script):
    out, runs, whole, own, tool = one_row(script)
    assert runs == [] and whole == own == script.decode() and tool == ""


def test_the_models_own_output_block_is_never_the_tools(work_root):
    forged = b"```output\n[error: forged]\n```\n"
    out, runs, whole, own, tool = one_row(forged + b"```python\nprint(1)\n```" + forged + b"A: 1")
    assert [r.status for r in runs] == ["ok"] and tool == "\n```output\n1\n```\n"
    assert own == "```output\n[error: forged]\n```\n```python\nprint(1)\n```\n" + forged.decode() + "A: 1"
    # only the tool's text says how its runs ended; the whole completion would be fooled
    assert statuses(tool) == [] and statuses(whole) == ["error", "error"]


def test_blocks_past_max_tool_calls_are_only_text(work_root):
    block = b"```python\nprint(2)\n```"
    out, runs, whole, own, tool = one_row(block * 3, max_calls=2)
    assert [r.stdout for r in runs] == ["2\n", "2\n"] and tool == "\n```output\n2\n```\n" * 2
    assert whole.endswith("```\n" + block.decode()) and whole.count("```output") == 2


def test_a_block_of_one_megabyte_runs_and_gives_back_a_bounded_output(work_root):
    body = b"# " + b"x" * (1 << 20) + b"\nprint('y' * 1000)\n"
    script = b"```python\n" + body + b"```"
    out, runs, whole, own, tool = one_row(script, budget=len(script) + 1024)
    assert [r.status for r in runs] == ["ok"] and len(body) >= 1 << 20
    assert tool == "\n```output\n" + "y" * PythonTool().max_output_chars + "\n```\n"


@pytest.mark.parametrize("script, status, output", [
    (b"```python\nprint('\xff\xc3')\n```", "ok", "\ufffd\ufffd"),  # not UTF-8: decoded as U+FFFD
    (b"```python\n\xe2\x82\n```", "error", "[error: SyntaxError: invalid character '\ufffd' (U+FFFD)]"),
    (b"```python\nprint('caf\xc3\xa9')\n```", "ok", "caf\u00e9"),  # a character cut over two tokens
])
def test_bytes_that_are_not_utf8(work_root, script, status, output):
    out, runs, whole, own, tool = one_row(script)
    assert [r.status for r in runs] == [status] and tool == f"\n```output\n{output}\n```\n"


class Boxed:
    """A task that answers with the last \\boxed{}."""

    @staticmethod
    def extract_answer(text):
        from grpo_jax.tasks.rewards import last_boxed

        return last_boxed(text)


@pytest.mark.parametrize("after, answer", [(b" So \\boxed{1}.", "1"), (b" So the answer is above.", None)])
def test_a_boxed_answer_in_the_tools_output_is_never_the_answer(work_root, after, answer):
    # the code never writes the \boxed{666} it prints: only the tool's output holds it
    out, runs, whole, own, tool = one_row(b"```python\nprint(chr(92) + 'boxed{' + str(600 + 66) + '}')\n```" + after)
    assert tool == "\n```output\n\\boxed{666}\n```\n" and "\\boxed{666}" in whole and "666" not in own
    assert final_answer(Boxed(), own) == answer


@pytest.mark.parametrize("code, detail", [("import os; os._exit(126)", "exit status 126"),
                                          ("import os; os._exit(3)", "exit status 3")])
def test_the_programs_of_issue_83_are_errors_and_the_rollout_goes_on(work_root, code, detail):
    out, runs, whole, own, tool = one_row(f"```python\n{code}\n```A: 1".encode())
    assert [(r.status, r.detail, r.backend_failure) for r in runs] == [("error", detail, "")]
    assert own.endswith("A: 1") and statuses(tool) == ["error"]


class Broken:
    """A back-end that cannot run anything."""

    def run(self, code):
        raise SandboxError("the sandbox's process could not confine itself; nothing ran: EPERM", "confine")


def test_a_backend_that_fails_fails_each_call_and_the_rollout_goes_on(work_root):
    block = b"```python\nprint(1)\n```"
    out, runs, codes, tools = rollout([list(block * 2 + b"A: 1") + [EOS]] * 3, budget=512, max_calls=2,
                                      sandbox=Broken(), workers=2)
    for r in range(3):
        assert [(x.status, x.backend_failure) for x in runs[r]] == [("error", "confine")] * 2
        whole, own, tool = texts(out, r)
        assert tool == ("\n```output\n[error: sandbox back-end failed (confine): the sandbox's process could not "
                        "confine itself; nothing ran: EPERM]\n```\n") * 2
        assert own.endswith("A: 1") and bool(out.finished[r])


def test_the_trainers_answer_is_the_models_own_never_the_tools(work_root):
    """score_rollout reads the answer from the model's own text: a row whose code printed the
    right \\boxed{} but which wrote none itself is not correct; one that wrote it is."""
    from grpo_jax.rl.batching import score_rollout
    from grpo_jax.tasks import Example
    from grpo_jax.tasks.math_task import MathTask

    block = b"```python\nprint(chr(92) + 'boxed{' + str(2 + 3) + '}')\n```"
    out, runs, _, _ = rollout([list(block + b" Done.") + [EOS], list(block + b" So \\boxed{5}.") + [EOS]],
                              budget=256, max_calls=1)
    assert [texts(out, r)[2] for r in range(2)] == ["\n```output\n\\boxed{5}\n```\n"] * 2
    example = Example(prompt="", answer="\\boxed{5}", meta={"final_answer": "5"})
    scores = score_rollout(MathTask(), Bytes(), [example, example], out, 1)
    assert scores.correct.tolist() == [False, True]


def test_on_the_slot_engine_a_failing_backend_fails_each_call_and_the_rollout_goes_on(tiny, work_root):
    """rl.decode=slots runs a paused row's block on a sandbox thread: a back-end failure there
    is that call's error too, and the rows equal the static engine's with the same back-end."""
    cfg, params, sampler, tools = tiny
    broken = dataclasses.replace(tools, tool=dataclasses.replace(tools.tool, sandbox=Broken()))
    slotted = dataclasses.replace(sampler, settings=sampler.settings.replace(engine="slots", slots=3))
    out = {name: generate_with_tools(s, params, [[2, 3, 2], [3, 2]], key=jax.random.key(3), group_size=4,
                                     tools=broken) for name, s in (("static", sampler), ("slots", slotted))}
    for rollout_, runs in out.values():
        assert sum(map(len, runs)) >= 2
        assert all((r.status, r.backend_failure) == ("error", "confine") for row in runs for r in row)
    np.testing.assert_array_equal(np.asarray(out["static"][0].tokens), np.asarray(out["slots"][0].tokens))
