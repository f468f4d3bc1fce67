"""The answer for one frame: what every tier publishes and every application consumes.

One :class:`Result` per frame goes out as UTF-8 JSON on ``{prefix}/{deployment}/results`` (and
to the HTTP callback, the results file and ``GET /v1/results``)::

    {"frame": 17, "class": 2, "label": "person", "exit": "local", "entropy": 0.12,
     "views": ["cam0", "cam2"], "missing": {"cam1": "absent", "cam3": "late"},
     "partial": true, "degraded": false, "latency_ms": 3.1}

``views`` are the views fused; ``missing`` names each expected view that was not fused and why;
``partial`` is true when a view the devices reported was not fused (an absent view, a camera
that saw nothing, does not make a frame partial); ``degraded`` means a tier the frame needed was
unreachable. A frame in which no view was fused — every camera saw nothing — is never classified:
its ``exit`` is ``"none"`` and its ``class``, ``label`` and ``entropy`` are ``null``::

    {"frame": 18, "class": null, "label": null, "exit": "none", "entropy": null, "views": [],
     "missing": {"cam0": "absent", "cam1": "absent"}, "partial": false, "degraded": false,
     "latency_ms": 2.0}
 Built, validated and serialised here only; :func:`json_schema` is the schema in the
docs (``docs/result.schema.json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ddnn import bounded_json
from ddnn.errors import DdnnError
from ddnn.names import is_name

EXITS = ("local", "edge", "cloud")
NO_EXIT = "none"  # the "exit" of a frame no view was fused in: nobody classified it
# Why an expected view was not fused: the camera saw nothing; its message came after the frame
# was answered; its device is offline (last will, or silent for several frames); its features
# were pulled but never arrived; the edge refused it (its device ran ahead of the others, or
# sent scores out of bounds: docs/security.md); its device fell behind its source and skipped
# the frame.
MISSING_REASONS = ("absent", "late", "offline", "no_features", "refused", "skipped")
KEYS = ("frame", "class", "label", "exit", "entropy", "views", "missing", "partial", "degraded",
        "latency_ms")
# ``seq``: the number the edge gives its answers in the order it makes them (every result the
# edge publishes has one; a one-view device's own result, before the edge numbers it, has not).
OPTIONAL_KEYS = ("seq",)
MAX_SEQ = (1 << 53) - 1  # exact as a JSON number everywhere (JavaScript's Number)
MAX_RESULT_DEPTH = 4  # a result is 2 deep ({"missing": {...}})
MAX_RESULT_BYTES = 64 << 10  # a result lists at most a few hundred views; anything larger is junk
# json.dumps(..., separators=...) builds an encoder per call; one result per frame reuses this.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class ResultError(DdnnError, ValueError):
    """A result that does not follow the contract (the message says which field)."""


@dataclass(frozen=True, kw_only=True)
class Result:
    """One frame's answer; validated on construction."""

    frame: int
    cls: int | None  # "class" in JSON (a keyword in Python); None when exit is "none"
    label: str | None
    exit: str
    entropy: float | None
    views: tuple[str, ...]
    missing: Mapping[str, str] = field(default_factory=dict)
    degraded: bool = False
    latency_ms: float = 0.0
    seq: int | None = None  # the edge's answer number; None until the edge numbers it

    def __post_init__(self) -> None:
        if type(self.frame) is not int or self.frame < 0:
            raise ResultError("frame must be a non-negative integer")
        if self.seq is not None and (type(self.seq) is not int or not 0 <= self.seq <= MAX_SEQ):
            raise ResultError(f"seq must be an integer in 0..{MAX_SEQ}")
        if self.exit == NO_EXIT:
            self._check_unanswered()
        else:
            self._check_answer()
        if type(self.latency_ms) not in (int, float) or not 0 <= self.latency_ms < math.inf:
            raise ResultError("latency_ms must be a non-negative number")
        if type(self.degraded) is not bool:
            raise ResultError("degraded must be true or false")
        views = tuple(self.views) if isinstance(self.views, list | tuple) else None
        if views is None or not all(is_name(v) for v in views) or len(set(views)) != len(views):
            raise ResultError("views must be a list of distinct device ids")
        if not isinstance(self.missing, Mapping) or not all(
                is_name(k) and r in MISSING_REASONS for k, r in self.missing.items()):
            raise ResultError(f"missing must map device ids to one of "
                              f"{', '.join(MISSING_REASONS)}")
        if set(views) & set(self.missing):
            raise ResultError("a view cannot be both fused and missing")
        object.__setattr__(self, "views", views)
        object.__setattr__(self, "missing", MappingProxyType(dict(self.missing)))

    def _check_answer(self) -> None:
        if type(self.cls) is not int or self.cls < 0:
            raise ResultError("class must be a non-negative integer")
        if not isinstance(self.label, str) or not self.label:
            raise ResultError("label must be a non-empty string")
        if self.exit not in EXITS:
            raise ResultError(f"exit must be one of {', '.join((*EXITS, NO_EXIT))}")
        if type(self.entropy) not in (int, float) or not 0 <= self.entropy < math.inf:
            raise ResultError("entropy must be a non-negative number")

    def _check_unanswered(self) -> None:
        if self.cls is not None or self.label is not None or self.entropy is not None:
            raise ResultError(f"a frame with exit {NO_EXIT!r} has null class, label and entropy")
        if not isinstance(self.views, list | tuple) or self.views:
            raise ResultError(f"a frame with exit {NO_EXIT!r} fused no view: views must be []")

    @property
    def answered(self) -> bool:
        """Whether a tier classified the frame (False: no view was fused, exit "none")."""
        return self.exit != NO_EXIT

    @property
    def partial(self) -> bool:
        """True when a view that had something to report was not fused."""
        return any(reason != "absent" for reason in self.missing.values())

    def to_dict(self) -> dict[str, Any]:
        return {"frame": self.frame, "class": self.cls, "label": self.label, "exit": self.exit,
                "entropy": None if self.entropy is None else round(float(self.entropy), 6),
                "views": list(self.views),
                "missing": dict(self.missing), "partial": self.partial,
                "degraded": self.degraded, "latency_ms": round(float(self.latency_ms), 3),
                **({} if self.seq is None else {"seq": self.seq})}

    def numbered(self, seq: int) -> Result:
        """This result as the edge's answer number ``seq``."""
        return replace(self, seq=seq)

    def to_json(self) -> bytes:
        return _ENCODER.encode(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, d: object) -> Result:
        """Parse and validate a result (a :class:`ResultError` says what is off)."""
        if not isinstance(d, dict) or not set(KEYS) <= set(d) <= {*KEYS, *OPTIONAL_KEYS}:
            raise ResultError(f"a result has exactly the keys {', '.join(KEYS)}, and "
                              f"optionally {', '.join(OPTIONAL_KEYS)}")
        r = cls(frame=d["frame"], cls=d["class"], label=d["label"], exit=d["exit"],
                entropy=d["entropy"], views=d["views"], missing=d["missing"],
                degraded=d["degraded"], latency_ms=d["latency_ms"], seq=d.get("seq"))
        if d["partial"] is not r.partial:
            raise ResultError("partial must be true exactly when a non-absent view is missing")
        return r

    @classmethod
    def from_json(cls, data: bytes | str) -> Result:
        if len(data) > MAX_RESULT_BYTES:
            raise ResultError(f"a result is at most {MAX_RESULT_BYTES} bytes")
        try:
            d = bounded_json.loads(data, MAX_RESULT_DEPTH)
        except ValueError as e:
            raise ResultError(f"not JSON: {e}") from None
        return cls.from_dict(d)


def result_for(*, frame: int, scores: Sequence[float], classes: Sequence[str], exit: str,
               entropy: float, views: Sequence[str], missing: Mapping[str, str] | None = None,
               degraded: bool = False, latency_ms: float = 0.0) -> Result:
    """The result of ``scores`` (one row of class scores): the arg-max class and its label."""
    best = max(range(len(scores)), key=lambda i: scores[i])
    return Result(frame=frame, cls=best, label=classes[best], exit=exit, entropy=float(entropy),
                  views=tuple(views), missing=missing or {}, degraded=degraded,
                  latency_ms=max(float(latency_ms), 0.0))


def unanswered(*, frame: int, missing: Mapping[str, str], degraded: bool = False,
               latency_ms: float = 0.0) -> Result:
    """The result of a frame in which no view was fused: exit "none", nothing classified."""
    return Result(frame=frame, cls=None, label=None, exit=NO_EXIT, entropy=None, views=(),
                  missing=missing, degraded=degraded, latency_ms=max(float(latency_ms), 0.0))


def json_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of one result message."""
    name = {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,63}$"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://ddnn.invalid/schemas/result.json",
        "title": "ddnn result",
        "description": "The answer for one frame, published on {prefix}/{deployment}/results.",
        "type": "object",
        "additionalProperties": False,
        "required": list(KEYS),
        "properties": {
            "frame": {"type": "integer", "minimum": 0, "description": "frame id"},
            "class": {"type": ["integer", "null"], "minimum": 0,
                      "description": "index into the classes; null when no view was fused"},
            "label": {"type": ["string", "null"], "minLength": 1,
                      "description": "the class's name; null when no view was fused"},
            "exit": {"enum": [*EXITS, NO_EXIT],
                     "description": "the tier that answered; \"none\" when no view was fused"},
            "entropy": {"type": ["number", "null"], "minimum": 0,
                        "description": "normalized entropy of the answering exit; null when no "
                                       "view was fused"},
            "views": {"type": "array", "items": name, "uniqueItems": True,
                      "description": "device ids of the views fused"},
            "missing": {"type": "object", "propertyNames": name,
                        "additionalProperties": {"enum": list(MISSING_REASONS)},
                        "description": "each expected view not fused, and why"},
            "partial": {"type": "boolean",
                        "description": "a view that had something to report was not fused"},
            "degraded": {"type": "boolean",
                         "description": "a tier the frame needed was unreachable"},
            "latency_ms": {"type": "number", "minimum": 0,
                           "description": "capture to result, milliseconds"},
            "seq": {"type": "integer", "minimum": 0, "maximum": MAX_SEQ,
                    "description": "the edge's number for this answer, increasing in the order "
                                   "it answers (across its restarts): page and resume by it "
                                   "(frame ids come out of order); on every result the edge "
                                   "publishes"},
        },
        # Null class, label and entropy, and no view fused, exactly when nobody classified it.
        "if": {"properties": {"exit": {"const": NO_EXIT}}},
        "then": {"properties": {"class": {"type": "null"}, "label": {"type": "null"},
                                "entropy": {"type": "null"}, "views": {"maxItems": 0}}},
        "else": {"properties": {"class": {"type": "integer"}, "label": {"type": "string"},
                                "entropy": {"type": "number"}}},
    }
