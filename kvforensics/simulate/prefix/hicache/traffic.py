"""The traffic of the ``prefix-hicache-l3`` incident, streamed in arrival order in bounded memory.

Words stand for tokens (the seeded vocabulary of :mod:`kvforensics.simulate.prefix.workload`), so a
prompt's text and its ``prompt_token_ids`` agree word for word. Every account's requests carry the
salt the gateway sets for it; the public playground's users share one namespace, ``playground``,
which the provider documents as shared.

* **Tenants**: Zipf-distributed rates (the calibration's exponent) and its hour-of-day profile. The
  hosted assistant's tenants start with the provider-wide system prompt; others build on one of four
  public framework templates, paste one of forty public documents, or send only their own documents.
  Chats of one to four turns resend their earlier turns and answers.
* **Playground** users (shared namespace): the playground's public prompt, sometimes a public document.
* **The provider's account** (internal): warms every instance with the system prompt as it starts,
  before it takes traffic, and every hour.
* **Look-alikes**: two evaluation harnesses (one template each, many items, ``max_tokens`` 1), retrying
  clients (a request that timed out, 504, sent again identical), keep-alive pings (one fixed prompt,
  one token out) and autocomplete clients (their own growing buffer, a few tokens out).
* **The prober** reads another tenant's document back through the shared store while every instance
  has it (PromptPeek, NDSS 2025; arXiv 2409.20002; arXiv 2411.18191): a known prefix, then for the
  next page candidates that differ in a few of its tokens, each with ``max_tokens`` 1 and a tail long
  enough for the store to be asked (the 256-token prefetch threshold, sgl-project/sglang#12092); a
  candidate whose page comes back in ``cached_tokens`` is kept and the prefix grows by one page.

Sessions are planned in a first pass over a dedicated random stream (who, how many requests), so the
request count is exact; their start times are the order statistics of uniform draws, produced in
increasing order one at a time, mapped through the hour-of-day profile. A heap holds only the
sessions in flight.
"""

from __future__ import annotations

import heapq
import random
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from hashlib import blake2b

from kvforensics.simulate.calibration import ACCOUNT_ZIPF_EXPONENT, DIURNAL_BY_UTC_HOUR
from kvforensics.simulate.prefix.hicache.engine import PAGE_SIZE, Chains, salt_seed
from kvforensics.simulate.prefix.workload import Vocabulary, vocabulary

PROVIDER_ACCOUNT = "provider-warmup"
PLAYGROUND_SALT = "playground"
TENANTS = 120
PLAYGROUND_USERS = 24
SYSTEM_PROMPT_TOKENS = 192  # three pages
PLAYGROUND_PROMPT_TOKENS = 160
TEMPLATES = 4
PUBLIC_DOCUMENTS = 40
PING_PROMPT_TOKENS = 140
EVAL_TEMPLATE_TOKENS = 384
PROBE_KNOWN_PAGES = 3  # leading pages of the victim's document the prober already knows
PROBE_DEPTH = 12  # pages it tries to read back
PROBE_CANDIDATES = 8  # candidates per page
PROBE_GUESSED_TOKENS = 3  # tokens of the page the candidates differ in
PROBE_TAIL_TOKENS = 200  # after the candidate page: the store is asked only with >= 256 tokens left
PROBE_ROUND_RETRIES = 2  # a page with no hit is tried again after a pause, then given up
PROBE_CAP = PROBE_DEPTH * PROBE_CANDIDATES * (1 + PROBE_ROUND_RETRIES)
_RESERVED = ("warmup", "eval", "ping", "probe")  # counted before the sessions are planned


@dataclass(slots=True)
class Request:
    """One request as the client sent it: the prompt is ``tokens[:prompt]``, the answer the next
    ``output`` tokens (a session's buffer only grows, so a later turn shares the earlier one's array)."""

    ts: float
    account: str
    salt: str
    tokens: array
    prompt: int
    output: int
    max_tokens: int
    role: str  # chat, retry, playground, warmup, eval, ping, autocomplete, probe
    chains: Chains
    instance: str | None = None  # pinned (the provider's warm-ups)
    timed_out: bool = False  # prefilled, but the gateway gave up (504)
    observe: Callable[[Request, int, float], None] | None = None  # the prober reads the response
    request_id: str = ""


@dataclass
class Tenant:
    account: str
    salt: str
    seed: bytes  # the salted chain's first digest
    weight: float
    layout: str  # provider, template, public, plain, playground, autocomplete
    prefix: tuple[int, ...]
    documents: list[tuple[int, ...]]
    retries: bool = False


@dataclass
class Accounts:
    """Who the incident's accounts are (the ground truth's lists)."""

    internal: list[str] = field(default_factory=lambda: [PROVIDER_ACCOUNT])
    playground: list[str] = field(default_factory=list)
    evaluators: list[str] = field(default_factory=list)
    retriers: list[str] = field(default_factory=list)
    pingers: list[str] = field(default_factory=list)
    autocomplete: list[str] = field(default_factory=list)
    probers: list[str] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)


def tenant_salt(seed: int, account: str) -> str:
    """The salt the gateway sets for an account (stable per seed, unguessable from the name alone)."""
    return "ns-" + blake2b(f"{seed}:{account}".encode(), digest_size=8).hexdigest()


def _length(rng: random.Random, median: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(0.0, 0.6) * median)))


class Traffic:
    """Requests in arrival order (:meth:`pop`), with the prober fed back its responses."""

    def __init__(
        self,
        seed: int,
        requests: int,
        start: float,
        hours: int,
        start_hour: int,
        warmups: list[tuple[float, str]],
        probe_window: tuple[float, float],
    ) -> None:
        self.seed, self.total = seed, requests
        rng = random.Random(f"hicache-l3:{seed}:content")
        self.rng = rng
        self.vocab: Vocabulary = vocabulary(rng)
        self.ids = self.vocab.ids
        self.accounts = Accounts()
        self._heap: list[tuple[float, int, Request | None, Iterator[Request] | None]] = []
        self._order = 0
        self._pending: Iterator[Request] | None = None
        self.emitted = 0
        self._build_accounts(rng)
        # the fixed traffic: warm-ups, evaluation runs, pings; counted before the sessions are planned
        fixed: list[Iterator[Request]] = [self._warmups(warmups)]
        items = max(50, min(2500, requests // 200))
        for n, harness in enumerate(self.harnesses):
            for run in range(2):
                at = start + (6 + n * 9 + run * 22 + rng.random() * 4) * 3600
                fixed.append(self._evaluation(harness, at, items))
        pings = max(30, min(3000, requests * 3 // 1000))
        for pinger in self.pingers:
            fixed.append(self._pings(pinger, start, hours, pings))
        self.fixed_left = len(warmups) + 2 * len(self.harnesses) * items + pings * len(self.pingers)
        for source in fixed:
            self._advance(source)
        self.prober_left = PROBE_CAP
        prober = Prober(self, self.victim_document, probe_window)
        self.push(prober.first())
        # the sessions: planned (who, how many requests), then started at increasing times
        budget = requests - self.fixed_left
        self._sessions = self._plan(budget)
        self._start, self._hours = start, hours
        self._profile = [DIURNAL_BY_UTC_HOUR[(start_hour + h) % 24] for h in range(hours)]
        cum, acc = [], 0.0
        for w in self._profile:
            acc += w
            cum.append(acc)
        self._cum = [c / acc for c in cum]
        self._times = random.Random(f"hicache-l3:{seed}:times")
        self._shapes = random.Random(f"hicache-l3:{seed}:shapes")
        self._started, self._x = 0, 0.0
        self._schedule_next_session()

    # --- accounts and content ------------------------------------------------------------------

    def _account(self, rng: random.Random) -> str:
        while True:
            name = f"org-{rng.getrandbits(32):08x}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.choices(self.ids, k=n))

    def _tenant(
        self,
        account: str,
        weight: float,
        layout: str,
        prefix: tuple[int, ...],
        documents: list[tuple[int, ...]],
        salt: str | None = None,
    ) -> Tenant:
        salt = salt or tenant_salt(self.seed, account)
        return Tenant(account, salt, salt_seed(salt), weight, layout, prefix, documents)

    def _build_accounts(self, rng: random.Random) -> None:
        self._taken = {PROVIDER_ACCOUNT}
        self.system_prompt = self._tokens(SYSTEM_PROMPT_TOKENS)
        self.playground_prompt = self._tokens(PLAYGROUND_PROMPT_TOKENS)
        templates = [self._tokens(_length(rng, 300, 160, 700)) for _ in range(TEMPLATES)]
        public = [self._tokens(_length(rng, 700, 256, 2400)) for _ in range(PUBLIC_DOCUMENTS)]
        tenants = []
        for rank in range(1, TENANTS + 1):
            u = rng.random()
            layout = "provider" if u < 0.35 else "template" if u < 0.55 else "public" if u < 0.72 else "plain"
            prefix = (
                self.system_prompt if layout == "provider" else rng.choice(templates) if layout == "template" else ()
            )
            docs = (
                public
                if layout == "public"
                else [self._tokens(_length(rng, 500, 96, 1800)) for _ in range(rng.randint(1, 3))]
            )
            tenants.append(self._tenant(self._account(rng), rank**-ACCOUNT_ZIPF_EXPONENT, layout, prefix, docs))
        rng.shuffle(tenants)  # account names carry no rank
        candidates = [t for t in tenants if t.layout in ("plain", "template")]
        for t in rng.sample(candidates[3:], 3):  # autocomplete clients: their own code buffers
            t.layout = "autocomplete"
            self.accounts.autocomplete.append(t.account)
        ordinary = [t for t in tenants if t.layout != "autocomplete"]
        for t in rng.sample(ordinary, 3):
            t.retries = True
            self.accounts.retriers.append(t.account)
        plain = sorted((t for t in ordinary if t.layout == "plain" and not t.retries), key=lambda t: -t.weight)
        victim = plain[0]  # a busy tenant that sends one long document in every chat
        need = (PROBE_KNOWN_PAGES + PROBE_DEPTH + 2) * PAGE_SIZE
        victim.documents = [victim.documents[0] + self._tokens(max(0, need - len(victim.documents[0])))]
        self.victim_document = victim.documents[0]
        self.accounts.victims.append(victim.account)
        # public playground users share one namespace; some paste public documents
        users = [
            self._tenant(
                self._account(rng),
                (rank + 6) ** -ACCOUNT_ZIPF_EXPONENT,
                "playground",
                self.playground_prompt,
                public,
                salt=PLAYGROUND_SALT,
            )
            for rank in range(1, PLAYGROUND_USERS + 1)
        ]
        self.accounts.playground = sorted(u.account for u in users)
        self.tenants = tenants + users
        total = sum(t.weight for t in self.tenants)
        acc, cum = 0.0, []
        for t in self.tenants:
            acc += t.weight / total
            cum.append(acc)
        self._tenant_cum = cum
        self.harnesses = [
            self._tenant(self._account(rng), 0.0, "eval", self._tokens(EVAL_TEMPLATE_TOKENS), []) for _ in range(2)
        ]
        self.accounts.evaluators = [h.account for h in self.harnesses]
        self.pingers = [
            self._tenant(self._account(rng), 0.0, "ping", self._tokens(PING_PROMPT_TOKENS), []) for _ in range(2)
        ]
        self.accounts.pingers = [p.account for p in self.pingers]
        self.provider = self._tenant(PROVIDER_ACCOUNT, 0.0, "provider", self.system_prompt, [])
        self.prober = self._tenant(self._account(rng), 0.0, "probe", (), [])
        self.accounts.probers = [self.prober.account]

    # --- the heap --------------------------------------------------------------------------------

    def push(self, request: Request | None, source: Iterator[Request] | None = None) -> None:
        if request is None:
            return
        self._order += 1
        heapq.heappush(self._heap, (request.ts, self._order, request, source))

    def _advance(self, source: Iterator[Request]) -> None:
        nxt = next(source, None)
        if nxt is not None:
            self.push(nxt, source)

    def peek(self) -> float | None:
        """When the next request arrives (None: the traffic is over). Sessions due before it start, and a
        session's request past the budget ends it: the total is exact, sessions giving way to the fixed
        traffic and to what the prober may still send."""
        heap = self._heap
        while heap:
            ts, _, request, _ = heap[0]
            if request is None:
                heapq.heappop(heap)
                self._start_session(ts)
                continue
            if request.role not in _RESERVED and self.emitted + self.fixed_left + self.prober_left >= self.total:
                heapq.heappop(heap)
                continue
            return ts
        return None

    def pop(self) -> Request:
        """The request :meth:`peek` announced; call :meth:`served` once it has been served."""
        _, _, request, source = heapq.heappop(self._heap)
        assert request is not None
        if request.role == "probe":
            self.prober_left -= 1
        elif request.role in _RESERVED:
            self.fixed_left -= 1
        self.emitted += 1
        self._pending = source
        return request

    def served(self) -> None:
        """The request just popped was served: its session may go on (its buffer only grows after)."""
        if self._pending is not None:
            self._advance(self._pending)
            self._pending = None

    def prober_done(self) -> None:
        self.prober_left = 0

    # --- sessions --------------------------------------------------------------------------------

    def _plan(self, budget: int) -> int:
        """How many sessions fill *budget* requests (the shapes drawn again, identically, as they start)."""
        shapes = random.Random(f"hicache-l3:{self.seed}:shapes")
        n = total = 0
        while total < budget:
            total += self._shape(shapes)[1]
            n += 1
        return n

    def _shape(self, rng: random.Random) -> tuple[Tenant, int, list[int]]:
        """A session's tenant, request count and per-step detail (retries per turn, or autocomplete steps)."""
        tenant = self.tenants[min(bisect_right(self._tenant_cum, rng.random()), len(self.tenants) - 1)]
        if tenant.layout == "autocomplete":
            steps = rng.randint(8, 40)
            return tenant, steps, [steps]
        turns = rng.choice((1, 1, 2, 2, 3, 4))
        retries = [rng.randint(1, 3) if tenant.retries and rng.random() < 0.2 else 0 for _ in range(turns)]
        return tenant, turns + sum(retries), retries

    def _schedule_next_session(self) -> None:
        if self._started >= self._sessions:
            return
        left = self._sessions - self._started
        u = self._times.random()
        self._x += (1.0 - self._x) * (1.0 - u ** (1.0 / left))  # the next order statistic of `left` uniforms
        hour = min(bisect_right(self._cum, self._x), self._hours - 1)
        lo = self._cum[hour - 1] if hour else 0.0
        frac = (self._x - lo) / max(1e-12, self._cum[hour] - lo)
        self._order += 1
        heapq.heappush(self._heap, (self._start + (hour + min(1.0, frac)) * 3600, self._order, None, None))

    def _start_session(self, ts: float) -> None:
        self._started += 1
        tenant, _, detail = self._shape(self._shapes)
        session = (
            self._autocomplete(tenant, ts, detail[0])
            if tenant.layout == "autocomplete"
            else self._chat(tenant, ts, detail)
        )
        self._advance(session)
        self._schedule_next_session()

    def _chat(self, t: Tenant, ts: float, retries: list[int]) -> Iterator[Request]:
        rng = self.rng
        document: tuple[int, ...] = ()
        if t.layout == "playground":
            document = rng.choice(t.documents) if rng.random() < 0.5 else ()
        elif t.layout == "public" and rng.random() < 0.15:
            document = self.playground_prompt  # a prompt copied from the public playground
        else:
            document = rng.choice(t.documents)
        context = array("I", t.prefix + document)
        chains = Chains(context, t.salt, t.seed)
        role = "playground" if t.layout == "playground" else "chat"
        for n_retries in retries:
            context.extend(self._tokens(_length(rng, 24, 4, 120)))
            prompt = len(context)
            for _ in range(n_retries):
                yield Request(ts, t.account, t.salt, context, prompt, 0, 1024, "retry", chains, timed_out=True)
                ts += 30.0 + rng.random() * 5
            answer = self._tokens(_length(rng, 120, 8, 600))
            context.extend(answer)
            yield Request(ts, t.account, t.salt, context, prompt, len(answer), 1024, role, chains)
            ts += 20.0 + rng.expovariate(1 / 90)

    def _autocomplete(self, t: Tenant, ts: float, steps: int) -> Iterator[Request]:
        rng = self.rng
        buffer = array("I", rng.choice(t.documents))
        chains = Chains(buffer, t.salt, t.seed)
        for _ in range(steps):
            buffer.extend(self._tokens(rng.randint(2, 10)))  # typed
            prompt = len(buffer)
            suggestion = self._tokens(rng.randint(2, 12))
            buffer.extend(suggestion)  # accepted: the buffer grows by it
            yield Request(ts, t.account, t.salt, buffer, prompt, len(suggestion), 16, "autocomplete", chains)
            ts += 0.4 + rng.random() * 2.5

    # --- the fixed traffic ---------------------------------------------------------------------

    def _warmups(self, at: list[tuple[float, str]]) -> Iterator[Request]:
        p = self.provider
        for ts, instance in at:
            tokens = array("I", p.prefix + self._tokens(6) + self._tokens(8))
            yield Request(
                ts,
                p.account,
                p.salt,
                tokens,
                len(tokens) - 8,
                8,
                8,
                "warmup",
                Chains(tokens, p.salt, p.seed),
                instance=instance,
            )

    def _evaluation(self, h: Tenant, ts: float, items: int) -> Iterator[Request]:
        rng = self.rng
        for _ in range(items):  # multiple choice: one template, an item, one token answered
            tokens = array("I", h.prefix + self._tokens(_length(rng, 70, 30, 200)) + self._tokens(1))
            yield Request(ts, h.account, h.salt, tokens, len(tokens) - 1, 1, 1, "eval", Chains(tokens, h.salt, h.seed))
            ts += 0.2 + rng.random() * 0.6

    def _pings(self, p: Tenant, start: float, hours: int, count: int) -> Iterator[Request]:
        tokens = array("I", p.prefix + self._tokens(1))
        chains = Chains(tokens, p.salt, p.seed)
        step = hours * 3600 / count
        ts = start + self.rng.random() * step
        for _ in range(count):
            yield Request(ts, p.account, p.salt, tokens, len(tokens) - 1, 1, 1, "ping", chains)
            ts += step * (0.9 + 0.2 * self.rng.random())


class Prober:
    """Reads the victim's document back one page at a time from ``cached_tokens`` (see the module)."""

    def __init__(self, traffic: Traffic, document: tuple[int, ...], window: tuple[float, float]) -> None:
        self.traffic, self.document = traffic, document
        self.tenant = traffic.prober
        rng = random.Random(f"hicache-l3:{traffic.seed}:probe")
        self.rng = rng
        self.start = window[0] + rng.random() * max(0.0, (window[1] - window[0]) / 3)
        self.known = PROBE_KNOWN_PAGES
        self.tail = tuple(rng.choices(traffic.ids, k=PROBE_TAIL_TOKENS))
        self.retries = 0
        self.depth = 0
        self._round: list[tuple[int, ...]] = []

    def _new_round(self) -> None:
        rng, doc = self.rng, self.document
        page = doc[self.known * PAGE_SIZE : (self.known + 1) * PAGE_SIZE]
        spots = sorted(rng.sample(range(PAGE_SIZE), PROBE_GUESSED_TOKENS))
        candidates = {page}
        while len(candidates) < PROBE_CANDIDATES:
            guess = list(page)
            for s in spots:
                guess[s] = rng.choice(self.traffic.ids)
            candidates.add(tuple(guess))
        self._round = sorted(candidates)  # tried in token-id order, as a list of guesses is

    def _request(self, ts: float) -> Request:
        candidate = self._round.pop(0)
        t = self.tenant
        tokens = array(
            "I", self.document[: self.known * PAGE_SIZE] + candidate + self.tail + (self.rng.choice(self.traffic.ids),)
        )
        return Request(
            ts,
            t.account,
            t.salt,
            tokens,
            len(tokens) - 1,
            1,
            1,
            "probe",
            Chains(tokens, t.salt, t.seed),
            observe=self.observe,
        )

    def first(self) -> Request:
        self._new_round()
        return self._request(self.start)

    def observe(self, request: Request, cached_tokens: int, done: float) -> None:
        """The response came back: a hit on the candidate page keeps it; otherwise the next candidate."""
        ts = done + 0.8 + self.rng.random() * 1.5
        if cached_tokens >= (self.known + 1) * PAGE_SIZE:
            self.known += 1
            self.depth += 1
            self.retries = 0
            if self.depth >= PROBE_DEPTH or (self.known + 1) * PAGE_SIZE > len(self.document):
                self.traffic.prober_done()
                return
            self._new_round()
        elif not self._round:
            if self.retries >= PROBE_ROUND_RETRIES:
                self.traffic.prober_done()
                return
            self.retries += 1
            self._new_round()
            ts += 600.0
        self.traffic.push(self._request(ts))
