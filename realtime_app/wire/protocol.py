"""JSON-RPC 2.0 over WebSocket text frames: parsing, validation, encoding (Sans-I/O).

Turns one inbound text frame into requests and ready-made error responses, and builds the
outbound envelopes. No I/O, no Django: the consumer feeds it text and sends what it
returns. Error codes and close codes are named once here and mirrored in the browser
module.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypeAlias, TypedDict

__all__ = [
    "FORBIDDEN_CHANNEL",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "LIBRARY_CODES",
    "MAX_DEPTH",
    "METHOD_NOT_FOUND",
    "OVERLOADED",
    "PARSE_ERROR",
    "RATE_LIMITED",
    "TOO_MANY_IN_FLIGHT",
    "TOO_MANY_SUBSCRIPTIONS",
    "UNKNOWN_CHANNEL",
    "CloseCode",
    "ErrorObject",
    "Frame",
    "MessageNotification",
    "Request",
    "Response",
    "encode",
    "use_encoder",
    "error_response",
    "notification_head",
    "notification_tail",
    "notification_text",
    "parse_frame",
    "result_response",
    "scan",
]

# Standard JSON-RPC 2.0 codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# Application codes (-32000..-32099).
FORBIDDEN_CHANNEL = -32001
UNKNOWN_CHANNEL = -32002
OVERLOADED = -32003
TOO_MANY_IN_FLIGHT = -32004
RATE_LIMITED = -32005
TOO_MANY_SUBSCRIPTIONS = -32006
#: The codes this library answers with: JSON-RPC's own and -32000..-32009. Applications
#: raise ``RPCError`` with -32010..-32099, or any code outside -32768..-32000
#: (docs/methods.md); an error with one of these codes counts as a bad request.
LIBRARY_CODES = frozenset(
    {PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR, *range(-32009, -31999)}
)

#: Longest string id echoed back; longer ids make the request invalid.
MAX_ID_LENGTH = 256


class CloseCode(enum.IntEnum):
    """WebSocket close codes the server sends. 1013 and 1001/1006/1011/1012 are transient
    (clients reconnect with backoff); 1008 and 4xxx are fatal."""

    NORMAL = 1000
    GOING_AWAY = 1001
    UNSUPPORTED_DATA = 1003
    INVALID_PAYLOAD = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    SERVICE_RESTART = 1012
    TRY_AGAIN_LATER = 1013
    SESSION_ENDED = 4001  # the socket's session logged out, expired, or its user was deactivated
    TOKEN_REFUSED = 4002  # the handshake's token is tampered, malformed, or its user revoked it
    TOKEN_EXPIRED = 4004  # the connection's token expired and was not refreshed
    RIGHTS_REVOKED = 4003  # a subscription of the socket is no longer allowed (demotion)
    CLOSED_BY_OPERATOR = 4010  # staff closed it from the admin's Realtime cluster screen


RequestId: TypeAlias = str | int | float | None


class ErrorData(TypedDict, total=False):
    reason: str
    retry_after_ms: int
    snapshot: Any
    channel: str


class ErrorObject(TypedDict):
    code: int
    message: str
    data: NotRequired[ErrorData]


class Response(TypedDict):
    jsonrpc: Literal["2.0"]
    id: RequestId
    result: NotRequired[Any]
    error: NotRequired[ErrorObject]


class MessageParams(TypedDict):
    channel: str
    data: Any
    seq: int
    epoch: NotRequired[str]  # channels with history
    ts: int


class MessageNotification(TypedDict):
    jsonrpc: Literal["2.0"]
    method: Literal["message"]
    params: MessageParams


@dataclass(slots=True)
class Request:
    """One valid JSON-RPC request or notification (``is_notification``: no ``id`` member)."""

    method: str
    params: dict[str, Any] | list[Any] | None
    id: RequestId = None
    is_notification: bool = False


@dataclass(slots=True)
class Frame:
    """What one inbound text frame holds: valid requests, and responses for invalid parts."""

    requests: list[Request] = field(default_factory=list)
    errors: list[Response] = field(default_factory=list)
    is_batch: bool = False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def error_response(request_id: RequestId, code: int, message: str, reason: str | None = None, **data: Any) -> Response:
    """A JSON-RPC error response; ``reason`` and extra ``data`` go in ``error.data``."""
    error: ErrorObject = {"code": code, "message": message}
    if reason is not None:
        error["data"] = {"reason": reason, **data}  # type: ignore[typeddict-item]
    return {"jsonrpc": "2.0", "error": error, "id": request_id}


def result_response(request_id: RequestId, result: Any) -> Response:
    return {"jsonrpc": "2.0", "result": result, "id": request_id}


def _valid_id(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return value is None
    if isinstance(value, str):
        return len(value) <= MAX_ID_LENGTH
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _request(obj: Any) -> Request | Response:
    """Validate one request object; return it, or the error response it deserves."""
    if not isinstance(obj, dict):
        return error_response(None, INVALID_REQUEST, "Invalid Request", "not_an_object")
    has_id = "id" in obj
    request_id = obj.get("id")
    if has_id and not _valid_id(request_id):
        return error_response(None, INVALID_REQUEST, "Invalid Request", "invalid_id")
    if obj.get("jsonrpc") != "2.0":
        return error_response(request_id, INVALID_REQUEST, "Invalid Request", "jsonrpc_must_be_2.0")
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        return error_response(request_id, INVALID_REQUEST, "Invalid Request", "method_must_be_string")
    params = obj.get("params")
    if "params" in obj and not isinstance(params, (dict, list)):
        return error_response(request_id, INVALID_REQUEST, "Invalid Request", "params_must_be_structured")
    return Request(method=method, params=params, id=request_id, is_notification=not has_id)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


#: Deepest nesting of arrays and objects a request's ``params`` may have: deeper is refused
#: (-32602 ``too_deep``) by an iterative scan, before anything walks them recursively.
MAX_DEPTH = 32


def scan(value: Any) -> tuple[int, bool]:
    """``(depth, lone surrogate)`` of a parsed JSON value — its nesting of arrays and
    objects, and whether a string in it holds a lone surrogate (valid JSON as an escape,
    never valid text). Iterative: no input nests deep enough to exhaust the stack, and the
    work is one visit per value."""
    depth, surrogate = 0, False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str):
            surrogate = surrogate or _SURROGATE.search(item) is not None
        elif isinstance(item, dict):
            depth = max(depth, level)
            for key, inner in item.items():
                stack.append((key, level))
                stack.append((inner, level + 1))
        elif isinstance(item, list):
            depth = max(depth, level)
            stack.extend((inner, level + 1) for inner in item)
    return depth, surrogate


def parse_frame(text: str, max_batch: int = 50) -> Frame:
    """Parse one text frame into requests and the error responses owed for its bad parts.

    Follows JSON-RPC 2.0 §4–6: unparsable text is one -32700; a scalar or an empty array
    is one -32600; each bad member of a batch gets its own -32600. Notifications (no
    ``id``) never get an answer, even an error, except when the id itself is invalid.
    """
    frame = Frame()
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        frame.errors.append(error_response(None, PARSE_ERROR, "Parse error", "invalid_json"))
        return frame
    if isinstance(data, list):
        frame.is_batch = True
        if not data:
            frame.is_batch = False
            frame.errors.append(error_response(None, INVALID_REQUEST, "Invalid Request", "empty_batch"))
            return frame
        if len(data) > max_batch:
            frame.is_batch = False
            frame.errors.append(
                error_response(None, INVALID_REQUEST, "Invalid Request", "batch_too_large", max_batch=max_batch)
            )
            return frame
        items = data
    else:
        items = [data]
    surrogates = _SURROGATE_ESCAPE.search(text) is not None  # only escapes can make one
    for item in items:
        parsed = _request(item)
        depth, surrogate = scan(parsed.params) if isinstance(parsed, Request) else (0, False)
        if isinstance(parsed, Request) and (depth > MAX_DEPTH or surrogates and surrogate):
            if parsed.is_notification:
                continue  # bad, and owed no answer
            if depth > MAX_DEPTH:
                message, reason = f"Invalid params: nested deeper than {MAX_DEPTH} levels", "too_deep"
            else:
                message, reason = "Invalid params: a string holds a lone surrogate (not text)", "invalid_string"
            parsed = error_response(
                parsed.id, INVALID_PARAMS, message, reason, **({"limit": MAX_DEPTH} if depth > MAX_DEPTH else {})
            )
        elif surrogates and isinstance(parsed, Request) and _SURROGATE.search(parsed.method):
            parsed = error_response(parsed.id, INVALID_REQUEST, "Invalid Request", "method_must_be_string")
        if isinstance(parsed, Request):
            frame.requests.append(parsed)
        else:
            frame.errors.append(parsed)
    return frame


_encoder: type[json.JSONEncoder] = json.JSONEncoder


def use_encoder(cls: type[json.JSONEncoder]) -> None:
    """The encoder class :func:`encode` uses for what JSON does not know (the app sets its
    ``JSON_ENCODER`` setting here: Django's ``DjangoJSONEncoder`` by default, so that the
    ``Decimal``, ``datetime`` and ``UUID`` values models hand out are answered as
    ``JsonResponse`` would write them)."""
    global _encoder
    _encoder = cls


def encode(message: Any) -> str:
    """Serialise an outbound message compactly (one encoder for every frame we send).

    The text is always encodable as UTF-8: a lone surrogate (``"\\ud800"`` is valid JSON
    and Python keeps it) is written as its ``\\u`` escape instead of breaking the send.
    Raises ``ValueError`` for what JSON cannot carry (``inf``, ``nan``) and ``TypeError``
    for what the encoder does not know.
    """
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False, cls=_encoder)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(message, separators=(",", ":"), ensure_ascii=True, allow_nan=False, cls=_encoder)
    return text


def notification_text(channel: str, data_json: str, seq: int, ts: int, epoch: str | None = None) -> str:
    """The ``message`` notification of one publication whose data is already encoded.

    The data is encoded once, before a ``seq`` is taken (so a publication that cannot be
    encoded burns no number), and spliced in here; the result equals
    ``encode({"jsonrpc": "2.0", "method": "message", "params": {...}})``. A channel with
    history adds its ``epoch`` after ``seq`` (the Redis backplane builds the same tail in
    Lua: :func:`notification_tail` is the one format).
    """
    return notification_head(channel, data_json) + notification_tail(seq, ts, epoch)


def notification_head(channel: str, data_json: str) -> str:
    """Everything of a ``message`` notification before its ``seq``."""
    return f'{{"jsonrpc":"2.0","method":"message","params":{{"channel":{encode(channel)},"data":{data_json}'


def notification_tail(seq: int, ts: int, epoch: str | None = None) -> str:
    """``seq``, ``epoch`` (a channel with history) and ``ts``, closing the notification."""
    if epoch is None:
        return f',"seq":{int(seq)},"ts":{int(ts)}}}}}'
    return f',"seq":{int(seq)},"epoch":{encode(epoch)},"ts":{int(ts)}}}}}'
