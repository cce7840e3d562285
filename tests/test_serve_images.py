"""Images in chat requests (rocdraft/serve/images.py): a live ``rocdraft serve`` of a tiny
Qwen2-VL target with an EAGLE head, driven by the official ``openai`` client with a base64
``image_url``, equal to ``LLM.generate`` on the same prompt and image; a remote URL, bad
base64, an image on a text-only target and more images than the template's pads are 400s."""
from __future__ import annotations

import base64
import io
import socket

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from checkpoints import write_tiny_llama  # noqa: E402
from rocdraft.config import SamplingParams, SpeculativeConfig  # noqa: E402
from rocdraft.engine import LLM  # noqa: E402
from rocdraft.serve.app import ServeSettings, chat_renderer  # noqa: E402
from serve_helpers import start_server  # noqa: E402
from rocdraft.serve.images import ImagePartError, image_part_bytes  # noqa: E402
from vl_checkpoints import make_image, write_mrope_head, write_tiny_qwen2_vl  # noqa: E402

KEY = "k"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def serve(llm, name: str):
    settings = ServeSettings(model_name=name, max_model_len=llm.max_model_len, max_num_seqs=4,
                             max_waiting_requests=0, api_key=KEY,
                             chat_template=llm.tokenizer.chat_template,
                             special_tokens=llm.tokenizer.special_tokens)
    srv, thread, port = start_server(llm, settings, shutdown_timeout=5, log_level="warning")
    return srv, thread, settings, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_vl")
    target = write_tiny_qwen2_vl(root / "vl", seed=3, cyclic=True, noise=2.2)
    llm = LLM(str(target), str(write_mrope_head(root / "head", target)),
              speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=2,
                                                   draft_policy="fixed"), max_model_len=128)
    text_llm = LLM(str(write_tiny_llama(root / "llama")), max_model_len=128)
    text_llm.tokenizer.chat_template = llm.tokenizer.chat_template
    started = [serve(llm, "vl"), serve(text_llm, "llama")]
    yield {"vl": (llm, started[0][2], started[0][3]), "llama": started[1][3]}
    for srv, thread, *_ in started:
        srv.should_exit = True
        thread.join(30)


def image_message(url: str, text: str = "the quick fox") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_chat_with_a_base64_image_equals_generate(servers):
    llm, settings, base = servers["vl"]
    image = make_image(70, 100, seed=5)
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="vl", messages=image_message(data_url(image)),
                                           max_tokens=10, temperature=0.0)
    prompt = chat_renderer(settings)([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "the quick fox"}]}])
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt
    expected = llm.generate([{"prompt": prompt, "images": [image]}],
                            SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # pads expanded


def test_refusals_are_400(servers):
    _, _, base = servers["vl"]
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    url = data_url(make_image(40, 40))
    with pytest.raises(openai.BadRequestError, match="is not a data: URL; rocdraft fetches "
                                                     "nothing"):
        client.chat.completions.create(model="vl", max_tokens=4, messages=image_message(
            "https://example.com/cat.png"))
    with pytest.raises(openai.BadRequestError, match="invalid base64"):
        client.chat.completions.create(model="vl", max_tokens=4, messages=image_message(
            "data:image/png;base64,***"))
    with pytest.raises(openai.BadRequestError, match="is not a readable image file"):
        client.chat.completions.create(model="vl", max_tokens=4, messages=image_message(
            "data:image/png;base64," + base64.b64encode(b"text").decode()))
    # The template writes one pad per image part: images outside the parts have no pads.
    text_client = openai.OpenAI(base_url=servers["llama"], api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="has no vision tower"):
        text_client.chat.completions.create(model="llama", max_tokens=4,
                                            messages=image_message(url))


def test_more_images_than_pads_in_the_template_output(servers):
    """A template that drops image parts: 1 image, 0 pads, a one-line refusal."""
    llm, settings, _ = servers["vl"]
    from rocdraft.serve.protocol import parse_chat

    req = parse_chat({"messages": image_message(data_url(make_image(40, 40)))},
                     lambda messages: "the fox")
    out = llm.generate(list(req.prompts), SamplingParams(max_tokens=2))[0]
    assert out.error.startswith("1 image(s) for 0 image-pad token(s)")


def test_image_part_shapes():
    assert image_part_bytes({"image_url": "data:image/png;base64,aGk="}, "m") == b"hi"
    with pytest.raises(ImagePartError, match="must be base64"):
        image_part_bytes({"image_url": {"url": "data:image/png,raw"}}, "m")
    with pytest.raises(ImagePartError, match="must be"):
        image_part_bytes({"image_url": {"uri": "x"}}, "m")
