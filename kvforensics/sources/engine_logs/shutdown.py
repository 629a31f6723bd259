"""Lines with which an engine server says it stops: the end of a start-up's lifetime.

A start-up holds until the next start-up of its instance, until one of these lines, or until the end
of its log (see ``kvforensics/stages/instances.py`` for how the end of a log is read). Only lines that mean
the serving process goes away are listed; an error a server survives is not one of them.

Where each line comes from (the text the engines print):

* SGLang ``srt/managers/tokenizer_manager.py`` ``SignalHandler.sigterm_handler``:
  ``SIGTERM received. signum=... frame=.... Draining requests and shutting down...``
* SGLang ``srt/entrypoints/engine.py`` / ``tokenizer_manager.py`` SIGQUIT handlers, raised when a
  child process dies: ``Received sigquit from a child process. It usually means the child failed.``
  and, in later builds, ``SIGQUIT received. signum=..., frame=.... It usually means one child failed.``
* SGLang ``srt/managers/scheduler.py`` ``run_scheduler_process`` (and the tokenizer, detokenizer and
  data-parallel controller processes): ``Scheduler hit an exception: <traceback>``, after which the
  process tree is killed.
* vLLM ``vllm/entrypoints/launcher.py`` ``serve_http``: ``Shutting down FastAPI HTTP server.``
  (``[shutdown] API server: shutting down FastAPI HTTP server`` in recent builds), and its
  ``terminate_if_errored``: ``AsyncLLMEngine has failed, terminating server process``.
* vLLM ``vllm/v1/engine/core_client.py``: ``Engine core proc EngineCore_DP0 died unexpectedly,
  shutting down client.``
* uvicorn (both engines' HTTP servers), ``uvicorn/server.py`` and ``uvicorn/lifespan/on.py``:
  ``Shutting down``, ``Waiting for application shutdown.``, ``Application shutdown complete.``,
  ``Finished server process [PID]``, printed as ``INFO:     <message>``.
* Python: a traceback ending in a bare ``KeyboardInterrupt`` line (Ctrl-C / SIGINT).

References: https://github.com/sgl-project/sglang (python/sglang/srt/managers/tokenizer_manager.py,
python/sglang/srt/entrypoints/engine.py, python/sglang/srt/managers/scheduler.py),
https://github.com/vllm-project/vllm (vllm/entrypoints/launcher.py, vllm/v1/engine/core_client.py),
https://github.com/encode/uvicorn (uvicorn/server.py, uvicorn/lifespan/on.py).
"""

from __future__ import annotations

import re

from kvforensics.sources.engine_logs.lines import contains_any

SHUTDOWN_NEEDLES = (
    "SIGTERM received",
    "SIGQUIT received",
    "Received sigquit",
    "hit an exception",
    "hutting down",
    "shutdown",
    "Finished server process",
    "died unexpectedly",
    "terminating server process",
    "KeyboardInterrupt",
)

# Each pattern must match at the start of the message (after an optional level such as "INFO:     "):
# a request log line quoting a prompt that contains one of these texts must not end a start-up.
_LEVEL = re.compile(r"^(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL|FATAL):?\s+)?")
_SHUTDOWN_LINES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"SIGTERM received\b"), "SIGTERM received"),
    (re.compile(r"SIGQUIT received\b|Received sigquit from a child process\b"), "a child process failed (SIGQUIT)"),
    (
        re.compile(r"(?P<who>Scheduler|TokenizerManager|DetokenizerManager|DataParallelController) hit an exception\b"),
        "fatal exception",
    ),
    (
        re.compile(r"Shutting down FastAPI HTTP server\b|\[shutdown\] API server: shutting down FastAPI HTTP server"),
        "API server shutting down",
    ),
    (re.compile(r"AsyncLLMEngine has failed, terminating server process\b"), "engine failed, server terminated"),
    (re.compile(r"Engine core proc \S+ died unexpectedly\b"), "engine core died"),
    (
        re.compile(
            r"(?:Shutting down|Waiting for application shutdown\.|Application shutdown complete\."
            r"|Finished server process \[\d+\])\s*$"
        ),
        "HTTP server shutting down",
    ),
    (re.compile(r"KeyboardInterrupt\s*$"), "KeyboardInterrupt"),
)


def shutdown_reason(message: str) -> str | None:
    """What a log message says about the server stopping, or None if it says nothing of the kind.

    *message* is the line without its envelope (time stamp, rank, Docker / process prefixes).
    """
    if not contains_any(message, SHUTDOWN_NEEDLES):
        return None
    text = _LEVEL.sub("", message.strip(), count=1)
    for pattern, reason in _SHUTDOWN_LINES:
        m = pattern.match(text)
        if m is not None:
            who = m.groupdict().get("who")
            return f"{reason} ({who})" if who else reason
    return None
