"""Data plane: the per-rank KVTransferManager and the transfer backends it writes through.

- ``manager``: the facade the worker calls (add_sends, drop_rooms, add_recvs, take_finished, ...);
- ``prefill_side`` / ``decode_side``: P's rooms and pushes, D's loads (states in ``states``);
- ``channel``: ZMQ sockets and the listener; ``tasks``: the transfer threads;
- ``outbox``: finished requests for vLLM; ``stats``: counters;
- ``backend``: the TransferBackend protocol; ``registry``: backends by name; ``mooncake``: Mooncake.
"""
