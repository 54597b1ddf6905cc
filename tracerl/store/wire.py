"""What crosses the store's HTTP API: request bodies, codecs, bounds, and error names.

Shared by the server (http.py) and the client (client.py), so the two cannot drift. Every
integer a request carries is bounded here, before it reaches SQLite (whose INTEGER is 64
bits) or the int32 token packing: an out-of-range value is a 422 naming the field, never a
500 from deep inside the store. So is every reward (finite, within types.REWARD_LIMIT);
leases are bounded by the service's config (Limits.max_lease_s, checked in http.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from tracerl.assets.records import Asset, AssetName, Comparison, Optimization
from tracerl.store import Conflict, InvalidTransition, LeaseLost, NotFound, StoreError
from tracerl.types import (
    SEED_LIMIT,
    PolicyVersion,
    Reward,
    RewardValue,
    Rollout,
    RolloutStatus,
    Span,
    Task,
)

__all__ = [
    "ATTEMPT_MAX",
    "LIMIT_MAX",
    "AssetRequest",
    "ClaimRequest",
    "Claimed",
    "EnqueueRequest",
    "FinishRequest",
    "HeartbeatRequest",
    "IssueRequest",
    "RequeueRequest",
    "RewardRequest",
    "PAYLOAD",
    "PAYLOAD_SCHEMA",
    "body_doc",
    "errors_doc",
    "out_of_range",
    "validate_strictly",
]

T = TypeVar("T")

ATTEMPT_MAX = 2**31
"""Attempts (and the other counters a record holds: seq, version) are below this."""
LIMIT_MAX = 100_000
"""Most rollouts one GET /store/rollouts lists."""
_JSON_INT = 2**63
"""JSON payloads (task inputs, messages) are stored as text by orjson: ints fit 64 bits."""


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnqueueRequest(_Body):
    """Body of POST /store/rollouts."""

    task_ids: list[str]
    """One rollout per entry; repeat an id for several rollouts of one task."""
    group_id: str | None = None
    """Group the new rollouts share."""
    max_attempts: int = Field(3, ge=1, lt=ATTEMPT_MAX)
    """Attempts before an expiring lease times the rollout out."""
    assets: dict[AssetName, Annotated[int, Field(ge=0, lt=ATTEMPT_MAX)]] | None = None
    """The asset versions the new rollouts' calls see (0: withheld); None: the gateway's."""
    seeds: list[Annotated[int, Field(ge=0, lt=SEED_LIMIT)]] | None = None
    """One sampling seed per task id (Rollout.seed); None: none."""

    @model_validator(mode="after")
    def _one_seed_each(self) -> EnqueueRequest:
        if self.seeds is not None and len(self.seeds) != len(self.task_ids):
            raise ValueError(f"{len(self.seeds)} seeds for {len(self.task_ids)} task ids")
        return self


class ClaimRequest(_Body):
    """Body of POST /store/claim."""

    runner_id: str
    """Who takes the leases."""
    n: int = Field(1, ge=1, le=10_000)
    """Most rollouts to claim."""
    lease_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Lease length; heartbeat before it runs out."""


class HeartbeatRequest(_Body):
    """Body of POST /store/rollouts/{id}/heartbeat."""

    attempt: int = Field(ge=0, lt=ATTEMPT_MAX)
    """The attempt the caller holds."""
    lease_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """New lease length from now."""


class FinishRequest(_Body):
    """Body of POST /store/rollouts/{id}/finish."""

    attempt: int = Field(ge=0, lt=ATTEMPT_MAX)
    """The attempt the caller holds."""
    status: RolloutStatus
    """Final status: succeeded, failed or timed_out."""
    answer: str | None = None
    """The agent's final answer."""
    reward: RewardValue | None = None
    """Final reward, also stored as a Reward record (finite, within REWARD_LIMIT)."""
    error: str | None = None
    """Why it failed."""


class RequeueRequest(_Body):
    """Body of POST /store/requeue_expired."""

    now: float | None = Field(None, allow_inf_nan=False)
    """Clock to compare leases against; None for the server's time."""


class RewardRequest(Reward):
    """Body of POST /store/rewards: a Reward whose value is finite and within REWARD_LIMIT."""

    value: RewardValue
    """The reward."""


class IssueRequest(_Body):
    """Body of POST /store/versions/issue."""

    roles: list[str] = Field(min_length=1)
    """The roles the new version's weights will be served in."""


class AssetRequest(_Body):
    """Body of POST /store/assets: a new version of an asset."""

    name: AssetName
    """The asset."""
    text: str = Field(min_length=1)
    """Its text."""
    note: str = ""
    """Why this version exists."""
    candidate: bool = False
    """An optimizer's proposal (never current)."""


class Claimed(Rollout):
    """A rollout as POST /store/claim returns it: the rollout and its agent's key."""

    agent_key: str | None = None
    """The key its agent calls the gateway with: this attempt's model calls and reward only,
    dead once the attempt ends (None from a store with no HTTP face)."""


TASKS = TypeAdapter(list[Task])
ROLLOUTS = TypeAdapter(list[Rollout])
CLAIMED = TypeAdapter(list[Claimed])
SPANS = TypeAdapter(list[Span])
REWARDS = TypeAdapter(list[Reward])
VERSION = TypeAdapter(PolicyVersion | None)
COUNTS = TypeAdapter(dict[str, int])
ENQUEUE = TypeAdapter(EnqueueRequest)
CLAIM = TypeAdapter(ClaimRequest)
HEARTBEAT = TypeAdapter(HeartbeatRequest)
FINISH = TypeAdapter(FinishRequest)
REQUEUE = TypeAdapter(RequeueRequest)
REWARD = TypeAdapter(RewardRequest)
PV = TypeAdapter(PolicyVersion)
ISSUE = TypeAdapter(IssueRequest)
SEQS = TypeAdapter(list[int])
ASSET = TypeAdapter(Asset)
ASSETS = TypeAdapter(list[Asset])
PUT_ASSET = TypeAdapter(AssetRequest)
COMPARISON = TypeAdapter(Comparison)
COMPARISONS = TypeAdapter(list[Comparison])
OPTIMIZATION = TypeAdapter(Optimization)
OPTIMIZATIONS = TypeAdapter(list[Optimization])
ISSUED = TypeAdapter(int)

# -- the OpenAPI document ---------------------------------------------------------------

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
        }
    },
}
"""Every refusal's body: {"error": {"message", "type", ...}}."""

_REASONS = {
    400: "Bad request", 401: "No key, or a key nobody issued (or whose attempt ended)",
    403: "The key may not make this call", 404: "No such record", 405: "Wrong method",
    408: "The body did not arrive in time", 409: "The state or lease changed",
    413: "The body is too large", 415: "The body is not application/json",
    422: "The body or query is invalid",
    429: "Too many calls in flight", 502: "The remote model failed",
}  # fmt: skip


def errors_doc(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses, each with the error body's schema."""
    content = {"application/json": {"schema": ERROR_SCHEMA}}
    return {code: {"description": _REASONS[code], "content": content} for code in codes}


PAYLOAD = "JsonPayload"
"""The OpenAPI component of a record's free JSON (a task's input, a span's messages)."""
PAYLOAD_SCHEMA: dict[str, Any] = {
    "description": "Any JSON whose numbers lie in [-2**63, 2**63)",
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        {"type": "string"},
        {"type": "number", "minimum": -_JSON_INT, "exclusiveMaximum": _JSON_INT},
        {"type": "array", "items": {"$ref": f"#/components/schemas/{PAYLOAD}"}},
        {"type": "object", "additionalProperties": {"$ref": f"#/components/schemas/{PAYLOAD}"}},
    ],
}
"""What out_of_range lets through in free JSON (recursive, so a component of its own)."""


def body_doc(
    adapter: TypeAdapter[Any], store: bool = False, maxima: dict[str, float] | None = None
) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of `adapter`'s type (the handlers parse
    raw bytes themselves, so FastAPI cannot see the type), with the bounds the handlers hold
    written on it: every integer within 64 bits, a record's counters within ATTEMPT_MAX (as
    out_of_range holds them); `store`: its free JSON is PAYLOAD, whose numbers out_of_range
    bounds too (a component the app's document must hold: store.http.document); `maxima`
    caps named fields (a lease's seconds: the service's limit)."""
    schema = _inline(adapter.json_schema(), adapter.json_schema().get("$defs", {}), store)
    schema = _Bounds(maxima or {}).of(schema, _JSON_INT)
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


@dataclass(frozen=True)
class _Bounds:
    """Writes the handlers' bounds on a body's schema (body_doc)."""

    maxima: dict[str, float]
    """Fields capped by the service's limits, by name."""

    def of(self, node: Any, bound: int) -> Any:
        """`node` with its integers within [-bound, bound) unless they say more, a record's
        counters (_COUNTERS) within [-ATTEMPT_MAX, ATTEMPT_MAX)."""
        if isinstance(node, list):
            return [self.of(v, bound) for v in node]
        if not isinstance(node, dict):
            return node
        out = dict(node)
        if out.get("type") == "integer":
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = -bound
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["exclusiveMaximum"] = bound
        for key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf"):
            if key in out:
                out[key] = self.of(out[key], bound)
        if isinstance(out.get("properties"), dict):
            out["properties"] = {k: self._field(k, v) for k, v in out["properties"].items()}
        return out

    def _field(self, name: str, node: Any) -> Any:
        bounded = self.of(node, ATTEMPT_MAX if name in _COUNTERS else _JSON_INT)
        if name in self.maxima and isinstance(bounded, dict):
            bounded = {**bounded, "maximum": self.maxima[name]}
            bounded.pop("exclusiveMaximum", None)
        return bounded


def _inline(node: Any, defs: dict[str, Any], payload: bool = False) -> Any:
    """`node` with every local $ref replaced by its definition (the types are not recursive),
    so one operation's schema stands alone in the OpenAPI document; `payload`: free JSON
    (pydantic's JsonValue) refers to PAYLOAD instead."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if payload and ref == "#/$defs/JsonValue":
            return {"$ref": f"#/components/schemas/{PAYLOAD}"}
        if ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs, payload)
        return {k: _inline(v, defs, payload) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs, payload) for v in node]
    return node


def validate_strictly(adapter: TypeAdapter[T], body: bytes) -> T:
    """`body` held to the JSON types the API document declares: pydantic's lax mode would
    take `false` for a number and "3" for an integer. An integer may still be written 3.0,
    as JSON Schema allows: a body whose only strict refusals are such is validated again,
    laxly, which reads 3.0 as 3."""
    try:
        return adapter.validate_json(body, strict=True)
    except ValidationError as e:
        if not all(_integral_float(error) for error in e.errors()):
            raise
    return adapter.validate_json(body)


def _integral_float(error: Any) -> bool:
    """Whether a strict refusal is of an integer written as a float (3.0)."""
    value = error.get("input")
    return error["type"] == "int_type" and type(value) is float and value.is_integer()


STATUS: dict[type[StoreError], int] = {
    NotFound: 404,
    InvalidTransition: 409,
    LeaseLost: 409,
    Conflict: 409,
}
"""HTTP status of each StoreError; any other StoreError is a 400."""
ERRORS: dict[str, type[StoreError]] = {c.__name__: c for c in (*STATUS, StoreError)}
"""Error type names on the wire -> the class the client raises."""


_PAYLOADS = frozenset({"input", "answer", "messages", "response"})
"""Free JSON fields of the records a body carries (Task, Span): PAYLOAD in the document."""
_COUNTERS = frozenset(
    {"attempt", "seq", "span_seq", "policy_version", "prefix_reused", "version"}
    | {"prompt_ids", "completion_ids", "assets"}
)
"""Integer fields of the records a body carries (Span, Reward, PolicyVersion), the token id
lists, and a span's asset versions, all held below ATTEMPT_MAX (ids are packed as int32)."""

Loc = tuple[str | int, ...]


def out_of_range(value: Any, loc: Loc = ("body",)) -> dict[str, Any] | None:
    """The first number in a parsed body outside its bound, as a validation error entry.

    A record's counters (_COUNTERS) lie in [-ATTEMPT_MAX, ATTEMPT_MAX) (policy_version -1
    marks a remote role's span); integers anywhere else (a task's input or answer, a span's
    messages) are JSON payload and only need to fit the 64 bits orjson and SQLite hold. A
    payload's other numbers (_PAYLOADS) lie within those 64 bits too: the API document can
    only say "a number" of 2**70 and 2.0**70 alike (PAYLOAD_SCHEMA), so the bound holds for
    both.
    """
    if isinstance(value, BaseModel):
        for name, field in value:
            bound = ATTEMPT_MAX if name in _COUNTERS else _JSON_INT
            if error := _ints(field, (*loc, name), bound, floats=name in _PAYLOADS):
                return error
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            if error := out_of_range(item, (*loc, i)):
                return error
        return None
    return _ints(value, loc, _JSON_INT)


def _ints(value: Any, loc: Loc, bound: int, floats: bool = False) -> dict[str, Any] | None:
    """The first int (and, with `floats`, float) in a JSON-like value outside
    [-bound, bound)."""
    if isinstance(value, list) and _numbers_within(value, bound):
        return None  # token ids and log-probs: thousands of items, checked in C
    if isinstance(value, BaseModel):  # a record inside a record: a comparison's pairs
        return out_of_range(value, loc)
    if type(value) is int:
        if -bound <= value < bound:
            return None
        power = bound.bit_length() - 1
        return {"loc": loc, "msg": f"integer out of range [-2**{power}, 2**{power})"}
    if type(value) is float and floats:
        if -_JSON_INT <= value < _JSON_INT:
            return None
        return {"loc": loc, "msg": "number out of range [-2**63, 2**63)"}
    children: list[tuple[str | int, Any]] = []
    if isinstance(value, dict):
        children = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        children = list(enumerate(value))
    for key, child in children:
        if error := _ints(child, (*loc, key), bound, floats):
            return error
    return None


def _numbers_within(values: list[Any], bound: int) -> bool:
    """True when every item is a number in [-bound, bound); False means walk them."""
    try:
        return not values or (-bound <= min(values) and max(values) < bound)
    except TypeError:  # not all numbers (messages, strings): walk the items
        return False
