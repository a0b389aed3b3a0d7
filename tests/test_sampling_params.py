"""SamplingParams refuses each bad value with an InvalidRequest naming the request field it came from."""

import pytest

from hybrid.invalid_request import InvalidRequest, lone_surrogate_at
from hybrid.sampling_params import SamplingParams

BAD = [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"), ({"seed": 2**64}, "seed"),
    ({"grammar": " "}, "grammar"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 2}, "min_p"), ({"logit_bias": {True: 1.0}}, "logit_bias"), ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"), ({"min_tokens": 17}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words_ids": [[]]}, "bad_words"),
    ({"bad_words_ids": [[1]] * 257}, "bad_words"), ({"cache_salt": ""}, "cache_salt"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": ["a\ud800"]}, "stop"), ({"grammar": "start: \"\udfff\""}, "grammar"),
    ({"cache_salt": "\ud800"}, "cache_salt"),
]


@pytest.mark.parametrize("kwargs,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_each_bad_value_names_its_field(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and e.value.code is None


def test_good_values_pass_and_a_lone_surrogate_is_found_where_it_is():
    assert SamplingParams(temperature=0, stop="x", logit_bias={3: -100.0}, cache_salt="é").stop == ["x"]
    assert lone_surrogate_at("ab\ud800c") == 2 and lone_surrogate_at("a\U0001f600") is None
