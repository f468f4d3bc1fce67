"""Which bundle versions' device messages the edge takes, and the bounds of their scores.

The running version's, the one before an over-the-air update's (devices switch one after
another), and one announced for an update; each compact message's model is the one its
device's retained status names (they carry only the version). The running version's hot
message is read in place (:class:`~ddnn.edge.ingest.ScoresReader`); its scores and the ones
before's are checked against their bundle's bounds (:mod:`ddnn.edge.score_bounds`).
"""

from __future__ import annotations

from ddnn.bundle import Manifest
from ddnn.edge.score_bounds import ScoreBounds

FINITE = ScoreBounds(None)  # the bounds of a version not known here yet: finite scores


class AcceptedVersions:
    """The versions taken now, starting with ``manifest``'s."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.previous: tuple[str, str] | None = None  # the version before the last update
        self.announced: tuple[str, str] | None = None  # a version announced for an update
        self.models: dict[str, str] = {}  # device -> model name its status says it runs
        # The bounds of the running version's scores and, during an update, the one before's;
        # an announced version's are unknown until it runs here.
        self.bounds = self._previous_bounds = ScoreBounds.of(manifest.calibration)

    def serve(self, manifest: Manifest) -> None:
        """Take messages of ``manifest``'s version (an update), still those of the one before."""
        self.previous = (self.manifest.name, self.manifest.version)
        self.manifest = manifest
        self._previous_bounds, self.bounds = self.bounds, ScoreBounds.of(manifest.calibration)

    def announce(self, version: tuple[str, str] | None) -> None:
        """Also take messages of this ``(name, version)``, announced for an update (None: no
        announced version)."""
        self.announced = version

    def withdraw(self, version: tuple[str, str]) -> None:
        """No longer take messages of ``version`` (its update was refused), unless another
        version has been announced since."""
        if self.announced == version:
            self.announced = None

    def model_of(self, device: str) -> str:
        """The model ``device`` runs, as its status says (the running one until it says)."""
        return self.models.get(device, self.manifest.name)

    def takes(self, version: tuple[str, str]) -> bool:
        """Whether messages of ``(name, version)`` are taken."""
        m = self.manifest
        return version in ((m.name, m.version), self.previous, self.announced)

    def bounds_of(self, version: tuple[str, str]) -> ScoreBounds:
        """The bounds of the scores of ``(name, version)``."""
        m = self.manifest
        return (self.bounds if version == (m.name, m.version) else
                self._previous_bounds if version == self.previous else FINITE)
