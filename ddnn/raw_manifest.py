"""The manifest of a raw-offload reference bundle (``"kind": "raw"``).

What ``ddnn train --baseline`` writes: one model on the full image of every view, judged against
the hierarchy and served beside it as ``{name}-raw``. Loaded by
``ddnn.bundle.load_bundle(path, kind="raw")`` (or ``kind=None``), which verifies its checksum as
for any bundle; the tiers' default load refuses it by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddnn.errors import BundleError
from ddnn.manifest_format import FORMAT, check_format, check_name, class_names
from ddnn.segment import SegmentSpec, expect_shape


@dataclass(frozen=True)
class RawManifest:
    """A raw-offload reference bundle (``"kind": "raw"``): one model, ``raw``, on the full image
    of every view → class scores. What the hierarchy is judged against (``ddnn train
    --baseline``), served beside a hierarchy bundle of the same name as ``{name}-raw``.

    Its one input, ``views`` (V, 3, H, W) in [0, 1], holds zeros for an absent view (the
    dataset contract), so every request needs nothing else; on a constrained uplink each
    present view counts as an 8-bit image.
    """

    name: str
    version: str
    classes: tuple[str, ...]
    views: int
    input_shape: tuple[int, int, int]
    raw: SegmentSpec
    training: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format_version: int = 1  # (version 2 adds stacking, which a raw bundle never holds)
    kind: str = "raw"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def segments(self) -> dict[str, SegmentSpec]:
        return {"raw": self.raw}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "kind": self.kind,
            "created": self.created,
            "model": {"name": self.name, "version": self.version},
            "classes": list(self.classes),
            "views": self.views,
            "input": {"shape": list(self.input_shape), "dtype": "float32", "range": [0.0, 1.0]},
            "segments": {"raw": self.raw.to_dict()},
            "training": self.training,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RawManifest:
        version = check_format(d, "raw")
        try:
            m = cls(
                name=check_name("model name", d["model"]["name"]),
                version=check_name("model version", str(d["model"]["version"])),
                classes=class_names(d["classes"]),
                views=int(d["views"]),
                input_shape=tuple(int(x) for x in d["input"]["shape"]),  # type: ignore[arg-type]
                raw=SegmentSpec.from_dict(d["segments"]["raw"]),
                training=dict(d.get("training", {})),
                created=str(d.get("created", "")),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(f"malformed manifest: {type(e).__name__}: {e}") from None
        if len(m.classes) < 2 or m.views < 1:
            raise BundleError("manifest must name at least two classes and one view")
        if len(m.input_shape) != 3 or m.input_shape[0] != 3:
            raise BundleError(f"input shape must be (3, H, W), got {m.input_shape}")
        f = m.raw.file
        if not f or "/" in f or "\\" in f or f.startswith("."):
            raise BundleError(f"segment raw names an unsafe file {f!r}")
        expect_shape(m.raw.input("views"), (m.views, *m.input_shape), "raw views")
        expect_shape(m.raw.output("scores"), (m.num_classes,), "raw scores")
        return m
