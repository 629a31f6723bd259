"""The files a simulated incident is made of: engine and gateway logs, content, KV events, small files."""
