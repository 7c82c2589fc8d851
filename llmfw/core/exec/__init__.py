"""Execution: the backend interface and the scheduler over backends."""
