"""Chat templates: the native renderer (csrc/model/specee-chat.cpp) against jinja2 rendering of the original
Jinja templates, byte for byte, the way Hugging Face's apply_chat_template renders them."""

from __future__ import annotations

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import specee
from specee import _core

# meta-llama/Llama-2-7b-chat-hf, tokenizer_config.json
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# the generic ChatML template (e.g. teknium/OpenHermes-2.5-Mistral-7B)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# HuggingFaceH4/zephyr-7b-beta (TinyLlama-1.1B-Chat carries the same one)
ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)

# Vicuna v1.1 has no template in its tokenizer_config.json; its format is FastChat's "vicuna_v1.1"
# conversation (system + " ", "USER: ..." + " ", "ASSISTANT: ..." + "</s>", a final "ASSISTANT:"), written
# here as Jinja and also checked against FastChat's own joining rule below
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
VICUNA = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system_message = '" + VICUNA_SYSTEM.replace("'", "\\'")
    + "' %}{% set loop_messages = messages %}{% endif %}{{ system_message + ' ' }}"
    "{% for message in loop_messages %}{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

SPECIAL = {
    "chatml": ("<s>", "</s>"),
    "smollm2": ("<|im_start|>", "<|im_end|>"),
    "llama2": ("<s>", "</s>"),
    "vicuna": ("<s>", "</s>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "zephyr": ("<s>", "</s>"),
}


def jinja_render(template: str, name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """Renders like transformers' apply_chat_template (sandboxed, trim_blocks, lstrip_blocks)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    bos, eos = SPECIAL[name]
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)


def fastchat_vicuna(messages: list[dict], add_generation_prompt: bool) -> str:
    """FastChat's SeparatorStyle.ADD_COLON_TWO with sep ' ' and sep2 '</s>' (vicuna_v1.1)."""
    system = VICUNA_SYSTEM
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    roles = {"user": "USER", "assistant": "ASSISTANT"}
    turns = [(roles[m["role"]], m["content"]) for m in messages]
    if add_generation_prompt:
        turns.append(("ASSISTANT", None))
    seps = [" ", "</s>"]
    out = system + seps[0]
    for i, (role, text) in enumerate(turns):
        out += role + ": " + text + seps[i % 2] if text is not None else role + ":"
    return out


def msgs(*pairs: str) -> list[dict]:
    return [{"role": pairs[i], "content": pairs[i + 1]} for i in range(0, len(pairs), 2)]


CONVERSATIONS = [
    msgs("user", "Hello!"),
    msgs("system", "You are a pirate.", "user", "Hi there"),
    msgs("system", "Be brief.", "user", "What is 2+2?", "assistant", "4", "user", "And 3+3?"),
    msgs("user", "one", "assistant", "two", "user", "three", "assistant", "four"),
    # whitespace that Python's str.strip() (used by Llama-2's and Llama-3's templates) removes: ASCII, NBSP,
    # ideographic space, line separator; and what it keeps (zero-width space)
    msgs("system", "  sys with spaces \n", "user", "\t  padded user \u00a0\u3000", "assistant",
         "\u2028 reply \u200b", "user", "  next\n\n"),
    msgs("user", "multi\nline\n\ncontent with {{ braces }} and <|im_start|> text"),
    msgs("system", "", "user", "empty system message"),
    msgs("user", "ünïcödé 日本語 🙂 emoji", "assistant", "ok 👍", "user", ""),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("name,template", [
    ("chatml", CHATML), ("llama2", LLAMA2_CHAT), ("llama3", LLAMA3), ("zephyr", ZEPHYR), ("vicuna", VICUNA)])
def test_template_matches_jinja(name: str, template: str, conversation: list[dict],
                                add_generation_prompt: bool) -> None:
    expected = jinja_render(template, name, conversation, add_generation_prompt)
    assert _core.chat_apply_template(name, conversation, add_generation_prompt) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_vicuna_matches_fastchat(conversation: list[dict], add_generation_prompt: bool) -> None:
    assert _core.chat_apply_template("vicuna", conversation, add_generation_prompt) == fastchat_vicuna(
        conversation, add_generation_prompt)


def test_llama2_reference_output() -> None:
    """The documented Llama-2-chat prompt format, spelled out."""
    conversation = msgs("system", "SYS", "user", "Q1", "assistant", "A1", "user", "Q2")
    assert _core.chat_apply_template("llama2", conversation) == (
        "<s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nQ1 [/INST] A1 </s><s>[INST] Q2 [/INST]")


def test_command_r_by_name() -> None:
    """llama.cpp's "command-r": a turn per message (a tool's dropped), contents stripped, no BOS text; found by its
    name only (a Cohere model's own template, with tool use and thinking, is left to jinja2)."""
    conversation = [*msgs("system", " SYS\n", "user", "Q1", "assistant", " A1 "), {"role": "tool", "content": "r"},
                    *msgs("user", "Q2")]
    turn = "<|START_OF_TURN_TOKEN|>{}{}<|END_OF_TURN_TOKEN|>"
    expected = (turn.format("<|SYSTEM_TOKEN|>", "SYS") + turn.format("<|USER_TOKEN|>", "Q1") +
                turn.format("<|CHATBOT_TOKEN|>", "A1") + turn.format("<|USER_TOKEN|>", "Q2"))
    assert _core.chat_apply_template("command-r", conversation, False) == expected
    assert _core.chat_apply_template("command-r", conversation, True) == expected + (
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert _core.chat_template_detect("command-r") == "command-r"
    assert _core.chat_template_detect("{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' }}") is None


def test_llama2_roles_must_alternate() -> None:
    conversation = msgs("user", "a", "user", "b")
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        jinja_render(LLAMA2_CHAT, "llama2", conversation, True)
    with pytest.raises(_core.SpecEEError, match="alternate"):
        _core.chat_apply_template("llama2", conversation)


def test_empty_conversation() -> None:
    for name, template in [("chatml", CHATML), ("llama3", LLAMA3), ("zephyr", ZEPHYR), ("vicuna", VICUNA)]:
        for add in (True, False):
            assert _core.chat_apply_template(name, [], add) == jinja_render(template, name, [], add)


def test_detect_by_name_and_by_markers() -> None:
    for name in ["chatml", "smollm2", "llama2", "vicuna", "llama3", "zephyr"]:
        assert _core.chat_template_detect(name) == name
    assert _core.chat_template_detect(CHATML) == "chatml"
    assert _core.chat_template_detect(LLAMA2_CHAT) == "llama2"
    assert _core.chat_template_detect(LLAMA3) == "llama3"
    assert _core.chat_template_detect(ZEPHYR) == "zephyr"
    assert _core.chat_template_detect(VICUNA) == "vicuna"
    assert _core.chat_template_detect("{{ messages }}") is None
    assert _core.chat_template_detect("") is None


def test_unknown_name_and_bad_messages() -> None:
    with pytest.raises(_core.SpecEEError, match="unknown chat template"):
        _core.chat_apply_template("alpaca", msgs("user", "x"))
    with pytest.raises(ValueError, match="role"):
        _core.chat_apply_template("chatml", [{"content": "no role"}])


def test_the_public_call_renders_as_the_runtime() -> None:
    """specee.chat_apply_template: the runtime's rendering, an unknown template or a bad conversation a ValueError."""
    conversation = msgs("system", "SYS", "user", "Q1", "assistant", "A1", "user", "Q2")
    for add in (True, False):
        assert specee.chat_apply_template("chatml", conversation, add) == _core.chat_apply_template(
            "chatml", conversation, add)
    assert specee.chat_apply_template("chatml", conversation) == _core.chat_apply_template("chatml", conversation)
    with pytest.raises(ValueError, match="unknown chat template"):
        specee.chat_apply_template("alpaca", msgs("user", "x"))
    with pytest.raises(ValueError, match="alternate"):
        specee.chat_apply_template("llama2", msgs("user", "a", "user", "b"))


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_smollm2_own_template(smollm2_path, conversation: list[dict], add_generation_prompt: bool) -> None:
    """SmolLM2's template as stored in its GGUF: ChatML with a default system message."""
    template = _core.Model({"model": str(smollm2_path)}).metadata()["tokenizer.chat_template"]
    name = _core.chat_template_detect(template)
    assert name == "smollm2"
    expected = jinja_render(template, name, conversation, add_generation_prompt)
    assert _core.chat_apply_template(name, conversation, add_generation_prompt) == expected
