"""Engine logs (``kind = "engine_log"``): the parse contract, lines, clocks, envelopes, engines."""
