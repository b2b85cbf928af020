"""The admin API: instances added, removed and drained at run time."""
