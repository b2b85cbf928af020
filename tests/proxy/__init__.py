"""Router tests: real `python -m proxy` processes in front of fake backends."""
