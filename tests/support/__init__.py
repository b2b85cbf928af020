"""Helpers shared by the test suites, imported absolutely (``from tests.support.<module> import ...``).

No test module imports another test module or a ``conftest.py``; what two tests share lives here:

- ``loopback``: free loopback ports, polling.
- ``transfer_rig``, ``inproc_backend``, ``sim_device``: the transfer-manager rig and its fakes.
- ``router_rig``, ``fake_backend``, ``key_files``: the Router's child processes, fake P/D backends, keys.
- ``serving``: the end-to-end tests' prompts, OpenAI calls and KV checks.
"""
