"""The stages of an investigation: ingest, detect, scope and the conclusiveness gate."""
