"""Response shapes: streamed prompt_logprobs come once, in the first chunk sent, equal to the whole body's."""

from hybrid.engine.outputs import TokenLogprob
from hybrid.managers.messages import TokenDelta
from server.responses import ChatShape, CompletionShape, TokenText

PROMPT = [None, TokenLogprob(7, -1.5, [(3, -0.2), (7, -1.5)], 2), TokenLogprob(4, -0.1, [(4, -0.1)], 1)]


def deltas() -> list[TokenDelta]:
    """A first delta whose text the stop-string check held back (empty), then two that are sent."""
    return [TokenDelta("r", [9], "", False, None, 3, 1, prompt_logprobs=PROMPT),
            TokenDelta("r", [10], "ab", False, None, 3, 2), TokenDelta("r", [11], "c", True, "length", 3, 3)]


def test_completion_chunks_carry_the_prompt_logprobs_once_after_a_held_back_delta():
    shape = CompletionShape("r", "m", 0, TokenText(None), None, None, [5, 7, 4], prompt_logprobs=1)
    chunks = [shape.chunk(d) for d in deltas()]
    assert chunks[0] is None
    carried = [c["choices"][0].get("prompt_logprobs") for c in chunks[1:]]
    whole = CompletionShape("r", "m", 0, TokenText(None), None, None, [5, 7, 4], prompt_logprobs=1)
    for d in deltas():
        whole.add(d)
    expected = whole.final({})["choices"][0]["prompt_logprobs"]
    assert carried == [expected, None] and expected[0] is None
    assert expected[1] == {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "token_id:7"},
                           "3": {"logprob": -0.2, "rank": 1, "decoded_token": "token_id:3"}}


def test_chat_sends_them_at_the_top_of_choice_0s_chunks_only():
    first, second = (ChatShape("r", "m", 0, TokenText(None), False, prompt_logprobs=0) for _ in range(2))
    second.index = 1
    got = [[c.get("prompt_logprobs") for d in deltas() if (c := shape.chunk(d)) is not None]
           for shape in (first, second)]
    assert got[0] == [first.final({})["prompt_logprobs"], None] and got[1] == [None, None]
    assert got[0][0][1] == {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "token_id:7"}}
    unasked = ChatShape("r", "m", 0, TokenText(None), False)
    assert all("prompt_logprobs" not in c for d in deltas() if (c := unasked.chunk(d)) is not None)
    assert "prompt_logprobs" not in unasked.final({})
