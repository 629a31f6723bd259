"""Seeded simulator of a prefill/decode-disaggregated SGLang deployment leaking KV pages.

``simulate(Scenario(), Path("data/sample"))`` writes the bundled sample incident; every knob of
:class:`Scenario` can be overridden to generate unseen incidents for tests and benchmarks.
"""

from kvforensics.simulate.run import SimulationResult, simulate
from kvforensics.simulate.scenario import Scenario, load_scenario_file

__all__ = ["Scenario", "SimulationResult", "load_scenario_file", "simulate"]
