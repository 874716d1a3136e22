"""``tandem plan``: predict data-parallel throughput at cluster scale from one profiled step.

``profile.py`` times one step's segments (or reads a saved profile); ``sim.py`` simulates training
iterations on W workers and S servers per communication mode; ``plan.py`` searches the modes and
knobs and reports; ``measure.py`` measures the machine constants; ``validate.py`` runs the real jobs.
"""

from __future__ import annotations
