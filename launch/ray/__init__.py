"""Ray launcher for explorer fleets (see fleet.py)."""
