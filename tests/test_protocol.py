import json

import pytest

from realtime_app.wire import protocol
from realtime_app.wire.protocol import parse_frame


def reasons(frame):
    return [e["error"]["data"]["reason"] for e in frame.errors]


def test_single_request_and_notification():
    frame = parse_frame('{"jsonrpc":"2.0","method":"ping","id":7}')
    assert not frame.errors and not frame.is_batch
    assert frame.requests[0].method == "ping" and frame.requests[0].id == 7
    note = parse_frame('{"jsonrpc":"2.0","method":"ping"}').requests[0]
    assert note.is_notification


@pytest.mark.parametrize("request_id", ["abc", 1, -3, 2.5, None, 10**30])
def test_any_valid_id_type_is_kept(request_id):
    frame = parse_frame(json.dumps({"jsonrpc": "2.0", "method": "m", "id": request_id}))
    assert frame.requests[0].id == request_id
    assert not frame.requests[0].is_notification


@pytest.mark.parametrize(
    ("text", "code", "reason"),
    [
        ("not json", protocol.PARSE_ERROR, "invalid_json"),
        ('{"jsonrpc": "2.0", "method"', protocol.PARSE_ERROR, "invalid_json"),
        ("NaN", protocol.PARSE_ERROR, "invalid_json"),
        ("1" * 5000, protocol.PARSE_ERROR, "invalid_json"),  # over Python's int digit limit
        ("[" * 100_000, protocol.PARSE_ERROR, "invalid_json"),  # recursion
        ("42", protocol.INVALID_REQUEST, "not_an_object"),
        ('"hello"', protocol.INVALID_REQUEST, "not_an_object"),
        ("null", protocol.INVALID_REQUEST, "not_an_object"),
        ("[]", protocol.INVALID_REQUEST, "empty_batch"),
        ('{"method":"ping","id":1}', protocol.INVALID_REQUEST, "jsonrpc_must_be_2.0"),
        ('{"jsonrpc":"1.0","method":"ping","id":1}', protocol.INVALID_REQUEST, "jsonrpc_must_be_2.0"),
        ('{"jsonrpc":"2.0","method":5,"id":1}', protocol.INVALID_REQUEST, "method_must_be_string"),
        ('{"jsonrpc":"2.0","id":1}', protocol.INVALID_REQUEST, "method_must_be_string"),
        ('{"jsonrpc":"2.0","method":"m","params":"x","id":1}', protocol.INVALID_REQUEST, "params_must_be_structured"),
        ('{"jsonrpc":"2.0","method":"m","id":true}', protocol.INVALID_REQUEST, "invalid_id"),
        ('{"jsonrpc":"2.0","method":"m","id":{"a":1}}', protocol.INVALID_REQUEST, "invalid_id"),
        ('{"jsonrpc":"2.0","method":"m","id":"' + "i" * 300 + '"}', protocol.INVALID_REQUEST, "invalid_id"),
    ],
)
def test_bad_frames_get_the_standard_error(text, code, reason):
    frame = parse_frame(text)
    assert not frame.requests and not frame.is_batch
    assert len(frame.errors) == 1
    assert frame.errors[0]["error"]["code"] == code
    assert reasons(frame) == [reason]


def test_error_keeps_a_valid_id():
    frame = parse_frame('{"method":"ping","id":"k"}')
    assert frame.errors[0]["id"] == "k"


def test_batch_mixes_requests_and_errors():
    frame = parse_frame('[{"jsonrpc":"2.0","method":"a","id":1}, 1, {"jsonrpc":"2.0","method":"b"}]')
    assert frame.is_batch
    assert [r.method for r in frame.requests] == ["a", "b"]
    assert reasons(frame) == ["not_an_object"]


def test_batch_over_the_limit_is_refused_whole():
    text = json.dumps([{"jsonrpc": "2.0", "method": "ping", "id": i} for i in range(6)])
    frame = parse_frame(text, max_batch=5)
    assert not frame.requests and reasons(frame) == ["batch_too_large"]


def test_a_notification_is_the_spec_envelope():
    text = protocol.notification_text("demo:clock", protocol.encode({"n": 1}), 3, 1700)
    assert json.loads(text) == {
        "jsonrpc": "2.0",
        "method": "message",
        "params": {"channel": "demo:clock", "data": {"n": 1}, "seq": 3, "ts": 1700},
    }


def test_close_codes():
    assert protocol.CloseCode.TRY_AGAIN_LATER == 1013
    assert protocol.CloseCode.MESSAGE_TOO_BIG == 1009
    assert protocol.CloseCode.POLICY_VIOLATION == 1008


@pytest.mark.parametrize(("levels", "refused"), [(32, False), (33, True), (500, True)])
def test_params_nested_past_the_limit_are_refused_before_any_recursive_walk(levels, refused):
    from realtime_app.wire.protocol import MAX_DEPTH, parse_frame

    params = "[" * levels + '"\\ud800"' + "]" * levels  # a lone surrogate at the bottom, too
    frame = parse_frame(f'{{"jsonrpc":"2.0","method":"m","id":1,"params":{params}}}')
    [error] = frame.errors
    expected = {"reason": "too_deep", "limit": MAX_DEPTH} if refused else {"reason": "invalid_string"}
    assert error["error"]["code"] == -32602 and error["error"]["data"] == expected
    notification = parse_frame(f'{{"jsonrpc":"2.0","method":"m","params":{params}}}')
    assert notification.errors == [] and notification.requests == []  # bad, and owed no answer
