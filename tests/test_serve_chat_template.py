"""The chat template (rocdraft/serve/chat_template.py): rendered as Hugging Face does, a
template that does not compile is the operator's error, messages it refuses a 400."""
from __future__ import annotations

import pytest

pytest.importorskip("jinja2")

from rocdraft.errors import RocdraftError  # noqa: E402
from rocdraft.serve.app import ServeSettings  # noqa: E402
from rocdraft.serve.chat_template import chat_renderer  # noqa: E402
from rocdraft.serve.protocol import ApiError  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def settings(template):
    return ServeSettings(model_name="m", max_model_len=64, max_num_seqs=1,
                         chat_template=template, special_tokens={"bos_token": "<s>"})


def test_renders_with_the_generation_prompt_and_special_tokens():
    render = chat_renderer(settings(TEMPLATE))
    assert render([{"role": "user", "content": "hi"}]) == "<s><user>hi\n<assistant>"


def test_no_template_is_a_400_naming_the_model():
    with pytest.raises(ApiError, match="model 'm' has no chat template") as info:
        chat_renderer(settings(None))([{"role": "user", "content": "hi"}])
    assert info.value.code == "no_chat_template"


def test_a_template_that_does_not_compile_is_the_operators_error():
    with pytest.raises(RocdraftError, match="does not compile"):
        chat_renderer(settings("{% for %}"))


def test_raise_exception_in_the_template_is_a_400():
    render = chat_renderer(settings("{{ raise_exception('only user turns') }}"))
    with pytest.raises(ApiError, match="refused the messages: only user turns"):
        render([{"role": "system", "content": "x"}])
