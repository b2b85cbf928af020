"""Scheduler-side features of PDConnector (no I/O)."""
