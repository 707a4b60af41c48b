"""The Grafana dashboard (deploy/grafana/grafana-idem.json, installed as
share/idem/grafana-idem.json) queries only metrics the contract names, covers all of them, and
every metric its PromQL references is exposed by a real relay's or consumer's /metrics
(histograms as _bucket, _sum and _count), with the labels it groups by."""

import json
import os
import re
import warnings

from conftest import REPO
from ops_helpers import parse_prometheus, scrape
from ops_helpers import relays  # noqa: F401  (fixture)

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "grafana-idem.json")

# The contract's "Metrics" section.
CONTRACT_METRICS = {
    "idem_relay_published_total", "idem_relay_publish_failures_total", "idem_relay_parked_total",
    "idem_consumer_applied_total", "idem_consumer_duplicates_total",
    "idem_consumer_handler_errors_total", "idem_consumer_dead_lettered_total",
    "idem_reconnects_total", "idem_batch_duration_seconds", "idem_outbox_oldest_pending_seconds",
    "idem_consumer_paused_total", "idem_consumer_lag_seconds", "idem_build_info",
}
HISTOGRAMS = {"idem_batch_duration_seconds", "idem_consumer_lag_seconds"}
# Labels Prometheus adds to every target (not the process's own) and the histogram bucket label.
TARGET_LABELS = {"instance", "job", "le"}

# Contract metrics this build does not expose yet. Delete each name once its metric is
# implemented (the test warns when a listed metric is in fact exposed).
EXPECTED_MISSING_ON_THIS_BUILD = set()


def dashboard_queries():
    """Every PromQL expression of the dashboard: panel targets (rows included) and the
    templating variables' queries."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and q:
            exprs.append(q)
    assert exprs
    return exprs


def base_name(name):
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name


def dashboard_metrics():
    """{metric family: set of labels the dashboard groups or filters by}."""
    out = {}
    for expr in dashboard_queries():
        for name in re.findall(r"\bidem_[a-z0-9_]+\b", expr):
            out.setdefault(base_name(name), set())
        # `sum by (code) (increase(idem_consumer_dead_lettered_total{...}[...]))`
        for labels, name in re.findall(r"\bby \(([^)]*)\)\s*\((?:\w+\()*(idem_[a-z0-9_]+)", expr):
            out[base_name(name)] |= {lb.strip() for lb in labels.split(",")} - TARGET_LABELS
        # label_values(idem_reconnects_total, instance)
        for name, label in re.findall(r"label_values\((idem_[a-z0-9_]+),\s*(\w+)\)", expr):
            out[base_name(name)] |= {label} - TARGET_LABELS
    return out


def test_dashboard_uses_exactly_the_contracts_metrics():
    used = set(dashboard_metrics())
    extra, uncovered = sorted(used - CONTRACT_METRICS), sorted(CONTRACT_METRICS - used)
    assert extra == [], f"dashboard metrics the contract does not name: {extra}"
    assert uncovered == [], f"contract metrics without a dashboard panel: {uncovered}"
    # the outbox age panel shows the alert threshold of the README's IdemOutboxStuck rule
    with open(DASHBOARD) as f:
        panels = json.load(f)["panels"]
    age = [p for p in panels
           if any("idem_outbox_oldest_pending_seconds" in t.get("expr", "")
                  for t in p.get("targets", []))]
    assert age, "no panel for idem_outbox_oldest_pending_seconds"
    steps = age[0]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert 300 in [s["value"] for s in steps]


def exposed(parsed):
    """{family: set of label names seen on its samples} of a parsed scrape; a family with a
    TYPE line but no sample yet (a labelled counter before its first event) has an empty set."""
    out = {name: set() for name in parsed["types"]}
    for (name, labels), _ in parsed["samples"].items():
        out.setdefault(name, set()).update(k for k, _ in labels)
    return out


def test_every_dashboard_metric_is_exposed(db, queue, consumers, relays):
    relay = relays()
    consumer = consumers("billing", queue, db)
    got = {}
    for port in (relay.metrics_port, consumer.metrics_port):
        status, _, text = scrape(port)
        assert status == 200
        for name, labels in exposed(parse_prometheus(text)).items():
            got.setdefault(name, set()).update(labels)

    missing, unlabelled = [], []
    for name, labels in sorted(dashboard_metrics().items()):
        if name in HISTOGRAMS:
            present = all(name + s in got for s in ("_bucket", "_sum", "_count"))
            seen = set().union(*(got.get(name + s, set()) for s in ("_bucket", "_sum", "_count")))
        else:
            present = name in got
            seen = got.get(name, set())
        if name in EXPECTED_MISSING_ON_THIS_BUILD:
            if present:
                warnings.warn(f"{name} is exposed now: remove it from "
                              "EXPECTED_MISSING_ON_THIS_BUILD in test_dashboard_metrics.py")
            continue
        if not present:
            missing.append(name)
        elif seen and not labels <= seen:
            unlabelled.append(f"{name} by {sorted(labels - seen)}")
    assert missing == [], f"dashboard metrics that no relay or consumer exposes: {missing}"
    assert unlabelled == [], f"dashboard groups by labels the metric lacks: {unlabelled}"
