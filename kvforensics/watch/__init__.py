"""``kvforensics watch``: the sources of an incident file followed as they grow, the rules run on what is new,
alerts raised when the evidence supports them (``docs/architecture.md``, "Watch").

* :mod:`~kvforensics.watch.follow`      the files of a source followed as ``tail -F`` follows them;
* :mod:`~kvforensics.watch.state`       where reading each request file stands (table ``watch_files``);
* :mod:`~kvforensics.watch.intake`      increments of requests, KV events, content and changes loaded;
* :mod:`~kvforensics.watch.engine_logs` increments of engine logs parsed after their start-up's lines;
* :mod:`~kvforensics.watch.detection`   the rules on the new requests;
* :mod:`~kvforensics.watch.alerts`      ``alerts.jsonl``, stdout and the alert command;
* :mod:`~kvforensics.watch.session`     the poll loop, stopping and settling the folder;
* :mod:`~kvforensics.watch.replay`      an incident's evidence written out again as it grew (tests, benchmarks);
* :mod:`~kvforensics.watch.streaming`   the same rules as Spark Structured Streaming queries.
"""

from kvforensics.watch.session import StopSummary, Watch, WatchOptions

__all__ = ["StopSummary", "Watch", "WatchOptions"]
