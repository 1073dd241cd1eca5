#!/usr/bin/env python3
"""Checks deploy/kubernetes offline (crates/strata/tests/kubernetes.rs runs it):

* every manifest validates against Kubernetes' own OpenAPI schemas (kubernetes-validate,
  strict: unknown fields are errors), and a broken copy of one is refused (the check can fail);
* each worker's memory requests and limits equal `strata plan`'s per-server device + host pool
  bytes for the flags the StatefulSet passes (from the ConfigMap), plus what the plan reserves
  beside the pools (the response store, a decode worker's K/V staging), plus STRATA_RUNTIME_MEMORY
  (the weights, the forward pass's scratch and the process); with --model-dir holding the model
  file the pods name, the plan is the file's (`strata serve`'s: its weights and forward pass for
  the pod's --threads and batch limits, 94 MiB + 182 MiB for SmolLM2) and STRATA_RUNTIME_MEMORY
  must cover both, else a preset's with the same pools (which counts neither),
  its CPUs equal --threads, requests equal limits (Guaranteed QoS: the topology manager aligns
  only such pods to a NUMA node);
* every $(VAR) an argument uses is defined; the router's and the decode workers' worker URLs
  name the StatefulSets' pods;
* the Grafana dashboards ConfigMap holds exactly deploy/grafana/dashboards/*.json
  (`check.py --write` regenerates it);
* a worker with a liveness probe has a startup probe of at least 10 minutes (a model loading
  answers no probe), and a pod's terminationGracePeriodSeconds covers a stop (61 s).

Usage: check.py --strata PATH/TO/strata [--model-dir DIR] [--write]
  (e.g. --strata ./target/release/strata --model-dir ~/.cache/strata/models)
Needs kubernetes-validate and PyYAML (scripts/requirements-test.txt).
"""

import argparse
import copy
import json
import pathlib
import re
import subprocess
import sys

try:
    import kubernetes_validate
    import yaml
except ImportError as e:
    sys.exit(f"check.py: {e}: it needs kubernetes-validate and PyYAML, pinned in "
             "scripts/requirements-test.txt (python3 -m pip install -r scripts/requirements-test.txt)")

HERE = pathlib.Path(__file__).resolve().parent
DASHBOARDS = HERE.parent / "grafana" / "dashboards"
K8S_VERSION = "1.30.0"
# Model files the manifests name, and the `strata plan` preset with the same pools.
PRESETS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m"}
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
         "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def fail(msg):
    print(f"check.py: {msg}", file=sys.stderr)
    sys.exit(1)


def quantity(q):
    m = re.fullmatch(r"(\d+)([KMGT]i?|k)?", str(q))
    if not m:
        fail(f"unsupported quantity {q!r}")
    return int(m.group(1)) * UNITS.get(m.group(2) or "", 1)


def load():
    docs = []
    for f in sorted(HERE.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d:
                docs.append((f.name, d))
    return docs


def validate(docs):
    for name, d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{name}: {d['kind']}/{d['metadata']['name']}: {e.message}")
    sts = next(d for _, d in docs if d["kind"] == "StatefulSet")
    for broken in ("replicas", "unknown"):
        b = copy.deepcopy(sts)
        if broken == "replicas":
            b["spec"]["replicas"] = "two"
        else:
            b["spec"]["template"]["spec"]["containers"][0]["cpuLimit"] = 4
        try:
            kubernetes_validate.validate(b, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError:
            continue
        fail(f"a StatefulSet with a broken {broken} field validated: the validator checks nothing")
    print(f"{len(docs)} resources valid against Kubernetes {K8S_VERSION} (strict)")


def flags(args, env):
    out = {}
    for a in args[1:]:
        m = re.fullmatch(r"--([a-z-]+)=(.*)", a)
        if not m:
            fail(f"argument {a!r} is not --flag=value")
        v = re.sub(r"\$\(([A-Z_]+)\)", lambda x: env.get(x.group(1)) or fail(
            f"$({x.group(1)}) is not defined"), m.group(2))
        out.setdefault(m.group(1), []).append(v)
    return out


def check_flags(what, args, strata):
    """Every --flag of a container exists in that `strata` subcommand's --help."""
    o = subprocess.run([strata, args[0], "--help"], capture_output=True, text=True)
    known = set(re.findall(r"--([a-z][a-z0-9-]*)", o.stdout))
    for a in args[1:]:
        name = a[2:].split("=", 1)[0]
        if name not in known:
            fail(f"{what}: `strata {args[0]}` has no flag --{name}")


# The plan's line for the forward pass (strata_mem::Scratch::LABEL): in the runtime memory.
FORWARD = "--max-batch-tokens/--max-running (the forward pass)"


def plan_source(name, f, model_dir):
    """`strata plan` arguments for the worker's model: the file itself when `model_dir` holds
    it (with the pod's --threads and batch limits), else the preset with the same pools."""
    model = pathlib.Path(f["model"][0]).name
    path = model_dir / model if model_dir else None
    if path and path.is_file():
        args = ["--model", str(path)]
        for k in ("threads", "max-batch-tokens", "max-running"):
            if k in f:
                args += [f"--{k}", f[k][0]]
        return args, True
    if model not in PRESETS:
        fail(f"{name}: no plan preset for model file {model}")
    return ["--model-preset", PRESETS[model]], False


def check_worker(sts, config, strata, model_dir=None):
    name = sts["metadata"]["name"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    check_flags(name, c["args"], strata)
    env = dict(config)
    for e in c.get("env", []):
        env[e["name"]] = "10.0.0.1" if "valueFrom" in e else e["value"]
    f = flags(c["args"], env)
    source, real = plan_source(name, f, model_dir)
    plan_args = [strata, "plan", "--machine", "1x64GB", *source, "--json"]
    # (`strata serve` runs one rank: --tp-size is 1 and not a serve flag.)
    for k in ("role", "page-size", "device-mem", "hicache-size", "numa-node", "numa-policy"):
        plan_args += [f"--{k}", f[k][0]]
    # What the worker holds beside its pools (the response store; a decode worker's K/V
    # staging), as the pod sets it or by default: the plan reserves it, and so does the pod.
    for k in ("kv-staging", "response-store-size"):
        if k in f:
            plan_args += [f"--{k}", f[k][0]]
    o = subprocess.run(plan_args, capture_output=True, text=True)
    if o.returncode != 0:
        fail(f"{name}: strata plan refused the pod's flags: {o.stderr.strip()}")
    plan = json.loads(o.stdout)
    beside = sum(b for what, b in plan["numa"]["beside"] if what != FORWARD)
    runtime = quantity(config["STRATA_RUNTIME_MEMORY"])
    if real:
        forward = sum(b for what, b in plan["numa"]["beside"] if what == FORWARD)
        weights = plan["numa"]["weights_bytes"]
        if weights + forward > runtime:
            fail(f"{name}: STRATA_RUNTIME_MEMORY {runtime} bytes does not cover the weights "
                 f"({weights}) and the forward pass ({forward}) that `strata serve` reserves")
        print(f"{name}: runtime {runtime} bytes covers the weights {weights} + forward pass "
              f"{forward} (from {f['model'][0]})")
    want = plan["server_device_bytes"] + plan["server_host_bytes"] + beside + runtime
    r = c["resources"]
    if r["requests"] != r["limits"]:
        fail(f"{name}: requests {r['requests']} differ from limits {r['limits']}")
    got = quantity(r["requests"]["memory"])
    if got != want:
        fail(f"{name}: memory {got} bytes, but the plan's pools, what it reserves beside them "
             f"and the runtime are {want}")
    if quantity(r["requests"]["cpu"]) != int(f["threads"][0]):
        fail(f"{name}: {r['requests']['cpu']} CPUs for --threads {f['threads'][0]}")
    # Loading answers no probe: a liveness probe without a startup probe that waits long
    # enough restarts a worker still loading a large model, for ever.
    s = c.get("startupProbe", {})
    waits = s.get("periodSeconds", 10) * s.get("failureThreshold", 3)
    pod = sts["spec"]["template"]["spec"]
    if pod.get("terminationGracePeriodSeconds", 30) < 61:
        fail(f"{name}: terminationGracePeriodSeconds under 61: a worker's stop takes its grace "
             "(30 s), as long again to write answers out, and a second")
    if "livenessProbe" in c and waits < 600:
        fail(f"{name}: a liveness probe with a startup probe of {waits} s: a large model's "
             "load (minutes) would be restarted; give startupProbe at least 600 s")
    print(f"{name}: memory {got} bytes = plan device {plan['server_device_bytes']} + host "
          f"{plan['server_host_bytes']} + beside {beside} + runtime; {f['threads'][0]} CPUs")
    return f


def pod_urls(sts):
    n, s = sts["metadata"]["name"], sts["spec"]["serviceName"]
    ns = sts["metadata"]["namespace"]
    return [f"http://{n}-{i}.{s}.{ns}.svc.cluster.local:8000" for i in range(sts["spec"]["replicas"])]


def dashboards_map():
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "strata-grafana-dashboards", "namespace": "strata",
                     "labels": {"grafana_dashboard": "1"}},
        "data": {p.name: p.read_text() for p in sorted(DASHBOARDS.glob("*.json"))},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--model-dir", type=pathlib.Path,
                    help="where the model file the pods name lies (its plan, not a preset's)")
    a = ap.parse_args()
    target = HERE / "grafana-dashboards.yaml"
    if a.write:
        head = ("# Generated by deploy/kubernetes/check.py --write from deploy/grafana/dashboards"
                " (Grafana's sidecar loads ConfigMaps labelled grafana_dashboard).\n")
        class Literal(yaml.SafeDumper):
            pass

        def text(dumper, v):
            style = "|" if "\n" in v else None
            return dumper.represent_scalar("tag:yaml.org,2002:str", v, style=style)

        Literal.add_representer(str, text)
        body = yaml.dump(dashboards_map(), Dumper=Literal, sort_keys=False, width=1 << 20)
        target.write_text(head + body)
    docs = load()
    validate(docs)
    by = {(d["kind"], d["metadata"]["name"]): d for _, d in docs}
    if by.get(("ConfigMap", "strata-grafana-dashboards")) != dashboards_map():
        fail("grafana-dashboards.yaml differs from deploy/grafana/dashboards: run check.py --write")
    config = by[("ConfigMap", "strata-config")]["data"]
    prefill = by[("StatefulSet", "strata-prefill")]
    decode = by[("StatefulSet", "strata-decode")]
    check_worker(prefill, config, a.strata, a.model_dir)
    df = check_worker(decode, config, a.strata, a.model_dir)
    if df["prefill-worker"] != pod_urls(prefill):
        fail(f"decode --prefill-worker {df['prefill-worker']} are not the prefill pods")
    rc = by[("Deployment", "strata-router")]["spec"]["template"]["spec"]["containers"][0]
    check_flags("strata-router", rc["args"], a.strata)
    rf = flags(rc["args"], config)
    if rf["prefill"] != pod_urls(prefill) or rf["decode"] != pod_urls(decode):
        fail("the router's --prefill/--decode URLs are not the StatefulSets' pods")
    print("worker URLs name the StatefulSets' pods; dashboards ConfigMap up to date")


if __name__ == "__main__":
    main()
