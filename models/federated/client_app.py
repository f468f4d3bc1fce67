"""The site's Flower ClientApp: one handler per message kind, the work done by ``trainer``.

The SuperNode (``ddnn federate client``) names the site's data in its node config: ``data``
(a dataset file or directory) and/or ``experience`` (a directory of recorded experience).
Under dynamic averaging the site's own model and the last shared reference live in the run's
``context.state`` between rounds; under FedAvg every round starts from the shared model (and,
under SCAFFOLD, the site keeps its control variate there; with derived variates also the
shared model its last round started from, to read the federation's step off the next one).
"""

from __future__ import annotations

import json
import logging

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ddnn.models.federated.records import (
    ARRAYS,
    CONFIG,
    CONTROL,
    COUNTS,
    METRICS,
    STACKING,
    from_record,
    to_record,
)

log = logging.getLogger("ddnn.federate")
app = ClientApp()
MODEL, REFERENCE = "ddnn-model", "ddnn-reference"  # context.state keys (dynamic averaging)
EVALUATED = "ddnn-evaluated"  # the final model, kept for a second evaluation
OWN_CONTROL = "ddnn-control"  # the site's SCAFFOLD control variate, from its last round
# SCAFFOLD with derived variates: the shared model the site's last round started from, and
# that round's number and learning rate
STARTED, STARTED_AT = "ddnn-started", "ddnn-started-at"


def _site(context: Context, arch: dict, config):
    from ddnn.models.federated.trainer import load_site

    data = context.node_config.get("data") or None
    experience = context.node_config.get("experience") or None
    return load_site(arch, data, experience, holdout=float(config["holdout"]),
                     seed=int(config["seed"]))


def _correction(msg: Message, context: Context) -> dict:
    """SCAFFOLD's correction of this site's steps: the sites' combined control variate (sent
    from the second round on) less the site's own (kept from its last round); either one
    missing counts as zeros, so the first round is not corrected."""
    shared = from_record(msg.content[CONTROL]) if CONTROL in msg.content else {}
    own = from_record(context.state[OWN_CONTROL]) if OWN_CONTROL in context.state else {}
    return {n: np.asarray(shared.get(n, 0.0) - own.get(n, 0.0), np.float32)
            for n in {**shared, **own}}


def _derived_correction(start: dict, config, context: Context, names: list[str]
                        ) -> dict | None:
    """SCAFFOLD's option II correction of this round's steps: the federation's direction (the
    shared model's last step over the span the server sends) less the site's own. None in
    the first round, after a round this site did not run, or after one that took no model."""
    from ddnn.models.federated import scaffold

    span = float(config.get("span", 0.0))
    if not 0 < span < float("inf"):  # no model taken last round (0), or a span not to be had
        return None
    if STARTED_AT not in context.state or OWN_CONTROL not in context.state:
        return None
    last = context.state[STARTED_AT]
    if int(last["round"]) != int(config["round"]) - 1:
        return None
    shared = scaffold.shared_direction(from_record(context.state[STARTED]), start,
                                       span * float(last["lr"]), names)
    return scaffold.step_correction(shared, from_record(context.state[OWN_CONTROL]))


def _fit_derived(arch: dict, msg: Message, start: dict, site, settings, rnd: int,
                 context: Context):
    """One round of SCAFFOLD with derived variates: corrected steps, then the site keeps its
    new direction and the model it started from (the record as sent); nothing but its model
    goes back."""
    from ddnn.models.federated import scaffold
    from ddnn.models.federated.trainer import fit
    from ddnn.models.federated.weights import trainable_names

    names = trainable_names(arch)
    correction = _derived_correction(start, msg.content[CONFIG], context, names)
    result = fit(arch, start, site, settings, rnd, step_correction=correction)
    own = scaffold.own_direction(start, result.weights, result.steps * settings.lr,
                                 correction, names)
    context.state[OWN_CONTROL] = to_record(own)
    context.state[STARTED] = msg.content[ARRAYS]
    context.state[STARTED_AT] = ConfigRecord({"round": rnd, "lr": settings.lr})
    return result


def _divergence(weights: dict, reference: dict) -> float:
    num = sum(float(np.square(weights[k] - reference[k], dtype=np.float64).sum()) for k in weights)
    den = sum(float(np.square(v, dtype=np.float64).sum()) for v in reference.values())
    return num / max(den, 1e-12)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train from the weights sent (or, under DMA, from the site's own model) and answer."""
    from ddnn.models.federated.trainer import LocalTraining, evaluate, fit

    config = msg.content[CONFIG]
    arch = json.loads(str(config["arch"]))
    site = _site(context, arch, config)
    dma = config["strategy"] == "dma"
    if ARRAYS in msg.content:
        start = from_record(msg.content[ARRAYS])
        if dma and bool(config["reference"]):
            context.state[REFERENCE] = msg.content[ARRAYS]
    elif dma and MODEL in context.state:
        start = from_record(context.state[MODEL])
    else:
        raise ValueError("no weights sent and none kept from an earlier round")
    metrics: dict[str, float] = {}
    if site.holdout is not None:  # how good the model this round starts from is, held out
        held = evaluate(arch, start, site.holdout, threads=int(config["threads"]),
                        with_counts=False)
        metrics.update({f"holdout-{k}": v for k, v in held.correct.items()})
    settings = LocalTraining(epochs=float(config["epochs"]), lr=float(config["lr"]),
                             batch_size=int(config["batch-size"]), seed=int(config["seed"]),
                             proximal=float(config.get("proximal", 0.0)),
                             balance=float(config.get("balance", 0.0)),
                             threads=int(config["threads"]))
    rnd = int(config["round"])
    if dma:
        reference = from_record(context.state[REFERENCE])
        threshold = float(config["threshold"])
        result = fit(arch, start, site, settings, rnd,
                     stop_when=lambda w: _divergence(w, reference) > threshold,
                     check_steps=int(config["check-steps"]))
        divergence = _divergence(result.weights, reference)
        context.state[MODEL] = to_record(result.weights)
        send = divergence > threshold
        metrics.update({"divergence": divergence, "violated": float(send)})
    elif bool(config.get("scaffold", False)) and config.get("variates") == "derived":
        result = _fit_derived(arch, msg, start, site, settings, rnd, context)
        send = True
    elif bool(config.get("scaffold", False)):
        result = fit(arch, start, site, settings, rnd,
                     correction=_correction(msg, context))
        context.state[OWN_CONTROL] = to_record(result.gradient)
        send = True
    else:
        result = fit(arch, start, site, settings, rnd)
        send = True
    metrics.update({"examples": float(result.examples), "steps": float(result.steps),
                    "loss": result.loss})
    content = RecordDict({METRICS: MetricRecord(metrics)})
    if send:
        content[ARRAYS] = to_record(result.weights)
    if result.gradient is not None:
        content[CONTROL] = to_record(result.gradient)
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Dynamic averaging's full synchronization: send the site's current model."""
    config = msg.content[CONFIG]
    arch = json.loads(str(config["arch"]))
    site = _site(context, arch, config)
    content = RecordDict({METRICS: MetricRecord({"examples": float(site.examples)})})
    if MODEL in context.state:
        content[ARRAYS] = context.state[MODEL]
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation of the final model: held-out results, calibration tables and, for
    stacked exits when the server asks, the tables that refit their weights."""
    from ddnn.models.federated.calibration import narrow_counts
    from ddnn.models.federated.trainer import evaluate as measure
    from ddnn.models.federated.trainer import evaluate_experience

    config = msg.content[CONFIG]
    arch = json.loads(str(config["arch"]))
    site = _site(context, arch, config)
    # The server sends the final model once. Where it asks for stacking tables, a second
    # evaluation (with refitted stacking weights) may follow without it: the model is kept
    # for that one and dropped by it (a SuperNode keeps a run's state for as long as it runs).
    if ARRAYS in msg.content:
        model = msg.content[ARRAYS]
        if config.get("stacking-tables", False):
            context.state[EVALUATED] = model
    elif EVALUATED in context.state:
        model = context.state[EVALUATED]
        del context.state[EVALUATED]
    else:
        raise ValueError("no model sent to evaluate and none kept from an earlier evaluation")
    content = RecordDict({METRICS: MetricRecord({"samples": 0.0})})
    held = None
    tables = bool(config.get("stacking-tables", False))
    if site.holdout is not None:
        held = measure(arch, from_record(model), site.holdout,
                       int(config["grid"]), int(config["threads"]), with_stacking_tables=tables)
    elif site.experience_holdout is not None:  # the cloud's answers label the stream's sample
        held = evaluate_experience(arch, from_record(model), site.experience_holdout,
                                   int(config["grid"]), int(config["threads"]),
                                   with_stacking_tables=tables)
    if held is not None:
        content[METRICS] = MetricRecord(held.correct)
        content[COUNTS] = to_record(narrow_counts(held.counts))
        if held.stacking_tables is not None:
            content[STACKING] = to_record(held.stacking_tables)
    return Message(content, reply_to=msg)
