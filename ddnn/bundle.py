"""The bundle: what training produces and every tier loads.

A directory holding ``manifest.json`` and one ONNX file per segment. The manifest describes the
model completely (classes, views, input shape, each segment's tensors and sha256, aggregation,
exit thresholds, codecs, and how it was trained and calibrated); :func:`load_bundle` verifies
every checksum and refuses a tampered or incompatible bundle with a :class:`BundleError`.
No pickle anywhere: the manifest is JSON, the weights live inside the ONNX files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddnn import bounded_json
from ddnn.aggregation import AGGREGATIONS, aggregated_channels
from ddnn.codec import CODECS
from ddnn.errors import BundleError, DdnnError
from ddnn.exits import ExitPolicy
from ddnn.manifest_format import (
    FORMAT,
    FORMAT_VERSION,
    KIND_NAMES,
    check_format,
    check_name,
    class_names,
)
from ddnn.raw_manifest import RawManifest
from ddnn.segment import SegmentSpec, expect_shape, sha256_file
from ddnn.stacking import Stacking

# The version that may hold ``stacking`` (ddnn.stacking), which a reader of version 1 would
# ignore and so answer otherwise than the bundle's calibration; a bundle without it is written
# as version 1, which every reader loads.
STACKING_FORMAT = 2
MANIFEST = "manifest.json"


def _level(value: Any) -> int:
    if value not in (0, 1) or isinstance(value, bool):
        raise ValueError(f"escalation level must be 0 or 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Manifest:
    """Everything a tier needs to know about a bundle, as stored in ``manifest.json``."""

    name: str
    version: str
    classes: tuple[str, ...]
    views: int
    input_shape: tuple[int, int, int]  # (3, H, W) of one view
    aggregation: dict[str, str]  # {"local": op, "edge": op}, ops from ddnn.aggregation
    scheme: str  # the paper's name, e.g. "MP-CC"
    devices: tuple[SegmentSpec, ...]  # one device segment per view
    local: SegmentSpec | None  # the local exit's layer; present only when it has weights
    edge: SegmentSpec
    cloud: SegmentSpec
    thresholds: dict[str, float]  # {"local": T, "edge": T}
    codec: dict[str, str]  # {"scores": ..., "device_features": ..., "edge_features": ...}
    training: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format_version: int = FORMAT_VERSION
    # Escalation (docs/training.md): the cloud's segment for frames that also bring every
    # present camera's detail (the devices' "detail" output, travelling with
    # codec["device_detail"]), and the level calibration chose (0: never pull them, 1: pull
    # them for every frame that passes the edge exit). Older bundles have neither: level 0.
    escalated: SegmentSpec | None = None
    escalation_level: int = 0
    escalation_views: int = 0  # details of the k surest present views (hierarchy.surest_views)
    # Stacked exits (ddnn.stacking): each upper tier's answer on top of the one below it.
    # Older bundles have none: every tier answers on its own.
    stacking: Stacking | None = None
    kind: str = "ddnn"  # a hierarchy bundle (a raw-offload reference is a RawManifest)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def policy(self) -> ExitPolicy:
        return ExitPolicy(dict(self.thresholds))

    def segments(self) -> dict[str, SegmentSpec]:
        """Every segment by role: ``device-{i}`` per view, ``local``, ``edge``, ``cloud``."""
        out = {f"device-{i}": s for i, s in enumerate(self.devices)}
        if self.local is not None:
            out["local"] = self.local
        out["edge"] = self.edge
        out["cloud"] = self.cloud
        if self.escalated is not None:
            out["escalated"] = self.escalated
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            # The lowest version that holds what this manifest holds: every reader that can.
            "format_version": STACKING_FORMAT if self.stacking is not None else 1,
            "kind": self.kind,
            "created": self.created,
            "model": {"name": self.name, "version": self.version},
            "classes": list(self.classes),
            "views": self.views,
            "input": {"shape": list(self.input_shape), "dtype": "float32", "range": [0.0, 1.0]},
            "aggregation": {**self.aggregation, "scheme": self.scheme},
            "segments": {
                "device": [s.to_dict() for s in self.devices],
                "local": self.local.to_dict() if self.local else None,
                "edge": self.edge.to_dict(),
                "cloud": self.cloud.to_dict(),
            },
            "exits": {k: {"threshold": v} for k, v in self.thresholds.items()},
            "codec": dict(self.codec),
            "training": self.training,
            "calibration": self.calibration,
        }
        if self.escalated is not None:
            out["segments"]["escalated"] = self.escalated.to_dict()
            out["escalation"] = {"level": self.escalation_level, "views": self.escalation_views}
        if self.stacking is not None:
            out["stacking"] = self.stacking.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest; raises :class:`BundleError` on any inconsistency."""
        version = check_format(d, "ddnn")
        try:
            segs = d["segments"]
            m = cls(
                name=check_name("model name", d["model"]["name"]),
                version=check_name("model version", str(d["model"]["version"])),
                classes=class_names(d["classes"]),
                views=int(d["views"]),
                input_shape=tuple(int(x) for x in d["input"]["shape"]),  # type: ignore[arg-type]
                aggregation={"local": d["aggregation"]["local"], "edge": d["aggregation"]["edge"]},
                scheme=str(d["aggregation"].get("scheme", "")),
                devices=tuple(SegmentSpec.from_dict(s) for s in segs["device"]),
                local=SegmentSpec.from_dict(segs["local"]) if segs.get("local") else None,
                edge=SegmentSpec.from_dict(segs["edge"]),
                cloud=SegmentSpec.from_dict(segs["cloud"]),
                thresholds={k: float(v["threshold"]) for k, v in d["exits"].items()},
                codec={k: str(v) for k, v in d["codec"].items()},
                training=dict(d.get("training", {})),
                calibration=dict(d.get("calibration", {})),
                created=str(d.get("created", "")),
                format_version=version,
                escalated=(SegmentSpec.from_dict(segs["escalated"])
                           if segs.get("escalated") else None),
                escalation_level=_level(d.get("escalation", {}).get("level", 0)),
                escalation_views=int(d.get("escalation", {}).get("views", 0)),
                stacking=Stacking.from_dict(d["stacking"]) if "stacking" in d else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(f"malformed manifest: {type(e).__name__}: {e}") from None
        m._validate()
        return m

    def _validate(self) -> None:
        if len(self.classes) < 2:
            raise BundleError("manifest must name at least two classes")
        if self.views < 1 or len(self.devices) != self.views:
            raise BundleError(
                f"manifest has {len(self.devices)} device segments for {self.views} views"
            )
        if len(self.input_shape) != 3 or self.input_shape[0] != 3:
            raise BundleError(f"input shape must be (3, H, W), got {self.input_shape}")
        for role, op in self.aggregation.items():
            if op not in AGGREGATIONS:
                raise BundleError(f"unknown {role} aggregation {op!r}")
        if self.aggregation["local"] == "concat" and self.local is None:
            raise BundleError("concat local aggregation needs a local segment")
        for role in ("scores", "device_features", "edge_features"):
            if self.codec.get(role) not in CODECS:
                raise BundleError(f"codec for {role} must be one of {CODECS}")
        try:
            self.policy  # noqa: B018 - validates the thresholds
        except DdnnError as e:
            raise BundleError(f"invalid exit thresholds: {e}") from None
        for role, seg in self.segments().items():
            if not seg.file or "/" in seg.file or "\\" in seg.file or seg.file.startswith("."):
                raise BundleError(f"segment {role} names an unsafe file {seg.file!r}")
        if self.stacking is not None:
            if self.format_version < STACKING_FORMAT:  # (a reader of 1 would ignore it)
                raise BundleError(f"stacking needs format_version {STACKING_FORMAT} or later")
            # One camera decides its own local exit and sends the edge no scores to stack on.
            if self.views == 1 and self.stacking.edge != 1.0:
                raise BundleError("a one-view bundle cannot stack its edge exit on the local one")
        self._validate_chain()

    def _validate_chain(self) -> None:
        """Each segment's input is what the one before it outputs, and every exit has C scores."""
        classes = (self.num_classes,)
        features = None
        for i, seg in enumerate(self.devices):
            expect_shape(seg.input("image"), self.input_shape, f"device-{i} image")
            expect_shape(seg.output("scores"), classes, f"device-{i} scores")
            shape = seg.output("features").sample_shape
            if not shape:
                raise BundleError(f"device-{i} features need a shape per sample, got none")
            if features not in (None, shape):
                raise BundleError(f"device-{i} features {shape} differ from device-0's "
                                  f"{features}")
            features = shape
        if self.local is not None:
            n = aggregated_channels(self.aggregation["local"], self.views, self.num_classes)
            expect_shape(self.local.input("device_scores"), (n,), "local device_scores")
            expect_shape(self.local.output("scores"), classes, "local scores")
        assert features is not None  # views >= 1 was checked
        channels = aggregated_channels(self.aggregation["edge"], self.views, features[0])
        expect_shape(self.edge.input("device_features"), (channels, *features[1:]),
                     "edge device_features")
        expect_shape(self.edge.output("scores"), classes, "edge scores")
        expect_shape(self.cloud.input("edge_features"),
                     self.edge.output("features").sample_shape, "cloud edge_features")
        expect_shape(self.cloud.output("scores"), classes, "cloud scores")
        self._validate_escalation()

    def _validate_escalation(self) -> None:
        """The escalated segment reads the edge features and every view's "detail" output."""
        if self.escalated is None:
            if self.escalation_level:
                raise BundleError("escalation level 1 needs an escalated segment")
            return
        if self.codec.get("device_detail") not in CODECS:
            raise BundleError(f"codec for device_detail must be one of {CODECS}")
        detail = self.devices[0].output("detail").sample_shape
        if not detail:
            raise BundleError("device-0 detail needs a shape per sample, got none")
        for i, seg in enumerate(self.devices):
            expect_shape(seg.output("detail"), detail, f"device-{i} detail")
        if not 0 <= self.escalation_views <= self.views:
            raise BundleError(f"escalation views must lie in 0..{self.views} (0: every view), "
                              f"got {self.escalation_views}")
        slots = self.escalation_views or self.views
        expect_shape(self.escalated.input("edge_features"),
                     self.edge.output("features").sample_shape, "escalated edge_features")
        expect_shape(self.escalated.input("device_detail"), (slots * detail[0], *detail[1:]),
                     "escalated device_detail")
        expect_shape(self.escalated.output("scores"), (self.num_classes,), "escalated scores")


def parse_manifest(d: Any, kind: str | None = "ddnn") -> Manifest | RawManifest:
    """A manifest of ``kind`` (None: either) from its JSON object; refuses any other kind.
    Kind "raw" gives a :class:`ddnn.raw_manifest.RawManifest`."""
    found = d.get("kind", "ddnn") if isinstance(d, dict) else "ddnn"
    if kind is None and found in KIND_NAMES:
        kind = found
    if kind == "raw":
        return RawManifest.from_dict(d)
    return Manifest.from_dict(d)


@dataclass(frozen=True)
class Bundle:
    """A verified bundle on disk: its directory and its manifest."""

    path: Path
    manifest: Manifest  # a RawManifest where the bundle was loaded with kind "raw" or None
    # The exact bytes of manifest.json (and manifest.sig, None when unsigned) that were read and
    # verified when the bundle was loaded: what a server hands out, never the file as it is now.
    manifest_bytes: bytes | None = field(default=None, compare=False, repr=False)
    signature_bytes: bytes | None = field(default=None, compare=False, repr=False)

    def file(self, segment: SegmentSpec) -> Path:
        return self.path / segment.file

    @property
    def ref(self) -> str:
        """``name:version``, how logs and messages refer to the bundle."""
        return f"{self.manifest.name}:{self.manifest.version}"


def read_manifest(path: str | Path, raw: bytes | None = None, kind: str | None = "ddnn"
                  ) -> Manifest:
    """Parse ``manifest.json`` of a bundle directory without verifying the files.

    ``raw``: the manifest's bytes when the caller already read (and verified) them. ``kind``:
    the kind of bundle expected ("ddnn", a hierarchy; "raw", a raw-offload reference; None:
    either); another kind is refused with a :class:`BundleError` that names it.
    """
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle directory")
    if raw is None and not mf.is_file():
        raise BundleError(f"{path}: not a bundle (no {MANIFEST})")
    try:
        # A bundle may come over the air: bound its nesting like any peer's JSON.
        data = bounded_json.loads((mf.read_bytes() if raw is None else raw).decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError, JSONDecodeError, too deep
        raise BundleError(f"{mf}: unreadable manifest ({e})") from None
    return parse_manifest(data, kind)  # type: ignore[return-value]


def load_bundle(path: str | Path, verify: bool = True,
                public_key: str | Path | None = None, kind: str | None = "ddnn") -> Bundle:
    """Load a bundle directory, verifying every segment file's sha256 unless ``verify=False``.

    With ``public_key`` (an Ed25519 PEM file, see :mod:`ddnn.signing`) the manifest's signature
    is checked first, whatever ``verify`` says: an unsigned or tampered bundle is refused.
    ``kind``: "ddnn" (a hierarchy, what the tiers run), "raw" (a raw-offload reference, see
    :class:`RawManifest`) or None (either, as ``manifest.kind`` says).
    """
    from ddnn.signing import read_signed_files, verify_manifest_bytes

    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle directory")
    if public_key is not None:
        from ddnn.signing import _crypto, _load_key

        _crypto()
        _load_key(public_key, private=False)  # a bad key is a ConfigError before any file
    elif not (path / MANIFEST).is_file():
        raise BundleError(f"{path}: not a bundle (no {MANIFEST})")
    raw, sig = read_signed_files(path)  # read once: what is verified is what is parsed
    if public_key is not None:
        verify_manifest_bytes(raw, sig, public_key, str(path))
    manifest = read_manifest(path, raw, kind)
    if verify:
        for role, seg in manifest.segments().items():
            f = path / seg.file
            if not f.is_file():
                raise BundleError(f"{path}: segment {role} file {seg.file} is missing")
            digest = sha256_file(f)
            if digest != seg.sha256:
                raise BundleError(
                    f"{path}: checksum mismatch for {seg.file} ({role}): the file was changed "
                    f"after export (expected sha256 {seg.sha256[:12]}…, got {digest[:12]}…)"
                )
    return Bundle(path, manifest, raw, sig)


def write_manifest(path: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` into a bundle directory (used by the exporter)."""
    out = Path(path) / MANIFEST
    out.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n", encoding="utf-8")
    return out
