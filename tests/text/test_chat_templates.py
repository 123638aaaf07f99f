"""Chat templates in the sandbox (grpo_jax.text.chat_templates): golden strings of real model
families' templates, checked against transformers' apply_chat_template on the same text;
the bounds that stop a hostile template; named formats for a model without a template.

The templates' text is written out here (no download): Meta-Llama-3-Instruct's, Mistral-7B-
Instruct's [INST] one, Qwen2.5-Instruct's ChatML (with its tool branches) and DeepSeek-R1-
Distill-Qwen's. Each golden string is what transformers renders from that text; the test
renders it both ways, so it holds for the text as written even where a Hub revision differs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from grpo_jax.text import chat_templates
from grpo_jax.model import pretrained
from grpo_jax.tasks import prompts
from grpo_jax.cli import runs
from grpo_jax.text.bpe_tokenizer import BPETokenizer
from grpo_jax.text.chat_templates import ChatTemplateError, render
from grpo_jax.config import ModelConfig, load_config
from grpo_jax.model.transformer import init_params

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

R1_DISTILL_QWEN = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' "
    "+ tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}"
    "{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' "
    "+ '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] "
    "+ '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

SPECIALS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "qwen25": {"bos_token": None, "eos_token": "<|im_end|>"},
    "r1_distill_qwen": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
}
TEMPLATES = {"llama3": LLAMA3, "mistral": MISTRAL, "qwen25": QWEN25, "r1_distill_qwen": R1_DISTILL_QWEN}

ASK = [{"role": "user", "content": "What is 7 times 8?"}]
SYSTEM = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime."}]
TURNS = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>easy</think>4"},
         {"role": "user", "content": "  and 3+3? "}]
CONVERSATIONS = {"ask": ASK, "system": SYSTEM, "turns": TURNS}

# (template, conversation) -> the text with the generation prompt. Mistral has no system role.
GOLDEN = {
    ("llama3", "ask"): "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 7 times 8?<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("llama3", "system"): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
                          "<|start_header_id|>user<|end_header_id|>\n\nName a prime.<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("llama3", "turns"): "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n<think>easy</think>4<|eot_id|>"
                         "<|start_header_id|>user<|end_header_id|>\n\nand 3+3?<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("mistral", "ask"): "<s>[INST] What is 7 times 8? [/INST]",
    ("mistral", "turns"): "<s>[INST] 2+2? [/INST]<think>easy</think>4</s>[INST]   and 3+3?  [/INST]",
    ("qwen25", "ask"): "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                       "<|im_end|>\n<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n",
    ("qwen25", "system"): "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
                          "<|im_start|>assistant\n",
    ("qwen25", "turns"): "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                         "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>easy</think>4"
                         "<|im_end|>\n<|im_start|>user\n  and 3+3? <|im_end|>\n<|im_start|>assistant\n",
    ("r1_distill_qwen", "ask"): "<｜begin▁of▁sentence｜><｜User｜>What is 7 times 8?<｜Assistant｜><think>\n",
    ("r1_distill_qwen", "system"): "<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>Name a prime.<｜Assistant｜><think>\n",
    ("r1_distill_qwen", "turns"): "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
                                  "<｜User｜>  and 3+3? <｜Assistant｜><think>\n",
}


@pytest.fixture(scope="module")
def hf_render():
    """transformers' apply_chat_template(tokenize=False) on a tokenizer with `specials`."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    def rendered(template, messages, specials, add_generation_prompt=True, **kw):
        vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(v for v in specials.values() if v)}}
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>",
            **{k: v for k, v in specials.items() if v})
        tok.chat_template = template
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    return rendered


@pytest.mark.parametrize("family, convo", sorted(GOLDEN))
def test_templates_render_as_transformers_renders_them(family, convo, hf_render):
    template, specials, messages = TEMPLATES[family], SPECIALS[family], CONVERSATIONS[convo]
    ours = render(template, messages, add_generation_prompt=True, special_tokens=specials)
    assert ours == GOLDEN[family, convo]
    assert ours == hf_render(template, messages, specials)
    # Without the generation prompt: what a training example's full conversation renders to.
    assert render(template, messages, add_generation_prompt=False, special_tokens=specials) == hf_render(
        template, messages, specials, add_generation_prompt=False)


def test_tools_and_template_errors_match_transformers(hf_render):
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ours = render(QWEN25, ASK, special_tokens=SPECIALS["qwen25"], tools=tools)
    assert '\n{"type": "function", "function": {"name": "add", "description": "a+b"' in ours
    assert ours == hf_render(QWEN25, ASK, SPECIALS["qwen25"], tools=tools)
    # Mistral's template refuses a system turn: the template's own message, in one line.
    with pytest.raises(ChatTemplateError, match="the chat template raised: Conversation roles must alternate"):
        render(MISTRAL, SYSTEM, special_tokens=SPECIALS["mistral"])


@pytest.mark.parametrize("template, match", [
    ("{{ 'a' * 10000000 }}", "repeated a value 10000000 times"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "built a value of 1048576 items"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "built a value of 1048576 items"),
    ("{{ 'x'|center(1000000000) }}", "passed the integer 1000000000 to a call"),
    ("{{ 'x'.ljust(1000000000) }}", "passed the integer 1000000000 to a call"),
    ("{{ 2 ** 100000000 }}", "passed the integer 100000000"),
    ("{{ (7 ** 99999) ** 99999 }}", "raised a number to the power 99999"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "multiplied numbers of over 100000 bits"),
    ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "cannot hold the name '_x'"),
    ("{% for %}", "does not compile"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than 0.05 s"),
    ("{{ 'x' * 600000 }}{{ 'y' * 600000 }}", "output passed 1000000 characters"),
    ("x" * (chat_templates.MAX_TEMPLATE_CHARS + 1), "has 200001 characters"),
])
def test_a_hostile_template_stops_in_one_line(template, match):
    # A short time limit where time is the bound under test; elsewhere a long one, so that a
    # slow machine still reaches the bound the case is about.
    limit = 0.05 if "took more than" in match else 30.0
    with pytest.raises(ChatTemplateError, match=match) as e:
        render(template, ASK, time_limit_s=limit)
    assert "\n" not in str(e.value)
    # The sandbox is left as it was: the next render of a good template works.
    assert render(LLAMA3, ASK, special_tokens=SPECIALS["llama3"]) == GOLDEN["llama3", "ask"]


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory):
    """A tiny HF folder whose tokenizer has no chat template (a base model)."""
    from tests.text.test_bpe_tokenizer import tiny_meta

    path = tmp_path_factory.mktemp("base")
    tok = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": None}))
    cfg = ModelConfig(vocab_size=tok.vocab_size, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, mlp_dim=32, max_seq_len=64)
    import jax
    pretrained.export_hf(path, cfg, init_params(cfg, jax.random.key(0)), tok)
    return path


def test_a_named_format_is_used_trained_and_exported(no_template_model, tmp_path):
    """run.chat_format: the model's prompts in the named format; the export carries it as its
    chat template. Without it, a chat prompt for a model with no template is refused."""
    question = "What is 2+3?"
    base = ["rl.algorithm=sft", f"run.pretrained={no_template_model}", f"run.run_dir={tmp_path / 'run'}"]
    cfg = load_config("cpu-tiny", base)
    _, _, tok = runs.model_and_tokenizer(cfg, None, None, tokenizer_vocab=0)
    with pytest.raises(ChatTemplateError, match="has no chat template: name a chat format"):
        prompts.chat_prompt(question, tok, "arithmetic")
    cfg = load_config("cpu-tiny", base + ["run.chat_format=deepseek"])
    cfg, params, tok = runs.model_and_tokenizer(cfg, None, None, tokenizer_vocab=0)
    assert prompts.chat_prompt(question, tok, "arithmetic") == "User: What is 2+3?\n\nAssistant:"
    out = pretrained.export_hf(tmp_path / "export", cfg.model, params, tok)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == chat_templates.FORMATS["deepseek"]
    again = pretrained.load(out)[2]
    assert prompts.chat_prompt(question, again, "arithmetic") == "User: What is 2+3?\n\nAssistant:"
    np.testing.assert_array_equal(np.asarray(pretrained.load(out)[1]["embedding"]), np.asarray(params["embedding"]))


@pytest.mark.parametrize("overrides, match", [
    (["run.chat_format=llama2"], "run.chat_format='llama2': choose one of"),
    (["run.chat_format=chatml"], "without run.pretrained"),
])
def test_bad_chat_formats_are_refused(overrides, match):
    from grpo_jax.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        load_config("cpu-tiny", overrides)


def test_a_model_whose_template_fails_names_the_way_out():
    from tests.text.test_bpe_tokenizer import tiny_meta
    tok = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": MISTRAL}))
    with pytest.raises(ChatTemplateError, match="the chat template raised: Conversation roles must alternate.*; "
                       "a model whose template cannot be used can be prompted in a named chat format") as e:
        tok.apply_chat_template(SYSTEM)
    assert "\n" not in str(e.value)
    # transformers' variables: the tokenizer's own bos/eos strings reach the template.
    assert tok.apply_chat_template(ASK) == "<|im_start|>[INST] What is 7 times 8? [/INST]"


def test_grpo_evaluate_refuses_a_model_without_a_template_unless_a_format_is_named(no_template_model, tmp_path):
    from grpo_jax.cli import evaluate as evaluate_cli
    argv = ["--model", str(no_template_model), "--task", "chat_arithmetic", "--limit", "2", "--k", "0",
            "--max-new-tokens", "4", "--no-progress"]
    with pytest.raises(ChatTemplateError, match="has no chat template: name a chat format"):
        evaluate_cli.main([*argv, "--out", str(tmp_path / "refused")])
    evaluate_cli.main([*argv, "--chat-format", "deepseek", "--out", str(tmp_path / "named")])
    records = [json.loads(line) for f in (tmp_path / "named").glob("shard-*.jsonl") for line in f.read_text().splitlines()]
    assert len(records) == 2
    assert all(r["prompt"].startswith("User: ") and r["prompt"].endswith("\n\nAssistant:") for r in records)


def test_the_config_names_every_format_there_is():
    """run.chat_format is validated against config.CHAT_FORMATS (the config imports nothing
    above it); the templates live here, one per name."""
    from grpo_jax.config import CHAT_FORMATS

    assert tuple(chat_templates.FORMATS) == CHAT_FORMATS
