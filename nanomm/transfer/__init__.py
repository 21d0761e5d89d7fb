"""What travels between the instances of a split engine, and how: visual tokens from an encoder service, a
request's KV from a prefill instance to a decode instance. Safetensors bodies over HTTP, checked on arrival.

Lesson: lessons/13-three-topologies.md.

- wire.py: tensors + a JSON header in one safetensors body, and the checks a receiver makes;
- remote_encoder.py: the engine's client of an encoder service (`LLM(encoder_url=...)`);
- kv_connector.py: the KV connector interface, and its HTTP implementation.

Nothing here imports the engine: the engine and the servers import this.
"""
