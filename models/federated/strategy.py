"""Aggregation strategies as pure policy over numpy arrays: what each site is sent in a round,
and how the sites' replies become the next shared model. No torch, no Flower, no network: the
round driver (``server_app``) carries these decisions over Flower's transport, and the unit
tests drive them with plain arrays.

- :class:`FedAvg` (McMahan et al., 2017): every site starts each round from the shared model;
  the replies are averaged weighted by the sites' example counts. With server momentum
  (FedAvgM, Hsu et al., 2019) the server's step keeps a share of its last one.
- :class:`DynamicAveraging` (Kamp et al., 2018): each site keeps training its own model and
  checks, every few local steps, how far it has moved from the last shared *reference*; it
  sends its model only once the divergence passes a threshold. Violators whose average lies
  within the threshold are balanced among themselves; otherwise the server asks the quiet
  sites for their models too, averages all of them into a new reference and re-syncs everyone.

Both refuse a bad reply (numbers that are not numbers or counts that cannot be true:
:func:`metrics_problem`; wrong names or shapes, NaN/inf, an outlying norm: :class:`UpdateGuard`)
with a logged reason, and a round with fewer good replies than ``min_sites`` leaves the shared
model as it was. No site's claim buys it the round: a claimed example count weighs at most
``MAX_WEIGHT_RATIO`` times the round's median claim (:func:`capped_counts`), and the good models
are combined by a rule (:data:`AGGREGATES`): the weighted mean, or a coordinate-wise trimmed mean
or median (Yin et al., 2018), which count each site once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ddnn.models.federated.scaffold import most_steps, round_span

log = logging.getLogger("ddnn.federate")

Weights = dict[str, np.ndarray]  # a model's named float arrays, in one fixed order

# Defaults, documented in docs/federated.md.
DMA_THRESHOLD = 0.05  # relative squared divergence ||w - r||^2 / ||r||^2 a site may reach
DMA_CHECK_STEPS = 4  # local steps between two divergence checks on a site
# An update moving the model by more than this many times its own norm is refused. On the
# drifted benchmark one honest site a seed moved it by 1.10 and 1.06 x its norm in round 1 of
# the default schedule (six local epochs): a bound of 1 x refused it.
MAX_RELATIVE_UPDATE = 2.0
# A SCAFFOLD control variate (a mean gradient) over this many times the model's norm is
# refused (the benchmark's round-1 variates: about a third of it).
MAX_RELATIVE_CONTROL = 1.0
MAX_NORM_RATIO = 5.0  # ... or by more than this many times the round's median update norm
MAX_WEIGHT_RATIO = 2.0  # a site weighs at most this many times the round's median claimed count
MAX_EXAMPLES = 2**40  # more examples than any site holds: a larger claim is refused
TRIM = 0.2  # trimmed mean: the share of sites dropped at each end of every coordinate
AGGREGATES = ("mean", "trimmed-mean", "median")


@dataclass(frozen=True)
class Instruction:
    """What the server sends one site for a round of local training."""

    weights: Weights | None  # start from these; None: continue from your own model
    reference: bool = False  # the weights are the new shared reference (DMA)
    control: Weights | None = None  # SCAFFOLD: the sites' mean control variate (None: zeros)
    # SCAFFOLD with derived variates: the mean steps the last round's shared step covered;
    # each site divides that step by them times that round's rate to get the federation's
    # direction (0: no model was taken, no correction)
    span: float = 0.0


@dataclass(frozen=True)
class Reply:
    """One site's answer: its model (None when it had nothing to send) and how much it saw."""

    node: int
    weights: Weights | None
    examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    control: Weights | None = None  # SCAFFOLD: the site's new control variate


@dataclass(frozen=True)
class Outcome:
    """What a round did: ``requests`` names the sites whose models the server still needs
    (DMA's full synchronization) before :meth:`complete` can finish the round."""

    accepted: tuple[int, ...] = ()  # sites whose update went into the shared model
    refused: dict[int, str] = field(default_factory=dict)  # site -> reason
    synchronized: str = "none"  # "none", "balanced" (among violators) or "full"
    requests: tuple[int, ...] = ()
    capped: dict[int, int] = field(default_factory=dict)  # site -> the count it weighed as


def squared_norm(weights: Mapping[str, np.ndarray]) -> float:
    return float(sum(np.square(a, dtype=np.float64).sum() for a in weights.values()))


def distance2(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """Squared Euclidean distance between two models with the same names and shapes."""
    return float(sum(np.square(a[k].astype(np.float64) - b[k]).sum() for k in a))


def weighted_average(models: list[Weights], weights: list[float]) -> Weights:
    """The average of ``models`` weighted by ``weights`` (example counts), array by array."""
    total = float(sum(weights))
    out: Weights = {}
    for name, first in models[0].items():
        acc = np.zeros(first.shape, dtype=np.float64)
        for model, w in zip(models, weights, strict=True):
            acc += model[name] * (w / total)
        out[name] = acc.astype(first.dtype)
    return out


def coordinate_median(models: list[Weights]) -> Weights:
    """Every coordinate's median over ``models`` (each site counted once)."""
    return {name: np.median(np.stack([m[name] for m in models]).astype(np.float64), axis=0)
            .astype(first.dtype) for name, first in models[0].items()}


def trimmed_mean(models: list[Weights], trim: float = TRIM) -> Weights:
    """Every coordinate's mean over ``models`` once its ``k`` largest and ``k`` smallest values
    are dropped: ``k = floor(trim * n)``, and at least one from three models up (else one
    hostile site of three would always count)."""
    n = len(models)
    k = max(int(trim * n), 1 if n >= 3 else 0)
    out: Weights = {}
    for name, first in models[0].items():
        ranked = np.sort(np.stack([m[name] for m in models]).astype(np.float64), axis=0)
        out[name] = ranked[k:n - k].mean(axis=0).astype(first.dtype)
    return out


def combine(rule: str, models: list[Weights], weights: list[float]) -> Weights:
    """The models combined by ``rule`` (:data:`AGGREGATES`); only ``mean`` reads ``weights``."""
    if rule == "mean":
        return weighted_average(models, weights)
    if rule == "trimmed-mean":
        return trimmed_mean(models)
    if rule == "median":
        return coordinate_median(models)
    raise ValueError(f"unknown aggregate {rule!r}: one of {AGGREGATES}")


def capped_counts(examples: list[int], ratio: float = MAX_WEIGHT_RATIO) -> list[float]:
    """Each claimed count, at most ``ratio`` times the round's median claim (the lower median:
    with two sites the smaller claim, so one of two cannot raise the bar it is held to). A site
    cannot show how much data it trained on; this bounds what an inflated claim buys to
    ``ratio`` honest sites' worth while fewer than half the sites inflate theirs."""
    if not examples:
        return []
    cap = ratio * sorted(examples)[(len(examples) - 1) // 2]
    return [float(min(e, cap)) for e in examples]


def count_problem(examples) -> str | None:
    """Why ``examples`` cannot be a site's example count, or None: a whole number from 1 to
    :data:`MAX_EXAMPLES`."""
    if isinstance(examples, bool) or not isinstance(examples, (int, float, np.integer,
                                                                np.floating)):
        return f"example count {examples!r} is not a number"
    # (An int of any size is whole and finite; a float must be both.)
    if isinstance(examples, (float, np.floating)) and not (
            math.isfinite(examples) and float(examples).is_integer()):
        return f"example count {examples!r} is not a whole number"
    if not 1 <= int(examples) <= MAX_EXAMPLES:
        return f"example count {int(examples)} is out of range (1 to {MAX_EXAMPLES})"
    return None


def metrics_problem(metrics: Mapping) -> str | None:
    """Why a site's metrics cannot be true numbers, or None: every value a finite real number
    (a list, a string, NaN or infinity is refused)."""
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                             np.floating)):
            return f"metric {str(name)[:40]!r} is a {type(value).__name__}, not a number"
        if isinstance(value, (float, np.floating)) and not math.isfinite(value):
            return f"metric {str(name)[:40]!r} is {value}"
    return None


def form_problem(reference: Weights, update: Weights) -> str | None:
    """A reason to refuse ``update`` outright (other arrays than ``reference``'s, in another
    order, or of other shapes or dtypes; NaN or infinite values), or None."""
    if list(update) != list(reference):
        if set(update) == set(reference):
            return "arrays are in another order than the model's"
        missing = sorted(set(reference) - set(update))[:3]
        extra = [str(n)[:40] for n in sorted(set(update) - set(reference), key=str)[:3]]
        return f"arrays differ from the model's (missing {missing}, unexpected {extra})"
    for name, ref in reference.items():
        a = update[name]
        if a.shape != ref.shape or a.dtype != ref.dtype:
            return f"{name} is {a.dtype}{list(a.shape)}, expected {ref.dtype}{list(ref.shape)}"
        if not np.isfinite(a).all():
            return f"{name} holds NaN or infinite values"
    return None


@dataclass(frozen=True)
class UpdateGuard:
    """Refuses updates that would spoil the shared model; every refusal names its reason."""

    max_relative_update: float = MAX_RELATIVE_UPDATE
    max_norm_ratio: float = MAX_NORM_RATIO
    max_relative_control: float = MAX_RELATIVE_CONTROL

    def screen(self, reference: Weights, replies: list[Reply]) -> tuple[list[Reply], dict]:
        """The replies fit to average and the refused ones with their reasons."""
        refused: dict[int, str] = {}
        formed: list[tuple[Reply, float]] = []
        ref_norm = np.sqrt(squared_norm(reference))
        for r in replies:
            assert r.weights is not None
            reason = form_problem(reference, r.weights) or count_problem(r.examples)
            if reason is None:
                step = np.sqrt(distance2(r.weights, reference))
                if step > self.max_relative_update * ref_norm:
                    reason = (f"update norm {step:.3g} exceeds {self.max_relative_update} x the "
                              f"model's norm {ref_norm:.3g}")
            if reason is None:
                formed.append((r, step))
            else:
                refused[r.node] = reason
        if len(formed) >= 3:  # a median of two is their mean: no outlier test below three
            median = float(np.median([s for _, s in formed]))
            for r, step in formed:
                if median > 0 and step > self.max_norm_ratio * median:
                    refused[r.node] = (f"update norm {step:.3g} is an outlier ({step / median:.1f}"
                                       f" x the round's median {median:.3g})")
        for node, reason in refused.items():
            log.warning("refused the update of site %s: %s", node, reason)
        return [r for r, _ in formed if r.node not in refused], refused


@dataclass(frozen=True)
class Combiner:
    """How the good replies of a round become one model: their claimed counts capped
    (:func:`capped_counts`), then combined by ``rule`` (:func:`combine`)."""

    rule: str = "mean"
    weight_ratio: float = MAX_WEIGHT_RATIO

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATES:
            raise ValueError(f"unknown aggregate {self.rule!r}: one of {AGGREGATES}")

    def __call__(self, rnd: int, replies: list[Reply]) -> tuple[Weights, dict[int, int]]:
        """The combined model and the sites whose claims were capped (-> what they weighed)."""
        counted = capped_counts([r.examples for r in replies], self.weight_ratio)
        capped = {r.node: int(c) for r, c in zip(replies, counted, strict=True)
                  if c < r.examples}
        for node, c in capped.items():
            log.warning("round %d: site %s claims more examples than %g x the round's median "
                        "claim; it weighs as %d", rnd, node, self.weight_ratio, c)
        return combine(self.rule, [r.weights for r in replies], counted), capped


def control_problem(model: Weights, control: Weights | None, names: Iterable[str],
                    max_norm: float) -> str | None:
    """Why a site's SCAFFOLD control variate is refused: missing, not of the form of the
    model's arrays named by the server's list ``names`` (the model's parameters, in order; see
    :func:`form_problem`), or of a norm over ``max_norm``."""
    if control is None:  # e.g. a ClientApp from before SCAFFOLD
        return "no control variate (a site without SCAFFOLD needs the run's --no-scaffold)"
    reason = form_problem({n: model[n] for n in names}, control)
    if reason is not None:
        return f"control variate: {reason}"
    norm = np.sqrt(squared_norm(control))
    if norm > max_norm:
        return f"control variate norm {norm:.3g} exceeds the model-relative bound {max_norm:.3g}"
    return None


class FedAvg:
    """Federated averaging: everyone starts from the shared model; the good replies are
    combined (by default averaged, weighted by their capped example counts).

    ``momentum`` > 0 is FedAvgM: the server moves the model by ``v = momentum * v + step``,
    ``step`` the combined model minus the shared one (what Flower's ``FedAvgM`` does with a
    server learning rate of 1). Under label skew each round's step leans toward the classes
    the sites happen to hold; the momentum keeps the direction they share.

    ``scaffold`` is SCAFFOLD (Karimireddy et al., 2020): each site corrects its local steps by
    the sites' mean control variate less its own (its mean gradient of its last round), so
    several local epochs a round do not drift toward its own classes. The sites' variates are
    screened as their models are (a variate whose norm is an outlier refuses the whole reply);
    the server keeps each connected site's last good one (dropped when a reply of the site is
    refused) and combines them all by the same rule, with capped counts. With ``derived``
    (SCAFFOLD's option II, :mod:`~ddnn.models.federated.scaffold`) no variate travels: each
    site derives its own and the federation's from the models, and the server sends only the
    span of the last round's steps (:attr:`Instruction.span`)."""

    name = "fedavg"

    def __init__(self, initial: Weights, min_sites: int = 1, guard: UpdateGuard | None = None,
                 combiner: Combiner | None = None, momentum: float = 0.0,
                 scaffold: bool = False, parameters: Iterable[str] | None = None,
                 derived: bool = False, local_steps: tuple[float, int] | None = None):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"server momentum must lie in [0, 1), got {momentum}")
        self.model: Weights = {k: np.asarray(v) for k, v in initial.items()}
        self.min_sites = max(1, min_sites)
        self.guard = guard or UpdateGuard()
        self.combiner = combiner or Combiner()
        self.momentum = float(momentum)
        self.velocity: Weights | None = None  # the server's last step (FedAvgM)
        self.scaffold = scaffold
        self.derived = scaffold and derived
        if self.derived and self.momentum:  # the shared step would carry the server's velocity
            raise ValueError("derived variates read the averaged step; server momentum "
                             "would count in every site's correction")
        # Derived variates: the sites' local epochs and batch size, which bound the steps a
        # site's example count lets it claim (None: no bound but the median's)
        self.local_steps = local_steps
        self.span = 0.0  # derived variates: the steps the last shared step covered
        self.control: Weights | None = None  # SCAFFOLD: the sites' combined variate
        # SCAFFOLD: each connected site's last accepted variate and claim. A silent site keeps
        # its share of the combined variate; a refused one, or one that left, loses it.
        self.site_controls: dict[int, tuple[Weights, int]] = {}
        # The arrays a variate must hold, fixed by the server, never by a reply (default:
        # every array of the model; the ServerApp names the network's parameters).
        self.parameters = tuple(parameters) if parameters is not None else tuple(self.model)

    def configure(self, rnd: int, nodes: Iterable[int]) -> dict[int, Instruction]:
        nodes = list(nodes)
        gone = set(self.site_controls) - set(nodes)
        if gone:  # sites that left the federation take their variates with them
            for node in gone:
                del self.site_controls[node]
            self._combine_controls()
        return {n: Instruction(self.model, control=self.control, span=self.span) for n in nodes}

    def aggregate(self, rnd: int, replies: list[Reply]) -> Outcome:
        sent = [r for r in replies if r.weights is not None]
        good, refused = self.guard.screen(self.model, sent)
        self.span = 0.0  # until a model is taken: a round that takes none corrects nothing
        if self.scaffold and not self.derived:
            good, refused = self._screen_controls(good, refused)
            for node in refused:  # a refused site's earlier variate no longer speaks for it
                self.site_controls.pop(node, None)
        if len(good) < self.min_sites:
            log.warning("round %d: %d good update(s), fewer than the %d required; the model "
                        "stays as it was", rnd, len(good), self.min_sites)
            self._combine_controls()  # without the variates of the sites refused
            return Outcome(refused=refused)
        combined, capped = self.combiner(rnd, good)
        self.model = self._step(combined) if self.momentum else combined
        if self.derived:
            self.span = self._span(good)
        elif self.scaffold:
            self.site_controls.update({r.node: (r.control, r.examples) for r in good})
        self._combine_controls()
        return Outcome(tuple(r.node for r in good), refused, "full", capped=capped)

    def _span(self, good: list[Reply]) -> float:
        """The mean steps the shared step just taken covered (``scaffold.round_span``): the
        sites' claimed steps, each within what its capped example count allows, weighted as
        their models were (capped counts for the mean, each site once for a robust rule). A
        reply that claims no steps counts as the most its examples allow."""
        counted = capped_counts([r.examples for r in good], self.combiner.weight_ratio)
        bounds = ([float(most_steps(n, *self.local_steps)) for n in counted]
                  if self.local_steps is not None else None)
        steps = [float(r.metrics.get("steps", bounds[i] if bounds else 1.0))
                 for i, r in enumerate(good)]
        weights = counted if self.combiner.rule == "mean" else [1.0] * len(good)
        return round_span(steps, weights, bounds)

    def _combine_controls(self) -> None:
        """The variate sent next: every connected site's last good one combined, as in the
        paper (a site silent for a round keeps its share), or none before the first."""
        kept = list(self.site_controls.values())
        if not kept:
            self.control = None
            return
        counted = capped_counts([n for _, n in kept], self.combiner.weight_ratio)
        self.control = combine(self.combiner.rule, [c for c, _ in kept], counted)

    def _screen_controls(self, good: list[Reply], refused: dict[int, str]
                         ) -> tuple[list[Reply], dict[int, str]]:
        """The replies whose control variates fit (:func:`control_problem`: the parameters'
        arrays, finite, a norm under ``max_relative_control`` x the model's) and whose norms
        are no outlier (over ``max_norm_ratio`` x the round's median, from three replies)."""
        now: dict[int, str] = {}
        # A bound relative to the model's norm, then (below) one relative to the other sites'.
        bound = self.guard.max_relative_control * np.sqrt(squared_norm(
            {n: self.model[n] for n in self.parameters}))
        for r in good:
            reason = control_problem(self.model, r.control, self.parameters, bound)
            if reason is not None:
                now[r.node] = reason
        norms = {r.node: np.sqrt(squared_norm(r.control)) for r in good if r.node not in now}
        if len(norms) >= 3:  # as for the updates: no outlier test below three
            median = float(np.median(list(norms.values())))
            for node, norm in norms.items():
                if median > 0 and norm > self.guard.max_norm_ratio * median:
                    now[node] = (f"control variate norm {norm:.3g} is an outlier "
                                 f"({norm / median:.1f} x the round's median {median:.3g})")
        for node, reason in now.items():
            log.warning("refused the update of site %s: %s", node, reason)
        return [r for r in good if r.node not in now], {**refused, **now}

    def _step(self, combined: Weights) -> Weights:
        step = {k: combined[k].astype(np.float64) - self.model[k] for k in self.model}
        if self.velocity is not None:
            step = {k: self.momentum * self.velocity[k] + step[k] for k in step}
        self.velocity = step
        return {k: (self.model[k] + step[k]).astype(self.model[k].dtype) for k in self.model}

    def complete(self, rnd: int, replies: list[Reply]) -> Outcome:  # never asks for more
        return Outcome()


class DynamicAveraging:
    """Dynamic model averaging (Kamp et al.): sites send only past a divergence threshold.

    ``threshold`` bounds the relative squared divergence ||w - r||^2 / ||r||^2 of a site's
    model w from the reference r; a site checks it every ``check_steps`` local steps.
    """

    name = "dma"

    def __init__(self, initial: Weights, threshold: float = DMA_THRESHOLD,
                 check_steps: int = DMA_CHECK_STEPS, min_sites: int = 1,
                 guard: UpdateGuard | None = None, combiner: Combiner | None = None):
        self.model: Weights = {k: np.asarray(v) for k, v in initial.items()}  # the reference
        self.threshold, self.check_steps = float(threshold), int(check_steps)
        self.min_sites = max(1, min_sites)
        self.guard = guard or UpdateGuard()
        self.combiner = combiner or Combiner()
        self._synced: set[int] = set()  # sites that hold the current reference
        self._pending: dict[int, Weights] = {}  # balanced models to hand back to violators
        self._round: dict[int, Reply] = {}  # this round's models, while a full sync gathers
        self._asked: set[int] = set()  # the sites configured this round

    def configure(self, rnd: int, nodes: Iterable[int]) -> dict[int, Instruction]:
        out = {}
        self._asked = set(nodes)
        for n in self._asked:
            if n not in self._synced:
                out[n] = Instruction(self.model, reference=True)
                self._synced.add(n)
            elif n in self._pending:
                out[n] = Instruction(self._pending.pop(n))
            else:
                out[n] = Instruction(None)
        return out

    def divergence(self, weights: Weights) -> float:
        return distance2(weights, self.model) / max(squared_norm(self.model), 1e-12)

    def aggregate(self, rnd: int, replies: list[Reply]) -> Outcome:
        """Violators' models in; balance them among themselves or ask for everyone's."""
        self._pending.clear()
        # A site that did not answer may have missed the reference: it gets it again.
        self._synced &= {r.node for r in replies} | (self._synced - self._asked)
        quiet = [r.node for r in replies if r.weights is None]
        good, refused = self.guard.screen(self.model, [r for r in replies if r.weights])
        for node in refused:  # a refused site starts again from the reference
            self._synced.discard(node)
        if not good:
            return Outcome(refused=refused)
        average, capped = self.combiner(rnd, good)
        if len(good) > 1 and self.divergence(average) <= self.threshold:
            for r in good:
                self._pending[r.node] = average
            return Outcome(tuple(r.node for r in good), refused, "balanced", capped=capped)
        self._round = {r.node: r for r in good}
        if not quiet:
            return self._full_sync(rnd, refused)
        return Outcome(tuple(self._round), refused, "full", requests=tuple(quiet))

    def complete(self, rnd: int, replies: list[Reply]) -> Outcome:
        """The quiet sites' models have arrived (or not): average everything gathered."""
        good, refused = self.guard.screen(self.model, [r for r in replies if r.weights])
        for node in refused:
            self._synced.discard(node)
        self._round.update({r.node: r for r in good})
        return self._full_sync(rnd, refused)

    def _full_sync(self, rnd: int, refused: dict[int, str]) -> Outcome:
        gathered, self._round = list(self._round.values()), {}
        if len(gathered) < self.min_sites:
            log.warning("round %d: %d model(s) gathered, fewer than the %d required; the "
                        "reference stays as it was", rnd, len(gathered), self.min_sites)
            return Outcome(refused=refused)
        self.model, capped = self.combiner(rnd, gathered)
        self._synced.clear()  # everyone gets the new reference next round
        return Outcome(tuple(r.node for r in gathered), refused, "full", capped=capped)


def make_strategy(name: str, initial: Weights, aggregate: str = "mean",
                  **options) -> FedAvg | DynamicAveraging:
    """The strategy called ``name`` (``fedavg`` or ``dma``), combining by ``aggregate``."""
    options.setdefault("combiner", Combiner(aggregate))
    if name == "fedavg":
        options.pop("threshold", None)
        options.pop("check_steps", None)
        return FedAvg(initial, **options)
    if name == "dma":
        if options.pop("momentum", 0.0):
            raise ValueError("server momentum is FedAvg's (FedAvgM); dma averages violators")
        if options.pop("scaffold", False):
            raise ValueError("SCAFFOLD's control variates are FedAvg's; dma sends no model "
                             "every round")
        return DynamicAveraging(initial, **options)
    raise ValueError(f"unknown strategy {name!r}: fedavg or dma")
