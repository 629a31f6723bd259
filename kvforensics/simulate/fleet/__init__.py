"""The simulated fleet: deployments, pods, what the engines served and which pages they read."""
