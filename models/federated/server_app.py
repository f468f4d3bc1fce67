"""The federation's Flower ServerApp: the round driver over Flower's transport (the ``Grid``).

Each round: the strategy says what every connected site gets (``configure``); the messages go
out and the replies come back within ``round_timeout`` (a silent or failing site is dropped
from the round and logged); each reply is decoded and screened on its own (:func:`decode_reply`:
a reply whose metrics are not numbers, whose arrays do not decode or whose example count cannot
be true is refused, logged and counted, and the round goes on with the others); the strategy
screens and combines the good updates (``aggregate``) and, for dynamic averaging's full
synchronization, asks the quiet sites for their models (``complete``).
After the last round the model is evaluated on every site's held-out split (federated
evaluation, which also calibrates the thresholds) and written as the next bundle version.
Progress goes to ``WORK/progress.jsonl``, the summary to ``WORK/result.json``.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from ddnn.errors import ConfigError, DdnnError
from ddnn.models.federated.records import (
    ARRAYS,
    CONFIG,
    CONTROL,
    COUNTS,
    METRICS,
    STACKING,
    from_record,
    message_bytes,
    to_record,
)
from ddnn.models.federated.settings import FederationSettings
from ddnn.models.federated.strategy import (
    Outcome,
    Reply,
    count_problem,
    make_strategy,
    metrics_problem,
)

log = logging.getLogger("ddnn.federate")
app = ServerApp()
PROGRESS, RESULT = "progress.jsonl", "result.json"


# How often the ServerApp asks the SuperLink for replies. Flower's ``Grid.send_and_receive``
# waits 3 s between pulls, which a round pays on top of its slowest site; a pull is one small
# request to the SuperLink, so half a second costs it little.
REPLY_POLL = 0.5


def send_and_receive(grid: Grid, messages: list[Message], timeout: float,
                     poll: float = REPLY_POLL) -> list[Message]:
    """``Grid.send_and_receive`` over the Grid's ``push_messages`` / ``pull_messages``, asking
    for the replies every ``poll`` seconds: the replies that came within ``timeout``."""
    waiting = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while waiting:
        pulled = list(grid.pull_messages(waiting))
        replies += pulled
        waiting -= {m.metadata.reply_to_message_id for m in pulled}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
    return replies


class Exchange:
    """Messages out and replies in over the Grid, counting every message's bytes both ways
    (:func:`~ddnn.models.federated.records.message_bytes`: arrays, tables, metrics, config)."""

    def __init__(self, grid: Grid, settings: FederationSettings, base_config: dict):
        self.grid, self.settings, self.base = grid, settings, base_config
        self.bytes_down = self.bytes_up = 0

    def send(self, kind: str, rnd: int, payloads: dict[int, tuple[dict | None, dict]],
             controls: dict[int, dict] | None = None) -> dict[int, RecordDict]:
        """``payloads``: node -> (weights or None, extra config); ``controls``: node -> the
        SCAFFOLD control variate it gets; returns node -> reply content."""
        messages = []
        for node, (weights, extra) in payloads.items():
            content = RecordDict({CONFIG: ConfigRecord({**self.base, "round": rnd, **extra})})
            if weights is not None:
                content[ARRAYS] = to_record(weights)
            if controls and controls.get(node) is not None:
                content[CONTROL] = to_record(controls[node])
            message = Message(content, dst_node_id=node, message_type=kind, group_id=str(rnd))
            self.bytes_down += message_bytes(message)
            messages.append(message)
        replies = {}
        for reply in send_and_receive(self.grid, messages, self.settings.round_timeout):
            node = reply.metadata.src_node_id
            self.bytes_up += message_bytes(reply)
            if reply.has_error():
                log.warning("round %d: site %s failed: %s", rnd, node, reply.error.reason)
                continue
            replies[node] = reply.content
        for node in set(payloads) - set(replies):
            log.warning("round %d: no answer from site %s; it is left out of the round",
                        rnd, node)
        return replies

    @property
    def communicated(self) -> int:
        return self.bytes_down + self.bytes_up


def decode_reply(node: int, content: RecordDict) -> Reply | str:
    """A site's training (or query) reply as the strategies take it, or why it is refused:
    records of other kinds than ours, metrics that are not finite numbers, an example count
    that cannot be true (``strategy.count_problem``), arrays that do not decode. The strategy
    then checks the model itself (``UpdateGuard``). Nothing a site sends raises past here."""
    if METRICS not in content.metric_records:
        return "no metrics record"
    for name in (ARRAYS, CONTROL):
        if name in content and name not in content.array_records:
            return f"{name!r} is not an array record"
    metrics = dict(content[METRICS])
    problem = metrics_problem(metrics) or count_problem(metrics.get("examples"))
    if problem is not None:
        return problem
    arrays: dict[str, dict | None] = {ARRAYS: None, CONTROL: None}
    for name in arrays:
        if name in content:
            try:
                arrays[name] = from_record(content[name])
            except Exception as e:  # bytes from a site: any failure to decode is its fault
                return f"{name} that do not decode ({type(e).__name__}: {str(e)[:80]})"
    return Reply(node, arrays[ARRAYS], int(metrics["examples"]), metrics, arrays[CONTROL])


def decode_replies(rnd: int, answers: dict[int, RecordDict]) -> tuple[list[Reply], dict]:
    """The answers that decode, and the refused ones with their reasons (logged)."""
    replies, refused = [], {}
    for node, content in answers.items():
        decoded = decode_reply(node, content)
        if isinstance(decoded, Reply):
            replies.append(decoded)
        else:
            refused[node] = decoded
            log.warning("round %d: refused the reply of site %s: %s", rnd, node, decoded)
    return replies, refused


def wait_for_sites(grid: Grid, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise DdnnError(f"{len(nodes)} site(s) connected within {timeout:.0f} s; "
                            f"the federation needs {count}")
        time.sleep(0.5)


def _held_out(replies: list[Reply]) -> float | None:
    """Held-out cloud-exit accuracy of the models the round started from, over all sites."""
    n = sum(r.metrics.get("holdout-samples", 0.0) for r in replies)
    right = sum(r.metrics.get("holdout-cloud", 0.0) for r in replies)
    return right / n if n else None


def run_rounds(grid: Grid, s: FederationSettings, exchange: Exchange, initial, progress,
               parameters: list[str] | None = None):
    """The rounds; ``parameters``: the network's trainable arrays, those a SCAFFOLD control
    variate holds (default: every array of ``initial``)."""
    from ddnn.models.federated.trainer import round_lr

    options = ({"scaffold": True, "parameters": parameters, "derived": s.variates == "derived",
                "local_steps": (s.epochs, s.batch_size)} if s.scaffold else {})
    strategy = make_strategy(s.strategy, initial, s.aggregate, threshold=s.threshold,
                             check_steps=s.check_steps, min_sites=s.min_sites,
                             momentum=s.momentum, **options)
    history = []
    for rnd in range(1, s.rounds + 1):
        start = time.perf_counter()
        nodes = sorted(grid.get_node_ids())
        plan = strategy.configure(rnd, nodes)
        lr = round_lr(s.lr, rnd, s.rounds)
        payloads = {n: (i.weights, {"reference": i.reference, "lr": lr, "span": i.span})
                    for n, i in plan.items()}
        answers = exchange.send(MessageType.TRAIN, rnd, payloads,
                                {n: i.control for n, i in plan.items()})
        replies, unfit = decode_replies(rnd, answers)
        outcome = strategy.aggregate(rnd, replies)
        if outcome.requests:
            more = exchange.send(MessageType.QUERY, rnd, {n: (None, {}) for n in outcome.requests})
            late_replies, late_unfit = decode_replies(rnd, more)
            late = strategy.complete(rnd, late_replies)
            unfit.update(late_unfit)
            outcome = Outcome(outcome.accepted + late.accepted,
                              {**outcome.refused, **late.refused}, late.synchronized,
                              capped={**outcome.capped, **late.capped})
        entry = {"round": rnd, "sites": len(nodes), "replied": len(answers),
                 "sent_models": sum(r.weights is not None for r in replies),
                 "accepted": len(outcome.accepted), "refused": {**unfit, **outcome.refused},
                 "capped": outcome.capped,
                 "sync": outcome.synchronized, "holdout_accuracy": _held_out(replies),
                 "communicated_bytes": exchange.communicated,
                 "seconds": round(time.perf_counter() - start, 2)}
        history.append(entry)
        progress(entry)
    return strategy, history


def final_model(grid: Grid, strategy, exchange: Exchange, rounds: int, history: list):
    """Dynamic averaging ends with one full synchronization: the final model averages every
    site's own model, not just the last reference."""
    if strategy.name != "dma" or (history and history[-1]["sync"] == "full"):
        return strategy.model  # FedAvg's, or every site's model went into the last average
    nodes = sorted(grid.get_node_ids())
    more = exchange.send(MessageType.QUERY, rounds + 1, {n: (None, {}) for n in nodes})
    strategy.complete(rounds + 1, decode_replies(rounds + 1, more)[0])
    return strategy.model


def _refit(answers: dict[int, RecordDict], arch: dict):
    """The stacking refitted from the first evaluation's stacking tables, and its record."""
    from ddnn.models.config import DDNNConfig
    from ddnn.models.federated.calibration import refit_stacking
    from ddnn.stacking import Stacking

    def site(node: int, content: RecordDict):
        samples = float(content[METRICS].get("samples", 0.0))  # screened: a number
        try:
            tables = (from_record(content[STACKING]) if STACKING in content.array_records
                      else None)
        except Exception:  # an array that does not decode: tables of nothing, left out
            tables = {}
        return node, samples, tables

    escalates = arch.get("config", {}).get("escalate", DDNNConfig().escalation.detail) != "none"
    tiers = {"edge", "cloud", "escalated"} if escalates else {"edge", "cloud"}
    # A site that held out experience labels it by the cloud and cannot run the escalated one.
    taught = [n for n, c in answers.items() if _taught(c) > 0]
    return refit_stacking([site(n, c) for n, c in answers.items()], int(arch["views"]), tiers,
                          Stacking.from_dict(arch["stacking"]), partial=taught)


def _screened(answers: dict[int, RecordDict], grid: int, views: int, detail: int,
              first: dict[int, RecordDict] | None = None) -> dict[int, RecordDict]:
    """The evaluation answers whose numbers can be true (``detail``: the most bytes a device's
    detail takes, 0 where the bundle does not escalate); a site whose cannot is left out of
    the evaluation and the calibration with a warning, as a bad update is left out of a round.
    A second evaluation's answer must also claim the samples its ``first`` one did."""
    from ddnn.models.federated.calibration import MAX_FRAMES, counts_problem

    def problem(c: RecordDict) -> str | None:
        if METRICS not in c.metric_records:
            return "no metrics"
        metrics = c[METRICS]
        try:
            samples = float(metrics.get("samples", float("nan")))
            right = [float(metrics.get(k, 0.0)) for k in ("local", "edge", "cloud",
                                                          "escalated", "teacher-labelled")]
        except (TypeError, ValueError):
            return "metrics that are not numbers"
        if not 0 <= samples <= MAX_FRAMES or not all(0 <= r <= samples for r in right):
            return f"{samples} held-out samples, {right} right answers"
        if COUNTS not in c.array_records:
            return "no calibration tables" if samples > 0 else None
        try:
            counts = from_record(c[COUNTS])
        except Exception:  # arrays that do not decode
            return "calibration tables that do not decode"
        found = counts_problem(counts, grid, views, detail)
        if found is None and int(counts["samples"][0]) != samples:
            found = f"tables of {int(counts['samples'][0])} samples, metrics of {samples:g}"
        return found

    kept = {}
    for node, content in answers.items():
        try:
            found = problem(content)
        except Exception as e:  # a check the answer broke: refused, as one that fails it
            found = f"an answer that cannot be checked ({type(e).__name__}: {str(e)[:80]})"
        if found is None and first is not None and float(
                content[METRICS]["samples"]) != float(first[node][METRICS]["samples"]):
            found = "other held-out samples than in the first evaluation"
        if found is None:
            kept[node] = content
        else:
            log.warning("left the evaluation of site %s out: %s", node, found)
    return kept


def _calibrate(total, cost, s: FederationSettings, recorded: Mapping):
    """The new version's calibration by its budget; a byte budget no point meets (the model
    changed) takes the cheapest point, with a warning, rather than losing the run."""
    from ddnn.models.federated.calibration import calibrate_counts, calibration_budget

    tolerance, agreement, max_bytes = calibration_budget(s.tolerance, s.agreement, s.max_bytes,
                                                         recorded)
    if max_bytes is not None:
        try:
            return calibrate_counts(total, cost, max_bytes=max_bytes)
        except ConfigError as e:
            log.warning("%s: the new version takes the cheapest point instead", e)
            return calibrate_counts(total, cost, tolerance=1.0, agreement=0.0)
    return calibrate_counts(total, cost, tolerance, agreement)


_KEPT = ("the held-out frames are experience, which holds no cameras' details: they cannot "
         "calibrate escalation level {0}, so the bundle's thresholds, level and stacking stay")


def _taught(c: RecordDict) -> float:
    """An evaluation answer's held-out frames labelled by the cloud's answers (its held-out
    experience), 0 for labelled data; a screened answer's metrics are numbers."""
    return float(c[METRICS].get("teacher-labelled", 0.0))


def _labelled_first(answers: dict[int, RecordDict]) -> dict[int, RecordDict]:
    """The evaluation answers the calibration stands on: where some site held out labelled
    frames, those sites' (and those that held none out); else every answer. A site that held
    out experience labels it with the cloud's answers (``teacher-labelled``), a weaker truth:
    beside true labels it would pull the thresholds toward the cloud's mistakes."""
    kept = {n: c for n, c in answers.items() if _taught(c) == 0}
    if len(kept) == len(answers) or not any(float(c[METRICS]["samples"]) > 0
                                            for c in kept.values()):
        return answers
    log.info("calibrating on the %d site(s) that held out labelled frames; the held-out "
             "experience of site(s) %s, labelled by the cloud, is left out",
             sum(float(c[METRICS]["samples"]) > 0 for c in kept.values()),
             ", ".join(str(n) for n in sorted(set(answers) - set(kept))))
    return kept


def evaluate_everywhere(weights, exchange: Exchange, grid: Grid, s: FederationSettings,
                        rounds: int, cost, arch: dict, recorded: Mapping | None = None,
                        level: int = 0):
    """Federated evaluation: the sites' held-out results and summed calibration tables, and,
    where the bundle stacks its exits, their stacking refitted from the sites' summed stacking
    tables (``None``: the bundle's stays). Where the refit changes the weights, the sites that
    answered evaluate once more (the model they kept, answering with the new weights), so the
    thresholds fit the answers the new version gives; if none answers that, the first
    evaluation and the bundle's stacking stand. The thresholds are calibrated by the budget
    ``s`` names, else by the starting bundle's (``recorded``: its manifest's calibration).
    Where the tables are held-out experience alone and the bundle escalates (``level`` 1 or
    more), nothing is calibrated or refitted (experience cannot count level 1)."""
    from ddnn.models.federated.calibration import add_counts

    nodes = sorted(grid.get_node_ids())
    stacked = arch.get("stacking") is not None
    views = int(arch["views"])
    answers = _screened(exchange.send(MessageType.EVALUATE, rounds + 1, {
        n: (weights, {"grid": s.grid, "stacking-tables": stacked}) for n in nodes}), s.grid,
        views, cost.detail)
    answers = _labelled_first(answers)
    # Held-out experience is labelled by the cloud's answers: there the accuracy is agreement
    # with the teacher, which says how right it is only as far as the cloud is.
    taught = sum(_taught(c) for c in answers.values())
    # Experience holds no details, so its tables count level 0 alone. For a bundle that
    # escalates they would stop sending up the frames the escalated cloud answers best
    # (measured: a 10-class bundle 0.635 -> 0.40): its thresholds, level and stacking stay.
    kept = _KEPT.format(level) if taught and level >= 1 else None
    if kept:
        log.warning("%s", kept)
    stacking, record = (_refit(answers, arch) if stacked and not kept else
                        (None, {"refit": False, "reason": kept} if stacked else None))
    if stacking is not None and stacking.to_dict() != arch["stacking"]:
        log.info("stacking refitted on the sites' held-out splits: %s", stacking.describe())
        again = json.dumps({**arch, "stacking": stacking.to_dict()})
        # No weights: each site evaluates the model it kept from the first evaluation.
        second = _screened(exchange.send(MessageType.EVALUATE, rounds + 1, {
            n: (None, {"grid": s.grid, "arch": again}) for n in sorted(answers)}), s.grid, views,
            cost.detail, first=answers)
        if any(COUNTS in c.array_records for c in second.values()):
            answers = second
        else:
            log.warning("no site evaluated the refitted stacking: the bundle's stays")
            stacking, record = None, {"refit": False, "reason": "no site evaluated the refitted "
                                      "stacking", "sites": record["sites"]}
    tables = [from_record(c[COUNTS]) for c in answers.values() if COUNTS in c.array_records]
    samples = sum(float(c[METRICS]["samples"]) for c in answers.values())
    # The escalated exit's accuracy where every site measured it (an older site does not).
    exits = ("local", "edge", "cloud", *(("escalated",) if answers and all(
        "escalated" in c[METRICS] for c in answers.values()) else ()))
    accuracy = {k: sum(float(c[METRICS].get(k, 0.0)) for c in answers.values()) / samples
                for k in exits} if samples else {}
    total = add_counts(tables) if tables else None
    # No calibration without a held-out frame (sites that held none out send empty tables).
    cal = (_calibrate(total, cost, s, recorded or {})
           if total is not None and int(total["samples"][0]) > 0 and not kept else None)
    if cal is not None:
        accuracy["overall"] = cal.point.accuracy
    evaluation = {"sites": len(answers), "samples": int(samples), "accuracy": accuracy}
    if taught:
        evaluation["teacher_labelled"] = int(taught)
    if kept:
        evaluation["calibration_kept"] = kept
    if record is not None:
        weights_now = stacking.to_dict() if stacking is not None else arch["stacking"]
        evaluation["stacking"] = {**record, "changed": weights_now != arch["stacking"],
                                  "weights": weights_now}
    return cal, stacking, evaluation


def federate(grid: Grid, s: FederationSettings, progress) -> dict:
    from ddnn.bundle import load_bundle
    from ddnn.hierarchy import UplinkCost
    from ddnn.models.federated.publish import write_federated_bundle
    from ddnn.models.federated.weights import (
        architecture,
        model_from_bundle,
        model_weights,
        trainable_names,
    )
    from ddnn.versions import next_version

    started = time.perf_counter()
    start = load_bundle(s.bundle)
    arch = architecture(start)
    initial = model_weights(model_from_bundle(s.bundle))
    version = s.version or next_version(start.manifest.version)
    base = {"arch": json.dumps(arch), "strategy": s.strategy, "epochs": s.epochs,
            "batch-size": s.batch_size, "proximal": s.proximal,
            "balance": s.balance, "scaffold": s.scaffold, "variates": s.variates,
            "holdout": s.holdout,
            "seed": s.seed, "threshold": s.threshold, "check-steps": s.check_steps,
            "threads": s.threads}
    exchange = Exchange(grid, s, base)
    wait_for_sites(grid, s.wait_sites, s.join_timeout)
    strategy, history = run_rounds(grid, s, exchange, initial, progress,
                                   trainable_names(arch))
    weights = final_model(grid, strategy, exchange, s.rounds, history)
    cal, stacking, evaluation = evaluate_everywhere(weights, exchange, grid, s, s.rounds,
                                                   UplinkCost.of(start.manifest), arch,
                                                   start.manifest.calibration,
                                                   start.manifest.escalation_level)
    refused = sum(len(h["refused"]) for h in history)
    summary = {"strategy": s.strategy, "aggregate": s.aggregate, "rounds": s.rounds,
               "epochs": s.epochs, "lr": s.lr, "server_momentum": s.momentum,
               "scaffold": s.scaffold, "variates": s.variates,
               "communicated_bytes": exchange.communicated,
               "bytes_down": exchange.bytes_down, "bytes_up": exchange.bytes_up,
               "refused_replies": refused, "evaluation": evaluation, "history": history}
    if s.strategy == "dma":
        summary.update({"threshold": s.threshold, "check_steps": s.check_steps})
    bundle = write_federated_bundle(start, arch, weights, s.out, version, cal, summary,
                                    stacking)
    return {"rounds": s.rounds, "communicated_bytes": exchange.communicated,
            "version": bundle.manifest.version, "bundle": str(bundle.path),
            "strategy": s.strategy, "aggregate": s.aggregate, "refused_replies": refused,
            "evaluation": evaluation,
            "thresholds": dict(bundle.manifest.thresholds),
            "escalation_level": bundle.manifest.escalation_level,
            "seconds": round(time.perf_counter() - started, 2)}


@app.main()
def main(grid: Grid, context: Context) -> None:
    s = FederationSettings.from_run_config(context.run_config)
    work = Path(s.work)
    work.mkdir(parents=True, exist_ok=True)

    def progress(entry: dict) -> None:
        with open(work / PROGRESS, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    try:
        result = federate(grid, s, progress)
    except Exception as e:
        error = str(e) if isinstance(e, DdnnError) else f"{type(e).__name__}: {e}"
        (work / RESULT).write_text(json.dumps({"error": error,
                                               "traceback": traceback.format_exc()}))
        raise
    (work / RESULT).write_text(json.dumps(result))
