"""Deterministic multi-camera scenes in the MVMC layout, for training without a download.

Each class is a 3D object built from coloured Gaussian blobs: a body shared by every class plus
a few distinguishing parts on particular sides of it. V cameras stand around the object; the
blobs are drawn opaque, back to front, so a part on the far side is hidden by the body. A single
camera therefore often sees only the shared body (classes look alike), while the set of
cameras nearly always has one that sees the parts: fusing views beats any one view for real
viewpoint reasons, as in the paper's MVMC data.

Only numpy: the file is used by tools that run without torch.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MVMC_CLASSES = ("car", "bus", "person")
_CHUNK = 128  # samples rendered at once: keeps the (views, H, W) work arrays in cache-sized pieces


@dataclass(frozen=True)
class SceneConfig:
    """How scenes are made; the defaults give a small CNN ~0.8 per view and ~0.98 fused."""

    views: int = 6  # cameras around the object, as MVMC's six
    classes: int = 3  # object classes; 3 gets MVMC's names (car, bus, person)
    size: int = 32  # image height and width in pixels, as MVMC's 32x32
    world_seed: int = 0  # seeds the class objects; keep it equal so train and test share classes
    body_blobs: int = 6  # blobs of the body all classes share: the source of single-view ambiguity
    parts: int = 3  # distinguishing blobs per class, clustered on one side of the body
    part_spread: float = 0.35  # radians the parts scatter around their side: small keeps them
    # hidden from the back of the object
    absent_prob: float = 0.2  # chance a camera does not see the object at all (all-zero image)
    noise: float = 0.06  # standard deviation of the Gaussian pixel noise
    occlusion_prob: float = 0.3  # chance a view has a random rectangle in front of the object
    camera_jitter: float = 0.25  # radians of random azimuth added to each camera's position
    max_elevation: float = 0.45  # radians cameras look down from at most; more shows the top
    scale_range: tuple[float, float] = (0.75, 1.25)  # relative object size in a view (distance)
    max_shift: float = 0.15  # largest object offset from the image centre, in image widths
    colour_jitter: float = 0.12  # per-view lighting change: gain and tint amplitude
    background: float = 0.12  # amplitude of the background's low-frequency texture
    zoom: float = 1.0  # partial views: each camera this many times closer, aimed at a random
    # point of the object, so it sees only part of it (1: the whole object)


def class_names(classes: int) -> list[str]:
    """MVMC's names for three classes, ``class0``, ``class1``, ... otherwise."""
    if classes == len(MVMC_CLASSES):
        return list(MVMC_CLASSES)
    return [f"class{i}" for i in range(classes)]


@dataclass(frozen=True)
class World:
    """The class objects: blob centres, covariances and colours, in the object's own frame."""

    centres: np.ndarray  # (C, K, 3) float64; axes x, y horizontal, z up
    covariances: np.ndarray  # (C, K, 3, 3)
    colours: np.ndarray  # (C, K, 3) in [0, 1]


def make_world(config: SceneConfig) -> World:
    """The class objects of ``config.world_seed``; the sample seed plays no part."""
    _check(config)
    rng = np.random.default_rng([config.world_seed, 0x5CE7E])
    c, kb, kp = config.classes, config.body_blobs, config.parts

    # A compact body: blobs around the centre, muted colours, so from a side without parts all
    # classes look the same up to small per-class variations.
    body_centre = rng.normal(0.0, 1.0, (kb, 3)) * np.array([0.32, 0.32, 0.22])
    body_sigma = rng.uniform(0.32, 0.5, (kb, 3))
    body_sigma[:, 2] *= 0.8
    body_colour = np.clip(0.45 + rng.normal(0.0, 0.12, (kb, 1)) + rng.normal(0.0, 0.04, (kb, 3)),
                          0.15, 0.8)

    centres = np.empty((c, kb + kp, 3))
    sigmas = np.empty((c, kb + kp, 3))
    colours = np.empty((c, kb + kp, 3))
    # Each class's parts face their own side of the object, evenly spaced around it.
    side0 = rng.uniform(0.0, 2 * math.pi)
    for k in range(c):
        centres[k, :kb] = body_centre + rng.normal(0.0, 0.03, (kb, 3))
        sigmas[k, :kb] = body_sigma * rng.uniform(0.95, 1.05, (kb, 3))
        colours[k, :kb] = body_colour
        side = side0 + 2 * math.pi * k / c
        az = side + rng.normal(0.0, config.part_spread, kp)
        # Parts sit half inside the body's surface: seen from their side, hidden from behind.
        radius = rng.uniform(0.45, 0.6, kp)
        centres[k, kb:, 0] = radius * np.cos(az)
        centres[k, kb:, 1] = radius * np.sin(az)
        centres[k, kb:, 2] = rng.uniform(-0.25, 0.2, kp)
        sigmas[k, kb:] = rng.uniform(0.18, 0.25, (kp, 3))
        hue = (k / c + rng.uniform(-0.03, 0.03)) % 1.0
        colours[k, kb:] = [
            colorsys.hsv_to_rgb((hue + rng.uniform(-0.04, 0.04)) % 1.0, rng.uniform(0.75, 1.0),
                                rng.uniform(0.75, 1.0))
            for _ in range(kp)
        ]

    # Random orientations so projected blobs are tilted ellipses, not axis-aligned ones.
    rot = _random_rotations(rng, c * (kb + kp)).reshape(c, kb + kp, 3, 3)
    cov = np.einsum("ckij,ckj,cklj->ckil", rot, sigmas**2, rot)
    return World(centres, cov, colours)


def synthesize(n_samples: int, config: SceneConfig = SceneConfig(), seed: int = 0,
               ) -> dict[str, np.ndarray]:
    """Returns {"X", "y", "label", "classes"} per the dataset contract.

    ``X`` float32 (N, V, 3, H, W) in [0, 1]; ``y`` int64 (N, V), the class of each view or -1
    where the view is absent (its image all zeros); ``label`` int64 (N,); ``classes`` the class
    names as a unicode array. Same ``n_samples``, ``config`` and ``seed``: same arrays.
    """
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    world = make_world(config)
    rng = np.random.default_rng([seed, 0xDA7A])
    n, v, s = n_samples, config.views, config.size

    label = rng.integers(0, config.classes, n)
    present = rng.random((n, v)) >= config.absent_prob
    # Never a sample with no view: one camera, at random, always sees it.
    empty = ~present.any(axis=1)
    present[empty, rng.integers(0, v, n)[empty]] = True

    X = np.zeros((n, v, 3, s, s), dtype=np.float32)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        X[start:stop] = _render(world, label[start:stop], config, rng)
    X[~present] = 0.0
    y = np.where(present, label[:, None], -1).astype(np.int64)
    return {
        "X": X,
        "y": y,
        "label": label.astype(np.int64),
        "classes": np.array(class_names(config.classes), dtype=np.str_),
    }


def save_dataset(path: str | Path, data: dict[str, np.ndarray]) -> None:
    """Write ``data`` as a compressed .npz (no pickled objects), creating parent directories."""
    path = Path(path)
    for key, arr in data.items():
        if np.asarray(arr).dtype == object:
            raise ValueError(f"{key!r} is an object array; the dataset format forbids pickles")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **{k: np.asarray(a) for k, a in data.items()})


def _check(config: SceneConfig) -> None:
    if config.views < 1:
        raise ValueError(f"views must be >= 1, got {config.views}")
    if config.classes < 2:
        raise ValueError(f"classes must be >= 2, got {config.classes}")
    if config.size < 16:
        raise ValueError(f"size must be >= 16, got {config.size}")
    if config.body_blobs < 1 or config.parts < 1:
        raise ValueError("body_blobs and parts must be >= 1")
    if not 0.0 <= config.absent_prob <= 1.0 or not 0.0 <= config.occlusion_prob <= 1.0:
        raise ValueError("absent_prob and occlusion_prob must lie in [0, 1]")
    if not config.zoom >= 1.0:
        raise ValueError(f"zoom must be >= 1, got {config.zoom}")
    lo, hi = config.scale_range
    if not 0.0 < lo <= hi:
        raise ValueError(f"scale_range must satisfy 0 < low <= high, got {config.scale_range}")


def _random_rotations(rng: np.random.Generator, count: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(count, 3, 3)))
    return q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]


def _render(world: World, label: np.ndarray, cfg: SceneConfig,
            rng: np.random.Generator) -> np.ndarray:
    """Render every view of the samples ``label``: float32 (n, V, 3, H, W) in [0, 1]."""
    n, v, s = len(label), cfg.views, cfg.size
    b = n * v

    # --- cameras: azimuth around the object, relative to its random yaw; a downward tilt ------
    yaw = rng.uniform(0.0, 2 * math.pi, (n, 1))
    azimuth = 2 * math.pi * np.arange(v) / v + rng.normal(0.0, cfg.camera_jitter, (n, v))
    rel = (azimuth - yaw).reshape(b)
    elev = rng.uniform(0.0, cfg.max_elevation, b)
    ca, sa, ce, se = np.cos(rel), np.sin(rel), np.cos(elev), np.sin(elev)
    zero = np.zeros(b)
    # Rows: image right, image up, depth away from the camera (object frame, camera on the
    # circle at angle ``rel``, looking at the origin).
    cam = np.stack([
        np.stack([-sa, ca, zero], 1),
        np.stack([-se * ca, -se * sa, ce], 1),
        np.stack([-ce * ca, -ce * sa, -se], 1),
    ], 1)

    # --- blobs in camera space, then pixels (weak perspective: one scale per view) -----------
    cls = np.repeat(label, v)
    mu = np.einsum("bij,bkj->bki", cam, world.centres[cls])
    cov = np.einsum("bij,bkjl,bml->bkim", cam, world.covariances[cls], cam)
    # Painter's key: where the blob's opaque core begins along the view axis, not its centre, so
    # a small part tucked against a large body blob is drawn first and hidden unless it sticks out.
    front = mu[:, :, 2] - 1.2 * np.sqrt(cov[..., 2, 2])
    cov = cov[..., :2, :2]
    scale = (0.3 * s * rng.uniform(0.85, 1.15, (n, 1))
             * rng.uniform(*cfg.scale_range, (n, v))).reshape(b)
    shift = rng.uniform(-cfg.max_shift, cfg.max_shift, (b, 2)) * s
    if cfg.zoom > 1:
        scale, shift = _partial_view(rng, scale, shift, cfg.zoom)
    col = s / 2 + shift[:, :1] + scale[:, None] * mu[:, :, 0]
    row = s / 2 + shift[:, 1:] - scale[:, None] * mu[:, :, 1]
    cov = cov * (scale**2)[:, None, None, None]
    det = cov[..., 0, 0] * cov[..., 1, 1] - cov[..., 0, 1] ** 2
    # Precision in (col, row): the row axis points down, which flips the off-diagonal sign.
    p_cc, p_rr, p_cr = cov[..., 1, 1] / det, cov[..., 0, 0] / det, cov[..., 0, 1] / det

    gain = 1.0 + rng.uniform(-2, 2, (b, 1)) * cfg.colour_jitter
    tint = rng.normal(0.0, cfg.colour_jitter / 2, (b, 3))
    colour = np.clip(world.colours[cls] * gain[:, :, None] + tint[:, None, :], 0.0, 1.0)

    img = _background(rng, b, s, cfg.background)

    # Painter's algorithm: farthest blob first, so near blobs cover far ones.
    order = np.argsort(-front, axis=1, kind="stable")

    def take(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(a, order if a.ndim == 2 else order[..., None], axis=1)

    col, row, p_cc, p_rr, p_cr, colour = map(take, (col, row, p_cc, p_rr, p_cr, colour))
    grid = np.arange(s, dtype=np.float32) + 0.5
    f32 = np.float32
    for k in range(order.shape[1]):
        dc = grid[None, :] - col[:, k, None].astype(f32)  # (b, W)
        dr = grid[None, :] - row[:, k, None].astype(f32)  # (b, H)
        d2 = (p_rr[:, k, None, None].astype(f32) * dr[:, :, None] ** 2
              + p_cc[:, k, None, None].astype(f32) * dc[:, None, :] ** 2)
        d2 += (2 * p_cr[:, k, None, None].astype(f32) * dr[:, :, None]) * dc[:, None, :]
        g = np.exp(-0.5 * d2)
        # Opaque core (alpha 1 within ~1.2 sigma), soft rim; brighter at the centre for shape.
        alpha = np.minimum(2.0 * g, 1.0)[:, None]
        shade = (0.65 + 0.35 * g)[:, None]
        img += alpha * (colour[:, k, :, None, None].astype(f32) * shade - img)

    _occlude(rng, img, cfg.occlusion_prob)
    img += rng.normal(0.0, cfg.noise, img.shape).astype(np.float32)
    # Floor a hair above zero: an all-zero image means "absent" in the dataset contract.
    np.clip(img, 1.0 / 255, 1.0, out=img)
    return img.reshape(n, v, 3, s, s)


def _partial_view(rng: np.random.Generator, scale: np.ndarray, shift: np.ndarray,
                  zoom: float) -> tuple[np.ndarray, np.ndarray]:
    """Each camera ``zoom`` times closer and aimed at a random point of the object (within the
    body's half-width of its centre, in the image plane): it sees only that part of it."""
    aim = rng.uniform(-0.5, 0.5, (len(scale), 2))
    scale = scale * zoom
    # The aimed point lands where the object's centre would have: (col, row) axes, row down.
    return scale, shift - scale[:, None] * aim * np.array([1.0, -1.0])


def _background(rng: np.random.Generator, b: int, s: int, amplitude: float) -> np.ndarray:
    """Dim, desaturated backgrounds: a level, a linear gradient and a low-frequency texture."""
    level = rng.uniform(0.1, 0.5, (b, 1, 1, 1)) + rng.normal(0.0, 0.04, (b, 3, 1, 1))
    t = (np.arange(s) + 0.5) / s - 0.5
    ang = rng.uniform(0.0, 2 * math.pi, b)
    slope = rng.uniform(-0.25, 0.25, b)
    ramp = slope[:, None, None] * (np.cos(ang)[:, None, None] * t[None, None, :]
                                   + np.sin(ang)[:, None, None] * t[None, :, None])
    # Bilinear upsampling of a coarse 4x4 grid, as one matrix per axis.
    coarse = rng.normal(0.0, amplitude, (b, 3, 4, 4))
    pos = np.clip(t + 0.5, 0, 1) * 3
    lo = np.minimum(pos.astype(int), 2)
    up = np.zeros((s, 4))
    up[np.arange(s), lo] = 1 - (pos - lo)
    up[np.arange(s), lo + 1] = pos - lo
    tex = np.einsum("hi,bcij,wj->bchw", up, coarse, up)
    return (level + ramp[:, None] + tex).astype(np.float32)


def _occlude(rng: np.random.Generator, img: np.ndarray, prob: float) -> None:
    """Paint a random flat rectangle (a passer-by, a pole) over some views, in place."""
    b, _, s, _ = img.shape
    hit = rng.random(b) < prob
    size = rng.uniform(0.2, 0.5, (b, 2)) * s
    corner = rng.uniform(0.0, 1.0, (b, 2)) * (s - size)
    # Muted fills: a saturated one would mimic a class's part and mislead even fused views.
    fill = (rng.uniform(0.1, 0.8, (b, 1)) + rng.normal(0.0, 0.08, (b, 3))).astype(np.float32)
    idx = np.flatnonzero(hit)
    if idx.size == 0:
        return
    grid = np.arange(s) + 0.5
    rows = (grid[None, :] >= corner[idx, :1]) & (grid[None, :] < corner[idx, :1] + size[idx, :1])
    cols = (grid[None, :] >= corner[idx, 1:]) & (grid[None, :] < corner[idx, 1:] + size[idx, 1:])
    mask = rows[:, :, None] & cols[:, None, :]
    sub = img[idx]
    sub[:] = np.where(mask[:, None], fill[idx, :, None, None], sub)
    img[idx] = sub


# --- Field conditions: a drifted domain and a split into sites (``ddnn data synth --drift``,
# ``--sites``), for federated fine-tuning's tests and benchmark ------------------------------

DRIFTS = ("remount", "lighting", "rotation")  # what ``--drift all`` means
# A drift of the sensors, not of the scene: a worn or high-gain camera, its pixel noise this
# much stronger (added in quadrature to the scene's own). A device's few full-resolution
# binary filters read it as texture, while an escalated frame's pooled view averages it away,
# so it misleads the early exits far more than the escalated cloud: the case where the cloud
# can teach the exits below it (docs/federated-learning.md, "The cloud as the only teacher").
SENSOR_NOISE = 0.2
DRIFT_KINDS = (*DRIFTS, "noise")


def drifted_config(config: SceneConfig, drifts: tuple[str, ...]) -> SceneConfig:
    """The scene settings of the drifted domain: ``remount`` puts the cameras higher, looking
    down on the objects, and closer (other elevations and scales than the training data);
    ``noise`` makes every camera's pixel noise stronger by :data:`SENSOR_NOISE`."""
    _check_drifts(drifts)
    if "noise" in drifts:
        config = replace(config, noise=math.hypot(config.noise, SENSOR_NOISE))
    if "remount" in drifts:
        config = replace(config, max_elevation=1.1, scale_range=(1.1, 1.5))
    return config


def apply_drift(data: dict[str, np.ndarray], drifts: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The images as the drifted sites see them: ``lighting`` (coloured lamps: every hue turned
    by 60 degrees, dimmer, more contrast) and ``rotation`` (cameras mounted a quarter turn
    round). Absent views stay all zeros; present ones stay in [1/255, 1], as the dataset
    contract wants."""
    _check_drifts(drifts)
    X = data["X"].copy()
    present = data["y"] >= 0
    if "lighting" in drifts:
        X = np.einsum("ij,...jhw->...ihw", _hue_rotation(math.radians(60)), X)
        X = 0.85 * np.power(np.clip(X, 0.0, 1.0), np.float32(1.3))
    if "rotation" in drifts:
        X = np.ascontiguousarray(np.rot90(X, k=1, axes=(-2, -1)))
    np.clip(X, 1.0 / 255, 1.0, out=X)
    X[~present] = 0.0
    return {**data, "X": X.astype(np.float32)}


def _hue_rotation(angle: float) -> np.ndarray:
    """The RGB matrix turning every colour by ``angle`` about the grey axis (greys unchanged)."""
    axis = np.ones(3) / math.sqrt(3)
    cross = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    m = (math.cos(angle) * np.eye(3) + math.sin(angle) * cross
         + (1 - math.cos(angle)) * np.outer(axis, axis))
    return m.astype(np.float32)


def split_sites(data: dict[str, np.ndarray], sites: int, alpha: float,
                seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Deal the samples out to ``sites`` sites, non-IID: each class's samples are shared among
    the sites in proportions drawn from a symmetric Dirichlet(``alpha``) (small alpha: each
    site sees few classes; large: every site sees them all alike). Same seed, same split."""
    if sites < 1 or alpha <= 0:
        raise ValueError("sites must be >= 1 and alpha > 0")
    rng = np.random.default_rng([seed, 0x517E5])
    owner = np.empty(len(data["label"]), dtype=np.int64)
    for c in np.unique(data["label"]):
        idx = rng.permutation(np.flatnonzero(data["label"] == c))
        shares = rng.dirichlet(np.full(sites, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for site, part in enumerate(np.split(idx, cuts)):
            owner[part] = site
    return [{k: (v[owner == s] if k != "classes" else v) for k, v in data.items()}
            for s in range(sites)]


def _check_drifts(drifts: tuple[str, ...]) -> None:
    unknown = sorted(set(drifts) - set(DRIFT_KINDS))
    if unknown:
        raise ValueError(f"unknown drift {unknown}: choose from {DRIFT_KINDS}")
