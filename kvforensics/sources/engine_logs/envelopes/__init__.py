"""Engine logs inside collection envelopes: one reader per envelope, and the split per instance."""
