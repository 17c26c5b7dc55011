"""The runtime: backends per device, realization of pending graphs, caches."""
