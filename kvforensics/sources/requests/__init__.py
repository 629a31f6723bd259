"""Gateway request logs (``kind = "requests"``): readers per format, mapping, typing, presets."""
