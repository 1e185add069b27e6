"""What `rft topics tail` / `export --decoded` show of a record (rft/ops/topics/render.py): every record type the
schema decodes has a summary and a content, serve mode's `served` and `feedback` records too."""
from __future__ import annotations

import numpy as np

from rft.ops.topics.render import decoded_view, format_message
from rft.schema import Feedback, ServedChoice, ServedCompletion, encode
from rft.text.tokens import Detokenizer
from rft.transport import Message

SERVED = ServedCompletion(run_id="r", request_id="chatcmpl-1", prompt_key="k", prompt_tokens=np.array([1, 2, 3]),
                          choices=[ServedChoice(0, np.array([4, 5]), np.array([-0.1, -0.2]), "stop")],
                          policy_version=7, model="m")
FEEDBACK = Feedback(run_id="r", request_id="chatcmpl-1", reward=0.5, index=0, components={"judge": 1.0})


def message(record: ServedCompletion | Feedback) -> Message:
    value, headers = encode(record)
    return Message("t", 0, 3, b"chatcmpl-1", value, headers, 1_700_000_000_000)


def test_a_served_record_shows_its_request_version_and_tokens():
    m = message(SERVED)
    view = decoded_view(m, Detokenizer(""))
    assert (view["type"], view["request_id"], view["policy_version"], view["n_choices"]) == ("served",
                                                                                            "chatcmpl-1", 7, 1)
    assert view["prompt_tokens"] == [1, 2, 3]
    assert view["choices"] == [{"index": 0, "finish_reason": "stop", "response_len": 2, "response_tokens": [4, 5]}]
    assert "type=served" in format_message(m, Detokenizer(""))


def test_a_feedback_record_shows_its_reward_and_components():
    view = decoded_view(message(FEEDBACK), Detokenizer(""))
    assert (view["type"], view["request_id"], view["index"], view["reward"]) == ("feedback", "chatcmpl-1", 0, 0.5)
    assert view["components"] == {"judge": 1.0}
