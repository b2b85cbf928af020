"""The test suites (a package, so every test module has one qualified name)."""
