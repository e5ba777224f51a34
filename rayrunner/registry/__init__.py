"""The registry actor and what it decides: state, capacity, eviction, model apps on Serve."""
