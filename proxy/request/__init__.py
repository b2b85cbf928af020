"""One client request: its body, its attempts on P/D pairs, its rooms and how failures settle."""
