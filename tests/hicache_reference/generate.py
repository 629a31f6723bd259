"""An SGLang 0.5.18 HiCache incident with a salt-blind shared L3 store, written from the engines' behaviour.

This generator is the judge of the toolkit's ``prefix_reuse`` mechanism, so it is written only from
``/work/shared/reference/kv-cache-isolation.md`` (sections 1-4, cited as "ref §n") and
``/work/shared/reference/engine-log-formats.md`` (SGLang lines, "logs §1.x"); it imports nothing from
``kvforensics``. ``generate(out_dir, seed=15, requests=60_000)`` writes one incident folder::

    incident.toml                  the toolkit's incident file (sources, [scope], [prefix_cache])
    gateway/requests-<day>.jsonl.gz  OpenAI-style records, cache_salt set per tenant by the gateway
    engines/<instance>/sglang.log.gz SGLang 0.5.18 logs: three start-ups per instance, batch and access lines
    kv-events/<instance>.jsonl.gz  a ZMQ subscriber's archive of the KVEventBatch messages
    content/prompts.jsonl.gz       only with ``with_content=True``: request_id, prompt_token_ids
    truth.json                     the ground truth defined below

Deployment (ref §2, §3): one model on four unified instances ``sglang-0`` .. ``sglang-3``, HiCache
(``--enable-hierarchical-cache``, write_through, page size 64, ``--enable-cache-report``,
``--kv-events-config`` ZMQ publisher). Start-up 0 has no storage backend; a rolling restart on day 2
adds ``hicache_storage_backend='mooncake'`` one instance at a time, a second on day 5 removes it. The
L3 store is external: it survives restarts, is shared by the instances whose current start-up has
the backend, and keys pages by their tokens only (SGLang HiCache storage up to 0.5.18: #26747, fixed
by #38577 after this incident).

Engine model per instance (ref §2): a device radix cache and a host (L2) cache, LRU, keyed by
(cache salt, token chain), so the in-process caches never serve one salt's pages to another
(#23300, #30827). A computed page: ``BlockStored(GPU)`` at the insert, ``BlockStored(CPU_PINNED)``
when the write-through host backup completes, and with the backend an L3 write (no event, #29709 /
#29948). A host hit: ``BlockStored(GPU)`` when loaded back. A device+host miss with at least 256
prompt tokens left (prefetch threshold, #12092) consults L3; the matching pages are loaded as
``BlockStored(CPU_PINNED)`` then ``BlockStored(GPU)``, in the requester's namespace (its salt, its
salted hashes: #22894). Evictions publish ``BlockRemoved`` with their medium; ``/flush_cache``
publishes ``AllBlocksCleared``; a restart empties device and host and restarts the sequence at 0.
Consecutive chained stores of one insert are one event with several hashes (#31479); page hashes
chain ``hash_str_to_int64(sha256(prior || uint32-LE ids))`` seeded with
``SHA256(b"sglang-cache-salt-v1\\0" + salt)`` for salted chains (#30827). ``cached_tokens`` counts
device + host + storage hits (ref §4, #17648).

Ground truth (``truth.json``), defined precisely:

* An **L3 load** is a page a request's lookup took from the shared store: its device and host caches
  (in the request's salt) missed the page, the instance's current start-up had the backend, the
  prompt left >= 256 uncached tokens, and the store held the page's token chain (written earlier by
  a backup of any instance whose start-up had the backend). Only loaded pages count, so a partial
  best_effort prefetch counts the pages it brought.
* A page's **owner** is the request whose backup first wrote its token chain to the store (the store
  keeps the first write: ``exists`` before ``set``), and that request's account and salt.
* A load is **foreign** when the owner's salt differs from the requester's and the owner is neither
  an internal account (``[scope] internal_accounts``) nor in a shared namespace
  (``shared_namespaces``, the public playground): ref §3, "Stores that drop the salt" (#26747) and
  "Same-tenant reuse ... is not cross-tenant; nor is a namespace the provider documents as shared".
* ``affected_requests``: gateway requests with at least one foreign L3 load (the engine's
  ``cached_tokens`` include those pages), whatever the status: the engine computed the response on
  them. ``affected_undelivered``: those of them the client did not receive whole (status 499, whose
  gateway record has no ``cached_tokens``). ``recipients``: the accounts of ``affected_requests``;
  ``source_accounts``: the owners of their foreign pages; ``sources``: per affected request, each
  foreign page's position, owner account and request, the instance that wrote it and when, and
  ``requester_stored_same_tokens_before``: the requester's salt had itself stored those tokens
  earlier (on any instance, e.g. before the backend was added, or since evicted). Such a load still
  reads another tenant's store object and counts as affected.
* Not affected, by construction and listed for scoring false positives: hits in the requester's own
  namespace (device or host, including the same public text another tenant also has in the same
  instance's cache: ``same_namespace_public_hits``), L3 loads of the requester's own pages written on
  another instance (``same_tenant_l3_loads``), loads of pages the playground wrote
  (``shared_namespace_l3_loads``), and later own-namespace hits on pages that an earlier foreign load
  brought in (``secondary_requests``: the KV is a copy in the requester's namespace; no new read of
  another tenant's store object).
* ``exposure_windows``: per instance, the start-up that had the backend, from its first log line
  (``start``) to the first line of the start-up that removed it (``end``); ``process_end`` is its
  shutdown line. Every affected request was served on its instance inside one.
* ``prober``: the account probing the victim's document (ref §4): its probes, the hits, the blocks
  it read back. ``lookalikes``: accounts whose traffic resembles probing and is not (ref §4).
* ``seq_gaps``: messages the archive lacks (a jump in ``seq``, ref §1), placed outside every
  exposure window, with the events they carried.

Run ``python tests/hicache_reference/generate.py OUT --seed 15 --requests 60000``.
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
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PAGE = 64  # --page-size 64
PREFETCH_THRESHOLD = 256  # HiCache storage prefetch threshold in tokens (ref §2, #12092)
SALT_SEED_PREFIX = b"sglang-cache-salt-v1\0"  # compute_node_event_hash_values (ref §2, #30827)
MODEL_PATH = "meta-llama/Llama-3.3-70B-Instruct"
MODEL = "llama-3.3-70b-instruct"  # served_model_name = the gateway's model id
INSTANCES = ("sglang-0", "sglang-1", "sglang-2", "sglang-3")
TP_SIZE = 4
KV_POOL_TOKENS = 430_080  # max_total_num_tokens per instance at the default size (6,720 pages)
MIN_POOL_TOKENS = 196_608  # smaller incidents get a smaller pool (still above the context length)
HICACHE_RATIO = 2.0  # host pool = 2 x device pool
CONTEXT_LENGTH = 131_072
T0 = datetime(2026, 9, 1, tzinfo=UTC)
DAYS = 6
SHARED_NAMESPACE = "playground"  # the playground's documented shared salt
INTERNAL_PATTERN = "playground-*"
GATEWAY_SALT_KEY = b"gw-cache-salt-2026"  # the gateway's key for per-tenant salts

# Llama 3 chat template token ids
BOS, SH, EH, EOT, NL2 = 128000, 128006, 128007, 128009, 271
SYSTEM, USER, ASSISTANT = 9125, 882, 78191

PUBLIC_TEXT_KINDS = ("public_doc", "template", "playground_copy")  # prompts opening with text other tenants send
DEFAULT_SEED = 15
DEFAULT_REQUESTS = 60_000
DEFAULT_STEP_S = 0.05  # events of concurrent requests share a scheduler step's batch


T0_S = T0.timestamp()
END_S = T0_S + DAYS * 86400


def iso(t: float) -> str:
    """UTC ISO-8601 with milliseconds and Z."""
    dt = datetime.fromtimestamp(t, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def iso_us(t: float) -> str:
    dt = datetime.fromtimestamp(t, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def log_stamp(t: float, rank: int | None = None) -> str:
    """SGLang's envelope: local time (UTC here), no milliseconds, ' TPn' when tp_size > 1 (logs §1.1)."""
    s = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"[{s}]" if rank is None else f"[{s} TP{rank}]"


def sub_seed(seed: int, *labels: object) -> int:
    text = "/".join([str(seed), *map(str, labels)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def token_run(seed: int, *labels: object, n: int) -> array:
    """n deterministic token ids (0..65535) for a labelled piece of text."""
    rng = random.Random(sub_seed(seed, *labels))
    out = array("I", array("H", rng.randbytes(2 * n)))
    return out


LITTLE_ENDIAN = sys.byteorder == "little"


def page_bytes(tokens: array, p: int) -> bytes:
    chunk = tokens[p * PAGE : (p + 1) * PAGE]
    if not LITTLE_ENDIAN:
        chunk.byteswap()
    return chunk.tobytes()


def hash_str_to_int64(digest: bytes) -> int:
    """The first 16 hex digits of the digest as a signed int64 (ref §2, mem_cache/utils.py)."""
    v = int.from_bytes(digest[:8], "big")
    return v - (1 << 64) if v >= 1 << 63 else v


def chain_seed(salt: str | None) -> bytes:
    """Salted chains are seeded from the salt (ref §2, #30827); unsalted chains start empty."""
    return b"" if salt is None else hashlib.sha256(SALT_SEED_PREFIX + salt.encode()).digest()


def chain_hashes(tokens: array, n_pages: int, seed_digest: bytes) -> list[int]:
    """Per-page event hashes: hash_str_to_int64(sha256(prior || uint32-LE ids))."""
    out: list[int] = []
    prior = seed_digest
    for p in range(n_pages):
        prior = hashlib.sha256(prior + page_bytes(tokens, p)).digest()
        out.append(hash_str_to_int64(prior))
    return out


def gateway_salt(account: str) -> str:
    """The gateway's per-tenant cache_salt: a keyed hash of the tenant id (ref §3)."""
    if is_internal(account):
        return SHARED_NAMESPACE
    return "cs-" + hmac.new(GATEWAY_SALT_KEY, account.encode(), hashlib.sha256).hexdigest()[:24]


def is_internal(account: str) -> bool:
    """The provider's own accounts, as ``[scope] internal_accounts`` names them."""
    return fnmatch.fnmatchcase(account, INTERNAL_PATTERN)


def user_block(text: array) -> array:
    return array("I", [SH, USER, EH, NL2]) + text + array("I", [EOT])


def system_block(text: array) -> array:
    return array("I", [SH, SYSTEM, EH, NL2]) + text + array("I", [EOT])


ASSISTANT_HEADER = array("I", [SH, ASSISTANT, EH, NL2])


# --------------------------------------------------------------------------------------------
# Deployment: start-ups, restarts, flush, lost messages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Startup:
    instance: str
    index: int  # 0, 1, 2 per instance
    start: float  # the server_args line
    ready: float  # "The server is fired up"
    drain: float | None  # the gateway stops routing here (None: runs to the end)
    shutdown: float | None  # uvicorn "Shutting down"
    backend: str | None  # hicache_storage_backend
    pid: int
    ip: str


def pool_tokens_for(requests: int) -> int:
    """The KV pool scales with the traffic so that small incidents still evict (never below the context)."""
    tokens = int(KV_POOL_TOKENS * min(1.0, requests / DEFAULT_REQUESTS))
    return max(MIN_POOL_TOKENS, tokens // PAGE * PAGE)


@dataclass(frozen=True)
class Deployment:
    pool_tokens: int
    startups: dict[str, list[Startup]]
    flush: tuple[str, float]
    seq_gaps: list[tuple[str, float, int]]  # (instance, from time, messages lost)

    def startup_at(self, instance: str, t: float) -> Startup | None:
        for s in self.startups[instance]:
            end = s.shutdown if s.shutdown is not None else math.inf
            if s.start <= t < end:
                return s
        return None

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
    add_store = T0_S + 86400 + 10 * 3600 + rng.uniform(0, 1800)  # day 2 ~10:00-10:30
    drop_store = T0_S + 4 * 86400 + 16 * 3600 + rng.uniform(0, 1800)  # day 5 ~16:00-16:30
    startups: dict[str, list[Startup]] = {}
    for k, inst in enumerate(INSTANCES):
        rows: list[Startup] = []
        starts = [
            (first + k * 150, None),
            (add_store + k * 420 + 75, "mooncake"),
            (drop_store + k * 420 + 75, None),
        ]
        for n, (start, backend) in enumerate(starts):
            ready = start + 170 + rng.uniform(0, 40)
            if n + 1 < len(starts):
                drain = starts[n + 1][0] - 75
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
                    backend,
                    pid=rng.randrange(60, 400),
                    ip=f"10.42.{rng.randrange(1, 9)}.{rng.randrange(10, 250)}",
                )
            )
        startups[inst] = rows
    flush_at = T0_S + 3 * 86400 + 3 * 3600 + 30 * 60 + rng.uniform(0, 600)  # day 4 ~03:30, in the window
    gaps = [
        ("sglang-2", T0_S + 15 * 3600 + rng.uniform(0, 3600), 3),  # day 1, before any backend
        ("sglang-3", T0_S + 20 * 3600 + rng.uniform(0, 3600), 1),
        ("sglang-0", T0_S + 5 * 86400 + 8 * 3600 + rng.uniform(0, 3600), 12),  # day 6, backend removed
    ]
    return Deployment(pool_tokens, startups, ("sglang-1", flush_at), gaps)


# --------------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------------


@dataclass
class Account:
    name: str
    salt: str
    role: str  # customer, playground, harness_mc, harness_gen, keepalive, autocomplete, prober, victim
    weight: float = 1.0
    system: array | None = None
    doc_first: bool = True  # pastes a document at the start of the prompt (no own system prompt)
    private_docs: list[array] = field(default_factory=list)
    kinds: tuple[float, float, float, float] = (0.45, 0.25, 0.15, 0.15)  # chat, public doc, template, private doc
    retry_p: float = 0.01
    stickiness: float = 0.7

    @property
    def internal(self) -> bool:
        return is_internal(self.name)


@dataclass
class Req:
    idx: int
    rid: str
    t: float  # the gateway received it
    account: Account
    kind: str
    pieces: list[Any]  # arrays, or ("out", req) for a previous response's output
    max_tokens: int
    completion: int
    status: int = 200
    session: str = ""
    gateway: bool = True
    client_timeout_s: float = 0.0
    # filled by the simulation
    instance: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    device_pages: int = 0
    host_pages: int = 0
    l3_pages: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    latency_ms: float = 0.0
    served: bool = False
    output: array | None = None
    l3_owners: list[tuple[int, Req, float, str]] = field(default_factory=list)  # (page, owner, written, by)
    l3_known: set[int] = field(default_factory=set)  # loaded pages whose tokens its salt had stored before
    secondary_from: set[str] = field(default_factory=set)
    public_same_namespace: bool = False


class Planner:
    """Accounts and their requests (ref §3-4), as the gateway received them."""

    def __init__(self, seed: int, n_requests: int, deployment: Deployment) -> None:
        self.seed = seed
        self.n = n_requests
        self.dep = deployment
        self.rng = random.Random(sub_seed(seed, "traffic"))
        self.reqs: list[Req] = []
        self.public_docs = [token_run(seed, "public-doc", i, n=self.rng.randrange(900, 5000)) for i in range(14)]
        self.public_doc_weights = [1 / (i + 1) ** 0.9 for i in range(14)]
        self.templates = [token_run(seed, "template", i, n=self.rng.randrange(600, 2500)) for i in range(5)]
        self.playground_prompt = token_run(seed, "playground-system", n=700)
        self.accounts: list[Account] = []
        self.special: dict[str, Any] = {}
        self._ids: set[str] = set()

    # -- helpers
    def account_name(self) -> str:
        while True:
            name = "org-" + "".join(self.rng.choice("0123456789abcdef") for _ in range(6))
            if name not in self._ids:
                self._ids.add(name)
                return name

    def rid(self) -> str:
        return "chatcmpl-" + "".join(self.rng.choice("0123456789abcdef") for _ in range(24))

    def text(self, *labels: object, n: int) -> array:
        return token_run(self.seed, *labels, n=n)

    def day_time(self, start: float = T0_S, end: float = END_S) -> float:
        """A time weighted by a diurnal profile (busiest around 14:00 UTC)."""
        while True:
            t = self.rng.uniform(start, end)
            h = (t - T0_S) / 3600 % 24
            if self.rng.random() < 0.25 + 0.75 * math.exp(-(((h - 14) / 5.5) ** 2)):
                return t

    def add(
        self,
        t: float,
        acct: Account,
        kind: str,
        pieces: list[Any],
        max_tokens: int,
        completion: int,
        session: str,
        **kw: Any,
    ) -> Req:
        r = Req(
            len(self.reqs),
            self.rid(),
            t,
            acct,
            kind,
            pieces,
            max_tokens,
            min(completion, max_tokens),
            session=session,
            **kw,
        )
        self.reqs.append(r)
        return r

    def send(
        self, t: float, acct: Account, kind: str, pieces: list[Any], max_tokens: int, completion: int, session: str
    ) -> Req:
        """One turn as the client sends it, with the account's duplicate sends and retries (ref §4)."""
        if self.rng.random() < acct.retry_p:
            if self.rng.random() < 0.75:  # a duplicate send: the same request again, both answered
                self.add(t, acct, kind, pieces, max_tokens, completion, session)
                return self.add(t + self.rng.uniform(0.05, 3.0), acct, kind, pieces, max_tokens, completion, session)
            timeout = self.rng.choice([15.0, 20.0, 30.0])  # the client gave up, then sent it again
            self.add(t, acct, kind, pieces, max_tokens, completion, session, status=499, client_timeout_s=timeout)
            return self.add(t + timeout + self.rng.uniform(0.5, 5), acct, kind, pieces, max_tokens, completion, session)
        return self.add(t, acct, kind, pieces, max_tokens, completion, session)

    def answer_len(self) -> int:
        return int(min(1500, self.rng.lognormvariate(5.0, 0.8)))

    # -- accounts
    def make_accounts(self) -> None:
        rng = self.rng
        for _ in range(140):
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
        for acct in rng.sample(self.accounts, 3):  # flaky clients: many duplicate sends and retries
            acct.retry_p = 0.2
        self.special["retries"] = sorted(a.name for a in self.accounts if a.retry_p > 0.1)
        copy = rng.sample([a for a in self.accounts if a.retry_p < 0.1], 4)  # paste the playground's prompt
        self.special["playground_copies"] = sorted(a.name for a in copy)
        for name in ("playground-web", "playground-docs"):
            self._ids.add(name)
            self.accounts.append(Account(name, gateway_salt(name), "playground"))
        for role in ("harness_mc", "harness_gen", "keepalive", "autocomplete", "autocomplete", "prober", "victim"):
            name = self.account_name()
            self.accounts.append(Account(name, gateway_salt(name), role, stickiness=0.5))

    def by_role(self, role: str) -> list[Account]:
        return [a for a in self.accounts if a.role == role]

    # -- traffic classes
    def plan(self) -> list[Req]:
        self.make_accounts()
        n = self.n
        self.plan_keepalive()
        self.plan_playground(self.by_role("playground"), int(0.025 * n), "playground")
        copies = set(self.special["playground_copies"])
        self.plan_playground([a for a in self.accounts if a.name in copies], int(0.008 * n), "playground_copy")
        self.plan_harness(int(0.04 * n), int(0.03 * n))
        self.plan_autocomplete(int(0.06 * n))
        self.plan_victim()
        self.plan_prober_cover()
        self.plan_customers(n - len(self.reqs))
        self.reqs.sort(key=lambda r: (r.t, r.idx))
        for i, r in enumerate(self.reqs):
            r.idx = i
        return self.reqs

    def plan_keepalive(self) -> None:
        acct = self.by_role("keepalive")[0]
        period = 60.0 * DEFAULT_REQUESTS / self.n  # every minute at the default size
        prompt = [
            array("I", [BOS]),
            system_block(self.text("keepalive", n=170)),
            user_block(self.text("ping", n=3)),
            ASSISTANT_HEADER,
        ]
        t = T0_S + self.rng.uniform(0, period)
        self.special["keep_alive"] = {"account": acct.name, "period_s": period}
        while t < END_S:
            self.add(t + self.rng.uniform(-0.2, 0.2), acct, "keepalive", prompt, 1, 1, "keepalive")
            t += period

    def chat_session(
        self,
        acct: Account,
        t: float,
        kind: str,
        head: list[Any],
        first_user: array,
        turns: int,
        think: tuple[float, float],
        label: str,
    ) -> float:
        pieces = list(head) + [user_block(first_user), ASSISTANT_HEADER]
        session = f"{acct.name}/{label}/{self.rng.randrange(1 << 30)}"
        for turn in range(turns):
            if t >= END_S:
                break
            r = self.send(t, acct, kind, list(pieces), 2048, self.answer_len(), session)
            pieces = pieces + [("out", r), array("I", [EOT])]
            pieces += [user_block(self.text("msg", session, turn, n=self.rng.randrange(15, 300))), ASSISTANT_HEADER]
            t += self.rng.uniform(*think)
        return t

    def plan_playground(self, accts: list[Account], budget: int, kind: str) -> None:
        """The public playground prompt, from the playground itself or pasted by customers."""
        start = len(self.reqs)
        head = [array("I", [BOS]), system_block(self.playground_prompt)]
        while len(self.reqs) - start < budget:
            acct = self.rng.choice(accts)
            msg = self.text(kind, len(self.reqs), n=self.rng.randrange(10, 400))
            self.chat_session(acct, self.day_time(), kind, head, msg, self.rng.randrange(1, 4), (20, 200), kind)

    def plan_harness(self, n_mc: int, n_gen: int) -> None:
        """Two evaluation harnesses: one template each, many items, short answers (ref §4)."""
        mc, gen = self.by_role("harness_mc")[0], self.by_role("harness_gen")[0]
        mc_head = [array("I", [BOS]), system_block(self.text("harness-mc-template", n=1800))]
        gen_head = [array("I", [BOS]), system_block(self.text("harness-gen-template", n=900))]
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
        """IDE completion: an own context that grows a little between requests (ref §4)."""
        accts = self.by_role("autocomplete")
        start = len(self.reqs)
        heads = {a.name: [array("I", [BOS]), system_block(self.text("ide", a.name, n=400))] for a in accts}
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
        """The prober's target: a private document that opens with its firm's public letterhead."""
        victim = self.by_role("victim")[0]
        letterhead = self.text("victim-letterhead", n=4 * PAGE - 5)  # with BOS + user header: 4 pages
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
            self.chat_session(
                victim, t, "private_doc", [array("I", [BOS])], doc + q, self.rng.randrange(2, 4), (60, 400), "vdoc"
            )

    def plan_prober_cover(self) -> None:
        prober = self.by_role("prober")[0]
        prober.system = self.text("system", prober.name, n=300)
        for _ in range(8):
            t = self.rng.uniform(T0_S + 2 * 86400, T0_S + 4 * 86400)
            head = [array("I", [BOS]), system_block(prober.system)]
            self.chat_session(
                prober, t, "chat", head, self.text("pmsg", t, n=120), self.rng.randrange(1, 3), (30, 90), "cover"
            )

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
            own_head: list[Any] = [array("I", [BOS])] + ([system_block(acct.system)] if acct.system else [])
            if kind == "chat":
                msg = self.text("msg0", acct.name, t, n=self.rng.randrange(15, 400))
                self.chat_session(acct, t, "chat", own_head, msg, self.rng.randrange(1, 9), (15, 400), "chat")
            elif kind == "public_doc":
                doc = self.rng.choices(self.public_docs, self.public_doc_weights)[0]
                q = self.text("pq", acct.name, t, n=self.rng.randrange(10, 120))
                head = [array("I", [BOS])] if acct.doc_first else own_head
                self.chat_session(acct, t, "public_doc", head, doc + q, self.rng.randrange(1, 5), (30, 600), "pdoc")
            elif kind == "template":
                tpl = self.rng.choice(self.templates)
                head = [array("I", [BOS]), system_block(tpl)]
                task = self.text("task", acct.name, t, n=self.rng.randrange(30, 500))
                self.chat_session(acct, t, "template", head, task, self.rng.randrange(1, 4), (5, 60), "tpl")
            else:
                doc = self.rng.choice(acct.private_docs)
                q = self.text("dq", acct.name, t, n=self.rng.randrange(10, 120))
                head = [array("I", [BOS])] if acct.doc_first else own_head
                self.chat_session(acct, t, "private_doc", head, doc + q, self.rng.randrange(1, 6), (30, 900), "doc")


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


def server_args_line(s: Startup) -> str:
    """The launcher's ``server_args=ServerArgs(...)`` dump (logs §1.2, up to 0.5.15; kept by 0.5.18 here)."""
    backend = repr(s.backend) if s.backend else "None"
    kv_events = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"})
    fields = [
        f"model_path='{MODEL_PATH}'",
        f"tokenizer_path='{MODEL_PATH}'",
        "tokenizer_mode='auto'",
        "skip_tokenizer_init=False",
        "load_format='auto'",
        "trust_remote_code=False",
        f"context_length={CONTEXT_LENGTH}",
        "is_embedding=False",
        "revision=None",
        "model_impl='auto'",
        "host='0.0.0.0'",
        "port=30000",
        "dtype='auto'",
        "quantization=None",
        "kv_cache_dtype='auto'",
        "mem_fraction_static=0.88",
        "max_running_requests=256",
        "max_queued_requests=None",
        "max_total_tokens=None",
        "chunked_prefill_size=8192",
        "max_prefill_tokens=16384",
        "schedule_policy='lpm'",
        "page_size=64",
        "device='cuda'",
        f"tp_size={TP_SIZE}",
        "pp_size=1",
        "stream_interval=1",
        "random_seed=1234",
        "log_level='info'",
        "log_requests=False",
        "log_requests_level=0",
        "enable_metrics=True",
        "enable_cache_report=True",
        f"served_model_name='{MODEL}'",
        "dp_size=1",
        "load_balance_method='round_robin'",
        "dist_init_addr=None",
        "nnodes=1",
        "node_rank=0",
        "attention_backend='fa3'",
        "enable_dp_attention=False",
        "disable_radix_cache=False",
        "enable_hierarchical_cache=True",
        f"hicache_ratio={HICACHE_RATIO}",
        "hicache_size=0",
        "hicache_write_policy='write_through'",
        "hicache_io_backend='kernel'",
        "hicache_mem_layout='page_first'",
        f"hicache_storage_backend={backend}",
        "hicache_storage_prefetch_policy='best_effort'",
        "hicache_storage_backend_extra_config=None",
        "enable_lmcache=False",
        f"kv_events_config='{kv_events}'",
        "allow_auto_truncate=False",
        "disaggregation_mode='null'",
        "disaggregation_transfer_backend='mooncake'",
        "disaggregation_bootstrap_port=8998",
    ]
    return f"{log_stamp(s.start)} server_args=ServerArgs({', '.join(fields)})"


def startup_lines(s: Startup, pool: int) -> list[tuple[float, str]]:
    """One start-up as SGLang logs it (logs §1.2), every TP rank for the model-runner lines."""
    out: list[tuple[float, str]] = [(s.start, server_args_line(s))]
    t = s.start + 4
    span = s.ready - s.start
    kv_gb = pool * 80 * (8 // TP_SIZE) * 128 * 2 / 1e9  # K (or V): 80 layers, 8 KV heads over TP, bf16
    steps = [
        (0.02, "Init torch distributed begin."),
        (0.05, "Load weight begin. avail mem=78.51 GB"),
        (
            0.55,
            f"Load weight end. elapsed={span * 0.5:.2f} s, type=LlamaForCausalLM, avail mem=41.36 GB, mem usage=37.15 GB.",
        ),
        (
            0.56,
            f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {pool}, K size: {kv_gb:.2f} GB, V size: {kv_gb:.2f} GB",
        ),
        (0.56, f"Memory pool end. avail mem={41.36 - 2 * kv_gb:.2f} GB"),
        (0.58, f"Capture decode CUDA graph begin. backend=full, num_tokens=256, avail mem={41.31 - 2 * kv_gb:.2f} GB"),
        (
            0.85,
            f"Capture decode CUDA graph end. elapsed={span * 0.27:.2f} s, mem usage=0.46 GB, "
            f"avail mem={40.85 - 2 * kv_gb:.2f} GB.",
        ),
    ]
    for frac, text in steps:
        for rank in range(TP_SIZE):
            out.append((t + frac * span + rank * 0.01, f"{log_stamp(t + frac * span, rank)} {text}"))
    tl = s.start + 0.9 * span
    out.append(
        (
            tl,
            f"{log_stamp(tl, 0)} max_total_num_tokens={pool}, chunked_prefill_size=8192, "
            f"max_prefill_tokens=16384, max_running_requests=256, context_len={CONTEXT_LENGTH}, "
            f"available_gpu_mem={40.85 - 2 * kv_gb:.2f} GB",
        )
    )
    tu = s.ready - 1
    out.append((tu, f"{log_stamp(tu)} INFO:     Started server process [{s.pid}]"))
    out.append((tu, f"{log_stamp(tu)} INFO:     Waiting for application startup."))
    out.append((tu, f"{log_stamp(tu)} INFO:     Application startup complete."))
    out.append((tu, f"{log_stamp(tu)} INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)"))
    out.append((s.ready, f"{log_stamp(s.ready)} The server is fired up and ready to roll!"))
    if s.shutdown is not None:
        for k, text in enumerate(
            (
                "INFO:     Shutting down",
                "INFO:     Waiting for application shutdown.",
                "INFO:     Application shutdown complete.",
                f"INFO:     Finished server process [{s.pid}]",
            )
        ):
            tt = s.shutdown + k * 0.5
            out.append((tt, f"{log_stamp(tt)} {text}"))
    return out


class KvArchive:
    """A ZMQ subscriber's archive: one JSON object per message, the batch positional (ref §1)."""

    def __init__(
        self, path: Path, instance: str, gaps: list[tuple[float, int]], rng: random.Random, step_s: float
    ) -> None:
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
        self.seq = 0  # _seq_gen = count() in the publisher's constructor (ref §1)
        self.endpoint = f"tcp://{s.ip}:5557"

    def publish(self, ts: float, events: list[Any]) -> None:
        """Events of one scheduler step go out as one batch: those published within step_s of the first."""
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
            "batch": [round(ts, 6), events, 0],
        }
        self.text.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.flush()
        self.text.close()
        self.raw.close()


@dataclass
class Flight:
    """A request in the engine: its tokens and page hashes while its pages are still being stored."""

    req: Req
    engine: Engine
    epoch: int
    tokens: array
    salted: list[int]
    keys: list[int]  # L3 keys: the token-only chain
    prompt_pages: int  # full pages of the prompt
    first_computed: int


class Engine:
    def __init__(self, name: str, archive: KvArchive, pool_tokens: int) -> None:
        self.name = name
        self.archive = archive
        self.device: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self.host: set[int] = set()
        self.host_only: OrderedDict[int, None] = OrderedDict()
        self.origin: dict[int, Req] = {}  # page hash -> owner of the foreign L3 page it was loaded from
        self.dev_cap = pool_tokens // PAGE
        self.host_cap = int(self.dev_cap * HICACHE_RATIO)
        self.epoch = -1
        self.startup: Startup | None = None
        self.log: list[tuple[float, str]] = []

    @property
    def l3(self) -> bool:
        return self.startup is not None and self.startup.backend is not None

    def reset(self) -> None:
        self.device.clear()
        self.host.clear()
        self.host_only.clear()
        self.origin.clear()

    # -- cache operations returning BlockRemoved events
    def evict_device(self, need: int) -> list[int]:
        removed = []
        while len(self.device) + need > self.dev_cap and self.device:
            h, _ = self.device.popitem(last=False)
            removed.append(h)
            if h in self.host:
                self.host_only[h] = None
            else:
                self.origin.pop(h, None)
        return removed

    def evict_host(self, need: int) -> list[int]:
        removed = []
        while len(self.host) + need > self.host_cap and self.host_only:
            h, _ = self.host_only.popitem(last=False)
            self.host.discard(h)
            self.origin.pop(h, None)
            removed.append(h)
        return removed

    def touch(self, hashes: list[int]) -> None:
        for h in reversed(hashes):  # leaves first, so a parent is always more recent than its child
            if h in self.device:
                self.device.move_to_end(h)


def runs(pages: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for p in pages:
        if out and out[-1][-1] == p - 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def stored_events(f: Flight, pages: list[int], medium: str, salt: str | None) -> list[Any]:
    """BlockStored events, consecutive chained pages merged into one event (#31479)."""
    events: list[Any] = []
    for run in runs(pages):
        first, last = run[0], run[-1]
        parent = f.salted[first - 1] if first > 0 else None
        ev: list[Any] = [
            "BlockStored",
            [f.salted[p] for p in run],
            parent,
            f.tokens[first * PAGE : (last + 1) * PAGE].tolist(),
            PAGE,
            None,
            medium,
        ]
        if salt is not None:
            ev.append({"cache_salt": salt})  # salted stores carry a metadata map (#30827): 8 elements
        events.append(ev)
    return events


def removed_event(hashes: list[int], medium: str) -> list[Any]:
    return [["BlockRemoved", hashes, medium]] if hashes else []


# --------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------

ARRIVE, SCHED, PREFILL, BACKUP, FINISH, STARTUP, FLUSH, PROBE = range(8)


class Prober:
    """Reads the victim's document back through the shared store (ref §4): a known prefix plus
    candidate continuations that differ in a few tokens of one block, max_tokens 1, the prefix growing
    by one block after each hit."""

    def __init__(self, seed: int, account: Account, victim: Account, doc: array, start: float) -> None:
        self.rng = random.Random(sub_seed(seed, "prober"))
        self.account = account
        self.victim = victim
        self.prompt = array("I", [BOS, SH, USER, EH, NL2]) + doc  # the victim's prompt opens like this
        self.block = 4  # the letterhead (pages 0-3) is public: the prober knows it
        self.max_block = min(4 + 14, len(self.prompt) // PAGE - 1)
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
        true = self.prompt[self.block * PAGE : (self.block + 1) * PAGE]
        cands = [true]
        for _ in range(self.rng.randrange(2, 8)):
            wrong = array("I", true)
            for pos in self.rng.sample(range(PAGE), self.rng.randrange(1, 4)):
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
            self.new_candidates_same_block()
        cand = self.candidates.pop(0)
        return [self.prompt[: self.block * PAGE], cand, self.filler]

    def new_candidates_same_block(self) -> None:
        cycle = self.cycle
        self.new_candidates()
        self.cycle = cycle

    def observe(self, req: Req) -> None:
        self.probes.append(req.idx)
        if req.cached_tokens >= (self.block + 1) * PAGE:
            self.hits.append(req.idx)
            self.read_blocks.append(self.block)
            self.block += 1
            if self.block > self.max_block:
                self.done = True
            else:
                self.new_candidates()


class Simulation:
    def __init__(
        self, seed: int, out: Path, dep: Deployment, planner: Planner, with_content: bool, step_s: float
    ) -> None:
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
        self.l3: dict[int, tuple[Req, float, str]] = {}  # token-chain key -> (owner request, written at, instance)
        self.salt_ids: dict[str, int] = {}
        self.stored_by_salt: set[int] = set()  # (token-chain key, salt) pairs any instance has stored
        self.heap: list[tuple[float, int, int, Any]] = []
        self.counter = 0
        self.canary_prompt = array("I", [BOS]) + token_run(seed, "canary", n=319)
        self.content = None
        if with_content:
            (out / "content").mkdir(parents=True, exist_ok=True)
            raw = (out / "content" / "prompts.jsonl.gz").open("wb")
            self.content = (
                raw,
                io.TextIOWrapper(
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0), encoding="utf-8", newline="\n"
                ),
            )
        victim = planner.by_role("victim")[0]
        self.prober = Prober(
            seed,
            planner.by_role("prober")[0],
            victim,
            planner.special["victim_doc"],
            T0_S + 2 * 86400 + 21 * 3600 + self.rng.uniform(0, 1200),
        )
        self.internal_names = {a.name for a in planner.accounts if a.internal}
        self.flushed_at: float | None = None

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, self.counter, kind, payload))

    # -- tokens
    def resolve(self, pieces: list[Any]) -> array:
        out = array("I")
        for p in pieces:
            if isinstance(p, tuple):
                out += self.output_tokens(p[1])
            else:
                out += p
        return out

    def output_tokens(self, r: Req) -> array:
        if r.output is None:
            r.output = token_run(self.seed, "output", r.rid, n=max(r.completion, 1))
        return r.output

    # -- schedule
    def run(self) -> None:
        for _inst, rows in self.dep.startups.items():
            for s in rows:
                self.push(s.start, STARTUP, s)
        self.push(self.dep.flush[1], FLUSH, self.dep.flush[0])
        for r in self.reqs:
            self.push(r.t, ARRIVE, r)
        self.push(self.prober.start, PROBE, None)
        # the provider's canary: each instance, every 15 min, straight to the engine without a salt
        for k, inst in enumerate(INSTANCES):
            t = T0_S + k * 97.0
            while t < END_S:
                if self.dep.serving(inst, t):
                    acct = Account("canary", "", "canary")
                    r = Req(-1, f"canary-{inst}-{int(t)}", t, acct, "canary", [self.canary_prompt], 8, 8, gateway=False)
                    r.instance = inst
                    self.push(t, SCHED, r)
                t += 900
        handlers = {
            ARRIVE: self.on_arrive,
            SCHED: self.on_sched,
            PREFILL: self.on_prefill,
            BACKUP: self.on_backup,
            FINISH: self.on_finish,
            STARTUP: self.on_startup,
            FLUSH: self.on_flush,
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
        e.reset()  # a restart starts with empty device and host caches (ref §2)
        e.epoch += 1
        e.startup = s
        e.archive.restart(s)
        e.log.extend(startup_lines(s, self.dep.pool_tokens))

    def on_flush(self, t: float, inst: str) -> None:
        e = self.engines[inst]
        e.reset()  # POST /flush_cache clears the host pool too (ref §1)
        e.archive.publish(t, [["AllBlocksCleared"]])
        e.log.append((t, f"{log_stamp(t)} INFO:     10.42.0.5:51234 - \"POST /flush_cache HTTP/1.1\" 200 OK"))
        self.flushed_at = t

    def route(self, r: Req) -> str | None:
        up = self.dep.up_instances(r.t)
        if not up:
            return None
        home = INSTANCES[sub_seed(0, r.session) % len(INSTANCES)]
        if home in up and self.rng.random() < r.account.stickiness:
            return home
        return self.rng.choice(up)

    def on_arrive(self, t: float, r: Req) -> None:
        inst = self.route(r)
        if inst is None:  # nothing serving: the gateway answers 503 without an upstream
            r.status = 503
            r.instance = ""
            return
        r.instance = inst
        queue = self.rng.lognormvariate(math.log(0.03), 0.8)  # queueing as noise
        self.push(t + queue, SCHED, r)

    def on_probe(self, t: float, _: Any) -> None:
        pieces = self.prober.next_pieces()
        if pieces is None:
            return
        p = self.planner
        r = Req(len(self.reqs), p.rid(), t, self.prober.account, "probe", pieces, 1, 1, session="probe")
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
        n_pages = len(tokens) // PAGE
        prompt_pages = plen // PAGE
        salted = chain_hashes(tokens, n_pages, chain_seed(salt))
        keys = chain_hashes(tokens, n_pages, b"") if salt is not None else salted
        f = Flight(r, e, e.epoch, tokens, salted, keys, prompt_pages, 0)
        r.prompt_tokens = plen
        if self.content is not None and r.gateway:
            self.content[1].write(
                json.dumps({"request_id": r.rid, "prompt_token_ids": prompt.tolist()}, separators=(",", ":")) + "\n"
            )
        # device + host lookup in the request's namespace; at least one prompt token is computed
        matchable = (plen - 1) // PAGE
        i = 0
        host_hits: list[int] = []
        while i < matchable:
            h = salted[i]
            if h in e.device:
                if host_hits:
                    break
            elif h in e.host:
                host_hits.append(i)
            else:
                break
            i += 1
        matched = i
        dev_hits = matched - len(host_hits)
        # storage (L3) prefetch: only with the backend, only above the threshold (ref §2)
        l3_pages: list[int] = []
        if e.l3 and plen - matched * PAGE >= PREFETCH_THRESHOLD:
            j = matched
            while j < matchable and keys[j] in self.l3 and salted[j] not in e.device and salted[j] not in e.host:
                l3_pages.append(j)
                j += 1
            if l3_pages and self.rng.random() < 0.04:  # best_effort: the prefetch was cut short
                l3_pages = l3_pages[: self.rng.randrange(0, len(l3_pages))]
        e.touch(salted[:dev_hits])
        for p in range(dev_hits):
            o = e.origin.get(salted[p])
            if o is not None:
                r.secondary_from.add(o.account.name)
        for p in host_hits:  # about to be loaded back: no longer host-only, not evictable from host
            e.host_only.pop(salted[p], None)
            o = e.origin.get(salted[p])
            if o is not None:
                r.secondary_from.add(o.account.name)
        events: list[Any] = []
        if l3_pages:
            # the prefetch refills host memory: CPU_PINNED stores of pages held nowhere (requester's namespace)
            events += removed_event(e.evict_host(len(l3_pages)), "CPU_PINNED")
            for p in l3_pages:
                e.host.add(salted[p])
                owner, wrote_at, wrote_on = self.l3[keys[p]]
                r.l3_owners.append((p, owner, wrote_at, wrote_on))
                if self.content_key(keys[p], salt) in self.stored_by_salt:
                    r.l3_known.add(p)
                if self.foreign(owner, r):
                    e.origin[salted[p]] = owner
            events += stored_events(f, l3_pages, "CPU_PINNED", salt)
        loads = host_hits + l3_pages
        if loads:
            events += removed_event(e.evict_device(len(loads)), "GPU")
            for p in loads:
                e.device[salted[p]] = None
            events += stored_events(f, loads, "GPU", salt)  # loaded back to the device (ref §2)
            self.stored_by_salt.update(self.content_key(keys[p], salt) for p in l3_pages)
        e.touch(salted[: matched + len(l3_pages)])
        if events:
            e.archive.publish(t, events)
        cached_pages = matched + len(l3_pages)
        r.cached_tokens = cached_pages * PAGE
        r.device_pages, r.host_pages, r.l3_pages = dev_hits, len(host_hits), l3_pages
        r.served = True
        if dev_hits and r.account.salt and r.kind in PUBLIC_TEXT_KINDS:
            r.public_same_namespace = True
        new_tokens = plen - r.cached_tokens
        prefill = 0.004 + new_tokens * 6e-5 + (new_tokens**2) * 2e-10 + len(host_hits) * 1e-4 + len(l3_pages) * 4e-4
        first = t + prefill + 0.02
        r.ttft_ms = round((first - r.t) * 1000, 1)
        decode = (r.completion - 1) * self.rng.uniform(0.018, 0.03)
        if r.status == 499:
            r.latency_ms = r.client_timeout_s * 1000
        else:
            r.latency_ms = round((first + decode - r.t) * 1000 + self.rng.uniform(1, 15), 1)
        running = self.rng.randrange(0, 24)
        e.log.append(
            (
                t,
                f"{log_stamp(t, 0)} Prefill batch, #new-seq: 1, #new-token: {new_tokens}, "
                f"#cached-token: {r.cached_tokens}, token usage: {len(e.device) / e.dev_cap:.2f}, "
                f"#running-req: {running}, #queue-req: 0, #pending-token: 0, cuda graph: False, "
                f"input throughput (token/s): {new_tokens / max(prefill, 1e-3):.2f}",
            )
        )
        f.first_computed = cached_pages
        self.push(t + prefill, PREFILL, f)
        if r.gateway:
            ip = f"10.42.0.{21 + r.idx % 3}"  # the gateway's three pods
            e.log.append(
                (
                    r.t + r.latency_ms / 1000,
                    f"{log_stamp(r.t + r.latency_ms / 1000)} INFO:     {ip}:"
                    f"{40000 + r.idx % 20000} - \"POST /v1/chat/completions HTTP/1.1\" 200 OK",
                )
            )
        if r.kind == "probe":
            self.prober.observe(r)
            self.push(r.t + r.latency_ms / 1000 + self.prober.rng.uniform(0.05, 0.6), PROBE, None)

    @staticmethod
    def foreign(owner: Req, r: Req) -> bool:
        """Another salt, and neither an internal account nor a shared namespace (ref §3)."""
        o = owner.account
        return o.salt != r.account.salt and o.role != "canary" and not o.internal and o.salt != SHARED_NAMESPACE

    def content_key(self, key: int, salt: str | None) -> int:
        sid = self.salt_ids.setdefault(salt or "", len(self.salt_ids))
        return (key << 24) | sid

    def insert_device(self, f: Flight, pages: list[int], t: float) -> None:
        e = f.engine
        r = f.req
        new = [p for p in pages if f.salted[p] not in e.device and f.salted[p] not in e.host]
        reload = [p for p in pages if f.salted[p] not in e.device and f.salted[p] in e.host]
        # a page evicted from the device but still in host memory and recomputed emits nothing (#32537)
        events = removed_event(e.evict_device(len(new) + len(reload)), "GPU")
        for p in new + reload:
            e.device[f.salted[p]] = None
            e.host_only.pop(f.salted[p], None)
        e.touch([f.salted[p] for p in pages])
        events += stored_events(f, new, "GPU", r.account.salt or None)
        self.stored_by_salt.update(self.content_key(f.keys[p], r.account.salt) for p in new)
        e.archive.publish(t, events)
        if new:
            self.push(t + self.rng.uniform(0.004, 0.05), BACKUP, (f, new))

    def on_prefill(self, t: float, f: Flight) -> None:
        if f.epoch != f.engine.epoch:
            return
        self.insert_device(f, list(range(f.first_computed, f.prompt_pages)), t)
        r = f.req
        if r.status == 200 and len(f.salted) > f.prompt_pages:
            self.push(r.t + r.latency_ms / 1000, FINISH, f)

    def on_finish(self, t: float, f: Flight) -> None:
        if f.epoch != f.engine.epoch:
            return
        self.insert_device(f, list(range(f.prompt_pages, len(f.salted))), t)

    def on_backup(self, t: float, payload: tuple[Flight, list[int]]) -> None:
        f, pages = payload
        e = f.engine
        if f.epoch != e.epoch:
            return
        todo = [p for p in pages if f.salted[p] in e.device and f.salted[p] not in e.host]
        if not todo:
            return
        events = removed_event(e.evict_host(len(todo)), "CPU_PINNED")
        for p in todo:
            e.host.add(f.salted[p])
        events += stored_events(f, todo, "CPU_PINNED", f.req.account.salt or None)  # write_through backup
        e.archive.publish(t, events)
        if e.l3:  # the backup also goes to the shared store, keyed by tokens only, with no event
            owner = f.req
            for p in todo:
                k = f.keys[p]
                if k not in self.l3:
                    self.l3[k] = (owner, t + 0.01, e.name)


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
    if rng.random() < 0.02:  # a client's own salt, overwritten by the gateway (ref §3)
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
    return f"""# Written by tests/hicache_reference/generate.py; truth.json is deliberately not referenced.
[incident]
id = "hicache-l3-salt-blind"
title = "{MODEL}: HiCache shared L3 store served pages across tenants"

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
path = "engines/*/sglang.log.gz"
format = "sglang"
timezone = "UTC"
instance = "{{parent}}"

[[sources]]
name = "kv-events"
kind = "kv_events"
path = "kv-events/*.jsonl.gz"
columns = {{ ts = "batch.0", events = "batch.1", dp_rank = "batch.2", instance = "instance", seq = "seq" }}
{content}
[scope]
internal_accounts = ["{INTERNAL_PATTERN}"]

[prefix_cache]
tenants = "multi"
cache_salt = "gateway"
engine_version = "0.5.18"
shared_namespaces = ["{SHARED_NAMESPACE}"]
"""


def window_rows(dep: Deployment) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for inst, rows in dep.startups.items():
        out[inst] = []
        for k, s in enumerate(rows):
            if s.backend is None:
                continue
            nxt = rows[k + 1] if k + 1 < len(rows) else None
            out[inst].append(
                {
                    "start": iso(s.start),
                    "ready": iso(s.ready),
                    "end": iso(nxt.start) if nxt else None,
                    "process_end": iso(s.shutdown) if s.shutdown is not None else None,
                    "storage_backend": s.backend,
                }
            )
    return out


def in_window(dep: Deployment, inst: str, t: float) -> bool:
    rows = dep.startups[inst]
    for k, s in enumerate(rows):
        end = rows[k + 1].start if k + 1 < len(rows) else math.inf
        if s.backend is not None and s.start <= t < end:
            return True
    return False


def build_truth(
    sim: Simulation, dep: Deployment, planner: Planner, seed: int, n: int, with_content: bool
) -> dict[str, Any]:
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
        foreign_pages = []
        own = shared = False
        for p, o, wrote_at, wrote_on in r.l3_owners:
            if sim.foreign(o, r):
                foreign_pages.append(
                    {
                        "position": p,
                        "source_account": o.account.name,
                        "source_request_id": o.rid,
                        "source_salt": o.account.salt,
                        "written_by": wrote_on,
                        "written_at": iso(wrote_at),
                        "requester_stored_same_tokens_before": p in r.l3_known,
                    }
                )
            elif o.account.salt == r.account.salt:
                own = True
            else:
                shared = True
        if foreign_pages:
            row = {
                "account": r.account.name,
                "account_class": "internal" if r.account.internal else "customer",
                "ts": iso(r.t),
                "instance": r.instance,
                "status": r.status,
                "cached_tokens": r.cached_tokens,
                "prompt_tokens": r.prompt_tokens,
                "l3_loaded_pages": r.l3_pages,
                "foreign_pages": foreign_pages,
                "source_accounts": sorted({fp["source_account"] for fp in foreign_pages}),
                "kind": r.kind,
                "requester_stored_same_tokens_before": all(
                    fp["requester_stored_same_tokens_before"] for fp in foreign_pages
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
            elif r.public_same_namespace and r.device_pages + r.host_pages > 0:
                public_same.append(r.rid)
    pr = sim.prober
    prober = {
        "account": pr.account.name,
        "victim": pr.victim.name,
        "victim_document_requests": sorted(r.rid for r in reqs if r.account is pr.victim and r.kind == "private_doc"),
        "known_prefix_pages": 4,
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
    for r in reqs:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    startups = {
        inst: [
            {
                "start": iso(s.start),
                "ready": iso(s.ready),
                "shutdown": iso(s.shutdown) if s.shutdown is not None else None,
                "storage_backend": s.backend,
                "endpoint": f"tcp://{s.ip}:5557",
            }
            for s in rows
        ]
        for inst, rows in dep.startups.items()
    }
    return {
        "generator": {
            "name": "tests/hicache_reference/generate.py",
            "seed": seed,
            "requests": n,
            "with_content": with_content,
        },
        "definitions": {
            "affected_requests": "gateway requests (any status) whose cached_tokens include pages their lookup "
            "loaded from the shared L3 store (device+host miss in their salt, >= 256 tokens "
            "left, backend on the instance's start-up) whose first writer had another salt "
            "and was neither internal nor in a shared namespace (ref 2-3, #26747)",
            "source_accounts": "the accounts whose requests first computed, backed up and wrote those pages",
            "exposure_windows": "per instance: the start-up with hicache_storage_backend, from its server_args line "
            "to the server_args line of the start-up that removed it (process_end: its "
            "shutdown line)",
            "not_affected": "own-namespace device/host hits (also of public text other tenants have cached), "
            "L3 loads of own pages, loads of the playground's pages, own-namespace copies of "
            "pages an earlier foreign load brought in",
        },
        "deployment": {
            "model": MODEL,
            "engine": "sglang",
            "engine_version": "0.5.18",
            "instances": list(INSTANCES),
            "page_size": PAGE,
            "prefetch_threshold_tokens": PREFETCH_THRESHOLD,
            "kv_pool_tokens": dep.pool_tokens,
            "device_pages": dep.pool_tokens // PAGE,
            "host_pages": int(dep.pool_tokens // PAGE * HICACHE_RATIO),
            "startups": startups,
            "flush": {"instance": dep.flush[0], "ts": iso(dep.flush[1])},
            "l3_objects": len(sim.l3),
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
    each instance's device pool (default: scaled with ``requests``, 196,608 to 430,080 tokens); the
    host pool is twice it. ``step_s``: events published within this many seconds of a batch's first
    go out in that batch, as one scheduler step's events do (0: a batch per request phase).
    """
    if requests < 500:
        raise ValueError("requests: at least 500")
    if kv_pool_tokens is not None and (kv_pool_tokens % PAGE or kv_pool_tokens <= CONTEXT_LENGTH):
        raise ValueError(f"kv_pool_tokens: a multiple of {PAGE} above the context length {CONTEXT_LENGTH}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dep = plan_deployment(seed, pool_tokens_for(requests) if kv_pool_tokens is None else kv_pool_tokens)
    planner = Planner(seed, requests, dep)
    planner.plan()
    sim = Simulation(seed, out, dep, planner, with_content, step_s)
    sim.run()
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
        write_gz_lines(out / "engines" / name / "sglang.log.gz", iter(lines))
    (out / "incident.toml").write_text(incident_toml(with_content))
    truth = build_truth(sim, dep, planner, seed, requests, with_content)
    truth["generator"].update({"kv_pool_tokens": dep.pool_tokens, "step_s": step_s})
    (out / "truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n")
    return truth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
