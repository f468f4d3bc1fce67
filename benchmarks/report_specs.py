"""What the benchmark report shows for each benchmark: its question, its one table (JSON paths
for rows and columns, units in the headers, the same run's baseline beside each figure), the
setup figures above it. Prose here says how to read a table, never what the figures are."""

from __future__ import annotations

from ddnn.benchmarks.report import Col, Row, Spec

PCT = 100.0  # fractions shown as %; their differences as percentage points

TRAINING = Spec(
    question="How accurate is the default bundle at each exit, where do frames leave, how "
    "many bytes does a frame send, and how long does it train, against the raw-offload "
    "reference?",
    baseline="the raw-offload reference: a float CNN trained (`ddnn train --baseline`) on the "
    "same files on the full images of every present view; bytes against raw offload (every "
    "present view sent as an 8-bit image). Accuracy on the 1000-sample test file.",
    label="figure",
    cols=(Col("default bundle", "{0}"), Col("baseline", "{1}"),
          Col("bundle vs baseline", "{0}", base="{1}", how="diff")),
    rows=(
        Row("overall accuracy (%)", ("evaluation/accuracy/overall",
                                     "raw_offload_reference/test_accuracy"), PCT),
        *(Row(f"{e} exit accuracy, every frame (%)", (f"evaluation/accuracy/{e}",
                                                      "raw_offload_reference/test_accuracy"),
              PCT) for e in ("local", "edge", "cloud")),
        *(Row(f"frames answered at the {e} exit (%)", (f"evaluation/exit_fraction/{e}", "-"),
              PCT) for e in ("local", "edge", "cloud")),
        Row("uplink bytes per frame (B)", ("evaluation/bytes_per_frame/ddnn",
                                           "evaluation/bytes_per_frame/raw_offload"), 1.0,
            "fewer"),
        Row("training wall time (s)", ("train_seconds", "raw_offload_reference/seconds"), 1.0,
            "ratio"),
    ),
    setup=("epochs", "trained_on", "dataset/samples"),
)

ABLATION = Spec(
    question="What does each of the default training's changes win: accuracy and bytes with "
    "one change turned off at a time?",
    baseline="`defaults`, the bundle with every change, trained in the same run on the same "
    "files; and the raw-offload reference's accuracy.",
    label="variant",
    rows="variants/*",
    cols=(Col("overall accuracy (%)", "variants/{0}/overall", scale=PCT),
          Col("vs defaults (points)", "variants/{0}/overall", base="variants/defaults/overall",
              how="diff", scale=PCT),
          Col("vs raw reference (points)", "variants/{0}/overall",
              base="raw_offload_reference", how="diff", scale=PCT),
          Col("cloud exit accuracy (%)", "variants/{0}/cloud", scale=PCT),
          Col("uplink (B/frame)", "variants/{0}/uplink_bytes_per_frame")),
)

TIERS = Spec(
    question="On three data sets and two seeds, how far is each escalation setting from the "
    "raw-offload reference's accuracy, and at how many fewer bytes than raw?",
    baseline="the raw-offload reference of the same set and seeds (mean over the seeds).",
    label="set · variant",
    rows="table/*/variants/*",
    cols=(Col("overall accuracy, seed mean (%)", "table/{0}/variants/{1}/aims/overall_mean",
              scale=PCT),
          Col("reference (%)", "table/{0}/reference/overall_mean", scale=PCT),
          Col("vs reference (points)", "table/{0}/variants/{1}/aims/overall_mean",
              base="table/{0}/reference/overall_mean", how="diff", scale=PCT),
          Col("fewer bytes than raw, worst seed (×)", "table/{0}/variants/{1}/aims/x_fewer_min")),
    setup=("sets", "seeds", "note"),
    bundle="bundles trained by the benchmark itself, per set and seed",
)

STACKING = Spec(
    question="On the tiers benchmark's bundles, what do stacked exits buy: does accuracy rise "
    "going up the tiers, and does the calibrated hierarchy gain?",
    baseline="the same bundle with its exits unstacked (stacking and thresholds fitted again by "
    "`ddnn train`'s own code on its held-out splits; mean over the seeds).",
    label="set · variant",
    rows="table/*/*",
    cols=(Col("local (%)", "table/{0}/{1}/stacked/mean/local", scale=PCT),
          Col("edge, unstacked (%)", "table/{0}/{1}/unstacked/mean/edge", scale=PCT),
          Col("edge, stacked (%)", "table/{0}/{1}/stacked/mean/edge", scale=PCT),
          Col("cloud, unstacked (%)", "table/{0}/{1}/unstacked/mean/cloud", scale=PCT),
          Col("cloud, stacked (%)", "table/{0}/{1}/stacked/mean/cloud", scale=PCT),
          Col("overall, stacked (%)", "table/{0}/{1}/stacked/mean/overall", scale=PCT),
          Col("vs unstacked (points)", "table/{0}/{1}/stacked/mean/overall",
              base="table/{0}/{1}/unstacked/mean/overall", how="diff", scale=PCT),
          Col("bytes a frame, stacked", "table/{0}/{1}/stacked/mean/bytes_per_frame")),
    setup=("sets", "seeds", "note"),
    bundle="the tiers benchmark's bundles (`--work`/tiers), restacked by the benchmark",
)

PAPER_TABLES = Spec(
    question="The paper's tables on the default bundle: accuracy as devices are added, and "
    "with one device missing.",
    baseline="the same bundle with all six devices present.",
    label="devices present",
    cols=(Col("overall accuracy (%)", "tables/{0}/accuracy/{1}/overall", scale=PCT),
          Col("local exit accuracy (%)", "tables/{0}/accuracy/{1}/local", scale=PCT),
          Col("all six present (%)", "tables/missing/all_present/overall", scale=PCT),
          Col("vs all present (points)", "tables/{0}/accuracy/{1}/overall",
              base="tables/missing/all_present/overall", how="diff", scale=PCT)),
    plots=("paper_tables.png", "paper_filters.png"),
    rows=(*(Row(f"devices 0..{i}", ("devices", str(i))) for i in range(6)),
          *(Row(f"all but device {i}", ("missing", str(i))) for i in range(6))),
)

DEVICE_FOOTPRINT = Spec(
    question="How much memory and time does a device agent need, and how big is its segment?",
    baseline="per row: a Python process that imported torch; the agent at an older commit over "
    "the same onnxruntime floor (only with `DDNN_FOOTPRINT_BASELINE=REV`, `baseline_*` in the "
    "JSON); a raw 8-bit frame. aarch64 only where `make test-arm64` built its userland.",
    label="figure",
    cols=(Col("this tree", "{0}"), Col("baseline", "{1}"),
          Col("this tree vs baseline", "{0}", base="{1}", how="ratio")),
    rows=(
        Row("agent peak RSS, x86-64 (MiB) vs Python with torch",
            ("memory/x86_64/this_tree/agent/peak_rss_mib",
             "baseline_python_with_torch_rss_mib")),
        *(Row(f"agent above an onnxruntime session alone, {a} (MiB) vs older commit",
              (f"memory/{k}/this_tree/agent_over_floor_mib",
               f"memory/{k}/baseline_*/agent_over_floor_mib"))
          for a, k in (("x86-64", "x86_64"), ("aarch64 emulated", "aarch64_emulated"))),
        *(Row(f"agent's own CPU per frame, {a} (ms) vs older commit",
              (f"memory/{k}/this_tree/per_frame/own_cpu_ms",
               f"memory/{k}/baseline_*/per_frame/own_cpu_ms"))
          for a, k in (("x86-64", "x86_64"), ("aarch64 emulated", "aarch64_emulated"))),
        Row("aarch64 emulated agent at 10 fps: share of frames delivered vs older commit",
            ("memory/aarch64_emulated/this_tree/ten_fps/delivered_share",
             "memory/aarch64_emulated/baseline_*/ten_fps/delivered_share")),
        Row("device segment file (B) vs a raw 8-bit frame",
            ("segment_file_bytes", "raw_frame_bytes")),
        Row("device segment per frame, one thread, p50 (ms)",
            ("per_frame_ms_one_thread/p50", "-")),
        Row("device segment per frame, one thread, p99 (ms)",
            ("per_frame_ms_one_thread/p99", "-")),
    ),
)

CLOUD_THROUGHPUT = Spec(
    question="How many single-sample requests per second does the cloud answer, with and "
    "without dynamic batching, and how close is that to onnxruntime called in-process?",
    baseline="the same model without batching, and called in-process (no HTTP), same run.",
    label="concurrent clients",
    rows="results/batching/*",
    cols=(Col("batching (req/s)", "results/batching/{0}/throughput"),
          Col("no batching (req/s)", "results/no_batching/{0}/throughput"),
          Col("batching vs none", "results/batching/{0}/throughput",
              base="results/no_batching/{0}/throughput", how="ratio"),
          Col("in-process (samples/s)", "results/in_process/{0}/throughput"),
          Col("batching vs in-process", "results/batching/{0}/throughput",
              base="results/in_process/{0}/throughput", how="ratio"),
          Col("batching p50 (ms)", "results/batching/{0}/p50_ms"),
          Col("batching p99 (ms)", "results/batching/{0}/p99_ms")),
    setup=("model", "server", "seconds_per_point", "repeats"),
)

EDGE_CLOUD_BYTES = Spec(
    question="How many HTTP bytes does a frame the edge sends to the cloud cost, packed "
    "against FP32 features, and an escalated frame as a lean frame against its packed inputs "
    "and FP32?",
    baseline="FP32 features, and FP32 as the server sent them before (`fp32_before`), same "
    "run, counted through a loopback relay.",
    label="frames per request",
    rows="summary/*",
    cols=(Col("packed (B/frame)", "summary/{0}/packed"),
          Col("FP32 (B/frame)", "summary/{0}/fp32"),
          Col("FP32 before (B/frame)", "summary/{0}/fp32_before"),
          Col("packed vs FP32", "summary/{0}/packed", base="summary/{0}/fp32", how="fewer"),
          Col("packed vs before", "summary/{0}/packed", base="summary/{0}/fp32_before",
              how="fewer"),
          Col("escalated, lean frame (B/frame)", "summary/{0}/escalated"),
          Col("escalated, packed inputs (B/frame)", "summary/{0}/escalated_packed"),
          Col("escalated, FP32 deflated (B/frame)", "summary/{0}/escalated_fp32"),
          Col("escalated, FP32 plain (B/frame)", "summary/{0}/escalated_plain"),
          Col("lean vs packed inputs", "summary/{0}/escalated",
              base="summary/{0}/escalated_packed", how="fewer"),
          Col("lean vs FP32 deflated", "summary/{0}/escalated",
              base="summary/{0}/escalated_fp32", how="fewer")),
    setup=("model", "codec", "features_shape", "detail_shape", "requests_per_point"),
)

HIERARCHY_LATENCY = Spec(
    question="How long from capture to answer, per exit, through a real broker, edge and "
    "cloud, and how far is that from the floor of the work itself?",
    baseline="the floor, measured in the same run: the compute of the segments a frame "
    "passes plus its broker hops (and the cloud call for cloud frames).",
    label="exit",
    rows="per_tier/*",
    cols=(Col("frames", "per_tier/{0}/frames"),
          Col("p50 (ms)", "per_tier/{0}/p50_ms"),
          Col("p99 (ms)", "per_tier/{0}/p99_ms"),
          Col("floor (ms)", "per_tier/{0}/floor_ms"),
          Col("p50 vs floor", "per_tier/{0}/p50_ms", base="per_tier/{0}/floor_ms",
              how="ratio")),
    setup=("frames", "fps", "views", "thresholds", "broker"),
)

ALIGNMENT = Spec(
    question="With devices started a second apart on a loaded machine, does the edge still "
    "fuse every view of a frame, and what does that cost in latency?",
    baseline="each configuration's offline accuracy on the same frames (`ddnn evaluate`): "
    "what the live answers would be with every view.",
    label="edge alignment",
    rows="per_config/*",
    cols=(Col("answered", "per_config/{0}/answered"),
          Col("partial frames (%)", "per_config/{0}/partial_share", scale=PCT),
          Col("live accuracy (%)", "per_config/{0}/live_accuracy", scale=PCT),
          Col("offline (%)", "per_config/{0}/offline_accuracy", scale=PCT),
          Col("live vs offline (points)", "per_config/{0}/live_accuracy",
              base="per_config/{0}/offline_accuracy", how="diff", scale=PCT),
          Col("local p50 (ms)", "per_config/{0}/local_p50_ms"),
          Col("local p99 (ms)", "per_config/{0}/local_p99_ms")),
    setup=("frames", "fps", "skew_s", "cpu_burners", "note"),
)

EDGE_INGEST = Spec(
    question="How many device messages per second can the edge take in, against a bare MQTT "
    "subscriber on the same broker?",
    baseline="a bare paho subscriber draining the same broker and publishers, same run.",
    label="figure",
    cols=(Col("edge", "{0}"), Col("bare subscriber", "{1}"),
          Col("edge vs subscriber", "{0}", base="{1}", how="ratio")),
    rows=(
        Row("messages per second, saturated", ("edge_msgs_per_s", "raw_broker_msgs_per_s")),
        Row("CPU per message (µs)", ("cpu_us_per_msg/edge", "cpu_us_per_msg/raw_subscriber")),
        *(Row(f"capture to result at {f}× the raw rate, p{q} (ms)",
              (f"paced/{f}/edge_capture_to_result_ms/p{q}",
               f"paced/{f}/raw_capture_to_receipt_ms/p{q}"))
          for f in ("0.5", "0.9") for q in ("50", "99")),
    ),
    setup=("views", "frames", "repeats"),
)

RAW_VS_HIERARCHY = Spec(
    question="End to end on this machine: the hierarchy against sending every view's raw "
    "image to a cloud model, in accuracy, uplink bytes and latency.",
    baseline="raw offload: the raw-offload reference model served by the cloud, one "
    "sequential client sending every present view as an 8-bit image, same frames.",
    label="figure",
    cols=(Col("hierarchy", "{0}"), Col("raw offload", "{1}"),
          Col("hierarchy vs raw", "{0}", base="{1}", how="ratio")),
    rows=(
        Row("accuracy (%)", ("hierarchy/accuracy", "raw_offload/accuracy"), PCT, "diff"),
        Row("uplink bytes per frame (B)", ("hierarchy/uplink_bytes_per_frame",
                                           "raw_offload/uplink_bytes_per_frame_8bit"),
            1.0, "fewer"),
        Row("latency p50, weighted over exits (ms)",
            ("hierarchy/latency_ms_p50_weighted", "raw_offload/latency_ms/p50")),
        *(Row(f"latency p50, {e} exit (ms)", (f"hierarchy/latency_ms_by_exit/{e}/p50",
                                              "raw_offload/latency_ms/p50"))
          for e in ("local", "edge", "cloud")),
        *(Row(f"frames answered at the {e} exit", (f"hierarchy/exits/{e}", "-"))
          for e in ("local", "edge", "cloud")),
    ),
    setup=("frames", "note"),
)

BANDWIDTH = Spec(
    question="On a rate-limited link, how many frames per second does each setup carry, and "
    "how many bytes does a frame put on the wire each way?",
    baseline="raw offload of 8-bit images over the same link (`raw_8bit`), same run.",
    label="link · setup",
    rows="rates/*/*",
    cols=(Col("frames/s", "rates/{0}/{1}/fps"),
          Col("vs raw 8-bit", "rates/{0}/{1}/fps", base="rates/{0}/raw_8bit/fps", how="ratio"),
          Col("latency p50 (ms)", "rates/{0}/{1}/latency_ms/p50"),
          Col("wire up (B/frame)", "rates/{0}/{1}/wire/up_bytes_per_frame"),
          Col("up vs raw 8-bit", "rates/{0}/{1}/wire/up_bytes_per_frame",
              base="rates/{0}/raw_8bit/wire/up_bytes_per_frame", how="fewer"),
          Col("wire down (B/frame)", "rates/{0}/{1}/wire/down_bytes_per_frame"),
          Col("accuracy (%)", "rates/{0}/{1}/accuracy", scale=PCT)),
    setup=("setup/link", "setup/views", "setup/model"),
)

SOAK = Spec(
    question="Running the full hierarchy for minutes, is every frame answered once, and does "
    "any process's memory grow?",
    baseline="each process's own resident memory at the start of the same run.",
    label="process",
    rows="rss/*",
    cols=(Col("start (MiB)", "rss/{0}/start_mib"), Col("end (MiB)", "rss/{0}/end_mib"),
          Col("peak (MiB)", "rss/{0}/max_mib"),
          Col("end vs start", "rss/{0}/end_mib", base="rss/{0}/start_mib", how="ratio")),
    setup=("frames_sent", "answered", "duplicates", "seconds", "fps", "outcomes"),
)

FEDERATED = Spec(
    question="Sites whose data drifted apart: how much accuracy do FedAvg and DMA win back, "
    "against central training on all data, and at how many bytes?",
    baseline="central training on every site's data, same run; `before` is the bundle before "
    "federation.",
    label="training",
    # One row per training and seed (the JSON keeps each seed's figure at its list index;
    # benchmarks/federated.py runs SEEDS = (1, 2)).
    rows=tuple(Row(f"{k}, seed {i + 1}", (k, str(i))) for k in ("before", "central", "fedavg",
                                                              "dma") for i in range(2)),
    cols=(Col("overall accuracy (%)", "summary/accuracy_overall/{0}/{1}", scale=PCT),
          Col("vs central (points)", "summary/accuracy_overall/{0}/{1}",
              base="summary/accuracy_overall/central/{1}", how="diff", scale=PCT),
          Col("communicated (MB)", "summary/communicated_mb/{0}/{1}"),
          Col("wall time (s)", "seeds/{1}/seconds/{0}"),
          Col("CPU time (s)", "seeds/{1}/cpu_seconds/{0}")),
    setup=("setup/classes", "setup/zoom", "setup/sites", "setup/non_iid_alpha",
           "setup/site_samples", "setup/seeds"),
    bundle="bundles trained by the benchmark itself (3 sites)",
)

DRIFT = Spec(
    question="When the scene changes under a live hierarchy, do adaptive exit thresholds "
    "notice sooner and answer better than fixed ones?",
    baseline="every exit of the same bundle offline on the drifted frames (`ddnn evaluate`, "
    "overall); the `fixed` row is the live baseline.",
    label="thresholds",
    rows="summary/*",
    cols=(Col("accuracy on drifted frames (%)", "summary/{0}/accuracy_drifted", scale=PCT),
          Col("offline, drifted (%)", "drifted_accuracy_offline/overall", scale=PCT),
          Col("vs offline (points)", "summary/{0}/accuracy_drifted",
              base="drifted_accuracy_offline/overall", how="diff", scale=PCT),
          Col("local exits, drifted (%)", "summary/{0}/local_share_drifted", scale=PCT),
          Col("cloud calls per frame", "summary/{0}/cloud_frames_per_frame"),
          Col("alarm after (drifted frames)", "summary/{0}/alarm_after_drifted_frames")),
    setup=("frames", "fps", "audit_rate", "drifts"),
    bundle="a small bundle the benchmark trains itself (3 views of 16×16) with today's "
    "training defaults, cached in `runs/bench/drift`",
)

CLOSED_LOOP = Spec(
    question="When the scene drifts under a live hierarchy, does the loop (drift alarm, "
    "operators' labels and a site's file, `ddnn federate`, the signed version over the air) "
    "win the accuracy back, and what does the cloud teach alone, without labels?",
    baseline="the same hierarchy on the same drifted scene before the update (`drifted`), same "
    "run; for the cloud as teacher, the bundle before it (`ddnn evaluate`, held-out drifted "
    "set).",
    label="phase",
    rows=tuple(Row(p, (p,)) for p in ("home", "drifted", "after")),
    cols=(Col("accuracy, live (%)", "phases/{0}/accuracy", scale=PCT),
          Col("vs drifted (points)", "phases/{0}/accuracy", base="phases/drifted/accuracy",
              how="diff", scale=PCT),
          Col("local exits (%)", "phases/{0}/local_share", scale=PCT),
          Col("frames", "phases/{0}/frames")),
    setup=("version", "alarm_after_drifted_frames", "seconds/labels_to_updated",
           "seconds/federation", "offline_test/before/accuracy/overall",
           "offline_test/after/accuracy/overall",
           "teacher/sound/before/accuracy/overall", "teacher/sound/after/accuracy/overall",
           "teacher/fooled/before/accuracy/overall", "teacher/fooled/after/accuracy/overall"),
    bundle="a small bundle the benchmark trains itself (3 views of 16×16, the drift "
    "benchmark's scene), cached in `runs/bench/closed_loop`",
)

LATENCY_SLO = Spec(
    question="When the cloud turns slow mid-run, does the latency planner (`--latency-slo`) keep "
    "the p99 within the objective, and at what accuracy, against fixed thresholds?",
    baseline="the same replay at fixed thresholds, same run: the curve's most accurate point "
    "(`fixed`) and its most accurate point sending nothing up (`fixed-no-cloud`); the objective "
    "is 100 ms at p99; `against_fixed` in the JSON says, per phase, which fixed run held it "
    "most accurately and the planner's accuracy beside it.",
    label="thresholds",
    rows="summary/*",
    cols=tuple(c for phase in ("fast", "slow", "recovered") for c in (
        Col(f"{phase}: p99 (ms)", f"summary/{{0}}/{phase}/p99_ms"),
        Col(f"{phase}: p99 after 3 s (ms)", f"summary/{{0}}/{phase}/p99_settled_ms"),
        Col(f"{phase}: accuracy (%)", f"summary/{{0}}/{phase}/accuracy", scale=PCT),
        Col(f"{phase}: cloud exits (%)", f"summary/{{0}}/{phase}/cloud_share", scale=PCT))),
    setup=("frames_per_phase", "fps", "delay_s", "warmup_s", "objective_ms", "percentile",
           "wait_ms"),
    bundle="a small bundle the benchmark trains itself (3 views of 16×16), cached in "
    "`runs/bench/latency_slo`",
)

LIVEZ_UNDER_LOAD = Spec(
    question="Does the edge's `/livez` keep answering while 80 connections pipeline GETs and "
    "never read (issue 40, round 3: 5 s timeouts)?",
    baseline="the same rounds against the code of `before_revision` (exported with `git "
    "archive`), same run.",
    label="figure",
    cols=(Col("after", "after/{0}"), Col("before", "before/{0}"),
          Col("after vs before", "after/{0}", base="before/{0}", how="ratio")),
    rows=tuple(Row(f"{what}, {target} pipelined", (f"{target}/{key}",))
               for target in ("results_page", "metrics")
               for what, key in (("worst /livez (s)", "worst_s"),
                                 ("median /livez (s)", "median_s"),
                                 ("rounds worse than 1 s", "rounds_over_1s"),
                                 ("failed probes", "failed_probes"))),
    setup=("connections", "pipelined", "rounds", "window_s", "before_revision"),
    bundle="the default bundle (the edge only loads it: the attack never reaches a model)",
)

SPECS = {
    "training": TRAINING, "ablation": ABLATION, "tiers": TIERS, "stacking": STACKING,
    "paper_tables": PAPER_TABLES,
    "device_footprint": DEVICE_FOOTPRINT, "cloud_throughput": CLOUD_THROUGHPUT,
    "edge_cloud_bytes": EDGE_CLOUD_BYTES, "hierarchy_latency": HIERARCHY_LATENCY,
    "alignment": ALIGNMENT, "edge_ingest": EDGE_INGEST, "raw_vs_hierarchy": RAW_VS_HIERARCHY,
    "bandwidth": BANDWIDTH, "soak": SOAK, "federated": FEDERATED, "drift": DRIFT,
    "latency_slo": LATENCY_SLO, "livez_under_load": LIVEZ_UNDER_LOAD,
    "closed_loop": CLOSED_LOOP,
}

# The suite's time budget for benchmarks without a measured wall time in their JSON
# (minutes on the 2 shared cores; tiers from its own docstring).
ESTIMATES = {
    "tiers": "hours (24 trainings); 6 min on a GPU machine (--jobs)",
    "ablation": "~30 (4 trainings beside the default bundle)",
    "paper_tables": "~15 (3 retrainings)",
    "federated": "~35 (central, FedAvg, DMA)",
    "edge_ingest": "~5",
    "edge_cloud_bytes": "~3",
}

INTRO = """# Benchmark results

`ddnn bench` runs each benchmark beside its baseline, **in the same run on the same machine**,
and writes `<name>.json` (every figure), `<name>*.png` (plots) and this page. Compare a figure
with the baseline beside it, not with figures taken elsewhere: the machine these were taken on
has 2 CPU cores and no GPU and was shared with other work while they ran (`nice -n 5`), so single
figures are noisy and absolute times are slower than on an idle machine.

Each section below: the question, one table (units in the headers; the baseline and the figure
against it in the columns named "vs"; `–` where a figure does not apply), the plot, the command
that reproduces it, and when, where and on which bundle it ran. `ddnn bench --only NAME` reruns
one (`--quick` for a smoke run of small data); the default generated dataset (1500 training,
1000 test samples of MVMC's shape: 6 cameras, 3 classes, 32×32) and the default bundle are made
once in `--work` (default `runs/bench`) and reused: delete it to retrain on new defaults.

## The last rerun and what it ran on

On 2026-11-25, 23:05-00:10 UTC, `runs/bench` was made afresh and the default bundle retrained
with the defaults of the day (live escalation on: `--escalate view`; 60 epochs on the CPU),
then every benchmark that uses it was rerun, and `drift` (its own small bundle), in up to three
concurrent `ddnn bench` runs beside other work on the 2 cores (load average 5 to 8): wall times
and latencies are upper bounds; ratios to the same run's baseline are what to read.
`cloud_throughput` and `hierarchy_latency` were rerun alone at the end, since the concurrent
runs had disturbed them. Live
escalation became the default on 2026-11-25 around 22:40 UTC: results committed before then
("not stamped" below) ran on a bundle without it. Not rerun with the others: `tiers` (rerun on
2026-11-26 with a teacher among its variants: its 30 trainings at once on the lent GPU machine in
5 min, `python -m ddnn.benchmarks.tiers --jobs 30`, then evaluated here in 91 s; without the
escalation-off variant, measured the day before), `edge_ingest` (rerun the same evening with
the change it measures, unstamped), `edge_cloud_bytes` (rerun on 2026-11-26 with the escalated
requests, on the defaults that run trained for set A, seed 0: the default set and seed),
`ablation` (rerun at 00:14 on the lent GPU machine: its seven trainings at once there in 66 s,
then the benchmark on them; escalation added to its variants), and `federated` and
`paper_tables` (rerun on 2026-11-26 in a `--work` of their own, on a default bundle of the day
trained there: escalation and stacked exits; `federated` after `ddnn federate` came to refit
the stacking weights).

**Time budget of the full suite** (`ddnn bench` in a fresh `--work` on the 2 shared cores):
training the default bundle and the raw-offload reference, 37 and 40 min side by side under
tonight's load (`train_seconds` and the reference's `seconds` in `training.json`; the previous
bundle, without escalation, trained in 1.4 min on a quieter machine), not counted in the
`training` row below; the nine rerun benchmarks, 18 min measured (`federated` and
`paper_tables`, rerun since, 12 min more: the table's total is every stamped run's); the
estimates below for the others, about 1.5 h on a quiet machine and several times that under
load; and `tiers`, about 2 h on 2 cores (24 trainings; two at a time with `--threads 1` each, as
two 2-thread trainings on 2 cores ran five times slower), minutes on a GPU machine. In
all: about 2 h under tonight's load without `ablation`, `paper_tables`, `federated` and
`tiers`; plan on half a day for everything on 2 cores.

## The benchmarks

`ddnn bench` prints which benchmark runs and how far the suite is (`== [i/n] name (m min so
far)`), each one's wall time and the total. The table gives each benchmark's wall time on the 2
shared cores: measured where its JSON has a `run` block (a fresh `--work` trains the default
bundle and the raw-offload reference in the first benchmark that needs them; tonight they were
trained apart, above), else an estimate.
"Not stamped" results ran before `ddnn bench` recorded when and on which bundle: their sections
say what is known.
"""
