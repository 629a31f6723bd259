"""The traffic of a prefix-cache incident: tenants, their documents and chats, and the special accounts.

Words stand for tokens: a seeded vocabulary maps each word to one token id, so a prompt's text and
its ``prompt_token_ids`` agree word for word. Every tenant has its own documents (a system prompt, a
manual) that its chats repeat, so a tenant mostly hits its own blocks; some tenants build on one
of a few public framework templates, some paste public documents (a licence, a paper) and ask about
them, and tenants of the provider's hosted assistant start with the
provider-wide system prompt, which the provider's own account stores first (warm-up requests every
hour on every instance). Special accounts: an evaluation harness (one template, many questions,
normal outputs), retrying clients (a request that timed out is sent again, identical) and, in the
``prefix-probe`` scenario, a prober reading another tenant's document back by TTFT.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from kvforensics.simulate.calibration import ACCOUNT_ZIPF_EXPONENT, DIURNAL_BY_UTC_HOUR

PROVIDER_ACCOUNT = "provider-warmup"
VOCABULARY_SIZE = 3000
FIRST_TOKEN_ID = 1000
SYSTEM_PROMPT_TOKENS = 64
TEMPLATES = 4
PUBLIC_DOCUMENTS = 40  # public texts (licences, papers, API references) tenants paste whole
PROBE_CANDIDATES = 8  # continuations tried per probed block
PROBE_KNOWN_BLOCKS = 3  # leading blocks of the victim's document the prober already knows
PROBE_DEPTH = 8  # blocks the prober tries to read back per victim
_SYLLABLES = (
    "ka",
    "ri",
    "to",
    "men",
    "sa",
    "lu",
    "dor",
    "vi",
    "ne",
    "pa",
    "zu",
    "gal",
    "mo",
    "the",
    "fin",
    "ro",
    "qua",
    "bel",
    "tis",
    "ur",
    "an",
    "ex",
    "ol",
    "shi",
    "ven",
    "dra",
    "co",
    "lim",
    "pe",
    "yo",
)


@dataclass(frozen=True)
class Vocabulary:
    """Pseudo-words and their token ids (a seeded permutation of ``FIRST_TOKEN_ID..``)."""

    words: tuple[str, ...]
    ids: tuple[int, ...]
    by_id: dict[int, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.by_id.update(zip(self.ids, self.words, strict=True))

    def text(self, tokens: list[int]) -> str:
        return " ".join(map(self.by_id.__getitem__, tokens))


def vocabulary(rng: random.Random) -> Vocabulary:
    words: set[str] = set()
    while len(words) < VOCABULARY_SIZE:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    ordered = sorted(words)
    ids = list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + VOCABULARY_SIZE))
    rng.shuffle(ids)
    return Vocabulary(tuple(ordered), tuple(ids))


@dataclass
class Tenant:
    account: str
    weight: float
    layout: str  # "provider" (hosted assistant), "template:<i>", "public" (pastes public texts) or "plain"
    documents: list[list[int]]
    retries: bool = False


@dataclass(frozen=True)
class Request:
    """One request as the client sent it, before serving decides hits, latency and status."""

    ts: datetime
    account: str
    tokens: tuple[int, ...]
    output: tuple[int, ...]
    role: str  # chat, warmup, eval, retry, probe
    instance: str | None = None  # set for warm-ups (one per instance)
    timed_out: bool = False  # the engine prefilled it but the gateway gave up (504)


@dataclass
class Workload:
    vocabulary: Vocabulary
    tenants: list[Tenant]
    requests: list[Request]
    system_prompt: tuple[int, ...]
    probers: list[str] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)
    evaluators: list[str] = field(default_factory=list)
    retriers: list[str] = field(default_factory=list)


def _tokens(rng: random.Random, vocab: Vocabulary, n: int) -> list[int]:
    return [rng.choice(vocab.ids) for _ in range(n)]


def _length(rng: random.Random, median: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(0.0, 0.6) * median)))


def _account(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = f"org-{rng.getrandbits(32):08x}"
        if name not in taken:
            taken.add(name)
            return name


def _arrival(rng: random.Random, start: datetime, hours: int) -> datetime:
    """A time in [start, start + hours), weighted by the hour-of-day profile of the calibration."""
    while True:
        offset = rng.random() * hours * 3600
        hour = (start + timedelta(seconds=offset)).hour
        if rng.random() * max(DIURNAL_BY_UTC_HOUR) <= DIURNAL_BY_UTC_HOUR[hour]:
            return start + timedelta(seconds=offset)


def build_workload(
    seed: int,
    requests: int,
    start: datetime,
    hours: int,
    instances: list[str],
    tenants: int,
    block_size: int,
    probe: bool,
) -> Workload:
    rng = random.Random(seed)
    vocab = vocabulary(rng)
    system_prompt = tuple(_tokens(rng, vocab, SYSTEM_PROMPT_TOKENS))
    templates = [_tokens(rng, vocab, _length(rng, 80, 40, 160)) for _ in range(TEMPLATES)]
    public = [_tokens(rng, vocab, _length(rng, 120, 48, 400)) for _ in range(PUBLIC_DOCUMENTS)]
    taken: set[str] = {PROVIDER_ACCOUNT}
    people = []
    for rank in range(1, tenants + 1):
        u = rng.random()
        layout = (
            "provider"
            if u < 0.4
            else f"template:{rng.randrange(TEMPLATES)}"
            if u < 0.6
            else "public"
            if u < 0.75
            else "plain"
        )
        docs = (
            public
            if layout == "public"
            else [_tokens(rng, vocab, _length(rng, 80, 24, 320)) for _ in range(rng.randint(1, 3))]
        )
        people.append(Tenant(_account(rng, taken), rank**-ACCOUNT_ZIPF_EXPONENT, layout, docs))
    rng.shuffle(people)  # account names carry no rank
    w = Workload(vocab, people, [], system_prompt)
    w.retriers = [t.account for t in rng.sample(people, 3)]
    for t in people:
        t.retries = t.account in w.retriers
    evaluator = Tenant(_account(rng, taken), 0.0, "plain", [_tokens(rng, vocab, 140)])
    w.evaluators = [evaluator.account]
    if probe:
        w.probers = [_account(rng, taken)]
        plain = sorted(
            (t for t in people if t.layout == "plain" and t.account not in w.retriers), key=lambda t: -t.weight
        )
        w.victims = [t.account for t in plain[:2]]
        need = (PROBE_KNOWN_BLOCKS + PROBE_DEPTH + 1) * block_size
        for t in plain[:2]:  # one long document, used in every chat: warm in the cache
            t.documents = [t.documents[0] + _tokens(rng, vocab, max(0, need - len(t.documents[0])))]
    end_special = _special(rng, w, evaluator, start, hours, instances, block_size)
    total_weight = sum(t.weight for t in people)
    budget = max(0, requests - end_special)
    chats: list[Request] = []
    while len(chats) < budget:
        tenant = rng.choices(people, weights=[t.weight / total_weight for t in people])[0]
        chats.extend(_chat(rng, vocab, tenant, system_prompt, templates, _arrival(rng, start, hours)))
    w.requests.extend(chats[:budget])
    w.requests.sort(key=lambda r: (r.ts, r.account))
    return w


def _prefix(tenant: Tenant, system_prompt: tuple[int, ...], templates: list[list[int]]) -> list[int]:
    if tenant.layout == "provider":
        return list(system_prompt)
    if tenant.layout.startswith("template:"):
        return list(templates[int(tenant.layout.split(":")[1])])
    return []


def _chat(
    rng: random.Random,
    vocab: Vocabulary,
    tenant: Tenant,
    system_prompt: tuple[int, ...],
    templates: list[list[int]],
    ts: datetime,
) -> list[Request]:
    """A conversation: each turn's prompt is the previous prompt, its answer and a new question."""
    context = _prefix(tenant, system_prompt, templates) + rng.choice(tenant.documents)
    out = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        context = context + _tokens(rng, vocab, _length(rng, 16, 4, 80))
        answer = tuple(_tokens(rng, vocab, _length(rng, 30, 5, 300)))
        if tenant.retries and rng.random() < 0.2:  # timed out after prefill, sent again identical
            for _ in range(rng.randint(1, 3)):
                out.append(Request(ts, tenant.account, tuple(context), (), "retry", timed_out=True))
                ts += timedelta(seconds=30 + rng.random() * 5)
        out.append(Request(ts, tenant.account, tuple(context), answer, "chat"))
        if len(context) + len(answer) > 2000:
            break
        context = context + list(answer)
        ts += timedelta(seconds=rng.expovariate(1 / 90))
    return out


def _special(
    rng: random.Random,
    w: Workload,
    evaluator: Tenant,
    start: datetime,
    hours: int,
    instances: list[str],
    block_size: int,
) -> int:
    """Warm-ups, the evaluation harness and the prober; returns how many requests they add."""
    vocab, before = w.vocabulary, len(w.requests)
    for hour in range(hours):
        for instance in instances:
            ts = start + timedelta(hours=hour, seconds=rng.random() * 60)
            w.requests.append(
                Request(
                    ts,
                    PROVIDER_ACCOUNT,
                    w.system_prompt + tuple(_tokens(rng, vocab, 6)),
                    tuple(_tokens(rng, vocab, 8)),
                    "warmup",
                    instance=instance,
                )
            )
    for _ in range(3):  # evaluation runs: one template, many questions, answers of normal length
        ts = _arrival(rng, start, hours)
        for _ in range(150):
            question = _tokens(rng, vocab, _length(rng, 30, 8, 90))
            w.requests.append(
                Request(
                    ts,
                    evaluator.account,
                    tuple(evaluator.documents[0] + question),
                    tuple(_tokens(rng, vocab, _length(rng, 80, 20, 300))),
                    "eval",
                )
            )
            ts += timedelta(seconds=0.5 + rng.random())
    if w.probers:
        victims = {t.account: t for t in w.tenants if t.account in w.victims}
        for victim in w.victims:
            _probe(
                rng,
                w,
                victims[victim].documents[0],
                _arrival(rng, start + timedelta(hours=hours // 4), hours // 2),
                block_size,
            )
    return len(w.requests) - before


def _probe(rng: random.Random, w: Workload, document: list[int], ts: datetime, block_size: int) -> None:
    """Read a document back block by block: the known prefix, then for each next block the candidates
    that differ in their last token (tried in vocabulary order), one word asked, one token answered;
    the candidate with a cache hit (a lower TTFT) is kept. Candidates are the real block plus decoys."""
    prober, vocab = w.probers[0], w.vocabulary
    known = document[: PROBE_KNOWN_BLOCKS * block_size]
    order = sorted(vocab.ids)
    for depth in range(PROBE_DEPTH):
        block = document[len(known) : len(known) + block_size]
        decoys = [t for t in order if t != block[-1]]
        first = rng.randrange(len(decoys) - PROBE_CANDIDATES)
        lasts = decoys[first : first + PROBE_CANDIDATES - 1]
        lasts.insert(rng.randrange(PROBE_CANDIDATES), block[-1])
        for last in sorted(lasts):
            candidate = known + block[:-1] + [last] + [order[depth]]
            w.requests.append(Request(ts, prober, tuple(candidate), (rng.choice(vocab.ids),), "probe"))
            ts += timedelta(seconds=1.5 + rng.random())
        known = known + block
