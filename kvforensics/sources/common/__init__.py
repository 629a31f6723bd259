"""What every kind of source reads with: text streams, CSV and JSONL records, chain fingerprints."""
