"""What `rft topics tail` / `export --decoded` show of a record (rft/ops/topics/render.py): every record type the
schema decodes has a summary and a content, serve mode's `served` and `feedback` records too; a claim-checked
record lists its claims, is shown whole when a claim store is given, and says why when its parts cannot be read."""
from __future__ import annotations

import numpy as np

from rft.ops.topics.render import decoded_view, format_message
from rft.schema import ExperienceGroup, Feedback, ServedChoice, ServedCompletion, encode
from rft.text.tokens import Detokenizer
from rft.transport import ClaimStore, Message, check_out, claims_in
from rft.transport.claims import HEADER_CLAIMS
from tests.records import make_group

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


def claim_checked(tmp_path, *, response_len: int) -> tuple[Message, ClaimStore, ExperienceGroup]:
    """A group sent as a claim-checking sink sends it: its large parts (or its whole body) in a directory store."""
    store = ClaimStore(tmp_path / "records", threshold=1024)
    group = make_group("r", 1, n_samples=2, response_len=response_len)
    value, headers = encode(group)
    checked = check_out(value, store, threshold=1024, limit=4000)
    headers = [*headers, (HEADER_CLAIMS, str(len(claims_in(checked))).encode())]
    return Message("t", 0, 5, group.group_id.encode(), checked, headers, 1_700_000_000_000), store, group


def test_a_claim_checked_record_lists_its_claims_without_a_store_and_shows_whole_with_one(tmp_path):
    m, store, group = claim_checked(tmp_path, response_len=400)  # 1.6 KB token arrays: claimed part by part
    held = claims_in(m.value)
    assert len(held) == 4
    text = format_message(m, None)
    assert "not a valid rft record" not in text
    assert f"claims: 4 ({sum(c.size for c in held)} bytes): {held[0].sha256[:12]} {held[0].size} B" in text
    assert f"group_id={group.group_id}" in text and "n_samples=2" in text and "not fetched" in text
    view = decoded_view(m, Detokenizer(""))
    assert view["claims"][0] == {"sha256": held[0].sha256, "size": held[0].size, "codec": held[0].codec}
    assert view["group_id"] == group.group_id and "samples" not in view

    resolved = format_message(m, Detokenizer(""), store)  # with the store: the whole record, its content
    assert "type=experience_group" in resolved and "sample 1:" in resolved and "claims: 4" in resolved
    view = decoded_view(m, Detokenizer(""), store)
    assert view["samples"][0]["response_tokens"] == [int(t) for t in group.samples[0].response_tokens]


def test_a_whole_body_stub_shows_its_ids_and_a_missing_object_says_why(tmp_path):
    m, store, group = claim_checked(tmp_path, response_len=250)  # 1000-byte parts, a record over 4000: whole body
    [claim] = claims_in(m.value)
    assert f"group_id={group.group_id}" in format_message(m, None)
    (tmp_path / "records" / claim.key).unlink()
    text = format_message(m, None, store)
    assert f"claims: 1 ({claim.size} bytes): {claim.sha256[:12]}" in text
    assert "not resolved" in text and "missing from the claim store" in text
    assert "missing from the claim store" in decoded_view(m, Detokenizer(""), store)["claims_status"]
