"""Where the detection rules and the scope SQL run: DuckDB (the evidence database) or Apache Spark.

``portable`` renders the one portable text of each rule and script for an engine; ``spark`` runs
it on Spark over the canonical tables and writes the results back to the evidence database.
"""

from kvforensics.engines.portable import ENGINES, EngineError, render

__all__ = ["ENGINES", "EngineError", "render"]
