"""A vLLM 0.33 incident with a salt-blind LMCache store, written from the engines' documented behaviour.

This generator is the judge of the toolkit's ``prefix_reuse`` mechanism on vLLM, so it is written only
from ``/work/shared/reference/kv-cache-isolation.md`` (cited as "ref §n"),
``/work/shared/reference/engine-log-formats.md`` section 2 (vLLM lines, "logs §2.x") and the upstream
vLLM / LMCache sources named in ``README.md``; it imports nothing from ``kvforensics``.
``generate(out_dir, seed=33, requests=20_000)`` writes one incident folder::

    incident.toml                    the toolkit's incident file (sources, [scope], [prefix_cache])
    gateway/requests-<day>.jsonl.gz  OpenAI-style records, cache_salt set per tenant by the gateway
    engines/<instance>/vllm.log.gz   vLLM 0.33 logs: three start-ups per instance, access and stats lines
    kv-events/<instance>.jsonl.gz    a ZMQ subscriber's archive of the KVEventBatch messages (map layout)
    content/prompts.jsonl.gz         only with ``with_content=True``: request_id, prompt_token_ids
    truth.json                       the ground truth defined below

Deployment: one model (``Qwen/Qwen3-32B`` served as ``qwen3-32b``) on four vLLM V1 instances
``vllm-0`` .. ``vllm-3`` (TP 2, block size 16, ``enable_prefix_caching=True``,
``--enable-prompt-tokens-details``, ``--kv-events-config`` with a ZMQ publisher). Start-up 0 has no KV
connector; a rolling restart on day 2 adds ``--kv-transfer-config
'{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'`` one instance at a time (LMCache with a
shared remote store, ``chunk_size`` 256, no local CPU tier), a second on day 5 removes it. The LMCache
store is external: it survives restarts, is shared by the instances whose current start-up has the
connector, and keys chunks by their tokens only, the cache salt dropped (ref §3, LMCache/LMCache#2878).

Engine model per instance: vLLM's GPU prefix cache, LRU, keyed by the salted block-hash chain (the salt
in the first block's ``extra_keys``, ref §1), so in-process hits never cross salts. A request's lookup:
the longest chain of its full prompt blocks cached locally (never the last prompt token), then, with
the connector, LMCache's lookup of its 256-token chunks from the start (prefix chain, tokens only);
the tokens LMCache holds beyond the local hit are loaded into newly allocated GPU blocks. vLLM caches
every full prompt block of the step, loaded or computed alike, as **one** ``BlockStored`` (medium
``GPU``, the requester's salted chain): a load from LMCache publishes no event of its own. LMCache's
save of the chunks beyond its lookup hit publishes, through the connector, one ``BlockStored`` per
chunk (medium ``cpu``, block size 256, its token-only chain, no ``extra_keys``). Evictions publish one
``BlockRemoved`` per block; a restart empties the GPU cache and restarts the sequence at 0.
``cached_tokens`` = local hit + external tokens (vLLM's ``num_cached_tokens``).

Ground truth (``truth.json``):

* A **store load** (key ``l3`` kept for the HiCache judge's scorer) is a 256-token chunk a request's
  lookup took from the LMCache store: its instance's current start-up had the connector, the chunk is
  within LMCache's prefix hit, and it ends beyond the request's local hit (part or all of its tokens
  were loaded into the request's blocks).
* A chunk's **owner** is the request whose save first wrote it to the store (a later put of an
  existing key keeps the stored object), and that request's account and salt.
* A load is **foreign** when the owner's salt differs from the requester's and the owner is neither an
  internal account nor in a shared namespace (ref §3).
* ``affected_requests``: gateway requests with at least one foreign store load, whatever the status
  (``affected_undelivered``: those with status 499). ``recipients``, ``source_accounts``, ``sources``
  (per request: each foreign chunk, its block positions, owner, writing instance and time, and
  ``requester_stored_same_tokens_before``).
* Not affected, listed to score false positives: ``same_tenant_l3_loads`` (own chunks, e.g. a chat
  continued on another instance), ``shared_namespace_l3_loads`` (chunks the playground wrote),
  ``secondary_requests`` (local hits, in the requester's namespace, of blocks an earlier foreign load
  brought in), ``same_namespace_public_hits`` (a count).
* ``exposure_windows``: per instance, the start-up with the connector, from its first log line
  (``start``) to the first line of the start-up that removed it (``end``); ``process_end`` is its
  ``Shutting down FastAPI HTTP server.`` line.
* ``prober``, ``lookalikes``, ``seq_gaps`` (lost messages, all outside the exposure windows),
  ``deployment``, ``counts``.

Run ``python tests/vllm_reference/generate.py OUT --seed 33 --requests 20000``.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import heapq
import hmac
import io
import json
import math
import random
import sys
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BLOCK = 16  # vLLM's default --block-size on CUDA
CHUNK = 256  # LMCache chunk_size (its default)
VLLM_VERSION = "0.33.0"
MODEL_PATH = "Qwen/Qwen3-32B"
MODEL = "qwen3-32b"  # --served-model-name = the gateway's model id
INSTANCES = ("vllm-0", "vllm-1", "vllm-2", "vllm-3")
TP_SIZE = 2
MAX_MODEL_LEN = 40_960
KV_POOL_TOKENS = 262_144  # GPU KV cache per instance at the default size
MIN_POOL_TOKENS = 81_920  # smaller incidents get a smaller pool, never below 2 x max_model_len
T0 = datetime(2026, 10, 5, tzinfo=UTC)
YEAR = T0.year
DAYS = 6
SHARED_NAMESPACE = "playground"
INTERNAL_PATTERN = "playground-*"
GATEWAY_SALT_KEY = b"gw-cache-salt-2026-q4"
CONNECTOR = "LMCacheConnectorV1"
LMCACHE_MEDIUM = "cpu"  # LMCacheEngine.store's CacheStoreEvent medium
KV_SPEC_KIND = "full_attention"
NONE_HASH_SEED = b"vllm-none-hash/PYTHONHASHSEED=0"  # stand-in for NONE_HASH under a fixed PYTHONHASHSEED

# Qwen chat template token ids
IM_START, IM_END, NL = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091

PUBLIC_TEXT_KINDS = ("public_doc", "template", "playground_copy")
DEFAULT_SEED = 33
DEFAULT_REQUESTS = 20_000
DEFAULT_STEP_S = 0.05

T0_S = T0.timestamp()
END_S = T0_S + DAYS * 86400
LITTLE_ENDIAN = sys.byteorder == "little"


def iso(t: float) -> str:
    dt = datetime.fromtimestamp(t, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def iso_us(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def vllm_stamp(t: float) -> str:
    """vLLM's datefmt ``%m-%d %H:%M:%S``: no year, no zone (logs §2.1); the hosts run on UTC."""
    return datetime.fromtimestamp(t, UTC).strftime("%m-%d %H:%M:%S")


def vline(t: float, proc: str, level: str, fileinfo: str, msg: str) -> str:
    """0.33's envelope: ``(name pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message`` (logs §2.1)."""
    return f"({proc}) {level} {vllm_stamp(t)} [{fileinfo}] {msg}"


def sub_seed(seed: int, *labels: object) -> int:
    text = "/".join([str(seed), *map(str, labels)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def token_run(seed: int, *labels: object, n: int) -> array:
    rng = random.Random(sub_seed(seed, *labels))
    return array("I", array("H", rng.randbytes(2 * n)))


def span_bytes(tokens: array, start: int, end: int) -> bytes:
    chunk = tokens[start:end]
    if not LITTLE_ENDIAN:
        chunk.byteswap()
    return chunk.tobytes()


def low64(digest: bytes) -> int:
    """The low 64 bits of a hash as an unsigned int (events' int block hashes, ref §1)."""
    return int.from_bytes(digest[-8:], "big")


NONE_HASH = hashlib.sha256(NONE_HASH_SEED).digest()


def block_hashes(tokens: array, n_blocks: int, salt: str | None) -> list[int]:
    """vLLM's chained block hashes, salt in the first block's extra keys (stand-in for its CBOR SHA-256)."""
    out: list[int] = []
    prior = NONE_HASH
    for b in range(n_blocks):
        extra = salt.encode() if (b == 0 and salt is not None) else b""
        prior = hashlib.sha256(prior + span_bytes(tokens, b * BLOCK, (b + 1) * BLOCK) + b"|" + extra).digest()
        out.append(low64(prior))
    return out


def chunk_keys(tokens: array, n_chunks: int) -> list[int]:
    """LMCache's prefix-chained chunk hashes over the tokens only (the salt dropped, LMCache#2878)."""
    out: list[int] = []
    prior = b"lmcache-chunk-v1"
    for c in range(n_chunks):
        prior = hashlib.sha256(prior + span_bytes(tokens, c * CHUNK, (c + 1) * CHUNK)).digest()
        out.append(low64(prior))
    return out


def gateway_salt(account: str) -> str:
    """The gateway's per-tenant cache_salt: a keyed hash of the tenant id (ref §3)."""
    if is_internal(account):
        return SHARED_NAMESPACE
    return "cs-" + hmac.new(GATEWAY_SALT_KEY, account.encode(), hashlib.sha256).hexdigest()[:24]


def is_internal(account: str) -> bool:
    return fnmatch.fnmatchcase(account, INTERNAL_PATTERN)


def system_block(text: array) -> array:
    return array("I", [IM_START, SYSTEM, NL]) + text + array("I", [IM_END, NL])


def user_block(text: array) -> array:
    return array("I", [IM_START, USER, NL]) + text + array("I", [IM_END, NL])


ASSISTANT_HEADER = array("I", [IM_START, ASSISTANT, NL])
TURN_END = array("I", [IM_END, NL])


# --------------------------------------------------------------------------------------------
# Deployment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Startup:
    instance: str
    index: int
    start: float  # the "vLLM server version" line
    ready: float  # "Application startup complete."
    drain: float | None  # the gateway stops routing here
    shutdown: float | None  # "Shutting down FastAPI HTTP server."
    connector: str | None
    engine_pid: int
    worker_pids: tuple[int, ...]
    ip: str
    engine_id: str


def pool_tokens_for(requests: int) -> int:
    tokens = int(KV_POOL_TOKENS * min(1.0, requests / DEFAULT_REQUESTS))
    return max(MIN_POOL_TOKENS, tokens // BLOCK * BLOCK)


@dataclass(frozen=True)
class Deployment:
    pool_tokens: int
    startups: dict[str, list[Startup]]
    seq_gaps: list[tuple[str, float, int]]

    def serving(self, instance: str, t: float) -> bool:
        for s in self.startups[instance]:
            stop = s.drain if s.drain is not None else math.inf
            if s.ready <= t < stop:
                return True
        return False

    def up_instances(self, t: float) -> list[str]:
        return [i for i in INSTANCES if self.serving(i, t)]


def plan_deployment(seed: int, pool_tokens: int) -> Deployment:
    rng = random.Random(sub_seed(seed, "deployment"))
    first = T0_S - 3600 + rng.uniform(0, 600)
    add_store = T0_S + 86400 + 10 * 3600 + rng.uniform(0, 1800)  # day 2 ~10:00
    drop_store = T0_S + 4 * 86400 + 16 * 3600 + rng.uniform(0, 1800)  # day 5 ~16:00
    startups: dict[str, list[Startup]] = {}
    for k, inst in enumerate(INSTANCES):
        rows: list[Startup] = []
        starts = [(first + k * 150, None), (add_store + k * 480 + 90, CONNECTOR), (drop_store + k * 480 + 90, None)]
        for n, (start, conn) in enumerate(starts):
            ready = start + 150 + rng.uniform(0, 60)
            if n + 1 < len(starts):
                drain = starts[n + 1][0] - 90
                shutdown = drain + 60
            else:
                drain = shutdown = None
            rows.append(
                Startup(
                    inst,
                    n,
                    start,
                    ready,
                    drain,
                    shutdown,
                    conn,
                    engine_pid=rng.randrange(150, 400),
                    worker_pids=(rng.randrange(400, 700), rng.randrange(700, 900)),
                    ip=f"10.44.{rng.randrange(1, 9)}.{rng.randrange(10, 250)}",
                    engine_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                )
            )
        startups[inst] = rows
    gaps = [
        ("vllm-2", T0_S + 15 * 3600 + rng.uniform(0, 3600), 3),  # day 1, no connector anywhere yet
        ("vllm-3", T0_S + 20 * 3600 + rng.uniform(0, 3600), 1),
        ("vllm-0", T0_S + 5 * 86400 + 8 * 3600 + rng.uniform(0, 3600), 9),  # day 6, connector removed
    ]
    return Deployment(pool_tokens, startups, gaps)


# --------------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------------


@dataclass
class Account:
    name: str
    salt: str
    role: str
    weight: float = 1.0
    system: array | None = None
    doc_first: bool = True
    private_docs: list[array] = field(default_factory=list)
    kinds: tuple[float, float, float, float] = (0.45, 0.25, 0.15, 0.15)
    retry_p: float = 0.01
    stickiness: float = 0.7

    @property
    def internal(self) -> bool:
        return is_internal(self.name)


@dataclass
class Req:
    idx: int
    rid: str
    t: float
    account: Account
    kind: str
    pieces: list[Any]
    max_tokens: int
    completion: int
    status: int = 200
    session: str = ""
    gateway: bool = True
    client_timeout_s: float = 0.0
    too_long: int = 0  # prompt length of an over-long paste the frontend rejects (400)
    pin: str = ""  # the gateway sends it to this instance (the playground's warm-up after a start-up)
    instance: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    local_blocks: int = 0
    external_tokens: int = 0
    l3_chunks: list[int] = field(default_factory=list)
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    served: bool = False
    output: array | None = None
    l3_owners: list[tuple[int, Req, float, str]] = field(default_factory=list)  # (chunk, owner, written, by)
    l3_known: set[int] = field(default_factory=set)
    secondary_from: set[str] = field(default_factory=set)
    public_same_namespace: bool = False


class Planner:
    """Accounts and their requests, as the gateway received them (ref §3-4)."""

    def __init__(self, seed: int, n_requests: int, deployment: Deployment) -> None:
        self.seed = seed
        self.n = n_requests
        self.dep = deployment
        self.rng = random.Random(sub_seed(seed, "traffic"))
        self.reqs: list[Req] = []
        self.public_docs = [token_run(seed, "public-doc", i, n=self.rng.randrange(900, 5000)) for i in range(12)]
        self.public_doc_weights = [1 / (i + 1) ** 0.9 for i in range(12)]
        self.templates = [token_run(seed, "template", i, n=self.rng.randrange(600, 2500)) for i in range(5)]
        self.playground_prompt = token_run(seed, "playground-system", n=760)
        self.accounts: list[Account] = []
        self.special: dict[str, Any] = {}
        self._ids: set[str] = set()

    def account_name(self) -> str:
        while True:
            name = "acct-" + "".join(self.rng.choice("0123456789abcdef") for _ in range(6))
            if name not in self._ids:
                self._ids.add(name)
                return name

    def rid(self) -> str:
        return "chatcmpl-" + "".join(self.rng.choice("0123456789abcdef") for _ in range(32))

    def text(self, *labels: object, n: int) -> array:
        return token_run(self.seed, *labels, n=n)

    def day_time(self, start: float = T0_S, end: float = END_S) -> float:
        while True:
            t = self.rng.uniform(start, end)
            h = (t - T0_S) / 3600 % 24
            if self.rng.random() < 0.25 + 0.75 * math.exp(-(((h - 15) / 5.5) ** 2)):
                return t

    def add(self, t: float, acct: Account, kind: str, pieces: list[Any], max_tokens: int, completion: int,
            session: str, **kw: Any) -> Req:  # fmt: skip
        r = Req(len(self.reqs), self.rid(), t, acct, kind, pieces, max_tokens, min(completion, max_tokens),
                session=session, **kw)  # fmt: skip
        self.reqs.append(r)
        return r

    def send(self, t: float, acct: Account, kind: str, pieces: list[Any], max_tokens: int, completion: int,
             session: str) -> Req:  # fmt: skip
        """One turn as the client sends it, with duplicate sends and retries after a timeout (ref §4)."""
        if self.rng.random() < acct.retry_p:
            if self.rng.random() < 0.7:
                self.add(t, acct, kind, pieces, max_tokens, completion, session)
                return self.add(t + self.rng.uniform(0.05, 3.0), acct, kind, pieces, max_tokens, completion, session)
            timeout = self.rng.choice([10.0, 20.0, 30.0])
            self.add(t, acct, kind, pieces, max_tokens, completion, session, status=499, client_timeout_s=timeout)
            return self.add(t + timeout + self.rng.uniform(0.5, 5), acct, kind, pieces, max_tokens, completion, session)
        return self.add(t, acct, kind, pieces, max_tokens, completion, session)

    def answer_len(self) -> int:
        return int(min(1500, self.rng.lognormvariate(5.0, 0.8)))

    def make_accounts(self) -> None:
        rng = self.rng
        for _ in range(120):
            name = self.account_name()
            has_sys = rng.random() < 0.8
            acct = Account(
                name,
                gateway_salt(name),
                "customer",
                weight=rng.paretovariate(1.2),
                system=self.text("system", name, n=rng.randrange(120, 1500)) if has_sys else None,
                doc_first=rng.random() < 0.6,
                private_docs=[
                    self.text("private", name, i, n=rng.randrange(1500, 7000)) for i in range(rng.randrange(0, 4))
                ],
                kinds=(rng.uniform(0.3, 0.6), rng.uniform(0.05, 0.4), rng.uniform(0.0, 0.25), rng.uniform(0.05, 0.3)),
                stickiness=rng.uniform(0.4, 0.9),
            )
            self.accounts.append(acct)
        for acct in rng.sample(self.accounts, 3):
            acct.retry_p = 0.2
        self.special["retries"] = sorted(a.name for a in self.accounts if a.retry_p > 0.1)
        copy = rng.sample([a for a in self.accounts if a.retry_p < 0.1], 4)
        self.special["playground_copies"] = sorted(a.name for a in copy)
        for name in ("playground-web", "playground-api"):
            self._ids.add(name)
            self.accounts.append(Account(name, gateway_salt(name), "playground"))
        for role in ("harness_mc", "harness_gen", "keepalive", "autocomplete", "autocomplete", "prober", "victim"):
            name = self.account_name()
            self.accounts.append(Account(name, gateway_salt(name), role, stickiness=0.5))

    def by_role(self, role: str) -> list[Account]:
        return [a for a in self.accounts if a.role == role]

    def plan(self) -> list[Req]:
        self.make_accounts()
        n = self.n
        self.plan_keepalive()
        self.plan_playground_warmup()
        self.plan_playground(self.by_role("playground"), int(0.025 * n), "playground")
        copies = set(self.special["playground_copies"])
        self.plan_playground([a for a in self.accounts if a.name in copies], int(0.008 * n), "playground_copy")
        self.plan_harness(int(0.04 * n), int(0.03 * n))
        self.plan_autocomplete(int(0.06 * n))
        self.plan_victim()
        self.plan_prober_cover()
        self.plan_too_long(max(6, int(0.003 * n)))
        self.plan_customers(n - len(self.reqs))
        self.reqs.sort(key=lambda r: (r.t, r.idx))
        for i, r in enumerate(self.reqs):
            r.idx = i
        return self.reqs

    def plan_keepalive(self) -> None:
        acct = self.by_role("keepalive")[0]
        period = 60.0 * 60_000 / self.n  # every minute at 60,000 requests
        prompt = [system_block(self.text("keepalive", n=170)), user_block(self.text("ping", n=3)), ASSISTANT_HEADER]
        t = T0_S + self.rng.uniform(0, period)
        self.special["keep_alive"] = {"account": acct.name, "period_s": period}
        while t < END_S:
            self.add(t + self.rng.uniform(-0.2, 0.2), acct, "keepalive", prompt, 1, 1, "keepalive")
            t += period

    def chat_session(self, acct: Account, t: float, kind: str, head: list[Any], first_user: array, turns: int,
                     think: tuple[float, float], label: str) -> float:  # fmt: skip
        pieces = list(head) + [user_block(first_user), ASSISTANT_HEADER]
        session = f"{acct.name}/{label}/{self.rng.randrange(1 << 30)}"
        for turn in range(turns):
            if t >= END_S:
                break
            r = self.send(t, acct, kind, list(pieces), 4096, self.answer_len(), session)
            pieces = pieces + [("out", r), TURN_END]
            pieces += [user_block(self.text("msg", session, turn, n=self.rng.randrange(15, 300))), ASSISTANT_HEADER]
            t += self.rng.uniform(*think)
        return t

    def plan_playground_warmup(self) -> None:
        """The playground warms each instance once it is up: one request with its prompt, pinned there."""
        acct = self.by_role("playground")[0]
        head = [system_block(self.playground_prompt)]
        for inst, rows in self.dep.startups.items():
            for s in rows:
                t = s.ready + self.rng.uniform(5, 30)
                pieces = head + [user_block(self.text("warmup", n=12)), ASSISTANT_HEADER]
                self.add(t, acct, "playground", pieces, 16, 16, f"warmup/{inst}/{s.index}", pin=inst)

    def plan_playground(self, accts: list[Account], budget: int, kind: str) -> None:
        start = len(self.reqs)
        head = [system_block(self.playground_prompt)]
        while len(self.reqs) - start < budget:
            acct = self.rng.choice(accts)
            msg = self.text(kind, len(self.reqs), n=self.rng.randrange(10, 400))
            self.chat_session(acct, self.day_time(), kind, head, msg, self.rng.randrange(1, 4), (20, 200), kind)

    def plan_harness(self, n_mc: int, n_gen: int) -> None:
        mc, gen = self.by_role("harness_mc")[0], self.by_role("harness_gen")[0]
        mc_head = [system_block(self.text("harness-mc-template", n=1800))]
        gen_head = [system_block(self.text("harness-gen-template", n=900))]
        runs = [
            (mc, mc_head, n_mc // 2, T0_S + 13 * 3600, 1, (1, 1), 4.0),
            (mc, mc_head, n_mc - n_mc // 2, T0_S + 2 * 86400 + 15 * 3600, 1, (1, 1), 4.0),
            (gen, gen_head, n_gen // 2, T0_S + 3 * 86400 + 9 * 3600, 48, (3, 48), 2.0),
            (gen, gen_head, n_gen - n_gen // 2, T0_S + 5 * 86400 + 20 * 3600, 48, (3, 48), 2.0),
        ]
        for acct, head, count, t, max_tokens, (lo, hi), rate in runs:
            t += self.rng.uniform(0, 1800)
            for item in range(count):
                q = self.text("item", acct.name, t, item, n=self.rng.randrange(40, 320))
                pieces = head + [user_block(q + self.text("answer-cue", n=4)), ASSISTANT_HEADER]
                self.add(t, acct, acct.role, pieces, max_tokens, self.rng.randint(lo, hi), f"{acct.name}/run")
                t += self.rng.expovariate(rate)
        self.special["harness"] = sorted([mc.name, gen.name])

    def plan_autocomplete(self, budget: int) -> None:
        accts = self.by_role("autocomplete")
        start = len(self.reqs)
        heads = {a.name: [system_block(self.text("ide", a.name, n=400))] for a in accts}
        while len(self.reqs) - start < budget:
            acct = self.rng.choice(accts)
            t = self.day_time()
            ctx = self.text("file", acct.name, t, n=self.rng.randrange(300, 3500))
            session = f"{acct.name}/ac/{self.rng.randrange(1 << 30)}"
            for k in range(self.rng.randrange(20, 150)):
                if t >= END_S:
                    break
                ctx = ctx + self.text("typed", session, k, n=self.rng.randrange(3, 40))
                pieces = heads[acct.name] + [user_block(ctx), ASSISTANT_HEADER]
                self.add(t, acct, "autocomplete", pieces, 32, self.rng.randint(4, 32), session)
                t += self.rng.uniform(0.3, 4.0)

    def plan_victim(self) -> None:
        """The prober's target: a private document that opens with its firm's public letterhead (one chunk)."""
        victim = self.by_role("victim")[0]
        letterhead = self.text("victim-letterhead", n=CHUNK - 3)  # with the user header: exactly chunk 0
        secret = self.text("victim-secret", n=2900)
        doc = letterhead + secret
        victim.private_docs = [doc]
        self.special["victim_doc"] = doc
        times = [
            T0_S + 14 * 3600,
            T0_S + 86400 + 16 * 3600,
            T0_S + 86400 + 19 * 3600,
            T0_S + 2 * 86400 + 9 * 3600,
            T0_S + 2 * 86400 + 14 * 3600,
            T0_S + 3 * 86400 + 11 * 3600,
            T0_S + 4 * 86400 + 10 * 3600,
        ]
        for t in times:
            t += self.rng.uniform(0, 1800)
            q = self.text("victim-q", t, n=self.rng.randrange(20, 80))
            self.chat_session(victim, t, "private_doc", [], doc + q, self.rng.randrange(2, 4), (60, 400), "vdoc")

    def plan_prober_cover(self) -> None:
        prober = self.by_role("prober")[0]
        prober.system = self.text("system", prober.name, n=300)
        for _ in range(8):
            t = self.rng.uniform(T0_S + 2 * 86400, T0_S + 4 * 86400)
            head = [system_block(prober.system)]
            self.chat_session(
                prober, t, "chat", head, self.text("pmsg", t, n=120), self.rng.randrange(1, 3), (30, 90), "cover"
            )

    def plan_too_long(self, count: int) -> None:
        """Pastes longer than max_model_len: the frontend rejects them with a 400 (logs §2.4)."""
        custs = [a for a in self.accounts if a.role == "customer"]
        for _ in range(count):
            acct = self.rng.choice(custs)
            n = self.rng.randrange(MAX_MODEL_LEN + 200, MAX_MODEL_LEN + 24_000)
            pieces = [user_block(self.text("huge", acct.name, len(self.reqs), n=n - 5)), ASSISTANT_HEADER]
            self.add(self.day_time(), acct, "too_long", pieces, 1024, 0, "too-long", status=400, too_long=n)

    def plan_customers(self, budget: int) -> None:
        custs = [a for a in self.accounts if a.role == "customer"]
        weights = [a.weight for a in custs]
        start = len(self.reqs)
        while len(self.reqs) - start < budget:
            acct = self.rng.choices(custs, weights)[0]
            kind = self.rng.choices(("chat", "public_doc", "template", "private_doc"), acct.kinds)[0]
            if kind == "private_doc" and not acct.private_docs:
                kind = "chat"
            t = self.day_time()
            own_head: list[Any] = [system_block(acct.system)] if acct.system else []
            if kind == "chat":
                msg = self.text("msg0", acct.name, t, n=self.rng.randrange(15, 400))
                self.chat_session(acct, t, "chat", own_head, msg, self.rng.randrange(1, 9), (15, 400), "chat")
            elif kind == "public_doc":
                doc = self.rng.choices(self.public_docs, self.public_doc_weights)[0]
                q = self.text("pq", acct.name, t, n=self.rng.randrange(10, 120))
                head = [] if acct.doc_first else own_head
                self.chat_session(acct, t, "public_doc", head, doc + q, self.rng.randrange(1, 5), (30, 600), "pdoc")
            elif kind == "template":
                tpl = self.rng.choice(self.templates)
                task = self.text("task", acct.name, t, n=self.rng.randrange(30, 500))
                self.chat_session(
                    acct, t, "template", [system_block(tpl)], task, self.rng.randrange(1, 4), (5, 60), "tpl"
                )
            else:
                doc = self.rng.choice(acct.private_docs)
                q = self.text("dq", acct.name, t, n=self.rng.randrange(10, 120))
                head = [] if acct.doc_first else own_head
                self.chat_session(acct, t, "private_doc", head, doc + q, self.rng.randrange(1, 6), (30, 900), "doc")


# --------------------------------------------------------------------------------------------
# Engine logs
# --------------------------------------------------------------------------------------------


def kv_events_config_repr() -> str:
    return (
        "KVEventsConfig(enable_kv_cache_events=True, publisher='zmq', endpoint='tcp://*:5557', "
        "replay_endpoint=None, buffer_steps=10000, hwm=100000, max_queue_size=100000, topic='kv-events')"
    )


def kv_transfer_config_repr(s: Startup) -> str:
    return (
        f"KVTransferConfig(kv_connector='{CONNECTOR}', engine_id='{s.engine_id}', kv_buffer_device='cuda', "
        "kv_buffer_size=1000000000.0, kv_role='kv_both', kv_rank=None, kv_parallel_size=1, "
        "kv_ip='127.0.0.1', kv_port=14579, kv_connector_extra_config={}, kv_connector_module_path=None)"
    )


def startup_lines(s: Startup, pool: int) -> list[tuple[float, str]]:
    """One start-up as vLLM 0.33 logs it (logs §2.1-2.3), the connector lines when it has one."""
    api = "APIServer pid=1"
    core = f"EngineCore pid={s.engine_pid}"
    workers = [f"Worker_TP{r} pid={p}" for r, p in enumerate(s.worker_pids)]
    span = s.ready - s.start
    args = [
        f"'model_tag': '{MODEL_PATH}'",
        "'host': '0.0.0.0'",
        "'enable_prompt_tokens_details': True",
        f"'model': '{MODEL_PATH}'",
        f"'served_model_name': ['{MODEL}']",
        f"'max_model_len': {MAX_MODEL_LEN}",
        f"'tensor_parallel_size': {TP_SIZE}",
        "'gpu_memory_utilization': 0.92",
        "'enable_prefix_caching': True",
        f"'kv_events_config': {kv_events_config_repr()}",
    ]
    if s.connector:
        args.append(f"'kv_transfer_config': {kv_transfer_config_repr(s)}")
    config = (
        f"model='{MODEL_PATH}', speculative_config=None, tokenizer='{MODEL_PATH}', skip_tokenizer_init=False, "
        f"tokenizer_mode=auto, revision=None, trust_remote_code=False, dtype=torch.bfloat16, "
        f"max_seq_len={MAX_MODEL_LEN}, download_dir=None, load_format=auto, tensor_parallel_size={TP_SIZE}, "
        "pipeline_parallel_size=1, data_parallel_size=1, disable_custom_all_reduce=False, quantization=None, "
        "enforce_eager=False, kv_cache_dtype=auto, device_config=cuda, seed=0, "
        f"served_model_name={MODEL}, enable_prefix_caching=True, enable_chunked_prefill=True"
    )
    kv_gib = pool * 64 * 8 // TP_SIZE * 128 * 2 * 2 / 2**30  # 64 layers, 8 KV heads over TP, K and V, bf16
    conc = pool / MAX_MODEL_LEN
    out: list[tuple[float, str]] = [
        (s.start, vline(s.start, api, "INFO", "startup.py:80", f"vLLM server version {VLLM_VERSION}, serving model {MODEL_PATH}")),
        (s.start, vline(s.start, api, "INFO", "startup.py:81", "non-default args: {" + ", ".join(args) + "}")),
        (s.start + 6, vline(s.start + 6, api, "INFO", "model.py:547", "Resolved architecture: Qwen3ForCausalLM")),
        (s.start + 6, vline(s.start + 6, api, "INFO", "model.py:1510", f"Using max model len {MAX_MODEL_LEN}")),
        (s.start + 14, vline(s.start + 14, core, "INFO", "core.py:101", f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: {config}")),
    ]  # fmt: skip
    tw = s.start + 0.2 * span
    if s.connector:
        for w in workers:
            msg = f"Creating v1 connector with name: {CONNECTOR} and engine_id: {s.engine_id}"
            out.append((tw, vline(tw, w, "INFO", "factory.py:62", msg)))
            out.append((tw, vline(tw, w, "WARNING", "base.py:203", "Initializing KVConnectorBase_V1. This API is experimental and subject to change in the future as we iterate the design.")))  # fmt: skip
            out.append((tw, vline(tw, w, "INFO", "lmcache_connector.py:96", "Initializing latest dev LMCache connector")))  # fmt: skip
    tl = s.start + 0.6 * span
    for w in workers:
        out.append((tl, vline(tl, w, "INFO", "gpu_model_runner.py:3012", f"Model loading took 30.62 GiB memory and {0.45 * span:.6f} seconds")))  # fmt: skip
        out.append((tl + 4, vline(tl + 4, w, "INFO", "gpu_worker.py:412", f"Available KV cache memory: {kv_gib:.2f} GiB")))  # fmt: skip
    tk = tl + 5
    size = f"GPU KV cache size: {int(conc * MAX_MODEL_LEN):,} tokens, Maximum concurrency for {MAX_MODEL_LEN:,} tokens per request: {conc:.2f}x"  # fmt: skip
    out.append((tk, vline(tk, core, "INFO", "kv_cache_utils.py:1310", size)))
    if s.connector:
        msg = f"Creating v1 connector with name: {CONNECTOR} and engine_id: {s.engine_id}"
        out.append((tk + 1, vline(tk + 1, core, "INFO", "factory.py:62", msg)))
    ti = s.ready - 3
    out.append((ti, vline(ti, core, "INFO", "core.py:250", f"init engine (profile, create kv cache, warmup model) took {0.35 * span:.2f} seconds")))  # fmt: skip
    out.append((s.ready - 1, vline(s.ready - 1, api, "INFO", "api_server.py:640", "Starting vLLM server on http://0.0.0.0:8000")))  # fmt: skip
    for text in ("Started server process [1]", "Waiting for application startup.", "Application startup complete."):
        out.append((s.ready, f"({api}) INFO:     {text}"))
    if s.shutdown is not None:
        t = s.shutdown
        out.append((t, vline(t, api, "INFO", "launcher.py:110", "Shutting down FastAPI HTTP server.")))
        for k, text in enumerate(
            ("Shutting down", "Waiting for application shutdown.", "Application shutdown complete.")
        ):
            out.append((t + 0.1 * (k + 1), f"({api}) INFO:     {text}"))
    return out


# --------------------------------------------------------------------------------------------
# KV events
# --------------------------------------------------------------------------------------------


class KvArchive:
    """A ZMQ subscriber's archive: one JSON object per message, the batch a map (vllm#42892, ref §1)."""

    def __init__(self, path: Path, instance: str, gaps: list[tuple[float, int]], rng: random.Random,
                 step_s: float) -> None:  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        self.raw = path.open("wb")
        self.gz = gzip.GzipFile(filename="", mode="wb", fileobj=self.raw, mtime=0, compresslevel=6)
        self.text = io.TextIOWrapper(self.gz, encoding="utf-8", newline="\n")
        self.instance = instance
        self.seq = 0
        self.endpoint = ""
        self.gaps = sorted(gaps)
        self.rng = rng
        self.lost: list[dict[str, Any]] = []
        self._gap_left = 0
        self._gap_row: dict[str, Any] | None = None
        self.step_s = step_s
        self._pending: list[Any] = []
        self._pending_from = 0.0
        self._pending_ts = 0.0

    def restart(self, s: Startup) -> None:
        self.flush()
        self.seq = 0  # _seq_gen = count() in ZmqEventPublisher.__init__
        self.endpoint = f"tcp://{s.ip}:5557"

    def publish(self, ts: float, events: list[Any]) -> None:
        if not events:
            return
        if self._pending and ts - self._pending_from >= self.step_s:
            self.flush()
        if not self._pending:
            self._pending_from = ts
        self._pending.extend(events)
        self._pending_ts = ts

    def flush(self) -> None:
        if self._pending:
            events, self._pending = self._pending, []
            self._send(self._pending_ts, events)

    def _send(self, ts: float, events: list[Any]) -> None:
        seq = self.seq
        self.seq += 1
        if self._gap_left == 0 and self.gaps and ts >= self.gaps[0][0]:
            _, n = self.gaps.pop(0)
            self._gap_left = n
            self._gap_row = {
                "instance": self.instance,
                "rank": 0,
                "after_seq": seq - 1,
                "next_seq": seq + n,
                "lost_messages": n,
                "lost_events": 0,
                "first_lost_ts": iso_us(ts),
                "last_lost_ts": None,
            }
            self.lost.append(self._gap_row)
        if self._gap_left > 0 and self._gap_row is not None:
            self._gap_left -= 1
            self._gap_row["lost_events"] += len(events)
            self._gap_row["last_lost_ts"] = iso_us(ts)
            return
        record = {
            "recv_ts": iso_us(ts + self.rng.uniform(0.0004, 0.004)),
            "instance": self.instance,
            "endpoint": self.endpoint,
            "topic": "kv-events",
            "seq": seq,
            "batch": {"ts": round(ts, 6), "events": events, "data_parallel_rank": 0},
        }
        self.text.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.flush()
        self.text.close()
        self.raw.close()


def gpu_stored(hashes: list[int], tokens: array, first: int, last: int, salt: str | None) -> dict[str, Any]:
    """vLLM's BlockStored for blocks first..last-1 of one cache_full_blocks call (omit_defaults: None dropped)."""
    extra: list[Any] = [[salt] if (b == 0 and salt is not None) else None for b in range(first, last)]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes[first:last],
        "parent_block_hash": hashes[first - 1] if first > 0 else None,
        "token_ids": tokens[first * BLOCK : last * BLOCK].tolist(),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    if any(e is not None for e in extra):
        ev["extra_keys"] = extra
    ev["group_idx"] = 0
    ev["kv_cache_spec_kind"] = KV_SPEC_KIND
    return ev


def lmcache_stored(keys: list[int], tokens: array, c: int) -> dict[str, Any]:
    """The connector's BlockStored for one LMCache chunk save: no extra_keys, no group (defaults omitted)."""
    return {
        "type": "BlockStored",
        "block_hashes": [keys[c]],
        "parent_block_hash": keys[c - 1] if c > 0 else None,
        "token_ids": tokens[c * CHUNK : (c + 1) * CHUNK].tolist(),
        "block_size": CHUNK,
        "lora_id": None,
        "medium": LMCACHE_MEDIUM,
        "lora_name": None,
    }


def removed(h: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}


# --------------------------------------------------------------------------------------------
# Engines and the simulation
# --------------------------------------------------------------------------------------------


class Engine:
    def __init__(self, name: str, archive: KvArchive, pool_tokens: int) -> None:
        self.name = name
        self.archive = archive
        self.device: OrderedDict[int, None] = OrderedDict()  # salted block hash, LRU oldest first
        self.origin: dict[int, Req] = {}  # block hash -> owner of the foreign chunk it was loaded from
        self.cap = pool_tokens // BLOCK
        self.epoch = -1
        self.startup: Startup | None = None
        self.log: list[tuple[float, str]] = []
        self.stats: dict[int, list[float]] = {}  # 10-s interval -> [prompt, generated, queries, local hit tokens]

    @property
    def connector(self) -> bool:
        return self.startup is not None and self.startup.connector is not None

    def reset(self) -> None:
        self.device.clear()
        self.origin.clear()

    def evict(self, need: int) -> list[int]:
        out = []
        while len(self.device) + need > self.cap and self.device:
            h, _ = self.device.popitem(last=False)
            self.origin.pop(h, None)
            out.append(h)
        return out

    def touch(self, hashes: list[int]) -> None:
        for h in reversed(hashes):  # vLLM frees a request's blocks tail first, so a prefix outlives its tail
            if h in self.device:
                self.device.move_to_end(h)


@dataclass
class Flight:
    req: Req
    engine: Engine
    epoch: int
    tokens: array
    hashes: list[int]
    keys: list[int]
    prompt_blocks: int
    save_chunks: list[int]


ARRIVE, SCHED, STEP, FINISH, STARTUP, PROBE = range(6)


class Prober:
    """PromptPeek on the victim's document (ref §4): the known prefix, a candidate chunk (the true one or
    variants differing in 1-3 tokens), 300 filler tokens, max_tokens 1; a hit grows the prefix by a chunk."""

    def __init__(self, seed: int, account: Account, victim: Account, doc: array, start: float) -> None:
        self.rng = random.Random(sub_seed(seed, "prober"))
        self.account = account
        self.victim = victim
        self.prompt = array("I", [IM_START, USER, NL]) + doc
        self.block = 1  # chunk 0 (the letterhead) is public: the prober knows it
        self.max_block = min(1 + 8, len(self.prompt) // CHUNK - 1)
        self.filler = token_run(seed, "probe-filler", n=300)
        self.start = start
        self.candidates: list[array] = []
        self.cycle = 0
        self.probes: list[int] = []
        self.hits: list[int] = []
        self.read_blocks: list[int] = []
        self.done = False
        self.new_candidates()

    def new_candidates(self) -> None:
        true = self.prompt[self.block * CHUNK : (self.block + 1) * CHUNK]
        cands = [true]
        for _ in range(self.rng.randrange(2, 8)):
            wrong = array("I", true)
            for pos in self.rng.sample(range(CHUNK), self.rng.randrange(1, 4)):
                wrong[pos] = (wrong[pos] + self.rng.randrange(1, 60000)) % 65536
            cands.append(wrong)
        self.rng.shuffle(cands)
        self.candidates = cands
        self.cycle = 0

    def next_pieces(self) -> list[Any] | None:
        if self.done:
            return None
        if not self.candidates:
            self.cycle += 1
            if self.cycle > 1:
                self.done = True
                return None
            cycle = self.cycle
            self.new_candidates()
            self.cycle = cycle
        cand = self.candidates.pop(0)
        return [self.prompt[: self.block * CHUNK], cand, self.filler]

    def observe(self, req: Req) -> None:
        self.probes.append(req.idx)
        if req.cached_tokens >= (self.block + 1) * CHUNK:
            self.hits.append(req.idx)
            self.read_blocks.append(self.block)
            self.block += 1
            if self.block > self.max_block:
                self.done = True
            else:
                self.new_candidates()


class Simulation:
    def __init__(self, seed: int, out: Path, dep: Deployment, planner: Planner, with_content: bool,
                 step_s: float) -> None:  # fmt: skip
        self.seed = seed
        self.out = out
        self.dep = dep
        self.planner = planner
        self.reqs = planner.reqs
        self.rng = random.Random(sub_seed(seed, "engines"))
        arch_rng = random.Random(sub_seed(seed, "archive"))
        self.engines = {
            name: Engine(
                name,
                KvArchive(
                    out / "kv-events" / f"{name}.jsonl.gz",
                    name,
                    [(t, n) for i, t, n in dep.seq_gaps if i == name],
                    arch_rng,
                    step_s,
                ),
                dep.pool_tokens,
            )
            for name in INSTANCES
        }
        self.store: dict[int, tuple[Req, float, str]] = {}  # chunk key -> (owner request, written at, instance)
        self.salt_ids: dict[str, int] = {}
        self.stored_by_salt: set[int] = set()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.counter = 0
        self.canary_prompt = token_run(seed, "canary", n=320)
        self.content = None
        if with_content:
            (out / "content").mkdir(parents=True, exist_ok=True)
            raw = (out / "content" / "prompts.jsonl.gz").open("wb")
            gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
            self.content = (raw, io.TextIOWrapper(gz, encoding="utf-8", newline="\n"))
        self.prober = Prober(
            seed,
            planner.by_role("prober")[0],
            planner.by_role("victim")[0],
            planner.special["victim_doc"],
            T0_S + 2 * 86400 + 21 * 3600 + self.rng.uniform(0, 1200),
        )

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, self.counter, kind, payload))

    def resolve(self, pieces: list[Any]) -> array:
        out = array("I")
        for p in pieces:
            out += self.output_tokens(p[1]) if isinstance(p, tuple) else p
        return out

    def output_tokens(self, r: Req) -> array:
        if r.output is None:
            r.output = token_run(self.seed, "output", r.rid, n=max(r.completion, 1))
        return r.output

    def run(self) -> None:
        for rows in self.dep.startups.values():
            for s in rows:
                self.push(s.start, STARTUP, s)
        for r in self.reqs:
            self.push(r.t, ARRIVE, r)
        self.push(self.prober.start, PROBE, None)
        period = max(900.0, 900.0 * DEFAULT_REQUESTS / self.planner.n)  # the provider's canary, no salt
        for k, inst in enumerate(INSTANCES):
            t = T0_S + k * 97.0
            while t < END_S:
                if self.dep.serving(inst, t):
                    acct = Account("canary", "", "canary")
                    r = Req(-1, f"canary-{inst}-{int(t)}", t, acct, "canary", [self.canary_prompt], 8, 8, gateway=False)
                    r.instance = inst
                    self.push(t, SCHED, r)
                t += period
        handlers = {
            ARRIVE: self.on_arrive,
            SCHED: self.on_sched,
            STEP: self.on_step,
            FINISH: self.on_finish,
            STARTUP: self.on_startup,
            PROBE: self.on_probe,
        }
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](t, payload)
        for e in self.engines.values():
            e.archive.close()
        if self.content is not None:
            self.content[1].close()
            self.content[0].close()

    def on_startup(self, t: float, s: Startup) -> None:
        e = self.engines[s.instance]
        e.reset()
        e.epoch += 1
        e.startup = s
        e.archive.restart(s)
        e.log.extend(startup_lines(s, self.dep.pool_tokens))

    def route(self, r: Req) -> str | None:
        up = self.dep.up_instances(r.t)
        if not up:
            return None
        if r.pin in up:
            return r.pin
        home = INSTANCES[sub_seed(0, r.session) % len(INSTANCES)]
        if home in up and self.rng.random() < r.account.stickiness:
            return home
        return self.rng.choice(up)

    def write_content(self, r: Req, prompt: array) -> None:
        if self.content is not None and r.gateway:
            line = json.dumps({"request_id": r.rid, "prompt_token_ids": prompt.tolist()}, separators=(",", ":"))
            self.content[1].write(line + "\n")

    def access_line(self, e: Engine, t: float, r: Req, status: str) -> None:
        ip = f"10.44.0.{21 + r.idx % 3}"
        e.log.append((t, f'(APIServer pid=1) INFO:     {ip}:{40000 + r.idx % 20000} - "POST /v1/chat/completions HTTP/1.1" {status}'))  # fmt: skip

    def on_arrive(self, t: float, r: Req) -> None:
        inst = self.route(r)
        if inst is None:
            r.status = 503
            return
        r.instance = inst
        if r.too_long:
            prompt = self.resolve(r.pieces)
            r.prompt_tokens = len(prompt)
            self.write_content(r, prompt)
            r.latency_ms = round(self.rng.uniform(40, 200), 1)
            e = self.engines[inst]
            te = t + r.latency_ms / 1000
            msg = (
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt contains "
                f"{r.prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt."
            )
            e.log.append((te, vline(te, "APIServer pid=1", "ERROR", "serving.py:412", msg)))
            self.access_line(e, te, r, "400 Bad Request")
            return
        self.push(t + self.rng.lognormvariate(math.log(0.02), 0.8), SCHED, r)

    def on_probe(self, t: float, _: Any) -> None:
        pieces = self.prober.next_pieces()
        if pieces is None:
            return
        r = Req(len(self.reqs), self.planner.rid(), t, self.prober.account, "probe", pieces, 1, 1, session="probe")
        self.reqs.append(r)
        self.on_arrive(t, r)

    def on_sched(self, t: float, r: Req) -> None:
        e = self.engines[r.instance]
        if e.startup is None or not self.dep.serving(r.instance, r.t):
            r.status = 503
            if r.kind == "probe":
                self.push(t + 1.0, PROBE, None)
            return
        salt = r.account.salt or None
        prompt = self.resolve(r.pieces)
        plen = len(prompt)
        keep_output = r.status == 200 and r.completion > 1
        tokens = prompt + self.output_tokens(r)[:-1] if keep_output else prompt
        hashes = block_hashes(tokens, len(tokens) // BLOCK, salt)
        keys = chunk_keys(prompt, plen // CHUNK)
        r.prompt_tokens = plen
        self.write_content(r, prompt)
        # local prefix cache in the request's namespace; the last prompt token is always computed
        max_local = (plen - 1) // BLOCK
        local = 0
        while local < max_local and hashes[local] in e.device:
            local += 1
        local_tokens = local * BLOCK
        # LMCache: lookup of the token-only chunk chain from the start; loads what lies beyond the local hit
        hit_chunks = 0
        if e.connector:
            limit = (plen - 1) // CHUNK
            while hit_chunks < limit and keys[hit_chunks] in self.store:
                hit_chunks += 1
        hit_tokens = hit_chunks * CHUNK
        external = max(0, hit_tokens - local_tokens)
        loaded = [c for c in range(hit_chunks) if (c + 1) * CHUNK > local_tokens] if external else []
        for c in loaded:
            owner, wrote_at, wrote_on = self.store[keys[c]]
            r.l3_owners.append((c, owner, wrote_at, wrote_on))
            if self.content_key(keys[c], salt) in self.stored_by_salt:
                r.l3_known.add(c)
        for h in hashes[:local]:
            o = e.origin.get(h)
            if o is not None:
                r.secondary_from.add(o.account.name)
        e.touch(hashes[:local])
        # allocate_slots caches every full prompt block of the step, loaded or computed: one BlockStored
        prompt_blocks = plen // BLOCK
        events: list[Any] = [removed(h) for h in e.evict(prompt_blocks - local)]
        for b in range(local, prompt_blocks):
            e.device[hashes[b]] = None
        for c, owner, _, _ in r.l3_owners:
            if self.foreign(owner, r):
                for b in range(max(local, c * CHUNK // BLOCK), min(prompt_blocks, (c + 1) * CHUNK // BLOCK)):
                    e.origin[hashes[b]] = owner
        if prompt_blocks > local:
            events.append(gpu_stored(hashes, tokens, local, prompt_blocks, salt))
        cached = local_tokens + external
        r.cached_tokens = cached
        r.local_blocks, r.external_tokens, r.l3_chunks = local, external, loaded
        r.served = True
        if local and r.account.salt and r.kind in PUBLIC_TEXT_KINDS:
            r.public_same_namespace = True
        new_tokens = plen - cached
        prefill = 0.006 + new_tokens * 7e-5 + (new_tokens**2) * 3e-10 + len(loaded) * 3e-3
        first = t + prefill + 0.015
        r.ttft_ms = round((first - r.t) * 1000, 1)
        decode = max(r.completion - 1, 0) * self.rng.uniform(0.02, 0.032)
        if r.status == 499:
            r.latency_ms = r.client_timeout_s * 1000
        else:
            r.latency_ms = round((first + decode - r.t) * 1000 + self.rng.uniform(1, 15), 1)
        save = list(range(hit_chunks, plen // CHUNK)) if e.connector else []
        f = Flight(r, e, e.epoch, tokens, hashes, keys, prompt_blocks, save)
        self.push(t + prefill, STEP, (f, events))
        stat = e.stats.setdefault(int(t // 10), [0.0, 0.0, 0.0, 0.0])
        stat[0] += new_tokens
        stat[1] += r.completion
        stat[2] += plen
        stat[3] += local_tokens
        if r.status == 200 and len(hashes) > prompt_blocks:
            self.push(r.t + r.latency_ms / 1000, FINISH, f)
        if r.gateway:
            self.access_line(e, r.t + r.ttft_ms / 1000, r, "200 OK")
        self.stored_by_salt.update(self.content_key(k, salt) for k in keys)
        if r.kind == "probe":
            self.prober.observe(r)
            self.push(r.t + r.latency_ms / 1000 + self.prober.rng.uniform(0.05, 0.6), PROBE, None)

    def on_step(self, t: float, payload: tuple[Flight, list[Any]]) -> None:
        """The step's end: its events go out, and LMCache's save of the new chunks lands in the store."""
        f, events = payload
        e = f.engine
        if f.epoch != e.epoch:
            return
        for c in f.save_chunks:
            events.append(lmcache_stored(f.keys, f.tokens, c))
            if f.keys[c] not in self.store:
                self.store[f.keys[c]] = (f.req, t, e.name)
        e.archive.publish(t, events)

    def on_finish(self, t: float, f: Flight) -> None:
        e = f.engine
        if f.epoch != e.epoch:
            return
        n = len(f.hashes)
        events: list[Any] = [removed(h) for h in e.evict(n - f.prompt_blocks)]
        for b in range(f.prompt_blocks, n):
            e.device[f.hashes[b]] = None
        events.append(gpu_stored(f.hashes, f.tokens, f.prompt_blocks, n, f.req.account.salt or None))
        e.archive.publish(t, events)

    @staticmethod
    def foreign(owner: Req, r: Req) -> bool:
        o = owner.account
        return o.salt != r.account.salt and o.role != "canary" and not o.internal and o.salt != SHARED_NAMESPACE

    def content_key(self, key: int, salt: str | None) -> int:
        sid = self.salt_ids.setdefault(salt or "", len(self.salt_ids))
        return (key << 24) | sid

    def stats_lines(self) -> None:
        """``Engine 000: Avg prompt throughput ...`` every 10 s with traffic (logs §2.5, V1 loggers)."""
        for e in self.engines.values():
            for k, (new, gen, prompt, hit) in sorted(e.stats.items()):
                t = (k + 1) * 10.0
                rate = 100.0 * hit / prompt if prompt else 0.0
                msg = (
                    f"Engine 000: Avg prompt throughput: {new / 10:.1f} tokens/s, Avg generation throughput: "
                    f"{gen / 10:.1f} tokens/s, Running: {self.rng.randrange(0, 6)} reqs, Waiting: 0 reqs, "
                    f"GPU KV cache usage: {self.rng.uniform(0.5, 9):.1f}%, Prefix cache hit rate: {rate:.1f}%"
                )
                e.log.append((t, vline(t, "APIServer pid=1", "INFO", "loggers.py:123", msg)))


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def write_gz_lines(path: Path, lines: Iterator[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        buf = io.TextIOWrapper(gz, encoding="utf-8", newline="\n")
        for line in lines:
            buf.write(line)
            buf.write("\n")
        buf.flush()
        buf.detach()


def gateway_record(r: Req, rng: random.Random) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": r.prompt_tokens}
    if r.status == 200:
        usage["completion_tokens"] = r.completion
        usage["total_tokens"] = r.prompt_tokens + r.completion
        usage["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
    else:
        usage["completion_tokens"] = 0
    rec: dict[str, Any] = {
        "id": r.rid,
        "created_at": iso(r.t),
        "tenant": r.account.name,
        "model": MODEL,
        "endpoint": "/v1/chat/completions",
        "status": r.status,
        "stream": r.kind not in ("harness_mc", "harness_gen", "keepalive", "probe"),
        "max_tokens": r.max_tokens,
        "usage": usage,
        "ttft_ms": r.ttft_ms if r.status == 200 else None,
        "latency_ms": r.latency_ms,
        "upstream": r.instance or None,
        "cache_salt": r.account.salt,
    }
    if r.status == 400:
        rec["error"] = {"type": "BadRequestError", "code": 400}
    if rng.random() < 0.02:
        rec["client_cache_salt"] = rng.choice(["shared", "default", "my-team"])
    return rec


def incident_toml(with_content: bool) -> str:
    content = (
        """
[[sources]]
name = "content"
kind = "content"
path = "content/prompts.jsonl.gz"
format = "jsonl"
"""
        if with_content
        else ""
    )
    return f"""# Written by tests/vllm_reference/generate.py; truth.json is deliberately not referenced.
[incident]
id = "vllm-lmcache-salt-blind"
title = "{MODEL}: LMCache store shared by vLLM instances served KV across tenants"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway/requests-*.jsonl.gz"
format = "jsonl"
timezone = "UTC"
null_tokens = [""]
[sources.columns]
request_id = "id"
ts = "created_at"
account_id = "tenant"
prompt_tokens = "usage.prompt_tokens"
completion_tokens = "usage.completion_tokens"
cached_tokens = "usage.prompt_tokens_details.cached_tokens"
prefill_instance = "upstream"

[[sources]]
name = "engines"
kind = "engine_log"
path = "engines/*/vllm.log.gz"
format = "vllm"
timezone = "UTC"
year = {YEAR}
instance = "{{parent}}"

[[sources]]
name = "kv-events"
kind = "kv_events"
path = "kv-events/*.jsonl.gz"
columns = {{ ts = "batch.ts", events = "batch.events", dp_rank = "batch.data_parallel_rank", instance = "instance", seq = "seq" }}
{content}
[scope]
internal_accounts = ["{INTERNAL_PATTERN}"]

[prefix_cache]
tenants = "multi"
cache_salt = "gateway"
engine_version = "{VLLM_VERSION}"
block_size = {BLOCK}
shared_namespaces = ["{SHARED_NAMESPACE}"]
"""


def window_rows(dep: Deployment) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for inst, rows in dep.startups.items():
        out[inst] = []
        for k, s in enumerate(rows):
            if s.connector is None:
                continue
            nxt = rows[k + 1] if k + 1 < len(rows) else None
            out[inst].append(
                {
                    "start": iso(s.start),
                    "ready": iso(s.ready),
                    "end": iso(nxt.start) if nxt else None,
                    "process_end": iso(s.shutdown) if s.shutdown is not None else None,
                    "kv_connector": s.connector,
                }
            )
    return out


def in_window(dep: Deployment, inst: str, t: float) -> bool:
    rows = dep.startups[inst]
    for k, s in enumerate(rows):
        end = rows[k + 1].start if k + 1 < len(rows) else math.inf
        if s.connector is not None and s.start <= t < end:
            return True
    return False


def build_truth(sim: Simulation, dep: Deployment, planner: Planner, seed: int, n: int,
                with_content: bool) -> dict[str, Any]:  # fmt: skip
    reqs = [r for r in sim.reqs if r.gateway]
    affected: list[str] = []
    undelivered: list[str] = []
    sources: dict[str, Any] = {}
    recipients: set[str] = set()
    owners: set[str] = set()
    same_tenant: list[str] = []
    shared_ns: list[str] = []
    secondary: list[str] = []
    public_same: list[str] = []
    for r in reqs:
        if not r.served:
            continue
        foreign_chunks = []
        own = shared = False
        first_local = r.local_blocks
        for c, o, wrote_at, wrote_on in r.l3_owners:
            if sim.foreign(o, r):
                lo = max(first_local, c * CHUNK // BLOCK)
                foreign_chunks.append(
                    {
                        "chunk": c,
                        "position": lo,  # the first block (of 16 tokens) loaded from this chunk
                        "positions": [lo, (c + 1) * CHUNK // BLOCK - 1],
                        "source_account": o.account.name,
                        "source_request_id": o.rid,
                        "source_salt": o.account.salt,
                        "written_by": wrote_on,
                        "written_at": iso(wrote_at),
                        "requester_stored_same_tokens_before": c in r.l3_known,
                    }
                )
            elif o.account.salt == r.account.salt:
                own = True
            else:
                shared = True
        if foreign_chunks:
            row = {
                "account": r.account.name,
                "account_class": "internal" if r.account.internal else "customer",
                "ts": iso(r.t),
                "instance": r.instance,
                "status": r.status,
                "cached_tokens": r.cached_tokens,
                "local_hit_tokens": r.local_blocks * BLOCK,
                "external_tokens": r.external_tokens,
                "prompt_tokens": r.prompt_tokens,
                "l3_loaded_chunks": r.l3_chunks,
                "foreign_pages": foreign_chunks,
                "source_accounts": sorted({fc["source_account"] for fc in foreign_chunks}),
                "kind": r.kind,
                "requester_stored_same_tokens_before": all(
                    fc["requester_stored_same_tokens_before"] for fc in foreign_chunks
                ),
            }
            sources[r.rid] = row
            affected.append(r.rid)
            recipients.add(r.account.name)
            owners.update(row["source_accounts"])
            if not 200 <= r.status < 300:
                undelivered.append(r.rid)
        else:
            if own:
                same_tenant.append(r.rid)
            if shared:
                shared_ns.append(r.rid)
            if r.secondary_from:
                secondary.append(r.rid)
            elif r.public_same_namespace:
                public_same.append(r.rid)
    pr = sim.prober
    prober = {
        "account": pr.account.name,
        "victim": pr.victim.name,
        "victim_document_requests": sorted(r.rid for r in reqs if r.account is pr.victim and r.kind == "private_doc"),
        "known_prefix_chunks": 1,
        "chunk_tokens": CHUNK,
        "probes": [sim.reqs[i].rid for i in pr.probes],
        "hits": [sim.reqs[i].rid for i in pr.hits],
        "blocks_read": pr.read_blocks,
        "first": iso(sim.reqs[pr.probes[0]].t) if pr.probes else None,
        "last": iso(sim.reqs[pr.probes[-1]].t) if pr.probes else None,
        "max_tokens": 1,
    }
    gaps = []
    for e in sim.engines.values():
        gaps.extend(e.archive.lost)
    for g in gaps:
        t = datetime.fromisoformat(g["first_lost_ts"].replace("Z", "+00:00")).timestamp()
        g["inside_exposure_window"] = in_window(dep, g["instance"], t)
    by_kind: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for r in reqs:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    startups = {
        inst: [
            {
                "start": iso(s.start),
                "ready": iso(s.ready),
                "shutdown": iso(s.shutdown) if s.shutdown is not None else None,
                "kv_connector": s.connector,
                "endpoint": f"tcp://{s.ip}:5557",
            }
            for s in rows
        ]
        for inst, rows in dep.startups.items()
    }
    return {
        "generator": {
            "name": "tests/vllm_reference/generate.py",
            "seed": seed,
            "requests": n,
            "with_content": with_content,
        },  # fmt: skip
        "definitions": {
            "affected_requests": "gateway requests (any status) whose cached_tokens include tokens their lookup "
            "loaded from the shared LMCache store (chunks within LMCache's prefix hit ending beyond the local "
            "vLLM prefix-cache hit, connector on the instance's start-up) whose first writer had another salt "
            "and was neither internal nor in a shared namespace (ref 3, LMCache#2878)",
            "source_accounts": "the accounts whose requests first computed those chunks and saved them to LMCache",
            "exposure_windows": "per instance: the start-up with kv_transfer_config LMCacheConnectorV1, from its "
            "first line to the first line of the start-up that removed it (process_end: its shutdown line)",
            "not_affected": "local prefix-cache hits in the requester's namespace (also of public text other "
            "tenants have cached), LMCache loads of own chunks, loads of the playground's chunks, local hits "
            "on copies an earlier foreign load brought in",
            "l3": "the LMCache remote store (the key names follow tests/hicache_reference)",
            "foreign_pages": "per foreign 256-token chunk: chunk index, the first 16-token block loaded from it "
            "(position) and the block range",
        },
        "deployment": {
            "model": MODEL,
            "model_path": MODEL_PATH,
            "engine": "vllm",
            "engine_version": VLLM_VERSION,
            "instances": list(INSTANCES),
            "block_size": BLOCK,
            "lmcache_chunk_size": CHUNK,
            "max_model_len": MAX_MODEL_LEN,
            "kv_pool_tokens": dep.pool_tokens,
            "gpu_blocks": dep.pool_tokens // BLOCK,
            "startups": startups,
            "lmcache_objects": len(sim.store),
        },
        "internal_accounts": sorted(a.name for a in planner.accounts if a.internal),
        "internal_account_patterns": [INTERNAL_PATTERN],
        "shared_namespaces": [SHARED_NAMESPACE],
        "exposure_windows": window_rows(dep),
        "affected_requests": sorted(affected),
        "affected_undelivered": sorted(undelivered),
        "recipients": sorted(recipients),
        "source_accounts": sorted(owners),
        "sources": sources,
        "same_tenant_l3_loads": sorted(same_tenant),
        "shared_namespace_l3_loads": sorted(shared_ns),
        "secondary_requests": sorted(secondary),
        "same_namespace_public_hits": len(public_same),
        "rejected_too_long": sorted(r.rid for r in reqs if r.too_long),
        "prober": prober,
        "lookalikes": {
            "evaluation_harness": planner.special["harness"],
            "retries": planner.special["retries"],
            "keep_alive": [planner.special["keep_alive"]["account"]],
            "autocomplete": sorted(a.name for a in planner.by_role("autocomplete")),
            "playground": sorted(a.name for a in planner.accounts if a.internal),
            "playground_copies": planner.special["playground_copies"],
        },
        "keep_alive_period_s": planner.special["keep_alive"]["period_s"],
        "seq_gaps": gaps,
        "counts": {
            "gateway_requests": len(reqs),
            "by_kind": dict(sorted(by_kind.items())),
            "by_status": dict(sorted(by_status.items())),
            "affected": len(affected),
            "recipients": len(recipients),
            "source_accounts": len(owners),
        },
    }


def generate(
    out_dir: str | Path,
    seed: int = DEFAULT_SEED,
    requests: int = DEFAULT_REQUESTS,
    with_content: bool = False,
    kv_pool_tokens: int | None = None,
    step_s: float = DEFAULT_STEP_S,
) -> dict[str, Any]:
    """Write the incident folder and return the truth (also written to truth.json).

    ``requests``: the gateway's requests, about (the prober's probes come on top); ``kv_pool_tokens``:
    each instance's GPU KV cache (default: scaled with ``requests``, 81,920 to 262,144 tokens, never
    below max_model_len); ``step_s``: events published within this many seconds of a batch's first go
    out in that batch, as one scheduler step's do.
    """
    if requests < 500:
        raise ValueError("requests: at least 500")
    if kv_pool_tokens is not None and (kv_pool_tokens % BLOCK or kv_pool_tokens < MAX_MODEL_LEN):
        raise ValueError(f"kv_pool_tokens: a multiple of {BLOCK}, at least max_model_len {MAX_MODEL_LEN}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dep = plan_deployment(seed, pool_tokens_for(requests) if kv_pool_tokens is None else kv_pool_tokens)
    planner = Planner(seed, requests, dep)
    planner.plan()
    sim = Simulation(seed, out, dep, planner, with_content, step_s)
    sim.run()
    sim.stats_lines()
    rng = random.Random(sub_seed(seed, "gateway"))
    gw = sorted((r for r in sim.reqs if r.gateway), key=lambda r: (r.t, r.rid))
    by_day: dict[str, list[str]] = {}
    for r in gw:
        day = datetime.fromtimestamp(r.t, UTC).strftime("%Y-%m-%d")
        by_day.setdefault(day, []).append(json.dumps(gateway_record(r, rng), separators=(",", ":")))
    for day, lines in by_day.items():
        write_gz_lines(out / "gateway" / f"requests-{day}.jsonl.gz", iter(lines))
    for name, e in sim.engines.items():
        lines = [text for _, text in sorted(e.log, key=lambda x: x[0])]
        write_gz_lines(out / "engines" / name / "vllm.log.gz", iter(lines))
    (out / "incident.toml").write_text(incident_toml(with_content))
    truth = build_truth(sim, dep, planner, seed, requests, with_content)
    truth["generator"].update({"kv_pool_tokens": dep.pool_tokens, "step_s": step_s})
    (out / "truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n")
    return truth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    ap.add_argument("--with-content", action="store_true")
    ap.add_argument("--kv-pool-tokens", type=int, default=None)
    ap.add_argument("--step-s", type=float, default=DEFAULT_STEP_S)
    args = ap.parse_args(argv)
    truth = generate(
        args.out_dir,
        seed=args.seed,
        requests=args.requests,
        with_content=args.with_content,
        kv_pool_tokens=args.kv_pool_tokens,
        step_s=args.step_s,
    )
    c = truth["counts"]
    print(
        f"{args.out_dir}: {c['gateway_requests']} requests, {c['affected']} affected, "
        f"{c['recipients']} recipients, {c['source_accounts']} source accounts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
