"""The model's chat template: ``chat_renderer(settings)`` (its ``model_name``,
``chat_template`` and ``special_tokens``) -> ``render(messages) -> prompt text``, rendered as
Hugging Face renders it (sandboxed Jinja2, trim_blocks/lstrip_blocks, add_generation_prompt,
the special-token strings). A template that does not compile is the operator's error
(RocdraftError at start-up); messages it refuses are the client's (a 400)."""
from __future__ import annotations

from rocdraft.errors import RocdraftError
from rocdraft.serve.protocol import ApiError


def chat_renderer(settings):
    """``render(messages) -> prompt text`` with the model's Jinja2 chat template, as Hugging Face
    renders it (sandboxed, trim_blocks/lstrip_blocks, add_generation_prompt, the special-token
    strings); without a template, a 400 saying so."""
    if settings.chat_template is None:
        def refuse(messages):
            raise ApiError(400, f"model {settings.model_name!r} has no chat template "
                                f"(tokenizer_config.json has no chat_template); use "
                                f"/v1/completions", "messages", "no_chat_template")
        return refuse
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(settings.chat_template)
    except TemplateError as exc:
        raise RocdraftError(f"the model's chat template does not compile: {exc}") from None

    def render(messages):
        try:
            return template.render(messages=messages, add_generation_prompt=True,
                                   **settings.special_tokens)
        except TemplateError as exc:
            raise ApiError(400, f"the chat template refused the messages: {exc}",
                           "messages") from None

    return render
