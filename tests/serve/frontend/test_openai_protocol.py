"""Request parsing at the OpenAI edge: what is accepted, what is refused and how."""

import pytest

from serve.frontend import openai_protocol as oai
from serve.frontend.errors import APIError


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return oai.parse(oai.ChatCompletionRequest, body)


def test_defaults_and_aliases():
    r = chat(max_completion_tokens=7, max_tokens=3)
    assert r.output_limit() == 7  # max_completion_tokens wins, as in OpenAI's API
    assert chat(max_tokens=3).output_limit() == 3
    assert chat().output_limit() is None
    assert oai.parse(oai.CompletionRequest, {"model": "m", "prompt": "x"}).output_limit() == 16


def test_text_parts_and_unknown_fields_accepted():
    r = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
             frequency_penalty=0, user="u", logprobs=False)
    r.check_supported()
    assert r.messages[0].content[1].text == "b"


@pytest.mark.parametrize("field,value,param", [
    ("temperature", 3, "temperature"),
    ("max_tokens", 0, "max_tokens"),
    ("top_p", 0, "top_p"),
    ("messages", [], "messages"),
    ("messages", [{"role": "robot", "content": "x"}], "messages.0.role"),
    ("stream", "yes please", "stream"),
])
def test_invalid_fields_name_the_parameter(field, value, param):
    with pytest.raises(APIError) as e:
        chat(**{field: value})
    assert e.value.status == 400
    assert e.value.param == param


@pytest.mark.parametrize("kw,param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                      ({"tools": [{"type": "function"}]}, "tools")])
def test_unsupported_features_are_refused(kw, param):
    with pytest.raises(APIError) as e:
        chat(**kw).check_supported()
    assert e.value.status == 400 and e.value.param == param


def test_stop_normalized_to_list():
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", ""]).stop == ["a"]
    with pytest.raises(APIError):
        chat(stop=[str(i) for i in range(oai.MAX_STOP_STRINGS + 1)])


def test_completion_prompt_forms():
    parse = lambda p: oai.parse(oai.CompletionRequest, {"model": "m", "prompt": p}).single_prompt()
    assert parse("hello") == "hello"
    assert parse([1, 2, 3]) == [1, 2, 3]
    assert parse(["only"]) == "only"
    assert parse([[5, 6]]) == [5, 6]
    with pytest.raises(APIError) as e:
        parse(["a", "b"])
    assert e.value.param == "prompt"


def test_non_object_body():
    with pytest.raises(APIError) as e:
        oai.parse(oai.ChatCompletionRequest, [1, 2])
    assert e.value.status == 400


def test_envelope_shape():
    err = APIError(404, "nope", "NotFoundError", "model", "model_not_found")
    assert err.body() == {"error": {"message": "nope", "type": "NotFoundError", "param": "model",
                                    "code": "model_not_found"}}
