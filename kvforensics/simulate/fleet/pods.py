"""The engine fleet as Kubernetes pods replaced in rollouts, and their logs as responders receive them.

Every instance is a pod of a Deployment rolled with ``maxSurge: 0`` (no spare GPUs): each simulated
start-up is a new pod, the replaced pod gets SIGTERM a few seconds before its successor prints its
first line, and a retired pod's log ends with SGLang's shutdown lines or simply stops (alternating).
The exposed model's pods go to one Grafana Loki export, the others to ``kubectl logs`` files
(:func:`kvforensics.simulate.exports.export_incident` puts them together).

Formats, as documented upstream:

* ``logcli --output=jsonl``: https://github.com/grafana/loki/blob/main/pkg/logcli/output/jsonl.go (one
  Go ``json.Marshal`` of ``{"labels", "line", "timestamp"}`` per entry: keys sorted, ``<``, ``>`` and
  ``&`` escaped, the time in RFC 3339 with nanoseconds, trailing zeros dropped) and
  https://grafana.com/docs/loki/latest/query/logcli/ (``--limit 0``, ``--timezone``, backward by default).
* ``kubectl logs --timestamps``: https://kubernetes.io/docs/reference/kubectl/generated/kubectl_logs/
  (each line prefixed with the kubelet's RFC 3339 time, nine fraction digits, UTC).
* SGLang shutdown lines: ``python/sglang/srt/managers/tokenizer_manager.py`` ``SignalHandler.sigterm_handler``
  and ``sigterm_watchdog`` in https://github.com/sgl-project/sglang.
* Pod names: ``<deployment>-<pod-template-hash>-<5 characters>`` from Kubernetes' safe alphabet
  (``k8s.io/apimachinery/pkg/util/rand`` ``SafeEncodeString``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo

import numpy as np

from kvforensics.simulate.fleet.deployment import Deployment, Startup
from kvforensics.simulate.sources.engine_log import EngineLog, LogLine, envelope
from kvforensics.simulate.traffic import to_ms

#: Kubernetes' alphabet for generated names (no vowels, no 0/1/3 look-alikes).
K8S_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
NAMESPACE = "inference"
#: Seconds between the SIGTERM of a pod a rollout deletes and its successor's first line.
ROLLOUT_GAP_S = (8.0, 20.0)
#: How long before the exposing rollout the exposed model was deployed dark with a safe pool.
DARK_LAUNCH_LEAD = timedelta(days=2)
#: SGLang's SignalHandler.sigterm_handler line (registered with add_signal_handler: no signum, no frame).
SIGTERM_LINE = "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
#: ... and its sigterm_watchdog's line once no request is left, just before the process tree is killed.
EXITING_LINE = "Gracefully exiting... Remaining number of requests 0. Remaining requests remaining_rids=[]."

PodEnd = Literal["shutdown", "log_end", "running"]
Collector = Literal["loki", "kubectl"]


# --- Go / Kubernetes text output ------------------------------------------------------------------


def rfc3339_nano(ns: int, zone: ZoneInfo, fixed: bool) -> str:
    """RFC 3339 with nanoseconds: kubelet's fixed nine digits, or Go's RFC3339Nano (zeros dropped)."""
    local = datetime.fromtimestamp(ns // 1_000_000_000, tz=UTC).astimezone(zone)
    digits = f"{ns % 1_000_000_000:09d}"
    fraction = "." + digits if fixed else ("." + digits.rstrip("0") if digits.strip("0") else "")
    offset = local.strftime("%z")
    zone_text = "Z" if offset == "+0000" else f"{offset[:3]}:{offset[3:]}"
    return f"{local:%Y-%m-%dT%H:%M:%S}{fraction}{zone_text}"


def go_json(value: Any) -> str:
    """``encoding/json.Marshal``: map keys sorted, no spaces, HTML characters and U+2028/9 escaped."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def random_uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def k8s_name(rng: np.random.Generator, n: int) -> str:
    return "".join(K8S_ALPHABET[i] for i in rng.integers(0, len(K8S_ALPHABET), size=n))


# --- The fleet as pods ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """One pod: one start-up of one simulated instance, and its log lines (epoch ns, text)."""

    name: str
    uid: str
    deployment: str
    instance: str  # the simulator's instance slot, e.g. glm53-prefill-0
    generation: int
    startup: Startup
    collector: Collector
    end: PodEnd
    node: str
    lines: tuple[tuple[int, str], ...]
    successor_start: datetime | None  # first line of the pod that replaced it

    @property
    def last_line(self) -> datetime:
        return datetime.fromtimestamp(self.lines[-1][0] / 1e9, tz=UTC)

    @property
    def stopped(self) -> datetime:
        """Where its log says it stopped serving: the SIGTERM line, else its last line."""
        ns = next((ns for ns, text in self.lines if text.endswith(SIGTERM_LINE)), self.lines[-1][0])
        return datetime.fromtimestamp(ns / 1e9, tz=UTC)


def with_dark_launch(dep: Deployment) -> Deployment:
    """The exposed model's instances, first started with a safe pool before the exposing rollout."""
    s = dep.scenario
    dark = []
    for instance in dep.instances("target", "prefill") + dep.instances("target", "decode"):
        first = dep.startups_of(instance)[0]
        pool = s.fixed_pool_tokens if first.role == "prefill" else s.fixed_decode_pool_tokens
        dark.append(
            dataclasses.replace(
                first, ts=first.ts - DARK_LAUNCH_LEAD, pool_tokens=pool, reason="dark launch: safe pool"
            )
        )
    startups = sorted(dep.startups + tuple(dark), key=lambda st: (st.ts, st.instance))
    return dataclasses.replace(dep, startups=tuple(startups))


def deployment_of(instance: str) -> tuple[str, int]:
    """``glm53-prefill-1`` -> (``glm53-prefill``, 1); the unified ``llama33-0`` -> (``llama33``, 0)."""
    name, _, index = instance.rpartition("-")
    return name, int(index)


def shutdown_lines(sigterm_ms: int, last_ms: int, zone: ZoneInfo, rng: np.random.Generator) -> list[LogLine]:
    """What SGLang prints between SIGTERM and exit (tokenizer manager, no rank prefix)."""
    exiting = max(sigterm_ms + int(rng.uniform(500, 5_000)), last_ms + 1)
    return [
        LogLine(sigterm_ms, 0, envelope(sigterm_ms, zone, None, 1) + SIGTERM_LINE),
        LogLine(exiting, 1, envelope(exiting, zone, None, 1) + EXITING_LINE),
    ]


def envelope_times(lines: list[LogLine], rng: np.random.Generator) -> tuple[tuple[int, str], ...]:
    """The container runtime's clock for each line: at or after the line's time, strictly increasing."""
    out: list[tuple[int, str]] = []
    previous = 0
    jitter = rng.integers(20_000, 900_000, size=len(lines))
    for line, j in zip(lines, jitter, strict=True):
        previous = max(previous + 1_000, line.ts_ms * 1_000_000 + int(j))
        out.append((previous, line.text))
    return tuple(out)


def build_pods(dep: Deployment, logs: dict[str, EngineLog], rng: np.random.Generator) -> list[Pod]:
    """Split each instance's log at its start-ups into pods; retired pods end as rollouts end them."""
    zone = ZoneInfo(dep.scenario.engine_timezone)
    hashes: dict[tuple[str, int], str] = {}
    pods: list[Pod] = []
    for instance in sorted(logs):
        deployment, index = deployment_of(instance)
        ups = dep.startups_of(instance)
        starts = [to_ms(st.ts) for st in ups]
        lines = sorted(logs[instance].lines)
        line_ms = np.array([line.ts_ms for line in lines], dtype=np.int64)
        generation_of = np.searchsorted(np.array(starts, dtype=np.int64), line_ms, side="right") - 1
        for k, st in enumerate(ups):
            own = [line for line, g in zip(lines, generation_of, strict=True) if g == k]
            successor = ups[k + 1].ts if k + 1 < len(ups) else None
            end: PodEnd = "running" if successor is None else ("shutdown" if (index + k) % 2 == 0 else "log_end")
            if end == "shutdown" and successor is not None:
                sigterm = to_ms(successor) - int(1000 * rng.uniform(*ROLLOUT_GAP_S))
                own = sorted(own + shutdown_lines(sigterm, own[-1].ts_ms, zone, rng))
            template = hashes.setdefault((deployment, k), k8s_name(rng, 10))
            pods.append(
                Pod(
                    name=f"{deployment}-{template}-{k8s_name(rng, 5)}",
                    uid=random_uuid(rng),
                    deployment=deployment,
                    instance=instance,
                    generation=k,
                    startup=st,
                    collector="loki" if st.model == "target" else "kubectl",
                    end=end,
                    node=f"gpu-node-{int(rng.integers(1, 64)):02d}",
                    lines=envelope_times(own, rng),
                    successor_start=successor,
                )
            )
    return pods


def loki_labels(pod: Pod) -> dict[str, str]:
    """Labels of the Promtail / Grafana Alloy Kubernetes pod discovery defaults."""
    return {
        "app": pod.deployment,
        "container": "sglang",
        "filename": f"/var/log/pods/{NAMESPACE}_{pod.name}_{pod.uid}/sglang/0.log",
        "job": f"{NAMESPACE}/{pod.deployment}",
        "namespace": NAMESPACE,
        "node_name": pod.node,
        "pod": pod.name,
        "stream": "stderr",
    }


def write_loki_export(pods: list[Pod], path: Path, zone: ZoneInfo) -> Path:
    """One ``logcli query --output=jsonl --limit 0`` export: every pod's lines, newest first."""
    entries = [(ns, pod, text) for pod in pods for ns, text in pod.lines]
    entries.sort(key=lambda e: e[0], reverse=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = {pod.name: loki_labels(pod) for pod in pods}
    with path.open("w", encoding="utf-8") as fh:
        for ns, pod, text in entries:
            fh.write(go_json({"labels": labels[pod.name], "line": text, "timestamp": rfc3339_nano(ns, zone, False)}))
            fh.write("\n")
    return path


def write_kubectl_logs(pods: list[Pod], out_dir: Path) -> list[Path]:
    """``kubectl logs --timestamps <pod> > <pod>.log`` for each pod."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for pod in pods:
        path = out_dir / f"{pod.name}.log"
        utc = ZoneInfo("UTC")
        path.write_text("".join(f"{rfc3339_nano(ns, utc, True)} {text}\n" for ns, text in pod.lines), encoding="utf-8")
        paths.append(path)
    return paths
