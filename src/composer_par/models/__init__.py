"""Small models for the demo, tests and benchmarks."""
