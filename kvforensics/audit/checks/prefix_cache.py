"""Check 6: prefix-cache isolation between tenants (issue 15).

A prefix cache reuses one request's KV blocks for a later request with the same leading tokens. On a
multi-tenant deployment that is a cross-tenant channel unless every tenant's requests carry their own
salt (vLLM ``cache_salt``, SGLang ``cache_salt`` / ``extra_key``) set by someone the tenant cannot
override, the block keys do not collide, and every store the blocks reach keys them with the salt.
Each start-up is judged from its server args (log or ``/get_server_info`` dump) and the manifest's
``[prefix_cache]`` table (:mod:`kvforensics.config.tenancy`):

* **prefix caching on/off.** SGLang's radix cache is on unless ``--disable-radix-cache``
  (``disable_radix_cache``; SGLang server arguments,
  https://docs.sglang.ai/advanced_features/server_arguments.html). vLLM: ``--enable-prefix-caching`` /
  ``--no-enable-prefix-caching``; the V1 engine (the default from v0.8.0, the only engine from
  v0.11.0) turns it on by default, V0 off (https://docs.vllm.ai/en/v0.8.0/getting_started/v1_user_guide.html,
  v0.11.0 release notes). The engine config line gives the resolved value (read on over terminal-wrapped
  lines). Otherwise the engine config line's name of the engine that ran (``Initializing a V1 LLM
  engine``, ``vllm/v1/engine/core.py``; ``a V0 LLM engine``, ``vllm/engine/llm_engine.py``) gives the
  default in every version (V1 ran from v0.7 with ``VLLM_USE_V1=1``, V0 until v0.10 with
  ``VLLM_USE_V1=0``), else the version's default engine. When the flags do not say, a
  prefill batch line with ``#cached-token`` above 0 in the start-up's log (the parsers' flag
  ``prefix_cache_hit_line``, :mod:`kvforensics.sources.engine_logs.sglang.batches`) shows the cache serving tokens: on.
* **block-hash algorithm (vLLM).** ``--prefix-caching-hash-algo``. Before v0.7.2 the block hash was
  Python ``hash()`` seeded with ``hash(None)``, a constant from Python 3.12: collisions could be
  crafted (GHSA-rm76-4mrf-v9r8, CVE-2025-25183, fixed by vllm-project/vllm#12621). ``sha256`` exists
  from v0.8.3 (vllm-project/vllm#15297) and is the default from v0.10.2 (docs/design/prefix_caching.md,
  vllm-project/vllm#29261), which advises SHA-256 "in a multi-tenant setup"; ``builtin`` was the default
  before. ``xxhash`` / ``xxhash_cbor`` (vllm-project/vllm#29163) are not cryptographic: practical
  collisions are reported even with an unknown seed (vllm-project/vllm#54727). On a multi-tenant
  deployment ``builtin`` and ``xxhash*`` fail. SGLang's radix tree matches token ids, not hashes.
* **salts.** From the manifest: ``tenants = "single"`` passes; ``"multi"`` with ``cache_salt = "none"``
  fails (any tenant's prefix serves another tenant, and TTFT probing reads it back: arXiv 2409.20002,
  2411.18191); ``"client"`` fails (a tenant can send another tenant's salt); ``"gateway"`` needs an
  engine that honours it: vLLM from v0.9.0 (``cache_salt``, vllm-project/vllm#17045, CVE-2025-46570);
  SGLang's radix tree keys on ``extra_key`` / ``cache_salt`` (sgl-project/sglang#26747, #30827).
* **KV connectors reuse KV with the prefix cache off.** vLLM V1 asks a KV connector for the tokens it
  already holds whatever ``enable_prefix_caching`` says, and hashes the blocks for it
  (``vllm/v1/engine/core.py``: ``enable_prefix_caching or kv_connector is not None``): a start-up with its
  prefix cache off and a store connector (below) still reuses KV across requests, and is judged as one
  with it on. The connector is read from the KV-transfer config and from the lines with which the
  engine builds each connector (``Creating v1 connector with name: X and engine_id: Y``,
  ``vllm/distributed/kv_transfer/kv_connector/factory.py``), which the verdict cites.
* **external / L3 KV stores.** vLLM ``--kv-transfer-config`` with ``LMCacheConnectorV1`` (or
  ``--kv-offloading-backend lmcache``) keys LMCache entries by tokens only: the salt is dropped
  (LMCache/LMCache#2878; fixes #2880 / #3008 unmerged). ``LMCacheMPConnector`` carries the salt only
  with vllm-project/vllm#39837 and LMCache/LMCache#3029 (unknown: check both builds). vLLM's own
  ``OffloadingConnector`` stores by vLLM's salted block hashes. Prefill/decode connectors (NIXL,
  Mooncake, P2P NCCL) move one request's KV, they are not a shared store. SGLang ``--enable-lmcache``
  drops the salt (sgl-project/sglang#37160, LMCache/LMCache#4825). SGLang HiCache storage backends
  (``--enable-hierarchical-cache --hicache-storage-backend ...``) keyed pages by tokens only, as
  ``radix_cache.py`` states in 0.5.18 ("external L3/remote storage keys remain token-only",
  sgl-project/sglang#26747, #37160) until sgl-project/sglang#38577 (merged 2026-09-08, no release named
  here): fail up to 0.5.18, unknown after or when the version is not known. A gateway's salt reaches
  SGLang's radix key only in builds with ``extra_key`` (sgl-project/sglang#10317, after 0.5.1) and the
  salt forwarding that followed (the radix tree honours ``cache_salt`` in 0.5.18, #37160): fail before
  0.5.2, pass from 0.5.18, unknown between or when the version is not known. The manifest's
  ``kv_store_keys_salt`` (true / false) settles what the audit cannot see.

Missing evidence is never a pass: an unstated tenancy or salt owner is ``unknown``.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from kvforensics.audit.checks.common import ON, Judged, server_arg
from kvforensics.audit.checks.engine_version import exact_version, inferred_spec, spec_side
from kvforensics.audit.inputs import DeploymentManifest
from kvforensics.audit.phrases import loc
from kvforensics.audit.startups import Startup
from kvforensics.config.tenancy import Said

VLLM_V1_DEFAULT = Version("0.8.0")
VLLM_V0_REMOVED = Version("0.11.0")
VLLM_HASH_SEED_FIX = Version("0.7.2")
VLLM_SHA256 = Version("0.8.3")
VLLM_SHA256_DEFAULT = Version("0.10.2")
VLLM_CACHE_SALT = Version("0.9.0")
SGLANG_HICACHE_TOKEN_KEYS_BEFORE = Version("0.5.19")  # 0.5.18 states storage keys are token-only
SGLANG_EXTRA_KEY = Version("0.5.2")  # the first release that can have the radix key's extra_key (#10317)
SGLANG_SALT_SEEN = Version("0.5.18")  # the radix tree honours cache_salt (sgl-project/sglang#37160)
OFF_VALUES = ("false", "0", "no", "off")
WEAK_HASHES = ("builtin", "xxhash", "xxhash_cbor")
PD_CONNECTORS = ("nixl", "mooncakeconnector", "p2pnccl", "decodebench")

Finding = tuple[str, str, str | None, int | None]  # status, sentence, file, line


def _flag(s: Startup, name: str) -> tuple[str, str | None, int | None] | None:
    """A setting by exact name: (value, file, line), from the log or the server_info dump."""
    found = server_arg(s, lambda k: k == name)
    if found is None:
        return None
    _, value, file, line = found
    if file == s.file and name in s.evidence:
        line = s.evidence[name]
    return value, file, line


def _is_set(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("none", "null", "", "false", "0")


def _version(s: Startup) -> Version | None:
    exact = exact_version(s)
    if exact is not None or s.version is None:
        return exact
    try:
        return Version(s.version.strip().lstrip("v"))
    except InvalidVersion:
        return None


def caching(s: Startup) -> tuple[bool | None, str, str | None, int | None]:
    """Is KV reused across requests? (on, how we know, file, line); on is None when the evidence does not say."""
    on, how, file, line = _caching_flags(s)
    hit = s.flags.get("prefix_cache_hit_line", "")
    if on is None and hit.isdigit():
        return (
            True,
            "prefix cache on: a prefill batch line reports #cached-token > 0 (the server args do not say)",
            s.file,
            int(hit),
        )
    if on is False and _v1_engine(s) and (found := _store(s)) is not None:
        # vLLM asks a KV connector for the tokens it already holds whatever enable_prefix_caching says, and
        # hashes the blocks for it (vllm/v1/engine/core.py: "enable_prefix_caching or kv_connector is not None")
        store_name = found[1].split(":")[0]
        return (
            True,
            f"{how}, yet {store_name} stores KV and loads it into later requests: vLLM consults a KV connector "
            "whatever enable_prefix_caching says",
            found[2],
            found[3],
        )
    return on, how, file, line


def _v1_engine(s: Startup) -> bool:
    """A vLLM start-up that ran (or may have run) the V1 engine."""
    if s.engine != "vllm" or s.flags.get("engine_generation") == "V0":
        return False
    v = _version(s)
    return s.flags.get("engine_generation") == "V1" or v is None or v >= VLLM_V1_DEFAULT


def _caching_flags(s: Startup) -> tuple[bool | None, str, str | None, int | None]:
    if s.engine == "sglang":
        flag = _flag(s, "disable_radix_cache")
        if flag is not None:
            value, file, line = flag
            on = value.lower() not in ON
            return on, f"radix cache {'on' if on else 'off'} (disable_radix_cache={value})", file, line
        file, line = s.where("server_args")
        if "server_args" in s.evidence or s.server_info is not None:
            return True, "radix cache on (SGLang's default: disable_radix_cache is not set)", file, line
        return None, "no server_args line: whether the radix cache is on is not in the log", file, line
    flag = _flag(s, "enable_prefix_caching")
    if flag is not None and flag[0].lower() in (*ON, *OFF_VALUES):
        value, file, line = flag
        on = value.lower() in ON
        return on, f"prefix caching {'on' if on else 'off'} (enable_prefix_caching={value})", file, line
    v = _version(s)
    generation = s.flags.get("engine_generation")
    if generation in ("V0", "V1"):  # the engine that ran decides the default, in every version range
        file, line = s.where("engine_generation")
        on = generation == "V1"
        build = f"vLLM {v}" if v is not None else "vLLM"
        return (
            on,
            f"prefix caching {'on' if on else 'off'} ({build} ran the {generation} engine, 'Initializing a "
            f"{generation} LLM engine': its default)",
            file,
            line,
        )
    file, line = s.where("engine_version")
    if v is None:
        return None, "prefix caching not logged and the vLLM version unknown", file, line
    if v >= VLLM_V0_REMOVED:
        return True, f"prefix caching on (vLLM {v}: the V1 engine's default)", file, line
    if v < VLLM_V1_DEFAULT:
        return False, f"prefix caching off (vLLM {v}: the V0 engine's default)", file, line
    return (
        None,
        f"prefix caching not logged: vLLM {v} turns it on in V1 and off in V0, and the log does not say "
        "which engine ran",
        file,
        line,
    )


def hashing(s: Startup) -> Finding | None:
    """The block-hash algorithm on a multi-tenant deployment (vLLM); None when nothing to say (SGLang)."""
    if s.engine != "vllm":
        return None
    v = _version(s)
    flag = _flag(s, "prefix_caching_hash_algo")
    file, line = s.where("engine_version")
    if flag is not None and _is_set(flag[0]):
        algo, file, line = flag[0].strip().strip("'\"").lower(), flag[1], flag[2]
        how = f"prefix_caching_hash_algo={algo}"
    elif v is None:
        return "unknown", "the block-hash algorithm is not logged and the vLLM version is unknown", file, line
    else:
        algo = "sha256" if v >= VLLM_SHA256_DEFAULT else "builtin"
        how = f"{algo}, the default of vLLM {v} (not among the logged args)"
    if algo == "builtin" and v is not None and v < VLLM_HASH_SEED_FIX:
        return (
            "fail",
            f"block hash {how}: before vLLM {VLLM_HASH_SEED_FIX} it starts from hash(None), a constant on "
            "Python 3.12, so a tenant can craft colliding blocks (CVE-2025-25183); upgrade and use sha256",
            file,
            line,
        )
    if algo in WEAK_HASHES:
        remedy = (
            f"upgrade to vLLM >= {VLLM_SHA256_DEFAULT} (sha256 by default; {v} has no other algorithm)"
            if v is not None and v < VLLM_SHA256
            else "use --prefix-caching-hash-algo sha256 on a multi-tenant deployment"
        )
        return (
            "fail",
            f"block hash {how} is not cryptographic: a colliding block serves one tenant's KV to another; {remedy}",
            file,
            line,
        )
    if algo.startswith("sha256"):
        return "pass", f"block hash {how}", file, line
    return "unknown", f"block hash {how}: an algorithm this audit does not know", file, line


def sglang_side(s: Startup, bound: Version) -> str | None:
    """'below' / 'above' *bound* for the SGLang build of *s* (exact or inferred), 'both', None unknown."""
    exact = exact_version(s)
    if exact is not None:
        return "below" if exact < bound else "above"
    spec = inferred_spec(s)
    return spec_side(spec, bound) if spec is not None else None


def _sglang_build(s: Startup) -> str:
    exact = exact_version(s)
    if exact is not None:
        return f"SGLang {exact}"
    spec = inferred_spec(s)
    return f"SGLang {spec} (inferred from the log's format)" if spec else "SGLang (version not logged)"


def engine_honours_salt(s: Startup) -> Finding | None:
    """Does the engine put a gateway's salt into its block keys? None when it does (or nothing to add)."""
    if s.engine == "sglang":
        file, line = s.where("engine_version")
        build = _sglang_build(s)
        if sglang_side(s, SGLANG_EXTRA_KEY) == "below":
            return (
                "fail",
                f"{build} predates the radix key's extra_key (sgl-project/sglang#10317): the gateway's salt "
                "is ignored and every tenant shares one radix tree",
                file,
                line,
            )
        if sglang_side(s, SGLANG_SALT_SEEN) == "above":
            return None
        return (
            "unknown",
            f"{build}: the radix tree keys on the salt in builds with sgl-project/sglang#10317 and the salt "
            f"forwarding after it (seen in {SGLANG_SALT_SEEN}); confirm the build, e.g. with a "
            "/get_server_info dump",
            file,
            line,
        )
    v = _version(s)
    file, line = s.where("engine_version")
    if v is None:
        return "unknown", f"vLLM version unknown: cache_salt needs vLLM >= {VLLM_CACHE_SALT}", file, line
    if v < VLLM_CACHE_SALT:
        return (
            "fail",
            f"vLLM {v} predates cache_salt ({VLLM_CACHE_SALT}): the gateway's salt is ignored and every "
            "tenant shares one prefix cache",
            file,
            line,
        )
    return None


def store(s: Startup, said: Said | None) -> Finding | None:
    """An external / L3 KV store and whether its keys carry the salt; None when there is none."""
    found = _store(s)
    if found is None:
        return None
    status, sentence, file, line = found
    if said is not None and status != "pass":
        keyed = bool(said.value)
        return (
            "pass" if keyed else "fail",
            f"{sentence.split(':')[0]}: the manifest says its keys {'include' if keyed else 'drop'} the salt "
            f"({said.scope}, line {said.line})",
            file,
            line,
        )
    return found


def _built(s: Startup, name: str) -> str:
    """Where the engine's log says it built connector *name* ("Creating v1 connector with name: ..."), if it does."""
    created = [c.strip() for c in s.flags.get("kv_connectors_created", "").split(",")]
    if name not in created:
        return ""
    file, line = s.where("kv_connector_created")
    return f"; the engine built {name} ({loc(file, line)})"


def _store(s: Startup) -> Finding | None:
    if s.engine == "vllm":
        offload = _flag(s, "kv_offloading_backend")
        transfer = _flag(s, "kv_transfer_config")
        connector = s.flags.get("kv_connector") or ""
        created = s.flags.get("kv_connectors_created") or ""
        configured = f"{transfer[0] if transfer else ''} {connector}".lower()
        text = f"{configured} {created}".lower()
        file, line = (transfer[1], transfer[2]) if transfer else s.where("engine_version")
        if created and not any(c.strip().lower() in configured for c in created.split(",")):
            file, line = s.where("kv_connector_created")  # only the line that built it names the connector
        if offload is not None and offload[0].lower() == "lmcache":
            file, line = offload[1], offload[2]
            text += " lmcacheconnectorv1"
        if "lmcachempconnector" in text:
            return (
                "unknown",
                "LMCacheMPConnector: the salt reaches LMCache's keys only with vllm-project/vllm#39837 and "
                "LMCache/LMCache#3029; check both builds (or set kv_store_keys_salt in the manifest)"
                + _built(s, "LMCacheMPConnector"),
                file,
                line,
            )
        if "lmcache" in text:
            return (
                "fail",
                "LMCache store (LMCacheConnectorV1): its keys are the tokens only, cache_salt is dropped "
                "(LMCache/LMCache#2878), so a prefix stored under one tenant's salt is served to another"
                + _built(s, "LMCacheConnectorV1"),
                file,
                line,
            )
        if offload is not None and _is_set(offload[0]) or "offloadingconnector" in text:
            at = (offload[1], offload[2]) if offload is not None and _is_set(offload[0]) else (file, line)
            return "pass", "vLLM's own KV offloading: stored by vLLM's salted block hashes", *at
        named = connector or created.split(",")[0].strip()
        if named and not any(p in named.lower() for p in PD_CONNECTORS):
            return (
                "unknown",
                f"KV connector {named}: check whether its store keys include cache_salt" + _built(s, named),
                file,
                line,
            )
        return None
    lmcache = _flag(s, "enable_lmcache")
    if lmcache is not None and lmcache[0].lower() in ON:
        return (
            "fail",
            "LMCache store (--enable-lmcache): SGLang hands LMCache token-only keys, cache_salt is dropped "
            "(sgl-project/sglang#37160)",
            lmcache[1],
            lmcache[2],
        )
    hicache = _flag(s, "hicache_storage_backend")
    if hicache is None or not _is_set(hicache[0]):
        return None
    backend, file, line = hicache
    what = f"HiCache storage backend {backend}"
    if sglang_side(s, SGLANG_HICACHE_TOKEN_KEYS_BEFORE) == "below":
        return (
            "fail",
            f"{what}: {_sglang_build(s)} keys stored pages by tokens only, extra_key / cache_salt dropped "
            "(sgl-project/sglang#26747)",
            file,
            line,
        )
    return (
        "unknown",
        f"{what}: {_sglang_build(s)}; storage keys include the salt only in builds with "
        "sgl-project/sglang#38577 (check the build, or set kv_store_keys_salt in the manifest)",
        file,
        line,
    )


def _said(manifest: DeploymentManifest | None, s: Startup) -> dict[str, Said]:
    if manifest is None or manifest.prefix_cache is None:
        return {}
    return manifest.prefix_cache.for_startup(s.instance, (s.model, s.engine_model))


def _where(said: Said) -> str:
    return "" if said.scope == "prefix_cache" else f" (setting for {said.scope})"


def check_prefix_cache(s: Startup, manifest: DeploymentManifest | None) -> Judged:
    on, how, file, line = caching(s)
    if on is False:
        return "pass", f"{how}: no KV is reused across requests", file, line
    said = _said(manifest, s)
    mfile = manifest.file if manifest is not None else None
    tenants, salt = said.get("tenants"), said.get("cache_salt")
    if tenants is not None and tenants.value == "single":
        single = f"single-tenant deployment{_where(tenants)}: {how}, reuse stays within one customer"
        return "pass", single, mfile, tenants.line
    if on is None:
        return "unknown", how, file, line
    if manifest is None or manifest.prefix_cache is None:
        return (
            "unknown",
            f"{how}; no deployment manifest with a [prefix_cache] table: whether tenants share these "
            "engines and who sets cache_salt is unknown",
            file,
            line,
        )
    if tenants is None:
        return (
            "unknown",
            f"{how}; the manifest does not say whether several tenants share it (tenants)",
            file,
            line,
        )
    findings: list[Finding] = []
    if salt is None:
        findings.append(("unknown", "the manifest does not say who sets cache_salt", mfile, None))
    elif salt.value == "none":
        findings.append(
            (
                "fail",
                f"multi-tenant with no cache_salt{_where(salt)}: one tenant's prompt prefix is reused for "
                "another's request and can be read back by timing; have the gateway set a salt per tenant",
                mfile,
                salt.line,
            )
        )
    elif salt.value == "client":
        findings.append(
            (
                "fail",
                f"cache_salt comes from the client's request body{_where(salt)}: a tenant can send another "
                "tenant's salt; have the gateway overwrite it per tenant",
                mfile,
                salt.line,
            )
        )
    else:
        honoured = engine_honours_salt(s)
        if honoured is not None:
            findings.append(honoured)
        stored = store(s, said.get("kv_store_keys_salt"))
        if stored is not None:
            findings.append(stored)
    hashed = hashing(s)
    if hashed is not None:
        findings.append(hashed)
    for status in ("fail", "unknown"):
        picked = [f for f in findings if f[0] == status]
        if picked:
            sentence = "; ".join(f[1] for f in picked)
            return status, f"{how} ({loc(file, line)}); {sentence}", picked[0][2], picked[0][3]
    salted = f"cache_salt set per tenant by the gateway{_where(salt)}" if salt is not None else ""
    rest = "; ".join(f[1] for f in findings)
    return "pass", "; ".join(x for x in (how, salted, rest) if x), file, line


# --- the paths across tenants, one per failing (or undecided) part of check 6 -------------------------
# Each path is how KV could cross tenants while the start-up ran: the exposure windows of the
# prefix_reuse mechanism (kvforensics/audit/isolation.py). "local" paths cross tenants inside one
# instance's own cache; "shared_store" through a store several instances read (an L3 / LMCache store
# whose keys drop the salt); "collision" through block hashes that collide.
PATH_REACH = {
    "no_salt": "local",
    "client_salt": "local",
    "engine_ignores_salt": "local",
    "salt_blind_store": "shared_store",
    "weak_hash": "collision",
    "undetermined": "any",
}

IsolationPath = tuple[str, str, str, str | None, int | None]  # path, status (fail | unknown), sentence, file, line


def isolation_paths(s: Startup, manifest: DeploymentManifest | None) -> list[IsolationPath]:
    """Every way KV could cross tenants on start-up *s* (status ``fail``) or might (``unknown``), from
    the same evidence as :func:`check_prefix_cache`; empty when the start-up keeps tenants apart."""
    on, how, file, line = caching(s)
    if on is False:
        return []
    said = _said(manifest, s)
    tenants, salt = said.get("tenants"), said.get("cache_salt")
    if tenants is not None and tenants.value == "single":
        return []
    if on is None:
        return [("undetermined", "unknown", how, file, line)]
    if manifest is None or manifest.prefix_cache is None or tenants is None:
        return [
            (
                "undetermined",
                "unknown",
                f"{how}; whether several tenants share it is not stated ([prefix_cache] tenants)",
                file,
                line,
            )
        ]
    mfile = manifest.file
    paths: list[IsolationPath] = []
    if salt is None:
        paths.append(
            ("undetermined", "unknown", "who sets cache_salt is not stated ([prefix_cache] cache_salt)", mfile, None)
        )
    elif salt.value in ("none", "client"):
        if salt.value == "none":
            paths.append(("no_salt", "fail", f"multi-tenant with no cache_salt{_where(salt)}", mfile, salt.line))
        else:
            paths.append(
                ("client_salt", "fail", f"cache_salt from the client's request body{_where(salt)}", mfile, salt.line)
            )
        shared = _store(s)  # without a salt of the tenant's own, any store several instances read is shared
        if shared is not None:
            paths.append(
                (
                    "salt_blind_store",
                    "fail",
                    f"{shared[1].split(':')[0]} shared by the instances, and no salt of the tenant's own keys it",
                    shared[2],
                    shared[3],
                )
            )
    else:
        honoured = engine_honours_salt(s)
        if honoured is not None:
            paths.append(("engine_ignores_salt", *honoured))
        stored = store(s, said.get("kv_store_keys_salt"))
        if stored is not None and stored[0] != "pass":
            paths.append(("salt_blind_store", *stored))
    hashed = hashing(s)
    if hashed is not None and hashed[0] != "pass":
        paths.append(("weak_hash", *hashed))
    return paths
