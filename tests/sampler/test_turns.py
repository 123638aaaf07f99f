"""Multi-turn rollouts (``sampler.turns``): the host's side with a scripted model (which
text it writes is fixed, so every case is exact), then the real sampler on a tiny model:
the shapes of a rollout without tools, the model's own log-probs, determinism given the key."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from grpo_jax.sampler import SamplingParams
from grpo_jax.sampler import slots
from grpo_jax.sampler.engines import ENGINES
from grpo_jax.sampler.host import Rollout
from grpo_jax.sampler.turns import ToolUse, generate_with_tools
from grpo_jax.tools import LocalSandbox, PythonTool, SandboxLimits
from grpo_jax.tools.python_tool import statuses

EOS = 3
SANDBOX = LocalSandbox(SandboxLimits(wall_seconds=2, cpu_seconds=1, memory_bytes=192 << 20))
# For the random model's rollouts: its blocks are a few characters that end at once, and two
# rollouts that draw the same blocks are compared status by status, so no time limit may be
# reached by a process that only started slowly on a loaded machine.
UNHURRIED = LocalSandbox(SandboxLimits(wall_seconds=60, cpu_seconds=10, memory_bytes=192 << 20))


class Chars:
    """A tokenizer of one token per character (ids = code points below 128; 3 is eos)."""

    vocab_size = 128
    stop_ids = [EOS]
    pad_id = 0

    def encode(self, text, add_bos=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != EOS)


@dataclasses.dataclass(frozen=True)
class Scripted:
    """A sampler whose model writes ``turns[p][k]`` (then eos) for prompt p after the k-th
    tool output: each call continues the current turn's text from where the context left it,
    stops on the call's stop tokens or at its length, and logs -(id / 1000) per token.
    ``seen`` records each call's (rows, max_new_tokens, stop tokens)."""

    turns: tuple
    settings: SamplingParams
    seen: list = dataclasses.field(default_factory=list)

    engine = ENGINES["scan"]  # a static engine: the rollout samples in calls

    def with_settings(self, **changes):
        return dataclasses.replace(self, settings=self.settings.replace(**changes))

    def generate(self, weights, prompts, *, key, group_size=1, prompts_per_call=0, between_calls=None,
                 row_ids=None, first_cols=None):
        tok, s = Chars(), self.settings
        contexts = [list(p) for p in prompts for _ in range(group_size)]
        self.seen.append((len(contexts), s.max_new_tokens, set(s.stop_tokens)))
        rows = np.full((len(contexts), s.max_new_tokens), 0, np.int32)
        for i, ctx in enumerate(contexts):
            text = tok.decode(ctx)
            prompt_index = int(text[1])  # prompts are "P<p>:"
            k = text.count("```output")
            tail = text[text.rfind("```\n") + 4:] if k else text[3:]
            plan = tok.encode(self.turns[prompt_index][k]) + [EOS]
            new = plan[len(tail):]
            for j, t in enumerate(new[: s.max_new_tokens]):
                rows[i, j] = t
                if t in s.stop_tokens:
                    break
        mask = np.zeros_like(rows, bool)
        for i in range(len(rows)):
            nz = np.flatnonzero(rows[i])
            mask[i, : (nz[-1] + 1 if len(nz) else 0)] = True
        tp = max(len(c) for c in contexts)
        pt = np.array([[0] * (tp - len(c)) + c for c in contexts], np.int32)
        return Rollout(prompt_tokens=pt, prompt_mask=pt > 0, tokens=rows, mask=mask,
                       logprobs=np.where(mask, -rows / 1000.0, 0.0).astype(np.float32),
                       lengths=mask.sum(1), finished=np.isin(rows, [EOS]).any(1))


def _run(turns, *, budget=64, max_calls=2, tool=None, group_size=1, workers=None):
    sampler = Scripted(tuple(turns), SamplingParams(max_new_tokens=budget, stop_tokens=(EOS,)))
    tools = ToolUse.build(tool or PythonTool(SANDBOX), Chars(), max_calls, workers)
    prompts = [Chars().encode(f"P{p}:") for p in range(len(turns))]
    rollout, runs = generate_with_tools(sampler, None, prompts, key=jax.random.key(0), group_size=group_size,
                                        tools=tools)
    texts = [Chars().decode(np.asarray(rollout.tokens[r])[np.asarray(rollout.mask[r])]) for r in range(len(runs))]
    return rollout, runs, texts, sampler.seen


def test_a_closed_block_runs_and_its_output_joins_the_completion():
    turns = [("I compute.\n```python\nprint(6 * 7)\n```", " So 42."), ("No code here.",)]
    rollout, runs, texts, seen = _run(turns)
    assert texts[0] == "I compute.\n```python\nprint(6 * 7)\n```\n```output\n42\n```\n So 42."
    assert texts[1] == "No code here."
    assert [[r.status for r in row] for row in runs] == [["ok"], []]
    tool = np.asarray(rollout.tool_mask[0])
    written = Chars().decode(np.asarray(rollout.tokens[0])[tool])
    assert written == "\n```output\n42\n```\n"  # exactly the tool's tokens are marked
    assert np.all(np.asarray(rollout.logprobs[0])[tool] == 0.0)
    own = np.asarray(rollout.mask[0]) & ~tool
    np.testing.assert_allclose(np.asarray(rollout.logprobs[0])[own], -np.asarray(rollout.tokens[0])[own] / 1000,
                               rtol=1e-6)
    assert rollout.finished.tolist() == [True, True]
    assert rollout.tokens.shape == rollout.mask.shape == rollout.tool_mask.shape == (2, 64)
    # an opening fence stops the row too (it may close a block), then it decodes on
    assert len(seen) >= 3 and all({ord("`"), EOS} <= stops for _, _, stops in seen[:2])


def test_a_tool_that_times_out_ends_the_turn_with_a_status_the_reward_reads():
    turns = [("```python\nwhile True:\n    pass\n```", " It timed out.")]
    _, runs, texts, _ = _run(turns, budget=128)
    assert [r.status for r in runs[0]] == ["timeout"]
    assert f"[timeout: {runs[0][0].detail}]\n```\n It timed out." in texts[0]  # wall or CPU time
    assert statuses(texts[0]) == ["timeout"]


def test_errors_say_their_exception_and_calls_stop_at_max_calls():
    block = "```python\nprint(1 / 0)\n```"
    turns = [(block, block, block + " done")]
    _, runs, texts, _ = _run(turns, budget=256, max_calls=2)
    assert [r.status for r in runs[0]] == ["error", "error"]
    assert statuses(texts[0]) == ["error", "error"]
    assert "[error: ZeroDivisionError: division by zero]" in texts[0]
    assert texts[0].endswith(block + " done")  # the third block is only text
    assert texts[0].count("```output") == 2


def test_the_budget_bounds_the_models_and_the_tools_tokens_together():
    turns = [("```python\nprint('x' * 300)\n```", " never written")]
    rollout, runs, texts, seen = _run(turns, budget=48)
    assert len(runs[0]) == 1 and int(rollout.lengths[0]) == 48 and not rollout.finished[0]
    assert texts[0] == "```python\nprint('x' * 300)\n```\n```output\n" + "x" * 7
    assert all(rows and new >= 1 for rows, new, _ in seen)


def test_rows_of_a_group_each_call_their_own_tool_and_keep_their_row():
    turns = [("```python\nprint(1)\n```", " a"), ("plain",)]
    rollout, runs, texts, seen = _run(turns, group_size=3)
    assert texts == [texts[0]] * 3 + ["plain"] * 3
    assert [len(r) for r in runs] == [1, 1, 1, 0, 0, 0]
    # later calls sample the running rows only, padded to a power of two
    assert seen[0][0] == 6 and all(rows in (1, 2, 4) for rows, _, _ in seen[1:])


class Recording:
    """A sandbox that notes the code of each run as it finishes (from whichever thread)."""

    def __init__(self, sandbox):
        self.sandbox, self.finished = sandbox, []

    def run(self, code):
        result = self.sandbox.run(code)
        self.finished.append(code)
        return result


def test_one_calls_blocks_run_at_once_and_come_back_in_row_order():
    # row 0's block sleeps, so rows 1 and 2 finish first; each row still gets its own output
    turns = [("```python\nimport time; time.sleep(0.8); print('zero')\n```", " a"),
             ("```python\nprint('one')\n```", " b"), ("```python\nprint('two')\n```", " c")]
    recording = Recording(SANDBOX)
    rollout, runs, texts, _ = _run(turns, budget=128, tool=PythonTool(recording), workers=3)
    assert "sleep" in recording.finished[-1]  # finished last: the three ran at once
    for text, word, end in zip(texts, ("zero", "one", "two"), " a b c".split()):
        assert text.endswith(f"\n```output\n{word}\n```\n {end}"), text
    assert [[r.status for r in row] for row in runs] == [["ok"]] * 3
    # the same rollout, token for token, as one block after another
    one_by_one, runs_1, texts_1, _ = _run(turns, budget=128, workers=1)
    assert texts_1 == texts and [[r.stdout for r in row] for row in runs_1] == [[r.stdout for r in row] for row in runs]
    for field in ("tokens", "mask", "tool_mask", "logprobs", "finished"):
        np.testing.assert_array_equal(getattr(rollout, field), getattr(one_by_one, field), err_msg=field)


def test_a_block_that_times_out_or_fails_leaves_the_other_rows_as_they_are_alone():
    fine = ("```python\nprint(6 * 7)\n```", " So 42.")
    turns = [("```python\nwhile True:\n    pass\n```", " slow"), fine, ("```python\nprint(1 / 0)\n```", " bad"), fine]
    _, runs, texts, _ = _run(turns, budget=128, workers=4)
    assert [[r.status for r in row] for row in runs] == [["timeout"], ["ok"], ["error"], ["ok"]]
    _, alone_runs, alone, _ = _run([fine], budget=128, workers=1)
    assert texts[1] == texts[3] == alone[0] and runs[1][0].stdout == alone_runs[0][0].stdout == "42\n"


def test_tool_use_needs_a_closing_token_a_call_and_a_worker():
    with pytest.raises(ValueError, match="max_calls must be >= 1"):
        ToolUse.build(PythonTool(SANDBOX), Chars(), 0)
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="workers .* must be an int >= 1"):
            ToolUse.build(PythonTool(SANDBOX), Chars(), 1, bad)
    assert ToolUse.build(PythonTool(SANDBOX), Chars(), 1, 0).workers == min(4, os.cpu_count() or 1)
    assert ToolUse.build(PythonTool(SANDBOX), Chars(), 1, 3).workers == 3
    with pytest.raises(ValueError, match="no token of the vocabulary holds"):
        ToolUse.build(PythonTool(SANDBOX, close="\u20ac"), Chars(), 1)


class Alphabet:
    """Four tokens (pad, eos, "a", "b"), so a random model writes the tool's markers ("a"
    opens a block, "b" closes it) all the time; other characters encode as "a"."""

    chars = ["", "", "a", "b"]
    vocab_size, stop_ids, pad_id = 4, [1], 0

    def encode(self, text, add_bos=False):
        return [3 if c == "b" else 2 for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


@pytest.fixture(scope="module")
def tiny():
    from grpo_jax.config import cpu_tiny
    from grpo_jax.model import transformer as model
    from grpo_jax.sampler import Sampler

    cfg = dataclasses.replace(cpu_tiny().model, vocab_size=4, max_seq_len=64, tie_embeddings=False)
    params = model.init_params(cfg, jax.random.key(1))
    # no stop token: every row runs to the budget, through several tool calls
    sampler = Sampler(cfg, None, SamplingParams(max_new_tokens=16, pad_id=0))
    tools = ToolUse.build(PythonTool(UNHURRIED, open="a", close="b"), Alphabet(), 2)
    return cfg, params, sampler, tools


def test_a_real_rollout_is_deterministic_given_its_key_and_logs_the_models_own_tokens(tiny):
    from grpo_jax.model.logprobs import sequence_logprobs

    cfg, params, sampler, tools = tiny
    prompts = [[2, 3, 2]]
    run = lambda seed: generate_with_tools(sampler, params, prompts, key=jax.random.key(seed), group_size=2,
                                           tools=tools)
    (a, runs_a), (b, runs_b), (c, _) = run(0), run(0), run(1)
    for field in ("tokens", "mask", "tool_mask", "logprobs", "finished"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert [[r.stderr for r in row] for row in runs_a] == [[r.stderr for r in row] for row in runs_b]
    assert not np.array_equal(a.tokens, c.tokens)
    # the shapes of a rollout without tools; the tool was called
    plain = sampler.generate(params, prompts, key=jax.random.key(0), group_size=2)
    assert a.tokens.shape == plain.tokens.shape == (2, 16) and a.prompt_tokens.shape == plain.prompt_tokens.shape
    assert sum(map(len, runs_a)) >= 1 and np.asarray(a.tool_mask).any()
    # log-probs: the model's own tokens', as one forward pass over the whole completion
    # (the tool's output in the context) gives them; 0 on the tool's tokens
    full = np.asarray(sequence_logprobs(cfg, params, a, temperature=1.0, chunk_size=16))
    own = np.asarray(a.mask) & ~np.asarray(a.tool_mask)
    np.testing.assert_allclose(np.asarray(a.logprobs)[own], full[own], atol=2e-5)
    assert np.all(np.asarray(a.logprobs)[np.asarray(a.tool_mask)] == 0.0)


def test_a_real_rollout_is_the_same_with_its_blocks_run_at_once_or_one_by_one(tiny):
    cfg, params, sampler, tools = tiny
    prompts = [[2, 3, 2], [3, 2]]
    out = {}
    for workers in (1, 4):
        out[workers] = generate_with_tools(sampler, params, prompts, key=jax.random.key(3), group_size=4,
                                           tools=dataclasses.replace(tools, workers=workers))
    (a, runs_a), (b, runs_b) = out[1], out[4]
    for field in ("tokens", "mask", "tool_mask", "logprobs", "finished"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert [[(r.status, r.stdout, r.stderr) for r in row] for row in runs_a] == \
        [[(r.status, r.stdout, r.stderr) for r in row] for row in runs_b]
    assert sum(len(row) >= 1 for row in runs_a) >= 2  # several rows called at once


@pytest.mark.parametrize("num_slots", [1, 3, 8])
def test_the_slot_engine_keeps_each_rows_cache_through_its_tool_calls_and_draws_the_same_rows(tiny, num_slots):
    """rl.decode=slots: a row pauses in its slot on a closing fence, its block runs, and only
    the output's tokens go through the model; every row equals the calls' (fresh prefills of
    the whole context), tool columns and tool runs included, on 1 slot (rows one by one), 3
    (refilled) or all 8."""
    cfg, params, sampler, tools = tiny
    prompts = [[2, 3, 2], [3, 2]]
    slotted = dataclasses.replace(sampler, settings=sampler.settings.replace(engine="slots", slots=num_slots))
    a, runs_a = generate_with_tools(sampler, params, prompts, key=jax.random.key(3), group_size=4, tools=tools)
    slots.APPENDED.clear()
    b, runs_b = generate_with_tools(slotted, params, prompts, key=jax.random.key(3), group_size=4, tools=tools)
    # a tool call put its output's tokens through the model, nothing more
    assert slots.APPENDED == {"tokens": int(np.asarray(b.tool_mask).sum()), "appends": sum(map(len, runs_b))}
    for field in ("prompt_tokens", "tokens", "mask", "tool_mask", "lengths", "finished"):
        np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field)
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
    assert [[(r.status, r.stdout) for r in row] for row in runs_a] == [[(r.status, r.stdout) for r in row]
                                                                          for row in runs_b]
    assert sum(len(row) >= 1 for row in runs_a) >= 2 and np.asarray(a.tool_mask).any()


def test_a_continuation_draws_as_the_row_it_continues(tiny):
    """Row r's token at column t comes from uniforms(key, t, r) whichever call draws it: a
    row resumed at column 5 as row 3 of a later call draws what the single-turn rollout drew
    at its columns 5.. (no tools: the context is the row's own first five tokens)."""
    cfg, params, sampler, _ = tiny
    prompts = [[2, 3, 2], [3, 2]]
    whole = sampler.generate(params, prompts, key=jax.random.key(5), group_size=2)
    r = 3
    context = list(prompts[r // 2]) + np.asarray(whole.tokens[r, :5]).tolist()
    rest = sampler.with_settings(max_new_tokens=11).generate(params, [context], key=jax.random.key(5),
                                                             row_ids=[r], first_cols=[5])
    np.testing.assert_array_equal(np.asarray(rest.tokens[0]), np.asarray(whole.tokens[r, 5:]))
    np.testing.assert_allclose(np.asarray(rest.logprobs[0]), np.asarray(whole.logprobs[r, 5:]), atol=1e-5)

