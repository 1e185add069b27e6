"""Developer tooling of a source checkout, not installed with `rft`: the benchmarks of `rft bench NAME`
(benchmarks/main.py names them), the fault harness of `rft chaos` (chaos.py) and what both use to drive whole
`rft run`s (runs.py). `rft bench` and `rft chaos` find this package beside the checkout's `rft/` (rft/cli);
`python -m benchmarks NAME [options]` from the repository root is the same as `rft bench NAME [options]`.
The processes a benchmark starts import it too: they run with the checkout on PYTHONPATH or as their directory."""
